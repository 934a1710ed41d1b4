"""The benchmarks' verdicts from plain values: a goal can be missed, and a time is reported
only where something was measured.

Shedding everything must not pass a latency goal: a window that admitted nothing is out of
target, and a recovery time exists only where the TTFT p99 (or the admissions) left the
target; otherwise the reports say "not left" and the goal "not tested", never a 0.0 s
"met".
"""

from __future__ import annotations

import math

import pytest

from loadtest.shedbench.classes import Request
from loadtest.shedbench.client import Outcome
from loadtest.shedbench.config import Config
from loadtest.shedbench.phases import Phase, PhasedRun, PhasePlan
from loadtest.shedbench.recovery import PoolSample, Probe, RecoveryPlan, RecoveryRound
from loadtest.shedbench.report import (
    MARK,
    Results,
    recovery_markdown,
    recovery_verdict,
    rejections_ordered,
)
from loadtest.shedbench.retry import OpenAIRetry
from loadtest.shedbench.slo_report import SloResults, goals
from loadtest.shedbench.slo_report import markdown as slo_markdown
from loadtest.shedbench.slo_report import recovery_verdict as slo_recovery_verdict
from loadtest.shedbench.windows import (
    NOT_LEFT,
    Mode,
    recovery,
    recovery_text,
    summarize_run,
    within_target,
)

TARGET_MS = 100.0
SLOWED = (0.0, 20.0)  # windows of 5 s every 0.5 s: the last one starts at 15 s


def _answers(ttft_ms: dict[float, float]) -> list[Outcome]:
    """Admitted attempts sent at these times (s) with these TTFTs (ms)."""
    return [
        Outcome(arrival=at, status=200, ttft=t / 1e3, e2e=t / 1e3 + 0.1, finished=True)
        for at, t in sorted(ttft_ms.items())
    ]


def _every(start: float, end: float, ttft: float, step: float = 0.5) -> dict[float, float]:
    return {round(start + i * step, 6): ttft for i in range(round((end - start) / step))}


# --- the slowdown's recovery ------------------------------------------------------------------


def test_a_p99_that_never_left_the_target_has_no_recovery_time() -> None:
    got = recovery(_answers(_every(0, 20, 50)), SLOWED, TARGET_MS)
    assert got == NOT_LEFT
    assert "not left" in recovery_text(got) and "0.0" not in recovery_text(got)


def test_nothing_admitted_during_the_slowdown_is_no_recovery() -> None:
    # Everything shed: before, nothing admitted counted as within target (0 s, "met").
    assert recovery([], SLOWED, TARGET_MS) is None
    assert recovery(_answers({25.0: 50}), SLOWED, TARGET_MS) is None


def test_a_gap_in_admissions_is_out_of_target_until_a_window_admits_again() -> None:
    # Nothing admitted in the first 6 s, then every answer within target: the windows
    # starting at 0, 0.5 and 1.0 s admitted nothing; the one at 1.5 s holds the 6-s answer.
    got = recovery(_answers(_every(6, 20, 50)), SLOWED, TARGET_MS)
    assert got == 1.5


@pytest.mark.parametrize(
    ("ttft_ms", "expected"),
    [
        (_every(0, 20, 300) | _every(0, 3, 300) | _every(3, 20, 50), 3.0),
        (_every(0, 10, 50) | {10.0: 300.0} | _every(10.5, 20, 50), 10.5),
        (_every(0, 20, 300), None),
        (_every(0, 17.5, 50) | _every(17.5, 20, 300), None),
    ],
)
def test_a_recovery_time_where_the_target_was_left(
    ttft_ms: dict[float, float], expected: float | None
) -> None:
    assert recovery(_answers(ttft_ms), SLOWED, TARGET_MS) == expected


@pytest.mark.parametrize(
    ("admitted", "p99", "expected"),
    [(0, math.nan, False), (0, 50.0, False), (3, 50.0, True), (3, 100.0, True),
     (3, 100.1, False), (3, math.nan, False)],
)  # fmt: skip
def test_a_window_is_within_target_only_if_it_admitted_something(
    admitted: int, p99: float, expected: bool
) -> None:
    assert within_target(admitted, p99, TARGET_MS) is expected


