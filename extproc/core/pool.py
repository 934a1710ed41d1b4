"""The table of workers: by id, by model and by endpoint, with per-model thresholds.

One :class:`WorkerPool` lists every :class:`~extproc.core.worker.Worker` and is the only
writer of their state. The event plane tells it what workers announce
(:meth:`~WorkerPool.announce`, :meth:`~WorkerPool.report_load`, :meth:`~WorkerPool.leave`),
the request path records router estimates (dispatch / first token / move / release), the
admin API sets thresholds. After every write the touched worker's busy flags are
recomputed, so a routing decision only reads them
(:func:`~extproc.core.scheduling.is_free`). Plain values only: no I/O, no wire structs,
and nothing is called back but two listeners: capacity (a request ended or reached its
first token, a worker joined, thresholds changed: the router queue and the held requests)
and load (a load report applied: deadline admission's measurements). Measurements such as
an engine's own TTFT go from the event plane to deadline admission without passing through
here. What this replica shares with the others (its id, the version stamps of threshold changes)
is in :mod:`extproc.core.replica`.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Iterator

from extproc.core.allowlist import WorkerAllowList
from extproc.core.busy import (
    FULL_SHARE,
    BusyThresholds,
    Share,
    class_limits,
    rank_busy_reason,
    scaled_limit,
    worker_busy,
)
from extproc.core.replica import Replica, Stamp, Versions
from extproc.core.worker import DEFAULT_BLOCK_SIZE, Rank, Ticket, Worker, WorkerType

OVERLOAD_MARK_SECONDS = 1.0


class PoolError(ValueError):
    """An announcement the pool refuses; nothing was changed."""


class EndpointNotAllowed(PoolError):
    """The announced endpoint is outside ``--worker-allow``."""


class RankOutOfRange(PoolError):
    """A load report for a rank the worker's ``dp_size`` does not have."""


