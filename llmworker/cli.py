"""Command-line plumbing of ``python -m llmworker.sim`` and ``python -m llmworker.agent``.

The settings both programs share (worker-side admission, the event publisher's timing and
CURVE keys, the log level) as rows of one settings table (:mod:`llmworker.settings`), the
value checks of ZeroMQ and event endpoints, logging setup, and running a :class:`Service`
until SIGTERM or SIGINT.
"""

from __future__ import annotations

import asyncio
import logging
import signal
import sys
from collections.abc import Coroutine
from typing import Annotated, Any, ClassVar, NoReturn, Protocol

import zmq
from pydantic import AfterValidator, model_validator

from extproc.core.endpoint import parse_endpoint
from extproc.events.curve import CurveClient, CurveKeyError
from extproc.openai.errors import DEFAULT_OVERLOAD_STATUS, OVERLOAD_STATUS_ENV
from llmworker.admission import (
    ADMISSION_GROUP,
    DEFAULT_QUEUE_LIMIT,
    MIN_QUEUE_LIMIT,
    QUEUE_LIMIT_ENV,
    AdmissionSettings,
)
from llmworker.settings import LOG_LEVELS, LogLevel, Number, option

LOG_FORMAT = "%(asctime)s %(levelname)s %(name)s: %(message)s"
ADMISSION_ENV_HELP = (
    f"Queue size Q comes from {QUEUE_LIMIT_ENV} (default {DEFAULT_QUEUE_LIMIT}, "
    f">= {MIN_QUEUE_LIMIT}, read only when N is set); the rejection status from "
    f"{OVERLOAD_STATUS_ENV} (default {DEFAULT_OVERLOAD_STATUS})."
)

# ---------------------------------------------------------------------------
# value checks (a ValueError says what was expected; the error names the flag and value)


def _zmq_scheme(text: str, schemes: tuple[str, ...]) -> str:
    if not text.startswith(schemes):
        raise ValueError("expected a ZeroMQ endpoint like tcp://127.0.0.1:5557")
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
        raise ValueError(f"expected a ZeroMQ endpoint a PUB socket can connect to: {exc}") from None
    finally:
        probe.close(0)
    return text


def event_endpoint(text: str) -> str:
    """``HOST:PORT`` as config events carry it (IPv6 host in brackets)."""
    parse_endpoint(text)  # ValueError naming the value
    return text


ZmqEndpoint = Annotated[str, AfterValidator(zmq_endpoint)]
ConnectableZmqEndpoint = Annotated[str, AfterValidator(connectable_zmq_endpoint)]
EventEndpoint = Annotated[str, AfterValidator(event_endpoint)]


# ---------------------------------------------------------------------------
# the settings both programs share


class WorkerFlags(AdmissionSettings):
    """Worker-side admission, the event publisher's timing and keys, the log level."""

    GROUPS: ClassVar[dict[str, tuple[str, str | None]]] = {
        "admission": (ADMISSION_GROUP, ADMISSION_ENV_HELP),
        "events": ("load events", None),
        "logging": ("logging", None),
    }

    curve_secret_key: str | None = option(
        None,
        "--curve-secret-key",
        "events",
        "ZeroMQ CURVE: this publisher's secret key file (NAME.key_secret from python -m "
        "extproc.events.keys), when the extproc requires CURVE; with --curve-server-key",
        metavar="FILE",
        expected="a CURVE secret key file",
    )
    curve_server_key: str | None = option(
        None,
        "--curve-server-key",
        "events",
        "ZeroMQ CURVE: the extproc's public key file (its NAME.key)",
        metavar="FILE",
        expected="a CURVE public key file",
    )
    heartbeat: Number = option(
        2.0,
        "--heartbeat",
        "events",
        "seconds between config/load re-sends",
        metavar="SECONDS",
        expected="a finite number of seconds > 0",
        gt=0,
    )
    debounce_ms: Number = option(
        5.0,
        "--debounce-ms",
        "events",
        "load changes are coalesced and sent at most this often, in milliseconds",
        metavar="MS",
        expected="a finite number >= 0",
        ge=0,
    )
    log_level: LogLevel = option(
        "INFO",
        "--log-level",
        "logging",
        "log level",
        choices=LOG_LEVELS,
        expected=f"one of {', '.join(LOG_LEVELS)}",
    )

    @model_validator(mode="after")
    def _curve_keys(self) -> WorkerFlags:
        self.curve()
        return self

    def curve(self) -> CurveClient | None:
        """The publisher's CURVE keys, or None; ValueError naming both flags and the file."""
        secret, server = self.curve_secret_key, self.curve_server_key
        if secret is None and server is None:
            return None
        if secret is None or server is None:
            raise ValueError("--curve-secret-key and --curve-server-key go together")
        try:
            return CurveClient.from_files(secret, server)
        except CurveKeyError as exc:
            raise ValueError(f"--curve-secret-key/--curve-server-key: {exc}") from None


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
