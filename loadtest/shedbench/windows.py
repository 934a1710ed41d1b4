"""A phased run in numbers: the series per window, each phase's totals, and the time the
TTFT p99 took to come back within target after the slowdown."""

from __future__ import annotations

import math
from collections import Counter
from dataclasses import dataclass, field
from typing import Final, Literal, TypeAlias

from loadtest.shedbench.classes import OVERLOAD_STATUSES, Request
from loadtest.shedbench.client import Outcome
from loadtest.shedbench.phases import PhasedRun, PhasePlan
from loadtest.shedbench.stats import percentile

WINDOW = 5.0  # seconds per point of the series
SETTLE = 10.0  # the first seconds of a phase are not judged against the target
RECOVERY_STEP = 0.5  # resolution of the time back within target

NOT_LEFT: Final = "not left"
# Seconds back within target; NOT_LEFT when no window of the slowdown was out of target
# (there was nothing to recover from); None when it was not back before the slowdown ended.
RecoveryTime: TypeAlias = float | Literal["not left"] | None


def recovery_text(value: RecoveryTime) -> str:
    """How a report says a :data:`RecoveryTime`: never a time where none was measured."""
    if value is None:
        return "not back within target during the slowdown"
    if value == NOT_LEFT:
        return "not left: the TTFT p99 stayed within target through the slowdown"
    if isinstance(value, str):
        raise ValueError(f"recovery: {value!r} is neither seconds, {NOT_LEFT!r} nor None")
    return f"{value:.1f} s"


@dataclass(frozen=True)
class Mode:
    """One setting the phases run under: thresholds (None: off) and a latency target."""

    name: str
    decode: float | None
    prefill_frac: float | None
    target_ms: float | None = None

    def describe(self) -> str:
        if self.decode is None and self.prefill_frac is None and self.target_ms:
            return f"TTFT p99 target {self.target_ms:g} ms alone: no threshold, nothing tuned"
        if self.decode is None and self.prefill_frac is None:
            checks = "thresholds off"
        else:
            checks = f"decode {_g(self.decode)}, prefill frac {_g(self.prefill_frac)}"
        return checks + (f", TTFT p99 target {self.target_ms:g} ms" if self.target_ms else "")


def _g(value: float | None) -> str:
    return "off" if value is None else f"{value:g}"


@dataclass
class Window:
    """``[start, start + WINDOW)`` seconds into the run, by the attempts sent in it."""

    start: float
    phase: int
    admitted_rps: float
    rejected_rps: float
    ttft_p99_ms: float  # of the admitted attempts; NaN when none was admitted
    admitted: int
    held: float | None  # mean of extproc_held_requests read in the window; None: not reported
    slowed: bool  # the slowdown was on for part of the window
    judged: bool  # at least SETTLE seconds into its phase, and an attempt was sent in it
    offered: int = 0  # attempts sent in it
    settled: bool = False  # at least SETTLE seconds into its phase

    def within(self, target_ms: float) -> bool:
        """The TTFT p99 of what it admitted was within target; a window that admitted
        nothing is a miss (shedding everything holds no target)."""
        return within_target(self.admitted, self.ttft_p99_ms, target_ms)

    @property
    def unoffered(self) -> bool:
        """Past its phase's settling but no attempt was sent in it: nothing to judge. At a
        low capacity at target a 5-s window often has no arrival (vLLM's 0.25 req/s: 1.25
        expected, none in 29 % of them); a window that was offered requests and admitted
        none is still a miss."""
        return self.settled and self.offered == 0


def within_target(admitted: int, ttft_p99_ms: float, target_ms: float) -> bool:
    """A window with ``admitted`` attempts and this TTFT p99 is within ``target_ms``: at
    least one attempt admitted, and the p99 at most the target."""
    return admitted > 0 and not math.isnan(ttft_p99_ms) and ttft_p99_ms <= target_ms


@dataclass
class Second:
    """``[t, t + 1)`` s into the run: attempts sent in it admitted and rejected, and the
    requests the router held (the mean of its reads; None: not reported)."""

    t: int
    admitted: int
    rejected: int
    held: float | None


