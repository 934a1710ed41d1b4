"""The decision before the model is known (``decide(None, ...)``), with plain values and
a fake clock: the answer the request headers get when it cannot depend on the body."""

from __future__ import annotations

import pytest

from extproc.core.busy import DECODE, PREFILL, BusyThresholds, Share
from extproc.core.pool import WorkerPool
from extproc.core.scheduling import (
    ANY_MODEL,
    DEFERRED,
    NO_WORKERS,
    QUEUED,
    Outcome,
    Rejected,
    Routed,
    Scheduler,
    is_free,
)


class Clock:
    def __init__(self) -> None:
        self.t = 500.0

    def __call__(self) -> float:
        return self.t


# Busy at 50 % of the KV cache or 100 prefill tokens in flight.
TH = BusyThresholds(0.5, 100)


def make() -> tuple[WorkerPool, Scheduler, Clock]:
    clock = Clock()
    pool = WorkerPool(TH, clock=clock)
    return pool, Scheduler(pool), clock


def add(pool: WorkerPool, wid: str, model: str, port: int, blocks: int | None = None) -> None:
    """A worker with 10 KV blocks; ``blocks`` in use (6 of 10 is busy)."""
    pool.announce(wid, model=model, endpoint=f"127.0.0.1:{port}", kv_total_blocks=10)
    if blocks is not None:
        pool.report_load(wid, active_decode_blocks=blocks)


def took(pool: WorkerPool, sched: Scheduler, clock: Clock, model: str, seconds: float) -> None:
    """One request of ``model`` that lasted ``seconds``: Retry-After learns from it."""
    decision = sched.decide(model, 0)
    assert isinstance(decision, Routed), decision
    clock.t += seconds
    pool.release(decision.ticket)


def test_no_workers_is_the_no_workers_rejection() -> None:
    _, sched, _ = make()
    assert sched.decide(None) is NO_WORKERS
    assert sched.decide(None, waiting=True) is NO_WORKERS


def test_one_model_all_busy_is_rejected_under_its_name_with_its_retry_after() -> None:
    pool, sched, clock = make()
    add(pool, "a", "m", 1)
    took(pool, sched, clock, "m", 7.0)
    add(pool, "b", "m", 2, blocks=6)
    pool.report_load("a", active_decode_blocks=6)
    decision = sched.decide(None)
    assert decision == Rejected(Outcome.OVERLOADED, 7, DECODE, "m")
    assert decision == sched.decide("m", 0)  # the same answer the body would get


def test_several_models_all_busy_are_rejected_under_star_with_the_shortest_retry_after() -> None:
    pool, sched, clock = make()
    add(pool, "a", "m", 1)
    add(pool, "b", "n", 2)
    took(pool, sched, clock, "m", 9.0)
    took(pool, sched, clock, "n", 4.0)
    pool.report_load("a", active_prefill_tokens=150)
    pool.report_load("b", active_decode_blocks=6)
    decision = sched.decide(None)
    # The check is the one that fired on the first model's workers.
    assert decision == Rejected(Outcome.OVERLOADED, 4, PREFILL, ANY_MODEL)
    assert (pool.retry_after("m"), pool.retry_after("n")) == (9, 4)


def test_a_free_worker_of_any_model_leaves_the_answer_to_the_model() -> None:
    pool, sched, clock = make()
    add(pool, "a", "m", 1, blocks=6)
    add(pool, "b", "n", 2, blocks=5)  # 5 of 10: below 50 %, free
    assert sched.decide(None) is DEFERRED
    assert not any(r.inflight for _, r in pool.inflight())  # nothing was dispatched
    # A worker-side rejection marks it: not free for a second, then free again.
    pool.mark_overloaded(pool.workers["b"])
    assert sched.decide(None) == Rejected(Outcome.OVERLOADED, 1, DECODE, ANY_MODEL)
    clock.t += 1.0
    assert sched.decide(None) is DEFERRED


def test_a_worker_without_load_data_is_free() -> None:
    pool, sched, _ = make()
    add(pool, "a", "m", 1)
    assert sched.decide(None) is DEFERRED


def test_requests_waiting_in_the_router_queue_leave_the_answer_to_the_model() -> None:
    pool, sched, _ = make()
    add(pool, "a", "m", 1, blocks=6)
    assert isinstance(sched.decide(None), Rejected)
    assert sched.decide(None, waiting=True) is DEFERRED
    # With the model known, the waiting requests are not overtaken.
    assert sched.decide("m", 10, waiting=True) is QUEUED


@pytest.mark.parametrize(
    ("variant", "expected"),
    [
        (0, DEFERRED),  # the default class: 5 of 10 blocks is below its 50 %
        (1, Rejected(Outcome.OVERLOADED, 1, DECODE, "m")),  # 40 % share: busy at 2 blocks
        (2, DEFERRED),  # 200 % share: free up to 10 blocks
    ],
)
def test_per_class_variant(variant: int, expected: object) -> None:
    pool, sched, _ = make()
    pool.set_shares([Share(), Share(0.4), Share(2.0)])
    add(pool, "a", "m", 1, blocks=5)
    assert is_free(pool.workers["a"], variant, pool.clock()) is (expected is DEFERRED)
    assert sched.decide(None, variant=variant) == expected


def test_a_worker_marked_overloaded_is_not_free_until_the_mark_passes() -> None:
    pool, _, clock = make()
    add(pool, "a", "m", 1, blocks=0)
    worker = pool.workers["a"]
    assert is_free(worker, 0, clock())
    pool.mark_overloaded(worker)
    assert not is_free(worker, 0, clock())
    clock.t += 1.0
    assert is_free(worker, 0, clock())


def test_kv_mode_ranks_by_the_kv_total_a_rank_reports_over_the_announced_one() -> None:
    """a: 4 blocks of the 100 it reports (4 %); b: 2 of the 10 it announced (20 %)."""
    pool, sched, _ = make()
    add(pool, "a", "m", 1)
    add(pool, "b", "m", 2, blocks=2)
    pool.report_load("a", active_decode_blocks=4, kv_total_blocks=100)
    for _ in range(5):
        decision = sched.decide("m", 0)
        assert isinstance(decision, Routed) and decision.ticket.worker.worker_id == "a"
        pool.release(decision.ticket)
