"""``python -m loadtest.slo``: the results, the goals they are judged by, the markdown and
one plot over time per mode."""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from loadtest.shedbench.classes import Retry
from loadtest.shedbench.config import LLAMACPP, SIM, Config
from loadtest.shedbench.phases import PhasePlan
from loadtest.shedbench.report import MARK, Verdict, workers_text
from loadtest.shedbench.results import fmt_ms
from loadtest.shedbench.windows import (
    NOT_LEFT,
    SETTLE,
    WINDOW,
    ModeResult,
    recovery_text,
)

GOODPUT_SHARE = 0.95  # of the best fixed thresholds' SLO goodput, in every phase
WINDOWS_WITHIN = 0.95  # of the judged windows within target
RECOVERY_GOAL_S = 10.0
OFF, SHIPPED, TARGET, TARGET_ALONE = "off", "shipped", "target", "target alone"


@dataclass
class SloResults:
    config: Config
    plan: PhasePlan
    retry: Retry
    command: str
    unloaded_ttft_p50_ms: float
    unloaded_ttft_p99_ms: float
    capacity_rps: float
    sweep: list[dict[str, float]]
    target_ms: float
    modes: list[ModeResult]
    best_fixed: str  # the name of the best fixed mode
    sources: list[dict[str, Any]] = field(default_factory=list)
    # Per mode: the TTFT sources over that mode alone, and where its TTFT went.
    sources_by_mode: dict[str, list[dict[str, Any]]] = field(default_factory=dict)
    splits: dict[str, list[dict[str, Any]]] = field(default_factory=dict)
    seconds: float = 0.0

    def mode(self, name: str) -> ModeResult | None:
        return next((m for m in self.modes if m.mode.name == name), None)


def total_slo_goodput(m: ModeResult) -> float:
    """SLO-good completions over the whole run: how the best fixed thresholds are chosen."""
    return sum(p.slo_goodput_rps * p.seconds for p in m.phases)


def goals(res: SloResults) -> list[Verdict]:
    target, best = res.mode(TARGET), res.mode(res.best_fixed)
    if target is None or best is None:
        return []
    out: list[Verdict] = []
    for i, (t, b) in enumerate(zip(target.phases, best.phases, strict=True)):
        need = GOODPUT_SHARE * b.slo_goodput_rps
        out.append(Verdict(
            f"phase {i + 1} ({t.load:g}x): SLO goodput >= {GOODPUT_SHARE:.0%} of the best "
            f"fixed thresholds' ({b.slo_goodput_rps:.2f} req/s)",
            t.slo_goodput_rps >= need - 1e-9,
            f"{t.slo_goodput_rps:.2f} req/s ("
            + (f"{t.slo_goodput_rps / b.slo_goodput_rps:.0%}" if b.slo_goodput_rps else "—")
            + ")",
        ))  # fmt: skip
    judged = sum(p.windows_judged for p in target.phases)
    within = sum(p.windows_within for p in target.phases)
    out.append(Verdict(
        f"TTFT p99 within {res.target_ms:g} ms in >= {WINDOWS_WITHIN:.0%} of the {WINDOW:g}-s "
        f"windows after the first {SETTLE:g} s of each phase",
        judged > 0 and within >= WINDOWS_WITHIN * judged - 1e-9,
        f"{within} of {judged}" + (f" ({within / judged:.0%})" if judged else ""),
    ))  # fmt: skip
    out.append(recovery_verdict(target))
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


def _phase_table(res: SloResults) -> str:
    rows = [
        "| mode | phase | requests | admitted (in the end) | rejected attempts | gave up | "
        "goodput req/s | SLO goodput req/s | TTFT p99 ms | windows within target |",
        "|---|---|---|---|---|---|---|---|---|---|",
    ]
    for m in res.modes:
        best = " (best fixed)" if m.mode.name == res.best_fixed else ""
        for i, p in enumerate(m.phases):
            admitted = f"{p.admitted / p.requests:.0%}" if p.requests else "—"
            rows.append(
                f"| {m.mode.name}{best} | {i + 1}: {p.load:g}x | {p.requests} | {admitted} | "
                f"{p.rejected_attempts} | {p.gave_up} | {p.goodput_rps:.2f} | "
                f"**{p.slo_goodput_rps:.2f}** | {fmt_ms(p.ttft_p99_ms)} | "
                f"{p.windows_within} of {p.windows_judged} |"
            )
    return "\n".join(rows)