def _ceil_div(a: int, b: int) -> int:
    return -(-a // b)


class WorkerPool:
    """All workers by id and by model, with per-model thresholds."""

    def __init__(
        self,
        defaults: BusyThresholds,
        *,
        kv_mode: bool = True,
        track_output_blocks: bool = False,
        worker_ttl: float = 10.0,
        allow: WorkerAllowList | None = None,
        queue_threshold: float | None = None,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self.defaults = defaults
        self.kv_mode = kv_mode
        self.track_output_blocks = track_output_blocks
        self.worker_ttl = worker_ttl
        self.allow = allow or WorkerAllowList()
        self.clock = clock
        self.workers: dict[str, Worker] = {}
        self.by_model: dict[str, list[Worker]] = {}
        # One endpoint serving one model is one engine: the worker that announced it last.
        self.by_endpoint: dict[tuple[str, str], Worker] = {}
        # The addresses of endpoints announced by host name, as looked up off the request
        # path (extproc.events.resolver): endpoint -> its ``ip:port`` forms.
        self.resolved: dict[str, frozenset[str]] = {}
        # Workers known only from a gateway's endpoint subset (extproc.core.subset), by
        # (address, model): in no index, but their limits follow thresholds and shares.
        self.unlisted: dict[tuple[str, str], Worker] = {}
        self.thresholds: dict[str, BusyThresholds] = {}
        self.events_lost = 0
        self._duration_ewma: dict[str, float] = {}
        self.queue_threshold = queue_threshold
        # Called with a model when its router-tracked prefill may have dropped.
        self.on_capacity: Callable[[str], None] | None = None
        # Sharing with other replicas (docs/replicas.md): who we are, told of every change
        # of our own estimates; the version stamps of threshold changes, by model.
        self.replica = Replica()
        self.threshold_versions = Versions(self.replica)
        # Request classes (extproc.core.classes): the default class's share, then the
        # others'. One class with the full share is the behaviour without classes.
        self.shares: list[Share] = [FULL_SHARE]
        # Called with a worker after each of its load reports is applied (deadline
        # admission's measurements, wired in the service).
        self.on_load: Callable[[Worker], None] | None = None

    # ----- reading -----------------------------------------------------------------

    def thresholds_for(self, model: str) -> BusyThresholds:
        return self.thresholds.get(model, self.defaults)

    def models(self) -> list[str]:
        return sorted(self.by_model)

    def inflight(self) -> Iterator[tuple[Worker, Rank]]:
        for worker in self.workers.values():
            for rank in worker.ranks:
                yield worker, rank

    def counts(self) -> dict[str, int]:
        now = self.clock()
        out = {"free": 0, "busy": 0, "overloaded": 0}
        for workers in self.by_model.values():
            for w in workers:
                out[w.state(now)] += 1
        return out

    def retry_after(self, model: str) -> int:
        """Whole seconds (1-60) until capacity likely frees: mean duration / in flight."""
        mean = self._duration_ewma.get(model)
        if not mean:
            return 1
        inflight = sum(r.inflight for w in self.by_model.get(model, ()) for r in w.ranks)
        return max(1, min(60, round(mean / max(1, inflight))))

    # ----- what workers announce ------------------------------------------------------

    def announce(
        self,
        worker_id: str,
        *,
        model: str,
        endpoint: str,
        kv_total_blocks: int | None = None,
        block_size: int | None = None,
        max_num_batched_tokens: int | None = None,
        dp_size: int | None = None,
        worker_type: WorkerType | None = None,
    ) -> list[str]:
        """A worker's registration or heartbeat; a later one replaces the earlier one.

        Raises :class:`EndpointNotAllowed` (nothing changed) for an endpoint outside the
        allow-list. Identity rules (docs/events.md, "Worker identity"): a changed model or
        endpoint moves the worker, which serves the new model at the new endpoint from the
        next decision on, keeping its load and in-flight estimates; a changed ``dp_size``
        keeps the ranks both sizes have. An endpoint belongs to the worker that announced it
        last for that model: another worker that held it for the same model is removed as if it
        had said ``bye`` (workers of other models may share an endpoint: one engine serving
        several models). Returns the ids of the workers so removed.
        """
        if not self.allow.allows(endpoint):
            raise EndpointNotAllowed(f"endpoint {endpoint} not in --worker-allow")
        now = self.clock()
        worker = self.workers.get(worker_id)
        if worker is None:
            worker = self.workers[worker_id] = Worker(worker_id, now)
        worker.last_seen = now
        if worker.configured and worker.model != model:
            self._unlink(worker)
        displaced: list[str] = []
        key = (endpoint, model)
        holder = self.by_endpoint.get(key)
        if holder is not None and holder is not worker:
            self.leave(holder.worker_id)
            displaced.append(holder.worker_id)
        old = (worker.endpoint, worker.model)
        if old != key and self.by_endpoint.get(old) is worker:
            del self.by_endpoint[old]
        self.by_endpoint[key] = worker
        size = dp_size or 1
        if size != len(worker.ranks):
            ranks = worker.ranks[:size]
            ranks.extend(Rank(i) for i in range(len(ranks), size))
            worker.ranks = ranks
        worker.endpoint = endpoint
        worker.addresses = self.resolved.get(endpoint, frozenset())
        worker.kv_total_blocks = kv_total_blocks
        worker.block_size = block_size or DEFAULT_BLOCK_SIZE
        worker.max_num_batched_tokens = max_num_batched_tokens
        worker.dp_size = size
        worker.worker_type = worker_type or "decode"
        worker.queue_limit = (
            scaled_limit(self.queue_threshold, max_num_batched_tokens)
            if self.queue_threshold is not None and max_num_batched_tokens
            else None
        )
        worker.model = model
        worker.configured = True
        if model not in self.thresholds:
            self.thresholds[model] = self.defaults
        group = self.by_model.setdefault(model, [])
        if worker not in group:
            group.append(worker)
        self._recompute_limits(worker)
        if self.on_capacity is not None:
            self.on_capacity(model)
        return displaced

    def report_load(
        self,
        worker_id: str,
        *,
        dp_rank: int = 0,
        active_decode_blocks: int | None = None,
        active_prefill_tokens: int | None = None,
        kv_total_blocks: int | None = None,
        seq: int | None = None,
        num_requests_waiting: int | None = None,
        request_active_slots: int | None = None,
        request_total_slots: int | None = None,
    ) -> Worker:
        """One rank's ActiveLoad; returns the worker. The queue fields (requests waiting at
        the engine, running, and its slots; None: not reported) are stored on the rank for
        deadline admission; they never change a busy flag. Raises :class:`RankOutOfRange`
        (nothing changed) for a rank at or above the announced ``dp_size``; before any
        announcement it is kept."""
        now = self.clock()
        worker = self.workers.get(worker_id)
        if worker is None:
            worker = self.workers[worker_id] = Worker(worker_id, now)
        if dp_rank >= len(worker.ranks):
            if worker.configured:
                raise RankOutOfRange(
                    f"dp_rank {dp_rank} >= dp_size {worker.dp_size} of {worker_id}"
                )
            worker.ranks.extend(Rank(i) for i in range(len(worker.ranks), dp_rank + 1))
        if seq is not None:
            last = worker.last_seq
            if last is not None and seq > last + 1:
                self.events_lost += seq - last - 1
            worker.last_seq = seq
        rank = worker.ranks[dp_rank]
        rank.reported_blocks = active_decode_blocks
        rank.reported_prefill = active_prefill_tokens
        kv_changed = rank.reported_kv_total != kv_total_blocks
        rank.reported_kv_total = kv_total_blocks
        rank.reported_at = now
        rank.reported_waiting = num_requests_waiting
        rank.reported_active_slots = request_active_slots
        rank.reported_total_slots = request_total_slots
        worker.last_seen = now
        worker.last_load_at = now
        if now >= worker.unreachable_until:
            worker.overloaded_until = 0.0
        if kv_changed:
            self._rank_all_limits(worker, rank)
        self._refresh_rank(worker, rank)
        if self.on_load is not None:
            self.on_load(worker)
        return worker

    def set_addresses(self, endpoint: str, addresses: frozenset[str]) -> None:
        """The ``ip:port`` forms of ``endpoint`` (announced by host name), for every worker
        announcing it now or later."""
        self.resolved[endpoint] = addresses
        for worker in self.workers.values():
            if worker.endpoint == endpoint:
                worker.addresses = addresses

    def worker_at(self, address: str, model: str) -> Worker | None:
        """The worker of ``model`` at ``address``: its announced endpoint, else an
        endpoint whose host name resolved to it."""
        worker = self.by_endpoint.get((address, model))
        if worker is None:
            for other in self.by_model.get(model, ()):
                if address in other.addresses:
                    return other
        return worker

    def leave(self, worker_id: str) -> bool:
        """The worker is gone (``bye`` or TTL); False if it was not known."""
        worker = self.workers.pop(worker_id, None)
        if worker is None:
            return False
        if worker.configured:
            self._unlink(worker)
            if self.by_endpoint.get((worker.endpoint, worker.model)) is worker:
                del self.by_endpoint[(worker.endpoint, worker.model)]
            if worker.addresses and all(
                w.endpoint != worker.endpoint for w in self.workers.values()
            ):
                self.resolved.pop(worker.endpoint, None)
        return True

    def expire(self) -> list[str]:
        """Remove workers silent for longer than the TTL; returns their ids."""
        cutoff = self.clock() - self.worker_ttl
        gone = [wid for wid, w in self.workers.items() if w.last_seen < cutoff]
        for wid in gone:
            self.leave(wid)
        return gone

    def _unlink(self, worker: Worker) -> None:
        group = self.by_model.get(worker.model)
        if group is not None and worker in group:
            group.remove(worker)
            if not group:
                del self.by_model[worker.model]

    # ----- thresholds --------------------------------------------------------------

    def set_thresholds(
        self, model: str, thresholds: BusyThresholds, stamp: Stamp | None = None
    ) -> bool:
        """Takes effect for the very next decision; False if ``stamp`` is not newer.

        A change made here (no ``stamp``) is stamped and announced to the listeners of
        ``threshold_versions``; one from another replica applies only if its stamp is
        newer (:class:`~extproc.core.replica.Versions`).
        """
        versions = self.threshold_versions
        taken = versions.next_stamp(model, stamp)
        if taken is None:
            return False
        versions.record(model, taken)
        self.thresholds[model] = thresholds
        for worker in self.by_model.get(model, ()):
            self._recompute_limits(worker)
        for (_, of), worker in self.unlisted.items():
            if of == model:
                self._recompute_limits(worker)
        if stamp is None:
            versions.announce(model)
        if self.on_capacity is not None:  # a raised or removed threshold (or target) frees
            self.on_capacity(model)
        return True

    def set_shares(self, shares: list[Share]) -> None:
        """The request classes' shares, the default class first; every flag is redone."""
        if not shares:
            raise ValueError("at least one share (the default class)")
        self.shares = list(shares)
        for worker in (*self.workers.values(), *self.unlisted.values()):
            self._recompute_limits(worker)

    def _rank_all_limits(self, worker: Worker, rank: Rank) -> None:
        limits = class_limits(
            self.thresholds_for(worker.model),
            self.shares,
            kv_mode=self.kv_mode,
            kv_total_blocks=worker.kv_total(rank),
            max_num_batched_tokens=worker.max_num_batched_tokens,
        )
        rank.limits, rank.class_limits = limits[0], limits[1:]

    def _recompute_limits(self, worker: Worker) -> None:
        for rank in worker.ranks:
            self._rank_all_limits(worker, rank)
            d, p = rank.decode_blocks, rank.prefill_tokens
            rank.busy_reason = rank_busy_reason(rank.limits, d, p)
            rank.class_reasons = [rank_busy_reason(lim, d, p) for lim in rank.class_limits]
        self._refresh_worker(worker)

    def refresh_rank(self, worker: Worker, rank: Rank) -> None:
        """Recompute a rank's busy flag after its load or estimate changed."""
        self._refresh_rank(worker, rank)

    def _refresh_rank(self, worker: Worker, rank: Rank) -> None:
        if rank.class_limits:
            d, p = rank.decode_blocks, rank.prefill_tokens
            rank.busy_reason = rank_busy_reason(rank.limits, d, p)
            rank.class_reasons = [rank_busy_reason(lim, d, p) for lim in rank.class_limits]
            self._refresh_worker(worker)
            return
        reason = rank_busy_reason(rank.limits, rank.decode_blocks, rank.prefill_tokens)
        rank.busy_reason = reason
        if len(worker.ranks) == 1:
            # The common case, once per load event. A rank without data has no load to
            # fire a check (reason None), so this is worker_busy() of its one rank.
            worker.busy = reason is not None
        else:
            self._refresh_worker(worker)

    def _refresh_worker(self, worker: Worker) -> None:
        with_data = [r for r in worker.ranks if r.has_data]
        worker.busy = worker_busy([r.busy_reason for r in with_data])
        classes = len(self.shares)
        if classes > 1:
            worker.busy_by_class = [worker.busy] + [
                worker_busy([r.class_reasons[c - 1] for r in with_data]) for c in range(1, classes)
            ]
        elif worker.busy_by_class:
            worker.busy_by_class = []

    # ----- router estimates ----------------------------------------------------------

    def dispatch(self, worker: Worker, rank: Rank, prompt_tokens: int) -> Ticket:
        blocks = _ceil_div(prompt_tokens, worker.block_size)
        rank.inflight += 1
        rank.est_blocks += blocks
        rank.est_prefill += prompt_tokens
        self._refresh_rank(worker, rank)
        self.replica.estimates_changed()
        return Ticket(worker, rank, prompt_tokens, blocks, 0, True, self.clock())

    def generated(self, ticket: Ticket, tokens: int) -> None:
        """``tokens`` more output tokens were seen for this request."""
        if ticket.released or tokens <= 0:
            return
        rank = ticket.rank
        first = ticket.in_prefill
        if first:
            ticket.in_prefill = False
            rank.est_prefill -= ticket.prompt_tokens
        ticket.generated += tokens
        if self.track_output_blocks:
            blocks = _ceil_div(ticket.prompt_tokens + ticket.generated, ticket.worker.block_size)
            rank.est_blocks += blocks - ticket.blocks
            ticket.blocks = blocks
        self._refresh_rank(ticket.worker, rank)
        self.replica.estimates_changed()
        if first and self.on_capacity is not None:
            self.on_capacity(ticket.worker.model)

    def prefill_done(self, ticket: Ticket) -> None:
        """The response started without a token count: the prompt leaves prefill."""
        if ticket.released or not ticket.in_prefill:
            return
        ticket.in_prefill = False
        rank = ticket.rank
        rank.est_prefill -= ticket.prompt_tokens
        self._refresh_rank(ticket.worker, rank)
        self.replica.estimates_changed()
        if self.on_capacity is not None:
            self.on_capacity(ticket.worker.model)

    def release(self, ticket: Ticket) -> None:
        """Idempotent: the request is over (finished, failed or abandoned)."""
        if ticket.released:
            return
        ticket.released = True
        rank = ticket.rank
        rank.inflight -= 1
        rank.est_blocks -= ticket.blocks
        if ticket.in_prefill:
            rank.est_prefill -= ticket.prompt_tokens
        model = ticket.worker.model
        duration = self.clock() - ticket.started
        prev = self._duration_ewma.get(model)
        self._duration_ewma[model] = duration if prev is None else prev * 0.9 + duration * 0.1
        self._refresh_rank(ticket.worker, rank)
        self.replica.estimates_changed()
        if self.on_capacity is not None:
            self.on_capacity(model)

    def move(self, ticket: Ticket, to: Worker | None, rank: Rank | None = None) -> None:
        """The request is served by ``to`` (rank ``rank``), not by the worker it was
        dispatched to: an Envoy retry moved it. Its estimate (in-flight count, blocks,
        prefill while in prefill) leaves the old rank and joins the new one, blocks counted
        with the new worker's block size; without ``rank``, the new worker's rank with the
        fewest router-tracked requests in flight (the lowest index on a tie).

        ``to`` None (the serving host is not a known worker): the estimate is released and
        nothing is counted anywhere, as if the request had ended, though no duration is
        recorded for ``retry_after``. A released ticket, or a move to its own rank, changes
        nothing.
        """
        if ticket.released:
            return
        old_worker, old_rank = ticket.worker, ticket.rank
        if to is not None:
            if rank is None:
                rank = min(to.ranks, key=lambda r: (r.inflight, r.index))
            if to is old_worker and rank is old_rank:
                return
        old_rank.inflight -= 1
        old_rank.est_blocks -= ticket.blocks
        if ticket.in_prefill:
            old_rank.est_prefill -= ticket.prompt_tokens
        self._refresh_rank(old_worker, old_rank)
        if to is None or rank is None:
            ticket.released = True
        else:
            tokens = ticket.prompt_tokens + (ticket.generated if self.track_output_blocks else 0)
            ticket.blocks = _ceil_div(tokens, to.block_size)
            rank.inflight += 1
            rank.est_blocks += ticket.blocks
            if ticket.in_prefill:
                rank.est_prefill += ticket.prompt_tokens
            ticket.worker, ticket.rank = to, rank
            self._refresh_rank(to, rank)
        self.replica.estimates_changed()
        if self.on_capacity is not None:
            self.on_capacity(old_worker.model)

    def mark_overloaded(self, worker: Worker) -> None:
        """A worker-side rejection: skip it until its next load report or 1 s."""
        worker.overloaded_until = self.clock() + OVERLOAD_MARK_SECONDS

    def mark_unreachable(self, worker: Worker) -> None:
        """Envoy could not reach it (a refused or reset connection): skip it for 1 s, load
        reports notwithstanding (a worker that reports may still be unreachable)."""
        worker.overloaded_until = worker.unreachable_until = self.clock() + OVERLOAD_MARK_SECONDS
