"""Decide one request: route it to a free worker, reject it, or hold it in the queue.

:meth:`Scheduler.decide` is the whole decision, one call on the pool's current flags,
no I/O. ``kv`` mode takes the least-loaded free rank: KV utilisation (blocks / total; raw
blocks when the total is unknown) first, then active prefill tokens; a rank with no data
counts as 0. Ties go to the next worker in rotation so equal workers share the load.
``round-robin`` and ``random`` pick among the free workers. A routed request is recorded
against its rank at once (its :class:`~extproc.core.pool.Ticket`), so the next decision
already sees it.
"""

from __future__ import annotations

import random
from dataclasses import dataclass
from enum import StrEnum
from typing import ClassVar

from extproc.core.pool import Rank, Ticket, Worker, WorkerPool

# Other free workers listed after the pick, for Envoy to retry a worker-side rejection on.
MAX_FALLBACKS = 2


class Outcome(StrEnum):
    ROUTED = "routed"
    OVERLOADED = "overloaded"
    NO_WORKERS = "no_workers"
    MODEL_NOT_FOUND = "model_not_found"
    QUEUED = "queued"  # free workers exist, but each has too much prefill in flight


@dataclass(frozen=True, slots=True)
class Routed:
    """Send the request to ``ticket.worker``; ``fallbacks`` are endpoints to retry on."""

    ticket: Ticket
    fallbacks: tuple[str, ...]
    outcome: ClassVar[Outcome] = Outcome.ROUTED


@dataclass(frozen=True, slots=True)
class Rejected:
    """Answer locally: ``outcome`` says why; ``retry_after`` is whole seconds (1-60)."""

    outcome: Outcome
    retry_after: int = 1


@dataclass(frozen=True, slots=True)
class Queued:
    """Free workers exist but each has too much prefill in flight: wait in the router."""

    outcome: ClassVar[Outcome] = Outcome.QUEUED


QUEUED = Queued()
NO_WORKERS = Rejected(Outcome.NO_WORKERS)
MODEL_NOT_FOUND = Rejected(Outcome.MODEL_NOT_FOUND)
Decision = Routed | Rejected | Queued


def _rank_key(worker: Worker, rank: Rank) -> tuple[float, int]:
    blocks = rank.decode_blocks or 0
    total = worker.kv_total(rank)
    return (blocks / total if total else float(blocks), rank.prefill_tokens or 0)


def _queue_full(worker: Worker, rank: Rank) -> bool:
    """Router-tracked prefill on the rank is above the worker's queue limit."""
    limit = worker.queue_limit
    return limit is not None and rank.est_prefill > limit


def _best_rank(worker: Worker) -> Rank:
    ranks = worker.ranks
    if len(ranks) == 1:
        return ranks[0]
    best: Rank | None = None
    best_key: tuple[float, int] = (0.0, 0)
    for rank in ranks:
        if rank.has_data and rank.busy_reason is not None:
            continue
        key = _rank_key(worker, rank)
        if best is None or key < best_key:
            best, best_key = rank, key
    return best if best is not None else ranks[0]


class Scheduler:
    """Stateful only for rotation; everything else is read from the pool."""

    def __init__(
        self,
        pool: WorkerPool,
        mode: str = "kv",
        rng: random.Random | None = None,
        queue_threshold: float | None = None,
        max_fallbacks: int = MAX_FALLBACKS,
    ):
        self.pool = pool
        self.mode = mode
        self.queue_threshold = queue_threshold
        self.max_fallbacks = max_fallbacks
        self._turn = 0
        self._rng = rng or random.Random()

    def decide(self, model: str, prompt_tokens: int) -> Decision:
        """The decision for one request of ``model``; a routed one is dispatched."""
        workers = self.pool.by_model.get(model)
        if not workers:
            return MODEL_NOT_FOUND if self.pool.by_model else NO_WORKERS
        picked = self._pick(workers)
        if picked is None:
            return self.overloaded(model)
        if isinstance(picked, Queued):
            return QUEUED
        worker, rank = picked
        ticket = self.pool.dispatch(worker, rank, prompt_tokens)
        return Routed(ticket, self._fallbacks(workers, worker))

    def overloaded(self, model: str) -> Rejected:
        """The overload rejection for ``model``, with its current Retry-After estimate."""
        return Rejected(Outcome.OVERLOADED, self.pool.retry_after(model))

    def _pick(self, workers: list[Worker]) -> tuple[Worker, Rank] | Queued | None:
        """The free worker and rank to use, QUEUED, or None when every worker is busy."""
        now = self.pool.clock()
        n = len(workers)
        self._turn = turn = (self._turn + 1) % 1_000_000_007
        if self.mode == "kv":
            best: Worker | None = None
            best_rank: Rank | None = None
            best_key: tuple[float, int] = (0.0, 0)
            start = turn % n
            for i in range(n):
                w = workers[(start + i) % n]
                if w.busy or now < w.overloaded_until:
                    continue
                rank = _best_rank(w)
                key = _rank_key(w, rank)
                if best is None or key < best_key:
                    best, best_rank, best_key = w, rank, key
            if best is None or best_rank is None:
                return None
            if self.queue_threshold is not None and _queue_full(best, best_rank):
                return self._least_loaded_not_queue_full(workers, now)
            return best, best_rank
        free = [w for w in workers if not w.busy and now >= w.overloaded_until]
        if not free:
            return None
        if self.queue_threshold is not None:
            free = [w for w in free if not _queue_full(w, _best_rank(w))]
            if not free:
                return QUEUED
        w = free[turn % len(free)] if self.mode == "round-robin" else self._rng.choice(free)
        return w, _best_rank(w)

    def _least_loaded_not_queue_full(
        self, workers: list[Worker], now: float
    ) -> tuple[Worker, Rank] | Queued:
        """The least-loaded free worker is queue-full: any other free one that is not?"""
        best: Worker | None = None
        best_rank: Rank | None = None
        best_key: tuple[float, int] = (0.0, 0)
        for w in workers:
            if w.busy or now < w.overloaded_until:
                continue
            rank = _best_rank(w)
            if _queue_full(w, rank):
                continue
            key = _rank_key(w, rank)
            if best is None or key < best_key:
                best, best_rank, best_key = w, rank, key
        if best is None or best_rank is None:
            return QUEUED
        return best, best_rank

    def _fallbacks(self, workers: list[Worker], chosen: Worker) -> tuple[str, ...]:
        """Endpoints of up to ``max_fallbacks`` other free workers, for retries."""
        limit = self.max_fallbacks
        if len(workers) < 2 or limit <= 0:
            return ()
        now = self.pool.clock()
        out: list[str] = []
        n = len(workers)
        start = self._turn % n
        for i in range(n):
            w = workers[(start + i) % n]
            if w is chosen or w.busy or now < w.overloaded_until or w.endpoint == chosen.endpoint:
                continue
            if w.endpoint not in out:
                out.append(w.endpoint)
                if len(out) == limit:
                    break
        return tuple(out)
