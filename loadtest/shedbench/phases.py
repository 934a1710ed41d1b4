"""Offered load in phases with retrying clients, one worker slowed down in the middle, and
what the stack said about itself meanwhile (the requests it held, its TTFT, the engines')."""

from __future__ import annotations

import asyncio
import contextlib
import random
import time
from collections.abc import Coroutine, Sequence
from dataclasses import dataclass, field
from typing import Any

import aiohttp

from loadtest.shedbench.arrivals import given_count, poisson
from loadtest.shedbench.classes import CLASS_HEADER, Request, RetryPolicy, attempts
from loadtest.shedbench.client import censor, request_body
from loadtest.shedbench.config import MODEL, Config
from loadtest.shedbench.stack import Stack
from loadtest.shedbench.workers import Buckets

BENCH_ID_HEADER = "x-bench-id"  # the logical request's number, for Envoy's access log
SAMPLE_EVERY = 0.5  # seconds between reads of /debug/workers and of the extproc's metrics
HELD_METRIC = "extproc_held_requests"  # requests held in the router, per model


@dataclass(frozen=True)
class Phase:
    load: float  # multiple of capacity
    seconds: float


@dataclass(frozen=True)
class PhasePlan:
    """The phases, and the worker slowed down ``slow_at`` seconds into phase ``slow_phase``
    (0-based) for ``slow_for`` seconds (0: no slowdown)."""

    phases: tuple[Phase, ...] = (Phase(1, 20), Phase(3, 30), Phase(10, 20), Phase(1, 20))
    slow_phase: int = 1
    slow_at: float = 10.0
    slow_for: float = 10.0
    slow_factor: float = 2.0
    slow_worker: int = 1  # index into the workers

    def starts(self) -> list[float]:
        """Each phase's start, seconds from the run's start."""
        out, at = [], 0.0
        for phase in self.phases:
            out.append(at)
            at += phase.seconds
        return out

    @property
    def seconds(self) -> float:
        return sum(p.seconds for p in self.phases)

    @property
    def slow_start(self) -> float:
        return self.starts()[self.slow_phase] + self.slow_at


@dataclass
class Sample:
    """One read of ``/debug/workers`` for one worker: what deadline admission shows of it
    (its ``deadline`` block: the predicted TTFT of a typical request, the slots it counts,
    the requests it has, and the engine's TTFT from the worker's load events, a running
    mean of histogram bucket upper bounds); None where the extproc does not show them."""

    at: float
    worker: str
    predicted_ttft_ms: float | None = None
    slots: float | None = None
    occupancy: float | None = None
    engine_ttft_ms: float | None = None


@dataclass
class HeldSample:
    """``extproc_held_requests`` of the benchmark's model at ``at``; None: the extproc
    does not report it."""

    at: float
    held: float | None


@dataclass
class HistogramRead:
    """The engines' TTFT histograms read at ``at``."""

    at: float
    buckets: dict[str, Buckets]


@dataclass
class PhasedRun:
    """What one mode's run sent and saw; times in seconds from its start."""

    requests: list[Request] = field(default_factory=list)
    samples: list[Sample] = field(default_factory=list)
    held: list[HeldSample] = field(default_factory=list)
    histograms: list[HistogramRead] = field(default_factory=list)
    slowed: tuple[float, float] = (0.0, 0.0)  # when the slowdown was set and lifted
    slow_worker: str = ""  # the id of the worker slowed down
    cutoff: float = 0.0
    # Per worker id: the requests its engine preempted during the run (engines that count).
    preempted: dict[str, int] = field(default_factory=dict)


async def run_phases(
    session: aiohttp.ClientSession,
    stack: Stack,
    cfg: Config,
    plan: PhasePlan,
    capacity: float,
    retry: RetryPolicy,
    tag: str = "",
    histogram_every: float = 5.0,
    mix: Sequence[tuple[str, float]] = (),
) -> PhasedRun:
    """Every phase's Poisson arrivals with the count its rate names (seeded per phase: the
    same in every mode; :func:`~loadtest.shedbench.arrivals.given_count`: a drawn count made
    the last 1x phase on the simulated workers 153 arrivals for an expected 135, 1.13x) of
    retrying clients, back to back on one clock; the slowdown; the samplers. Request ``n`` carries
    ``x-bench-id: <tag><n>`` (Envoy's access log names it) and, with a ``mix`` of
    (class, share), a class drawn from its own seeded stream (the arrivals and bodies stay
    those without classes). Bounded: each phase at most ``2 x rate x seconds + 10``
    requests of at most ``retry.max_attempts`` attempts, everything cancelled
    ``cfg.grace`` seconds after the last phase."""
    run = PhasedRun(slow_worker=stack.engines.ids[plan.slow_worker])
    # Read before the clock starts: the first arrivals are not delayed by the scrape.
    preempted_before = await stack.engines.preempted(session)
    total = plan.seconds
    t0 = time.monotonic() + 0.2
    last_retry = total + cfg.grace / 2
    jitter = random.Random(f"{cfg.seed}-jitter")
    draw = random.Random(f"{cfg.seed}-classes")
    names, weights = [n for n, _ in mix], [w for _, w in mix]

    def launcher(offset: float, rng: random.Random) -> Any:
        def launch(at: float, phase_t0: float) -> Coroutine[Any, Any, None]:
            cls = draw.choices(names, weights)[0] if mix else ""
            req = Request(cls=cls, arrival=offset + at)
            run.requests.append(req)
            headers = {BENCH_ID_HEADER: f"{tag}{len(run.requests) - 1}"}
            if cls:
                headers[CLASS_HEADER] = cls
            body = request_body(cfg, rng)
            return attempts(session, stack.url, body, req, t0, retry, jitter, last_retry, headers)

        return launch

    phases = []
    for i, (phase, start) in enumerate(zip(plan.phases, plan.starts(), strict=True)):
        rng = random.Random(f"{cfg.seed}-phase-{i}")
        grace = total - start - phase.seconds + cfg.grace
        launch = launcher(start, rng)
        rate = phase.load * capacity
        times = given_count(rate, phase.seconds, 0.0, rng)
        phases.append(poisson(rate, phase.seconds, grace, rng, launch, t0 + start, times))
    stop = asyncio.Event()
    samplers = [
        asyncio.create_task(_sample_debug(session, stack, t0, run, stop)),
        asyncio.create_task(_sample_held(session, stack, t0, run, stop)),
        asyncio.create_task(_sample_histograms(session, stack, t0, run, stop, histogram_every)),
    ]
    slowdown = asyncio.create_task(_slow_one(session, stack, plan, t0, run))
    try:
        cutoffs = await asyncio.gather(*phases)
    finally:
        stop.set()
        await asyncio.gather(*samplers, return_exceptions=True)
        if not slowdown.done():
            slowdown.cancel()
        await asyncio.gather(slowdown, return_exceptions=True)
        await stack.engines.slowdown(session, plan.slow_worker, 1.0)
    preempted_after = await stack.engines.preempted(session)
    run.preempted = {
        wid: int(after - preempted_before.get(wid, 0.0)) for wid, after in preempted_after.items()
    }
    # The phases' cut-offs are relative to their own starts.
    run.cutoff = max(c + s for c, s in zip(cutoffs, plan.starts(), strict=True))
    for req in run.requests:
        if req.attempts:
            censor(req.last, run.cutoff)
    return run


