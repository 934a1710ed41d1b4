"""Worker identity changes a real fleet produces, as rows of one table (docs/events.md).

Each row is a sequence of announcements, load reports, byes and clock steps applied to a
fresh pool; the expected outcome is which workers each model routes to, at which
endpoint, and how many ranks each has. A request decided afterwards must go where the
table says.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import pytest

from extproc.core.busy import BusyThresholds
from extproc.core.pool import WorkerPool
from extproc.core.scheduling import Outcome, Routed, Scheduler


class Clock:
    def __init__(self) -> None:
        self.t = 1000.0

    def __call__(self) -> float:
        return self.t


# Steps: ("config", worker_id, model, endpoint, extra kwargs) / ("load", worker_id, kwargs)
# / ("bye", worker_id) / ("wait", seconds) / ("expire",)
Step = tuple[Any, ...]


@dataclass
class Row:
    name: str
    steps: list[Step]
    # model -> {worker_id: endpoint}
    routable: dict[str, dict[str, str]]
    ranks: dict[str, int] = field(default_factory=dict)
    gone: set[str] = field(default_factory=set)


A, B, C = "10.0.0.1:8000", "10.0.0.2:8000", "10.0.0.3:8000"
ROWS = [
    Row(
        "endpoint change under the same id (StatefulSet pod with a new IP)",
        [("config", "w", "m", A, {}), ("load", "w", {}), ("config", "w", "m", B, {})],
        {"m": {"w": B}},
    ),
    Row(
        "endpoint change, then back",
        [("config", "w", "m", A, {}), ("config", "w", "m", B, {}), ("config", "w", "m", A, {})],
        {"m": {"w": A}},
    ),
    Row(
        "model change under the same id and endpoint",
        [("config", "w", "m1", A, {}), ("config", "w", "m2", A, {})],
        {"m2": {"w": A}},
    ),
    Row(
        "model and endpoint change at once",
        [("config", "w", "m1", A, {}), ("config", "x", "m1", C, {}), ("config", "w", "m2", B, {})],
        {"m1": {"x": C}, "m2": {"w": B}},
    ),
    Row(
        "dp_size grows",
        [("config", "w", "m", A, {"dp_size": 2}), ("config", "w", "m", A, {"dp_size": 4})],
        {"m": {"w": A}},
        ranks={"w": 4},
    ),
    Row(
        "dp_size shrinks",
        [("config", "w", "m", A, {"dp_size": 4}), ("config", "w", "m", A, {"dp_size": 1})],
        {"m": {"w": A}},
        ranks={"w": 1},
    ),
    Row(
        "bye then config again",
        [("config", "w", "m", A, {}), ("bye", "w"), ("config", "w", "m", A, {})],
        {"m": {"w": A}},
    ),
    Row(
        "bye alone",
        [("config", "w", "m", A, {}), ("config", "x", "m", B, {}), ("bye", "w")],
        {"m": {"x": B}},
        gone={"w"},
    ),
    Row(
        "id reused after its TTL expired",
        [("config", "w", "m", A, {}), ("wait", 11), ("expire",), ("config", "w", "m", B, {})],
        {"m": {"w": B}},
    ),
    Row(
        "TTL expiry removes the silent worker only",
        [
            ("config", "w", "m", A, {}),
            ("config", "x", "m", B, {}),
            ("wait", 6),
            ("load", "x", {}),
            ("wait", 5),
            ("expire",),
        ],
        {"m": {"x": B}},
        gone={"w"},
    ),
    Row(
        "two workers claim one endpoint: the newer claim wins",
        [("config", "old", "m", A, {}), ("config", "new", "m", A, {})],
        {"m": {"new": A}},
        gone={"old"},
    ),
    Row(
        "two models served from one endpoint (one engine, several models) coexist",
        [("config", "base", "m1", A, {}), ("config", "lora", "m2", A, {})],
        {"m1": {"base": A}, "m2": {"lora": A}},
    ),
    Row(
        "a worker moves onto another's endpoint",
        [("config", "x", "m", A, {}), ("config", "y", "m", B, {}), ("config", "y", "m", A, {})],
        {"m": {"y": A}},
        gone={"x"},
    ),
    Row(
        "the endpoint a worker left is free for a new one",
        [("config", "x", "m", A, {}), ("config", "x", "m", B, {}), ("config", "z", "m", A, {})],
        {"m": {"x": B, "z": A}},
    ),
    Row(
        "load before config is kept but routable only after config",
        [("load", "w", {"active_decode_blocks": 1}), ("config", "w", "m", A, {})],
        {"m": {"w": A}},
    ),
]


def run(row: Row) -> tuple[WorkerPool, Clock]:
    clock = Clock()
    pool = WorkerPool(BusyThresholds(), clock=clock, worker_ttl=10.0)
    for step in row.steps:
        kind = step[0]
        if kind == "config":
            _, wid, model, endpoint, extra = step
            pool.announce(wid, model=model, endpoint=endpoint, **extra)
        elif kind == "load":
            pool.report_load(step[1], **step[2])
        elif kind == "bye":
            pool.leave(step[1])
        elif kind == "wait":
            clock.t += step[1]
        else:
            pool.expire()
    return pool, clock


@pytest.mark.parametrize("row", ROWS, ids=[r.name for r in ROWS])
def test_identity_rules(row: Row) -> None:
    pool, _ = run(row)
    routable = {m: {w.worker_id: w.endpoint for w in ws} for m, ws in pool.by_model.items()}
    assert routable == row.routable
    for wid, n in row.ranks.items():
        assert len(pool.workers[wid].ranks) == n
    for wid in row.gone:
        assert wid not in pool.workers
    # Every (endpoint, model) maps to exactly the worker routed there, and nothing else.
    assert {k: w.worker_id for k, w in pool.by_endpoint.items()} == {
        (e, model): wid for model, workers in row.routable.items() for wid, e in workers.items()
    }
    # A request for each model goes to one of the table's workers, at the table's endpoint.
    sched = Scheduler(pool)
    for model, workers in row.routable.items():
        decision = sched.decide(model, 10)
        assert isinstance(decision, Routed)
        assert workers[decision.ticket.worker.worker_id] == decision.ticket.worker.endpoint
    for model in {s[2] for s in row.steps if s[0] == "config"} - set(row.routable):
        assert sched.decide(model, 10).outcome is Outcome.MODEL_NOT_FOUND


def test_estimates_survive_an_endpoint_change_and_release_to_zero() -> None:
    pool = WorkerPool(BusyThresholds(), clock=Clock())
    pool.announce("w", model="m", endpoint=A)
    decision = Scheduler(pool).decide("m", 64)
    assert isinstance(decision, Routed)
    pool.announce("w", model="m", endpoint=B)
    rank = pool.workers["w"].ranks[0]
    assert (rank.inflight, rank.est_prefill) == (1, 64)
    pool.release(decision.ticket)
    assert (rank.inflight, rank.est_prefill, rank.est_blocks) == (0, 0, 0)


def test_a_displaced_worker_is_reported() -> None:
    pool = WorkerPool(BusyThresholds(), clock=Clock())
    assert pool.announce("old", model="m", endpoint=A) == []
    assert pool.announce("new", model="m", endpoint=A) == ["old"]
    assert pool.announce("new", model="m", endpoint=A) == []  # heartbeat
