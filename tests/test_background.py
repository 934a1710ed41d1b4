"""The service's background tasks survive a failing step: each failure is counted, the first
is logged with its traceback, and the task goes on running on its period. Every task runs in
the real service (replica sharing, CURVE, the builtin HTTP/2 server with a connection open)
with a failure injected into its step."""

from __future__ import annotations

import asyncio
import logging
import socket
import urllib.request
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
from prometheus_client.parser import text_string_to_metric_families

from extproc import service
from extproc.admin import status
from extproc.admin.status import DecisionHistory
from extproc.background import (
    CURVE_REFUSALS,
    H2_KEEPALIVE,
    HELD_TIMER,
    REPLICA_PUBLISHER,
    STATUS_HISTORY,
    SWEEPER,
    Guard,
)
from extproc.core.pool import WorkerPool
from extproc.events.curve import CurveServer
from extproc.events.keys import main as keys_main
from extproc.events.publisher import EventPublisher
from extproc.events.replica import ReplicaPublisher
from extproc.events.schema import ConfigEvent
from extproc.handlers.held import HeldRequests
from extproc.service import BACKGROUND_TASKS
from extproc.settings import load_settings
from extproc.transport.h2.connection import H2Connection
from extproc.transport.h2server import GrpcServer

FAILURES = 3  # the first calls of each step that raise
HELD_MODEL = "held"  # the model whose held requests' deadline timer the test keeps armed


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def _errors(admin: str) -> dict[str, float]:
    with urllib.request.urlopen(admin + "/metrics", timeout=5) as resp:
        text = resp.read().decode()
    out: dict[str, float] = {}
    for family in text_string_to_metric_families(text):
        if family.name == "extproc_background_errors":
            for sample in family.samples:
                if sample.name.endswith("_total"):
                    out[sample.labels["task"]] = sample.value
    return out


def _failing_first(calls: dict[str, int], task: str, real: Callable[..., Any]) -> Any:
    def step(self: Any, *args: Any) -> Any:
        calls[task] += 1
        if calls[task] <= FAILURES:
            raise RuntimeError(f"injected failure {calls[task]} of {task}")
        return real(self, *args)

    return step


def _refused(admin: str) -> float:
    with urllib.request.urlopen(admin + "/metrics", timeout=5) as resp:
        text = resp.read().decode()
    return sum(
        s.value
        for family in text_string_to_metric_families(text)
        if family.name == "extproc_events_refused"
        for s in family.samples
        if s.name.endswith("_total")
    )


def _keys(tmp: Path) -> tuple[Path, Path]:
    """The extproc's CURVE secret key file and a directory admitting one other publisher."""
    for name in ("extproc", "admitted"):
        assert keys_main([str(tmp / "keys"), name]) == 0
    publishers = tmp / "publishers"
    publishers.mkdir()
    (publishers / "admitted.key").write_bytes((tmp / "keys" / "admitted.key").read_bytes())
    return tmp / "keys" / "extproc.key_secret", publishers


# A gRPC client's first bytes: the HTTP/2 preface and an empty SETTINGS frame.
H2_PREFACE = b"PRI * HTTP/2.0\r\n\r\nSM\r\n\r\n" + bytes([0, 0, 0, 4, 0, 0, 0, 0, 0])


async def _until(cond: Callable[[], bool], timeout: float, what: str) -> None:
    deadline = asyncio.get_running_loop().time() + timeout
    while not cond():
        if asyncio.get_running_loop().time() > deadline:
            raise AssertionError(f"timed out waiting for {what}")
        await asyncio.sleep(0.02)


