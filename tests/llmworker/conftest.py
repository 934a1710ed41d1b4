"""Fixtures for the worker tests: an in-process simulated worker and an HTTP client."""

from __future__ import annotations

from collections.abc import AsyncIterator

import aiohttp
import pytest

from llmworker.sim import SimWorker
from llmworker.sim_settings import parse_args
from tests.llmworker.support import StartSim


@pytest.fixture
async def start_sim(monkeypatch: pytest.MonkeyPatch) -> AsyncIterator[StartSim]:
    """Start SimWorkers from command-line flags (and env); all stopped at teardown."""
    workers: list[SimWorker] = []

    async def start(*flags: str, env: dict[str, str] | None = None) -> SimWorker:
        for name in ("DYN_ENGINE_REQUEST_LIMIT", "DYN_DYNAMO_REQUEST_QUEUE_LIMIT"):
            monkeypatch.delenv(name, raising=False)
        monkeypatch.delenv("DYN_HTTP_OVERLOAD_STATUS_CODE", raising=False)
        for name, value in (env or {}).items():
            monkeypatch.setenv(name, value)
        settings, _ = parse_args(["--port", "0", "--speedup", "100", *flags])
        worker = SimWorker(settings)
        workers.append(worker)
        await worker.start()
        return worker

    yield start
    for worker in workers:
        await worker.stop()


@pytest.fixture
async def http() -> AsyncIterator[aiohttp.ClientSession]:
    async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=30)) as session:
        yield session
