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

from extproc.core.busy import DECODE, PREFILL, PREFILL_FRAC, THRESHOLD_NAMES, TTFT_TARGET
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
    sim_port: int

    def worker(self) -> dict[str, Any]:
        return self.ext.workers()["sim"]

    def post(self, body: dict[str, Any]) -> tuple[int, Any]:
        status, _, raw = http("POST", self.ext.admin + "/busy_threshold", body)
        return status, json.loads(raw)


@contextlib.contextmanager
def sim_stack(tmp_path: Path, ext_args: list[str], name: str = "sim") -> Iterator[Stack]:
    """The extproc with ``ext_args``, one simulated engine ("sim", model "m") and Envoy with
    the output-observing filter chain; everything stopped on the way out."""
    ext = Extproc(tmp_path, ["--worker-ttl", "60", "--log-level", "INFO", *ext_args])
    port = free_port()
    sim = envoy = None
    try:
        sim = SimProcess(
            cli_flags(host="127.0.0.1", port=port, model="m", worker_id="sim",
                      publish=ext.event_endpoint, heartbeat=0.3, log_level="WARNING"),
            log_dir=tmp_path, name=name,
        )  # fmt: skip
        wait_until(lambda: sim is not None and sim.healthy(port), 20, "sim up")
        wait_until(lambda: "sim" in ext.workers(), 10, "sim announced")
        envoy = Envoy(tmp_path, ext, [port], source=ROOT / "envoy" / "envoy-track-output.yaml")
        yield Stack(ext, sim, envoy, port)
    finally:
        if envoy is not None:
            envoy.stop()
        if sim is not None:
            sim.stop()
        ext.stop()


@pytest.fixture
def stack(tmp_path: Path) -> Iterator[Stack]:
    with sim_stack(tmp_path, ["--active-prefill-tokens-threshold", str(CEILING)]) as st:
        yield st


async def drive(url: str, seconds: float) -> Counter[int]:
    """CLIENTS closed-loop streaming clients for ``seconds``: statuses counted."""
    return (await drive_classes(url, seconds, {"": CLIENTS}))[""]


async def drive_classes(
    url: str, seconds: float, per_class: dict[str, int]
) -> dict[str, Counter[int]]:
    """Closed-loop streaming clients per class (``x-request-class``; "": none) for
    ``seconds``: statuses counted per class."""
    statuses: dict[str, Counter[int]] = {cls: Counter() for cls in per_class}
    deadline = time.monotonic() + seconds

    async def client(session: aiohttp.ClientSession, cls: str) -> None:
        headers = {"x-request-class": cls} if cls else {}
        for _ in range(MAX_REQUESTS_PER_CLIENT):
            if time.monotonic() >= deadline:
                return
            async with session.post(url + "/v1/completions", json=BODY, headers=headers) as resp:
                await resp.read()
                statuses[cls][resp.status] += 1
            if resp.status != 200:
                await asyncio.sleep(0.02)  # a rejected client backs off a little

    timeout = aiohttp.ClientTimeout(total=60)
    async with aiohttp.ClientSession(timeout=timeout) as session:
        await asyncio.gather(
            *(client(session, cls) for cls, n in per_class.items() for _ in range(n))
        )
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
        rank = stack.worker()["ranks"][0]
        assert rank["busy_limits"][PREFILL] == int(CEILING * FLOOR)
        assert rank["ceiling_limits"][PREFILL] == CEILING
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
    assert "latency_control" not in worker and "ceiling_limits" not in worker["ranks"][0]
    after = await drive(url, 3)
    assert set(after) == {200}, after
    log = stack.ext.proc.log()
    turns = [line for line in log.splitlines() if "latency limit of worker sim" in line]
    assert turns and len(turns) <= 3, turns  # one line per change of direction


