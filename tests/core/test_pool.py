"""WorkerPool and Scheduler with plain values and a fake clock (no sockets)."""

from __future__ import annotations

import random
from typing import Any

import pytest

from extproc.core.allowlist import WorkerAllowList
from extproc.core.busy import BusyThresholds
from extproc.core.pool import EndpointNotAllowed, RankOutOfRange, WorkerPool
from extproc.core.scheduling import Outcome, Routed, Scheduler
from extproc.core.worker import Ticket


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


# ----- the worker that served the request (an Envoy retry moved it) ---------------------


def estimate(worker: Any) -> list[tuple[int, int, int]]:
    return [(r.inflight, r.est_blocks, r.est_prefill) for r in worker.ranks]


def test_move_takes_the_whole_estimate_to_the_serving_worker() -> None:
    pool, _ = make_pool(BusyThresholds(None, 100))
    announce(pool, "a", port=8001, block_size=16)
    announce(pool, "b", port=8002, block_size=16)
    a, b = pool.workers["a"], pool.workers["b"]
    t = pool.dispatch(a, a.ranks[0], 101)  # above the prefill threshold: a is busy
    freed: list[str] = []
    pool.on_capacity = freed.append
    assert a.busy and not b.busy
    pool.move(t, b)
    assert estimate(a) == [(0, 0, 0)] and not a.busy
    assert estimate(b) == [(1, 7, 101)] and b.busy  # ceil(101/16) = 7
    assert (t.worker, t.rank) == (b, b.ranks[0])
    assert freed == ["m"]  # a request waiting for the model may now fit on a
    pool.release(t)
    assert estimate(a) == estimate(b) == [(0, 0, 0)] and not b.busy


def test_move_after_the_first_token_carries_no_prefill_and_recounts_blocks() -> None:
    pool, _ = make_pool(BusyThresholds(0.5), track_output_blocks=True)
    announce(pool, "a", port=8001, block_size=16, kv_total_blocks=100)
    announce(pool, "b", port=8002, block_size=32, kv_total_blocks=10)
    a, b = pool.workers["a"], pool.workers["b"]
    t = pool.dispatch(a, a.ranks[0], 40)
    pool.generated(t, 120)  # 160 tokens: 10 blocks of 16 on a
    assert estimate(a) == [(1, 10, 0)]
    pool.move(t, b)
    assert estimate(a) == [(0, 0, 0)]
    assert estimate(b) == [(1, 5, 0)] and not b.busy  # 160 tokens in blocks of 32
    pool.generated(t, 1)  # 161 tokens: 6 blocks of 32 > half of 10
    assert estimate(b) == [(1, 6, 0)] and b.busy and estimate(a) == [(0, 0, 0)]
    pool.release(t)
    assert estimate(b) == [(0, 0, 0)] and not b.busy


def test_move_picks_the_rank_with_fewest_requests_or_the_one_given() -> None:
    pool, _ = make_pool()
    announce(pool, "a", port=8001)
    announce(pool, "b", port=8002, dp_size=3)
    a, b = pool.workers["a"], pool.workers["b"]
    pool.dispatch(b, b.ranks[0], 16)
    pool.dispatch(b, b.ranks[2], 16)
    t1 = pool.dispatch(a, a.ranks[0], 16)
    pool.move(t1, b)
    assert t1.rank is b.ranks[1]
    t2 = pool.dispatch(a, a.ranks[0], 16)
    pool.move(t2, b)
    assert t2.rank is b.ranks[0]  # all three have one: the lowest index
    t3 = pool.dispatch(a, a.ranks[0], 16)
    pool.move(t3, b, b.ranks[2])
    assert [r.inflight for r in b.ranks] == [2, 1, 2] and a.ranks[0].inflight == 0


def test_move_to_an_unknown_host_releases_the_estimate_and_counts_nothing() -> None:
    pool, clock = make_pool(BusyThresholds(None, 100))
    announce(pool, "a", port=8001)
    announce(pool, "b", port=8002)
    a, b = pool.workers["a"], pool.workers["b"]
    t = pool.dispatch(a, a.ranks[0], 101)
    clock.t += 30.0
    pool.move(t, None)
    assert t.released and not a.busy
    assert estimate(a) == estimate(b) == [(0, 0, 0)]
    pool.generated(t, 50)
    pool.prefill_done(t)
    pool.release(t)  # the stream's end: already released, nothing changes
    assert estimate(a) == estimate(b) == [(0, 0, 0)]
    assert pool.retry_after("m") == 1  # no 30 s duration was recorded


def test_move_to_its_own_rank_or_of_a_released_ticket_changes_nothing() -> None:
    pool, _ = make_pool()
    announce(pool, "a", port=8001)
    announce(pool, "b", port=8002)
    a, b = pool.workers["a"], pool.workers["b"]
    t = pool.dispatch(a, a.ranks[0], 32)
    changed: list[str] = []
    pool.on_capacity = changed.append
    pool.move(t, a)
    assert estimate(a) == [(1, 2, 32)] and t.worker is a and changed == []
    pool.release(t)
    pool.move(t, b)
    assert estimate(a) == estimate(b) == [(0, 0, 0)] and t.worker is a