def test_the_recovery_goal_is_never_met_without_a_recovery() -> None:
    class _Mode:
        def __init__(self, rec: object) -> None:
            self.recovery_s = rec

    def verdict(rec: object) -> tuple[bool | None, str]:
        v = slo_recovery_verdict(_Mode(rec))  # type: ignore[arg-type]
        return v.met, MARK[v.met]

    assert verdict(NOT_LEFT) == (None, "not tested")
    assert verdict(None) == (False, "**missed**")
    assert verdict(3.0) == (True, "met")
    assert verdict(12.5) == (False, "**missed**")


# --- a phased run that sheds everything while a worker is slow ---------------------------------

CFG = Config(
    kv_total_blocks=640, block_size=16, max_num_seqs=48, max_num_batched_tokens=2048,
    speedup=2.0, prompt_tokens=512, max_tokens=128, decode_threshold=0.9,
    prefill_frac_threshold=0.4, loads=(1.0,), cell_seconds=20.0, warmup=4.0, grace=5.0,
    sweep_seconds=14.0, seed=1,
)  # fmt: skip
PLAN = PhasePlan(phases=(Phase(1, 40),), slow_phase=0, slow_at=15.0, slow_for=15.0)


def _phased(shed_while_slow: bool) -> PhasedRun:
    """One request every 0.25 s for 40 s, each answered 200 within target at 50 ms, except
    (``shed_while_slow``) every one sent during the slowdown, 15-30 s, rejected."""
    run = PhasedRun(slowed=(15.0, 30.0), slow_worker="sim-2")
    for i in range(160):
        at = i * 0.25
        shed = shed_while_slow and 15.0 <= at < 30.0
        out = (
            Outcome(arrival=at, status=529, e2e=0.002)
            if shed
            else Outcome(arrival=at, status=200, ttft=0.05, e2e=0.5, finished=True,
                         worker="sim-1")
        )  # fmt: skip
        run.requests.append(Request(cls="", arrival=at, attempts=[out]))
    return run


def _results(run: PhasedRun) -> SloResults:
    mode = Mode("target alone", None, None, TARGET_MS)
    target = summarize_run(run, PLAN, mode, TARGET_MS)
    fixed = summarize_run(_phased(False), PLAN, Mode("shipped", 0.9, 0.4), TARGET_MS)
    return SloResults(
        config=CFG, plan=PLAN, retry=OpenAIRetry(), command="python -m loadtest.slo",
        unloaded_ttft_p50_ms=20.0, unloaded_ttft_p99_ms=22.0, capacity_rps=4.0, sweep=[],
        target_ms=TARGET_MS, modes=[fixed, target], best_fixed="shipped",
    )  # fmt: skip


def test_shedding_everything_while_slow_misses_every_goal_it_touches() -> None:
    res = _results(_phased(True))
    target = res.mode("target alone")
    assert target is not None
    (phase,) = target.phases
    # Judged windows from 10 s: 10-15 within, 15-30 nothing admitted, 30-40 within.
    assert (phase.windows_within, phase.windows_judged) == (3, 6)
    assert target.recovery_s is None  # the last window of the slowdown admitted nothing
    marks = {v.name.split(" ")[0]: v.met for v in goals(res)}
    assert marks["TTFT"] is False and marks["after"] is False
    md = slo_markdown(res)
    assert "| 15 slow | 1 | — | **no** (none admitted) |" in md
    assert "0.0 s" not in md and "not back within target during the slowdown" in md


def test_a_window_without_an_arrival_is_not_judged_one_that_shed_everything_is() -> None:
    run = _phased(False)
    # Nothing sent 20-25 s (a low rate's Poisson gap), and everything refused 30-35 s.
    run.requests = [r for r in run.requests if not 20.0 <= r.arrival < 25.0]
    for r in run.requests:
        if 30.0 <= r.arrival < 35.0:
            r.attempts = [Outcome(arrival=r.arrival, status=529, e2e=0.002)]
    target = summarize_run(run, PLAN, Mode("target alone", None, None, TARGET_MS), TARGET_MS)
    (phase,) = target.phases
    assert (phase.windows_within, phase.windows_judged, phase.windows_unoffered) == (4, 5, 1)
    res = _results(run)
    (windows,) = [v for v in goals(res) if v.name.startswith("TTFT p99 within")]
    assert windows.met is False
    assert "4 of 5 (80%) (1 more without an arrival, not judged)" in windows.detail
    md = slo_markdown(res)
    assert "| 20 slow | 1 | — | (no arrival) |" in md
    assert "| 30 | 1 | — | **no** (none admitted) |" in md
    # A share near a goal's line is shown to a tenth of a percent: 120 of 140 is 85.7 %.
    assert "first attempt: 120 of 140 (85.7%);" in md


