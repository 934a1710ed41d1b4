"""When full workers free a slot, from how long each running request has run.

A worker's recent slot times (the last ``EWMA_SAMPLES`` times a request held a slot, its
decode plus its prefill) give the survival ``S(x)``: the share of requests that hold a slot
longer than ``x``, smoothed by a normal kernel (bandwidth by Silverman's rule, at least
``BANDWIDTH_MIN`` of the median slot time, so that equal samples still leave some jitter;
the kernel's mass below 0 left out). A request that has held its slot ``a`` seconds still
holds it ``t`` seconds later with probability ``S(a + t) / S(a)``; one that has run past
nearly all of them (``S(a) < TAIL``) is taken to hold it for an exponential time of mean
``a`` (nothing is known but that it has lasted ``a``: the rule of the doubling time). The
requests end independently, so the number ended by ``t`` is a sum of independent
Bernoulli variables (Poisson-binomial), and a request with ``n - 1`` others ahead of it in
line gets the slot of the ``n``-th end: its wait is ``t`` with ``P(fewer than n ended by t)``
falling through 0.9 (the 10th percentile), 0.5 (the median, the wait predicted) and 0.1
(the 90th). Only the requests running now are counted: a wait that needs more ends than
run is left to the memoryless rate (``core/deadline.py``).

Where the requests' lengths are alike (a benchmark's fixed ``max_tokens``, a deployment's
typical answer), this knows that the oldest request ends soon and the others much later; a
memoryless rate (each running request ending at ``1 / service``, the first of ``k`` after an
exponential time of mean ``service / k``) puts the 90th percentile of the same wait at 2.3 x
its mean whatever the ages say.

Pure: plain values, times passed in, no I/O.
"""

from __future__ import annotations

import bisect
import math
import statistics
from collections.abc import Sequence
from dataclasses import dataclass

BANDWIDTH_MIN = 0.01  # of the median slot time: the least jitter a slot time is taken to have
TAIL = 0.02  # a request whose age leaves less than this share of slot times past it: the tail
GRID = 128  # points of the survival table
SURE = 0.999  # the percentiles are searched below the time by which they ended this surely
BISECT_STEPS = 12  # a percentile is searched to within 1/4096 of the span it lies in ...
CHANCE_CLOSE = 1e-5  # ... or this close to its chance


class Survival:
    """``S(x)``: the share of slot times longer than ``x``, from ``samples`` (seconds, at
    least one), smoothed (the module's rule); a table, linear between its points."""

    __slots__ = ("hi", "lo", "step", "table")

    def __init__(self, samples: Sequence[float]) -> None:
        if not samples:
            raise ValueError("samples: empty; expected at least one slot time")
        s = sorted(samples)
        m = len(s)
        spread = statistics.pstdev(s) if m > 1 else 0.0
        width = max(BANDWIDTH_MIN * statistics.median(s), 1.06 * spread * m**-0.2, 1e-6)
        self.lo = max(0.0, s[0] - 4.0 * width)  # S is 1 below it
        self.hi = s[-1] + 4.0 * width  # and 0 above it
        self.step = (self.hi - self.lo) / (GRID - 1)
        scale = width * math.sqrt(2.0)

        def longer(y: float) -> float:
            return sum(0.5 * math.erfc((y - x) / scale) for x in s)

        # No slot time is negative: the kernel's mass below 0 is left out (S(0) = 1).
        whole = longer(0.0)
        self.table = [longer(self.lo + i * self.step) / whole for i in range(GRID)]

    def __call__(self, x: float) -> float:
        if x <= self.lo:
            return 1.0
        if x >= self.hi:
            return 0.0
        f = (x - self.lo) / self.step
        i = int(f)
        if i >= GRID - 1:
            return self.table[-1]
        frac = f - i
        return self.table[i] * (1.0 - frac) + self.table[i + 1] * frac


@dataclass(frozen=True, slots=True)
class FirstFree:
    """The wait for a slot to free (seconds): its median and 10th and 90th percentiles."""

    median: float
    low: float
    high: float


