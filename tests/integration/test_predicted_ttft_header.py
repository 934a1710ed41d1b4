"""The predicted TTFT sent with a request, through the real Envoy to a real HTTP worker.

With a TTFT target, deadline admission puts the TTFT it predicted for a request when it
admitted it in the upstream request's ``x-ttft-predicted-ms``: dispatched at once, its
worker's prediction; held for a slot, the prediction it was held on, its wait included.
Without a target the thresholds decide and no such header is sent.
The worker here is a small HTTP server in the test that records each request's headers,
announced to the extproc over ZMQ with one slot (its load reports say how many are busy).
"""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator
from dataclasses import dataclass, field
from pathlib import Path

import aiohttp
import pytest
from aiohttp import web

from extproc.core.busy import TTFT_TARGET
from extproc.core.deadline import ACTIVE, TOTAL, WAITING
from extproc.devstack import (
    ROOT,
    Envoy,
    Extproc,
    Publisher,
    free_port,
    http,
    metric_value,
    wait_until,
)
from extproc.handlers.processor import PREDICTED_TTFT_HEADER

BODY = {"model": "m", "prompt": "x" * 200, "max_tokens": 2, "stream": True}


@dataclass
class Recorder:
    """A worker that records the headers of each inference request it serves."""

    port: int
    seen: list[dict[str, str]] = field(default_factory=list)


async def _serve(recorder: Recorder, request: web.Request) -> web.StreamResponse:
    await request.read()
    recorder.seen.append({k.lower(): v for k, v in request.headers.items()})
    resp = web.StreamResponse(headers={"content-type": "text/event-stream"})
    await resp.prepare(request)
    for i in range(2):
        await asyncio.sleep(0.05)
        chunk = f'{{"choices":[{{"index":0,"text":"t{i}"}}]}}'
        await resp.write(f"data: {chunk}\n\n".encode())
    await resp.write(b"data: [DONE]\n\n")
    await resp.write_eof()
    return resp


@dataclass
class Stack:
    ext: Extproc
    envoy: Envoy
    pub: Publisher
    worker: Recorder

    def target(self, body: dict[str, object]) -> None:
        status, _, raw = http("POST", self.ext.admin + "/busy_threshold", body)
        assert status == 200, raw

    def load(self, active: int) -> None:
        self.pub.load("rec", **{WAITING: 0, ACTIVE: active, TOTAL: 1})


@pytest.fixture
async def stack(tmp_path: Path) -> AsyncIterator[Stack]:
    recorder = Recorder(free_port())
    app = web.Application()

    async def serve(request: web.Request) -> web.StreamResponse:
        return await _serve(recorder, request)

    app.router.add_post("/v1/completions", serve)
    runner = web.AppRunner(app)
    await runner.setup()
    await web.TCPSite(runner, "127.0.0.1", recorder.port).start()
    ext = await asyncio.to_thread(Extproc, tmp_path, ["--worker-ttl", "60"])
    envoy = pub = None
    try:
        source = ROOT / "envoy" / "envoy-track-output.yaml"
        envoy = await asyncio.to_thread(Envoy, tmp_path, ext, [recorder.port], source=source)
        pub = Publisher(ext.event_endpoint)
        endpoint = f"127.0.0.1:{recorder.port}"
        await asyncio.to_thread(pub.announce, ext, "rec", "m", endpoint)
        yield Stack(ext, envoy, pub, recorder)
    finally:
        if pub is not None:
            pub.close()
        if envoy is not None:
            await asyncio.to_thread(envoy.stop)
        await asyncio.to_thread(ext.stop)
        await runner.cleanup()


async def _send(session: aiohttp.ClientSession, stack: Stack) -> int:
    async with session.post(stack.envoy.url + "/v1/completions", json=BODY) as resp:
        await resp.read()
        return resp.status


def _predicted(headers: dict[str, str]) -> float:
    value = headers[PREDICTED_TTFT_HEADER]
    assert value.replace(".", "", 1).isdigit(), value  # ms, at most one decimal
    assert len(value.partition(".")[2]) <= 1, value
    return float(value)


async def test_the_prediction_reaches_the_worker_with_a_target_and_not_without(
    stack: Stack,
) -> None:
    timeout = aiohttp.ClientTimeout(total=30)
    async with aiohttp.ClientSession(timeout=timeout) as session:
        await asyncio.to_thread(stack.load, 0)
        # No target: the thresholds decide, nothing is predicted or sent.
        assert await _send(session, stack) == 200
        assert PREDICTED_TTFT_HEADER not in stack.worker.seen[-1]

        await asyncio.to_thread(stack.target, {"model": "m", TTFT_TARGET: 10_000})
        for _ in range(3):  # dispatched at once: the slot is free
            assert await _send(session, stack) == 200
            assert _predicted(stack.worker.seen[-1]) >= 0

        # Held: the worker reports its only slot busy; sent when it reports it free.
        view = await asyncio.to_thread(stack.ext.workers)
        assert view["rec"]["deadline"]["completion_rate_per_s"] is not None, view["rec"]
        await asyncio.to_thread(stack.load, 1)

        def full() -> bool:
            view = stack.ext.workers()["rec"]["deadline"]
            return view["slots"] == 1 and view["occupancy"] >= 1

        await asyncio.to_thread(wait_until, full, 10, "the slot reported busy")
        before = len(stack.worker.seen)
        held = asyncio.ensure_future(_send(session, stack))

        def is_held() -> bool:
            metrics = stack.ext.metrics()
            return metric_value(metrics, "extproc_held_requests", {"model": "m"}) == 1

        await asyncio.to_thread(wait_until, is_held, 10, "the request held")
        assert len(stack.worker.seen) == before  # not sent yet
        view = (await asyncio.to_thread(stack.ext.workers))["rec"]["deadline"]
        wait_ms = view["predicted_wait_ms"]
        assert wait_ms is not None and wait_ms > 0, view
        await asyncio.to_thread(stack.load, 0)
        assert await held == 200
        # The TTFT it was held on, its predicted wait included; at its release the slot
        # was free, and a prediction made then (its prefill alone) would be below the wait.
        assert _predicted(stack.worker.seen[-1]) >= wait_ms - 1.0, (stack.worker.seen[-1], view)

        # The target removed: back to the thresholds, no header.
        await asyncio.to_thread(stack.target, {"model": "m", "disable": [TTFT_TARGET]})
        assert await _send(session, stack) == 200
        assert PREDICTED_TTFT_HEADER not in stack.worker.seen[-1]
