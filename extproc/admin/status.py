"""``GET /status`` (a self-contained HTML page) and ``GET /status.json`` (what it draws).

The page is one static file (``status.html``: inline CSS and JS, no CDN, works air-gapped)
that fetches ``/status.json`` every second and never writes. ``/status.json`` is built at
read time from the pool (per model thresholds and overload state, per worker and rank the
effective load against each limit, reported vs router estimate) and from the Metrics
registry (router queue, event drops, streamed responses whose generated tokens went
uncounted), plus :class:`DecisionHistory`: per-second decision
counts by outcome (and overload replies per model) for the last few minutes, sampled from
the counters once a second on a timer, so the request path pays nothing for it and the
chart has history on first load. With deadline admission, each model with a TTFT target
has its target, held requests and the share of admitted requests that met it, and each
worker its prediction (the ``deadline`` object of ``/debug/workers``).
"""

from __future__ import annotations

import asyncio
import contextlib
import time
from collections import deque
from collections.abc import AsyncIterator, Callable, Iterable
from importlib import resources
from typing import Any

from aiohttp import web
from prometheus_client import Counter

from extproc.admin.diagnostics import STALE_LOAD_SECONDS, output_tracking, worker_view
from extproc.background import STATUS_HISTORY, Guard
from extproc.core.latency import DeadlineAdmission
from extproc.core.pool import WorkerPool
from extproc.metrics.registry import DECISION_OUTCOMES, Metrics
from extproc.openai.errors import overload_status_from_env

HISTORY_SECONDS = 300
SAMPLE_SECONDS = 1.0  # the history's period
PAGE = "status.html"


def counter_totals(counter: Counter) -> dict[str, float]:
    """A one-label counter's ``_total`` samples by label value (only that metric is read)."""
    out: dict[str, float] = {}
    for family in counter.collect():
        for sample in family.samples:
            if sample.name.endswith("_total") and sample.labels:
                out[next(iter(sample.labels.values()))] = sample.value
    return out


def _rejection_totals(counter: Counter) -> dict[str, float]:
    """Overload replies since the start per model (summed over endpoints)."""
    out: dict[str, float] = {}
    for family in counter.collect():
        for s in family.samples:
            if s.name.endswith("_total"):
                model = s.labels.get("model", "")
                out[model] = out.get(model, 0.0) + s.value
    return out


class DecisionHistory:
    """Ring buffer of per-second decision counts by outcome and overload replies (all, and
    per model), newest last."""

    def __init__(
        self,
        metrics: Metrics,
        seconds: int = HISTORY_SECONDS,
        clock: Callable[[], float] = time.time,
    ) -> None:
        self.metrics = metrics
        self.clock = clock
        self.points: deque[dict[str, Any]] = deque(maxlen=seconds)
        self._last: dict[str, float] | None = None
        self._last_rejected: dict[str, float] = {}

    def sample(self) -> None:
        """Append the counts since the previous call (the first call only sets the base)."""
        totals = counter_totals(self.metrics.decisions)
        rejected = _rejection_totals(self.metrics.rejections)
        if self._last is not None:
            last, last_rejected = self._last, self._last_rejected
            counts = {o: max(0.0, totals.get(o, 0.0) - last.get(o, 0.0)) for o in totals}
            by_model = {
                m: int(max(0.0, n - last_rejected.get(m, 0.0))) for m, n in rejected.items()
            }
            self.points.append(
                {
                    "t": round(self.clock(), 3),
                    "decisions": {o: int(n) for o, n in counts.items() if n},
                    "rejected": sum(by_model.values()),
                    "rejected_by_model": {m: n for m, n in by_model.items() if n},
                }
            )
        self._last = totals
        self._last_rejected = rejected

    async def run(self, guard: Guard, period: float = SAMPLE_SECONDS) -> None:
        """Sample every ``period`` seconds until cancelled; a failed sample is counted by
        ``guard`` and the next one is taken on time."""
        loop = asyncio.get_running_loop()
        next_at = loop.time()
        while True:
            guard.call(self.sample)
            next_at += period
            await asyncio.sleep(max(0.0, next_at - loop.time()))


def _families(metrics: Metrics, names: Iterable[str]) -> dict[str, list[Any]]:
    wanted = set(names)
    out: dict[str, list[Any]] = {n: [] for n in wanted}
    for family in metrics.registry.collect():
        if family.name in wanted:
            out[family.name].extend(family.samples)
    return out


def _display_state(worker: dict[str, Any], stale_after: float) -> tuple[str, str]:
    """free / busy / overloaded / stale / not_routable, and why (stale wins over free/busy)."""
    state, why = worker["state"], worker["why"]
    age = worker["last_load_age_s"]
    if state in ("free", "busy") and age is not None and age > stale_after:
        return "stale", f"no load events for {age:.0f} s (was {state}: {why})"
    return state, why


