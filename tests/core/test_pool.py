"""WorkerPool and Scheduler with plain values and a fake clock (no sockets)."""

from __future__ import annotations

import random
from typing import Any

import pytest

from extproc.core.allowlist import WorkerAllowList
from extproc.core.busy import BusyThresholds
from extproc.core.pool import EndpointNotAllowed, RankOutOfRange, WorkerPool
from extproc.core.scheduling import Outcome, Routed, Scheduler


class Clock:
    def __init__(self) -> None:
        self.t = 1000.0

    def __call__(self) -> float:
        return self.t


DEFAULT = BusyThresholds(0.5, 100)


def make_pool(th: BusyThresholds = DEFAULT, **kw: object) -> tuple[WorkerPool, Clock]:
    clock = Clock()
    return WorkerPool(th, clock=clock, **kw), clock  # type: ignore[arg-type]


def picked(sched: Scheduler, model: str = "m") -> str:
    """The worker a decision routes to (the request is dispatched)."""
    decision = sched.decide(model, 0)
    assert isinstance(decision, Routed), decision
    return decision.ticket.worker.worker_id


def announce(pool: WorkerPool, wid: str, model: str = "m", port: int = 8000, **kw: Any) -> None:
    pool.announce(wid, model=model, endpoint=f"127.0.0.1:{port}", **kw)


def test_config_registers_and_load_marks_busy() -> None:
    pool, _ = make_pool()
    announce(pool, "w", kv_total_blocks=100)
    assert [w.worker_id for w in pool.by_model["m"]] == ["w"]
    pool.report_load("w", active_decode_blocks=51)
    assert pool.workers["w"].busy
    pool.report_load("w", active_decode_blocks=50)
    assert not pool.workers["w"].busy


def test_load_before_config_is_kept_but_not_routable() -> None:
    pool, _ = make_pool()
    pool.report_load("w", active_decode_blocks=99, kv_total_blocks=100)
    assert "w" in pool.workers and not pool.by_model
    announce(pool, "w")
    assert pool.by_model["m"][0].busy  # the earlier load applies once config arrives


def test_later_config_replaces_model_and_endpoint() -> None:
    pool, _ = make_pool()
    announce(pool, "w", "a", 8000)
    announce(pool, "w", "b", 8001)
    assert "a" not in pool.by_model
    assert pool.by_model["b"][0].endpoint == "127.0.0.1:8001"


def test_bye_and_ttl_remove() -> None:
    pool, clock = make_pool(worker_ttl=10.0)
    announce(pool, "a")
    announce(pool, "b")
    pool.leave("a")
    assert [w.worker_id for w in pool.by_model["m"]] == ["b"]
    clock.t += 9.9
    assert pool.expire() == []
    pool.report_load("b")  # heartbeat
    clock.t += 9.9
    assert pool.expire() == []
    clock.t += 0.2
    assert pool.expire() == ["b"]
    assert not pool.by_model and not pool.workers


def test_seq_gaps_count_lost_and_restart_is_not_loss() -> None:
    pool, _ = make_pool()
    announce(pool, "w")
    for seq in (1, 2, 5, 6, 1, 2, 4):
        pool.report_load("w", seq=seq)
    assert pool.events_lost == 2 + 1  # 3,4 missing; after the restart 3 missing


def test_rank_beyond_dp_size_is_rejected_without_change() -> None:
    pool, _ = make_pool()
    announce(pool, "w", dp_size=2, kv_total_blocks=10)
    with pytest.raises(RankOutOfRange, match="dp_rank 2 >= dp_size 2 of w"):
        pool.report_load("w", dp_rank=2, active_decode_blocks=9)
    assert all(r.reported_at is None for r in pool.workers["w"].ranks)


def test_allow_list_drops_config() -> None:
    pool, _ = make_pool(allow=WorkerAllowList.from_entries(["10.0.0.0/8", "localhost:9"]))
    with pytest.raises(EndpointNotAllowed, match=r"127\.0\.0\.1:8000"):
        announce(pool, "w")
    assert not pool.workers
    pool.announce("ok", model="m", endpoint="10.1.2.3:80")
    pool.announce("ok2", model="m", endpoint="LOCALHOST:9")
    assert len(pool.by_model["m"]) == 2


def test_effective_load_is_max_of_reported_and_estimate() -> None:
    pool, _ = make_pool(BusyThresholds(None, 100))
    announce(pool, "w", block_size=16)
    w = pool.workers["w"]
    rank = w.ranks[0]
    pool.report_load("w", active_prefill_tokens=30, active_decode_blocks=1)
    t1 = pool.dispatch(w, rank, 50)
    assert (rank.prefill_tokens, rank.decode_blocks) == (50, 4)  # ceil(50/16) = 4
    t2 = pool.dispatch(w, rank, 51)
    assert rank.prefill_tokens == 101 and w.busy
    pool.generated(t2, 1)  # first token: prompt leaves prefill
    assert rank.prefill_tokens == 50 and not w.busy
    pool.release(t1)
    pool.release(t2)
    pool.release(t2)  # idempotent
    assert (rank.inflight, rank.est_blocks, rank.est_prefill) == (0, 0, 0)
    assert (rank.prefill_tokens, rank.decode_blocks) == (30, 1)


