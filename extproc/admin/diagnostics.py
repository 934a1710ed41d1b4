"""``GET /debug/workers``: per worker and rank, what the decision sees and why.

Answers "I set a threshold and never see 529": for every configured check
that cannot fire on a rank, it names the missing prerequisite; and, with
--router-track-output-blocks, whether generated tokens are counted at all.
"""

from __future__ import annotations

import time
from typing import Any

from extproc.core.busy import DECODE, PREFILL, PREFILL_FRAC, THRESHOLD_NAMES, RankLimits
from extproc.core.latency import DeadlineAdmission
from extproc.core.pool import WorkerPool
from extproc.core.worker import Rank, Worker
from extproc.metrics.registry import UNOBSERVED_OUTPUT_FIX, Metrics

STALE_LOAD_SECONDS = 5.0  # at most; half the worker TTL when that is shorter
# The output-tracking warning shows while the last unobserved response ended this recently
# (the status page's history span): once the wiring is fixed, it goes away.
UNOBSERVED_WARNING_SECONDS = 300.0


def _age(now: float, t: float | None) -> float | None:
    return None if t is None else round(now - t, 3)


def _inactive(pool: WorkerPool, worker: Worker, rank: Rank, now: float) -> dict[str, str]:
    th = pool.thresholds_for(worker.model)
    out: dict[str, str] = {}
    if th.active_decode_blocks is not None:
        if not pool.kv_mode:
            out[DECODE] = "router mode is not kv: decode-block checks run only in kv mode"
        elif not worker.kv_total(rank):
            out[DECODE] = "no kv_total_blocks (0 or not reported in config or load)"
    if th.active_prefill_tokens_frac is not None and not worker.max_num_batched_tokens:
        out[PREFILL_FRAC] = "no max_num_batched_tokens in the worker's config"
    configured = [
        name
        for name, value in th.as_dict().items()
        if value is not None and name in THRESHOLD_NAMES and name not in out
    ]
    if configured:
        if rank.reported_at is None and not rank.inflight:
            reason = "no load events from this rank and no requests in flight"
        elif rank.reported_at is not None and now - rank.reported_at > min(
            STALE_LOAD_SECONDS, pool.worker_ttl / 2
        ):
            reason = f"no load events for {now - rank.reported_at:.0f} s"
        else:
            reason = ""
        if reason:
            for name in configured:
                out[name] = reason
    return out


def _limits(limits: RankLimits) -> dict[str, int | None]:
    return {
        DECODE: limits.decode_blocks,
        PREFILL: limits.prefill_tokens,
        PREFILL_FRAC: limits.prefill_tokens_frac,
    }


def _rank(pool: WorkerPool, worker: Worker, rank: Rank, now: float) -> dict[str, Any]:
    """One rank: what it reported (load and queue), the router's estimate, the limits."""
    view = {
        "dp_rank": rank.index,
        "reported": {
            "active_decode_blocks": rank.reported_blocks,
            "active_prefill_tokens": rank.reported_prefill,
            "kv_total_blocks": rank.reported_kv_total,
            "num_requests_waiting": rank.reported_waiting,
            "request_active_slots": rank.reported_active_slots,
            "request_total_slots": rank.reported_total_slots,
            "age_s": _age(now, rank.reported_at),
        },
        "router_estimate": {
            "requests_in_flight": rank.inflight,
            "active_decode_blocks": rank.est_blocks,
            "active_prefill_tokens": rank.est_prefill,
        },
        "other_replicas_estimate": {
            "requests_in_flight": rank.peer_inflight,
            "active_decode_blocks": rank.peer_blocks,
            "active_prefill_tokens": rank.peer_prefill,
        },
        "effective": {
            "active_decode_blocks": rank.decode_blocks,
            "active_prefill_tokens": rank.prefill_tokens,
            "kv_total_blocks": worker.kv_total(rank),
        },
        "busy_limits": _limits(rank.limits),
        "has_load_data": rank.has_data,
        "busy": rank.has_data and rank.busy_reason is not None,
        "fired": rank.busy_reason if rank.has_data else None,
        "cannot_fire": _inactive(pool, worker, rank, now),
    }
    return view


def _by_class(worker: Worker, names: list[str]) -> dict[str, Any] | None:
    """Per request class (and large-prompt share): busy, and the check that fired."""
    if len(names) < 2 or not worker.busy_by_class:
        return None
    out: dict[str, Any] = {}
    for i, name in enumerate(names):
        fired = [r.reason_for(i) for r in worker.ranks if r.has_data]
        out[name] = {
            "busy": worker.busy_by_class[i],
            "fired": next((f for f in fired if f is not None), None),
        }
    return out


