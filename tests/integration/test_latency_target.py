"""Deadline admission through the real Envoy, the extproc and a simulated engine.

The engine runs one sequence at a time (``--max-num-seqs 1``) and a long generation holds
its slot for about 2 s, longer than Envoy's 1 s ext_proc message timeout, so a second
request must wait for that slot and a held one needs Envoy's timer extended. With a TTFT
target the router predicts that wait from what it measured (two long requests first):
a target the wait fits holds the request in the router until the slot frees, then sends
it; a target it does not fit is answered at once with the deadline reply. Removing the
target returns to the plain thresholds (none here: everything is admitted) at once.

TTFT is measured from the response body (the observer filter of envoy-track-output.yaml):
the engine sends its headers before its first token.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import aiohttp
import pytest

from extproc.core.busy import TTFT_TARGET
from extproc.core.deadline import ACTIVE, TOTAL, WAITING
from extproc.core.latency import GATEWAY_ONLY
from extproc.devstack import (
    ROOT,
    Envoy,
    Extproc,
    Publisher,
    SimProcess,
    cli_flags,
    free_port,
    http,
    metric_value,
    wait_until,
)

LONG = {"model": "m", "prompt": "x" * 400, "max_tokens": 100, "stream": True}  # ~2 s
SHORT = {"model": "m", "prompt": "x" * 400, "max_tokens": 2, "stream": True}


@dataclass
class Stack:
    ext: Extproc
    sim: SimProcess
    envoy: Envoy
    sim_port: int

    def post(self, body: dict[str, Any], via_envoy: bool = False) -> tuple[int, Any]:
        base = self.envoy.url if via_envoy else self.ext.admin
        status, _, raw = http("POST", base + "/busy_threshold", body)
        return status, json.loads(raw)

    def metric(self, name: str, labels: dict[str, str] | None = None) -> float:
        return metric_value(self.ext.metrics(), name, labels) or 0.0


@contextlib.contextmanager
def sim_stack(
    tmp_path: Path,
    publish: bool = True,
    ext_args: tuple[str, ...] = (),
    envoy_config: str = "envoy-track-output.yaml",
) -> Iterator[Stack]:
    """The extproc, one simulated engine ("sim", model "m", one slot) and Envoy with the
    output-observing filter chain (or ``envoy_config`` of envoy/); everything stopped on
    the way out. ``publish`` False: the engine publishes nothing (the test announces it)."""
    ext = Extproc(tmp_path, ["--worker-ttl", "60", "--log-level", "INFO", *ext_args])
    port = free_port()
    sim = envoy = None
    try:
        flags = cli_flags(
            host="127.0.0.1", port=port, model="m", worker_id="sim", max_num_seqs=1,
            publish=ext.event_endpoint if publish else None, heartbeat=0.3,
            log_level="WARNING",
        )  # fmt: skip
        sim = SimProcess(flags, log_dir=tmp_path, name="sim")
        wait_until(lambda: sim is not None and sim.healthy(port), 20, "sim up")
        if publish:
            wait_until(lambda: "sim" in ext.workers(), 10, "sim announced")
        envoy = Envoy(tmp_path, ext, [port], source=ROOT / "envoy" / envoy_config)
        yield Stack(ext, sim, envoy, port)
    finally:
        if envoy is not None:
            envoy.stop()
        if sim is not None:
            sim.stop()
        ext.stop()


@dataclass
class Result:
    status: int
    headers: dict[str, str]
    first_byte: float  # s after sending
    done: float


async def request(
    session: aiohttp.ClientSession,
    url: str,
    body: dict[str, Any],
    headers: dict[str, str] | None = None,
) -> Result:
    start = time.monotonic()
    async with session.post(url + "/v1/completions", json=body, headers=headers) as resp:
        first = None
        async for _ in resp.content.iter_any():
            if first is None:
                first = time.monotonic() - start
        return Result(
            resp.status,
            {k.lower(): v for k, v in resp.headers.items()},
            first if first is not None else time.monotonic() - start,
            time.monotonic() - start,
        )


def envoy_ext_proc_stats(envoy: Envoy) -> dict[str, int]:
    """Envoy's own counters of the inference route's ext_proc filter."""
    _, _, body = http("GET", f"http://127.0.0.1:{envoy.admin_port}/stats", timeout=10)
    prefix = "http.inference.ext_proc."
    out: dict[str, int] = {}
    for line in body.decode().splitlines():
        name, sep, value = line.partition(": ")
        if sep and name.startswith(prefix) and value.strip().isdigit():
            out[name[len(prefix) :]] = int(value)
    return out


async def warm_up(session: aiohttp.ClientSession, stack: Stack, n: int = 2) -> None:
    """``n`` long requests one after another: the router measures the worker's service
    time (and so its completion rate) and its prefill."""
    for _ in range(n):
        assert (await request(session, stack.envoy.url, LONG)).status == 200

    def measured() -> bool:
        view = stack.ext.workers()["sim"]["deadline"]
        return view["completion_rate_per_s"] is not None and view["in_flight"] == 0

    await asyncio.to_thread(wait_until, measured, 10, "the completions measured")


async def occupied(stack: Stack) -> None:
    """Until the router counts a request in flight on the worker (its only slot)."""

    def busy() -> bool:
        return int(stack.ext.workers()["sim"]["deadline"]["in_flight"]) >= 1

    await asyncio.to_thread(wait_until, busy, 10, "the long request in flight")


@pytest.fixture
def stack(tmp_path: Path) -> Iterator[Stack]:
    with sim_stack(tmp_path) as st:
        yield st


async def test_a_request_that_fits_after_a_wait_is_held_and_served_when_the_slot_frees(
    stack: Stack,
) -> None:
    url = stack.envoy.url
    async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=30)) as session:
        await warm_up(session, stack)
        assert stack.post({"model": "m", TTFT_TARGET: 10_000})[0] == 200
        long = asyncio.ensure_future(request(session, url, LONG))
        await occupied(stack)
        short = asyncio.ensure_future(request(session, url, SHORT))

        def held() -> bool:
            return stack.metric("extproc_held_requests", {"model": "m"}) == 1

        # Held in the router while the long one runs, not sent to wait in the engine.
        await asyncio.to_thread(wait_until, held, 5, "the short request held")
        view = stack.ext.workers()["sim"]["deadline"]
        assert view["held_requests"] == 1 and view["in_flight"] == 1
        first, second = await asyncio.gather(long, short)
    assert (first.status, second.status) == (200, 200)
    assert second.first_byte > 1.0  # it waited for the slot
    # The series stays, at 0, once the model has held a request.
    assert metric_value(stack.ext.metrics(), "extproc_held_requests", {"model": "m"}) == 0
    assert stack.metric("extproc_held_wait_seconds_count") == 1
    assert stack.metric("extproc_held_wait_seconds_sum") > 1.0
    # Held past Envoy's 1 s message timeout: the timer was extended, nothing failed open.
    envoy = envoy_ext_proc_stats(stack.envoy)
    assert envoy.get("message_timeouts", 0) == 0 and envoy.get("failure_mode_allowed", 0) == 0
    assert envoy.get("streams_started", 0) > 0, envoy
    assert stack.metric("extproc_decisions_total", {"outcome": "deadline"}) == 0
    met = stack.metric("extproc_ttft_target_met_total", {"model": "m", "met": "true"})
    assert met >= 2  # the held one met its 10 s too
    assert stack.metric("extproc_predicted_ttft_seconds_count", {"model": "m"}) >= 2


async def test_a_wait_past_the_target_is_answered_at_once_and_removing_the_target_admits(
    stack: Stack,
) -> None:
    url = stack.envoy.url
    async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=30)) as session:
        await warm_up(session, stack)
        assert stack.post({"model": "m", TTFT_TARGET: 300})[0] == 200
        long = asyncio.ensure_future(request(session, url, LONG))
        await occupied(stack)
        refused = await request(session, url, SHORT)
        assert refused.status == 529
        assert refused.done < 0.5  # at once, not after the ~2 s wait
        assert refused.headers["x-shed-reason"] == "deadline"
        assert 1 <= int(refused.headers["retry-after"]) <= 60
        assert int(refused.headers["retry-after-ms"]) >= 1
        assert "x-should-retry" not in refused.headers  # a client that numbers no attempt
        # The OpenAI SDK numbers its attempts: its retry, due after the ~2 s wait, could not
        # meet the 300 ms counted from this first attempt, and the reply says not to retry.
        sdk = await request(session, url, SHORT, {"x-stainless-retry-count": "0"})
        assert sdk.status == 529 and sdk.headers["x-shed-reason"] == "deadline"
        assert sdk.headers["x-should-retry"] == "false"
        assert stack.metric("extproc_decisions_total", {"outcome": "deadline"}) == 2
        labels = {"model": "m", "endpoint": "completions"}
        assert stack.metric("dynamo_frontend_model_rejection_total", labels) == 2
        assert (await long).status == 200
        # The slot free again: the same request fits the target.
        assert (await request(session, url, SHORT)).status == 200

        # Bad targets: 422 naming the field and the value, nothing changed.
        for bad in (0, -5, 600_001, "soon"):
            status, body = stack.post({"model": "m", TTFT_TARGET: bad}, via_envoy=True)
            assert status == 422 and TTFT_TARGET in body["error"], body
            assert str(bad) in body["error"], body

        # The target removed: the plain thresholds (none set) decide the very next request.
        long = asyncio.ensure_future(request(session, url, LONG))
        await occupied(stack)
        status, body = stack.post({"model": "m", "disable": [TTFT_TARGET]})
        assert status == 200 and TTFT_TARGET not in body
        admitted = await request(session, url, SHORT)
        assert admitted.status == 200  # it waits in the engine: nothing is rejected
        assert (await long).status == 200
    assert stack.metric("extproc_decisions_total", {"outcome": "deadline"}) == 2


async def test_a_worker_without_queue_fields_is_predicted_from_the_gateways_timings(
    tmp_path: Path,
) -> None:
    with sim_stack(tmp_path, publish=False) as stack:
        pub = Publisher(stack.ext.event_endpoint)
        try:
            pub.announce(stack.ext, "gw", "m", f"127.0.0.1:{stack.sim_port}")
            pub.load("gw", active_decode_blocks=0)  # no slots, no waiting count
            assert stack.post({"model": "m", TTFT_TARGET: 10_000})[0] == 200
            async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=30)) as s:
                for _ in range(3):  # no data yet: routable, as without a target
                    assert (await request(s, stack.envoy.url, SHORT)).status == 200
            view = stack.ext.workers()["gw"]["deadline"]
            assert view["from"] == GATEWAY_ONLY
            assert {WAITING, ACTIVE, TOTAL} <= set(view["missing"])
            assert view["completion_rate_per_s"] is None  # no slot count: no full worker yet
            assert view["gateway_delay_ms"] >= 0 and view["prefill_overhead_ms"] > 0
            assert 0 <= view["prefill_serial"] <= 1
        finally:
            pub.close()


CLASS_TARGETS = """
default: standard
classes:
  critical: {priority: 0, ttft_p99_target_ms: 10000}
  standard: {priority: 1}
  sheddable: {priority: 2, ttft_p99_target_ms: 300}