def _window_table(m: ModeResult, target_ms: float) -> str:
    rows = [
        "| t s | phase | TTFT p99 ms | within | limit per worker | admitted/s | rejected/s |",
        "|---|---|---|---|---|---|---|",
    ]
    for w in m.windows:
        limit = ", ".join(f"{k} {v:.2f}" for k, v in w.limit.items()) or "—"
        mark = ("yes" if w.within(target_ms) else "**no**") if w.judged else "(settling)"
        if w.judged and not w.admitted:
            mark = "**no** (none admitted)"
        slow = " slow" if w.slowed else ""
        rows.append(
            f"| {w.start:g}{slow} | {w.phase + 1} | {fmt_ms(w.ttft_p99_ms)} | {mark} | {limit} | "
            f"{w.admitted_rps:.1f} | {w.rejected_rps:.1f} |"
        )
    return "\n".join(rows)


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


def markdown(res: SloResults) -> str:
    cfg, plan = res.config, res.plan
    phases = " → ".join(f"{p.load:g}x for {p.seconds:g} s" for p in plan.phases)
    modes = "\n".join(f"- **{m.mode.name}**: {m.mode.describe()}" for m in res.modes)
    verdicts = "\n".join(f"- {v.name}: {v.detail}: {MARK[v.met]}" for v in goals(res))
    recovery = "\n".join(f"- {m.mode.name}: {_recovered(m)}" for m in res.modes)
    sweep = ", ".join(f"c={int(s['concurrency'])}: {s['completed_rps']:.2f}" for s in res.sweep)
    capacity = (
        f"Capacity (closed-loop sweep, thresholds off, completed req/s: {sweep}): "
        f"**{res.capacity_rps:.2f} req/s**."
        if res.sweep
        else f"Capacity: **{res.capacity_rps:.2f} req/s**, given with `--capacity`."
    )
    per_mode = "\n\n".join(
        f"#### {m.mode.name}\n\n![{m.mode.name}]({plot_name(res.config, m.mode.name)})\n\n"
        f"{_window_table(m, res.target_ms)}"
        for m in res.modes
        if m.mode.name in (OFF, SHIPPED, TARGET, TARGET_ALONE, res.best_fixed)
    )
    r = res.retry
    return f"""## Holding a latency target: the benchmark

Command (took {res.seconds:.0f} s):

```sh
{res.command}
```

{workers_text(cfg)} Through Envoy (`envoy/envoy-track-output.yaml`, the extproc with \
`--router-track-output-blocks`). \
Unloaded TTFT p50 {res.unloaded_ttft_p50_ms:.1f} ms, p99 {res.unloaded_ttft_p99_ms:.1f} ms. \
{capacity}

Offered load (Poisson, the same seeded arrivals in every mode): {phases}. \
{plan.slow_at:g} s into phase {plan.slow_phase + 1}, worker {plan.slow_worker + 1} becomes \
{plan.slow_factor:g}x slower ({_how_slowed(cfg)}) for {plan.slow_for:g} s. Clients retry an \
overload reply after `Retry-After` plus a uniform backoff in [0, min({r.cap:g}, \
{r.base:g} x 2^(n-1))] s, at most {r.max_attempts} attempts. The target: TTFT p99 \
**{res.target_ms:g} ms**; it is also the bar of SLO goodput (streams completed in the phase \
whose TTFT was within it, per second).

Modes, one after the other on the same stack:

{modes}

The best fixed thresholds are those of the sweep (the shipped ones included) with the most \
SLO-good completions over the whole run: **{res.best_fixed}**.

{_phase_table(res)}

Goals (the target mode):

{verdicts}

Where the TTFT of admitted requests went, by Envoy's access log (medians): until Envoy sent \
the request to the worker (the routing decision), the worker (to the first byte of its \
response body), and after it (the response body through the extproc and Envoy to the \
client):

{split_table(res)}

How far each source of TTFT is from the clients' (all modes but "off", whose queue of \
seconds would drown the rest; error = source minus clients):

{sources_table(res)}

Time back within target after the slowdown began (the first {WINDOW:g}-s window, sliding by \
0.5 s, from which every window up to the slowdown's end has its TTFT p99 within target; a \
window that admitted nothing is out of target). "not left": no such window was out of \
target, so there was nothing to recover from and no time is given; the recovery goal is then \
"not tested", never "met":

{recovery}

Per {WINDOW:g}-s window, by the attempts sent in it: TTFT p99 of those admitted (from the \
attempt's start to its first token, as the client saw it), the latency limit each worker ran \
under (`latency_control.limit` in `/debug/workers`, read every 0.5 s: the multiplier on the \
thresholds; "—" without a target), attempts admitted and rejected per second. "slow": the \
slowdown was on during the window; "(settling)": the first {SETTLE:g} s of a phase, not judged.

{per_mode}
"""


