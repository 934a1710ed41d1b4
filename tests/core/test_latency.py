"""DeadlineAdmission with plain values: targets of models and classes, the estimates it
feeds from load reports, what it shows, and the estimates of workers that left."""

from __future__ import annotations

import pytest

from extproc.core import deadline as deadline_module
from extproc.core.busy import BusyThresholds
from extproc.core.classes import ClassRegistry, parse_table
from extproc.core.deadline import Dispatch, Hold, Reject
from extproc.core.latency import GATEWAY_ONLY, RETRY_MEMORY, DeadlineAdmission
from extproc.core.pool import WorkerPool
from extproc.core.worker import Worker


class Clock:
    t = 100.0

    def __call__(self) -> float:
        return self.t


def make(target_ms: float | None = 1000.0) -> tuple[WorkerPool, DeadlineAdmission]:
    pool = WorkerPool(BusyThresholds(ttft_p99_target_ms=target_ms), clock=Clock())
    registry = ClassRegistry(
        parse_table(
            {
                "default": "standard",
                "classes": {"critical": {"ttft_p99_target_ms": 200}, "standard": {}},
            }
        ),
        pool,
    )
    return pool, DeadlineAdmission(pool, registry)


def test_a_class_target_replaces_the_models_and_a_class_without_one_uses_the_models() -> None:
    pool, admission = make(1000.0)
    pool.announce("w", model="m", endpoint="127.0.0.1:1")
    assert admission.target_s("m", "critical") == 0.2
    assert admission.target_s("m", "standard") == 1.0
    assert admission.target_s("m", "nope") == 1.0
    assert admission.target_s("m") == 1.0
    pool.set_thresholds("m", BusyThresholds())
    assert admission.target_s("m") is None
    assert admission.target_s("m", "critical") == 0.2


def test_load_reports_are_summed_over_the_ranks_that_report_each_field() -> None:
    pool, admission = make()
    pool.announce("w", model="m", endpoint="127.0.0.1:1", dp_size=2)
    pool.on_load = admission.load
    pool.report_load("w", dp_rank=0, num_requests_waiting=2, request_total_slots=4)
    pool.report_load("w", dp_rank=1, num_requests_waiting=1, request_active_slots=3)
    est = admission.estimates["w"]
    assert (est.waiting, est.active, est.total_slots) == (3, 3, 4)
    assert not est.gateway_only


def test_a_worker_with_no_queue_fields_is_shown_as_predicted_from_the_gateway() -> None:
    pool, admission = make()
    pool.announce("w", model="m", endpoint="127.0.0.1:1")
    pool.on_load = admission.load
    pool.report_load("w", active_decode_blocks=3)
    view = admission.view(pool.workers["w"])
    assert view["from"] == GATEWAY_ONLY
    assert view["held_requests"] == 0 and view["target_unreachable"] is False


def one_slot_measured() -> tuple[DeadlineAdmission, Worker, float]:
    """One worker "w" of model "m" with one slot, measured on 6 requests one at a time:
    0.1 s to the first byte, 1 s each. Returns the admission, the worker and the time after."""
    pool, admission = make()
    pool.announce("w", model="m", endpoint="127.0.0.1:1")
    pool.report_load("w", num_requests_waiting=0, request_active_slots=0, request_total_slots=1)
    admission.load(pool.workers["w"])
    worker = pool.workers["w"]
    t = 0.0
    for i in range(6):
        admission.dispatched(i, worker, 100, t, t)
        admission.first_byte(i, worker, t + 0.1)
        admission.ended(i, worker, t + 1.0, 10)
        t += 1.0
    return admission, worker, t


def test_decide_dispatches_holds_and_rejects_on_the_measured_worker() -> None:
    admission, worker, t = one_slot_measured()
    decision, _ = admission.admit("m", [worker], 100, 1.0, t, t)
    assert isinstance(decision, Dispatch)
    admission.dispatched("busy", worker, 100, t, t)
    decision, _ = admission.admit("m", [worker], 100, 5.0, t, t)  # ~1 s wait fits 5 s
    assert isinstance(decision, Hold) and decision.deadline <= t + 5.0
    decision, _ = admission.admit("m", [worker], 100, 0.5, t, t)  # it does not fit 0.5 s
    assert isinstance(decision, Reject) and decision.wait is not None and decision.wait > 0.5


