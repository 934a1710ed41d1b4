"""Command-line plumbing of ``python -m llmworker.sim`` and ``python -m llmworker.agent``.

Flag types whose errors name the value and what was expected (bounds checked by
pydantic, as the settings of the extproc and of worker-side admission are), the help
formatter, the flags both programs share, logging setup, and running a
:class:`Service` until SIGTERM or SIGINT.
"""

from __future__ import annotations

import argparse
import asyncio
import logging
import signal
import sys
from collections.abc import Callable, Coroutine
from typing import Annotated, Any, NoReturn, Protocol

import zmq
from pydantic import Field, TypeAdapter, ValidationError

from extproc.core.endpoint import parse_endpoint
from extproc.events.curve import CurveClient, CurveKeyError
from extproc.openai.errors import DEFAULT_OVERLOAD_STATUS, OVERLOAD_STATUS_ENV
from llmworker.admission import DEFAULT_QUEUE_LIMIT, MIN_QUEUE_LIMIT, QUEUE_LIMIT_ENV

LOG_LEVELS = ("DEBUG", "INFO", "WARNING", "ERROR")
LOG_FORMAT = "%(asctime)s %(levelname)s %(name)s: %(message)s"
ADMISSION_ENV_HELP = (
    f"Queue size Q comes from {QUEUE_LIMIT_ENV} (default {DEFAULT_QUEUE_LIMIT}, "
    f">= {MIN_QUEUE_LIMIT}, read only when N is set); the rejection status from "
    f"{OVERLOAD_STATUS_ENV} (default {DEFAULT_OVERLOAD_STATUS})."
)

# ---------------------------------------------------------------------------
# flag types


def _flag_type(
    kind: type[int] | type[float], expected: str, unparsed: str | None = None, **bounds: Any
) -> Callable[[str], Any]:
    """An argparse type: Python's own ``kind(text)``, then pydantic ``bounds``.

    The error names the value and what was expected (``unparsed`` when the text is
    not a number at all); argparse prefixes the flag.
    """
    constrained: Any = Annotated[kind, Field(**bounds)]  # a type built at run time
    adapter: TypeAdapter[Any] = TypeAdapter(constrained)

    def parse(text: str) -> Any:
        try:
            value = kind(text)
        except ValueError:
            raise argparse.ArgumentTypeError(
                f"expected {unparsed or expected}, got {text!r}"
            ) from None
        try:
            return adapter.validate_python(value)
        except ValidationError:
            raise argparse.ArgumentTypeError(f"expected {expected}, got {text!r}") from None

    return parse


def _number(bound: str, unit: str = "", **bounds: Any) -> Callable[[str], Any]:
    what = f"number of {unit}" if unit else "number"
    return _flag_type(
        float, f"a finite {what} {bound}", f"a {what} {bound}", allow_inf_nan=False, **bounds
    )


positive_int = _flag_type(int, "an integer >= 1", ge=1)
"""An integer >= 1."""
non_negative_int = _flag_type(int, "an integer >= 0", ge=0)
"""An integer >= 0."""
positive_number = _number("> 0", gt=0)
"""A finite number > 0."""
non_negative_number = _number(">= 0", ge=0)
"""A finite number >= 0."""
positive_seconds = _number("> 0", "seconds", gt=0)
"""A finite number of seconds > 0."""
non_negative_seconds = _number(">= 0", "seconds", ge=0)
"""A finite number of seconds >= 0."""


def _zmq_scheme(text: str, schemes: tuple[str, ...]) -> str:
    if not text.startswith(schemes):
        raise argparse.ArgumentTypeError(
            f"expected a ZeroMQ endpoint like tcp://127.0.0.1:5557, got {text!r}"
        )
    return text


def zmq_endpoint(text: str) -> str:
    """A ZeroMQ endpoint: ``tcp://``, ``ipc://`` or ``inproc://`` (checked by scheme only)."""
    return _zmq_scheme(text, ("tcp://", "ipc://", "inproc://"))


def connectable_zmq_endpoint(text: str) -> str:
    """A ``tcp://`` or ``ipc://`` endpoint that a PUB socket accepts to connect to."""
    _zmq_scheme(text, ("tcp://", "ipc://"))
    probe: zmq.Socket[Any] = zmq.Context.instance().socket(zmq.PUB)
    try:
        probe.setsockopt(zmq.LINGER, 0)
        probe.connect(text)
    except zmq.ZMQError as exc:
        raise argparse.ArgumentTypeError(f"bad ZeroMQ endpoint {text!r}: {exc}") from None
    finally:
        probe.close(0)
    return text


