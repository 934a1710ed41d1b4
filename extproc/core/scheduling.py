"""Decide one request: route it to a free worker, reject it, or hold it in the queue.

:meth:`Scheduler.decide` is the whole decision, one call on the pool's current flags, no
I/O. A worker can be picked for a request while it is free for the request's class
variant (:func:`is_free`): not busy, by the flags the pool recomputes on every load
report, dispatch, release and threshold change, and not marked overloaded. Picking reads
those flags and the ranks' loads as plain values. ``kv`` mode takes the least-loaded free
rank: KV utilisation (blocks / total; raw blocks when the total is unknown) first, then
active prefill tokens; a rank with no data counts as 0. Ties go to the next worker in
rotation so equal workers share the load. ``round-robin`` and ``random`` pick among the
free workers. A routed request is recorded against its rank at once (its
:class:`~extproc.core.worker.Ticket`), so the next decision already sees it.

A request whose model is not known yet (``model=None``: the body has not been read) is
decided too, where the answer cannot depend on the model: no worker at all, or every
worker of every model busy. Otherwise the decision is :data:`DEFERRED`: read the body.
"""

from __future__ import annotations

import random
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from enum import StrEnum
from typing import ClassVar, overload

from extproc.core.pool import WorkerPool
from extproc.core.subset import GatewayWorkers
from extproc.core.worker import Rank, Ticket, Worker

# Other free workers listed after the pick, for Envoy to retry a worker-side rejection on.
MAX_FALLBACKS = 2
# The model a rejection is counted under when the request named none and the pool serves
# several models.
ANY_MODEL = "*"


class Outcome(StrEnum):
    ROUTED = "routed"
    OVERLOADED = "overloaded"
    NO_WORKERS = "no_workers"
    MODEL_NOT_FOUND = "model_not_found"
    QUEUED = "queued"  # free workers exist, but each has too much prefill in flight


@dataclass(frozen=True, slots=True)
class Routed:
    """Send the request to ``ticket.worker``; ``fallbacks`` are endpoints to retry on.

    ``endpoint``: the address to send it to when it is not the worker's announced one (a
    gateway's subset names the pod's address, :mod:`extproc.core.subset`)."""

    ticket: Ticket
    fallbacks: tuple[str, ...]
    endpoint: str = ""
    outcome: ClassVar[Outcome] = Outcome.ROUTED

    @property
    def address(self) -> str:
        """Where the request goes: ``endpoint``, else the worker's announced endpoint."""
        return self.endpoint or self.ticket.worker.endpoint


@dataclass(frozen=True, slots=True)
class Rejected:
    """Answer locally: ``outcome`` says why; ``retry_after`` is whole seconds (1-60);
    ``check`` names the busy check that fired and ``model`` the model the rejection is
    counted under (overload only; ``*`` when the request named none and the pool serves
    several models)."""

    outcome: Outcome
    retry_after: int = 1
    check: str | None = None
    model: str = ""


@dataclass(frozen=True, slots=True)
class Queued:
    """Free workers exist but each has too much prefill in flight: wait in the router."""

    outcome: ClassVar[Outcome] = Outcome.QUEUED


@dataclass(frozen=True, slots=True)
class Deferred:
    """The model is not known yet and the answer depends on it: decide on the body."""


QUEUED = Queued()
DEFERRED = Deferred()
NO_WORKERS = Rejected(Outcome.NO_WORKERS)
MODEL_NOT_FOUND = Rejected(Outcome.MODEL_NOT_FOUND)
Decision = Routed | Rejected | Queued


def is_free(worker: Worker, variant: int, now: float) -> bool:
    """Whether a decision may pick ``worker`` now for class variant ``variant`` (an index
    of the pool's shares; 0 = the default class): not busy for it, and not marked
    overloaded or unreachable."""
    busy = worker.busy_by_class[variant] if variant else worker.busy
    return not busy and now >= worker.overloaded_until


def _rank_key(worker: Worker, rank: Rank) -> tuple[float, int]:
    """KV utilisation, then prefill tokens; the KV total is the one the rank reported,
    else the worker's announced one."""
    blocks = rank.decode_blocks or 0
    total = rank.reported_kv_total
    if total is None:
        total = worker.kv_total_blocks
    return (blocks / total if total else float(blocks), rank.prefill_tokens or 0)


def _queue_full(worker: Worker, rank: Rank) -> bool:
    """Router-tracked prefill on the rank is above the worker's queue limit."""
    limit = worker.queue_limit
    return limit is not None and rank.est_prefill > limit