def test_track_output_blocks_counts_generated_tokens() -> None:
    pool, _ = make_pool(BusyThresholds(0.5), track_output_blocks=True)
    announce(pool, "w", block_size=16, kv_total_blocks=10)
    w = pool.workers["w"]
    t = pool.dispatch(w, w.ranks[0], 16)
    assert w.ranks[0].est_blocks == 1
    pool.generated(t, 64)  # 80 tokens -> 5 blocks
    assert w.ranks[0].est_blocks == 5 and not w.busy
    pool.generated(t, 1)  # 81 -> 6 blocks > 5
    assert w.busy
    pool.release(t)
    assert w.ranks[0].est_blocks == 0 and not w.busy


def test_threshold_change_applies_immediately_both_ways() -> None:
    pool, _ = make_pool(BusyThresholds())
    announce(pool, "w", kv_total_blocks=100)
    pool.report_load("w", active_decode_blocks=80)
    assert not pool.workers["w"].busy
    pool.set_thresholds("m", BusyThresholds(0.5))
    assert pool.workers["w"].busy
    pool.set_thresholds("m", BusyThresholds(0.9))
    assert not pool.workers["w"].busy


def test_overload_mark_cleared_by_load_or_one_second() -> None:
    pool, clock = make_pool(BusyThresholds())
    announce(pool, "w")
    sched = Scheduler(pool)
    w = pool.workers["w"]
    pool.mark_overloaded(w)
    assert sched.decide("m", 0).outcome is Outcome.OVERLOADED
    pool.report_load("w")
    assert sched.decide("m", 0).outcome is Outcome.ROUTED
    pool.mark_overloaded(w)
    clock.t += 0.99
    assert sched.decide("m", 0).outcome is Outcome.OVERLOADED
    clock.t += 0.02
    assert sched.decide("m", 0).outcome is Outcome.ROUTED  # no thresholds set, still cleared


def test_outcomes_no_workers_and_not_found() -> None:
    pool, _ = make_pool()
    sched = Scheduler(pool)
    assert sched.decide("m", 0).outcome is Outcome.NO_WORKERS
    announce(pool, "w", "other")
    assert sched.decide("m", 0).outcome is Outcome.MODEL_NOT_FOUND


def test_kv_mode_least_loaded_then_prefill_and_ties_rotate() -> None:
    pool, _ = make_pool(BusyThresholds())
    for i, wid in enumerate("abc"):
        announce(pool, wid, port=8000 + i, kv_total_blocks=100)
    pool.report_load("a", active_decode_blocks=10, active_prefill_tokens=0)
    pool.report_load("b", active_decode_blocks=5, active_prefill_tokens=50)
    pool.report_load("c", active_decode_blocks=5, active_prefill_tokens=10)
    sched = Scheduler(pool, "kv")
    assert picked(sched) == "c"
    for wid in "abc":
        pool.report_load(wid, active_decode_blocks=0, active_prefill_tokens=0)
    seen = {picked(sched) for _ in range(6)}
    assert seen == {"a", "b", "c"}


def test_kv_mode_picks_least_loaded_free_rank() -> None:
    pool, _ = make_pool(BusyThresholds(0.5))
    announce(pool, "w", kv_total_blocks=100, dp_size=3)
    pool.report_load("w", dp_rank=0, active_decode_blocks=90)
    pool.report_load("w", dp_rank=1, active_decode_blocks=30)
    pool.report_load("w", dp_rank=2, active_decode_blocks=20)
    decision = Scheduler(pool).decide("m", 0)
    assert isinstance(decision, Routed) and decision.ticket.rank.index == 2


def test_round_robin_and_random_skip_busy() -> None:
    pool, _ = make_pool(BusyThresholds(0.5))
    for i, wid in enumerate("abc"):
        announce(pool, wid, port=8000 + i, kv_total_blocks=10)
    pool.report_load("b", active_decode_blocks=9)
    rr = Scheduler(pool, "round-robin")
    seq = [picked(rr) for _ in range(4)]
    assert set(seq) == {"a", "c"} and seq[0] != seq[1]
    rnd = Scheduler(pool, "random", random.Random(1))
    assert {picked(rnd) for _ in range(40)} == {"a", "c"}


def test_decode_check_inactive_outside_kv_mode() -> None:
    pool, _ = make_pool(BusyThresholds(0.5), kv_mode=False)
    announce(pool, "w", kv_total_blocks=10)
    pool.report_load("w", active_decode_blocks=10)
    assert not pool.workers["w"].busy


def test_thresholds_per_model_start_from_defaults() -> None:
    pool, _ = make_pool(BusyThresholds(None, 7))
    announce(pool, "a", "m1")
    pool.set_thresholds("m1", BusyThresholds(None, 99))
    announce(pool, "b", "m2", 8001)
    assert pool.thresholds_for("m2") == BusyThresholds(None, 7)
    assert pool.thresholds_for("m1") == BusyThresholds(None, 99)
    pool.leave("a")
    announce(pool, "a", "m1")
    assert pool.thresholds_for("m1") == BusyThresholds(None, 99)  # kept while gone


def test_retry_after_is_bounded() -> None:
    pool, clock = make_pool()
    announce(pool, "w")
    assert pool.retry_after("m") == 1
    w = pool.workers["w"]
    t = pool.dispatch(w, w.ranks[0], 1)
    clock.t += 500
    pool.release(t)
    assert pool.retry_after("m") == 60
