"""The busy rule (docs/routing.md) with plain values: rule tables, properties for invariants."""

from __future__ import annotations

import pytest
from hypothesis import given
from hypothesis import strategies as st

from extproc.core.busy import (
    DECODE,
    PREFILL,
    PREFILL_FRAC,
    BusyThresholds,
    Share,
    class_limits,
    rank_busy_reason,
    rank_limits,
    scaled_limit,
    worker_busy,
)


def reason(
    th: BusyThresholds,
    blocks: int | None = None,
    prefill: int | None = None,
    kv_total: int | None = None,
    max_batched: int | None = None,
    kv_mode: bool = True,
) -> str | None:
    limits = rank_limits(
        th, kv_mode=kv_mode, kv_total_blocks=kv_total, max_num_batched_tokens=max_batched
    )
    return rank_busy_reason(limits, blocks, prefill)


D = BusyThresholds(active_decode_blocks=0.5)
P = BusyThresholds(active_prefill_tokens=100)
F = BusyThresholds(active_prefill_tokens_frac=1.5)

CASES = [
    # (name, thresholds, blocks, prefill, kv_total, max_batched, kv_mode, expected)
    ("decode above", D, 51, None, 100, None, True, DECODE),
    ("decode at boundary is free (strict >)", D, 50, None, 100, None, True, None),
    ("decode below", D, 10, None, 100, None, True, None),
    ("decode kv_total unknown never fires", D, 10**9, None, None, None, True, None),
    ("decode kv_total 0 never fires", D, 10**9, None, 0, None, True, None),
    ("decode no blocks value cannot fire", D, None, 10**9, 100, None, True, None),
    ("decode off outside kv mode", D, 99, None, 100, None, False, None),
    (
        "decode threshold 0: any block is busy",
        BusyThresholds(0.0),
        1,
        None,
        100,
        None,
        True,
        DECODE,
    ),
    ("decode threshold 0: zero blocks free", BusyThresholds(0.0), 0, None, 100, None, True, None),
    ("decode threshold 1: full is free", BusyThresholds(1.0), 100, None, 100, None, True, None),
    ("decode threshold 1: over full busy", BusyThresholds(1.0), 101, None, 100, None, True, DECODE),
    ("decode exact decimal 0.29*100=29", BusyThresholds(0.29), 29, None, 100, None, True, None),
    ("decode exact decimal 30 > 29", BusyThresholds(0.29), 30, None, 100, None, True, DECODE),
    ("prefill above", P, None, 101, None, None, True, PREFILL),
    ("prefill at boundary", P, None, 100, None, None, True, None),
    ("prefill no value cannot fire", P, 10**6, None, 100, None, True, None),
    ("prefill works outside kv mode", P, None, 101, None, None, False, PREFILL),
    (
        "prefill threshold 0 any token busy",
        BusyThresholds(None, 0),
        None,
        1,
        None,
        None,
        True,
        PREFILL,
    ),
    ("frac above floor(1.5*100)=150", F, None, 151, None, 100, True, PREFILL_FRAC),
    ("frac at boundary", F, None, 150, None, 100, True, None),
    ("frac floors: floor(1.5*101)=151", F, None, 151, None, 101, True, None),
    ("frac floors: 152 > 151", F, None, 152, None, 101, True, PREFILL_FRAC),
    ("frac without max_num_batched_tokens never fires", F, None, 10**9, None, None, True, None),
    ("frac below 1", BusyThresholds(None, None, 0.1), None, 7, None, 64, True, PREFILL_FRAC),
    (
        "frac below 1 boundary floor(6.4)=6",
        BusyThresholds(None, None, 0.1),
        None,
        6,
        None,
        64,
        True,
        None,
    ),
    ("no thresholds never busy", BusyThresholds(), 10**9, 10**9, 1, 1, True, None),
    ("OR: decode fires alone", BusyThresholds(0.5, 100), 60, 10, 100, None, True, DECODE),
    ("OR: prefill fires alone", BusyThresholds(0.5, 100), 10, 200, 100, None, True, PREFILL),
    ("OR: neither", BusyThresholds(0.5, 100, 2.0), 10, 50, 100, 64, True, None),
    ("OR: frac fires alone", BusyThresholds(0.5, 1000, 0.5), 10, 40, 100, 64, True, PREFILL_FRAC),
]


@pytest.mark.parametrize(
    ("th", "blocks", "prefill", "kv_total", "max_batched", "kv_mode", "expected"),
    [c[1:] for c in CASES],
    ids=[c[0] for c in CASES],
)
def test_rank_rule(
    th: BusyThresholds,
    blocks: int | None,
    prefill: int | None,
    kv_total: int | None,
    max_batched: int | None,
    kv_mode: bool,
    expected: str | None,
) -> None:
    assert reason(th, blocks, prefill, kv_total, max_batched, kv_mode) == expected


