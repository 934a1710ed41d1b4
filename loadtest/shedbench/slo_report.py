"""``python -m loadtest.slo``: the results, the goals the target alone is judged by, the
markdown and one plot over time per mode. Every number of the markdown and the plots comes
from :class:`SloResults`, the object written as the run's JSON."""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from loadtest.shedbench.capacity import RateProbe
from loadtest.shedbench.config import LLAMACPP, SIM, Config
from loadtest.shedbench.phases import PhasePlan
from loadtest.shedbench.report import MARK, Verdict, workers_text
from loadtest.shedbench.results import fmt_ms
from loadtest.shedbench.retry import OpenAIRetry
from loadtest.shedbench.windows import (
    NOT_LEFT,
    SETTLE,
    WINDOW,
    ModeResult,
    PhaseStats,
    recovery_text,
)

# The goals of the target alone.
ADMITTED_AT_1X = 0.98  # of the user requests of a 1x phase, admitted at their first attempt
CAPACITY_SHARE = 0.95  # SLO goodput at 3x and 10x, of the capacity at target
WINDOWS_WITHIN = 0.95  # of the judged windows within target
RECOVERY_GOAL_S = 5.0
CLASSES_SHARE = 0.95  # total SLO goodput with classes, of the flat run's
CRITICAL_ADMITTED = 0.99  # critical user requests admitted at their first attempt
OVERLOADED = 3.0  # phases at this load or more are judged on their SLO goodput

OFF, SHIPPED, TARGET_ALONE = "off", "shipped", "target alone"
# Kept for the readers of older results: the target beside the shipped thresholds.
TARGET = "target"


@dataclass
class ClassStats:
    """One class (or all, ``cls`` "all") of a classes cell."""

    cls: str
    requests: int
    admitted_first: int
    admitted: int
    slo_good: int  # first token within the model's target (retries included), completed
    user_ttft_p99_ms: float

    @property
    def admitted_first_share(self) -> float:
        return self.admitted_first / self.requests if self.requests else math.nan


@dataclass
class ClassesRun:
    """The same 1x arrivals twice on a stack with the classes file: every request in the
    default class (flat), then each with a class of the mix (classed)."""

    classes_yaml: str
    mix: list[tuple[str, float]]
    load: float
    seconds: float
    flat: list[ClassStats]
    classed: list[ClassStats]

    def total(self, cells: list[ClassStats]) -> ClassStats:
        return next(c for c in cells if c.cls == "all")

    def slo_goodput_rps(self, cells: list[ClassStats]) -> float:
        return self.total(cells).slo_good / self.seconds


@dataclass
class SweepRow:
    """One fixed-threshold candidate over the sweep's phases."""

    name: str
    decode: float | None
    prefill_frac: float | None
    slo_goodput_rps: list[float]  # per phase
    slo_good: int  # over the sweep's phases


@dataclass
class SloResults:
    config: Config
    plan: PhasePlan
    retry: OpenAIRetry
    command: str
    unloaded_ttft_p50_ms: float
    unloaded_ttft_p99_ms: float
    capacity_rps: float  # at target: the highest Poisson rate holding the TTFT p99
    target_ms: float
    modes: list[ModeResult]
    best_fixed: str  # the name of the best fixed mode
    capacity_probes: list[RateProbe] = field(default_factory=list)
    capacity_search: str = ""  # how the capacity was found, or "given"
    sweep: list[SweepRow] = field(default_factory=list)
    sweep_plan: PhasePlan | None = None
    classes: ClassesRun | None = None
    sources: list[dict[str, Any]] = field(default_factory=list)
    # Per mode: the TTFT sources over that mode alone, and where its TTFT went.
    sources_by_mode: dict[str, list[dict[str, Any]]] = field(default_factory=dict)
    splits: dict[str, list[dict[str, Any]]] = field(default_factory=dict)
    seconds: float = 0.0
    load_average: dict[str, str] = field(default_factory=dict)  # /proc/loadavg before, after
    code: str = ""  # the commit the stack ran

    def mode(self, name: str) -> ModeResult | None:
        return next((m for m in self.modes if m.mode.name == name), None)