def test_a_retry_yields_its_slot_while_first_attempts_are_refused() -> None:
    """A retry (the client says so) is refused while the deadline refused a first attempt
    of its model within the last second; before that and after it, it is decided alike."""
    admission, worker, t = one_slot_measured()
    decision, _ = admission.admit("m", [worker], 100, 1.0, t, t, retry=True)
    assert isinstance(decision, Dispatch)  # nothing refused yet: a retry is a request
    admission.dispatched("busy", worker, 100, t, t)
    decision, _ = admission.admit("m", [worker], 100, 0.5, t, t)  # a first attempt
    assert isinstance(decision, Reject)
    admission.ended("busy", worker, t + 0.2)  # the slot frees
    decision, _ = admission.admit("m", [worker], 100, 1.0, t + 0.2, t + 0.2)
    assert isinstance(decision, Dispatch)  # a first attempt takes the free slot
    decision, preds = admission.admit("m", [worker], 100, 1.0, t + 0.3, t + 0.3, retry=True)
    assert isinstance(decision, Reject)  # a retry does not, 0.3 s after the refusal
    assert decision.yielded and admission.probe(decision, preds, t + 0.3) is None
    assert decision.wait == pytest.approx(0.7) and decision.retry_after_ms == 700
    assert admission.refused_at["m"] == {0: t}  # a refused retry does not extend it
    decision, _ = admission.admit("m", [worker], 100, 1.0, t + 1.0, t + 1.0, retry=True)
    assert isinstance(decision, Dispatch)  # a second later: decided like any request


def test_a_retry_due_after_a_deadline_reply_counts_from_its_users_first_attempt() -> None:
    """The router remembers when the retry of each deadline reply is due and when its user
    first asked: a retry arriving then (at most 250 ms late) takes that user's first
    attempt as its start, each due retry once, the latest due first; a first attempt, a
    retry that matches none, and one too late keep their own arrival."""
    _, admission = make()
    admission.told("m", 10.0, 700, 10.0)  # refused at 10.0: come back in 0.7 s
    admission.told("m", 10.2, 500, 10.2)  # refused at 10.2: come back in 0.5 s (due 10.7)
    admission.told("n", 9.0, 1700, 9.0)  # another model's, due at 10.7 too
    assert admission.user_arrival("m", 10.72, False, 10.72) == 10.72  # a first attempt
    assert admission.user_arrival("m", 10.6, True, 10.6) == 10.6  # none due yet
    # Both due at 10.7: the first retry takes the one that came due last (10.2, by 0.5 s),
    # the second the other; a third finds none left.
    assert admission.user_arrival("m", 10.72, True, 10.72) == 10.2
    assert admission.user_arrival("m", 10.73, True, 10.73) == 10.0
    assert admission.user_arrival("m", 10.74, True, 10.74) == 10.74
    assert admission.user_arrival("n", 11.0, True, 11.0) == 11.0  # 300 ms after its due
    assert admission.due == {}  # nothing is kept that no retry can match
    # A chain: the retry refused again names its user's first attempt for the next one.
    admission.told("m", 10.0, 1000, 10.8)
    assert admission.user_arrival("m", 11.85, True, 11.85) == 10.0


def test_a_retry_whose_user_is_already_past_the_target_is_refused() -> None:
    """One slot, busy for about a second: a first attempt with a 5 s target is held; a
    retry arriving at the same moment, due after a deadline reply its user got 4.5 s
    earlier, has 0.5 s of that target left and is refused."""
    admission, worker, t = one_slot_measured()
    admission.dispatched("busy", worker, 100, t, t)
    decision, _ = admission.admit("m", [worker], 100, 5.0, t, t)
    assert isinstance(decision, Hold)
    admission.told("m", t - 4.5, 4500, t - 4.5)
    start = admission.user_arrival("m", t, True, t)
    assert start == t - 4.5
    decision, _ = admission.admit("m", [worker], 100, 5.0, start, t, retry=True)
    assert isinstance(decision, Reject) and not decision.yielded


def test_due_retries_are_bounded_per_model() -> None:
    _, admission = make()
    for i in range(RETRY_MEMORY + 10):
        admission.told("m", 0.0, 60_000, i * 1e-3)
    assert len(admission.due["m"]) == RETRY_MEMORY


def test_a_retry_yields_to_its_class_and_better_ones_not_to_lesser_ones() -> None:
    """Priorities 0 (critical) and 2 (sheddable): a sheddable first attempt refused makes a
    sheddable retry yield, not a critical retry; a lesser class's first attempt never yields."""
    admission, worker, t = one_slot_measured()
    admission.dispatched("busy", worker, 100, t, t)
    decision, _ = admission.admit("m", [worker], 100, 0.5, t, t, priority=2)
    assert isinstance(decision, Reject) and not decision.yielded  # sheddable: no room
    admission.ended("busy", worker, t + 0.1)
    now = t + 0.2
    decision, _ = admission.admit("m", [worker], 100, 1.0, now, now, retry=True, priority=0)
    assert isinstance(decision, Dispatch)  # a sheddable refusal holds no critical retry back
    decision, _ = admission.admit("m", [worker], 100, 1.0, now, now, retry=True, priority=2)
    assert isinstance(decision, Reject) and decision.yielded
    admission.dispatched("crit", worker, 100, now, now)
    decision, _ = admission.admit("m", [worker], 100, 0.5, t + 0.3, t + 0.3, priority=0)
    assert isinstance(decision, Reject) and not decision.yielded  # critical: no room
    admission.ended("crit", worker, t + 0.4)
    decision, _ = admission.admit("m", [worker], 100, 1.0, t + 0.5, t + 0.5, priority=2)
    assert isinstance(decision, Dispatch)  # a first attempt of a lesser class: decided