"""


async def test_a_class_target_is_the_deadline_of_that_classs_requests(tmp_path: Path) -> None:
    """The slot taken by a long request: a sheddable request (300 ms) cannot wait for it and
    is answered at once; a critical one (10 s) is held and served when it frees."""
    classes = tmp_path / "classes.yaml"
    classes.write_text(CLASS_TARGETS)
    with sim_stack(tmp_path, ext_args=("--classes-file", str(classes))) as stack:
        url = stack.envoy.url
        timeout = aiohttp.ClientTimeout(total=30)
        async with aiohttp.ClientSession(timeout=timeout) as session:
            await warm_up(session, stack)
            long = asyncio.ensure_future(request(session, url, LONG))
            await occupied(stack)
            shed = await request(session, url, SHORT, {"x-request-class": "sheddable"})
            assert shed.status == 529 and shed.done < 0.5  # at once, not after ~2 s
            assert shed.headers["x-shed-reason"] == "deadline"
            assert shed.headers["x-shed-class"] == "sheddable"
            critical = await request(session, url, SHORT, {"x-request-class": "critical"})
            assert (await long).status == 200
        assert critical.status == 200 and critical.first_byte > 1.0  # held for the slot
        assert stack.metric("extproc_held_wait_seconds_count") == 1


async def test_non_streamed_2xx_through_a_filter_that_sends_no_body_measure_the_rate(
    tmp_path: Path,
) -> None:
    """envoy/envoy.yaml sends the extproc the response headers only: a non-streamed 200's
    end is the end of its ext_proc stream. After three of them the worker's completions are
    measured (not listed as missing), each slot time about the request's own duration."""
    body = {**LONG, "stream": False}
    with sim_stack(tmp_path, envoy_config="envoy.yaml") as stack:
        async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=30)) as session:
            done = [await request(session, stack.envoy.url, body) for _ in range(3)]
        assert all(r.status == 200 for r in done), done

        def measured() -> bool:
            view = stack.ext.workers()["sim"]["deadline"]
            return view["in_flight"] == 0 and "completions" not in view["missing"]

        await asyncio.to_thread(wait_until, measured, 10, "the completions measured")
        view = stack.ext.workers()["sim"]["deadline"]
        assert view["completion_rate_per_s"] is not None
        shortest = min(r.done for r in done) * 1000
        assert 0.5 * shortest <= view["service_ms"] <= 1.5 * max(r.done for r in done) * 1000


