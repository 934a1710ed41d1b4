"""Decisions inside a gateway's endpoint subset, with plain values and a fake clock."""

from __future__ import annotations

from collections import Counter

import pytest
from hypothesis import given
from hypothesis import strategies as st

from extproc.core.busy import BusyThresholds, Share
from extproc.core.pool import WorkerPool
from extproc.core.scheduling import (
    MODEL_NOT_FOUND,
    NO_WORKERS,
    Outcome,
    Rejected,
    Routed,
    Scheduler,
)
from extproc.core.subset import GATEWAY_ID_PREFIX, MAX_GATEWAY_WORKERS


class Clock:
    def __init__(self) -> None:
        self.t = 100.0

    def __call__(self) -> float:
        return self.t


# Busy at 50 % of the KV cache or above 100 prefill tokens.
TH = BusyThresholds(0.5, 100)


def make(mode: str = "kv") -> tuple[WorkerPool, Scheduler]:
    pool = WorkerPool(TH, clock=Clock())
    return pool, Scheduler(pool, mode)


def add(pool: WorkerPool, wid: str, endpoint: str, blocks: int | None, model: str = "m") -> None:
    """A worker with 10 KV blocks, ``blocks`` in use (6 and more is busy)."""
    pool.announce(wid, model=model, endpoint=endpoint, kv_total_blocks=10)
    if blocks is not None:
        pool.report_load(wid, active_decode_blocks=blocks)


def routed(sched: Scheduler, subset: tuple[str, ...] | None, model: str = "m") -> Routed:
    decision = sched.decide(model, 10, subset=subset)
    assert isinstance(decision, Routed), decision
    sched.pool.release(decision.ticket)
    return decision


def test_only_the_subset_is_picked_even_when_a_worker_outside_is_less_loaded() -> None:
    pool, sched = make()
    add(pool, "a", "10.0.0.1:8000", 4)
    add(pool, "b", "10.0.0.2:8000", 0)
    for _ in range(20):
        d = routed(sched, ("10.0.0.1:8000",))
        assert d.ticket.worker.worker_id == "a"
        assert d.address == "10.0.0.1:8000"
        assert d.fallbacks == ()
    # Without a subset the least-loaded worker wins, as in the Envoy wiring.
    assert routed(sched, None).ticket.worker.worker_id == "b"


def test_every_subset_endpoint_busy_is_the_overload_rejection_though_others_are_free() -> None:
    pool, sched = make()
    add(pool, "a", "10.0.0.1:8000", 9)
    add(pool, "b", "10.0.0.2:8000", 0)
    decision = sched.decide("m", 10, subset=("10.0.0.1:8000",))
    assert isinstance(decision, Rejected)
    assert decision.outcome is Outcome.OVERLOADED
    assert decision.check == "active_decode_blocks_threshold"
    assert decision.model == "m"


def test_an_empty_subset_is_no_workers_before_and_after_the_model_is_known() -> None:
    pool, sched = make()
    add(pool, "a", "10.0.0.1:8000", 0)
    assert sched.decide("m", 10, subset=()) is NO_WORKERS
    assert sched.decide(None, subset=()) is NO_WORKERS
    assert sched.decide("m", 10, subset=(), waiting=True) is NO_WORKERS


def test_a_subset_defers_the_decision_before_the_model_to_the_body() -> None:
    pool, sched = make()
    add(pool, "a", "10.0.0.1:8000", 9)  # every worker busy: decided on the headers without
    assert isinstance(sched.decide(None), Rejected)
    assert type(sched.decide(None, subset=("10.0.0.9:8000",))).__name__ == "Deferred"


def test_an_unknown_endpoint_is_a_free_candidate_with_the_router_estimate_only() -> None:
    pool, sched = make()
    add(pool, "a", "10.0.0.1:8000", 9)  # busy
    d = sched.decide("m", 60, subset=("10.0.0.1:8000", "10.0.0.7:8000"))
    assert isinstance(d, Routed)
    worker = d.ticket.worker
    assert d.address == worker.endpoint == "10.0.0.7:8000"
    assert worker.worker_id == GATEWAY_ID_PREFIX + "10.0.0.7:8000"
    assert "gateway:10.0.0.7:8000" not in pool.workers  # not an announced worker
    # 60 prompt tokens in flight: free; 60 more are 120 > 100, so the next one is shed.
    d2 = sched.decide("m", 60, subset=("10.0.0.1:8000", "10.0.0.7:8000"))
    assert isinstance(d2, Routed) and d2.ticket.worker is worker
    d3 = sched.decide("m", 60, subset=("10.0.0.1:8000", "10.0.0.7:8000"))
    assert isinstance(d3, Rejected) and d3.outcome is Outcome.OVERLOADED
    pool.release(d.ticket)
    pool.release(d2.ticket)
    assert worker.ranks[0].inflight == 0 and worker.ranks[0].est_prefill == 0
    assert isinstance(sched.decide("m", 60, subset=("10.0.0.7:8000",)), Routed)