def total_slo_goodput(m: ModeResult) -> float:
    """SLO-good user requests over the whole run: how the best fixed thresholds are chosen."""
    return sum(p.slo_goodput_rps * p.seconds for p in m.phases)


def _share(part: float, whole: float) -> str:
    return f"{part / whole:.0%}" if whole else "—"


def _exact_share(part: float, whole: float) -> str:
    """To a tenth of a percent, for a goal whose line is a whole percent: 125 of 128 is
    97.7 %, which rounds to the 98 % it misses."""
    return f"{part / whole:.1%}" if whole else "—"


def _reasons(m: ModeResult) -> str:
    if not m.reasons:
        return "none refused"
    return "refused attempts by `x-shed-reason`: " + ", ".join(
        f"{k} {v}" for k, v in sorted(m.reasons.items(), key=lambda kv: -kv[1])
    )


def _workers(m: ModeResult) -> str:
    if not m.workers:
        return "—"

    def num(value: float | None, unit: str = "") -> str:
        return "—" if value is None else f"{value:,.0f}{unit}"

    return "; ".join(
        f"{wid}: {num(w.get('admitted'))} admitted, predicted TTFT "
        f"{num(w.get('predicted_ttft_ms'), ' ms')}, slots {num(w.get('slots'))}, occupancy "
        f"{num(w.get('occupancy'))}"
        + ("" if w.get("preempted") is None else f", {num(w.get('preempted'))} preempted")
        for wid, w in m.workers.items()
    )


def goals(res: SloResults) -> list[Verdict]:
    """The target alone's goals, each met, missed or not tested, with what was measured."""
    alone, best = res.mode(TARGET_ALONE), res.mode(res.best_fixed)
    if alone is None:
        return []
    out: list[Verdict] = []
    for i, p in enumerate(alone.phases):
        label = f"phase {i + 1} ({p.load:g}x)"
        if p.load <= 1.0:
            out.append(Verdict(
                f"{label}: >= {ADMITTED_AT_1X:.0%} of user requests admitted at their first "
                "attempt",
                p.requests > 0 and p.admitted_first >= ADMITTED_AT_1X * p.requests - 1e-9,
                f"{p.admitted_first} of {p.requests} "
                f"({_exact_share(p.admitted_first, p.requests)});"
                f" {p.admitted} admitted after retries; {p.rejected_attempts} attempts refused "
                f"({p.deadline_rejections} for the deadline)",
            ))  # fmt: skip
            out.append(Verdict(
                f"{label}: TTFT p99 within {res.target_ms:g} ms",
                not math.isnan(p.ttft_p99_ms) and p.ttft_p99_ms <= res.target_ms,
                f"{fmt_ms(p.ttft_p99_ms)} ms (of the user requests, retries included: "
                f"{fmt_ms(p.user_ttft_p99_ms)} ms)",
            ))  # fmt: skip
        if p.load >= OVERLOADED:
            need = CAPACITY_SHARE * res.capacity_rps
            out.append(Verdict(
                f"{label}: SLO goodput >= {CAPACITY_SHARE:.0%} of the capacity at target "
                f"({need:.2f} of {res.capacity_rps:.2f} req/s)",
                res.capacity_rps > 0 and p.slo_goodput_rps >= need - 1e-9,
                f"{p.slo_goodput_rps:.2f} req/s ({_share(p.slo_goodput_rps, res.capacity_rps)})",
            ))  # fmt: skip
            b = best.phases[i] if best is not None else None
            out.append(Verdict(
                f"{label}: SLO goodput >= the best fixed thresholds' ("
                + (f"{best.mode.name}: {b.slo_goodput_rps:.2f} req/s)" if best and b else "none)"),
                None if b is None else p.slo_goodput_rps >= b.slo_goodput_rps - 1e-9,
                f"{p.slo_goodput_rps:.2f} req/s"
                + (f" ({_share(p.slo_goodput_rps, b.slo_goodput_rps)})" if b else ""),
            ))  # fmt: skip
    judged = sum(p.windows_judged for p in alone.phases)
    within = sum(p.windows_within for p in alone.phases)
    unoffered = sum(p.windows_unoffered for p in alone.phases)
    missed = [w for w in alone.windows if w.judged and not w.within(res.target_ms)]
    out.append(Verdict(
        f"TTFT p99 within {res.target_ms:g} ms in >= {WINDOWS_WITHIN:.0%} of the {WINDOW:g}-s "
        f"windows after the first {SETTLE:g} s of each phase",
        None if not judged else within >= WINDOWS_WITHIN * judged - 1e-9,
        f"{within} of {judged}" + (f" ({within / judged:.0%})" if judged else "")
        + (f" ({unoffered} more without an arrival, not judged)" if unoffered else "")
        + ("; out of target: " + ", ".join(
            f"{w.start:g} s{' (slow)' if w.slowed else ''} "
            + (f"{fmt_ms(w.ttft_p99_ms)} ms" if w.admitted else "none admitted")
            for w in missed) if missed else ""),
    ))  # fmt: skip
    out.append(recovery_verdict(alone))
    out.extend(classes_verdicts(res))
    return out