def _latency(pool: WorkerPool, latency: DeadlineAdmission | None) -> dict[str, dict[str, Any]]:
    """Per model with a TTFT target: the target, its held requests, how many admitted
    requests met it and missed it and the share met, and the workers on which it is
    unreachable."""
    if latency is None:
        return {}
    out: dict[str, dict[str, Any]] = {}
    for m in latency.models():
        model = m.model
        th = pool.thresholds_for(model)
        unreachable = [w.worker_id for w in pool.by_model.get(model, ()) if latency.unreachable(w)]
        share = m.met.share
        out[model] = {
            "ttft_p99_target_ms": th.ttft_p99_target_ms,
            "itl_p99_target_ms": th.itl_p99_target_ms,
            "held_requests": m.held,
            "admitted_met_target": m.met.met,
            "admitted_missed_target": m.met.missed,
            "target_met_share": None if share is None else round(share, 4),
            "target_unreachable": unreachable,
        }
    return out


def status_view(
    pool: WorkerPool,
    metrics: Metrics,
    history: DecisionHistory,
    overload_status: int,
    latency: DeadlineAdmission | None = None,
) -> dict[str, Any]:
    now = pool.clock()
    stale_after = min(STALE_LOAD_SECONDS, pool.worker_ttl / 2)
    workers = []
    for w in pool.workers.values():
        view = worker_view(pool, w, now, None, latency)
        view["display_state"], view["display_why"] = _display_state(view, stale_after)
        workers.append(view)
    fam = _families(
        metrics,
        (
            "extproc_router_queue_depth",
            "extproc_router_queue_wait_seconds",
            "extproc_events_dropped",
            "extproc_events_lost",
        ),
    )
    depth = {s.labels["model"]: int(s.value) for s in fam["extproc_router_queue_depth"]}
    wait = {
        s.name.rsplit("_", 1)[1]: s.value
        for s in fam["extproc_router_queue_wait_seconds"]
        if s.name.endswith(("_sum", "_count"))
    }
    dropped = {
        s.labels["reason"]: int(s.value)
        for s in fam["extproc_events_dropped"]
        if s.name.endswith("_total")
    }
    lost = sum(int(s.value) for s in fam["extproc_events_lost"] if s.name.endswith("_total"))
    targets = _latency(pool, latency)
    models = []
    for model in pool.models():
        members = [v for v in workers if v["model"] == model]
        states = [v["display_state"] for v in members if v["state"] != "not_routable"]
        entry = {
            "model": model,
            "thresholds": pool.thresholds_for(model).as_dict(),
            "workers": len(members),
            # What a request for this model gets now: the overload reply when every
            # routable worker is busy or marked overloaded.
            "overloaded": bool(states) and all(s in ("busy", "overloaded") for s in states),
            "router_queue_depth": depth.get(model, 0),
        }
        if model in targets:  # only with a latency target: the entry is unchanged without
            entry["latency"] = targets[model]
        models.append(entry)
    return {
        "now": round(time.time(), 3),
        "overload_status": overload_status,
        "router_mode_kv": pool.kv_mode,
        "worker_ttl_s": pool.worker_ttl,
        "stale_after_s": stale_after,
        "counts": pool.counts(),
        "models": models,
        "workers": workers,
        "router_queue": {
            "depth": depth,
            "wait_count": int(wait.get("count", 0)),
            "wait_sum_s": round(wait.get("sum", 0.0), 6),
        },
        "events": {"dropped": dropped, "lost": lost},
        "output_tracking": output_tracking(pool, metrics),
        "outcomes": list(DECISION_OUTCOMES),
        "history": list(history.points),
    }


def page_html() -> bytes:
    return resources.files("extproc.admin").joinpath(PAGE).read_bytes()


def add_routes(
    app: web.Application,
    pool: WorkerPool,
    metrics: Metrics,
    latency: DeadlineAdmission | None = None,
) -> None:
    """``GET /status``, ``GET /status.json`` and ``GET /`` (redirects to ``/status``)."""
    history = DecisionHistory(metrics)
    overload_status, _ = overload_status_from_env()
    html = page_html()

    async def page(_: web.Request) -> web.Response:
        return web.Response(
            body=html,
            content_type="text/html",
            charset="utf-8",
            headers={"Cache-Control": "no-cache"},
        )

    async def data(_: web.Request) -> web.Response:
        return web.json_response(
            status_view(pool, metrics, history, overload_status, latency),
            headers={"Cache-Control": "no-store"},
        )

    async def root(_: web.Request) -> web.Response:
        raise web.HTTPFound("/status")

    async def sampler(_: web.Application) -> AsyncIterator[None]:
        guard = Guard(STATUS_HISTORY, metrics.background_errors)
        task = asyncio.create_task(history.run(guard, SAMPLE_SECONDS))
        yield
        task.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await task

    app.router.add_get("/status", page)
    app.router.add_get("/status.json", data)
    app.router.add_get("/", root)
    app.cleanup_ctx.append(sampler)