class _Running:
    """The running requests of the full workers, each with its worker's survival."""

    __slots__ = ("his", "lows", "reqs", "tails")

    def __init__(self, running: Sequence[tuple[float, Survival]]) -> None:
        reqs: list[tuple[float, float, Survival, float]] = []
        self.tails: list[float] = []  # past their slot times: exponential, mean = their age
        for age, s in running:
            start = s(age)
            if start < TAIL:
                self.tails.append(1.0 / max(age, 1e-6))
            else:
                reqs.append((s.lo - age, age, s, start))
        # Those that may end soonest first: :meth:`fewer` stops at the first whose slot
        # times all lie beyond ``age + t`` (it cannot have ended by then).
        reqs.sort(key=lambda r: r[0])
        self.lows = [r[0] for r in reqs]
        self.his = [r[2].hi - r[1] for r in reqs]  # by when each has surely ended
        # What S(age + t) needs, per request: its table from ``age`` on, in table steps.
        self.reqs = [
            (r[2].table, (r[1] - r[2].lo) / r[2].step, 1.0 / r[2].step, r[3]) for r in reqs
        ]

    def fewer(self, t: float, n: int) -> float:
        """The chance that fewer than ``n`` of them have ended ``t`` seconds from now."""
        ended = [-math.expm1(-t * rate) for rate in self.tails]
        last = GRID - 1
        his, reqs = self.his, self.reqs
        for i in range(bisect.bisect_right(self.lows, t)):
            if t >= his[i]:
                ended.append(1.0)
                continue
            table, offset, per, start = reqs[i]
            f = offset + t * per  # S(age + t), as Survival.__call__ (inline: the hot loop)
            if f <= 0.0:
                continue  # it cannot have ended yet
            j = int(f)
            after = table[-1] if j >= last else table[j] + (table[j + 1] - table[j]) * (f - j)
            ended.append(1.0 - after / start)
        if n == 1:  # none ended: the product of each one's survival
            alive = 1.0
            for p in ended:
                alive *= 1.0 - p
            return alive
        dist = [1.0] + [0.0] * (n - 1)  # P(j ended), j < n
        for p in ended:
            for j in range(n - 1, 0, -1):
                dist[j] = dist[j] * (1.0 - p) + dist[j - 1] * p
            dist[0] *= 1.0 - p
        return sum(dist)

    def quantile(self, share: float, n: int, lo: float, hi: float) -> float:
        """The ``t`` by which ``n`` of them have ended with chance ``share``, between ``lo``
        (not yet) and ``hi`` (by then): regula falsi (the Illinois variant), to within
        ``1 / 2**BISECT_STEPS`` of the span or ``CHANCE_CLOSE`` of the chance."""
        goal = 1.0 - share
        f_lo, f_hi = self.fewer(lo, n) - goal, self.fewer(hi, n) - goal
        if f_lo <= 0.0:
            return lo
        close = (hi - lo) / 2**BISECT_STEPS
        side = 0
        for _ in range(4 * BISECT_STEPS):
            if hi - lo <= close:
                break
            mid = (lo * f_hi - hi * f_lo) / (f_hi - f_lo) if f_lo != f_hi else 0.5 * (lo + hi)
            if not lo < mid < hi:
                mid = 0.5 * (lo + hi)
            f_mid = self.fewer(mid, n) - goal
            if abs(f_mid) <= CHANCE_CLOSE:
                return mid
            if f_mid > 0.0:  # not yet
                lo, f_lo = mid, f_mid
                if side == 1:
                    f_hi *= 0.5
                side = 1
            else:
                hi, f_hi = mid, f_mid
                if side == -1:
                    f_lo *= 0.5
                side = -1
        return hi


def nth_free(running: Sequence[tuple[float, Survival]], n: int = 1) -> FirstFree | None:
    """When the ``n``-th of ``running`` (each request's age in its slot, and its worker's
    survival) frees its slot (the module's rule). None: fewer than ``n`` run (the later
    slots depend on requests not started yet)."""
    if n < 1 or len(running) < n:
        return None
    r = _Running(running)
    # From the first time by which one of them has surely ended (or, all in the tail, a few
    # of their mean waits), doubled until n of them have ended surely enough.
    hi = max(min(r.his) if r.his else 8.0 / sum(r.tails), 1e-4)
    for _ in range(64):
        if r.fewer(hi, n) <= 1.0 - SURE:
            break
        hi *= 2.0
    median = r.quantile(0.5, n, 0.0, hi)
    return FirstFree(median, r.quantile(0.1, n, 0.0, median), r.quantile(0.9, n, median, hi))


def first_free(running: Sequence[tuple[float, Survival]]) -> FirstFree | None:
    """When the first of ``running`` frees its slot; None: nothing runs."""
    return nth_free(running, 1)