def test_a_target_that_held_through_the_slowdown_is_not_tested_for_recovery() -> None:
    res = _results(_phased(False))
    target = res.mode("target alone")
    assert target is not None and target.recovery_s == NOT_LEFT
    recovered = [v for v in goals(res) if v.name.startswith("after the slowdown")]
    assert [v.met for v in recovered] == [None]
    md = slo_markdown(res)
    assert "never left the target: nothing to recover: not tested" in md
    assert "- target alone: not left" in md and "0.0 s" not in md


# --- recovery after overload ------------------------------------------------------------------


def _round(
    load: float, index: int, last_second_529: int, first: float, full: float
) -> RecoveryRound:
    return RecoveryRound(
        load=load, round=index, offered_rps=3 * 19.5, overload_sent=350,
        overload_rejected=last_second_529 * 6, overload_rejected_last_second=last_second_529,
        running_at_end=90.0, kv_usage_at_end=0.9, first_admitted_s=first, admitted_95_s=full,
        probes_admitted=100, rejected_reasons={}, last_rejected_s=None, first_free_s=first,
        at_end=PoolSample(at=0.0, free=0, overloaded=0, reported_blocks=1100,
                          estimated_blocks=1000, effective_blocks=1100, limit_blocks=1152,
                          oldest_report_ms=40.0),
        overload_marked_s=0.0, oldest_report_ms=40.0,
        probes=[Probe(at=0.0, status=200, reason="", worker="sim-1", answer_ms=20.0)],
    )  # fmt: skip


def test_a_round_that_was_not_shedding_at_its_end_is_not_a_recovery() -> None:
    quiet = [_round(3.0, i, 0, 0.0, 0.0) for i in (1, 2, 3)]
    v = recovery_verdict(3.0, quiet)
    assert v.met is None and MARK[v.met] == "not tested"
    # Two rounds shedding at their end count; the quiet one is said, not averaged in.
    mixed = [_round(3.0, 1, 4, 0.3, 0.6), quiet[0], _round(3.0, 3, 2, 0.5, 0.8)]
    v = recovery_verdict(3.0, mixed)
    assert v.met is True
    assert "median of 2 rounds" in v.detail and "95 % admitted 0.70 s" in v.detail
    assert "1 of 3 rounds not shedding at their end" in v.detail
    slow = [_round(10.0, 1, 4, 0.5, 1.5), _round(10.0, 2, 4, 0.5, None)]  # type: ignore[arg-type]
    assert recovery_verdict(10.0, slow).met is False


def test_the_recovery_table_says_not_left_where_nothing_was_shed() -> None:
    res = Results(
        config=CFG, command="python -m loadtest.overload", unloaded_ttft_p50_ms=19.0,
        unloaded_ttft_p99_ms=20.0, unloaded_e2e_p99_ms=1300.0, sweep=[], capacity_rps=19.5,
        knee_concurrency=0, cells=[], seconds=1.0, recovery_plan=RecoveryPlan(),
        recovery=[_round(3.0, 1, 0, 0.0, 0.0), _round(3.0, 2, 5, 0.4, 0.65)],
    )  # fmt: skip
    md = recovery_markdown(res)
    rows = [line for line in md.splitlines() if line.startswith("| 3x |")]
    # Columns 6 and 7: first admitted, 95 % admitted.
    assert [c.strip() for c in rows[0].split("|")[6:8]] == ["not left", "not left"]
    assert [c.strip() for c in rows[1].split("|")[6:8]] == ["0.40", "0.65"]
    assert "median of 1 rounds, first admitted 0.40 s, 95 % admitted 0.65 s" in md
    (verdict,) = [line for line in md.splitlines() if line.startswith("- after 3x")]
    assert verdict.endswith(": met") and "1 of 2 rounds not shedding at their end" in verdict


# --- classes ----------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("rates", "expected"),
    [
        ([0.0, 0.2, 0.8], True),
        ([0.54, 0.997, 1.0], True),
        ([0.3, 0.2, 0.8], False),
        ([1.0, 1.0, 1.0], False),  # everything shed: ordered, and proves nothing
        ([0.0, math.nan, 0.5], False),  # a class without attempts
        ([], False),
    ],
)
def test_the_rejection_order_is_not_met_by_shedding_everything(
    rates: list[float], expected: bool
) -> None:
    assert rejections_ordered(rates) is expected
