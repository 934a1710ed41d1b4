"""Recovery after overload: how soon after an overload phase ends are requests admitted again?

One round: open-loop Poisson arrivals at ``load`` x capacity for ``overload_seconds`` (busy
thresholds on), then, from the instant that phase ends (``T``), probes at a steady
``probe_rate`` for ``probe_seconds``: probe ``i`` is due at ``T + i / probe_rate``, and its
time is the one it was sent at. The overload's admitted streams keep running; nothing else
is sent. From the probes' answers:

- **first admitted**: the send time, after ``T``, of the first probe answered 200;
- **95 % admitted**: the send time, after ``T``, of the first probe ``i`` answered 200 such
  that of the ``window`` probes ``i .. i + window - 1`` at least 95 % were answered 200 (the
  window must fit inside the probe phase; none found: not recovered within it).

A round whose overload phase was not shedding in its last second had nothing to recover
from: the reports say "not left" for its times and leave it out of the medians and the goal.

The resolution is one probe interval. A probe is the workload's prompt with ``max_tokens``
4: it asks what an ordinary request would be told, and adds little load itself. Alongside,
the extproc's own view (``GET /debug/workers``) is sampled at the probe rate: what kept the
workers busy (reported KV blocks, the router's estimate, an overload mark) and for how long.
"""

from __future__ import annotations

import asyncio
import math
import random
import time
from collections import Counter
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

import aiohttp

from loadtest.shedbench.arrivals import open_loop
from loadtest.shedbench.client import Outcome, request_body, send
from loadtest.shedbench.config import Config
from loadtest.shedbench.results import log
from loadtest.shedbench.stack import Stack
from loadtest.shedbench.workers import EngineLoad, wait_idle

DECODE = "active_decode_blocks_threshold"

PROBE_MAX_TOKENS = 4
PROBE_TIMEOUT = 30.0  # seconds a probe may take after the probe phase, then it is cancelled
ADMIN_TIMEOUT = aiohttp.ClientTimeout(total=5)  # one GET /debug/workers


@dataclass(frozen=True)
class RecoveryPlan:
    """The recovery rounds: loads, rounds per load, phase lengths, probe rate and window."""

    loads: tuple[float, ...] = (3.0, 10.0)
    rounds: int = 3
    overload_seconds: float = 6.0
    probe_rate: float = 20.0
    probe_seconds: float = 5.0
    window: int = 20
    share: float = 0.95

    @property
    def probes(self) -> int:
        return max(1, round(self.probe_rate * self.probe_seconds))


@dataclass(frozen=True)
class Probe:
    """One probe: sent ``at`` seconds after the overload ended; its answer."""

    at: float
    status: int
    reason: str  # x-shed-reason of a rejection
    worker: str  # x-worker-id of an answer
    answer_ms: float  # until the status (a rejection) or the first token (a 200)


@dataclass(frozen=True)
class PoolSample:
    """The extproc's view of the workers ``at`` seconds after the overload ended, summed."""

    at: float
    free: int  # workers the extproc would route a request to
    overloaded: int  # workers under an overload mark (a worker-side rejection, unreachable)
    reported_blocks: int  # active decode blocks, as the workers last reported them
    estimated_blocks: int  # the router's estimate of its requests in flight
    effective_blocks: int  # per rank the larger of the two: what the threshold compares
    limit_blocks: int  # the decode threshold in blocks
    oldest_report_ms: float  # age of the oldest load report


def pool_sample(at: float, workers: Sequence[dict[str, Any]]) -> PoolSample:
    """One ``GET /debug/workers`` answer, reduced to what recovery depends on."""
    ranks = [r for w in workers for r in w["ranks"]]
    return PoolSample(
        at=at,
        free=sum(1 for w in workers if w["state"] == "free"),
        overloaded=sum(1 for w in workers if w["state"] == "overloaded"),
        reported_blocks=sum(r["reported"]["active_decode_blocks"] or 0 for r in ranks),
        estimated_blocks=sum(r["router_estimate"]["active_decode_blocks"] for r in ranks),
        effective_blocks=sum(r["effective"]["active_decode_blocks"] or 0 for r in ranks),
        limit_blocks=sum(r["busy_limits"][DECODE] or 0 for r in ranks),
        oldest_report_ms=max((r["reported"]["age_s"] or 0.0 for r in ranks), default=0.0) * 1e3,
    )


