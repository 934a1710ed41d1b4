"""Deadline admission with plain values: the predictor and the admission against a plant that
queues (tests/core/plant.py), rule tables for the decision, properties of the held queue, and
missing inputs. Every plant run is seeded: the numbers below are reproducible exactly.

Measured by :func:`errors` on the cases of ``ACCURACY``, seeds 1-3: the relative error
|pred - true| / true of each TTFT after 60 s of warm-up, on the plant's defaults (8 slots,
prompts of 100-2000 tokens at 0.1 ms each, 20-300 output tokens at 10 ms each):

======================================  ==============  ==============  ================
load (x the plant's capacity)           this predictor  queue-blind     mean of last 32
======================================  ==============  ==============  ================
0.6 / 1.3 alternating every 30 s        median 7-8 %    median 97-98 %  median 41-46 %
                                        p90 17-23 %     p90 99 %        p90 98-160 %
same, no load reports (gateway only)    the same to     the same        the same
                                        0.1 point
steady 0.9                              median 15-16 %  median 85-87 %  median 47-56 %
                                        p90 49-57 %     p90 94-96 %     p90 330-350 %
======================================  ==============  ==============  ================

At a steady load the error is mostly the wait for one or two completions, which is random
whatever is known (its spread is what admission adds as a margin).
"""

from __future__ import annotations

import contextlib
import math
import statistics
from collections.abc import Callable, Hashable, Iterator, Sequence
from dataclasses import replace
from functools import partial

import pytest
from hypothesis import given
from hypothesis import strategies as st

from extproc.core import deadline as deadline_module
from extproc.core.deadline import (
    ACTIVE,
    COMPLETIONS,
    ENGINE_TTFT,
    GATEWAY,
    MIN_FIT_SAMPLES,
    PREFILL,
    STEP_MIN,
    STEP_SAMPLES,
    STEP_TRIGGER,
    TOTAL,
    WAITING,
    Dispatch,
    Hold,
    Prediction,
    PrefillFit,
    Reject,
    WorkerEstimate,
    decide,
    fits_now,
    pool_wait,
    predict_all,
    predict_ttft,
    still_fits,
)
from extproc.core.held import HeldQueue, fill_slots
from tests.core.plant import Engine, Params, Request, Router, Sim

# ----- the predictor against the plant ------------------------------------------------------


class Predicting(Router):
    """Dispatches everything at once to one engine; records this predictor's TTFT for each
    request."""

    def __init__(self) -> None:
        self.est = WorkerEstimate("w0")

    def predict(self, req: Request, now: float) -> float | None:
        return predict_ttft(self.est, req.prompt, 0, now).ttft

    def arrive(self, sim: Sim, req: Request, now: float) -> None:
        req.predicted = self.predict(req, now)
        self.est.dispatched(req.rid, req.prompt, now, arrived=req.arrived)
        sim.engines["w0"].dispatch(req, now)

    def first_byte(self, engine: Engine, req: Request, now: float) -> None:
        self.est.first_byte(req.rid, now)

    def ended(self, engine: Engine, req: Request, now: float) -> None:
        self.est.ended(req.rid, now, req.output)

    def load(self, engine: Engine, waiting: int, active: int, total: int, now: float) -> None:
        self.est.load(waiting, active, total)


class QueueBlind(Predicting):
    """Control: the same measurements, the wait for a slot left out."""

    def predict(self, req: Request, now: float) -> float | None:
        p = predict_ttft(self.est, req.prompt, 0, now)
        return p.prefill + p.gateway


class RecentMean(Predicting):
    """Control: the mean TTFT of the last 32 requests to reach their first token."""

    def __init__(self) -> None:
        super().__init__()
        self.recent: list[float] = []

    def predict(self, req: Request, now: float) -> float | None:
        last = self.recent[-32:]
        return sum(last) / len(last) if last else None

    def first_byte(self, engine: Engine, req: Request, now: float) -> None:
        super().first_byte(engine, req, now)
        self.recent.append(now - req.arrived)