def test_a_threshold_change_applies_to_gateway_known_endpoints_at_once() -> None:
    pool, sched = make()
    add(pool, "a", "10.0.0.1:8000", 0)
    d = sched.decide("m", 60, subset=("10.0.0.7:8000",))
    assert isinstance(d, Routed)
    pool.set_thresholds("m", BusyThresholds(0.5, 50))  # 60 in flight is now busy
    assert isinstance(sched.decide("m", 1, subset=("10.0.0.7:8000",)), Rejected)
    pool.set_thresholds("m", BusyThresholds(0.5, None))
    assert isinstance(sched.decide("m", 1, subset=("10.0.0.7:8000",)), Routed)


def test_a_share_change_applies_to_gateway_known_endpoints_at_once() -> None:
    pool, sched = make()
    add(pool, "a", "10.0.0.1:8000", 0)
    d = sched.decide("m", 40, subset=("10.0.0.7:8000",))
    assert isinstance(d, Routed)
    worker = d.ticket.worker
    assert pool.unlisted[("10.0.0.7:8000", "m")] is worker  # made once, kept current
    pool.set_shares([Share(), Share(active_prefill_tokens=0.3)])  # class 1: busy above 30
    assert isinstance(sched.decide("m", 1, 1, subset=("10.0.0.7:8000",)), Rejected)
    d2 = sched.decide("m", 1, 0, subset=("10.0.0.7:8000",))
    assert isinstance(d2, Routed) and d2.ticket.worker is worker
    pool.set_shares([Share(), Share()])
    assert isinstance(sched.decide("m", 1, 1, subset=("10.0.0.7:8000",)), Routed)


def test_a_new_gateway_known_endpoint_is_free_for_every_class() -> None:
    pool, sched = make()
    pool.set_shares([Share(), Share(0.5, 0.5), Share(2.0, 2.0)])
    for variant in range(3):
        d = sched.decide("m", 10, variant, subset=(f"10.0.0.{7 + variant}:8000",))
        assert isinstance(d, Routed) and d.ticket.worker.busy_by_class == [False] * 3


def test_a_worker_announced_by_host_name_is_matched_by_its_resolved_address() -> None:
    """The gateway names pods by ``ip:port``; the worker announced ``worker-a:8000``."""
    pool, sched = make()
    add(pool, "a", "worker-a:8000", 0)
    pool.set_addresses("worker-a:8000", frozenset({"10.0.0.5:8000"}))
    d = routed(sched, ("10.0.0.5:8000",))
    assert d.ticket.worker.worker_id == "a"
    assert d.address == "10.0.0.5:8000"
    pool.report_load("a", active_decode_blocks=9)  # its load is the address's load
    decision = sched.decide("m", 10, subset=("10.0.0.5:8000",))
    assert isinstance(decision, Rejected) and decision.outcome is Outcome.OVERLOADED
    assert len(sched.gateway) == 0


def test_before_its_name_resolves_a_host_name_worker_is_not_the_address() -> None:
    pool, sched = make()
    add(pool, "a", "worker-a:8000", 9)  # busy
    d = routed(sched, ("10.0.0.5:8000",))
    assert d.ticket.worker.worker_id == GATEWAY_ID_PREFIX + "10.0.0.5:8000"


def test_the_same_host_with_another_port_is_matched_on_the_resolved_address() -> None:
    pool, sched = make()
    add(pool, "a", "worker-a:8000", 0)
    pool.set_addresses("worker-a:8000", frozenset({"10.0.0.5:8000"}))
    d = routed(sched, ("10.0.0.5:8001",))
    assert d.ticket.worker.worker_id == "a" and d.address == "10.0.0.5:8001"


def test_the_resolved_address_of_another_model_s_worker_is_not_a_candidate() -> None:
    pool, sched = make()
    add(pool, "a", "10.0.0.1:8000", 0, model="m")
    add(pool, "b", "worker-b:8000", 0, model="other")
    pool.set_addresses("worker-b:8000", frozenset({"10.0.0.2:8000"}))
    assert sched.decide("m", 10, subset=("10.0.0.2:8000",)) is NO_WORKERS


def test_a_worker_on_the_same_host_with_another_port_stands_behind_the_gateway_address() -> None:
    """The engine announces :8000, the gateway targets the pod's :8001 (a proxy in front):
    the worker's load counts, and the request goes where the gateway said."""
    pool, sched = make()
    add(pool, "a", "10.0.0.5:8000", 0)
    d = routed(sched, ("10.0.0.5:8001",))
    assert d.ticket.worker.worker_id == "a"
    assert d.address == "10.0.0.5:8001"
    pool.report_load("a", active_decode_blocks=9)  # its load is the pod's load
    decision = sched.decide("m", 10, subset=("10.0.0.5:8001",))
    assert isinstance(decision, Rejected) and decision.outcome is Outcome.OVERLOADED