async def _slow_one(
    session: aiohttp.ClientSession, stack: Stack, plan: PhasePlan, t0: float, run: PhasedRun
) -> None:
    if plan.slow_for <= 0:
        return
    await asyncio.sleep(max(0.0, t0 + plan.slow_start - time.monotonic()))
    await stack.engines.slowdown(session, plan.slow_worker, plan.slow_factor)
    began = time.monotonic() - t0
    await asyncio.sleep(max(0.0, t0 + plan.slow_start + plan.slow_for - time.monotonic()))
    await stack.engines.slowdown(session, plan.slow_worker, 1.0)
    run.slowed = (began, time.monotonic() - t0)


async def _sample_debug(
    session: aiohttp.ClientSession, stack: Stack, t0: float, run: PhasedRun, stop: asyncio.Event
) -> None:
    """``/debug/workers`` every :data:`SAMPLE_EVERY` s: each worker's prediction."""
    url = stack.ext.admin + "/debug/workers"
    timeout = aiohttp.ClientTimeout(total=2)
    while not stop.is_set():
        try:
            async with session.get(url, timeout=timeout) as resp:
                view = await resp.json()
        except (aiohttp.ClientError, TimeoutError):
            view = {}
        at = time.monotonic() - t0
        for w in view.get("workers", []):
            deadline = w.get("deadline") or {}
            run.samples.append(
                Sample(
                    at,
                    w["worker_id"],
                    predicted_ttft_ms=deadline.get("predicted_ttft_ms"),
                    slots=deadline.get("slots"),
                    occupancy=deadline.get("occupancy"),
                    engine_ttft_ms=deadline.get("engine_ttft_ms"),
                )
            )
        await _wait(stop, SAMPLE_EVERY)


def held_requests(metrics: str, model: str = MODEL) -> float | None:
    """The value of ``extproc_held_requests{model="<model>"}`` in a metrics page, summed
    over its other labels: 0 when the metric is there without a series for the model (none
    held yet), None when the page does not have the metric at all."""
    total: float | None = 0.0 if f"# TYPE {HELD_METRIC} " in metrics else None
    label = f'model="{model}"'
    for line in metrics.splitlines():
        if not line.startswith(HELD_METRIC + "{") or label not in line:
            continue
        try:
            value = float(line.rsplit(" ", 1)[1])
        except (IndexError, ValueError):
            continue
        total = (total or 0.0) + value
    return total


async def _sample_held(
    session: aiohttp.ClientSession, stack: Stack, t0: float, run: PhasedRun, stop: asyncio.Event
) -> None:
    """The extproc's ``/metrics`` every :data:`SAMPLE_EVERY` s: the requests it holds."""
    url = stack.ext.admin + "/metrics"
    timeout = aiohttp.ClientTimeout(total=2)
    while not stop.is_set():
        try:
            async with session.get(url, timeout=timeout) as resp:
                held = held_requests(await resp.text())
        except (aiohttp.ClientError, TimeoutError):
            held = None
        run.held.append(HeldSample(time.monotonic() - t0, held))
        await _wait(stop, SAMPLE_EVERY)


async def _sample_histograms(
    session: aiohttp.ClientSession,
    stack: Stack,
    t0: float,
    run: PhasedRun,
    stop: asyncio.Event,
    every: float,
) -> None:
    """The engines' TTFT histograms at the start and every ``every`` seconds of the run."""
    next_at = 0.0
    while not stop.is_set():
        await _wait(stop, max(0.0, t0 + next_at - time.monotonic()))
        buckets = await stack.engines.ttft_buckets(session)
        run.histograms.append(HistogramRead(time.monotonic() - t0, buckets))
        next_at += every


async def _wait(stop: asyncio.Event, seconds: float) -> None:
    with contextlib.suppress(TimeoutError):
        await asyncio.wait_for(stop.wait(), seconds)
