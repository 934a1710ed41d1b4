"""The service's background tasks survive a failing step: each failure is counted, the first
is logged with its traceback, and the task goes on running on its period."""

from __future__ import annotations

import asyncio
import logging
import socket
import urllib.request
from collections.abc import Callable
from typing import Any

import pytest
from prometheus_client.parser import text_string_to_metric_families

from extproc import service
from extproc.core.latency import LatencyControl
from extproc.core.pool import WorkerPool
from extproc.service import BACKGROUND_TASKS, LATENCY_CONTROLLER, SWEEPER
from extproc.settings import load_settings

FAILURES = 3  # the first calls of each step that raise


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
    def step(self: Any) -> Any:
        calls[task] += 1
        if calls[task] <= FAILURES:
            raise RuntimeError(f"injected failure {calls[task]} of {task}")
        return real(self)

    return step


async def _until(cond: Callable[[], bool], timeout: float, what: str) -> None:
    deadline = asyncio.get_running_loop().time() + timeout
    while not cond():
        if asyncio.get_running_loop().time() > deadline:
            raise AssertionError(f"timed out waiting for {what}")
        await asyncio.sleep(0.02)


async def test_each_background_task_counts_logs_once_and_keeps_running(
    monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    calls = dict.fromkeys(BACKGROUND_TASKS, 0)
    monkeypatch.setattr(WorkerPool, "expire", _failing_first(calls, SWEEPER, WorkerPool.expire))
    monkeypatch.setattr(
        LatencyControl, "tick", _failing_first(calls, LATENCY_CONTROLLER, LatencyControl.tick)
    )
    monkeypatch.setattr(service, "LATENCY_TICK_SECONDS", 0.05)
    admin_port = _free_port()
    settings = load_settings(
        [
            "--grpc-port", str(_free_port()),
            "--admin-port", str(admin_port),
            "--event-bind", f"tcp://127.0.0.1:{_free_port()}",
            "--startup-grace", "0",
            "--worker-ttl", "0.5",  # the sweeper runs every 0.05 s
        ],
        {},
    )  # fmt: skip
    admin = f"http://127.0.0.1:{admin_port}"
    stop = asyncio.Event()
    caplog.set_level(logging.ERROR, logger="extproc")
    served = asyncio.create_task(service.serve(settings, stop))
    try:
        # One series per task from the start (the tasks start last, once all is served).
        await _until(lambda: served.done() or any(calls.values()), 10, "the tasks to start")
        errors = await asyncio.to_thread(_errors, admin)
        assert set(errors) == set(BACKGROUND_TASKS), errors
        # Each task fails FAILURES times, then runs on: its step is called again after.
        await _until(
            lambda: all(n >= FAILURES + 3 for n in calls.values()) or served.done(),
            15,
            "every task to run past its failures",
        )
        assert not served.done()
        errors = await asyncio.to_thread(_errors, admin)
        assert errors == dict.fromkeys(BACKGROUND_TASKS, float(FAILURES)), errors
    finally:
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