def worker_view(
    pool: WorkerPool,
    worker: Worker,
    now: float,
    class_names: list[str] | None = None,
    latency: DeadlineAdmission | None = None,
) -> dict[str, Any]:
    """One worker; ``deadline``: deadline admission's prediction for it (the predicted
    wait, prefill cost, completion rate, held requests, the inputs it goes without, and
    whether its model's TTFT target is unreachable on it)."""
    ranks = [_rank(pool, worker, r, now) for r in worker.ranks]
    state = worker.state(now) if worker.configured else "not_routable"
    if state == "busy":
        why = "every rank with load data is busy: " + ", ".join(
            f"rank {r['dp_rank']}: {r['fired']}" for r in ranks if r["has_load_data"]
        )
    elif state == "overloaded" and now < worker.unreachable_until:
        why = f"Envoy could not reach it; skipped for {worker.unreachable_until - now:.2f} s more"
    elif state == "overloaded":
        why = (
            f"worker-side rejection; skipped for {worker.overloaded_until - now:.2f} s "
            "more or until its next load report"
        )
    elif state == "not_routable":
        why = "load received but no config event yet"
    elif not any(r["has_load_data"] for r in ranks):
        why = "no load data at all: a worker without data is free"
    else:
        why = "at least one rank with load data is free"
    view = {
        "worker_id": worker.worker_id,
        "model": worker.model or None,
        "endpoint": worker.endpoint or None,
        # An endpoint announced by host name: the ip:port forms it resolved to.
        "addresses": sorted(worker.addresses),
        "worker_type": worker.worker_type,
        "dp_size": worker.dp_size,
        "kv_total_blocks": worker.kv_total_blocks,
        "block_size": worker.block_size,
        "max_num_batched_tokens": worker.max_num_batched_tokens,
        "state": state,
        "why": why,
        "last_seen_age_s": _age(now, worker.last_seen),
        "last_load_age_s": _age(now, worker.last_load_at),
        "expires_in_s": round(worker.last_seen + pool.worker_ttl - now, 3),
        "thresholds": pool.thresholds_for(worker.model).as_dict() if worker.model else None,
        "classes": _by_class(worker, class_names or []),
        "ranks": ranks,
    }
    if latency is not None and worker.model:
        view["deadline"] = latency.view(worker)
    return view


def models_view(pool: WorkerPool, latency: DeadlineAdmission | None) -> dict[str, Any]:
    """Per model: its TTFT target (null: none), the requests held for a slot, and of the
    admitted streamed requests with a target, how many met it and the share."""
    out: dict[str, Any] = {}
    for model in pool.models():
        target = latency.target_s(model) if latency is not None else None
        entry: dict[str, Any] = {
            "ttft_p99_target_ms": None if target is None else round(target * 1000, 3)
        }
        if latency is not None:
            q = latency.held.get(model)
            met = latency.met.get(model)
            entry["held_requests"] = len(q) if q else 0
            entry["admitted_met_target"] = met.met if met else 0
            entry["admitted_missed_target"] = met.missed if met else 0
            share = met.share if met else None
            entry["target_met_share"] = None if share is None else round(share, 4)
        out[model] = entry
    return out


def output_tracking(pool: WorkerPool, metrics: Metrics | None) -> dict[str, Any]:
    """Whether generated tokens reach the estimate: with --router-track-output-blocks, the
    streamed responses that ended while no ext_proc stream received their body, and the
    fix while the last of them is recent."""
    unobserved, age = 0, None
    if metrics is not None:
        value = metrics.registry.get_sample_value("extproc_output_unobserved_responses_total")
        unobserved = int(value or 0)
        if metrics.output_unobserved_at is not None:
            age = round(time.monotonic() - metrics.output_unobserved_at, 3)
    warning = None
    if age is not None and age < UNOBSERVED_WARNING_SECONDS:
        warning = (
            f"--router-track-output-blocks is on, but {unobserved} streamed responses ended "
            "without their body reaching the extproc (the last "
            f"{age:.0f} s ago): their generated tokens were not counted, so long "
            f"generations never turn a worker busy. Fix: {UNOBSERVED_OUTPUT_FIX}"
        )
    return {
        "track_output_blocks": pool.track_output_blocks,
        "unobserved_responses": unobserved,
        "last_unobserved_age_s": age,
        "warning": warning,
    }


def workers_view(
    pool: WorkerPool,
    class_names: list[str] | None = None,
    metrics: Metrics | None = None,
    latency: DeadlineAdmission | None = None,
) -> dict[str, Any]:
    """``class_names``: a label per class variant, when request classes are configured."""
    now = pool.clock()
    return {
        "router_mode_kv": pool.kv_mode,
        "track_output_blocks": pool.track_output_blocks,
        "output_tracking": output_tracking(pool, metrics),
        "worker_ttl_s": pool.worker_ttl,
        "counts": pool.counts(),
        "models": models_view(pool, latency),
        "workers": [worker_view(pool, w, now, class_names, latency) for w in pool.workers.values()],
    }