def recovery_verdict(m: ModeResult) -> Verdict:
    """Back within target <= :data:`RECOVERY_GOAL_S` after the slowdown began: met only if
    the TTFT p99 left the target and came back in time; not tested if it never left."""
    rec = m.recovery_s
    name = f"after the slowdown, back within target in <= {RECOVERY_GOAL_S:g} s"
    if rec == NOT_LEFT:
        return Verdict(name, None, "the TTFT p99 never left the target: nothing to recover")
    if rec is None or isinstance(rec, str):
        return Verdict(name, False, recovery_text(rec))
    return Verdict(name, rec <= RECOVERY_GOAL_S, recovery_text(rec))


def classes_verdicts(res: SloResults) -> list[Verdict]:
    c = res.classes
    names = (
        f"with classes at 1x: total SLO goodput >= {CLASSES_SHARE:.0%} of the flat run's",
        f"with classes at 1x: >= {CRITICAL_ADMITTED:.0%} of critical user requests admitted "
        "at their first attempt",
    )
    if c is None:
        return [Verdict(n, None, "not run (`--no-classes`)") for n in names]
    flat, classed = c.slo_goodput_rps(c.flat), c.slo_goodput_rps(c.classed)
    critical = next((x for x in c.classed if x.cls == "critical"), None)
    return [
        Verdict(
            names[0],
            flat > 0 and classed >= CLASSES_SHARE * flat - 1e-9,
            f"{classed:.2f} against {flat:.2f} req/s ({_share(classed, flat)})",
        ),
        Verdict(
            names[1],
            None if critical is None or not critical.requests
            else critical.admitted_first >= CRITICAL_ADMITTED * critical.requests - 1e-9,
            "no critical request" if critical is None else
            f"{critical.admitted_first} of {critical.requests} "
            f"({_exact_share(critical.admitted_first, critical.requests)})",
        ),
    ]  # fmt: skip


# --- markdown -----------------------------------------------------------------------------------


def _phase_row(name: str, i: int, p: PhaseStats) -> str:
    return (
        f"| {name} | {i + 1}: {p.load:g}x | {p.requests} | "
        f"{_share(p.admitted_first, p.requests)} | {_share(p.admitted, p.requests)} | "
        f"{p.rejected_attempts} | {p.gave_up} | {p.goodput_rps:.2f} | "
        f"**{p.slo_goodput_rps:.2f}** | {fmt_ms(p.ttft_p99_ms)} | {fmt_ms(p.user_ttft_p99_ms)} | "
        f"{p.windows_within} of {p.windows_judged} |"
    )


