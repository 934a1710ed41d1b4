"""What the stack does unloaded (the reference TTFT), at most (the closed-loop capacity sweep),
and at a TTFT target (the highest Poisson rate whose TTFT p99 holds it)."""

from __future__ import annotations

import math
import random
from collections.abc import Awaitable, Callable
from dataclasses import dataclass

import aiohttp

from loadtest.shedbench.arrivals import closed_loop
from loadtest.shedbench.client import Outcome, probe
from loadtest.shedbench.config import Config
from loadtest.shedbench.results import log
from loadtest.shedbench.stack import Stack
from loadtest.shedbench.stats import percentile
from loadtest.shedbench.workers import wait_idle


@dataclass(frozen=True)
class Unloaded:
    """One request at a time: TTFT p50 and p99, and (if measured) end-to-end p99, in ms."""

    ttft_p50_ms: float
    ttft_p99_ms: float
    e2e_p99_ms: float = math.nan


async def measure_unloaded(
    session: aiohttp.ClientSession, stack: Stack, cfg: Config, rng: random.Random, full: int = 0
) -> Unloaded:
    """``cfg.unloaded_probes`` short requests one at a time (TTFT does not depend on
    ``max_tokens`` here; the first pays for the connection and is not counted), then
    ``full`` full-length ones for the end-to-end latency."""
    solo = [await probe(session, stack.url, cfg, rng, 4) for _ in range(cfg.unloaded_probes)]
    whole = [await probe(session, stack.url, cfg, rng) for _ in range(full)]
    failed = [(i, o) for i, o in enumerate(solo + whole) if not o.finished]
    if failed:
        i, o = failed[0]
        raise RuntimeError(
            f"{len(failed)} of {len(solo + whole)} unloaded requests did not finish; the "
            f"first, request {i + 1}: status {o.status or 'none'}"
            + (f", {o.shed_reason}" if o.shed_reason else "")
            + (f", {o.error}" if o.error else "")
        )
    return Unloaded(
        ttft_p50_ms=percentile([o.ttft or 0 for o in solo[1:]], 50) * 1e3,
        ttft_p99_ms=percentile([o.ttft or 0 for o in solo[1:]], 99) * 1e3,
        e2e_p99_ms=percentile([o.e2e or 0 for o in whole], 99) * 1e3 if whole else math.nan,
    )