def test_the_best_class_is_judged_on_its_mean_prediction_the_others_on_the_spread(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """One slot, busy: the next completion is 1 s away on average (by the rate, the running
    request's age left out: its 90th percentile about 2.3 s). Against a 1.5 s target a
    critical request (the best of several priorities) is held, more likely than not to be
    served in time; a standard one is rejected. Without lesser classes, or without classes,
    nobody is judged leniently."""
    monkeypatch.setattr(deadline_module, "AGES_FOR", 0)
    admission, worker, t = one_slot_measured()
    admission.dispatched("busy", worker, 100, t, t)
    admission.classes = ClassRegistry(
        parse_table(
            {
                "default": "standard",
                "classes": {"critical": {"priority": 0}, "standard": {"priority": 1}},
            }
        ),
        admission.pool,
    )
    assert admission.best_class(0) and not admission.best_class(1)
    decision, _ = admission.admit("m", [worker], 100, 1.5, t, t, priority=0)
    assert isinstance(decision, Hold)
    decision, _ = admission.admit("m", [worker], 100, 1.5, t, t, priority=1)
    assert isinstance(decision, Reject)
    one = parse_table({"default": "standard", "classes": {"standard": {"priority": 0}}})
    admission.classes = ClassRegistry(one, admission.pool)
    assert not admission.best_class(0)
    admission.classes = None
    assert not admission.best_class(0)
    decision, _ = admission.admit("m", [worker], 100, 1.5, t, t)
    assert isinstance(decision, Reject)


def test_the_share_met_and_the_models_with_a_target() -> None:
    pool, admission = make(500.0)
    pool.announce("w", model="m", endpoint="127.0.0.1:1")
    assert admission.ttft_measured("m", 0.4, 0.5) is True
    assert admission.ttft_measured("m", 0.6, 0.5) is False
    assert admission.ttft_measured("m", 0.5, 0.5) is True  # at the target: met
    [model] = list(admission.models())
    assert (model.model, model.target_s, model.held) == ("m", 0.5, 0)
    assert model.met.share == 2 / 3


def test_the_estimates_of_workers_that_left_are_dropped() -> None:
    pool, admission = make()
    pool.announce("w", model="m", endpoint="127.0.0.1:1")
    pool.announce("v", model="m", endpoint="127.0.0.1:2")
    admission.estimate("w")
    admission.estimate("v")
    pool.leave("w")
    assert admission.prune() == ["w"]
    assert set(admission.estimates) == {"v"}


def test_an_unreachable_target_still_measures_a_free_worker_four_times_a_second() -> None:
    pool, admission = make()
    pool.announce("w", model="m", endpoint="127.0.0.1:1")
    pool.report_load("w", num_requests_waiting=0, request_active_slots=0, request_total_slots=1)
    admission.load(pool.workers["w"])
    worker = pool.workers["w"]
    t = 0.0
    for i in range(8):  # cold: 0.1 s to the first byte
        admission.dispatched(i, worker, 100, t, t)
        admission.first_byte(i, worker, t + 0.1)
        admission.ended(i, worker, t + 0.2, 10)
        t += 1.0
    decision, preds = admission.admit("m", [worker], 100, 0.05, t, t)
    assert isinstance(decision, Reject) and decision.unreachable
    assert admission.probe(decision, preds, t) == "w"
    assert admission.probe(decision, preds, t + 0.2) is None  # at most every 0.25 s
    t += 0.25
    probes = 0
    while isinstance(decision, Reject):  # warm now: 10 ms to the first byte
        assert admission.probe(decision, preds, t) == "w"
        admission.dispatched(("p", probes), worker, 100, t, t)
        admission.first_byte(("p", probes), worker, t + 0.01)
        admission.ended(("p", probes), worker, t + 0.1, 10)
        probes += 1
        t += 0.25
        decision, preds = admission.admit("m", [worker], 100, 0.05, t, t)
        # Within the prefill fit's memory (about the last 100 requests).
        assert probes < 100, "the measurement does not follow the worker"
    assert isinstance(decision, Dispatch)


def test_no_retry_fits_once_what_is_left_is_below_every_idle_ttft() -> None:
    """Measured: about 0.1 s to a first token on an idle worker. A retry due 0.95 s into a
    1 s target has 50 ms left: none fits; due at 0.5 s it may. A worker not yet measured may
    be faster than any: never "none fits" while one is in the pool."""
    admission, _, t = one_slot_measured()
    assert admission.no_retry_fits("m", 100, 1.0, t, 950, t)
    assert not admission.no_retry_fits("m", 100, 1.0, t, 500, t)
    assert not admission.no_retry_fits("nope", 100, 1.0, t, 950, t)  # no worker: unknown
    admission.pool.announce("new", model="m", endpoint="127.0.0.1:2")
    assert not admission.no_retry_fits("m", 100, 1.0, t, 950, t)
