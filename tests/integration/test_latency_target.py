"""A latency target through the real Envoy, the extproc and a simulated engine.

The engine runs one 2000-token prefill per step (about 60 ms), so with 16 clients a new
request waits behind the others' prefills: TTFT near a second. The prefill threshold
(64000 tokens: 32 such prompts at once) never fires for 16 clients, so the thresholds
alone reject nothing. A TTFT target of 1 ms cannot be met by any limit: the controller
walks the worker's limit down to the floor, where it holds, says "target unreachable"
with the measured p99, and rejections begin that the thresholds alone would not make.
Turning the target off restores the plain thresholds for the very next request.

TTFT is measured from the response body (the observer filter of envoy-track-output.yaml):
the engine sends its headers before its first token.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import time
from collections import Counter
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import aiohttp
import pytest

from extproc.core.busy import PREFILL, THRESHOLD_NAMES, TTFT_TARGET
from extproc.core.latency import FLOOR
from extproc.devstack import (
    ROOT,
    Envoy,
    Extproc,
    SimProcess,
    cli_flags,
    free_port,
    get_json,
    http,
    metric_value,
    wait_until,
)

CEILING = 64_000
CLIENTS = 16
PROMPT = "x" * 8000  # 2000 prompt tokens
BODY = {"model": "m", "prompt": PROMPT, "max_tokens": 4, "stream": True}
MAX_REQUESTS_PER_CLIENT = 2000


@dataclass
class Stack:
    ext: Extproc
    sim: SimProcess
    envoy: Envoy

    def worker(self) -> dict[str, Any]:
        return self.ext.workers()["sim"]

    def post(self, body: dict[str, Any]) -> tuple[int, Any]:
        status, _, raw = http("POST", self.ext.admin + "/busy_threshold", body)
        return status, json.loads(raw)


@pytest.fixture
def stack(tmp_path: Path) -> Iterator[Stack]:
    ext = Extproc(tmp_path, ["--active-prefill-tokens-threshold", str(CEILING),
                             "--worker-ttl", "60", "--log-level", "INFO"])  # fmt: skip
    port = free_port()
    sim = envoy = None
    try:
        sim = SimProcess(
            cli_flags(host="127.0.0.1", port=port, model="m", worker_id="sim",
                      publish=ext.event_endpoint, heartbeat=0.3, log_level="WARNING"),
            log_dir=tmp_path, name="sim",
        )  # fmt: skip
        wait_until(lambda: sim is not None and sim.healthy(port), 20, "sim up")
        wait_until(lambda: "sim" in ext.workers(), 10, "sim announced")
        envoy = Envoy(tmp_path, ext, [port], source=ROOT / "envoy" / "envoy-track-output.yaml")
        yield Stack(ext, sim, envoy)
    finally:
        if envoy is not None:
            envoy.stop()
        if sim is not None:
            sim.stop()
        ext.stop()


async def drive(url: str, seconds: float) -> Counter[int]:
    """CLIENTS closed-loop streaming clients for ``seconds``: statuses counted."""
    statuses: Counter[int] = Counter()
    deadline = time.monotonic() + seconds

    async def client(session: aiohttp.ClientSession) -> None:
        for _ in range(MAX_REQUESTS_PER_CLIENT):
            if time.monotonic() >= deadline:
                return
            async with session.post(url + "/v1/completions", json=BODY) as resp:
                await resp.read()
                statuses[resp.status] += 1
            if resp.status != 200:
                await asyncio.sleep(0.02)  # a rejected client backs off a little

    timeout = aiohttp.ClientTimeout(total=60)
    async with aiohttp.ClientSession(timeout=timeout) as session:
        await asyncio.gather(*(client(session) for _ in range(CLIENTS)))
    return statuses


def _control(stack: Stack) -> dict[str, Any]:
    return stack.worker().get("latency_control") or {}


async def test_a_target_sheds_what_the_thresholds_admit_and_off_restores_them(
    stack: Stack,
) -> None:
    url = stack.envoy.url
    plain = await drive(url, 3)
    assert plain[200] > CLIENTS and set(plain) == {200}, plain  # the thresholds alone admit all

    status, entry = await asyncio.to_thread(stack.post, {"model": "m", TTFT_TARGET: 1})
    assert (status, entry[TTFT_TARGET]) == (200, 1.0)

    load = asyncio.create_task(drive(url, 90))
    try:

        def at_floor() -> bool:
            control = _control(stack)
            return bool(control.get("target_unreachable")) and control["limit"] == FLOOR

        await asyncio.to_thread(wait_until, at_floor, 60, "the limit at the floor, unreachable")
        limits = []
        for _ in range(6):  # held, not oscillating
            await asyncio.sleep(0.5)
            control = await asyncio.to_thread(_control, stack)
            limits.append(control["limit"])
            assert control["target_unreachable"] is True, control
        assert limits == [FLOOR] * 6
        assert "target unreachable" in control["why"] and "p99" in control["why"]
        assert control["ttft_p99_ms"] > 1
        assert control["ttft_measured_at"].startswith("first generated tokens")
        limit = stack.worker()["ranks"][0]["busy_limits"][PREFILL]
        assert limit == int(CEILING * FLOOR)
        status_json = await asyncio.to_thread(get_json, stack.ext.admin + "/status.json")
        latency = status_json["models"][0]["latency"]
        assert latency["target_unreachable"] == ["sim"] and latency["ttft_p99_ms"] > 1
        text = await asyncio.to_thread(stack.ext.metrics)
        assert metric_value(text, "extproc_latency_limit", {"model": "m"}) == FLOOR
        assert (metric_value(text, "extproc_ttft_p99_seconds", {"model": "m"}) or 0) > 0.001
    finally:
        load.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await load

    shed = await drive(url, 3)
    assert shed[529] > 0 and shed[200] > 0, shed  # rejections the thresholds alone never made

    status, entry = await asyncio.to_thread(stack.post, {"model": "m", "disable": [TTFT_TARGET]})
    assert status == 200 and set(entry) == {"model", *THRESHOLD_NAMES}, entry
    worker = await asyncio.to_thread(stack.worker)  # at once: no controller tick needed
    assert worker["ranks"][0]["busy_limits"][PREFILL] == CEILING
    assert "latency_control" not in worker
    after = await drive(url, 3)
    assert set(after) == {200}, after
    log = stack.ext.proc.log()
    turns = [line for line in log.splitlines() if "latency limit of worker sim" in line]
    assert turns and len(turns) <= 3, turns  # one line per change of direction