def event_endpoint(text: str) -> str:
    """``HOST:PORT`` as config events carry it (IPv6 host in brackets)."""
    try:
        parse_endpoint(text)
    except ValueError as exc:
        raise argparse.ArgumentTypeError(str(exc)) from None
    return text


# ---------------------------------------------------------------------------
# parser pieces


class HelpFormatter(argparse.ArgumentDefaultsHelpFormatter):
    """Shows a default only when there is one worth showing."""

    def _get_help_string(self, action: argparse.Action) -> str:
        text = action.help or ""
        if action.default in (None, False, []) or "default" in text:
            return text
        return super()._get_help_string(action) or text


def add_log_level_flag(group: argparse._ActionsContainer) -> None:
    """``--log-level``, default INFO."""
    group.add_argument("--log-level", default="INFO", choices=LOG_LEVELS, help="log level")


def add_event_timing_flags(group: argparse._ActionsContainer) -> None:
    """``--heartbeat`` (seconds), ``--debounce-ms`` and the CURVE key files of the event
    publisher."""
    group.add_argument(
        "--curve-secret-key",
        metavar="FILE",
        help="ZeroMQ CURVE: this publisher's secret key file (NAME.key_secret from python -m "
        "extproc.events.keys), when the extproc requires CURVE; with --curve-server-key",
    )
    group.add_argument(
        "--curve-server-key",
        metavar="FILE",
        help="ZeroMQ CURVE: the extproc's public key file (its NAME.key)",
    )
    group.add_argument(
        "--heartbeat",
        type=positive_seconds,
        default=2.0,
        metavar="SECONDS",
        help="seconds between config/load re-sends",
    )
    group.add_argument(
        "--debounce-ms",
        type=non_negative_number,
        default=5.0,
        metavar="MS",
        help="load changes are coalesced and sent at most this often, in milliseconds",
    )


def curve_client(parser: argparse.ArgumentParser, args: argparse.Namespace) -> CurveClient | None:
    """The publisher's CURVE keys from ``--curve-secret-key``/``--curve-server-key``; a
    usage error (exit 2) naming the flag and the file when they are unusable."""
    secret, server = args.curve_secret_key, args.curve_server_key
    if secret is None and server is None:
        return None
    if secret is None or server is None:
        parser.error("--curve-secret-key and --curve-server-key go together")
    try:
        return CurveClient.from_files(secret, server)
    except CurveKeyError as exc:
        parser.error(f"--curve-secret-key/--curve-server-key: {exc}")


# ---------------------------------------------------------------------------
# running


class Service(Protocol):
    """Something started once and stopped once: the simulated worker, the agent."""

    async def start(self) -> None: ...

    async def stop(self) -> None: ...


async def serve_until_signal(
    service: Service,
    log: logging.Logger,
    name: str,
    *,
    start_errors: tuple[type[Exception], ...] = (OSError,),
    failed: asyncio.Event | None = None,
) -> int:
    """Start ``service``, run until SIGTERM/SIGINT (or ``failed``), stop it; the exit code.

    A start that raises one of ``start_errors`` is logged and exits 1, as does a set ``failed``.
    """
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(sig, stop.set)
    try:
        await service.start()
    except start_errors as exc:
        log.error("cannot start: %s", exc)
        await service.stop()
        return 1
    waits = [loop.create_task(stop.wait())]
    if failed is not None:
        waits.append(loop.create_task(failed.wait()))
    await asyncio.wait(waits, return_when=asyncio.FIRST_COMPLETED)
    for task in waits:
        task.cancel()
    log.info("stopping %s", name)
    await service.stop()
    return 1 if failed is not None and failed.is_set() else 0


def run(
    serve: Coroutine[Any, Any, int], log_level: str, warning: str | None, log: logging.Logger
) -> NoReturn:
    """Log to stderr at ``log_level``, log the startup ``warning``, run ``serve``, exit with it."""
    logging.basicConfig(level=log_level, format=LOG_FORMAT, stream=sys.stderr)
    if warning:
        log.warning("%s", warning)
    sys.exit(asyncio.run(serve))