@dataclass
class PhaseStats:
    """One phase of one mode. A *user request* is a logical request with its retries; its
    TTFT runs from its first attempt to its first token, retries and waits included."""

    load: float
    seconds: float
    requests: int  # user requests that arrived in the phase
    attempts: int
    admitted: int  # user requests whose last attempt was answered 200
    admitted_first: int  # user requests whose first attempt was answered 200
    rejected_attempts: int
    gave_up: int  # user requests whose last attempt was still refused
    goodput_rps: float  # 2xx streams completed in the phase, per second
    # User requests whose first token came in the phase within the target (their TTFT
    # with retries), their stream completed, per second.
    slo_goodput_rps: float
    ttft_p99_ms: float  # of the admitted attempts sent in the phase
    user_ttft_p99_ms: float  # of the user requests of the phase that got a first token
    windows_judged: int
    windows_within: int
    deadline_rejections: int = 0  # attempts refused with x-shed-reason: deadline
    windows_unoffered: int = 0  # settled windows in which no attempt was sent: not judged

    @property
    def admitted_first_share(self) -> float:
        return self.admitted_first / self.requests if self.requests else math.nan


@dataclass
class ModeResult:
    mode: Mode
    phases: list[PhaseStats]
    windows: list[Window]
    slowed: tuple[float, float]
    recovery_s: RecoveryTime  # see :func:`recovery`
    attempts_rps_max: float
    errors: int
    # The slowed worker's TTFT p50 (ms) of attempts sent before and during the slowdown.
    slow_worker_ttft_p50_ms: tuple[float, float] = (math.nan, math.nan)
    seconds: list[Second] = field(default_factory=list)
    held_reported: bool = False  # the extproc reported extproc_held_requests
    reasons: dict[str, int] = field(default_factory=dict)  # refused attempts by x-shed-reason
    # Per worker: attempts it answered 200, and the means of what /debug/workers showed for
    # it (predicted TTFT ms, slots counted, occupancy) over the run; empty when not shown.
    workers: dict[str, dict[str, float | None]] = field(default_factory=dict)


def _attempts(run: PhasedRun) -> list[Outcome]:
    return [a for r in run.requests for a in r.attempts]


def _p99_ms(outs: list[Outcome]) -> float:
    return percentile([o.ttft for o in outs if o.ttft is not None], 99) * 1e3


def _p50_ms(outs: list[Outcome]) -> float:
    return percentile([o.ttft for o in outs if o.ttft is not None], 50) * 1e3


def _mean(values: list[float]) -> float | None:
    return sum(values) / len(values) if values else None


def refused(out: Outcome) -> bool:
    """An overload reply (any of the statuses the extproc answers with)."""
    return out.status in OVERLOAD_STATUSES


def slo_good(req: Request, start: float, end: float, target_s: float) -> bool:
    """``req`` got its first token in ``[start, end)`` within ``target_s`` of its first
    attempt, and its stream completed."""
    at, ttft = req.first_token_at, req.user_ttft
    return (
        at is not None and ttft is not None and start <= at < end and ttft <= target_s
        and req.last.finished
    )  # fmt: skip


