"""The aiohttp server side that the simulated worker and the agent's proxy share."""

from __future__ import annotations

from aiohttp import web

from extproc.openai.errors import error_body
from llmworker.admission import Admission


async def listen(
    app: web.Application, host: str, port: int, shutdown_timeout: float
) -> tuple[web.AppRunner, int]:
    """Serve ``app`` on ``host:port`` (0 = any free); the runner and the bound port.

    A client that disconnects cancels its handler; on cleanup, in-flight requests get
    ``shutdown_timeout`` seconds.
    """
    runner = web.AppRunner(
        app, access_log=None, handler_cancellation=True, shutdown_timeout=shutdown_timeout
    )
    await runner.setup()
    try:
        await web.TCPSite(runner, host, port, reuse_address=True).start()
    except BaseException:
        await runner.cleanup()
        raise
    return runner, int(runner.addresses[0][1])


def json_error(status: int, message: str) -> web.Response:
    """A local error reply with the flat JSON error body."""
    return web.Response(
        status=status, body=error_body(message, status), content_type="application/json"
    )


def rejection_response(admission: Admission) -> web.Response:
    """The overload reply of worker-side admission."""
    rejection = admission.rejection()
    return web.Response(status=rejection.status, body=rejection.body, headers=rejection.headers)