async def test_the_simulated_engine_reports_its_ttft_and_can_drive_the_controller(
    tmp_path: Path,
) -> None:
    """With --ttft-source engine the controller reads what the engine reports in its load
    events (no Envoy, no body observed): a 1 ms target walks the limit to the floor."""
    ext = Extproc(tmp_path, ["--active-prefill-tokens-threshold", str(CEILING),
                             "--ttft-p99-target-ms", "1", "--ttft-source", "engine",
                             "--worker-ttl", "60"])  # fmt: skip
    port = free_port()
    sim = None
    try:
        sim = SimProcess(
            cli_flags(host="127.0.0.1", port=port, model="m", worker_id="sim",
                      publish=ext.event_endpoint, heartbeat=0.3, log_level="WARNING"),
            log_dir=tmp_path, name="sim-engine",
        )  # fmt: skip
        wait_until(lambda: sim is not None and sim.healthy(port), 20, "sim up")
        wait_until(lambda: "sim" in ext.workers(), 10, "sim announced")
        load = asyncio.create_task(drive(f"http://127.0.0.1:{port}", 60))
        try:

            def at_floor() -> bool:
                control = ext.workers()["sim"].get("latency_control") or {}
                return control.get("limit") == FLOOR and bool(control.get("target_unreachable"))

            await asyncio.to_thread(wait_until, at_floor, 45, "the limit at the floor")
            control = (await asyncio.to_thread(ext.workers))["sim"]["latency_control"]
            assert control["engine_ttft_p99_ms"] > 1
            assert control["ttft_p99_ms"] == control["engine_ttft_p99_ms"]  # what it reads
            text = await asyncio.to_thread(ext.metrics)
            assert (metric_value(text, "extproc_engine_ttft_p99_seconds", {"model": "m"}) or 0) > 0
            # Requests sent straight to the engine pass no gateway: nothing measured there.
            assert metric_value(text, "extproc_ttft_p99_seconds", {"model": "m"}) is None
        finally:
            load.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await load
    finally:
        if sim is not None:
            sim.stop()
        ext.stop()


async def drive_timed(url: str, seconds: float) -> list[tuple[float, int, float | None]]:
    """Like :func:`drive`, per request: start time, status, and the client's own TTFT (the
    first body chunk with generated text)."""
    out: list[tuple[float, int, float | None]] = []
    deadline = time.monotonic() + seconds

    async def client(session: aiohttp.ClientSession) -> None:
        for _ in range(MAX_REQUESTS_PER_CLIENT):
            if time.monotonic() >= deadline:
                return
            started = time.monotonic()
            first = None
            async with session.post(url + "/v1/completions", json=BODY) as resp:
                async for chunk in resp.content.iter_any():
                    if first is None and b'"text"' in chunk:
                        first = time.monotonic() - started
                out.append((started, resp.status, first))
            if resp.status != 200:
                await asyncio.sleep(0.02)

    async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=60)) as session:
        await asyncio.gather(*(client(session) for _ in range(CLIENTS)))
    return out