def summarize_run(run: PhasedRun, plan: PhasePlan, mode: Mode, target_ms: float) -> ModeResult:
    """Windows, phases and recovery of one mode, from its responses; ``target_ms`` is the
    bar of SLO goodput and windows (the same for every mode)."""
    attempts = _attempts(run)
    admitted = [a for a in attempts if a.status == 200]
    began, ended = run.slowed
    held_reads = [h for h in run.held if h.held is not None]
    windows: list[Window] = []
    for i, (phase, start) in enumerate(zip(plan.phases, plan.starts(), strict=True)):
        at = start
        while at + WINDOW <= start + phase.seconds + 1e-9:
            mine = [a for a in attempts if at <= a.arrival < at + WINDOW]
            ok = [a for a in mine if a.status == 200]
            held = [h.held for h in held_reads if at <= h.at < at + WINDOW and h.held is not None]
            windows.append(
                Window(
                    start=at,
                    phase=i,
                    admitted_rps=len(ok) / WINDOW,
                    rejected_rps=sum(1 for a in mine if refused(a)) / WINDOW,
                    ttft_p99_ms=_p99_ms(ok),
                    admitted=len(ok),
                    held=_mean(held),
                    slowed=run.slowed[0] < at + WINDOW and at < run.slowed[1],
                    judged=at >= start + SETTLE and bool(mine),
                    offered=len(mine),
                    settled=at >= start + SETTLE,
                )
            )
            at += WINDOW
    phases: list[PhaseStats] = []
    target_s = target_ms / 1e3
    for i, (phase, start) in enumerate(zip(plan.phases, plan.starts(), strict=True)):
        end = start + phase.seconds
        reqs = [r for r in run.requests if start <= r.arrival < end and r.attempts]
        mine = [a for r in reqs for a in r.attempts]
        done = [a for a in admitted if a.finished and start <= a.arrival + (a.e2e or 0) < end]
        judged = [w for w in windows if w.phase == i and w.judged]
        user_ttfts = [t for r in reqs if (t := r.user_ttft) is not None]
        phases.append(
            PhaseStats(
                load=phase.load,
                seconds=phase.seconds,
                requests=len(reqs),
                attempts=len(mine),
                admitted=sum(1 for r in reqs if r.admitted),
                admitted_first=sum(1 for r in reqs if r.attempts[0].status == 200),
                rejected_attempts=sum(1 for a in mine if refused(a)),
                gave_up=sum(1 for r in reqs if refused(r.last)),
                goodput_rps=len(done) / phase.seconds,
                slo_goodput_rps=sum(1 for r in run.requests if r.attempts
                                    and slo_good(r, start, end, target_s)) / phase.seconds,
                ttft_p99_ms=_p99_ms([a for a in mine if a.status == 200]),
                user_ttft_p99_ms=percentile(user_ttfts, 99) * 1e3,
                windows_judged=len(judged),
                windows_within=sum(1 for w in judged if w.within(target_ms)),
                windows_unoffered=sum(1 for w in windows if w.phase == i and w.unoffered),
                deadline_rejections=sum(
                    1 for a in mine if refused(a) and a.shed_reason == "deadline"
                ),
            )
        )  # fmt: skip
    per_second: dict[int, int] = {}
    for a in attempts:
        per_second[int(a.arrival)] = per_second.get(int(a.arrival), 0) + 1
    seconds = []
    for t in range(math.ceil(plan.seconds)):
        mine = [a for a in attempts if t <= a.arrival < t + 1]
        held = [h.held for h in held_reads if t <= h.at < t + 1 and h.held is not None]
        seconds.append(
            Second(
                t=t,
                admitted=sum(1 for a in mine if a.status == 200),
                rejected=sum(1 for a in mine if refused(a)),
                held=_mean(held),
            )
        )
    return ModeResult(
        mode=mode,
        phases=phases,
        windows=windows,
        slowed=run.slowed,
        recovery_s=recovery(admitted, run.slowed, target_ms),
        attempts_rps_max=max(per_second.values(), default=0),
        errors=sum(1 for a in attempts if a.status not in OVERLOAD_STATUSES | {200}),
        slow_worker_ttft_p50_ms=(
            _p50_ms([a for a in admitted if a.worker == run.slow_worker and a.arrival < began]),
            _p50_ms(
                [a for a in admitted if a.worker == run.slow_worker and began <= a.arrival < ended]
            ),
        ),
        seconds=seconds,
        held_reported=bool(held_reads),
        reasons=dict(Counter(a.shed_reason or "none" for a in attempts if refused(a))),
        workers=_per_worker(run, admitted),
    )


def _per_worker(run: PhasedRun, admitted: list[Outcome]) -> dict[str, dict[str, float | None]]:
    ids = sorted({s.worker for s in run.samples} | {a.worker for a in admitted if a.worker})
    out: dict[str, dict[str, float | None]] = {}
    for wid in ids:
        mine = [s for s in run.samples if s.worker == wid]
        predicted = [s.predicted_ttft_ms for s in mine if s.predicted_ttft_ms is not None]
        slots = [s.slots for s in mine if s.slots is not None]
        occupancy = [s.occupancy for s in mine if s.occupancy is not None]
        out[wid] = {
            "admitted": float(sum(1 for a in admitted if a.worker == wid)),
            "predicted_ttft_ms": _mean(predicted),
            "slots": _mean(slots),
            "occupancy": _mean(occupancy),
        }
        if wid in run.preempted:
            out[wid]["preempted"] = float(run.preempted[wid])
    return out


def recovery(
    admitted: list[Outcome], slowed: tuple[float, float], target_ms: float
) -> RecoveryTime:
    """Seconds from the start of the slowdown until the TTFT p99 of the admitted attempts
    sent in a sliding :data:`WINDOW` stays within target, every :data:`RECOVERY_STEP`, up
    to the last window that ends before the slowdown does. A window that admitted nothing
    is out of target. :data:`NOT_LEFT` if no window was out of target; None if the p99
    was not back within target by the last window (or the slowdown is shorter than one)."""
    began, ended = slowed
    if ended <= began:
        return None
    steps = int((ended - began - WINDOW) / RECOVERY_STEP) + 1
    within = []
    for k in range(max(0, steps)):
        at = began + k * RECOVERY_STEP
        mine = [a for a in admitted if at <= a.arrival < at + WINDOW]
        within.append(within_target(len(mine), _p99_ms(mine), target_ms))
    if not within or not within[-1]:
        return None
    if all(within):
        return NOT_LEFT
    last_miss = max(k for k, ok in enumerate(within) if not ok)
    return (last_miss + 1) * RECOVERY_STEP
