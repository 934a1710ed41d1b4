"""Shared in-flight estimates and thresholds across replicas, with plain values."""

from __future__ import annotations

import itertools

from hypothesis import given, settings
from hypothesis import strategies as st

from extproc.core.busy import BusyThresholds
from extproc.core.peers import PeerEstimates, own_estimates
from extproc.core.pool import WorkerPool
from extproc.core.scheduling import Routed, Scheduler


class Clock:
    def __init__(self) -> None:
        self.t = 50.0

    def __call__(self) -> float:
        return self.t


PREFILL_1000 = BusyThresholds(None, 1000)


def make(th: BusyThresholds = PREFILL_1000) -> tuple[WorkerPool, PeerEstimates, Clock]:
    clock = Clock()
    pool = WorkerPool(th, clock=clock)
    pool.replica.replica_id = "me"
    for i, wid in enumerate("ab"):
        pool.announce(wid, model="m", endpoint=f"127.0.0.1:{8000 + i}", dp_size=2)
    return pool, PeerEstimates(pool, ttl=3.0), clock


def test_peer_estimates_add_to_the_effective_load_and_make_a_worker_busy() -> None:
    pool, peers, _ = make()
    rank = pool.workers["a"].ranks[0]
    assert rank.prefill_tokens is None and not pool.workers["a"].busy
    peers.snapshot("r1", [("a", 0, 2, 10, 600)])
    peers.snapshot("r2", [("a", 0, 1, 5, 500), ("a", 1, 1, 5, 1001)])
    assert (rank.decode_blocks, rank.prefill_tokens) == (15, 1100)
    assert pool.workers["a"].busy  # both ranks above 1000 prefill tokens
    decision = Scheduler(pool).decide("m", 40)
    assert isinstance(decision, Routed) and decision.ticket.worker.worker_id == "b"
    assert rank.prefill_tokens == 1100  # our own dispatch went elsewhere


def test_a_snapshot_replaces_the_previous_one_whole() -> None:
    pool, peers, _ = make()
    peers.snapshot("r1", [("a", 0, 3, 30, 3000), ("b", 1, 1, 1, 1)])
    peers.snapshot("r1", [("a", 0, 1, 2, 20)])
    ranks = [r for w in pool.workers.values() for r in w.ranks]
    assert [(r.peer_inflight, r.peer_blocks, r.peer_prefill) for r in ranks] == [
        (1, 2, 20),
        (0, 0, 0),
        (0, 0, 0),
        (0, 0, 0),
    ]
    assert not pool.workers["a"].busy


def test_own_echo_is_ignored_and_unknown_workers_are_skipped() -> None:
    pool, peers, _ = make()
    peers.snapshot("me", [("a", 0, 5, 5, 5000)])
    peers.snapshot("r1", [("zz", 0, 1, 1, 1), ("a", 7, 1, 1, 1)])
    assert all(r.peer_inflight == 0 for w in pool.workers.values() for r in w.ranks)


def test_bye_and_ttl_remove_a_replica_contribution() -> None:
    pool, peers, clock = make()
    peers.snapshot("r1", [("a", 0, 1, 1, 2000), ("a", 1, 1, 1, 2000)])
    peers.snapshot("r2", [("b", 0, 1, 1, 2000), ("b", 1, 1, 1, 2000)])
    assert pool.workers["a"].busy and pool.workers["b"].busy
    assert peers.leave("r1") and not peers.leave("r1")
    assert not pool.workers["a"].busy
    clock.t += 2.9
    assert peers.expire() == []
    clock.t += 0.2
    assert peers.expire() == ["r2"]
    assert not pool.workers["b"].busy
    assert all(r.peer_prefill == 0 for w in pool.workers.values() for r in w.ranks)