def _best_rank(worker: Worker, variant: int = 0) -> Rank:
    ranks = worker.ranks
    if len(ranks) == 1:
        return ranks[0]
    best: Rank | None = None
    best_key: tuple[float, int] = (0.0, 0)
    for rank in ranks:
        if rank.has_data and rank.reason_for(variant) is not None:
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
        self.gateway = GatewayWorkers(pool)

    @overload
    def decide(
        self,
        model: str,
        prompt_tokens: int,
        variant: int = 0,
        *,
        waiting: bool = False,
        subset: Sequence[str] | None = None,
    ) -> Decision: ...
    @overload
    def decide(
        self,
        model: None,
        prompt_tokens: int = 0,
        variant: int = 0,
        *,
        waiting: bool = False,
        subset: Sequence[str] | None = None,
    ) -> Rejected | Deferred: ...
    def decide(
        self,
        model: str | None,
        prompt_tokens: int = 0,
        variant: int = 0,
        *,
        waiting: bool = False,
        subset: Sequence[str] | None = None,
    ) -> Decision | Deferred:
        """The decision for one request of ``model`` under class variant ``variant`` (an
        index of the pool's shares; 0 = the default class); a routed one is dispatched.

        ``waiting``: requests of the model already wait in the router queue, so this one
        joins them (QUEUED, no overtaking). ``model=None``: the model is not known yet
        (:meth:`_before_the_model`; ``waiting`` then means requests of any model wait).
        ``subset``: the only addresses the request may go to (a gateway's endpoint subset,
        :mod:`extproc.core.subset`); empty, or none of them a candidate: NO_WORKERS.
        """
        if subset is not None and not subset:
            return NO_WORKERS
        if model is None:
            return DEFERRED if subset else self._before_the_model(variant, waiting)
        if waiting:
            return QUEUED
        address: Mapping[Worker, str] | None = None
        if subset:
            if model not in self.pool.by_model and self.pool.by_model:
                return MODEL_NOT_FOUND
            address = self.gateway.members(model, subset)
            workers = list(address)
            if not workers:
                return NO_WORKERS
        else:
            workers = self.pool.by_model.get(model) or []
            if not workers:
                return MODEL_NOT_FOUND if self.pool.by_model else NO_WORKERS
        picked = self._pick(workers, variant)
        if picked is None:
            return self._overloaded(model, workers, variant)
        if isinstance(picked, Queued):
            return QUEUED
        worker, rank = picked
        ticket = self.pool.dispatch(worker, rank, prompt_tokens)
        fallbacks = self._fallbacks(workers, worker, variant, address)
        if address is None:
            return Routed(ticket, fallbacks)
        return Routed(ticket, fallbacks, address[worker])

    def _before_the_model(self, variant: int, waiting: bool) -> Rejected | Deferred:
        """The answer that cannot depend on the model, or DEFERRED.

        No worker at all: NO_WORKERS. No worker of any model free for ``variant``: the
        overload rejection, whichever model the request names. It is counted under the
        pool's only model, or under ``*`` with the shortest Retry-After of all models when
        the pool serves several; the check is the one that fired on the first model's
        workers. A free worker anywhere, or requests waiting in the router queue (FIFO
        keeps their order): DEFERRED, the model decides.
        """
        by_model = self.pool.by_model
        if not by_model:
            return NO_WORKERS
        now = self.pool.clock()
        for workers in by_model.values():
            for w in workers:
                if is_free(w, variant, now):
                    return DEFERRED
        if waiting:
            return DEFERRED
        first = next(iter(by_model))
        rejected = self._overloaded(first, by_model[first], variant)
        if len(by_model) == 1:
            return rejected
        retry_after = min(self.pool.retry_after(m) for m in by_model)
        return Rejected(Outcome.OVERLOADED, retry_after, rejected.check, ANY_MODEL)

    def _overloaded(
        self, model: str, workers: list[Worker] | None = None, variant: int = 0
    ) -> Rejected:
        """The overload rejection for ``model``, with its current Retry-After estimate and
        the check that fired on the first busy worker."""
        check = None
        now = self.pool.clock()
        for w in workers or ():
            if now < w.overloaded_until:
                unreachable = now < w.unreachable_until
                check = check or ("worker_unreachable" if unreachable else "worker_overloaded")
                continue
            reasons = [r.reason_for(variant) for r in w.ranks if r.has_data]
            check = next((r for r in reasons if r is not None), None)
            if check is not None:
                break
        return Rejected(Outcome.OVERLOADED, self.pool.retry_after(model), check, model)

    def _pick(self, workers: list[Worker], variant: int) -> tuple[Worker, Rank] | Queued | None:
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
                if not is_free(w, variant, now):
                    continue
                rank = _best_rank(w, variant)
                key = _rank_key(w, rank)
                if best is None or key < best_key:
                    best, best_rank, best_key = w, rank, key
            if best is None or best_rank is None:
                return None
            if self.queue_threshold is not None and _queue_full(best, best_rank):
                return self._least_loaded_not_queue_full(workers, now, variant)
            return best, best_rank
        free = [w for w in workers if is_free(w, variant, now)]
        if not free:
            return None
        if self.queue_threshold is not None:
            free = [w for w in free if not _queue_full(w, _best_rank(w, variant))]
            if not free:
                return QUEUED
        w = free[turn % len(free)] if self.mode == "round-robin" else self._rng.choice(free)
        return w, _best_rank(w, variant)

    def _least_loaded_not_queue_full(
        self, workers: list[Worker], now: float, variant: int
    ) -> tuple[Worker, Rank] | Queued:
        """The least-loaded free worker is queue-full: any other free one that is not?"""
        best: Worker | None = None
        best_rank: Rank | None = None
        best_key: tuple[float, int] = (0.0, 0)
        for w in workers:
            if not is_free(w, variant, now):
                continue
            rank = _best_rank(w, variant)
            if _queue_full(w, rank):
                continue
            key = _rank_key(w, rank)
            if best is None or key < best_key:
                best, best_rank, best_key = w, rank, key
        if best is None or best_rank is None:
            return QUEUED
        return best, best_rank

    def _fallbacks(
        self,
        workers: list[Worker],
        chosen: Worker,
        variant: int,
        address: Mapping[Worker, str] | None = None,
    ) -> tuple[str, ...]:
        """Endpoints of up to ``max_fallbacks`` other free workers, for retries (their
        ``address`` when given, else their announced endpoints)."""
        limit = self.max_fallbacks
        if len(workers) < 2 or limit <= 0:
            return ()
        now = self.pool.clock()
        out: list[str] = []
        n = len(workers)
        start = self._turn % n
        picked = chosen.endpoint if address is None else address[chosen]
        for i in range(n):
            w = workers[(start + i) % n]
            if w is chosen or not is_free(w, variant, now):
                continue
            endpoint = w.endpoint if address is None else address[w]
            if endpoint != picked and endpoint not in out:
                out.append(endpoint)
                if len(out) == limit:
                    break
        return tuple(out)
