"""Endpoints announced by host name are looked up off the request path, with the real
resolver of the event loop, and their addresses reach the pool."""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Callable

import pytest

from extproc.core.busy import BusyThresholds
from extproc.core.pool import WorkerPool
from extproc.events.resolver import (
    REFRESH_SECONDS,
    EndpointResolver,
    as_endpoint,
    is_ip,
    split_endpoint,
)


class Clock:
    t = 0.0

    def __call__(self) -> float:
        return self.t


def test_endpoint_parts() -> None:
    assert split_endpoint("localhost:8000") == ("localhost", 8000)
    assert split_endpoint("[::1]:8000") == ("::1", 8000)
    assert split_endpoint("nohost") is None
    assert is_ip("10.0.0.1") and is_ip("::1") and not is_ip("localhost")
    assert as_endpoint("::1", 80) == "[::1]:80" and as_endpoint("10.0.0.1", 80) == "10.0.0.1:80"


async def _until(cond: Callable[[], object], what: str, timeout: float = 10.0) -> None:
    loop = asyncio.get_running_loop()
    deadline = loop.time() + timeout
    while not cond():
        assert loop.time() < deadline, f"timed out waiting for {what}"
        await asyncio.sleep(0.01)


async def test_localhost_resolves_to_its_loopback_address() -> None:
    pool = WorkerPool(BusyThresholds(0.5))
    resolver = EndpointResolver(pool)
    pool.announce("w", model="m", endpoint="localhost:8123")
    resolver.announced(pool.workers["w"])
    await _until(lambda: pool.workers["w"].addresses, "the lookup")
    assert "127.0.0.1:8123" in pool.workers["w"].addresses
    assert pool.worker_at("127.0.0.1:8123", "m") is pool.workers["w"]
    await resolver.close()


async def test_an_ip_endpoint_is_not_looked_up() -> None:
    pool = WorkerPool(BusyThresholds(0.5))
    asked: list[str] = []

    def lookup(host: str, port: int) -> asyncio.Future[list[str]]:
        asked.append(host)
        future: asyncio.Future[list[str]] = asyncio.get_running_loop().create_future()
        future.set_result([])
        return future

    resolver = EndpointResolver(pool, lookup)
    pool.announce("w", model="m", endpoint="10.0.0.1:8000")
    resolver.announced(pool.workers["w"])
    await asyncio.sleep(0)
    assert asked == []


async def test_one_lookup_per_name_until_the_answer_is_old() -> None:
    pool = WorkerPool(BusyThresholds(0.5))
    clock = Clock()
    asked: list[str] = []

    def lookup(host: str, port: int) -> asyncio.Future[list[str]]:
        asked.append(host)
        future: asyncio.Future[list[str]] = asyncio.get_running_loop().create_future()
        future.set_result([f"10.0.0.{len(asked)}"])
        return future

    resolver = EndpointResolver(pool, lookup, clock)
    pool.announce("w", model="m", endpoint="worker-w:8000")
    w = pool.workers["w"]
    for _ in range(3):  # heartbeats
        resolver.announced(w)
    await _until(lambda: w.addresses, "the first answer")
    resolver.announced(w)
    await asyncio.sleep(0)
    assert asked == ["worker-w"] and w.addresses == {"10.0.0.1:8000"}
    clock.t = REFRESH_SECONDS + 1
    resolver.announced(w)
    await _until(lambda: w.addresses == {"10.0.0.2:8000"}, "the refreshed answer")
    await resolver.close()


async def test_a_failed_lookup_is_logged_once_and_tried_again(
    caplog: pytest.LogCaptureFixture,
) -> None:
    pool = WorkerPool(BusyThresholds(0.5))
    asked: list[str] = []

    def lookup(host: str, port: int) -> asyncio.Future[list[str]]:
        asked.append(host)
        future: asyncio.Future[list[str]] = asyncio.get_running_loop().create_future()
        future.set_exception(OSError("Name or service not known"))
        return future

    resolver = EndpointResolver(pool, lookup)
    pool.announce("w", model="m", endpoint="nowhere.invalid:8000")
    w = pool.workers["w"]
    caplog.set_level(logging.WARNING, logger="extproc.events")
    for n in (1, 2, 3):
        resolver.announced(w)

        def done(n: int = n) -> bool:
            return len(asked) == n and not resolver._pending

        await _until(done, f"lookup {n}")
    warnings = [r for r in caplog.records if "cannot resolve" in r.getMessage()]
    assert len(warnings) == 1 and "nowhere.invalid:8000" in warnings[0].getMessage()
    assert w.addresses == frozenset()
    await resolver.close()
