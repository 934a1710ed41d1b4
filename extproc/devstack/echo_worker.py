"""A minimal OpenAI-shaped HTTP worker for the tests and benchmarks.

``python -m extproc.devstack.echo_worker --port P --worker-id W``. Every reply names the
worker (header ``x-worker-id``) and echoes what it received, with ``received``: the host's
monotonic clock (``time.monotonic()``) when the request reached it, so a test on the same
host can tell the order in which requests arrived. Request headers steer it:
``x-test-status`` answers with that status (``x-test-overloaded: 1`` adds
``x-worker-overloaded: 1``; ``x-test-status-for: a,b`` limits that to the named workers),
``x-test-chunks`` and ``x-test-delay-ms`` shape an SSE stream, ``x-test-hang`` never answers.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import time

from aiohttp import web


def make_app(worker_id: str) -> web.Application:
    async def inference(request: web.Request) -> web.StreamResponse:
        received = time.monotonic()
        raw = await request.read()
        headers = {"x-worker-id": worker_id}
        info: dict[str, object] = {
            "worker_id": worker_id,
            "path": request.path,
            "destination": request.headers.get("x-gateway-destination-endpoint"),
            "body_len": len(raw),
            "received": received,
        }
        if request.headers.get("x-test-hang"):
            await asyncio.sleep(3600)
        status = request.headers.get("x-test-status")
        only = request.headers.get("x-test-status-for")
        if status and (only is None or worker_id in only.split(",")):
            if request.headers.get("x-test-overloaded") == "1":
                headers["x-worker-overloaded"] = "1"
            return web.json_response(info, status=int(status), headers=headers)
        try:
            body = json.loads(raw)
        except ValueError:
            body = {}
        chunks = int(request.headers.get("x-test-chunks", "3"))
        delay = int(request.headers.get("x-test-delay-ms", "0")) / 1000
        if isinstance(body, dict) and body.get("stream") is True:
            resp = web.StreamResponse(headers={**headers, "content-type": "text/event-stream"})
            await resp.prepare(request)
            for i in range(chunks):
                if delay:
                    await asyncio.sleep(delay)
                chunk = {"choices": [{"index": 0, "delta": {"content": f"tok{i} "}}], "i": i}
                await resp.write(f"data: {json.dumps(chunk)}\n\n".encode())
            await resp.write(b"data: [DONE]\n\n")
            await resp.write_eof()
            return resp
        if delay:
            await asyncio.sleep(delay)
        info["usage"] = {
            "prompt_tokens": 1,
            "completion_tokens": chunks,
            "total_tokens": 1 + chunks,
        }
        return web.json_response(info, headers=headers)

    async def other(request: web.Request) -> web.Response:
        return web.json_response(
            {
                "worker_id": worker_id,
                "path": request.path,
                "destination": request.headers.get("x-gateway-destination-endpoint"),
            },
            headers={"x-worker-id": worker_id},
        )

    app = web.Application(client_max_size=64 * 1024 * 1024)
    for path in ("/v1/chat/completions", "/v1/completions", "/v1/embeddings", "/v1/responses"):
        app.router.add_post(path, inference)
    app.router.add_route("*", "/{tail:.*}", other)
    return app


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--port", type=int, required=True)
    parser.add_argument("--worker-id", required=True)
    args = parser.parse_args()
    web.run_app(make_app(args.worker_id), host="127.0.0.1", port=args.port, print=None)


if __name__ == "__main__":
    main()
