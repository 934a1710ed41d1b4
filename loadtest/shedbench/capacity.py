"""What the stack does unloaded (the reference TTFT) and at most (the capacity sweep)."""

from __future__ import annotations

import math
import random
from dataclasses import dataclass

import aiohttp

from loadtest.shedbench.arrivals import closed_loop
from loadtest.shedbench.client import probe
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
    if not all(o.finished for o in solo + whole):
        raise RuntimeError("an unloaded request did not finish")
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