async def test_each_background_task_counts_logs_once_and_keeps_running(
    monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture, tmp_path: Path
) -> None:
    calls = dict.fromkeys(BACKGROUND_TASKS, 0)
    steps: dict[str, tuple[Any, str]] = {
        SWEEPER: (WorkerPool, "expire"),
        REPLICA_PUBLISHER: (ReplicaPublisher, "_send_all"),
        CURVE_REFUSALS: (CurveServer, "_count_refusal"),
        STATUS_HISTORY: (DecisionHistory, "sample"),
        H2_KEEPALIVE: (H2Connection, "_keepalive_tick"),
        HELD_TIMER: (HeldRequests, "_due"),
    }
    assert set(steps) == set(BACKGROUND_TASKS)
    for task, (owner, name) in steps.items():
        monkeypatch.setattr(owner, name, _failing_first(calls, task, getattr(owner, name)))
    # The status history and the HTTP/2 keepalive check run every 0.05 s, not every 1 s / 5 s.
    monkeypatch.setattr(status, "SAMPLE_SECONDS", 0.05)
    server_init = GrpcServer.__init__

    def fast_keepalive(self: GrpcServer, *args: Any, **kwargs: Any) -> None:
        server_init(self, *args, **kwargs)
        self.keepalive_check = 0.05

    monkeypatch.setattr(GrpcServer, "__init__", fast_keepalive)
    held: list[HeldRequests] = []  # the service's held requests, once its handler is built
    held_init = HeldRequests.__init__

    def keep_held(self: HeldRequests, *args: Any, **kwargs: Any) -> None:
        held_init(self, *args, **kwargs)
        held.append(self)

    monkeypatch.setattr(HeldRequests, "__init__", keep_held)

    async def hold_one_after_another() -> None:
        """A request of HELD_MODEL held until 0.02 s on, whenever none is: the deadline timer
        fires for each. Its client is gone (no waiter), so at the deadline it is just dropped."""
        n = 0
        while True:
            if held and not held[0].admission.held.get(HELD_MODEL):
                now = held[0].pool.clock()
                n += 1
                held[0].admission.queue(HELD_MODEL).push(("gone", n), now + 0.02, now)
                held[0]._arm(HELD_MODEL)
            await asyncio.sleep(0.01)

    secret, publishers = _keys(tmp_path)
    admin_port, grpc_port = _free_port(), _free_port()
    events = f"tcp://127.0.0.1:{_free_port()}"
    settings = load_settings(
        [
            "--grpc-port", str(grpc_port),
            "--admin-port", str(admin_port),
            "--event-bind", events,
            "--startup-grace", "0",
            "--worker-ttl", "0.5",  # the sweeper runs every 0.05 s
            "--replica-publish", f"tcp://127.0.0.1:{_free_port()}",  # a peer yet to start
            "--replica-interval", "0.05",
            "--event-curve-secret-key", str(secret),
            "--event-curve-publishers", str(publishers),
        ],
        {},
    )  # fmt: skip
    admin = f"http://127.0.0.1:{admin_port}"
    stop = asyncio.Event()
    caplog.set_level(logging.ERROR, logger="extproc")
    served = asyncio.create_task(service.serve(settings, stop))
    holding = asyncio.create_task(hold_one_after_another())
    # Publishers without CURVE: each refused at least once, each refusal a monitor event.
    intruders = [
        EventPublisher(
            events,
            ConfigEvent(worker_id=f"intruder{i}", model="m", endpoint=f"127.0.0.1:{_free_port()}"),
        )
        for i in range(FAILURES + 3)
    ]
    envoy: socket.socket | None = None
    try:
        # One series per task, at 0, before any has failed.
        await _until(lambda: served.done() or calls[SWEEPER] > 0, 10, "the sweeper to start")
        assert not served.done()
        errors = await asyncio.to_thread(_errors, admin)
        assert set(errors) == set(BACKGROUND_TASKS), errors
        assert errors[CURVE_REFUSALS] == errors[H2_KEEPALIVE] == 0.0, errors
        # A connection for the keepalive check to watch, a publisher for CURVE to refuse.
        envoy = await asyncio.to_thread(socket.create_connection, ("127.0.0.1", grpc_port), 5)
        envoy.sendall(H2_PREFACE)
        for intruder in intruders:
            await intruder.start()
        # Each task fails FAILURES times, then runs on: its step is called again after.
        try:
            await _until(
                lambda: all(n >= FAILURES + 3 for n in calls.values()) or served.done(),
                15,
                "every task to run past its failures",
            )
        except AssertionError as exc:
            raise AssertionError(f"{exc}; steps run: {calls}") from None
        assert not served.done()
        errors = await asyncio.to_thread(_errors, admin)
        assert errors == dict.fromkeys(BACKGROUND_TASKS, float(FAILURES)), errors
        # The refusals after the failures were counted: the watch really went on.
        assert await asyncio.to_thread(_refused, admin) >= 3
    finally:
        holding.cancel()
        for intruder in intruders:
            await intruder.close()
        if envoy is not None:
            envoy.close()
        stop.set()
        assert await asyncio.wait_for(served, 10) == 0
    for task in BACKGROUND_TASKS:
        logged = [
            r
            for r in caplog.records
            if r.levelno == logging.ERROR and f"background task {task} failed" in r.getMessage()
        ]
        assert len(logged) == 1, [r.getMessage() for r in logged]
        assert logged[0].exc_info is not None
        assert f"injected failure 1 of {task}" in str(logged[0].exc_info[1])


def test_a_task_name_outside_the_documented_set_is_refused() -> None:
    """The ``task`` label takes only the documented values: a typo cannot add a series."""
    with pytest.raises(ValueError, match="'sweep' is not one of sweeper, "):
        Guard("sweep")
