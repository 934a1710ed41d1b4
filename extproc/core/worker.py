"""One worker and its data-parallel ranks: what it announced, what it reports, what the
router estimates, and the busy flags a routing decision reads.

A :class:`Worker` is written only by the :class:`~extproc.core.pool.WorkerPool` that lists
it (announcements, load reports, router estimates, thresholds) and read by the decision
(:func:`~extproc.core.scheduling.is_free`). A :class:`Ticket` is one request dispatched to
a rank, held until its response ends. Plain values only: no I/O, no wire structs.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

from extproc.core.busy import RankLimits

DEFAULT_BLOCK_SIZE = 16
_NO_LIMITS = RankLimits(None, None, None)
WorkerType = Literal["decode", "prefill"]


class Rank:
    """One data-parallel rank: what the worker reported and what the router estimates."""

    __slots__ = (
        "busy_reason",
        "class_limits",
        "class_reasons",
        "est_blocks",
        "est_prefill",
        "index",
        "inflight",
        "limits",
        "peer_blocks",
        "peer_inflight",
        "peer_prefill",
        "reported_active_slots",
        "reported_at",
        "reported_blocks",
        "reported_kv_total",
        "reported_prefill",
        "reported_total_slots",
        "reported_waiting",
    )

    def __init__(self, index: int) -> None:
        self.index = index
        self.reported_blocks: int | None = None
        self.reported_prefill: int | None = None
        self.reported_kv_total: int | None = None
        self.reported_at: float | None = None
        # The engine's queue on this rank (None: not reported): requests waiting, running,
        # and the most it runs at once. They feed deadline admission, never the busy rules.
        self.reported_waiting: int | None = None
        self.reported_active_slots: int | None = None
        self.reported_total_slots: int | None = None
        self.est_blocks = 0
        self.est_prefill = 0
        self.inflight = 0
        # The other replicas' estimates for this rank, summed (docs/replicas.md).
        self.peer_inflight = 0
        self.peer_blocks = 0
        self.peer_prefill = 0
        self.limits = _NO_LIMITS
        self.busy_reason: str | None = None
        # The other request classes' limits and reasons (class 0, the default, is above).
        self.class_limits: list[RankLimits] = []
        self.class_reasons: list[str | None] = []

    def reason_for(self, variant: int) -> str | None:
        """The check that fires for class variant ``variant`` (an index of the pool's
        shares; 0 = the default class)."""
        return self.busy_reason if variant == 0 else self.class_reasons[variant - 1]

    @property
    def has_data(self) -> bool:
        return self.reported_at is not None or self.inflight > 0 or self.peer_inflight > 0

    @property
    def decode_blocks(self) -> int | None:
        """Effective active blocks: max(reported, router estimate), None if neither.

        The router estimate is this replica's plus the other replicas' (when shared)."""
        rep = self.reported_blocks
        if self.inflight or self.peer_inflight:
            est = self.est_blocks + self.peer_blocks
            return est if rep is None or est > rep else rep
        return rep

    @property
    def prefill_tokens(self) -> int | None:
        """Effective active prefill tokens: max(reported, router estimate)."""
        rep = self.reported_prefill
        if self.inflight or self.peer_inflight:
            est = self.est_prefill + self.peer_prefill
            return est if rep is None or est > rep else rep
        return rep


class Worker:
    """One worker (an engine process group behind one endpoint)."""

    __slots__ = (
        "addresses",
        "block_size",
        "busy",
        "busy_by_class",
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
        "unreachable_until",
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
        # Envoy could not connect to it: skipped until then, whatever it reports.
        self.unreachable_until = 0.0
        self.last_seq: int | None = None
        self.busy = False
        # Busy per request class, kept only with more than one class ([0] is ``busy``).
        self.busy_by_class: list[bool] = []
        # floor(--router-queue-threshold x max_num_batched_tokens), None = never queue.
        self.queue_limit: int | None = None
        # The ``ip:port`` forms of an endpoint announced by host name, once looked up
        # (Envoy names a served host by its address); empty for an IP endpoint.
        self.addresses: frozenset[str] = frozenset()

    def serves_at(self, address: str) -> bool:
        """Whether ``address`` (an ``ip:port`` Envoy connected to) is this worker's endpoint,
        as announced or as its host name resolved."""
        return address == self.endpoint or address in self.addresses

    def kv_total(self, rank: Rank) -> int | None:
        return (
            rank.reported_kv_total if rank.reported_kv_total is not None else self.kv_total_blocks
        )

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
