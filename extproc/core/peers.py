"""What the replicas have in flight (docs/replicas.md).

Each replica publishes its own router estimate per worker rank (:func:`own_estimates`) as
a whole snapshot, on change and at an interval. :class:`PeerEstimates` keeps the latest
snapshot of every other replica and adds it into the ranks' ``peer_*`` sums, so the busy
rule and the pick see max(reported, own estimate + the others'). A snapshot replaces that
replica's previous one whole, so a lost message is repaired by the next. A replica that
says ``bye`` or is silent for longer than the TTL has its contribution removed; a
restarted replica comes back under a new id and starts from zero, so nothing is counted
twice."""

from __future__ import annotations

from collections.abc import Callable, Iterable
from dataclasses import dataclass, field

from extproc.core.pool import WorkerPool
from extproc.core.worker import Rank, Worker

# (worker_id, dp_rank, in flight, blocks, prefill tokens), as on the wire.
EstimateEntry = tuple[str, int, int, int, int]


def own_estimates(pool: WorkerPool) -> list[EstimateEntry]:
    """This replica's estimate per rank with requests in flight."""
    return [
        (w.worker_id, r.index, r.inflight, r.est_blocks, r.est_prefill)
        for w in pool.workers.values()
        for r in w.ranks
        if r.inflight
    ]


@dataclass
class _Peer:
    last_seen: float
    # Applied contributions, with the rank objects they were added to, so that a worker
    # that left and came back is never subtracted from.
    parts: list[tuple[Worker, Rank, int, int, int]] = field(default_factory=list)


class PeerEstimates:
    """The other replicas' snapshots, summed into the pool's ranks."""

    def __init__(self, pool: WorkerPool, ttl: float, clock: Callable[[], float] | None = None):
        self.pool = pool
        self.ttl = ttl
        self.clock = clock or pool.clock
        self.peers: dict[str, _Peer] = {}

    def snapshot(self, replica_id: str, entries: Iterable[EstimateEntry]) -> None:
        """The whole current estimate of ``replica_id``; replaces its previous one."""
        if replica_id == self.pool.replica.replica_id:
            return  # our own, echoed back by a forwarder
        peer = self.peers.get(replica_id)
        if peer is None:
            peer = self.peers[replica_id] = _Peer(self.clock())
        peer.last_seen = self.clock()
        touched = self._withdraw(peer)
        workers = self.pool.workers
        parts = []
        for worker_id, index, inflight, blocks, prefill in entries:
            worker = workers.get(worker_id)
            if worker is None or index >= len(worker.ranks) or inflight <= 0:
                continue
            rank = worker.ranks[index]
            rank.peer_inflight += inflight
            rank.peer_blocks += blocks
            rank.peer_prefill += prefill
            parts.append((worker, rank, inflight, blocks, prefill))
            touched[id(rank)] = (worker, rank)
        peer.parts = parts
        self._refresh(touched)

    def leave(self, replica_id: str) -> bool:
        """``replica_id`` is gone: its contribution is removed now."""
        peer = self.peers.pop(replica_id, None)
        if peer is None:
            return False
        self._refresh(self._withdraw(peer))
        return True

    def expire(self) -> list[str]:
        """Remove the replicas silent for longer than the TTL; returns their ids."""
        cutoff = self.clock() - self.ttl
        gone = [rid for rid, p in self.peers.items() if p.last_seen < cutoff]
        for rid in gone:
            self.leave(rid)
        return gone

    def inflight(self) -> dict[str, int]:
        """Requests in flight per other replica, for diagnostics."""
        return {rid: sum(p[2] for p in peer.parts) for rid, peer in self.peers.items()}

    @staticmethod
    def _withdraw(peer: _Peer) -> dict[int, tuple[Worker, Rank]]:
        touched: dict[int, tuple[Worker, Rank]] = {}
        for worker, rank, inflight, blocks, prefill in peer.parts:
            rank.peer_inflight -= inflight
            rank.peer_blocks -= blocks
            rank.peer_prefill -= prefill
            touched[id(rank)] = (worker, rank)
        peer.parts = []
        return touched

    def _refresh(self, touched: dict[int, tuple[Worker, Rank]]) -> None:
        pool = self.pool
        for worker, rank in touched.values():
            if pool.workers.get(worker.worker_id) is worker:
                pool.refresh_rank(worker, rank)