async def watch_pool(
    session: aiohttp.ClientSession, admin: str, end: float, plan: RecoveryPlan
) -> list[PoolSample]:
    """``GET /debug/workers`` every probe interval for the probe phase, from ``end`` on."""
    samples: list[PoolSample] = []
    for i in range(plan.probes):
        await asyncio.sleep(max(0.0, end + i / plan.probe_rate - time.monotonic()))
        async with session.get(admin + "/debug/workers", timeout=ADMIN_TIMEOUT) as resp:
            body = await resp.json()
        samples.append(pool_sample(time.monotonic() - end, body["workers"]))
    return samples


def recovery_times(
    probes: Sequence[Probe], window: int, share: float = 0.95
) -> tuple[float | None, float | None]:
    """(first admitted, ``share`` admitted over a sliding window), in seconds after the
    overload's end; ``None`` where the probes never got there.

    The second is the send time of the first probe ``i`` answered 200 such that of the
    ``window`` probes ``i .. i + window - 1`` at least ``share`` were answered 200."""
    ordered = sorted(probes, key=lambda p: p.at)
    ok = [p.status == 200 for p in ordered]
    first = next((p.at for p, good in zip(ordered, ok, strict=True) if good), None)
    need = math.ceil(share * window - 1e-9)
    sustained = next(
        (
            ordered[i].at
            for i in range(len(ordered) - window + 1)
            if ok[i] and sum(ok[i : i + window]) >= need
        ),
        None,
    )
    return first, sustained


@dataclass
class RecoveryRound:
    """One overload phase and the probes after it."""

    load: float
    round: int
    offered_rps: float
    overload_sent: int
    overload_rejected: int
    overload_rejected_last_second: int  # 529s to arrivals in the phase's last second
    running_at_end: float  # the engines' running requests at the overload's end
    kv_usage_at_end: float
    first_admitted_s: float | None
    admitted_95_s: float | None
    probes_admitted: int
    rejected_reasons: dict[str, int]
    last_rejected_s: float | None
    first_free_s: float | None  # first pool sample with a worker free
    at_end: PoolSample | None  # the first pool sample, at the overload's end
    overload_marked_s: float  # pool samples with a worker under an overload mark, x interval
    oldest_report_ms: float  # the oldest load report seen until 0.5 s after recovery
    probes: list[Probe] = field(default_factory=list)
    pool: list[PoolSample] = field(default_factory=list)  # until 0.5 s after recovery

    @property
    def overloaded(self) -> bool:
        """The phase was shedding when it ended: there was something to recover from."""
        return self.overload_rejected_last_second > 0