async def test_at_debug_the_extproc_logs_why_a_request_was_refused_and_nothing_of_http2(
    tmp_path: Path,
) -> None:
    """``--log-level DEBUG``: the deadline reply's request is in the extproc's log with its
    target and the worker's prediction; the HTTP/2 libraries' header traces are not."""
    with sim_stack(tmp_path, ext_args=("--log-level", "DEBUG")) as stack:
        async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=30)) as session:
            await warm_up(session, stack)
            assert stack.post({"model": "m", TTFT_TARGET: 300})[0] == 200
            long = asyncio.ensure_future(request(session, stack.envoy.url, LONG))
            await occupied(stack)
            refused = await request(session, stack.envoy.url, SHORT, {"x-request-id": "why-1"})
            assert (await long).status == 200
        assert refused.status == 529 and refused.headers["x-shed-reason"] == "deadline"
        ms = refused.headers["retry-after-ms"]

        def logged() -> str | None:
            lines = [ln for ln in stack.ext.proc.log().splitlines() if "request_id=why-1" in ln]
            return lines[0] if lines else None

        await asyncio.to_thread(wait_until, lambda: logged() is not None, 5, "the line")
        line = logged()
        assert line is not None and " DEBUG extproc.handlers: deadline reject: " in line
        assert " model=m " in line and " target_ms=300.0 " in line
        assert f" retry_after_ms={ms} " in line and " | sim: ttft_ms=" in line
        assert " slot_free=no " in line
        log = stack.ext.proc.log()
        assert "hpack" not in log and " h2." not in log
