"""Requests held in the router for a slot, earliest deadline first.

A request is held when no worker can start it now but a worker is predicted to give it a
first token within its target (the deadline rule, ``core/deadline.py``). Its deadline is
the latest moment it can still be dispatched and meet the target; held requests go out in
deadline order, ties in arrival order, and a slot that frees is filled at once:
:func:`fill_slots` gives every free slot a held request it may go to, so no slot sits idle
while one waits. A request past its deadline leaves the queue (:meth:`HeldQueue.expire`)
for the overload reply. Pure: plain values, times passed in; the request path owns the
waiting itself.
"""

from __future__ import annotations

import bisect
from collections.abc import Hashable, Iterator, Mapping
from dataclasses import dataclass


@dataclass(frozen=True, slots=True)
class Held:
    """One held request: ``key`` is the caller's handle; ``workers`` those it may go to
    (None: any worker of the queue)."""

    key: Hashable
    deadline: float
    since: float
    workers: frozenset[str] | None = None
    order: float = 0.0  # the deadline it is served by (set by HeldQueue.push)

    def fits(self, worker: str) -> bool:
        return self.workers is None or worker in self.workers


class HeldQueue:
    """Held requests in the order of the deadline they are served by (ties: first pushed
    first).

    A request's ``order`` is its deadline unless given: a request of the best class, admitted
    on its mean prediction, is answered at the deadline that mean gives it but served by the
    one its prediction's spread would give it, as a request of a lesser class with the same
    target and arrival is; ordered by its later deadline, it would be served after those."""

    __slots__ = ("_at", "_by_deadline", "_held", "_order", "_seq")

    def __init__(self) -> None:
        self._order: list[tuple[float, int]] = []  # (order, seq), sorted
        self._by_deadline: list[tuple[float, int]] = []  # (deadline, seq), sorted
        self._held: dict[int, Held] = {}  # seq -> the request
        self._at: dict[Hashable, int] = {}  # key -> its seq
        self._seq = 0

    def __len__(self) -> int:
        return len(self._order)

    def __contains__(self, key: Hashable) -> bool:
        return key in self._at

    def __iter__(self) -> Iterator[Held]:
        """Held requests in the order they are served (earliest ``order`` first)."""
        return iter([self._held[seq] for _, seq in self._order])

    def push(
        self,
        key: Hashable,
        deadline: float,
        since: float,
        workers: frozenset[str] | None = None,
        order: float | None = None,
    ) -> Held:
        """Hold ``key`` until ``deadline``, served by ``order`` (None: by ``deadline``; it
        is at most ``deadline``); a key already held is an error."""
        if key in self._at:
            raise ValueError(f"held request {key!r} is already in the queue")
        rank = deadline if order is None else min(order, deadline)
        seq = self._seq
        self._seq += 1
        held = Held(key, deadline, since, workers, rank)
        bisect.insort(self._order, (rank, seq))
        bisect.insort(self._by_deadline, (deadline, seq))
        self._held[seq] = held
        self._at[key] = seq
        return held

    def remove(self, key: Hashable) -> Held | None:
        """Take ``key`` out (the client went away); None if it is not held."""
        seq = self._at.pop(key, None)
        if seq is None:
            return None
        held = self._held.pop(seq)
        del self._order[bisect.bisect_left(self._order, (held.order, seq))]
        del self._by_deadline[bisect.bisect_left(self._by_deadline, (held.deadline, seq))]
        return held

    def first_deadline(self) -> float | None:
        """The earliest deadline held (when the next one is answered); None when empty."""
        return self._by_deadline[0][0] if self._by_deadline else None

    def peek_for(self, worker: str) -> Held | None:
        """The first request in serving order that may go to ``worker``, left in the
        queue."""
        for _, seq in self._order:
            held = self._held[seq]
            if held.fits(worker):
                return held
        return None

    def pop_for(self, worker: str) -> Held | None:
        """A slot freed on ``worker``: take the first request in serving order that may go
        there.
        Call :meth:`expire` first to leave out the requests already too late."""
        held = self.peek_for(worker)
        if held is not None:
            self.remove(held.key)
        return held

    def expire(self, now: float) -> list[Held]:
        """Take out every request whose deadline has passed (``deadline < now``)."""
        gone = []
        while self._by_deadline and self._by_deadline[0][0] < now:
            held = self._held[self._by_deadline[0][1]]
            self.remove(held.key)
            gone.append(held)
        return gone

    def ahead_of(self, order: float, workers: frozenset[str] | None = None) -> int:
        """How many held requests go before a new one served by ``order`` (ties go first:
        they were pushed earlier) and share a worker with ``workers`` (None: any)."""
        count = 0
        for _, seq in self._order:
            held = self._held[seq]
            if held.order > order:
                break
            if workers is None or held.workers is None or not held.workers.isdisjoint(workers):
                count += 1
        return count

    def oldest_since(self) -> float | None:
        """When the longest-held request was pushed; None when the queue is empty."""
        return min((h.since for h in self._held.values()), default=None)


def fill_slots(queue: HeldQueue, free: Mapping[str, int]) -> list[tuple[Held, str]]:
    """Give every free slot a held request, in serving order (earliest deadline first).

    ``free`` is the free slots per worker, in the order the caller prefers them (the
    smallest predicted TTFT first). Each held request, in serving order, goes to the first
    worker it may go to that still has a free slot. Afterwards no worker with a free slot
    has a held request it could take, and each worker received its requests in serving
    order. Returns the (request, worker) pairs taken out of ``queue``, in dispatch order.
    """
    left = {w: n for w, n in free.items() if n > 0}
    out: list[tuple[Held, str]] = []
    if not left:
        return out
    for held in list(queue):
        worker = next((w for w in left if held.fits(w)), None)
        if worker is None:
            continue
        queue.remove(held.key)
        out.append((held, worker))
        left[worker] -= 1
        if not left[worker]:
            del left[worker]
            if not left:
                break
    return out
