"""Deadline admission for requests with a gateway's endpoint subset (the Endpoint Picker
protocol), through the real Envoy wired as a Kubernetes gateway (envoy/envoy-epp.yaml, a Lua
filter writing the subset hint: tests/support/envoy_wirings.py).

Two simulated engines "a" and "b" serve model ``m``, one sequence at a time; a long
generation holds a's slot for about 2 s. With a TTFT target, a request whose subset names
only a is decided on a alone: rejected at once with the deadline reply when the wait does
not fit, though b is free; held for a and sent to a's address when it fits. A subset naming
both goes to the free one.
"""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import aiohttp
import pytest

from extproc.core.busy import TTFT_TARGET
from extproc.devstack import (
    Envoy,
    Extproc,
    SimProcess,
    checkout_file,
    cli_flags,
    free_port,
    http,
    metric_value,
    wait_until,
)
from tests.integration.test_latency_target import LONG, SHORT, Result
from tests.integration.test_latency_target import request as completion
from tests.support.envoy_wirings import gateway_subset_hint


@dataclass
class Gateway:
    ext: Extproc
    envoy: Envoy
    ports: dict[str, int]

    def address(self, name: str) -> str:
        return f"127.0.0.1:{self.ports[name]}"

    def deadline(self, name: str) -> dict[str, Any]:
        view: dict[str, Any] = self.ext.workers()[name]["deadline"]
        return view

    def metric(self, name: str, labels: dict[str, str] | None = None) -> float:
        return metric_value(self.ext.metrics(), name, labels) or 0.0


@contextlib.contextmanager
def gateway(tmp_path: Path) -> Iterator[Gateway]:
    ext = Extproc(tmp_path, ["--protocol", "epp", "--worker-ttl", "60"])
    sims: list[SimProcess] = []
    envoy = None
    try:
        ports = {}
        for name in ("a", "b"):
            port = free_port()
            flags = cli_flags(
                host="127.0.0.1", port=port, model="m", worker_id=name, max_num_seqs=1,
                publish=ext.event_endpoint, heartbeat=0.3, log_level="WARNING",
            )  # fmt: skip
            sims.append(SimProcess(flags, log_dir=tmp_path, name=f"sim-{name}"))
            ports[name] = port
        for sim, port in zip(sims, ports.values(), strict=True):
            wait_until(lambda s=sim, p=port: s.healthy(p), 20, "sim up")
        wait_until(lambda: {"a", "b"} <= set(ext.workers()), 10, "both announced")
        access_log = tmp_path / f"epp-deadline-{ext.grpc_port}.log"
        envoy = Envoy(
            tmp_path,
            ext,
            [],
            tweak=gateway_subset_hint(str(access_log)),
            source=checkout_file("envoy/envoy-epp.yaml"),
        )
        yield Gateway(ext, envoy, ports)
    finally:
        if envoy is not None:
            envoy.stop()
        for sim in sims:
            sim.stop()
        ext.stop()


async def request(
    session: aiohttp.ClientSession, gw: Gateway, body: dict[str, Any], *names: str
) -> Result:
    """``body`` with the subset hint naming the addresses of ``names``."""
    subset = ",".join(gw.address(n) for n in names)
    headers = {"x-test-subset": subset, "x-test-subset-kind": "string"}
    return await completion(session, gw.envoy.url, body, headers)


async def warm_up(session: aiohttp.ClientSession, gw: Gateway) -> None:
    """Two long requests on a, one after the other: its completion rate is measured."""
    for _ in range(2):
        assert (await request(session, gw, LONG, "a")).status == 200

    def measured() -> bool:
        view = gw.deadline("a")
        return view["completion_rate_per_s"] is not None and view["in_flight"] == 0

    await asyncio.to_thread(wait_until, measured, 10, "a's completions measured")


async def occupied(gw: Gateway) -> None:
    def busy() -> bool:
        return int(gw.deadline("a")["in_flight"]) >= 1

    await asyncio.to_thread(wait_until, busy, 10, "the long request in flight on a")


def set_target(gw: Gateway, ms: int) -> None:
    status, _, _ = http("POST", gw.ext.admin + "/busy_threshold", {"model": "m", TTFT_TARGET: ms})
    assert status == 200


async def long_on_a(
    session: aiohttp.ClientSession, gw: Gateway, target_ms: int
) -> asyncio.Future[Result]:
    """Warm up, set the model's target, and start a long generation on worker a; returns
    it once a holds it."""
    await warm_up(session, gw)
    set_target(gw, target_ms)
    long = asyncio.ensure_future(request(session, gw, LONG, "a"))
    await occupied(gw)
    return long


@pytest.fixture
def gw(tmp_path: Path) -> Iterator[Gateway]:
    with gateway(tmp_path) as g:
        yield g


async def test_a_subset_of_one_full_worker_is_refused_for_the_deadline_though_another_is_free(
    gw: Gateway,
) -> None:
    async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=30)) as session:
        long = await long_on_a(session, gw, 300)
        refused = await request(session, gw, SHORT, "a")
        assert refused.status == 529
        assert refused.done < 0.5  # at once, not after the ~2 s wait for a's slot
        assert refused.headers["x-shed-reason"] == "deadline"
        assert int(refused.headers["retry-after-ms"]) >= 1
        both = await request(session, gw, SHORT, "a", "b")
        assert both.status == 200 and both.done < 1.0  # b, free, within the subset
        assert (await long).status == 200
    assert gw.metric("extproc_decisions_total", {"outcome": "deadline"}) == 1
    assert gw.deadline("b")["in_flight"] == 0
    assert gw.metric("extproc_ttft_target_met_total", {"model": "m", "met": "true"}) >= 1


async def test_a_subset_request_that_fits_after_the_wait_is_held_for_its_worker_only(
    gw: Gateway,
) -> None:
    async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=30)) as session:
        long = await long_on_a(session, gw, 10_000)
        short = asyncio.ensure_future(request(session, gw, SHORT, "a"))

        def held() -> bool:
            return gw.metric("extproc_held_requests", {"model": "m"}) == 1

        await asyncio.to_thread(wait_until, held, 5, "the short request held")
        # b is free and idle all along: a held request of a's subset never goes there.
        assert gw.deadline("b")["in_flight"] == 0
        first, second = await asyncio.gather(long, short)
    assert (first.status, second.status) == (200, 200)
    assert second.first_byte > 1.0  # it waited for a's slot
    assert gw.metric("extproc_held_wait_seconds_count") == 1
    assert gw.metric("extproc_decisions_total", {"outcome": "deadline"}) == 0
