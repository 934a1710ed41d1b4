"""What is known about workers: config, per-rank load, router estimates, thresholds.

One :class:`WorkerPool` holds it all. The event subscriber writes reported
load, the request path writes router estimates (dispatch / first token /
release), the admin API writes thresholds. After every write the touched
worker's busy flag is recomputed, so a routing decision only reads flags.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass

from extproc.core.allowlist import WorkerAllowList
from extproc.core.busy import (
    BusyThresholds,
    RankLimits,
    rank_busy_reason,
    rank_limits,
    scaled_limit,
    worker_busy,
)
from extproc.events.schema import (
    DROP_NOT_ALLOWED,
    DROP_SCHEMA,
    ByeEvent,
    ConfigEvent,
    Event,
    EventRejected,
    LoadEvent,
)

DEFAULT_BLOCK_SIZE = 16
OVERLOAD_MARK_SECONDS = 1.0
_NO_LIMITS = RankLimits(None, None, None)


class Rank:
    """One data-parallel rank: what the worker reported and what the router estimates."""

    __slots__ = (
        "busy_reason",
        "est_blocks",
        "est_prefill",
        "index",
        "inflight",
        "limits",
        "reported_at",
        "reported_blocks",
        "reported_kv_total",
        "reported_prefill",
    )

    def __init__(self, index: int) -> None:
        self.index = index
        self.reported_blocks: int | None = None
        self.reported_prefill: int | None = None
        self.reported_kv_total: int | None = None
        self.reported_at: float | None = None
        self.est_blocks = 0
        self.est_prefill = 0
        self.inflight = 0
        self.limits = _NO_LIMITS
        self.busy_reason: str | None = None

    @property
    def has_data(self) -> bool:
        return self.reported_at is not None or self.inflight > 0

    @property
    def decode_blocks(self) -> int | None:
        """Effective active blocks: max(reported, router estimate), None if neither."""
        rep = self.reported_blocks
        if self.inflight:
            return self.est_blocks if rep is None or self.est_blocks > rep else rep
        return rep

    @property
    def prefill_tokens(self) -> int | None:
        """Effective active prefill tokens: max(reported, router estimate)."""
        rep = self.reported_prefill
        if self.inflight:
            return self.est_prefill if rep is None or self.est_prefill > rep else rep
        return rep


class Worker:
    """One worker (an engine process group behind one endpoint)."""

    __slots__ = (
        "block_size",
        "busy",
        "configured",
        "dp_size",
        "endpoint",
        "kv_total_blocks",
        "last_load_at",
        "last_seen",
        "last_seq",
        "max_num_batched_tokens",
        "model",
        "overloaded_until",
        "queue_limit",
        "ranks",
        "worker_id",
        "worker_type",
    )

    def __init__(self, worker_id: str, now: float) -> None:
        self.worker_id = worker_id
        self.model = ""
        self.endpoint = ""
        self.kv_total_blocks: int | None = None
        self.block_size = DEFAULT_BLOCK_SIZE
        self.max_num_batched_tokens: int | None = None
        self.dp_size = 1
        self.worker_type = "decode"
        self.configured = False
        self.ranks: list[Rank] = [Rank(0)]
        self.last_seen = now
        self.last_load_at: float | None = None
        self.overloaded_until = 0.0
        self.last_seq: int | None = None
        self.busy = False
        # floor(--router-queue-threshold x max_num_batched_tokens), None = never queue.
        self.queue_limit: int | None = None

    def kv_total(self, rank: Rank) -> int | None:
        return (
            rank.reported_kv_total if rank.reported_kv_total is not None else self.kv_total_blocks
        )

    def overloaded(self, now: float) -> bool:
        return now < self.overloaded_until

    def state(self, now: float) -> str:
        """``overloaded`` (mark) else ``busy`` else ``free``: disjoint, for /health."""
        if now < self.overloaded_until:
            return "overloaded"
        return "busy" if self.busy else "free"


@dataclass(slots=True)
class Ticket:
    """A request dispatched to a rank, held until its response ends."""

    worker: Worker
    rank: Rank
    prompt_tokens: int
    blocks: int
    generated: int
    in_prefill: bool
    started: float
    released: bool = False


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
        self.thresholds: dict[str, BusyThresholds] = {}
        self.events_lost = 0
        self._duration_ewma: dict[str, float] = {}
        self.queue_threshold = queue_threshold
        self.on_change: list[Callable[[], None]] = []
        # Called with a model when its router-tracked prefill may have dropped.
        self.on_capacity: Callable[[str], None] | None = None

    # ----- reading -----------------------------------------------------------------

    def eligible(self, model: str) -> list[Worker] | None:
        return self.by_model.get(model)

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

    # ----- events ------------------------------------------------------------------

    def apply(self, event: Event) -> None:
        """Apply one validated event; raise EventRejected to drop it unapplied."""
        if type(event) is LoadEvent:
            self._apply_load(event)
        elif type(event) is ConfigEvent:
            self._apply_config(event)
        else:
            assert type(event) is ByeEvent
            self.remove(event.worker_id)

    def _apply_config(self, ev: ConfigEvent) -> None:
        if not self.allow.allows(ev.endpoint):
            raise EventRejected(DROP_NOT_ALLOWED, f"endpoint {ev.endpoint} not in --worker-allow")
        now = self.clock()
        worker = self.workers.get(ev.worker_id)
        if worker is None:
            worker = self.workers[ev.worker_id] = Worker(ev.worker_id, now)
        worker.last_seen = now
        if worker.configured and (worker.model != ev.model or worker.endpoint != ev.endpoint):
            self._unlink(worker)
        dp_size = ev.dp_size or 1
        if dp_size != len(worker.ranks):
            ranks = worker.ranks[:dp_size]
            ranks.extend(Rank(i) for i in range(len(ranks), dp_size))
            worker.ranks = ranks
        worker.endpoint = ev.endpoint
        worker.kv_total_blocks = ev.kv_total_blocks
        worker.block_size = ev.block_size or DEFAULT_BLOCK_SIZE
        worker.max_num_batched_tokens = ev.max_num_batched_tokens
        worker.dp_size = dp_size
        worker.worker_type = ev.worker_type or "decode"
        worker.queue_limit = (
            scaled_limit(self.queue_threshold, ev.max_num_batched_tokens)
            if self.queue_threshold is not None and ev.max_num_batched_tokens
            else None
        )
        if not worker.configured or worker.model != ev.model:
            worker.model = ev.model
            worker.configured = True
            if ev.model not in self.thresholds:
                self.thresholds[ev.model] = self.defaults
            group = self.by_model.setdefault(ev.model, [])
            if worker not in group:
                group.append(worker)
        self._recompute_limits(worker)
        self._changed()
        if self.on_capacity is not None:
            self.on_capacity(worker.model)

    def _apply_load(self, ev: LoadEvent) -> None:
        now = self.clock()
        worker = self.workers.get(ev.worker_id)
        if worker is None:
            worker = self.workers[ev.worker_id] = Worker(ev.worker_id, now)
        index = ev.dp_rank or 0
        if index >= len(worker.ranks):
            if worker.configured:
                raise EventRejected(
                    DROP_SCHEMA, f"dp_rank {index} >= dp_size {worker.dp_size} of {ev.worker_id}"
                )
            worker.ranks.extend(Rank(i) for i in range(len(worker.ranks), index + 1))
        if ev.seq is not None:
            last = worker.last_seq
            if last is not None and ev.seq > last + 1:
                self.events_lost += ev.seq - last - 1
            worker.last_seq = ev.seq
        rank = worker.ranks[index]
        rank.reported_blocks = ev.active_decode_blocks
        rank.reported_prefill = ev.active_prefill_tokens
        kv_changed = rank.reported_kv_total != ev.kv_total_blocks
        rank.reported_kv_total = ev.kv_total_blocks
        rank.reported_at = now
        worker.last_seen = now
        worker.last_load_at = now
        worker.overloaded_until = 0.0
        if kv_changed:
            rank.limits = self._limits(worker, rank)
        self._refresh_rank(worker, rank)

    def remove(self, worker_id: str) -> bool:
        worker = self.workers.pop(worker_id, None)
        if worker is None:
            return False
        if worker.configured:
            self._unlink(worker)
        self._changed()
        return True

    def expire(self) -> list[str]:
        """Remove workers silent for longer than the TTL; returns their ids."""
        cutoff = self.clock() - self.worker_ttl
        gone = [wid for wid, w in self.workers.items() if w.last_seen < cutoff]
        for wid in gone:
            self.remove(wid)
        return gone

    def _unlink(self, worker: Worker) -> None:
        group = self.by_model.get(worker.model)
        if group is not None and worker in group:
            group.remove(worker)
            if not group:
                del self.by_model[worker.model]

    # ----- thresholds --------------------------------------------------------------

    def set_thresholds(self, model: str, thresholds: BusyThresholds) -> None:
        """Takes effect for the very next decision."""
        self.thresholds[model] = thresholds
        for worker in self.by_model.get(model, ()):
            self._recompute_limits(worker)

    def _limits(self, worker: Worker, rank: Rank) -> RankLimits:
        return rank_limits(
            self.thresholds_for(worker.model),
            kv_mode=self.kv_mode,
            kv_total_blocks=worker.kv_total(rank),
            max_num_batched_tokens=worker.max_num_batched_tokens,
        )

    def _recompute_limits(self, worker: Worker) -> None:
        for rank in worker.ranks:
            rank.limits = self._limits(worker, rank)
            rank.busy_reason = rank_busy_reason(
                rank.limits, rank.decode_blocks, rank.prefill_tokens
            )
        self._refresh_worker(worker)

    def _refresh_rank(self, worker: Worker, rank: Rank) -> None:
        reason = rank_busy_reason(rank.limits, rank.decode_blocks, rank.prefill_tokens)
        rank.busy_reason = reason
        if len(worker.ranks) == 1:
            # The common case, once per load event. A rank without data has no load to
            # fire a check (reason None), so this is worker_busy() of its one rank.
            worker.busy = reason is not None
        else:
            self._refresh_worker(worker)

    @staticmethod
    def _refresh_worker(worker: Worker) -> None:
        worker.busy = worker_busy([r.busy_reason for r in worker.ranks if r.has_data])

    def _changed(self) -> None:
        for callback in self.on_change:
            callback()

    # ----- router estimates ----------------------------------------------------------

    def dispatch(self, worker: Worker, rank: Rank, prompt_tokens: int) -> Ticket:
        blocks = _ceil_div(prompt_tokens, worker.block_size)
        rank.inflight += 1
        rank.est_blocks += blocks
        rank.est_prefill += prompt_tokens
        self._refresh_rank(worker, rank)
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
        if self.on_capacity is not None:
            self.on_capacity(model)

    def mark_overloaded(self, worker: Worker) -> None:
        """A worker-side rejection: skip it until its next load report or 1 s."""
        worker.overloaded_until = self.clock() + OVERLOAD_MARK_SECONDS