@pytest.mark.parametrize(
    ("ranks", "busy"),
    [
        ([], False),  # no load data at all = free
        ([DECODE], True),
        ([None], False),
        ([DECODE, PREFILL], True),
        ([DECODE, None], False),  # one free rank keeps the worker free
        ([None, None, PREFILL_FRAC], False),
    ],
)
def test_worker_busy_only_when_every_rank_with_data_is(ranks: list[str | None], busy: bool) -> None:
    assert worker_busy(ranks) is busy


def test_scaled_limit_is_exact_for_decimal_thresholds() -> None:
    assert 0.29 * 100 < 29  # what plain floats would get wrong
    assert scaled_limit(0.29, 100) == 29
    assert scaled_limit(0.7, 10) == 7
    assert scaled_limit(1.5, 101) == 151
    assert scaled_limit(0.0, 10**9) == 0


thresholds = st.builds(
    BusyThresholds,
    st.none() | st.floats(0, 1),
    st.none() | st.integers(0, 10**6),
    st.none() | st.floats(0, 10),
)
opt_count = st.none() | st.integers(0, 10**6)
opt_cap = st.none() | st.integers(0, 10**5)


@given(
    thresholds, opt_count, opt_count, opt_cap, opt_cap, st.integers(0, 1000), st.integers(0, 1000)
)
def test_more_load_never_turns_busy_into_free(
    th: BusyThresholds,
    blocks: int | None,
    prefill: int | None,
    kv_total: int | None,
    max_batched: int | None,
    more_blocks: int,
    more_prefill: int,
) -> None:
    before = reason(th, blocks, prefill, kv_total, max_batched)
    after = reason(
        th,
        None if blocks is None else blocks + more_blocks,
        None if prefill is None else prefill + more_prefill,
        kv_total,
        max_batched,
    )
    if before is not None:
        assert after is not None


@given(thresholds, opt_count, opt_count, opt_cap, opt_cap)
def test_lower_threshold_never_turns_busy_into_free(
    th: BusyThresholds,
    blocks: int | None,
    prefill: int | None,
    kv_total: int | None,
    max_batched: int | None,
) -> None:
    lower = BusyThresholds(
        None if th.active_decode_blocks is None else th.active_decode_blocks / 2,
        None if th.active_prefill_tokens is None else th.active_prefill_tokens // 2,
        None if th.active_prefill_tokens_frac is None else th.active_prefill_tokens_frac / 2,
    )
    if reason(th, blocks, prefill, kv_total, max_batched) is not None:
        assert reason(lower, blocks, prefill, kv_total, max_batched) is not None


@given(opt_count, opt_count, opt_cap, opt_cap)
def test_unset_thresholds_never_reject(
    blocks: int | None, prefill: int | None, kv_total: int | None, max_batched: int | None
) -> None:
    assert reason(BusyThresholds(), blocks, prefill, kv_total, max_batched) is None


@given(thresholds, opt_count, opt_count, opt_cap, opt_cap)
def test_enabling_a_check_never_frees(
    th: BusyThresholds,
    blocks: int | None,
    prefill: int | None,
    kv_total: int | None,
    max_batched: int | None,
) -> None:
    """Checks are OR-ed: adding one can only add reasons to be busy."""
    only_decode = BusyThresholds(th.active_decode_blocks)
    if reason(only_decode, blocks, prefill, kv_total, max_batched) is not None:
        assert reason(th, blocks, prefill, kv_total, max_batched) is not None


@given(
    st.lists(st.none() | st.sampled_from([DECODE, PREFILL]), max_size=8),
    st.sampled_from([DECODE, PREFILL]),
)
def test_another_busy_rank_never_frees_a_busy_worker(ranks: list[str | None], extra: str) -> None:
    if worker_busy(ranks):
        assert worker_busy([*ranks, extra])


def test_class_limits_are_each_share_s_rank_limits_the_default_class_first() -> None:
    th = BusyThresholds(0.5, 100, 1.5)
    shares = [Share(), Share(0.4, 0.5, 0.25), Share(2.0, 2.0, 2.0)]
    got = class_limits(th, shares, kv_mode=True, kv_total_blocks=10, max_num_batched_tokens=8)
    assert [(x.decode_blocks, x.prefill_tokens, x.prefill_tokens_frac) for x in got] == [
        (5, 100, 12),
        (2, 50, 3),
        (10, 200, 24),
    ]
    # Without capacities announced only the prefill-token threshold can fire.
    bare = class_limits(th, shares, kv_mode=True, kv_total_blocks=None, max_num_batched_tokens=None)
    assert [(x.decode_blocks, x.prefill_tokens_frac) for x in bare] == [(None, None)] * 3
    assert [x.prefill_tokens for x in bare] == [100, 50, 200]