def _phase_table(res: SloResults) -> str:
    rows = [
        "| mode | phase | user requests | admitted first try | admitted in the end | "
        "refused attempts | gave up | goodput req/s | SLO goodput req/s | TTFT p99 ms | "
        "user TTFT p99 ms | windows within target |",
        "|---|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    for m in res.modes:
        best = " (best fixed)" if m.mode.name == res.best_fixed else ""
        for i, p in enumerate(m.phases):
            rows.append(_phase_row(m.mode.name + best, i, p))
    return "\n".join(rows)


def _window_table(m: ModeResult, target_ms: float) -> str:
    rows = [
        "| t s | phase | TTFT p99 ms | within | held (mean) | admitted/s | rejected/s |",
        "|---|---|---|---|---|---|---|",
    ]
    for w in m.windows:
        mark = ("yes" if w.within(target_ms) else "**no**") if w.judged else "(settling)"
        if w.unoffered:
            mark = "(no arrival)"
        elif w.judged and not w.admitted:
            mark = "**no** (none admitted)"
        slow = " slow" if w.slowed else ""
        held = "—" if w.held is None else f"{w.held:.1f}"
        rows.append(
            f"| {w.start:g}{slow} | {w.phase + 1} | {fmt_ms(w.ttft_p99_ms)} | {mark} | {held} | "
            f"{w.admitted_rps:.1f} | {w.rejected_rps:.1f} |"
        )
    return "\n".join(rows)


def _capacity_text(res: SloResults) -> str:
    if not res.capacity_probes:
        return (
            f"Capacity at target: **{res.capacity_rps:.2f} req/s**, given with `--capacity` "
            "(not searched in this run)."
        )
    rows = [
        "| probe | rate req/s | judged requests | TTFT p99 ms | refused | errors | holds |",
        "|---|---|---|---|---|---|---|",
    ]
    for i, p in enumerate(res.capacity_probes):
        rows.append(
            f"| {i + 1} | {p.rate:.2f} | {p.requests} | {fmt_ms(p.ttft_p99_ms)} | {p.refused} | "
            f"{p.errors} | {'yes' if p.within else 'no'} |"
        )
    table = "\n".join(rows)
    return (
        f"Capacity at target: **{res.capacity_rps:.2f} req/s**, the highest Poisson rate "
        f"whose TTFT p99 stayed within {res.target_ms:g} ms with thresholds off and no target "
        f"({res.capacity_search}):\n\n{table}"
    )


def _sweep_text(res: SloResults) -> str:
    if not res.sweep or res.sweep_plan is None:
        return (
            "No threshold sweep in this run (`--sweep ''`): the best fixed thresholds are the "
            "shipped ones."
        )
    phases = " → ".join(f"{p.load:g}x for {p.seconds:g} s" for p in res.sweep_plan.phases)
    rows = [
        "| candidate | decode | prefill frac | SLO goodput req/s per phase | SLO-good requests |",
        "|---|---|---|---|---|",
    ]
    for s in res.sweep:
        per = " / ".join(f"{v:.2f}" for v in s.slo_goodput_rps)
        rows.append(f"| {s.name} | {_g(s.decode)} | {_g(s.prefill_frac)} | {per} | {s.slo_good} |")
    return (
        f"The fixed-threshold sweep: every candidate (the shipped thresholds included) over "
        f"the same seeded arrivals, {phases}, no slowdown; the one with the most SLO-good user "
        f"requests then runs the full phases as a mode of its own:\n\n" + "\n".join(rows)
    )


def _classes_text(res: SloResults) -> str:
    c = res.classes
    if c is None:
        return "Classes: not run (`--no-classes`)."
    mix = ", ".join(f"{n} {s:.0%}" for n, s in c.mix)
    rows = [
        "| run | class | user requests | admitted first try | admitted in the end | "
        "SLO-good | SLO goodput req/s | user TTFT p99 ms |",
        "|---|---|---|---|---|---|---|---|",
    ]
    for label, cells in (("flat", c.flat), ("classes", c.classed)):
        for x in cells:
            rows.append(
                f"| {label} | {x.cls} | {x.requests} | "
                f"{_share(x.admitted_first, x.requests)} | {_share(x.admitted, x.requests)} | "
                f"{x.slo_good} | {x.slo_good / c.seconds:.2f} | {fmt_ms(x.user_ttft_p99_ms)} |"
            )
    return (
        f"Classes: a second stack, the extproc started with the classes file below and the "
        f"target alone; the same {c.load:g}x Poisson arrivals for {c.seconds:g} s twice, every "
        f"request in the default class (flat), then each with a class drawn from the mix "
        f"({mix}). SLO-good: first token within the model's target of {res.target_ms:g} ms, "
        f"retries included, whatever the class's own target.\n\n```yaml\n{c.classes_yaml}```"
        f"\n\n" + "\n".join(rows)
    )


def sources_table(res: SloResults) -> str:
    if not res.sources:
        return "TTFT sources: not measured in this run."
    rows = [
        "| source | compared | n | abs. error p50 ms | abs. error p99 ms | bias ms |",
        "|---|---|---|---|---|---|",
    ]
    for s in res.sources:
        rows.append(
            f"| {s['source']} | {s['compared']} | {s['n']} | {_ms1(s['abs_error_p50_ms'])} | "
            f"{_ms1(s['abs_error_p99_ms'])} | {_ms1(s['bias_ms'], signed=True)} |"
        )
    return "\n".join(rows)


def split_table(res: SloResults) -> str:
    rows = [
        "| mode | requests | n | until sent upstream ms | worker (to its first body byte) ms "
        "| after the worker ms | client TTFT ms |",
        "|---|---|---|---|---|---|---|",
    ]
    for mode, splits in res.splits.items():
        for s in splits:
            rows.append(
                f"| {mode} | {s['requests']} | {s['n']} | {_ms1(s['before_upstream_ms'])} | "
                f"{_ms1(s['worker_ms'])} | {_ms1(s['after_worker_ms'])} | "
                f"{_ms1(s['client_ttft_ms'])} |"
            )
    return "\n".join(rows)


def _ms1(value: float, signed: bool = False) -> str:
    if math.isnan(value):
        return "—"
    return f"{value:+.1f}" if signed else f"{value:.1f}"


def _g(value: float | None) -> str:
    return "off" if value is None else f"{value:g}"


def markdown(res: SloResults) -> str:
    cfg, plan = res.config, res.plan
    phases = " → ".join(f"{p.load:g}x for {p.seconds:g} s" for p in plan.phases)
    modes = "\n".join(f"- **{m.mode.name}**: {m.mode.describe()}" for m in res.modes)
    verdicts = "\n".join(f"- {v.name}: {v.detail}: {MARK[v.met]}" for v in goals(res))
    recovery = "\n".join(f"- {m.mode.name}: {_recovered(m)}" for m in res.modes)
    reasons = "\n".join(f"- {m.mode.name}: {_reasons(m)}" for m in res.modes)
    workers = "\n".join(f"- {m.mode.name}: {_workers(m)}" for m in res.modes)
    held = (
        "held: the mean of `extproc_held_requests` read every 0.5 s in the window"
        if any(m.held_reported for m in res.modes)
        else 'held: "—", this extproc does not report `extproc_held_requests`'
    )
    per_mode = "\n\n".join(
        f"#### {m.mode.name}\n\n![{m.mode.name}]({plot_name(res.config, m.mode.name)})\n\n"
        f"{_window_table(m, res.target_ms)}"
        for m in res.modes
    )
    load = res.load_average
    return f"""## Holding a latency target: the benchmark

Command (took {res.seconds:.0f} s; `/proc/loadavg` before: `{load.get("before", "—")}`, \
after: `{load.get("after", "—")}`; the machine is shared; code: {res.code or "—"}):

```sh
{res.command}
```

{workers_text(cfg)} Through Envoy (`envoy/envoy-track-output.yaml`, the extproc with \
`--router-track-output-blocks`). \
Unloaded TTFT p50 {res.unloaded_ttft_p50_ms:.1f} ms, p99 {res.unloaded_ttft_p99_ms:.1f} ms. \
The target: TTFT p99 **{res.target_ms:g} ms**.

{_capacity_text(res)}

Offered load (Poisson, the same seeded arrivals in every mode, each phase with the count its \
rate names, placed uniformly at random as a Poisson process places a given count): {phases} \
of the capacity at target. {plan.slow_at:g} s into phase {plan.slow_phase + 1}, worker \
{plan.slow_worker + 1} becomes {plan.slow_factor:g}x slower ({_how_slowed(cfg)}) for \
{plan.slow_for:g} s. Clients retry as {res.retry.describe()}. A user request is one request \
with its retries; its TTFT runs from its first attempt to its first token. SLO goodput: user \
requests whose first token came in the phase within the target, retries included, their \
stream completed, per second. "TTFT p99" without "user": of the attempts admitted (sent to a \
worker), from the attempt's start.

{_sweep_text(res)}

Modes, one after the other on the same stack:

{modes}

The best fixed thresholds are the fixed mode (shipped, or the sweep's best) with the most \
SLO-good user requests over the whole run: **{res.best_fixed}**.

{_phase_table(res)}

Goals of the target alone:

{verdicts}

Why requests were refused, per mode:

{reasons}

Per worker and mode: attempts it answered 200, and the means over the run of what \
`/debug/workers` showed for it every 0.5 s under deadline admission (its predicted TTFT, the \
slots it counts, its occupancy; "—" where not shown), and the requests its engine preempted \
in the mode's run (engines that count them):

{workers}

{_classes_text(res)}

Where the TTFT of admitted requests went, by Envoy's access log (medians): until Envoy sent \
the request to the worker (the routing decision, and any time held in the router), the worker \
(to the first byte of its response body), and after it (the response body through the \
extproc and Envoy to the client):

{split_table(res)}

How far each source of TTFT is from the clients' (all modes but "off", whose queue of \
seconds would drown the rest; error = source minus clients). The rows compared "per \
request" pair each request's value with the client's TTFT of that same request: the \
prediction (the `x-ttft-predicted-ms` deadline admission sends with a request it \
dispatches: the TTFT it predicted when it admitted it, for a request held for a slot its \
predicted wait included; from Envoy's access log; only modes with a target have it) and \
Envoy's own \
timings. The others compare a statistic per worker: the engine's TTFT the extproc keeps \
from the load events (a running mean of histogram bucket upper bounds) against the same \
running mean of the clients' TTFTs on that worker, and the engine's histogram quantiles \
per interval against the clients' quantiles in it:

{sources_table(res)}

Time back within target after the slowdown began (the first {WINDOW:g}-s window, sliding by \
0.5 s, from which every window up to the slowdown's end has its TTFT p99 within target; a \
window that admitted nothing is out of target). "not left": no such window was out of \
target, so there was nothing to recover from and no time is given; the recovery goal is then \
"not tested", never "met":

{recovery}

Per {WINDOW:g}-s window, by the attempts sent in it: TTFT p99 of those admitted (from the \
attempt's start to its first token, as the client saw it); {held}; attempts admitted and \
refused per second. "slow": the slowdown was on during the window; "(settling)": the first \
{SETTLE:g} s of a phase, not judged.

{per_mode}
"""


def _how_slowed(cfg: Config) -> str:
    if cfg.engine == LLAMACPP:
        return "the server process paused and resumed, SIGSTOP/SIGCONT, on a 100-ms duty cycle"
    if cfg.engine == SIM:
        return "`POST /sim/slowdown`: every engine step takes twice its modelled time"
    return "its processes paused and resumed, SIGSTOP/SIGCONT, on a 100-ms duty cycle"


def _recovered(m: ModeResult) -> str:
    before, during = m.slow_worker_ttft_p50_ms
    effect = f" (the slowed worker's TTFT p50: {fmt_ms(before)} ms before, {fmt_ms(during)} during)"
    return recovery_text(m.recovery_s) + effect


def file_prefix(cfg: Config) -> str:
    """What a run's files are named after: ``slo``, or ``slo-<engine>`` on a real engine."""
    return "slo" if cfg.engine == SIM else f"slo-{cfg.engine}"


def plot_name(cfg: Config, mode: str) -> str:
    return f"{file_prefix(cfg)}-{mode.replace(' ', '-').replace('/', '-')}.png"


def plot(res: SloResults, out: Path) -> list[Path]:
    """One figure per mode: TTFT p99 per window against the target; attempts admitted and
    refused per second; the requests held in the router per second."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    paths: list[Path] = []
    starts = res.plan.starts()
    for m in res.modes:
        fig, axes = plt.subplots(3, 1, figsize=(7.5, 7.0), sharex=True)
        ttft, rate, held = axes
        xs = [w.start + WINDOW / 2 for w in m.windows]
        ttft.plot(xs, [w.ttft_p99_ms for w in m.windows], marker="o", color="tab:blue",
                  label="TTFT p99 per window")  # fmt: skip
        empty = [w.start + WINDOW / 2 for w in m.windows if not w.admitted]
        if empty:
            ttft.plot(empty, [res.target_ms] * len(empty), "x", color="black",
                      label="nothing admitted")  # fmt: skip
        ttft.axhline(res.target_ms, color="tab:red", linestyle="--", label="target")
        ttft.set_yscale("log")
        ttft.set_ylabel("TTFT p99 (ms, log)")
        ts = [s.t + 0.5 for s in m.seconds]
        rate.plot(ts, [s.admitted for s in m.seconds], color="tab:green", label="admitted/s")
        rate.plot(ts, [s.rejected for s in m.seconds], color="tab:orange", label="refused/s")
        rate.set_ylabel("attempts per second")
        pts = [(s.t + 0.5, s.held) for s in m.seconds if s.held is not None]
        if pts:
            held.plot([t for t, _ in pts], [v for _, v in pts], color="tab:purple",
                      label="held in the router")  # fmt: skip
        else:
            held.text(0.5, 0.5, "extproc_held_requests: not reported", ha="center",
                      va="center", transform=held.transAxes)  # fmt: skip
        held.set_ylim(bottom=0)
        held.set_ylabel("requests held")
        held.set_xlabel("seconds into the run")
        for ax in axes:
            for s in starts[1:]:
                ax.axvline(s, color="grey", linewidth=0.8)
            if m.slowed[1] > m.slowed[0]:
                ax.axvspan(*m.slowed, color="tab:purple", alpha=0.12)
            ax.grid(alpha=0.3)
            if ax.get_legend_handles_labels()[0]:
                ax.legend(fontsize=7, loc="upper left")
        loads = ", ".join(f"{p.load:g}x" for p in res.plan.phases)
        ttft.set_title(f"{m.mode.name}: {m.mode.describe()}\nphases {loads} of "
                       f"{res.capacity_rps:.2f} req/s; shaded: one worker "
                       f"{res.plan.slow_factor:g}x slower", fontsize=9)  # fmt: skip
        fig.tight_layout()
        paths.append(out / plot_name(res.config, m.mode.name))
        fig.savefig(paths[-1], dpi=100)
        plt.close(fig)
    return paths