def sweep_levels(cfg: Config) -> list[int]:
    """Concurrencies around what the two engines run at once: the requests their KV caches
    hold at full length (at most ``max_num_seqs`` each), then twice and three times that.
    Where that is only a few slots (llama.cpp), half of it too."""
    blocks_per_seq = math.ceil((cfg.prompt_tokens + cfg.max_tokens) / cfg.block_size)
    fits = 2 * max(1, min(cfg.max_num_seqs, cfg.kv_total_blocks // blocks_per_seq))
    factors = (0.5, 1.0, 2.0) if fits <= 8 else (1.0, 2.0, 3.0)
    levels = {max(1, round(fits * f)) for f in factors}
    return sorted(levels)


async def sweep_capacity(
    session: aiohttp.ClientSession, stack: Stack, cfg: Config, rng: random.Random
) -> tuple[list[dict[str, float]], dict[str, float]]:
    """Closed loop at each of :func:`sweep_levels` (thresholds as they are): every level's
    completed req/s, and the knee (the smallest concurrency within 5 % of the best)."""
    sweep: list[dict[str, float]] = []
    for concurrency in sweep_levels(cfg):
        outcomes = await closed_loop(
            session, stack.url, cfg, concurrency, cfg.sweep_seconds, rng, stagger=1.0
        )
        warm = cfg.sweep_seconds * 0.4  # the engine fills up, then preempts: skip that
        done = [o for o in outcomes if o.finished and o.arrival + (o.e2e or 0) >= warm]
        rps = len(done) / (cfg.sweep_seconds - warm)
        sweep.append({"concurrency": concurrency, "completed_rps": rps})
        log(f"sweep c={concurrency}: {rps:.2f} completed req/s")
        await wait_idle(session, stack.engines)
    best = max(s["completed_rps"] for s in sweep)
    return sweep, next(s for s in sweep if s["completed_rps"] >= 0.95 * best)


@dataclass(frozen=True)
class RateProbe:
    """One rate of the search for the capacity at target: Poisson arrivals with the count
    the rate names (:func:`~loadtest.shedbench.arrivals.given_count`), thresholds off, no
    retries; the TTFT p99 of those that arrived after the warm-up (a stream cut at the
    end counts what it had waited)."""

    rate: float
    requests: int  # judged: arrived after the warm-up
    ttft_p99_ms: float
    refused: int
    errors: int
    within: bool  # enough requests, none refused or failed, and the p99 within target


MIN_JUDGED = 20  # fewer requests in a probe: its p99 says nothing
PROBE_STRETCH = 10  # a probe at a low rate runs at most this many times its set length


async def search_capacity(
    probe: Callable[[float], Awaitable[RateProbe]],
    start: float,
    max_probes: int,
    resolution: float = 0.1,
    confirm: int = 2,
) -> tuple[float, list[RateProbe]]:
    """The highest Poisson rate whose probes hold the target, and every probe in order.

    From ``start`` the rate doubles while it holds (halves while it does not, down to
    ``start / 8``) until one rate holds and a higher one does not; then bisects between
    them until they are within ``resolution`` of the lower one. That rate is then probed
    again with other arrivals until it has held ``confirm`` times: one probe at the knee is
    a coin toss (on simulated workers a rate that held in a 16-s probe gave a p99 of 426 ms
    against 150 in the benchmark's first phase, thresholds off), so a rate counts only once
    it held in every probe of it. A probe that does not hold makes its rate the new upper
    bound, and the search goes on below it. At most ``max_probes`` probes; when they run out
    first, the highest rate that held in every probe of it (confirmed or not); 0.0 when no
    rate held."""
    probes: list[RateProbe] = []
    held: dict[float, int] = {}  # rates that held in every probe of them: how many times
    high: float | None = None  # the lowest rate that did not hold
    rate = start
    while len(probes) < max_probes:
        result = await probe(rate)
        probes.append(result)
        if result.within:
            held[rate] = held.get(rate, 0) + 1
        else:
            high = rate if high is None else min(high, rate)
            held = {r: n for r, n in held.items() if r < high}
        low = max(held, default=None)
        if high is None:
            rate *= 2
        elif low is None:
            rate /= 2
            if rate < start / 8:
                break
        elif high - low <= resolution * low:
            if held[low] >= confirm:
                break
            rate = low
        else:
            rate = (low + high) / 2
    return max(held, default=0.0), probes


def probe_seconds(rate: float, seconds: float, warmup: float) -> float:
    """How long a probe at ``rate`` runs: ``seconds``, or long enough to expect 1.75 x
    :data:`MIN_JUDGED` requests after the warm-up at a low rate (a Poisson count of 35 falls
    under 20 about once in 400 probes; at 25 a 40-s probe on llama.cpp judged 17), at most
    :data:`PROBE_STRETCH` x ``seconds``. With at most 4 x, vLLM's probe at 0.125 req/s ran
    160 s and judged 19 requests, under 20: it did not hold for want of requests though its
    p99 was half the target, the search went lower, where fewer still were judged, and no
    rate held at all."""
    return min(PROBE_STRETCH * seconds, max(seconds, warmup + 1.75 * MIN_JUDGED / rate))


def judge_probe(rate: float, outcomes: list[Outcome], warmup: float, target_ms: float) -> RateProbe:
    """A :class:`RateProbe` from the answers of one open-loop run."""
    judged = [o for o in outcomes if o.arrival >= warmup]
    ok = [o.ttft for o in judged if o.status == 200 and o.ttft is not None]
    refused = sum(1 for o in judged if o.status in (429, 503, 529))
    errors = sum(1 for o in judged if o.status not in (200, 429, 503, 529))
    p99 = percentile(ok, 99) * 1e3
    within = len(judged) >= MIN_JUDGED and not refused and not errors and p99 <= target_ms
    return RateProbe(rate, len(judged), p99, refused, errors, within)