@pytest.mark.parametrize("seed", range(20))
def test_any_sequence_of_moves_leaves_nothing_behind(seed: int) -> None:
    """Dispatch, move (to a worker, a rank or nowhere), tokens and release in a random
    order: while requests are live the estimates sum to theirs, and 0 everywhere after."""
    rng = random.Random(seed)
    pool, _ = make_pool(BusyThresholds(0.5, 100), track_output_blocks=True)
    for i, (bs, dp) in enumerate([(16, 1), (32, 2), (8, 3)]):
        announce(pool, f"w{i}", port=8000 + i, block_size=bs, dp_size=dp, kv_total_blocks=50)
    workers = list(pool.workers.values())
    live: list[Ticket] = []
    for _ in range(200):
        op = rng.randrange(5)
        if op == 0 or not live:
            w = rng.choice(workers)
            live.append(pool.dispatch(w, rng.choice(w.ranks), rng.randrange(1, 300)))
            continue
        t = rng.choice(live)
        if op == 1:
            to = rng.choice([*workers, None])
            rank = rng.choice(to.ranks) if to is not None and rng.random() < 0.5 else None
            pool.move(t, to, rank)
        elif op == 2:
            pool.generated(t, rng.randrange(1, 40))
        elif op == 3:
            pool.prefill_done(t)
        else:
            pool.release(t)
        live = [t for t in live if not t.released]
        counted = [r.inflight for w in workers for r in w.ranks]
        assert sum(counted) == len(live) and min(counted) >= 0
        assert sum(r.est_blocks for w in workers for r in w.ranks) == sum(t.blocks for t in live)
    for t in live:
        pool.release(t)
    for w in workers:
        assert estimate(w) == [(0, 0, 0)] * len(w.ranks) and not w.busy


def test_a_name_announced_endpoint_is_found_by_its_resolved_address() -> None:
    pool, _ = make_pool()
    pool.announce("w", model="m", endpoint="worker-w:8000")
    pool.announce("v", model="m2", endpoint="worker-w:8000")  # the same engine, another model
    assert pool.worker_at("10.0.0.7:8000", "m") is None
    pool.set_addresses("worker-w:8000", frozenset({"10.0.0.7:8000"}))
    w = pool.workers["w"]
    assert pool.worker_at("10.0.0.7:8000", "m") is w
    assert pool.worker_at("10.0.0.7:8000", "m2") is pool.workers["v"]
    assert pool.worker_at("worker-w:8000", "m") is w
    assert w.serves_at("10.0.0.7:8000") and w.serves_at("worker-w:8000")
    assert not w.serves_at("10.0.0.8:8000")
    # A worker announcing the name later has the addresses at once; a move drops them.
    pool.announce("u", model="m3", endpoint="worker-w:8000")
    assert pool.workers["u"].addresses == {"10.0.0.7:8000"}
    pool.announce("u", model="m3", endpoint="worker-u:8000")
    assert pool.workers["u"].addresses == frozenset()
    # The last worker of the name gone, its addresses are forgotten.
    pool.leave("w")
    assert "worker-w:8000" in pool.resolved
    pool.leave("v")
    assert "worker-w:8000" not in pool.resolved


def test_queue_fields_are_stored_per_rank_and_never_change_a_busy_flag() -> None:
    pool, _ = make_pool(BusyThresholds(0.5))
    announce(pool, "w", dp_size=2, kv_total_blocks=100)
    seen: list[str] = []
    pool.on_load = lambda worker: seen.append(worker.worker_id)
    pool.report_load(
        "w",
        dp_rank=1,
        active_decode_blocks=10,
        num_requests_waiting=7,
        request_active_slots=4,
        request_total_slots=4,
    )
    rank0, rank1 = pool.workers["w"].ranks
    assert (rank1.reported_waiting, rank1.reported_active_slots) == (7, 4)
    assert rank1.reported_total_slots == 4
    assert rank0.reported_waiting is None and rank0.reported_total_slots is None
    assert not pool.workers["w"].busy  # 7 waiting, all slots taken: the busy rule is KV's
    assert seen == ["w"]  # told after the report is applied
    # A later report without them: not reported any more.
    pool.report_load("w", dp_rank=1, active_decode_blocks=10)
    assert (rank1.reported_waiting, rank1.reported_active_slots) == (None, None)
    assert rank1.reported_total_slots is None


def test_a_threshold_change_tells_the_capacity_listener() -> None:
    pool, _ = make_pool(BusyThresholds(0.5))
    announce(pool, "w", kv_total_blocks=100)
    woken: list[str] = []
    pool.on_capacity = woken.append
    pool.set_thresholds("m", BusyThresholds(0.9, ttft_p99_target_ms=500.0))
    pool.set_thresholds("m", BusyThresholds(0.9))  # the target removed
    assert woken == ["m", "m"]