async def recovery_round(
    session: aiohttp.ClientSession,
    stack: Stack,
    cfg: Config,
    plan: RecoveryPlan,
    capacity: float,
    load: float,
    index: int,
) -> RecoveryRound:
    """One round (thresholds as they are; the caller turns them on)."""
    rng = random.Random(f"{cfg.seed}-recovery-{load}-{index}")
    rate = load * capacity
    t0 = time.monotonic()
    end = t0 + plan.overload_seconds
    outcomes: list[Outcome] = [Outcome(arrival=i / plan.probe_rate) for i in range(plan.probes)]
    bodies = [request_body(cfg, rng, PROBE_MAX_TOKENS) for _ in outcomes]

    async def probes() -> EngineLoad:
        await asyncio.sleep(max(0.0, end - time.monotonic()))
        at_end = asyncio.create_task(stack.engines.load(session))
        tasks: list[asyncio.Task[None]] = []
        for out, body in zip(outcomes, bodies, strict=True):
            await asyncio.sleep(max(0.0, end + out.arrival - time.monotonic()))
            out.arrival = time.monotonic() - end  # when it was sent, however late the loop
            tasks.append(asyncio.create_task(send(session, stack.url, body, out, end)))
        await asyncio.wait(tasks, timeout=PROBE_TIMEOUT)
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
        return await at_end

    # The overload's admitted streams run on through the probe phase, then are cut off.
    overload, engines, pool = await asyncio.gather(
        open_loop(
            session, stack.url, cfg, rate, rng, plan.overload_seconds,
            grace=plan.probe_seconds + 2.0, t0=t0,
        ),
        probes(),
        watch_pool(session, stack.ext.admin, end, plan),
    )  # fmt: skip
    taken = [
        Probe(
            at=o.arrival,
            status=o.status,
            reason=o.shed_reason,
            worker=o.worker,
            answer_ms=((o.ttft if o.status == 200 else o.e2e) or math.nan) * 1e3,
        )
        for o in outcomes
    ]
    first, sustained = recovery_times(taken, plan.window, plan.share)
    first_free = next((s.at for s in pool if s.free), None)
    recovered = max(math.inf if t is None else t for t in (first_free, sustained))
    kept = [s for s in pool if s.at <= recovered + 0.5]
    rejected = [p for p in taken if p.status != 200]
    last_second = plan.overload_seconds - 1.0
    return RecoveryRound(
        load=load,
        round=index,
        offered_rps=rate,
        overload_sent=len(overload),
        overload_rejected=sum(1 for o in overload if o.status == 529),
        overload_rejected_last_second=sum(
            1 for o in overload if o.status == 529 and o.arrival >= last_second
        ),
        running_at_end=engines.running,
        kv_usage_at_end=engines.kv_usage,
        first_admitted_s=first,
        admitted_95_s=sustained,
        probes_admitted=len(taken) - len(rejected),
        rejected_reasons=dict(Counter(p.reason or f"status {p.status}" for p in rejected)),
        last_rejected_s=max((p.at for p in rejected), default=None),
        first_free_s=first_free,
        at_end=pool[0] if pool else None,
        overload_marked_s=sum(1 for s in pool if s.overloaded) / plan.probe_rate,
        oldest_report_ms=max((s.oldest_report_ms for s in kept), default=math.nan),
        probes=taken,
        pool=kept,
    )


async def measure_recovery(
    session: aiohttp.ClientSession, stack: Stack, cfg: Config, plan: RecoveryPlan, capacity: float
) -> list[RecoveryRound]:
    """Every round of ``plan``, thresholds on, each from empty engines."""
    stack.thresholds(True)
    rounds: list[RecoveryRound] = []
    for load in plan.loads:
        for index in range(1, plan.rounds + 1):
            r = await recovery_round(session, stack, cfg, plan, capacity, load, index)
            rounds.append(r)
            times = (
                f"first admitted {_s(r.first_admitted_s)}, 95 % admitted {_s(r.admitted_95_s)}"
                if r.overloaded
                else "not left (nothing shed in the overload's last second)"
            )
            log(
                f"recovery after {load:g}x, round {index}: {times}; overload "
                f"{r.overload_rejected} of {r.overload_sent} rejected, "
                f"{r.running_at_end:.0f} running at its end; rejected probes "
                f"{r.rejected_reasons}"
            )
            await wait_idle(session, stack.engines)
    return rounds


def _s(seconds: float | None) -> str:
    return "never" if seconds is None else f"{seconds:.2f} s"


def median(values: Sequence[float | None]) -> float | None:
    """The median, a round that never recovered counting as infinitely long; ``None`` for no
    values or where the median itself is such a round."""
    ordered = sorted(math.inf if v is None else v for v in values)
    if not ordered:
        return None
    mid = len(ordered) // 2
    value = ordered[mid] if len(ordered) % 2 else (ordered[mid - 1] + ordered[mid]) / 2
    return None if math.isinf(value) else value