def phased(lo: float, hi: float, cap: float) -> Callable[[float], float]:
    return lambda t: cap * (lo if (t // 30) % 2 == 0 else hi)


def errors(
    router: Predicting, params: Params, rate: Callable[[float], float], seed: int
) -> tuple[float, float]:
    """Median and 90th percentile of the relative error, after 60 s of warm-up."""
    reqs = Sim(params, router, seed).run(rate, 600.0)
    errs = sorted(
        abs(r.predicted - r.ttft) / r.ttft
        for r in reqs
        if r.arrived > 60.0 and r.predicted is not None and r.ttft
    )
    assert len(errs) > 1000
    return statistics.median(errs), errs[int(0.9 * len(errs))]


P = Params()
# (name, load over time, params, median bound, p90 bound)
ACCURACY = [
    ("a queue that builds and drains", phased(0.6, 1.3, P.capacity()), P, 0.12, 0.30),
    (
        "the same, no load reports: gateway timings alone",
        phased(0.6, 1.3, P.capacity()),
        replace(P, reports=False),
        0.12,
        0.30,
    ),
    ("steady 0.9 of capacity", lambda t: 0.9 * P.capacity(), P, 0.20, 0.60),
]


@pytest.mark.parametrize("seed", [1, 2, 3])
@pytest.mark.parametrize(
    ("name", "rate", "params", "median_max", "p90_max"), ACCURACY, ids=[c[0] for c in ACCURACY]
)
def test_the_prediction_follows_a_plant_that_queues(
    name: str,
    rate: Callable[[float], float],
    params: Params,
    median_max: float,
    p90_max: float,
    seed: int,
) -> None:
    median, p90 = errors(Predicting(), params, rate, seed)
    assert median < median_max and p90 < p90_max, (name, median, p90)


@pytest.mark.parametrize("control", [QueueBlind, RecentMean])
@pytest.mark.parametrize(
    ("name", "rate", "params", "median_max", "p90_max"), ACCURACY, ids=[c[0] for c in ACCURACY]
)
def test_a_predictor_blind_to_the_queue_fails_the_same_bounds(
    control: type[Predicting],
    name: str,
    rate: Callable[[float], float],
    params: Params,
    median_max: float,
    p90_max: float,
) -> None:
    """The control: the bounds above are not met by leaving out the queue, nor by the mean
    of the recent TTFTs (which lags every change of the queue)."""
    median, p90 = errors(control(), params, rate, 1)
    assert median > median_max and p90 > p90_max, (name, median, p90)


# ----- admission against the plant ----------------------------------------------------------

TARGET = 1.0


class LetAllIn(Router):
    """No admission: every request to the engine with the fewest requests."""

    def arrive(self, sim: Sim, req: Request, now: float) -> None:
        engine = min(sim.engines.values(), key=lambda e: e.running + len(e.waiting))
        engine.dispatch(req, now)


class Admitting(Router):
    """Deadline admission over the plant's engines: dispatch, hold (earliest deadline first,
    one queue for all) or reject each request; fill every slot that frees from the queue."""

    def __init__(self, target: float = TARGET, blind: bool = False, recheck: bool = True) -> None:
        self.target = target
        self.blind = blind
        self.recheck = recheck
        self.est: dict[str, WorkerEstimate] = {}
        self.held = HeldQueue()
        self.reqs: dict[Hashable, Request] = {}

    def estimates(self, sim: Sim) -> list[WorkerEstimate]:
        for name in sim.engines:
            self.est.setdefault(name, WorkerEstimate(name))
        return list(self.est.values())

    def send(self, sim: Sim, worker: str, req: Request, now: float, held: float = 0.0) -> None:
        req.decided = now
        self.est[worker].dispatched(req.rid, req.prompt, now, arrived=req.arrived, held=held)
        sim.engines[worker].dispatch(req, now)

    def pump(self, sim: Sim, now: float) -> None:
        for h in self.held.expire(now):
            self.reqs[h.key].outcome = "expired"
            self.reqs[h.key].decided = now
        if not self.held:
            return
        free = {}
        for est in sorted(self.estimates(sim), key=lambda e: -(e.rate(now) or 0.0)):
            n = est.free_slots(now)
            free[est.worker] = 10**9 if n is None else n
        for h, worker in fill_slots(self.held, free):
            self.send(sim, worker, self.reqs[h.key], now, now - h.since)
        if self.recheck:
            self.redecide(sim, now)

    def redecide(self, sim: Sim, now: float) -> None:
        """Each held request decided again on the prediction now, behind the held requests
        before it: one that no longer fits is rejected at once."""
        ests = self.estimates(sim)
        for ahead, h in enumerate(list(self.held)):
            req = self.reqs[h.key]
            preds = predict_all(ests, req.prompt, ahead, now)
            if not still_fits(preds, self.target, now, req.arrived):
                self.held.remove(h.key)
                req.outcome, req.decided = "rejected after a hold", now

    def arrive(self, sim: Sim, req: Request, now: float) -> None:
        self.reqs[req.rid] = req
        self.pump(sim, now)
        ests = self.estimates(sim)
        idle = min(e.idle_ttft(req.prompt) for e in ests)
        ahead = self.held.ahead_of(req.arrived + self.target - idle)
        preds = predict_all(ests, req.prompt, ahead, now)
        if self.blind:
            preds = [
                replace(p, ttft=p.prefill + p.gateway, wait=0.0, can_start=True) for p in preds
            ]
        d = decide(preds, self.target, now, arrived=req.arrived)
        if isinstance(d, Dispatch):
            req.predicted = d.prediction.ttft
            self.send(sim, d.worker, req, now)
        elif isinstance(d, Hold):
            req.outcome, req.decided = "held", now
            self.held.push(req.rid, d.deadline, now, d.workers)
            sim.at(d.deadline + 1e-9, lambda t: self.pump(sim, t))
        else:
            req.outcome, req.decided = "rejected", now

    def first_byte(self, engine: Engine, req: Request, now: float) -> None:
        self.est[engine.name].first_byte(req.rid, now)

    def tokens(self, engine: Engine, req: Request, count: int, now: float) -> None:
        self.est[engine.name].tokens(req.rid, now, count)

    def ended(self, engine: Engine, req: Request, now: float) -> None:
        self.est[engine.name].ended(req.rid, now, req.output)
        self.pump(engine.sim, now)

    def load(self, engine: Engine, waiting: int, active: int, total: int, now: float) -> None:
        self.est[engine.name].load(waiting, active, total)
        self.pump(engine.sim, now)


def admission(
    router: Router,
    params: Params,
    load: float,
    seed: int,
    workers: int = 1,
    slow: tuple[float, float] | None = None,
) -> dict[str, float]:
    """Offer ``load`` x capacity for 300 s (``slow``: from (time, factor) on, the first
    worker takes factor x as long); judge the requests that arrived after 30 s."""
    sim = Sim(params, router, seed, workers)
    if slow is not None:
        sim.slow_down(slow[0], "w0", slow[1])
    reqs = sim.run(lambda t: load * sim.capacity(), 300.0)
    window = [r for r in reqs if r.arrived > 30.0]
    admitted = [r for r in window if r.outcome == "dispatched" and r.ttft is not None]
    ttfts = sorted(r.ttft for r in admitted if r.ttft is not None)
    done = sum(1 for r in reqs if r.outcome == "dispatched" and r.ended and 30 < r.ended < 300)
    # The p99 TTFT of each 5-s window of arrivals; a window with nothing admitted is a miss.
    windows = []
    for start in range(30, 300, 5):
        w = sorted(r.ttft for r in admitted if start <= r.arrived < start + 5 and r.ttft)
        windows.append(w[int(0.99 * len(w))] if w else float("inf"))
    return {
        "offered": len(window),
        "admitted": len(ttfts),
        "expired": sum(1 for r in window if r.outcome == "expired"),
        "rejected_after_hold": sum(1 for r in window if r.outcome == "rejected after a hold"),
        "p99": ttfts[int(0.99 * len(ttfts))],
        "served_per_s": done / 270.0,
        "windows_within": sum(1 for v in windows if v <= TARGET) / len(windows),
    }


@pytest.mark.parametrize("params", [P, replace(P, reports=False)], ids=["slots", "gateway"])
@pytest.mark.parametrize("seed", [1, 2])
def test_admission_holds_the_target_at_3x_and_serves_all_that_fits(
    params: Params, seed: int
) -> None:
    """At 3x the plant's capacity: the admitted requests' p99 TTFT within the target, also
    in >= 95 % of the 5-s windows, and the plant serves >= 95 % of what it serves with every
    request let in (all its slots busy all the time). Measured: p99 0.88-0.89 s, windows
    98-100 %, 99-104 % served, 3-4 % of the admitted held past their deadline (a late
    rejection; 0-1 rejected earlier after a hold); blind to the queue: p99 1.7-2.1 s."""
    everything = admission(LetAllIn(), params, 3.0, seed)
    got = admission(Admitting(), params, 3.0, seed)
    assert got["p99"] <= TARGET, got
    assert got["windows_within"] >= 0.95, got
    assert got["served_per_s"] >= 0.95 * everything["served_per_s"], (got, everything)
    assert got["expired"] <= 0.05 * got["admitted"], got
    # The control: without admission, or blind to the queue, the target is not held.
    assert everything["p99"] > 10 * TARGET
    blind = admission(Admitting(blind=True), params, 3.0, seed)
    assert blind["p99"] > TARGET, blind


def test_admission_at_half_load_lets_nearly_everything_in() -> None:
    """Measured: 625 of 629 admitted, p99 0.44 s against 1 s."""
    got = admission(Admitting(), P, 0.5, 1)
    assert got["admitted"] >= 0.98 * got["offered"], got
    assert got["p99"] <= TARGET, got


def test_two_workers_one_slowing_down_at_3x() -> None:
    """Two workers share one held queue at 3x their capacity; at 150 s one becomes 2x slower.
    The target holds over each run and in >= 95 % of the 5-s windows of seeds 1 to 3; the
    plant serves >= 95 % of what it serves with every request let in. Measured over seeds 1
    to 8: p99 0.90-0.92 s, windows 94-100 % a run (97 % in all), 7-8 % of the admitted held
    past their deadline (5 % with no slowdown; 3 % with one worker; 2-3 rejected earlier
    after a hold): the held queue is longer, and a request held at the edge, its deadline at
    the 90th percentile of its wait, misses it 1 time in 10."""
    windows = []
    for seed in (1, 2, 3):
        everything = admission(LetAllIn(), P, 3.0, seed, workers=2, slow=(150.0, 2.0))
        got = admission(Admitting(), P, 3.0, seed, workers=2, slow=(150.0, 2.0))
        assert got["p99"] <= TARGET, got
        assert got["served_per_s"] >= 0.95 * everything["served_per_s"], (got, everything)
        assert got["expired"] <= 0.10 * got["admitted"], got
        windows.append(got["windows_within"])
    assert sum(windows) / len(windows) >= 0.95, windows
    blind = admission(Admitting(blind=True), P, 3.0, 1, workers=2, slow=(150.0, 2.0))
    assert blind["p99"] > TARGET, blind


# ----- the decision: a rule table ------------------------------------------------------------


def pred(
    worker: str = "a",
    ttft: float | None = 0.5,
    wait: float | None = 0.0,
    can_start: bool = True,
    prefill: float = 0.1,
    gateway: float = 0.0,
    idle: float | None = None,
    spread: float = 0.0,
    occupancy: int = 0,
) -> Prediction:
    return Prediction(
        worker,
        ttft,
        wait,
        prefill,
        gateway,
        0.0,
        can_start,
        prefill + gateway if idle is None else idle,
        spread,
        0.0,
        occupancy=occupancy,
    )


DECISIONS = [
    # (name, predictions, target, expected decision type, expected worker)
    ("free and fits: dispatch", [pred()], 1.0, Dispatch, "a"),
    ("exactly at the target fits", [pred(ttft=1.0)], 1.0, Dispatch, "a"),
    ("free but over the target: reject", [pred(ttft=1.5)], 1.0, Reject, None),
    ("spread counts: 0.9 + 0.2 > 1", [pred(ttft=0.9, spread=0.2)], 1.0, Reject, None),
    (
        "the smallest of the free ones",
        [pred("a", 0.6), pred("b", 0.3), pred("c", 0.1, 0.1, False)],
        1.0,
        Dispatch,
        "b",
    ),
    (
        "within the smallest's spread of it: the one holding the fewest requests",
        [pred("a", 0.30, spread=0.05, occupancy=9), pred("b", 0.34, occupancy=2)],
        1.0,
        Dispatch,
        "b",
    ),
    (
        "past the smallest's spread: the smallest, however many it holds",
        [pred("a", 0.30, spread=0.02, occupancy=9), pred("b", 0.34, occupancy=2)],
        1.0,
        Dispatch,
        "a",
    ),
    (
        "the same prediction and load: the first candidate",
        [pred("a", 0.3, occupancy=2), pred("b", 0.3, occupancy=2)],
        1.0,
        Dispatch,
        "a",
    ),
    (
        "a free one that fits beats a faster full one",
        [pred("a", 0.9), pred("b", 0.2, 0.1, False)],
        1.0,
        Dispatch,
        "a",
    ),
    ("full, wait fits: hold", [pred(ttft=0.8, wait=0.7, can_start=False)], 1.0, Hold, "a"),
    (
        "free but too slow, full one fits: hold for it",
        [pred("a", 1.4), pred("b", 0.8, 0.7, False)],
        1.0,
        Hold,
        "b",
    ),
    (
        "free with held ahead (wait > 0): hold",
        [pred(ttft=0.8, wait=0.7, can_start=True)],
        1.0,
        Hold,
        "a",
    ),
    ("full, wait too long: reject", [pred(ttft=3.0, wait=2.9, can_start=False)], 1.0, Reject, None),
    (
        "full, wait unknown: reject",
        [pred(ttft=None, wait=None, can_start=False)],
        1.0,
        Reject,
        None,
    ),
]


@pytest.mark.parametrize(
    ("name", "preds", "target", "kind", "worker"), DECISIONS, ids=[c[0] for c in DECISIONS]
)
def test_decision_rules(
    name: str, preds: list[Prediction], target: float, kind: type, worker: str | None
) -> None:
    d = decide(preds, target, now=100.0)
    assert isinstance(d, kind), (name, d)
    if worker is not None:
        assert getattr(d, "worker", None) == worker


def test_a_lenient_decision_still_spreads_near_equal_predictions_by_load() -> None:
    # The best class is judged without the spread, but two predictions within it are
    # still the same to the predictor: the less loaded worker takes the request.
    preds = [pred("a", 0.30, spread=0.05, occupancy=9), pred("b", 0.34, occupancy=2)]
    d = decide(preds, 1.0, now=100.0, lenient=True)
    assert isinstance(d, Dispatch) and d.worker == "b"


def test_a_hold_deadline_leaves_room_for_the_prefill_and_counts_from_arrival() -> None:
    p = replace(pred(ttft=0.7, wait=0.45, can_start=False, prefill=0.2, gateway=0.05), idle=0.25)
    d = decide([p], 1.0, now=100.3, arrived=100.0)
    assert d == Hold("a", 0.45, 100.0 + 1.0 - 0.2 - 0.05, frozenset({"a"}))
    # 0.3 s already gone: 0.75 no longer fits in the 0.7 left.
    assert isinstance(decide([replace(p, ttft=0.75)], 1.0, now=100.3, arrived=100.0), Reject)


def test_reject_says_whether_the_target_is_unreachable() -> None:
    slow = decide([pred(ttft=1.5, idle=1.5)], 1.0, now=0.0)
    assert isinstance(slow, Reject) and slow.unreachable and slow.idle == 1.5
    queued = decide([pred(ttft=3.0, wait=2.9, can_start=False, idle=0.1)], 1.0, now=0.0)
    assert isinstance(queued, Reject) and not queued.unreachable
    assert (queued.retry_after, queued.retry_after_ms) == (3, 2900)


def test_bad_decision_input_is_named() -> None:
    with pytest.raises(ValueError, match="predictions: empty"):
        decide([], 1.0, 0.0)
    with pytest.raises(ValueError, match="target_s: 0"):
        decide([pred()], 0.0, 0.0)


@given(st.one_of(st.none(), st.floats(0, 1e6, allow_nan=False)))
def test_retry_after_is_whole_seconds_1_to_60_and_ms_at_least_1(wait: float | None) -> None:
    r = Reject(wait)
    assert 1 <= r.retry_after <= 60
    assert r.retry_after_ms >= 1
    if wait is not None:
        assert r.retry_after_ms >= min(wait * 1000, 60_000)  # never earlier than predicted
        assert r.retry_after == max(1, min(60, -(-r.retry_after_ms // 1000)))


# ----- the held queue: properties ------------------------------------------------------------

WORKERS = ("a", "b", "c")
Entry = tuple[int, frozenset[str] | None, int]
entries = st.lists(
    st.tuples(
        st.integers(0, 50),  # deadline
        st.one_of(st.none(), st.frozensets(st.sampled_from(WORKERS), min_size=1)),
        st.integers(0, 10),  # how much earlier it is served by (0: by its deadline)
    ),
    max_size=30,
)


def filled(items: list[Entry]) -> HeldQueue:
    q = HeldQueue()
    for i, (deadline, workers, earlier) in enumerate(items):
        q.push(i, float(deadline), 0.0, workers, float(deadline - earlier) if earlier else None)
    return q


@given(entries)
def test_held_requests_come_out_earliest_deadline_first_ties_in_push_order(
    items: list[Entry],
) -> None:
    q = filled(items)
    out = [(h.order, h.key) for h in q]
    assert out == sorted(out)
    by_key = {h.key: h for h in q}
    assert [by_key[i].order for i in range(len(items))] == [d - e for d, _, e in items]
    assert q.first_deadline() == min((float(d) for d, _, _ in items), default=None)
    popped = []
    while (h := q.pop_for("a")) is not None:
        popped.append(h)
    assert [(h.order, h.key) for h in popped] == sorted((h.order, h.key) for h in popped)
    assert all(h.fits("a") for h in popped)
    assert all(not h.fits("a") for h in q)


@given(entries, st.dictionaries(st.sampled_from(WORKERS), st.integers(0, 5)))
def test_no_slot_sits_idle_while_a_request_it_could_take_is_held(
    items: list[Entry], free: dict[str, int]
) -> None:
    q = filled(items)
    before = len(q)
    out = fill_slots(q, free)
    assert len(out) + len(q) == before
    for w, n in free.items():
        used = sum(1 for _, to in out if to == w)
        assert used <= n
        if used < n:  # a free slot left: nothing held could go there
            assert all(not h.fits(w) for h in q)
    for held, w in out:  # each went in serving order: nothing earlier left for its worker
        assert held.fits(w)
        order = (held.order, held.key)  # keys are the push order: ties go first pushed
        assert all((h.order, h.key) > order or not h.fits(w) for h in q)


@given(entries, st.integers(0, 50))
def test_expire_takes_exactly_the_late_ones(items: list[Entry], now: int) -> None:
    """By their deadline, whatever order they are served in."""
    q = filled(items)
    gone = q.expire(float(now))
    assert all(h.deadline < now for h in gone)
    assert all(h.deadline >= now for h in q)
    assert len(gone) + len(q) == len(items)
    left = {h.key for h in q}
    kept = [i for i in range(len(items)) if i in left]
    assert [h.key for h in q] == sorted(kept, key=lambda i: (items[i][0] - items[i][2], i))


def test_held_queue_cancel_and_count_ahead() -> None:
    q = HeldQueue()
    q.push("x", 5.0, 1.0, frozenset({"a"}))
    q.push("y", 3.0, 2.0)
    q.push("z", 7.0, 3.0, frozenset({"b"}))
    assert q.ahead_of(5.0) == 2  # y, and x (a tie goes first)
    assert q.ahead_of(10.0, frozenset({"b"})) == 2  # y (any worker) and z
    q.push("w", 9.0, 4.0, order=4.0)  # answered at 9, served by 4
    assert q.ahead_of(4.0) == 2  # y and w
    assert q.remove("w") is not None
    assert q.oldest_since() == 1.0
    assert q.remove("x") is not None and q.remove("x") is None
    assert "x" not in q and len(q) == 2
    assert q.pop_for("a") is not None and q.pop_for("a") is None  # y; z is b's only
    with pytest.raises(ValueError, match="'z' is already"):
        q.push("z", 1.0, 1.0)


# ----- the estimator: measurements and missing inputs -------------------------------------


def test_prefill_fit_recovers_cost_and_overhead_and_shrugs_off_one_stall() -> None:
    fit = PrefillFit()
    for i in range(200):
        tokens = 100 + (i * 37) % 1900
        fit.add(tokens, 0.02 + 0.1 * tokens / 1000)
        if i == 150:
            fit.add(500, 30.0)  # one stall of 30 s
    assert fit.overhead == pytest.approx(0.02, abs=0.005)
    assert fit.cost == pytest.approx(0.1, rel=0.05)


def test_prefill_fit_on_one_prompt_size_stays_bounded() -> None:
    """All prompts alike: cost and overhead cannot be told apart, but the prediction at that
    size is right and the fit's uncertainty stays bounded (no windup)."""
    fit = PrefillFit()
    for _ in range(5000):
        fit.add(1000, 0.2)
    assert fit.predict(1000) == pytest.approx(0.2, rel=0.01)
    assert fit.p[0][0] + fit.p[1][1] + fit.p[2][2] <= 10.0 + 1e-9


def test_prefill_fit_learns_how_much_of_the_prefill_ahead_a_request_waits() -> None:
    """An engine that prefills one request's batch, then the next (llama.cpp on a CPU): a
    request sent while another's 0.4 s prefill has 0.3 s to run takes 0.3 s + its own. The
    fit learns the seconds ahead apart from the tokens, and bounds their weight by 1."""
    fit = PrefillFit()
    for i in range(300):
        tokens = 20 + (i * 7) % 40
        ahead = 0.0 if i % 3 else 0.4 * ((i * 13) % 10) / 10
        fit.add(tokens, 0.4 + 0.002 * tokens + ahead, ahead)
    assert 0.9 <= fit.serial <= 1.0
    assert fit.predict(40, 0.3) == pytest.approx(0.4 + 0.08 + 0.3, rel=0.03)
    batched = PrefillFit()  # an engine that prefills them in the same step: no weight
    for i in range(300):
        tokens = 20 + (i * 7) % 40
        batched.add(tokens, 0.4 + 0.002 * tokens, 0.0 if i % 3 else 0.4 * ((i * 13) % 10) / 10)
    assert batched.serial <= 0.05


def test_the_prefill_spread_counts_the_errors_of_a_trusted_fit_only() -> None:
    """The fit starts from nothing, so the first requests' errors are most of their prefill
    (0.5, 0.24, 0.16, 0.12 s here); they are left out of the mean absolute residual, which
    starts with the request after the MIN_FIT_SAMPLES-th. Counted, they made it 0.14 s after
    10 requests of the same 0.5 s; left out, it is the trusted fit's own error, 0.07 s, and
    falls on."""
    fit = PrefillFit()
    for _ in range(MIN_FIT_SAMPLES):
        fit.add(200, 0.5)
    assert fit.abs_residual.get() is None
    errors = []
    for _ in range(6):
        errors.append(abs(0.5 - fit.predict(200)))
        fit.add(200, 0.5)
    spread = fit.abs_residual.get()
    assert spread is not None
    assert spread == pytest.approx(sum(errors) / len(errors)) and spread < 0.08, spread
    for _ in range(40):
        fit.add(200, 0.5)
    later = fit.abs_residual.get()
    assert later is not None and later < 0.03, later
    est = WorkerEstimate("w")  # /debug/workers shows the spread: 0 until the fit is trusted
    for i in range(MIN_FIT_SAMPLES):
        assert est.view(float(i))["prefill_spread_ms"] == 0.0
        est.dispatched(i, 200, float(i))
        est.first_byte(i, i + 0.5)
        est.ended(i, i + 0.6)
    est.dispatched("next", 200, 10.0)
    est.first_byte("next", 10.5)
    shown = est.view(11.0)["prefill_spread_ms"]
    assert shown == round(2000 * (est.fit.abs_residual.get() or 0.0), 1) and shown > 0, shown


def test_a_worker_with_no_data_is_routable_with_everything_missing() -> None:
    est = WorkerEstimate("w")
    p = predict_ttft(est, 500, 0, 0.0)
    assert p.can_start and p.wait == 0.0 and p.ttft == 0.0
    assert p.gateway_only
    assert set(p.missing) == {WAITING, ACTIVE, TOTAL, ENGINE_TTFT, COMPLETIONS, PREFILL, GATEWAY}
    assert isinstance(decide([p], 0.5, 0.0), Dispatch)


def test_slots_reported_but_no_completion_yet_a_full_worker_rejects_at_once() -> None:
    est = WorkerEstimate("w")
    est.load(waiting=0, active=0, total=2)
    for i in range(2):
        est.dispatched(i, 100, float(i))
    p = predict_ttft(est, 100, 0, 3.0)
    assert not p.can_start and p.wait is None and p.ttft is None
    assert not p.gateway_only and COMPLETIONS in p.missing
    d = decide([p], 1.0, 3.0)
    assert isinstance(d, Reject) and (d.retry_after, d.retry_after_ms) == (1, 1000)


def measured(est: WorkerEstimate, slots: int, service: float = 2.0, n: int = 40) -> float:
    """Feed ``n`` requests of 1000 tokens, one at a time: 0.1 s to first byte, ``service``
    in all. Returns the time after the last one."""
    t = 0.0
    for i in range(n):
        est.dispatched(("m", i), 1000, t, arrived=t - 0.01)
        est.first_byte(("m", i), t + 0.1)
        est.ended(("m", i), t + service, output_tokens=100)
        t += service + 0.5
    return t


def prefill_after(est: WorkerEstimate, t: float, seconds: Sequence[float]) -> float:
    """Requests of 1000 tokens sent one at a time to a free slot, first bytes ``seconds``
    after their dispatch; returns the time after the last one."""
    for i, took in enumerate(seconds):
        est.dispatched(("p", t, i), 1000, t)
        est.first_byte(("p", t, i), t + took)
        est.ended(("p", t, i), t + took + 1.0, output_tokens=50)
        t += took + 1.5
    return t


def test_a_held_request_fits_a_free_slot_with_the_prefill_ahead_and_its_spread() -> None:
    """A held request sent to a free slot now: judged on its prefill there now, after the
    prefill of a request started before it, with the spread (without it when admitted on
    its mean); not on its idle prefill alone."""
    est = WorkerEstimate("w")
    t = prefill_after(est, 0.0, [0.4, 0.6] * 10)  # 0.5 s, off by 0.1 s either way
    spread = predict_ttft(est, 1000, 0, t).prefill_spread
    assert est.idle_ttft(1000) == pytest.approx(0.5, abs=0.02)
    assert spread == pytest.approx(0.2, abs=0.03)
    arrived = t - 1.0  # held 1 s of a 1.65-s target: 0.65 s left
    assert fits_now(est, 1000, 1.65, arrived, t, lenient=True)
    assert not fits_now(est, 1000, 1.65, arrived, t)  # 0.5 + 0.2 > 0.65
    assert fits_now(est, 1000, 1.8, arrived, t)
    est.dispatched("ahead", 1000, t)  # its 1000 tokens are prefilled with this one's
    assert predict_ttft(est, 1000, 0, t).prefill == pytest.approx(0.73, abs=0.02)
    assert not fits_now(est, 1000, 1.65, arrived, t, lenient=True)  # 0.73 > 0.65


@contextlib.contextmanager
def pace_off() -> Iterator[None]:
    """The prefill from the fit alone (``PACE_SAMPLES`` 0), for the control."""
    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(deadline_module, "PACE_SAMPLES", 0)
        yield


@pytest.mark.parametrize("factor", [2.0, 3.0])
def test_a_worker_that_slows_down_is_predicted_at_its_pace_after_three_requests(
    factor: float,
) -> None:
    """40 requests at 0.1 s to the first byte, then the worker takes 2x (3x: each looks as
    if it waited for a slot, and the fit leaves it out) as long: after the third slow one
    the prefill is predicted at about that (the smallest of their ratios); from the fit
    alone it has moved a few per cent (not at all). Mixed errors, or a worker faster than
    its fit, leave the pace at 1."""
    slow = 0.1 * factor

    def slowed() -> tuple[float, float]:
        est = WorkerEstimate("w")
        t = measured(est, 4)
        est.load(waiting=0, active=0, total=4)
        t = prefill_after(est, t, [slow, slow])
        two = predict_ttft(est, 1000, 0, t).prefill
        t = prefill_after(est, t, [slow])
        return two, predict_ttft(est, 1000, 0, t).prefill

    two, three = slowed()
    assert two < 0.12 and three == pytest.approx(slow, rel=0.08), (two, three)
    with pace_off():
        _, fit_alone = slowed()
    assert fit_alone < 0.12
    est = WorkerEstimate("w")
    t = prefill_after(est, measured(est, 4), [0.15, 0.08, 0.12])
    assert est.pace() == 1.0
    prefill_after(est, t, [0.05, 0.05, 0.05])
    assert est.pace() == 1.0


HEAVY = replace(P, prefill_s_per_token=0.0002, prompt_tokens=(200, 1000))
HEAVY4 = replace(HEAVY, chunk_tokens=4)


def late_while_slow(params: Params, target: float, seed: int) -> int:
    """Two plant workers at 3x their capacity, the first twice as slow from 100 s to 120 s:
    the requests admitted from 100 s to 125 s whose first token came after ``target``."""
    sim = Sim(params, Admitting(target=target), seed, 2)
    sim.slow_down(100.0, "w0", 2.0)
    sim.slow_down(120.0, "w0", 1.0)
    reqs = sim.run(lambda t: 3.0 * sim.capacity(), 130.0)
    window = [r for r in reqs if 100.0 <= r.arrived < 125.0 and r.outcome == "dispatched"]
    assert len(window) > 150
    return sum(1 for r in window if r.ttft is not None and r.ttft > target)


# llama.cpp on a CPU, as the plant sees it: 2 slots, short prompts, each prefilled in a batch
# of its own that costs 0.4 s whatever its length; 1 to 3 tokens a stream chunk.
SERIAL = replace(
    P,
    slots=2,
    prefill_fixed_s=0.4,
    prefill_s_per_token=0.001,
    prompt_tokens=(20, 60),
    output_tokens=(16, 48),
    decode_s_per_token=0.03,
    chunk_tokens=1,
)


def ttft_over_predicted(params: Params, target: float, seeds: range) -> list[float]:
    """Measured over predicted TTFT of the requests dispatched as they arrived, two plant
    workers at their capacity, from 10 s to 100 s."""
    out = []
    for seed in seeds:
        sim = Sim(params, Admitting(target=target), seed, 2)
        reqs = sim.run(partial(steady, sim.capacity()), 100.0)
        out += [r.ttft / r.predicted for r in reqs if r.arrived >= 10.0 and r.predicted and r.ttft]
    return sorted(out)


def test_a_request_sent_while_another_prefills_is_predicted_to_wait_for_it() -> None:
    """On the plant of an engine that prefills one request at a time, at its capacity with a
    1.5-s target, seeds 1 to 4: the TTFT of the requests dispatched on arrival over their
    prediction, 90th percentile 1.21 and 99th 1.56, against 1.48 and 1.90 when the fit counts
    only the prompt tokens ahead (each of them costs 0.4 s whatever its tokens). The test runs
    seeds 1 and 2."""
    seeds = range(1, 3)
    ahead = ttft_over_predicted(SERIAL, 1.5, seeds)
    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(deadline_module, "SERIAL_MAX", 0.0)
        tokens_only = ttft_over_predicted(SERIAL, 1.5, seeds)
    p90 = ahead[int(0.9 * len(ahead))]
    p90_tokens = tokens_only[int(0.9 * len(tokens_only))]
    assert len(ahead) > 150 and len(tokens_only) > 150
    assert p90 < 1.3 and p90_tokens > p90 + 0.15, (p90, p90_tokens)


def test_a_worker_slowing_down_for_20_s_costs_few_late_requests() -> None:
    """Two plant workers whose prefill is a large part of the 0.5-s target, at 3x their
    capacity; from 100 s to 120 s one takes twice as long. Requests admitted from 100 s to
    125 s with a first token late, seeds 1 to 8: 2, 0, 5, 5, 4, 3, 4, 5 (28 of about 1,400)
    at the worker's pace; 8, 4, 7, 4, 5, 9, 10, 10 (57) from the fit alone, which follows a
    change over about 100 requests. (Before the fit counted the prefill still ahead of a
    request: 28 and 41, seeds 1 to 32: 113 and 229; before near-equal predictions went to
    the less loaded worker: 40 and 60, 150 and 249.) The test runs seeds 1 to 5."""

    seeds = range(1, 6)
    paced = sum(late_while_slow(HEAVY, 0.5, seed) for seed in seeds)
    with pace_off():
        fit_alone = sum(late_while_slow(HEAVY, 0.5, seed) for seed in seeds)
    assert paced <= 0.7 * fit_alone and fit_alone - paced >= 10, (paced, fit_alone)


def streamed(est: WorkerEstimate, t: float, n: int, gap: float, tokens: int = 20) -> float:
    """``n`` requests of 1000 tokens, one at a time: 0.1 s to the first byte, then ``tokens``
    tokens ``gap`` apart, one per chunk. Returns the time after the last one."""
    for i in range(n):
        key = ("s", i, t)
        est.dispatched(key, 1000, t)
        t += 0.1
        est.first_byte(key, t)
        for _ in range(tokens):
            t += gap
            est.tokens(key, t, 1)
        est.ended(key, t, output_tokens=tokens + 1)
        t += 0.5
    return t


def test_a_worker_whose_tokens_come_slower_is_predicted_slower_at_once() -> None:
    """20 requests whose tokens come 10 ms apart; then one stream's tokens come 20 ms apart:
    the engine's step is twice what it was when the fit learnt, and the next request's
    prefill is predicted twice as long, before any first byte came late. 13 ms apart (a
    fuller batch's swing): no change. Tokens before a stream's first byte, of a request not
    in flight, or a chunk of none count nothing; a chunk of 4 tokens counts its gap over 4."""
    est = WorkerEstimate("w")
    t = streamed(est, 0.0, 20, 0.01)
    assert est.step() == pytest.approx(0.01) and est.step_pace() == 1.0
    est.dispatched("slow", 1000, t)
    est.tokens("slow", t + 0.05, 1)  # before its first byte: the prefill's chunk
    est.tokens("gone", t + 0.05, 1)
    t += 0.1
    est.first_byte("slow", t)
    before = predict_ttft(est, 1000, 0, t).prefill
    assert before == pytest.approx(0.1, rel=0.05) and est.step() == pytest.approx(0.01)
    for _ in range(STEP_SAMPLES):
        t += 0.08
        est.tokens("slow", t, 4)
        est.tokens("slow", t, 0)
    assert est.step() == pytest.approx(0.02) and est.step_pace() == pytest.approx(2.0)
    # twice the fit (the pace of its first bytes, 1.02 here, is the smaller)
    assert predict_ttft(est, 1000, 0, t).prefill == pytest.approx(2 * est.fit.predict(1000))
    assert est.view(t)["step_pace"] == pytest.approx(2.0)
    for _ in range(STEP_SAMPLES):
        t += 0.013
        est.tokens("slow", t, 1)
    assert est.step_pace() == 1.0
    # the step's 2 is gone (the middle of the last ratios, about 1 here, holds until a
    # request is back within its fit: the test after next)
    assert predict_ttft(est, 1000, 0, t).prefill == pytest.approx(before, rel=0.01)
    fresh = WorkerEstimate("w")  # no base yet, and too few gaps: no step pace
    t = streamed(fresh, 0.0, 1, 0.01, tokens=STEP_MIN - 1)
    assert fresh.step() is None and fresh.step_pace() == 1.0


def paced_after(step_gap: float, prompts: Sequence[float] = (0.3, 0.3)) -> WorkerEstimate:
    """A worker of 4 slots that learnt 0.1 s to the first byte with tokens 10 ms apart; then
    a stream whose first byte takes 1.2 times the fit and whose tokens come ``step_gap``
    apart, and requests sent to a free slot meanwhile whose first bytes take ``prompts``
    seconds (by default two, 3 times the fit)."""
    est = WorkerEstimate("w")
    t = streamed(est, 0.0, 20, 0.01)
    est.load(waiting=0, active=0, total=4)
    est.dispatched("long", 1000, t)
    t += 0.12
    est.first_byte("long", t)
    for _ in range(STEP_SAMPLES):
        t += 4 * step_gap
        est.tokens("long", t, 4)
    prefill_after(est, t, prompts)
    return est


def steps_as_fitted(est: WorkerEstimate) -> float:
    """The stream of :func:`paced_after` goes on with its tokens as far apart as when the
    fit learnt (10 ms) for a whole step window; returns the time of its last chunk."""
    t = est.flights["long"].last_token
    assert t is not None
    for _ in range(STEP_SAMPLES):
        t += 4 * 0.01
        est.tokens("long", t, 4)
    return t


def test_while_the_step_is_slowed_the_prefill_is_paced_at_the_middle_of_its_last_ratios() -> None:
    """Tokens twice as slow as when the fit learnt, and the last three free-slot requests at
    1.2, 3 and 3 times the fit: the prefill is predicted at 3 times the fit (their middle;
    a slowed engine's prompts may slow more than its steps), not at the step's 2 (with the
    smallest ratio, 1.2, the larger of the two before). With its tokens as fast as before,
    the same ratios give 1.2: the smallest, as the pace alone."""
    slowed = paced_after(0.02)
    ratios = sorted(slowed.ratios)
    assert ratios[0] == pytest.approx(1.2, rel=0.05) and ratios[1] == pytest.approx(3, rel=0.1)
    assert slowed.step_pace() == pytest.approx(2.0, rel=0.1)
    assert slowed.pace() == pytest.approx(ratios[1])
    steady_step = paced_after(0.01)
    assert steady_step.step_pace() == 1.0
    assert steady_step.pace() == pytest.approx(min(steady_step.ratios))
    assert steady_step.pace() == pytest.approx(1.2, rel=0.05)


def test_once_the_step_showed_a_slowdown_the_middle_ratio_holds_till_a_prefill_is_on_time() -> None:
    """The worker of the test before, its tokens twice as slow: then its tokens come as fast
    as when the fit learnt. The step pace is back at 1, but the prefill is still predicted
    at the middle of its last ratios, 3 (not the smallest, 1.2): nothing on time came back
    yet. A request sent to a free slot whose first byte comes within its fit turns that
    off: the pace is the smallest ratio's again, here 1 (that request's 0.9)."""
    est = paced_after(0.02)
    t = steps_as_fitted(est)
    assert est.step_pace() == 1.0
    assert est.pace() == pytest.approx(sorted(est.ratios)[1])
    assert est.pace() == pytest.approx(3, rel=0.1)
    assert est.view(t)["slowed"] is True
    prefill_after(est, 1000.0, [0.9 * est.fit.predict(1000)])
    assert est.ratios[-1] == pytest.approx(0.9)
    assert est.pace() == 1.0
    assert est.view(1000.0)["slowed"] is False


def test_a_step_that_slowed_while_the_prompts_stayed_near_the_fit_latches_nothing() -> None:
    """Tokens twice as slow as when the fit learnt (an engine whose step grows with its
    batch), while the last three free-slot requests took 1.2, 1.3 and 1.4 times the fit:
    the middle, 1.3, is under the step's trigger, so the prompts do not show the engine
    slowed. Once the tokens come as fast as before, the pace is the smallest ratio's (the
    pace alone), not held at the middle one."""
    est = paced_after(0.02, [0.13, 0.14])
    ratios = sorted(est.ratios)
    assert ratios[1] == pytest.approx(1.3, rel=0.05) and ratios[1] < STEP_TRIGGER
    assert est.step_pace() == pytest.approx(2.0, rel=0.1)
    assert not est.slowed and est.view(0.0)["slowed"] is False
    steps_as_fitted(est)
    assert est.step_pace() == 1.0
    assert est.pace() == pytest.approx(ratios[0])


@contextlib.contextmanager
def step_off() -> Iterator[None]:
    """The prefill's pace without the engine's step, for the control."""
    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(deadline_module, "STEP_TRIGGER", math.inf)
        yield


def test_a_worker_slowing_down_is_seen_in_its_streams_before_its_first_bytes() -> None:
    """Two plant workers streaming chunks of 4 tokens, at 3x their capacity, prefill a large
    part of a 0.5-s target; from 100 s to 120 s one takes twice as long per token. Requests
    admitted from 100 s to 125 s with a first token late, seeds 1 to 8: 1 from the engine's
    step against 27 from the pace alone (before the fit counted the prefill still ahead of a
    request: 4 against 28). With a 1-s target the two are alike since then (seeds 1 to 24: 13
    against 14; before, 10 against 19). The test runs seeds 1 to 3."""

    seeds = range(1, 4)
    stepped = sum(late_while_slow(HEAVY4, 0.5, seed) for seed in seeds)
    with step_off():
        paced = sum(late_while_slow(HEAVY4, 0.5, seed) for seed in seeds)
    assert stepped <= 2 and paced >= stepped + 6, (stepped, paced)


def steady(rate: float, t: float) -> float:
    """An arrival rate that does not change with ``t``."""
    return rate


# Prefill a large part of a tight target: 0.3-0.7 s of 1.5 s; 4 slots, 1-3 s of decode.
TIGHT = replace(
    P,
    slots=4,
    prompt_tokens=(100, 300),
    prefill_s_per_token=0.002,
    overhead_s=0.1,
    decode_s_per_token=0.05,
    output_tokens=(16, 64),
)


@pytest.mark.parametrize(("load", "share"), [(0.3, 1.0), (0.5, 0.98)])
def test_fresh_workers_under_a_tight_target_take_what_fits(load: float, share: float) -> None:
    """Two fresh plant workers, a 1.5-s target, at 30 % and 50 % of their capacity (all let
    in: TTFT p99 0.89-0.98 s at 30 %, 1.08-1.68 s at 50 %). When the first requests' errors
    counted in the prefill's spread, a worker that drew a slow start looked unreachable and
    got nothing more (this test's router sends no probes; the extproc's sends such a worker
    one request every 0.25 s while it rejects others): seeds 1 to 4 admitted
    1,061 of 1,130 requests at 30 % and 1,610 of 1,894 at 50 %, 3 late. From a trusted fit's
    errors: all 1,130, and 1,876, 1 late."""
    arrivals = admitted = late = 0
    for seed in (1, 2, 3, 4):
        sim = Sim(TIGHT, Admitting(target=1.5), seed, 2)
        reqs = sim.run(partial(steady, load * sim.capacity()), 300.0)
        done = [r for r in reqs if r.outcome == "dispatched"]
        arrivals += len(reqs)
        admitted += len(done)
        late += sum(1 for r in done if r.ttft is not None and r.ttft > 1.5)
    assert admitted >= share * arrivals and late <= 1, (admitted, arrivals, late)


def test_the_wait_counts_the_engine_queue_the_router_and_the_held() -> None:
    est = WorkerEstimate("w")
    t = measured(est, 4)
    est.load(waiting=0, active=0, total=4)
    assert est.rate(t) == pytest.approx(4 / 2.0, rel=0.01)
    for i in range(4):  # the router fills the 4 slots
        est.dispatched(i, 1000, t)
    est.load(waiting=2, active=4, total=4)  # and the engine has 2 more of other clients
    assert est.occupancy() == 6
    p = predict_ttft(est, 1000, 1, t)
    assert p.ahead == 3  # 2 waiting at the engine + 1 held ahead
    assert p.wait is not None
    assert p.wait == pytest.approx(4 / 2.0, rel=0.01)  # the 4th completion, at 2 per second
    assert p.gateway == pytest.approx(0.01)
    assert p.ttft == pytest.approx(p.wait + p.prefill + p.gateway)
    # It will start beside others' prefills: those the last requests started with (the 4 sent
    # together shared 0, 1000, 2000 and 3000 tokens, after 40 alone).
    assert 0 < est.shared.value < 1000
    assert p.prefill == pytest.approx(est.prefill(1000 + est.shared.value))
    assert p.prefill > est.prefill(1000) == pytest.approx(0.1, rel=0.02)


def test_a_worker_without_slot_or_waiting_counts_learns_its_slots_from_timings() -> None:
    est = WorkerEstimate("w")
    t = measured(est, 2)
    assert est.gateway_only and est.slots(t) is None  # never seen queueing: never full
    for i in range(2):
        est.dispatched(i, 1000, t)
    est.first_byte(0, t + 0.1)
    est.first_byte(1, t + 0.1)
    est.dispatched(2, 1000, t + 0.2)  # a third: it waits for a slot
    est.first_byte(2, t + 2.0)
    assert est.slots(t + 2.0) == 2
    assert est.rate(t + 2.0) == pytest.approx(2 / 2.0, rel=0.01)
    assert not predict_ttft(est, 1000, 0, t + 2.0).can_start
    # Seen streaming 3 at once (a probe started at once): at least 3.
    est.ended(0, t + 2.1)
    probe = t + 2.1 + 10.0
    assert est.slots(probe) == 3  # one probe past the guess every 10 s
    est.dispatched(3, 1000, probe)
    est.dispatched(4, 1000, probe)
    est.first_byte(3, probe + 0.1)
    est.first_byte(4, probe + 0.1)
    assert est.streaming == 4 and est.slots(probe + 0.1) == 4


def test_an_engine_that_queues_below_its_slots_is_full_at_what_it_runs() -> None:
    """vLLM short of KV cache: requests wait while fewer than ``max_num_seqs`` run."""
    est = WorkerEstimate("w")
    t = measured(est, 1)
    est.load(waiting=0, active=3, total=256)
    assert est.slots(t) == 256 and est.free_slots(t) == 256 - 3
    est.load(waiting=2, active=3, total=256)
    assert est.slots(t) == 3 and est.free_slots(t) == 0
    assert est.rate(t) == pytest.approx(3 / 2.0, rel=0.01)
    p = predict_ttft(est, 1000, 0, t)
    assert not p.can_start and p.ahead == 2


def test_slots_are_bounded_by_what_the_kv_cache_runs_even_with_nobody_waiting() -> None:
    """48 sequences allowed, but 640 blocks hold about 17 requests of 36 blocks: once the
    engine's queue drains, the worker is not taken for 48 free slots."""
    est = WorkerEstimate("w")
    t = measured(est, 1)
    est.load(waiting=0, active=3, total=48)  # no KV reported: the sequences alone
    assert est.slots(t) == 48 and est.kv_slots() is None
    est.load(waiting=0, active=16, total=48, kv_blocks=576, kv_total=640)
    assert est.kv_slots() == 17 and est.slots(t) == 17
    est.load(waiting=3, active=15, total=48, kv_blocks=570, kv_total=640)
    assert est.slots(t) == 17  # prompts waiting a step for the token budget: still 17
    est.load(waiting=0, active=17, total=48, kv_blocks=610, kv_total=640)
    assert est.slots(t) == 17  # drained: back to the KV bound, not to 48
    assert est.view(t)["kv_slots"] == 17
    small = WorkerEstimate("small")
    small.load(waiting=0, active=2, total=4, kv_blocks=2, kv_total=7)
    assert small.slots(t) == 4  # short requests: the sequences bound it, not the KV


def test_a_slot_without_a_free_kv_block_is_not_free() -> None:
    """vLLM with 7 blocks (6 for tokens) and 4 sequences, requests of 2 blocks as they
    decode: 3 of them fill the cache, and a 4th sent to the 4th sequence waits at the engine
    for the next one to end. The router counts the slot free again as a request ends (it
    frees at least a block) and takes one block per request sent, until the next report."""
    est = WorkerEstimate("w")
    t = measured(est, 4)
    for i in range(3):
        est.dispatched(i, 1000, t)
    est.load(waiting=0, active=3, total=4, kv_blocks=3, kv_total=7)  # early: a block each
    assert est.kv_room() == 3 and est.slots(t) == 4 and est.free_slots(t) == 1
    est.load(waiting=0, active=3, total=4, kv_blocks=6, kv_total=7)  # decoding: 2 each
    assert est.kv_room() == 0 and est.slots(t) == 3 and est.free_slots(t) == 0
    p = predict_ttft(est, 1000, 0, t)
    # The 3 running just started and hold a slot 2 s: the first frees then.
    assert not p.can_start and p.ahead == 0 and p.wait == pytest.approx(2.0, rel=0.05)
    assert est.rate(t) == pytest.approx(3 / 2.0, rel=0.01)  # 3 running complete the next
    assert est.view(t)["kv_room_blocks"] == 0
    est.first_byte(0, t + 0.1)
    est.ended(0, t + 1.0)  # a request ends: its blocks are free before the next report
    assert est.kv_room() == 1 and est.free_slots(t + 1.0) == 1
    est.dispatched(3, 1000, t + 1.0)  # and the request sent to it takes one
    assert est.kv_room() == 0 and est.free_slots(t + 1.0) == 0
    est.dispatched(4, 1000, t + 1.0)  # one sent anyway waits at the engine: ahead of others
    assert est.slots(t + 1.0) == 3 and predict_ttft(est, 1000, 0, t + 1.0).ahead == 1
    # The engine preempts one of 4 running (it keeps it waiting): 3 run, the wait is behind it.
    est.load(waiting=1, active=3, total=4, kv_blocks=6, kv_total=7)
    assert est.slots(t + 1.1) == 3 and predict_ttft(est, 1000, 0, t + 1.1).ahead == 1
    # An engine that reports no KV cache, or no usage, is bounded by its sequences alone.
    est.load(waiting=0, active=3, total=4, kv_blocks=None, kv_total=7)
    assert est.kv_room() is None


def test_a_worker_reporting_waiting_but_no_slots_learns_them_and_is_not_gateway_only() -> None:
    est = WorkerEstimate("w")
    t = measured(est, 1)
    est.load(waiting=0, active=0)
    assert not est.gateway_only and est.slots(t) is None and est.free_slots(t) is None
    est.dispatched("a", 1000, t)
    est.first_byte("a", t + 0.1)
    est.dispatched("b", 1000, t + 0.2)  # sent to a presumed free slot; it waits
    est.first_byte("b", t + 1.5)
    assert est.slots(t + 1.5) == 1
    est.load(waiting=0, active=2)  # the engine says 2 run at once
    assert est.slots(t + 1.5) == 2


def test_target_unreachable_is_shown_with_the_idle_ttft() -> None:
    est = WorkerEstimate("w")
    t = measured(est, 1)
    view = est.view(t, target_s=0.05)
    # 0.1 s to the first byte and 0.01 s before dispatch, within the fit's 40 samples
    assert view["target"] in {
        f"target unreachable: an idle worker takes {ms} ms" for ms in (109, 110)
    }
    assert "target" not in est.view(t, target_s=0.5)
    missing = view["missing"]
    assert isinstance(missing, list) and TOTAL in missing and GATEWAY not in missing
    assert view["from"] == "gateway timings alone"
    p = predict_ttft(est, 1000, 0, t)
    r = decide([p], 0.05, t)
    assert isinstance(r, Reject) and r.unreachable


def test_engine_ttft_histogram_is_kept_for_diagnostics() -> None:
    est = WorkerEstimate("w")
    est.engine_ttft([(0.1, 3), (0.5, 1), (float("inf"), 2)])
    assert est.engine_ttft_s.get() == pytest.approx(0.2)
    assert ENGINE_TTFT not in est.missing


def test_bad_measurements_are_named() -> None:
    est = WorkerEstimate("w")
    with pytest.raises(ValueError, match="prompt_tokens: -1"):
        est.dispatched(1, -1, 0.0)
    est.dispatched(1, 1, 0.0)
    with pytest.raises(ValueError, match="request 1 is already in flight on w"):
        est.dispatched(1, 1, 0.0)
    est.first_byte("unknown", 1.0)  # a key never dispatched is ignored
    est.ended("unknown", 1.0)
    est.ended(1, 1.0)  # ended before its first byte: gone, nothing learnt
    assert est.occupancy() == 0 and est.service.count == 0


# ----- several workers: the held requests shared out -----------------------------------------


def full_worker(name: str, slots: int, service: float) -> tuple[WorkerEstimate, float]:
    est = WorkerEstimate(name)
    t = measured(est, slots, service)
    est.load(waiting=0, active=0, total=slots)
    for i in range(slots):
        est.dispatched(i, 1000, t)
    return est, t


def test_held_requests_go_to_whichever_worker_frees_first() -> None:
    fast, t = full_worker("fast", 4, 1.0)  # 4 per second
    slow, _ = full_worker("slow", 4, 4.0)  # 1 per second
    first = pool_wait([fast, slow], 0, t)  # none held: the first slot either frees
    assert first is not None and first.seconds == pytest.approx(1 / 5, rel=0.02)
    preds = predict_all([fast, slow], 1000, 9, t)
    # 10 slots needed at 5 per second: 2 s; the fast worker frees 8 of them, the slow 2.
    assert preds[0].wait == pytest.approx(2.0, rel=0.02)
    assert preds[1].wait == pytest.approx(2.0, rel=0.02)
    alone = predict_ttft(fast, 1000, 9, t)
    assert alone.wait == pytest.approx(10 / 4, rel=0.02)  # as if the fast one took them all
    # Free slots for the held request ahead and for this one: no wait, it starts now.
    free, _ = full_worker("free", 4, 1.0)
    free.ended(0, t + 0.1)
    assert pool_wait([fast, free], 1, t) is not None  # one free slot: the held one takes it
    free.ended(1, t + 0.1)
    assert pool_wait([fast, free], 1, t) is None
    assert predict_all([fast, free], 1000, 1, t)[1].can_start


@contextlib.contextmanager
def rate_rule() -> Iterator[None]:
    """Every wait from the rate (the running requests' ages left out: ``AGES_FOR`` 0), for
    the tests of the rate's rule."""
    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(deadline_module, "AGES_FOR", 0)
        yield


@given(st.integers(0, 40), st.integers(0, 5))
def test_one_worker_waits_for_its_backlog_and_every_held_request(held: int, backlog: int) -> None:
    est, t = full_worker("w", 3, 1.5)
    for j in range(backlog):
        est.dispatched(("b", j), 1000, t)
    with rate_rule():
        [p] = predict_all([est], 1000, held, t)
        assert p.wait == pytest.approx((backlog + held + 1) / 2.0, rel=0.01)
        assert p.wait == pytest.approx(predict_ttft(est, 1000, held, t).wait)
    # From the ages: all 3 just started and hold a slot 1.5 s, so the first 2 slots free
    # then; a later slot from the rate.
    [p] = predict_all([est], 1000, held, t)
    n = backlog + held + 1
    assert p.wait == pytest.approx(1.5 if n <= deadline_module.AGES_FOR else n / 2.0, rel=0.03)


@given(
    st.lists(
        st.tuples(st.integers(1, 8), st.sampled_from([0.5, 1.0, 2.0, 4.0]), st.integers(0, 6)),
        min_size=1,
        max_size=4,
    ),
    st.integers(1, 40),
)
def test_the_smallest_predicted_wait_is_when_the_workers_have_freed_enough_slots(
    workers: list[tuple[int, float, int]], held: int
) -> None:
    """Full workers (slots, service s, backlog beyond the slots): the smallest predicted wait
    is the time by which they free ``held + 1`` slots in all, each after its backlog."""
    ests = []
    for i, (slots, service, backlog) in enumerate(workers):
        est, t = full_worker(f"w{i}", slots, service)
        for j in range(backlog):
            est.dispatched(("b", j), 1000, t)
        ests.append(est)
    with rate_rule():
        preds = predict_all(ests, 1000, held, t)
        owns = [predict_ttft(e, 1000, held, t).wait for e in ests]
    first = min(p.wait for p in preds if p.wait is not None)
    freed = 0.0
    for e in ests:
        rate, total = e.rate_now(t), e.total_slots  # its rate given its requests' ages
        assert rate is not None and total is not None
        freed += max(0.0, rate * first - (e.occupancy() - total))
    assert freed == pytest.approx(held + 1, rel=1e-6)
    for own, p in zip(owns, preds, strict=True):  # none is predicted after its own free slot
        assert p.wait is not None and own is not None
        assert p.wait <= own + 1e-9


# ----- requests of alike lengths: the oldest frees the next slot ------------------------------


def staggered(slots: int, service: float, gap: float) -> tuple[WorkerEstimate, float]:
    """A worker whose requests hold a slot ``service`` s, full: ``slots`` requests started
    ``gap`` s apart, the oldest ``service - gap`` ago."""
    est = WorkerEstimate("w")
    t = measured(est, slots, service)
    est.load(waiting=0, active=0, total=slots)
    for i in range(slots):
        age = service - gap * (i + 1)
        est.dispatched(i, 1000, t - age)
        est.first_byte(i, t - age + 0.1)
    return est, t


def test_when_requests_run_alike_the_oldest_frees_the_next_slot() -> None:
    """17 slots, each request 3 s, the oldest started 2.85 s ago: the next slot frees in
    about 0.15 s, which the request's 0.4 s target has room for: it is held. The rate alone
    (17 / 3 s, its 90th percentile 2.3 x its 0.18-s mean) would reject it."""
    est, t = staggered(17, 3.0, 0.15)
    [p] = predict_all([est], 1000, 0, t)
    assert p.wait == pytest.approx(0.15, abs=0.02)
    assert p.wait_spread < 0.05
    assert isinstance(decide([p], 0.4, t), Hold)
    # The second slot to free: the next oldest's, 0.15 s later.
    [q] = predict_all([est], 1000, 1, t)
    assert q.wait == pytest.approx(0.30, abs=0.02)
    with rate_rule():
        [r] = predict_all([est], 1000, 0, t)
    assert r.wait == pytest.approx(3.0 / 17, rel=0.05)
    assert isinstance(decide([r], 0.4, t), Reject)


ALIKE = replace(
    P,
    slots=17,
    prompt_tokens=(512, 512),
    output_tokens=(128, 128),
    prefill_s_per_token=0.00007,
    decode_s_per_token=0.02,
    overhead_s=0.005,
)


def test_alike_requests_at_capacity_more_are_admitted_within_target() -> None:
    """Two plant workers of 17 slots, every request 512 prompt and 128 output tokens (the
    simulated benchmark's), at their capacity with a 150-ms target: from the ages more are
    admitted, within target, than from the rate alone. Measured (seeds 1-4): 88.6-89.2 %
    admitted against 87.1-87.8 %, p99 111-121 ms against 100-106 ms."""
    target = 0.15

    def run() -> tuple[float, float]:
        sim = Sim(ALIKE, Admitting(target=target), 1, 2)
        reqs = sim.run(lambda t: sim.capacity(), 150.0)
        window = [r for r in reqs if r.arrived > 30.0]
        ttfts = sorted(r.ttft for r in window if r.outcome == "dispatched" and r.ttft)
        return len(ttfts) / len(window), ttfts[int(0.99 * len(ttfts))]

    share, p99 = run()
    with rate_rule():
        rate_share, rate_p99 = run()
    assert p99 <= target and rate_p99 <= target
    assert share >= rate_share + 0.008, (share, rate_share)


# ----- running requests far longer than the recent ones ---------------------------------------


def long_generations(router: Admitting) -> tuple[list[Request], list[Request], list[Request]]:
    """One plant worker (8 slots, requests of 0.2-3.2 s) at half its capacity for 60 s; at
    65 s, idle, it takes 8 generations of 3000 tokens (30 s each), which fill its slots;
    then one short request a second from 70 s to 90 s (the long ones run) and from 100 s to
    110 s (they ended). Returns (long, short while they run, short after)."""
    sim = Sim(P, router, 1)
    long = [sim.add(65.0, 500, 3000) for _ in range(P.slots)]
    during = [sim.add(70.0 + i, 500, 50) for i in range(21)]
    after = [sim.add(100.0 + i, 500, 50) for i in range(11)]
    sim.run(lambda t: 0.5 * P.capacity() if t < 60 else 1e-9, 60.0)
    return long, during, after


def test_short_requests_behind_long_generations_are_rejected_at_once_then_admitted() -> None:
    """While long generations fill every slot, well past every recent slot time, a short
    request is rejected at once (not held to its deadline); once they end, short requests
    are admitted and meet the target. Control: the rate of the recent completions alone
    (ages ignored) holds every one of them to its deadline."""
    long, during, after = long_generations(Admitting())
    assert all(r.outcome == "dispatched" for r in long)
    assert max(r.ended or 0.0 for r in long) < 100.0
    assert all(r.outcome == "rejected" for r in during), [r.outcome for r in during]
    assert all((r.decision_delay or 0.0) <= 0.01 for r in during)
    assert all(r.outcome == "dispatched" for r in after), [r.outcome for r in after]
    assert all(r.ttft is not None and r.ttft <= TARGET for r in after)


def test_held_behind_long_generations_without_their_ages_waits_to_its_deadline(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """The control of the test above: with the rate of the recent completions alone, the
    short requests are held and answered only at (or near) their deadline."""
    monkeypatch.setattr(WorkerEstimate, "rate_now", WorkerEstimate.rate)
    monkeypatch.setattr(deadline_module, "AGES_FOR", 0)
    _, during, _ = long_generations(Admitting())
    late = [r for r in during if (r.decision_delay or 0.0) > 0.5 * TARGET]
    assert len(late) >= 0.9 * len(during), [(r.outcome, r.decision_delay) for r in during]


def test_a_rejection_with_a_slot_free_says_to_come_back_once_the_work_ahead_drained() -> None:
    """A slot is free but the prefill ahead makes the first token late: the retry hint is
    what the prediction exceeds the target by, not the wait of 0 (a retry 1 ms later would
    meet the same queue)."""
    p = Prediction(
        "w", ttft=0.9, wait=0.0, prefill=0.85, gateway=0.05, ahead=0, can_start=True, idle=0.2
    )
    d = decide([p], 0.5, 10.0)
    assert isinstance(d, Reject) and not d.unreachable
    assert (d.retry_after, d.retry_after_ms) == (1, 400)
    # Waiting for a slot: the wait, as before (the excess is smaller than the wait).
    q = replace(p, ttft=1.3, wait=1.1, prefill=0.15, can_start=False)
    d = decide([q], 0.5, 10.0)
    assert isinstance(d, Reject) and (d.retry_after, d.retry_after_ms) == (2, 1100)


def test_lenient_is_judged_on_the_mean_without_the_spread() -> None:
    free = [pred(ttft=0.9, spread=0.2)]
    assert isinstance(decide(free, 1.0, 0.0), Reject)  # 0.9 + 0.2 > 1
    assert isinstance(decide(free, 1.0, 0.0, lenient=True), Dispatch)
    full = [pred(ttft=0.9, wait=0.8, can_start=False, spread=0.5)]
    assert isinstance(decide(full, 1.0, 0.0), Reject)
    held = decide(full, 1.0, 0.0, lenient=True)
    assert isinstance(held, Hold) and held.deadline == pytest.approx(1.0 - 0.1)


def test_a_lenient_hold_is_served_by_the_deadline_its_spread_gives() -> None:
    """Answered at the deadline its mean gives it (1 - 0.1), but served by the one the
    prefill's spread would give it (1 - 0.1 - 0.15), as a request judged on the spread is."""
    full = [replace(pred(ttft=0.5, wait=0.3, can_start=False), prefill_spread=0.15)]
    strict = decide(full, 1.0, 0.0)
    assert isinstance(strict, Hold)
    assert strict.order is None and strict.deadline == pytest.approx(0.75)
    lenient = decide(full, 1.0, 0.0, lenient=True)
    assert isinstance(lenient, Hold)
    assert (lenient.deadline, lenient.order) == (pytest.approx(0.9), pytest.approx(0.75))
