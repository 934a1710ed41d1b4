"""Percentiles, and the numbers of one overload cell (one offered load, thresholds off or on)."""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass, field

from loadtest.shedbench.client import Outcome
from loadtest.shedbench.config import Config
from loadtest.shedbench.workers import EngineSamples


def percentile(values: Sequence[float], q: float) -> float:
    """Nearest-rank percentile (q in 0-100); NaN for no values."""
    if not values:
        return math.nan
    ordered = sorted(values)
    rank = max(1, math.ceil(q / 100 * len(ordered)))
    return ordered[rank - 1]


@dataclass
class Cell:
    """The measured numbers of one offered load and threshold setting."""

    load: float
    thresholds: bool
    offered_rps: float
    sent_rps: float
    sent: int
    accepted: int
    rejected: int
    errors: int
    unfinished: int
    goodput_rps: float
    slo_goodput_rps: float
    ttft_p50_ms: float
    ttft_p99_ms: float
    e2e_p99_ms: float
    censored_p99: bool
    rejection_rate: float
    preemptions: int
    waiting_max: float
    waiting_mean: float
    kv_usage_mean: float
    # Core-seconds used while the cell ran, by part of the stack, "client" (this process)
    # and "other" (the rest of the machine); empty if not measured.
    cpu: dict[str, float] = field(default_factory=dict)


def summarize(
    cfg: Config,
    load: float,
    on: bool,
    rate: float,
    outcomes: list[Outcome],
    samples: EngineSamples,
    ttft_slo_s: float,
    overload_status: int = 529,
) -> Cell:
    """The cell's numbers; ``ttft_slo_s`` is the TTFT that counts into the SLO goodput."""
    span = cfg.cell_seconds - cfg.warmup
    window = [o for o in outcomes if o.arrival >= cfg.warmup]
    accepted = [o for o in window if o.status == 200]
    rejected = [o for o in window if o.status == overload_status]
    done = [o for o in outcomes if o.finished and cfg.warmup <= o.arrival + (o.e2e or 0)]
    done_in_window = [o for o in done if o.arrival + (o.e2e or 0) <= cfg.cell_seconds]
    unfinished = [o for o in accepted if not o.finished]
    ttfts = [o.ttft for o in accepted if o.ttft is not None]
    e2es = [o.e2e for o in accepted if o.e2e is not None]
    e2e_p99 = percentile(e2es, 99)
    return Cell(
        load=load,
        thresholds=on,
        offered_rps=rate,
        sent_rps=len(window) / span,
        sent=len(window),
        accepted=len(accepted),
        rejected=len(rejected),
        errors=len(window) - len(accepted) - len(rejected),
        unfinished=len(unfinished),
        goodput_rps=len(done_in_window) / span,
        slo_goodput_rps=sum(1 for o in done_in_window if (o.ttft or 0) <= ttft_slo_s) / span,
        ttft_p50_ms=percentile(ttfts, 50) * 1e3,
        ttft_p99_ms=percentile(ttfts, 99) * 1e3,
        e2e_p99_ms=e2e_p99 * 1e3,
        censored_p99=bool(unfinished) and any((o.e2e or 0) >= e2e_p99 for o in unfinished),
        rejection_rate=len(rejected) / len(window) if window else 0.0,
        preemptions=int(samples.preemptions),
        waiting_max=max(samples.waiting, default=0.0),
        waiting_mean=sum(samples.waiting) / len(samples.waiting) if samples.waiting else 0.0,
        kv_usage_mean=sum(samples.kv_usage) / len(samples.kv_usage) if samples.kv_usage else 0.0,
    )