def test_two_workers_on_the_host_and_neither_port_matches_is_no_load_data() -> None:
    pool, sched = make()
    add(pool, "a", "10.0.0.5:8000", 9)
    add(pool, "b", "10.0.0.5:8002", 9)
    d = routed(sched, ("10.0.0.5:8001",))
    assert d.ticket.worker.worker_id == GATEWAY_ID_PREFIX + "10.0.0.5:8001"


def test_the_exact_match_wins_and_a_second_port_of_its_pod_is_another_endpoint() -> None:
    pool, sched = make()
    add(pool, "a", "10.0.0.5:8000", 9)
    d = routed(sched, ("10.0.0.5:8000", "10.0.0.5:8001"))
    assert d.address == "10.0.0.5:8001"  # a is busy; :8001 is known only from the gateway
    assert d.ticket.worker.worker_id.startswith(GATEWAY_ID_PREFIX)


def test_an_endpoint_of_another_model_only_is_not_a_candidate() -> None:
    pool, sched = make()
    add(pool, "a", "10.0.0.1:8000", 0, model="m")
    add(pool, "b", "10.0.0.2:8000", 0, model="other")
    assert sched.decide("m", 10, subset=("10.0.0.2:8000",)) is NO_WORKERS


def test_an_unknown_model_is_model_not_found_with_or_without_a_subset() -> None:
    pool, sched = make()
    add(pool, "a", "10.0.0.1:8000", 0)
    assert sched.decide("nope", 10, subset=("10.0.0.1:8000",)) is MODEL_NOT_FOUND
    assert sched.decide("nope", 10) is MODEL_NOT_FOUND


def test_with_no_worker_known_at_all_the_subset_is_routable() -> None:
    """Before any worker's events arrive, the gateway's pods are served, not refused."""
    _, sched = make()
    assert sched.decide("m", 10) is NO_WORKERS
    assert routed(sched, ("10.0.0.1:8000",)).address == "10.0.0.1:8000"


def test_fallbacks_are_free_subset_addresses_after_the_pick() -> None:
    pool, sched = make()
    add(pool, "a", "10.0.0.1:8000", 1)
    add(pool, "b", "10.0.0.2:8000", 2)
    add(pool, "c", "10.0.0.3:8000", 9)  # busy
    add(pool, "d", "10.0.0.4:8000", 0)  # outside the subset
    subset = ("10.0.0.1:8000", "10.0.0.2:8000", "10.0.0.3:8000", "10.0.0.6:8001")
    d = routed(sched, subset)
    assert d.address in {"10.0.0.1:8000", "10.0.0.6:8001"}  # least loaded: no data or 10 %
    assert set(d.fallbacks) <= {"10.0.0.1:8000", "10.0.0.2:8000", "10.0.0.6:8001"}
    assert d.address not in d.fallbacks and len(d.fallbacks) == 2


@pytest.mark.parametrize("mode", ["round-robin", "random"])
def test_other_router_modes_keep_to_the_subset(mode: str) -> None:
    pool, sched = make(mode)
    add(pool, "a", "10.0.0.1:8000", 0)
    add(pool, "b", "10.0.0.2:8000", 0)
    add(pool, "c", "10.0.0.3:8000", 0)
    seen = Counter(routed(sched, ("10.0.0.1:8000", "10.0.0.3:8000")).address for _ in range(60))
    assert set(seen) == {"10.0.0.1:8000", "10.0.0.3:8000"}


def test_gateway_known_workers_are_bounded() -> None:
    _, sched = make()
    for i in range(MAX_GATEWAY_WORKERS + 10):
        routed(sched, (f"10.1.{i // 250}.{i % 250}:8000",))
    assert len(sched.gateway) <= MAX_GATEWAY_WORKERS


ADDRESSES = [f"10.0.0.{i}:8000" for i in range(1, 7)]


@given(
    loads=st.lists(st.one_of(st.none(), st.integers(0, 10)), min_size=3, max_size=3),
    subset=st.lists(st.sampled_from(ADDRESSES), max_size=6, unique=True),
)
def test_a_decision_never_leaves_the_subset(loads: list[int | None], subset: list[str]) -> None:
    pool, sched = make()
    for i, blocks in enumerate(loads):
        add(pool, f"w{i}", ADDRESSES[i], blocks)
    decision = sched.decide("m", 10, subset=tuple(subset))
    if isinstance(decision, Routed):
        assert decision.address in subset
        assert set(decision.fallbacks) <= set(subset)
        pool.release(decision.ticket)
    else:
        assert isinstance(decision, Rejected)
        in_subset = [b for i, b in enumerate(loads) if ADDRESSES[i] in subset]
        if not subset:
            assert decision is NO_WORKERS
        else:
            # Every candidate is a known busy worker (an unknown address would be free).
            assert decision.outcome is Outcome.OVERLOADED
            assert len(in_subset) == len(subset) and all(b is not None and b > 5 for b in in_subset)
