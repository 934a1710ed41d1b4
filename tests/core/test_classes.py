"""Request classes with plain values: the share in the busy rule, the table, the variants."""

from __future__ import annotations

from typing import Any

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from extproc.core.busy import (
    DECODE,
    BusyThresholds,
    Share,
    rank_busy_reason,
    rank_limits,
)
from extproc.core.classes import ClassConfigError, ClassTable, parse_table
from extproc.core.pool import WorkerPool
from extproc.core.scheduling import Outcome, Rejected, Routed, Scheduler

TABLE = {
    "default": "standard",
    "classes": {
        "critical": {"priority": 0, "share": 1.0},
        "standard": {"priority": 1, "share": 0.9},
        "sheddable": {
            "priority": 2,
            "share": 0.7,
            "status": 429,
            "retry_after": 5,
            "large_prompt": {"above_tokens": 1000, "share": 0.4},
        },
    },
}


@pytest.mark.parametrize(
    ("share", "load", "busy"),
    [
        # threshold 0.5 of 100 blocks = 50; share 0.7 -> 35 (strict >)
        (1.0, 50, False),
        (1.0, 51, True),
        (0.7, 35, False),
        (0.7, 36, True),
        (0.3, 15, False),
        (0.3, 16, True),
        (1.2, 60, False),
        (1.2, 61, True),
    ],
)
def test_share_scales_the_decode_limit_exactly(share: float, load: int, busy: bool) -> None:
    limits = rank_limits(
        BusyThresholds(0.5),
        kv_mode=True,
        kv_total_blocks=100,
        max_num_batched_tokens=None,
        share=Share(share, 1.0, 1.0),
    )
    assert (rank_busy_reason(limits, load, None) == DECODE) is busy


@pytest.mark.parametrize(
    ("share", "limit_tokens", "limit_frac"),
    [(1.0, 1000, 1024), (0.9, 900, 921), (0.7, 700, 716), (0.29, 290, 296)],
)
def test_share_scales_the_prefill_limits(share: float, limit_tokens: int, limit_frac: int) -> None:
    limits = rank_limits(
        BusyThresholds(None, 1000, 0.5),
        kv_mode=True,
        kv_total_blocks=None,
        max_num_batched_tokens=2048,
        share=Share(1.0, share, share),
    )
    assert (limits.prefill_tokens, limits.prefill_tokens_frac) == (limit_tokens, limit_frac)


@settings(max_examples=300, derandomize=True, deadline=None)
@given(
    st.floats(0.0, 1.0),
    st.integers(0, 10_000),
    st.floats(0.01, 3.0),
    st.floats(0.01, 3.0),
    st.integers(0, 20_000),
    st.integers(0, 20_000),
)
def test_a_higher_share_never_turns_a_free_rank_busy(
    th: float, kv: int, low: float, high: float, blocks: int, prefill: int
) -> None:
    lo, hi = sorted((low, high))
    kw: dict[str, Any] = {"kv_mode": True, "kv_total_blocks": kv, "max_num_batched_tokens": 4096}
    thresholds = BusyThresholds(th, 5000, 0.8)
    busy_lo = rank_busy_reason(
        rank_limits(thresholds, share=Share(lo, lo, lo), **kw), blocks, prefill
    )
    busy_hi = rank_busy_reason(
        rank_limits(thresholds, share=Share(hi, hi, hi), **kw), blocks, prefill
    )
    assert not (busy_lo is None and busy_hi is not None)


def test_table_variants_and_shares() -> None:
    table = parse_table(TABLE)
    names = table.variant_names()
    assert names == ["standard", "critical", "sheddable", "sheddable/large"]
    shares = table.shares()
    assert [s.active_decode_blocks for s in shares] == [0.9, 1.0, 0.7, 0.4]
    sheddable, unknown = table.resolve("sheddable")
    assert not unknown and table.variant(sheddable, 1000) == 2
    assert table.variant(sheddable, 1001) == 3
    assert table.resolve("vip") == (table.by_name("standard"), True)
    assert table.resolve(None) == (table.by_name("standard"), False)
    assert not ClassTable().enabled and table.enabled


def test_pool_keeps_a_flag_per_class_and_critical_gets_the_last_worker() -> None:
    table = parse_table(TABLE)
    pool = WorkerPool(BusyThresholds(0.5))
    pool.set_shares(table.shares())
    for i, wid in enumerate("ab"):
        pool.announce(wid, model="m", endpoint=f"127.0.0.1:{9000 + i}", kv_total_blocks=100)
    pool.report_load("a", active_decode_blocks=40)  # 40 %: busy for sheddable (35) only
    pool.report_load("b", active_decode_blocks=48)  # 48 %: busy for sheddable and standard
    assert pool.workers["a"].busy_by_class == [False, False, True, True]
    assert pool.workers["b"].busy_by_class == [True, False, True, True]
    sched = Scheduler(pool)
    shed = sched.decide("m", 10, 2)
    assert isinstance(shed, Rejected) and shed.outcome is Outcome.OVERLOADED
    assert shed.check == DECODE
    standard = sched.decide("m", 10, 0)
    assert isinstance(standard, Routed) and standard.ticket.worker.worker_id == "a"
    pool.release(standard.ticket)
    critical = sched.decide("m", 10, 1)
    assert isinstance(critical, Routed)  # critical may use both, up to 50 %


def test_without_a_table_the_pool_keeps_no_class_flags() -> None:
    pool = WorkerPool(BusyThresholds(0.5))
    pool.set_shares(ClassTable().shares())
    pool.announce("a", model="m", endpoint="127.0.0.1:1", kv_total_blocks=10)
    pool.report_load("a", active_decode_blocks=6)
    assert pool.workers["a"].busy and pool.workers["a"].busy_by_class == []


@pytest.mark.parametrize(
    ("change", "message"),
    [
        ({"default": "nope"}, "default: 'nope' is not one of the classes"),
        ({"classes": {}}, "classes: expected a mapping"),
        ({"extra": 1}, "extra: unknown key"),
        ({"classes": {"a": {"share": 0}}, "default": "a"}, "classes.a.share: 0 is out of range"),
        (
            {"classes": {"a": {"share": "x"}}, "default": "a"},
            "classes.a.share: 'x' is not a number",
        ),
        (
            {"classes": {"a": {"share": {"bogus": 1}}}, "default": "a"},
            "classes.a.share: unknown threshold 'bogus'",
        ),
        ({"classes": {"a": {"status": 500}}, "default": "a"}, "classes.a.status: 500 is not one"),
        ({"classes": {"a": {"retry_after": 0}}, "default": "a"}, "classes.a.retry_after: 0"),
        ({"classes": {"a": {"colour": 1}}, "default": "a"}, "classes.a.colour: unknown key"),
        (
            {"classes": {"a": {"large_prompt": {"above_tokens": 5}}}, "default": "a"},
            "classes.a.large_prompt: {'above_tokens': 5} must have exactly",
        ),
        ({"header": "X-Class"}, "header: 'X-Class' is not a lower-case"),
        ({"trusted_marker": {"value": "x"}}, "trusted_marker: {'value': 'x'} needs header"),
    ],
)
def test_bad_tables_name_the_key_and_the_value(change: dict[str, Any], message: str) -> None:
    with pytest.raises(ClassConfigError, match=message.replace("(", r"\(").replace("{", r"\{")):
        parse_table({**TABLE, **change})