def _how_slowed(cfg: Config) -> str:
    if cfg.engine == LLAMACPP:
        return "the server process paused and resumed, SIGSTOP/SIGCONT, on a 100-ms duty cycle"
    return "`POST /sim/slowdown`"


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
    """One figure per mode: TTFT p99 per window against the target, the limit per worker,
    admitted and rejected per second."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    paths: list[Path] = []
    starts = res.plan.starts()
    for m in res.modes:
        if m.mode.name not in (OFF, SHIPPED, TARGET, TARGET_ALONE, res.best_fixed):
            continue
        fig, axes = plt.subplots(3, 1, figsize=(7.5, 7.0), sharex=True)
        ttft, limit, rate = axes
        xs = [w.start + WINDOW / 2 for w in m.windows]
        ttft.plot(xs, [w.ttft_p99_ms for w in m.windows], marker="o", color="tab:blue",
                  label="TTFT p99 per window")  # fmt: skip
        ttft.axhline(res.target_ms, color="tab:red", linestyle="--", label="target")
        ttft.set_yscale("log")
        ttft.set_ylabel("TTFT p99 (ms, log)")
        for worker, series in m.series.items():
            pts = [(t, v) for t, v in series if v is not None]
            if pts:
                limit.step([t for t, _ in pts], [v for _, v in pts], where="post",
                           label=f"limit, {worker}")  # fmt: skip
        if not any(v is not None for s in m.series.values() for _, v in s):
            limit.text(0.5, 0.5, "no target: the thresholds as configured", ha="center",
                       va="center", transform=limit.transAxes)  # fmt: skip
        limit.set_ylim(0, 1.05)
        limit.set_ylabel("limit (x thresholds)")
        rate.plot(xs, [w.admitted_rps for w in m.windows], marker="s", color="tab:green",
                  label="admitted/s")  # fmt: skip
        rate.plot(xs, [w.rejected_rps for w in m.windows], marker="x", color="tab:orange",
                  label="rejected/s")  # fmt: skip
        rate.set_ylabel("attempts per second")
        rate.set_xlabel("seconds into the run")
        for ax in axes:
            for s in starts[1:]:
                ax.axvline(s, color="grey", linewidth=0.8)
            ax.axvspan(*m.slowed, color="tab:purple", alpha=0.12)
            ax.grid(alpha=0.3)
            if ax.get_legend_handles_labels()[0]:
                ax.legend(fontsize=7, loc="upper left")
        loads = ", ".join(f"{p.load:g}x" for p in res.plan.phases)
        ttft.set_title(f"{m.mode.name}: {m.mode.describe()}\nphases {loads}; shaded: one "
                       f"worker {res.plan.slow_factor:g}x slower", fontsize=9)  # fmt: skip
        fig.tight_layout()
        paths.append(out / plot_name(res.config, m.mode.name))
        fig.savefig(paths[-1], dpi=100)
        plt.close(fig)
    return paths
