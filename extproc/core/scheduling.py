"""Pick a free worker for a model, or say why none can take the request.

Works on the pool's current flags; no I/O. ``kv`` mode takes the least-loaded
free rank: KV utilisation (blocks / total; raw blocks when the total is
unknown) first, then active prefill tokens; a rank with no data counts as 0.
Ties go to the next worker in rotation so equal workers share the load.
"""

from __future__ import annotations

import random
from enum import StrEnum

from extproc.core.pool import Rank, Worker, WorkerPool


class Outcome(StrEnum):
    ROUTED = "routed"
    OVERLOADED = "overloaded"
    NO_WORKERS = "no_workers"
    MODEL_NOT_FOUND = "model_not_found"
    QUEUED = "queued"  # free workers exist, but each has too much prefill in flight


def _rank_key(worker: Worker, rank: Rank) -> tuple[float, int]:
    blocks = rank.decode_blocks or 0
    total = worker.kv_total(rank)
    return (blocks / total if total else float(blocks), rank.prefill_tokens or 0)


def _queue_full(worker: Worker, rank: Rank | None) -> bool:
    """Router-tracked prefill on the rank is above the worker's queue limit."""
    limit = worker.queue_limit
    return limit is not None and rank is not None and rank.est_prefill > limit


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
    ):
        self.pool = pool
        self.mode = mode
        self.queue_threshold = queue_threshold
        self._turn = 0
        self._rng = rng or random.Random()

    def pick(self, model: str) -> tuple[Outcome, Worker | None, Rank | None]:
        workers = self.pool.by_model.get(model)
        if not workers:
            if self.pool.by_model:
                return Outcome.MODEL_NOT_FOUND, None, None
            return Outcome.NO_WORKERS, None, None
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
            if best is None:
                return Outcome.OVERLOADED, None, None
            if self.queue_threshold is not None and _queue_full(best, best_rank):
                return self._queue_or_other(workers, now)
            return Outcome.ROUTED, best, best_rank
        free = [w for w in workers if not w.busy and now >= w.overloaded_until]
        if not free:
            return Outcome.OVERLOADED, None, None
        if self.queue_threshold is not None:
            free = [w for w in free if not _queue_full(w, _best_rank(w))]
            if not free:
                return Outcome.QUEUED, None, None
        w = free[turn % len(free)] if self.mode == "round-robin" else self._rng.choice(free)
        return Outcome.ROUTED, w, _best_rank(w)

    def _queue_or_other(
        self, workers: list[Worker], now: float
    ) -> tuple[Outcome, Worker | None, Rank | None]:
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
        if best is None:
            return Outcome.QUEUED, None, None
        return Outcome.ROUTED, best, best_rank

    def fallbacks(self, model: str, chosen: Worker, limit: int) -> tuple[str, ...]:
        """Endpoints of up to ``limit`` other free workers of the model, for retries."""
        workers = self.pool.by_model.get(model)
        if not workers or len(workers) < 2 or limit <= 0:
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