@pytest.mark.slow
async def test_a_reachable_target_is_held_for_the_clients(stack: Stack) -> None:
    """A 400 ms target against about a second of TTFT under the thresholds alone: once the
    controller has settled, the clients' own TTFT p99 is near the target, the excess is shed,
    and the limit did not hunt."""
    target_ms = 400
    status, _ = await asyncio.to_thread(stack.post, {"model": "m", TTFT_TARGET: target_ms})
    assert status == 200
    out = await drive_timed(stack.envoy.url, 35)
    start = min(o[0] for o in out)
    late = [o for o in out if o[0] >= start + 25]  # the last 10 s, after settling
    ttfts = sorted(o[2] for o in late if o[1] == 200 and o[2] is not None)
    assert len(ttfts) >= 50, len(ttfts)
    p99 = ttfts[max(0, -(-99 * len(ttfts) // 100) - 1)]
    assert p99 <= 1.3 * target_ms / 1000, f"client TTFT p99 {p99:.3f} s"
    assert any(o[1] == 529 for o in late)  # held by shedding the excess
    control = (await asyncio.to_thread(stack.worker))["latency_control"]
    assert control["target_unreachable"] is False and 0.1 < control["limit"] < 1.0, control
    turns = [line for line in stack.ext.proc.log().splitlines() if "latency limit of" in line]
    assert 1 <= len(turns) <= 3, turns  # settled, not hunting


async def test_a_target_alone_sheds_from_a_full_worker_and_counts_requests_still_waiting(
    tmp_path: Path,
) -> None:
    """No threshold configured: nothing is shed until a target is set; then the ceiling is
    a full worker (every KV block, one batch of prompt tokens) and the controller scales
    it. With the engine stalled (100x slower), no request gets its first token, yet the
    limit falls: the requests waiting past the target count. Taking the target away sheds
    nothing again, at once."""
    short = {"model": "m", "prompt": "x" * 160, "max_tokens": 4, "stream": True}
    slowdown = "/sim/slowdown"
    with sim_stack(tmp_path, [], name="sim-alone") as stack:
        sim_url = f"http://127.0.0.1:{stack.sim_port}"
        assert not any((stack.worker()["ranks"][0].get("busy_limits") or {}).values())
        status, _ = await asyncio.to_thread(stack.post, {"model": "m", TTFT_TARGET: 200})
        assert status == 200
        worker = stack.worker()
        rank = worker["ranks"][0]
        assert rank["busy_limits"][PREFILL_FRAC] == worker["max_num_batched_tokens"]
        assert rank["busy_limits"][DECODE] == rank["effective"]["kv_total_blocks"] > 0

        status, _, raw = await asyncio.to_thread(http, "POST", sim_url + slowdown, {"factor": 100})
        assert status == 200, raw
        clients = [asyncio.create_task(_one(stack.envoy.url, short)) for _ in range(32)]
        try:

            def cut() -> bool:
                return float(_control(stack).get("limit", 1.0)) < 1.0

            await asyncio.to_thread(wait_until, cut, 15, "the limit cut while requests wait")
            control = await asyncio.to_thread(_control, stack)
            assert control["ttft_p99_ms"] is None, control  # not one first token yet
            assert control["waiting_past_target"] >= 20, control
            assert str(control["why"]).startswith("lowering: p99"), control
            rank = (await asyncio.to_thread(stack.worker))["ranks"][0]
            assert rank["busy_limits"][PREFILL_FRAC] < rank["ceiling_limits"][PREFILL_FRAC]
        finally:
            for task in clients:
                task.cancel()
            await asyncio.gather(*clients, return_exceptions=True)
            await asyncio.to_thread(http, "POST", sim_url + slowdown, {"factor": 1})

        status, _ = await asyncio.to_thread(stack.post, {"model": "m", "disable": [TTFT_TARGET]})
        assert status == 200
        rank = (await asyncio.to_thread(stack.worker))["ranks"][0]  # at once
        assert not any((rank.get("busy_limits") or {}).values()), rank
        after = await drive(stack.envoy.url, 2)
        assert set(after) == {200}, after


async def _one(url: str, body: dict[str, Any]) -> int:
    """One streamed request, read to its end."""
    timeout = aiohttp.ClientTimeout(total=120)
    async with (
        aiohttp.ClientSession(timeout=timeout) as session,
        session.post(url + "/v1/completions", json=body) as resp,
    ):
        await resp.read()
        return resp.status


CLASS_TARGETS = """
default: standard
classes:
  critical: {priority: 0, share: 1.0}
  standard: {priority: 1, share: 1.0}
  sheddable: {priority: 2, share: 1.0, ttft_p99_target_ms: 1}
"""


async def test_a_class_target_sheds_that_class_and_never_a_higher_one(tmp_path: Path) -> None:
    """A target on the sheddable class only, from the classes file, beside a prefill
    threshold that never fires for these clients: its controller walks the sheddable
    requests' limit to the floor (1 ms is out of reach) and they are shed, while the critical
    requests on the same worker are all admitted. Taking the class's target away
    (POST /classes) sheds nothing again, at once."""
    classes = tmp_path / "classes.yaml"
    classes.write_text(CLASS_TARGETS)
    mix = {"sheddable": 12, "critical": 4}
    args = ["--classes-file", str(classes), "--active-prefill-tokens-threshold", str(CEILING)]
    with sim_stack(tmp_path, args, name="sim-classes") as stack:
        load = asyncio.create_task(drive_classes(stack.envoy.url, 90, mix))
        try:

            def at_floor() -> bool:
                shed = (_control(stack).get("classes") or {}).get("sheddable") or {}
                return shed.get("limit") == FLOOR and bool(shed.get("target_unreachable"))

            await asyncio.to_thread(wait_until, at_floor, 60, "sheddable's limit at the floor")
        finally:
            load.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await load
        held = await drive_classes(stack.envoy.url, 4, mix)
        assert held["sheddable"][529] > 0 and held["sheddable"][200] > 0, held
        assert set(held["critical"]) == {200}, held  # never shed for a lower class's target
        control = await asyncio.to_thread(_control, stack)
        assert control["limit"] == 1.0  # the model has no target of its own

        status, _, raw = await asyncio.to_thread(
            http,
            "POST",
            stack.ext.admin + "/classes",
            {"name": "sheddable", "ttft_p99_target_ms": None},
        )
        assert status == 200, raw
        after = await drive_classes(stack.envoy.url, 2, mix)
        assert set(after["sheddable"]) == {200} and set(after["critical"]) == {200}, after