def test_a_worker_that_left_and_came_back_is_never_subtracted_from() -> None:
    pool, peers, _ = make()
    peers.snapshot("r1", [("a", 0, 1, 4, 400)])
    pool.leave("a")
    pool.announce("a", model="m", endpoint="127.0.0.1:8000", dp_size=2)
    peers.snapshot("r1", [])
    fresh = pool.workers["a"].ranks[0]
    assert (fresh.peer_inflight, fresh.peer_blocks, fresh.peer_prefill) == (0, 0, 0)


def test_own_estimates_and_their_change_counter() -> None:
    pool, _, _ = make()
    calls = []
    pool.replica.on_estimates = lambda: calls.append(pool.replica.estimates_version)
    decision = Scheduler(pool).decide("m", 33)
    assert isinstance(decision, Routed)
    t = decision.ticket
    assert own_estimates(pool) == [(t.worker.worker_id, t.rank.index, 1, 3, 33)]
    pool.generated(t, 1)
    pool.release(t)
    assert own_estimates(pool) == [] and calls == [1, 2, 3]


def test_threshold_changes_converge_whatever_the_order() -> None:
    """Concurrent changes on two replicas: every replica ends with the same values."""
    changes = [
        ("m", BusyThresholds(0.1), (1, "r1")),
        ("m", BusyThresholds(0.2), (1, "r2")),  # same version: the higher id wins
        ("m", BusyThresholds(0.3), (2, "r1")),
        ("n", BusyThresholds(None, 5), (1, "r1")),
    ]
    results = set()
    for order in itertools.permutations(changes):
        pool = WorkerPool(BusyThresholds())
        for model, th, stamp in order:
            pool.set_thresholds(model, th, stamp)
        results.add(tuple(sorted((m, pool.thresholds_for(m)) for m in ("m", "n"))))
    assert results == {(("m", BusyThresholds(0.3)), ("n", BusyThresholds(None, 5)))}


def test_a_local_change_is_stamped_above_everything_seen_and_announced() -> None:
    pool = WorkerPool(BusyThresholds())
    pool.replica.replica_id = "r0"
    told: list[str] = []
    pool.threshold_versions.listeners.append(told.append)
    pool.set_thresholds("m", BusyThresholds(0.5), (7, "zz"))
    assert told == []  # a remote change is not announced again
    pool.set_thresholds("m", BusyThresholds(0.6))
    assert pool.threshold_versions.stamps["m"] == (8, "r0") and told == ["m"]
    assert not pool.set_thresholds("m", BusyThresholds(0.9), (8, "a"))
    assert pool.thresholds_for("m") == BusyThresholds(0.6)


@settings(max_examples=200, derandomize=True, deadline=None)
@given(
    st.lists(
        st.tuples(
            st.sampled_from(["r1", "r2", "r3"]),
            st.lists(
                st.tuples(
                    st.sampled_from(["a", "b", "c"]),
                    st.integers(0, 2),
                    st.integers(0, 3),
                    st.integers(0, 50),
                    st.integers(0, 5000),
                ),
                max_size=6,
            ),
        ),
        max_size=12,
    )
)
def test_sums_always_match_the_latest_snapshots(
    snapshots: list[tuple[str, list[tuple[str, int, int, int, int]]]],
) -> None:
    pool, peers, _ = make()
    latest: dict[str, list[tuple[str, int, int, int, int]]] = {}
    for replica, entries in snapshots:
        peers.snapshot(replica, entries)
        latest[replica] = entries
    for w in pool.workers.values():
        for r in w.ranks:
            want = [e for es in latest.values() for e in es if e[:2] == (w.worker_id, r.index)]
            want = [e for e in want if e[2] > 0]
            assert r.peer_inflight == sum(e[2] for e in want)
            assert r.peer_prefill == sum(e[4] for e in want)
    for replica in list(latest):
        peers.leave(replica)
    assert all(
        (r.peer_inflight, r.peer_blocks, r.peer_prefill) == (0, 0, 0)
        for w in pool.workers.values()
        for r in w.ranks
    )
