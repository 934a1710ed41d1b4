"""The markdown reports: the overload table, the recovery rounds, the per-class table, and
the targets each is measured against."""

from __future__ import annotations

import itertools
import math
import os
from collections.abc import Sequence
from dataclasses import dataclass, field

from loadtest.shedbench.classes import ALONE, CLASS_HEADER, MIX, RETRY, MixedCell, Retry
from loadtest.shedbench.config import LLAMACPP, SIM, Config
from loadtest.shedbench.recovery import RecoveryPlan, RecoveryRound, median
from loadtest.shedbench.results import fmt_ms, fmt_pct
from loadtest.shedbench.stats import Cell
from loadtest.shedbench.windows import NOT_LEFT


@dataclass
class Results:
    """``python -m loadtest.overload``: what was run and measured."""

    config: Config
    command: str
    unloaded_ttft_p50_ms: float
    unloaded_ttft_p99_ms: float
    unloaded_e2e_p99_ms: float
    sweep: list[dict[str, float]]
    capacity_rps: float
    knee_concurrency: int
    cells: list[Cell]
    seconds: float
    recovery_plan: RecoveryPlan | None = None
    recovery: list[RecoveryRound] = field(default_factory=list)
    load_average: list[float] = field(default_factory=list)  # 1-min, at the start and end

    def loads_present(self) -> list[float]:
        return sorted({c.load for c in self.cells})


@dataclass
class MixedResults:
    """``python -m loadtest.mixed``: what was run and measured."""

    config: Config
    retry: Retry
    classes_yaml: str
    command: str
    unloaded_ttft_p50_ms: float
    unloaded_ttft_p99_ms: float
    capacity_rps: float
    cells: list[MixedCell]
    seconds: float


@dataclass
class Verdict:
    name: str
    met: bool | None  # None: not tested (the run had nothing the goal could be judged on)
    detail: str


MARK = {True: "met", False: "**missed**", None: "not tested"}

# --- overload ----------------------------------------------------------------------------------


def markdown(res: Results) -> str:
    cfg = res.config
    lines = [
        "| offered load | thresholds | sent req/s | goodput req/s | SLO goodput req/s | "
        "TTFT p50 ms | TTFT p99 ms | e2e p99 ms | rejected | preemptions | waiting max / mean |",
        "|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    for c in res.cells:
        lines.append(
            f"| {c.load:g}x | {'on' if c.thresholds else 'off'} | {c.sent_rps:.1f} | "
            f"{c.goodput_rps:.2f} | {c.slo_goodput_rps:.2f} | {fmt_ms(c.ttft_p50_ms)} | "
            f"{fmt_ms(c.ttft_p99_ms, c.censored_p99)} | "
            f"{fmt_ms(c.e2e_p99_ms, c.censored_p99)} | {c.rejection_rate:.0%} | "
            f"{c.preemptions} | {c.waiting_max:.0f} / {c.waiting_mean:.1f} |"
        )
    table = "\n".join(lines)
    sweep = ", ".join(f"c={int(s['concurrency'])}: {s['completed_rps']:.2f}" for s in res.sweep)
    verdict = targets(res)
    if res.sweep:
        capacity = (
            f"Capacity sweep (closed loop, thresholds off, completed req/s): {sweep}. Capacity = "
            f"**{res.capacity_rps:.2f} req/s** at the knee, concurrency {res.knee_concurrency}."
        )
    else:
        capacity = f"Capacity: **{res.capacity_rps:.2f} req/s**, given with `--capacity`."
    extproc_flags = (
        "with `--router-track-output-blocks` behind `envoy/envoy-track-output.yaml`"
        if cfg.track_output_blocks
        else "without `--router-track-output-blocks`, behind `envoy/envoy.yaml`"
    )
    recovery = recovery_markdown(res)
    return f"""## Overload: goodput and latency against offered load

Command (took {res.seconds:.0f} s):

```sh
{res.command}
```

{workers_text(cfg)} Thresholds \
"on": {thresholds_text(cfg)} (set with \
`POST /busy_threshold`); the extproc runs {extproc_flags}. Each cell: \
{cfg.cell_seconds:g} s of Poisson arrivals, the first \
{cfg.warmup:g} s not counted, {cfg.grace:g} s for the last requests to finish.

Unloaded (one request at a time): TTFT p50 {res.unloaded_ttft_p50_ms:.1f} ms, p99 \
{res.unloaded_ttft_p99_ms:.1f} ms; end-to-end p99 {res.unloaded_e2e_p99_ms:.0f} ms.
{capacity}

{table}

Goodput counts 2xx streams completed inside the arrival window after warm-up; SLO goodput \
only those whose TTFT was at most 2 x the unloaded p99 ({2 * res.unloaded_ttft_p99_ms:.0f} ms), \
the target's bar; latencies are \
those of accepted (200) requests that arrived after warm-up; `>=` marks a percentile that \
includes streams cut off at the end of the cell (a lower bound). Rejected = overload replies \
(529) / requests sent. {engine_columns(cfg)}

{verdict}
{cpu_markdown(res)}{recovery}
![goodput]({cfg.name}-goodput.png)
![latency]({cfg.name}-latency.png)
"""


def cpu_markdown(res: Results) -> str:
    """Where the CPU went in each cell; empty if not measured."""
    cells = [c for c in res.cells if c.cpu]
    if not cells:
        return ""
    parts = list(cells[0].cpu)
    rows = [
        "| offered load | thresholds | " + " | ".join(parts) + " | engines per completed request |",
        "|---|---|" + "---|" * (len(parts) + 1),
    ]
    for c in cells:
        done = c.goodput_rps * (res.config.cell_seconds - res.config.warmup)
        per = f"{c.cpu.get('engines', 0) / done:.2f}" if done else "—"
        rows.append(
            f"| {c.load:g}x | {'on' if c.thresholds else 'off'} | "
            + " | ".join(f"{c.cpu[p]:.1f}" for p in parts)
            + f" | {per} |"
        )
    machine = ""
    if len(res.load_average) == 2:
        machine = (
            f" The machine's 1-minute load average was {res.load_average[0]:.1f} at the start "
            f"of the run and {res.load_average[1]:.1f} at its end."
        )
    return f"""
### Where the CPU went

Core-seconds used while each cell's requests ran (arrivals and grace), from `/proc`: the \
engines, {"their agents, " if "agents" in parts else ""}the extproc, Envoy, this load \
generator (`client`), and `other`: everything else the machine ran meanwhile (other work \
sharing its {os.cpu_count()} cores). "engines per completed request": engine core-seconds over \
the requests completed in the cell's window.{machine}

{chr(10).join(rows)}
"""


def workers_text(cfg: Config) -> str:
    """The workers and the requests, as the report's first lines say them."""
    if cfg.engine == "vllm":
        from loadtest.shedbench.vllm_workers import workers_text as vllm_text

        return vllm_text(cfg)
    if cfg.engine == LLAMACPP:
        return (
            f"Workers: 2 llama.cpp `llama-server` serving SmolLM2-135M-Instruct (Q4_1), each "
            f"`--ctx-size {cfg.kv_total_blocks * cfg.block_size} --parallel "
            f"{cfg.max_num_seqs} --threads 1 --batch-size {cfg.max_num_batched_tokens}`, each "
            f"with its agent (`--engine llamacpp --interval 0.1 --block-size "
            f"{cfg.block_size}`). Every request is a streaming chat completion whose prompt "
            f"the router counts as {cfg.prompt_tokens} tokens (4 bytes each; the model's "
            f"tokenizer makes about 2.2 tokens of each 4 bytes, plus its chat template), "
            f"`max_tokens` {cfg.max_tokens} and `ignore_eos`."
        )
    return (
        f"Workers: 2 simulated engines, each `--kv-total-blocks {cfg.kv_total_blocks} "
        f"--block-size {cfg.block_size} --max-num-seqs {cfg.max_num_seqs} "
        f"--max-num-batched-tokens {cfg.max_num_batched_tokens} --speedup {cfg.speedup:g}`. "
        f"Every request is a streaming chat completion of {cfg.prompt_tokens} prompt tokens "
        f"and `max_tokens` {cfg.max_tokens}."
    )


def thresholds_text(cfg: Config) -> str:
    names = (
        ("active_decode_blocks_threshold", cfg.decode_threshold),
        ("active_prefill_tokens_threshold", cfg.prefill_threshold),
        ("active_prefill_tokens_threshold_frac", cfg.prefill_frac_threshold),
    )
    return ", ".join(f"`{n}` {v}" for n, v in names if v is not None) or "none"


def engine_columns(cfg: Config) -> str:
    if cfg.engine == LLAMACPP:
        return (
            "Preemptions: none on llama.cpp (a request keeps its slot). Waiting: the requests "
            "before their first token on both engines (`llamacpp:requests_deferred` plus the "
            "slots still evaluating a prompt), sampled every 0.25 s."
        )
    return (
        "Preemptions: increase of `vllm:num_preemptions_total` over both workers during the "
        "cell; waiting: `vllm:num_requests_waiting` of both workers, sampled every 0.25 s."
    )


def _cell(res: Results, load: float, on: bool) -> Cell | None:
    return next((c for c in res.cells if c.load == load and c.thresholds == on), None)


GOAL_LOAD = 3.0  # the real engine's goals are set at 3 x capacity


def targets(res: Results) -> str:
    if res.config.engine != SIM:  # a real engine: llama.cpp or vLLM
        return slo_targets(res, GOAL_LOAD)
    top = max(res.loads_present())
    on, off = _cell(res, top, True), _cell(res, top, False)
    peak = _cell(res, 1.0, True) or _cell(res, 1.0, False)
    if on is None or off is None or peak is None:
        return "Targets: not evaluated (need the 1x cells and the highest load on and off)."
    peak_goodput = max(c.goodput_rps for c in res.cells if c.load == 1.0)
    ttft_limit = 2 * res.unloaded_ttft_p99_ms
    ttft_ok = on.ttft_p99_ms <= ttft_limit
    goodput_ok = on.goodput_rps >= 0.9 * peak_goodput
    return (
        f"Targets at {top:g}x with thresholds on: p99 TTFT {on.ttft_p99_ms:,.0f} ms vs "
        f"<= 2 x unloaded p99 = {ttft_limit:,.0f} ms: {MARK[ttft_ok]}; goodput "
        f"{on.goodput_rps:.2f} req/s vs >= 90 % of the 1x peak ({peak_goodput:.2f}) = "
        f"{0.9 * peak_goodput:.2f}: {MARK[goodput_ok]}. With thresholds off at {top:g}x: "
        f"goodput {off.goodput_rps:.2f} req/s, p99 TTFT "
        f"{fmt_ms(off.ttft_p99_ms, off.censored_p99)} ms, {off.preemptions} preemptions, "
        f"up to {off.waiting_max:.0f} requests waiting."
    )


def slo_targets(res: Results, load: float) -> str:
    """At ``load`` x capacity with thresholds on: TTFT p99 <= 2 x the unloaded p99, and SLO
    goodput >= 90 % of capacity; what thresholds off did at the same load."""
    on, off = _cell(res, load, True), _cell(res, load, False)
    if on is None or off is None:
        return f"Targets: not evaluated (need the {load:g}x cells with thresholds on and off)."
    ttft_limit = 2 * res.unloaded_ttft_p99_ms
    need = 0.9 * res.capacity_rps
    ttft_ok = on.ttft_p99_ms <= ttft_limit and not on.censored_p99
    goodput_ok = on.slo_goodput_rps >= need
    return (
        f"Targets at {load:g}x with thresholds on: TTFT p99 {on.ttft_p99_ms:,.0f} ms vs <= 2 x "
        f"unloaded p99 = {ttft_limit:,.0f} ms: {MARK[ttft_ok]}; SLO goodput "
        f"{on.slo_goodput_rps:.2f} req/s vs >= 90 % of capacity ({res.capacity_rps:.2f}) = "
        f"{need:.2f}: {MARK[goodput_ok]} ({on.slo_goodput_rps / res.capacity_rps:.0%} of "
        f"capacity). With thresholds off at {load:g}x: SLO goodput "
        f"{off.slo_goodput_rps:.2f} req/s, TTFT p99 {fmt_ms(off.ttft_p99_ms, off.censored_p99)} "
        f"ms, up to {off.waiting_max:.0f} requests waiting."
    )


RECOVERY_GOAL_S = 1.0


def _s(value: float | None) -> str:
    return "not within the probes" if value is None else f"{value:.2f}"


def _round_s(r: RecoveryRound, value: float | None) -> str:
    """A round's time, or "not left" where its phase was not shedding when it ended: there
    was nothing to recover from, so the probes' answer times are no recovery time."""
    return _s(value) if r.overloaded else NOT_LEFT


def recovery_verdict(load: float, rounds: Sequence[RecoveryRound]) -> Verdict:
    """The median 95 %-admitted time after ``load`` x capacity against the goal, over the
    rounds whose phase was still shedding when it ended; not tested without such a round."""
    left = [r for r in rounds if r.overloaded]
    name = f"after {load:g}x: 95 % admitted <= {RECOVERY_GOAL_S:g} s (median)"
    skipped = len(rounds) - len(left)
    aside = (
        f"; {skipped} of {len(rounds)} rounds not shedding at their end ({NOT_LEFT}), not counted"
        if skipped
        else ""
    )
    if not left:
        return Verdict(name, None, f"no round was shedding at its end ({NOT_LEFT}){aside}")
    first = median([r.first_admitted_s for r in left])
    full = median([r.admitted_95_s for r in left])
    return Verdict(
        name,
        full is not None and full <= RECOVERY_GOAL_S,
        f"median of {len(left)} rounds, first admitted {_s(first)} s, 95 % admitted "
        f"{_s(full)} s{aside}",
    )


def recovery_markdown(res: Results) -> str:
    """The recovery rounds, their medians per load and the 1 s goal; empty if none ran."""
    plan = res.recovery_plan
    if plan is None or not res.recovery:
        return ""
    rows = [
        "| overload | round | sent / 529 (last second) | at the end: engines running; KV blocks "
        "effective / limit (reported, router estimate) | first worker free s | first admitted s "
        "| 95 % admitted s | probes admitted | rejected probes by reason | overload marks s "
        "| oldest load report ms |",
        "|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    for r in res.recovery:
        reasons = ", ".join(f"{k} {v}" for k, v in sorted(r.rejected_reasons.items())) or "—"
        e = r.at_end
        end = (
            f"{r.running_at_end:.0f}; {e.effective_blocks} / {e.limit_blocks} "
            f"({e.reported_blocks}, {e.estimated_blocks})"
            if e is not None
            else f"{r.running_at_end:.0f}"
        )
        rows.append(
            f"| {r.load:g}x | {r.round} | {r.overload_sent} / {r.overload_rejected} "
            f"({r.overload_rejected_last_second}) | {end} | {_s(r.first_free_s)} | "
            f"{_round_s(r, r.first_admitted_s)} | {_round_s(r, r.admitted_95_s)} | "
            f"{r.probes_admitted} of {len(r.probes)} | {reasons} | {r.overload_marked_s:.2f} | "
            f"{r.oldest_report_ms:.0f} |"
        )
    verdicts = []
    for load in sorted({r.load for r in res.recovery}):
        v = recovery_verdict(load, [r for r in res.recovery if r.load == load])
        verdicts.append(f"- {v.name}: {v.detail}: {MARK[v.met]}")
    interval = 1 / plan.probe_rate
    need = math.ceil(plan.share * plan.window - 1e-9)
    return f"""
### Recovery after overload

Thresholds on. Each round: {plan.overload_seconds:g} s of Poisson arrivals at the load shown, \
then, from the instant they end, a probe every {interval * 1e3:.0f} ms for \
{plan.probe_seconds:g} s ({plan.probes} probes: the same prompt, `max_tokens` 4); the \
overload's admitted streams run on. First admitted: the send time, after the overload's end, \
of the first probe answered 200. 95 % admitted: the send time of the first admitted probe \
from which at least {need} of {plan.window} consecutive probes \
({plan.window * interval:g} s) were answered 200. Resolution: one probe interval. Between \
rounds the run waits until both engines are empty. "sent / 529 (last second)": the overload \
phase's arrivals, those rejected, and those rejected in its last second (the phase was still \
shedding when it ended). A round with none rejected in its last second had nothing to \
recover from: its times read "{NOT_LEFT}", and the medians and the goal count only the \
other rounds (none left: the goal is "not tested", never "met"). The extproc's view, \
`GET /debug/workers` sampled at the probe rate from the overload's end and summed over both \
workers: KV blocks "effective" (per rank the \
larger of the last reported load and the router's estimate of its requests in flight) \
against the decode threshold's limit at the end; the first sample with a worker free; the \
time a worker was under an overload mark (after a worker-side rejection or an unreachable \
worker); the oldest load report seen until half a second after the round recovered.

{chr(10).join(rows)}

{chr(10).join(verdicts)}
"""


# --- classes -----------------------------------------------------------------------------------


def class_targets(res: MixedResults) -> list[Verdict]:
    """The targets, evaluated on the mixed cells with classes (not flat, not alone)."""
    out: list[Verdict] = []
    crit_share = dict(MIX)["critical"]
    bar = 1.5 * res.unloaded_ttft_p99_ms
    classed = [c for c in res.cells if c.classed]
    for cell in classed:
        if cell.load * crit_share > 1.0:
            continue  # critical alone does not fit capacity: the targets do not apply
        crit = cell.of("critical")
        out.append(Verdict(
            f"{cell.load:g}x {cell.mode}: critical admitted >= 95 %",
            crit.admitted_ratio >= 0.95,
            f"{crit.admitted_ratio:.1%} ({crit.admitted} of {crit.requests})",
        ))  # fmt: skip
        alone = next((c for c in res.cells if c.mode == ALONE and c.load == cell.load), None)
        versus = (
            f"; {crit.ttft_p99_ms / alone.of('critical').ttft_p99_ms:.2f} x its p99 with "
            f"the critical requests alone ({alone.of('critical').ttft_p99_ms:.1f} ms)"
            if alone is not None
            else ""
        )
        out.append(Verdict(
            f"{cell.load:g}x {cell.mode}: critical TTFT p99 <= 1.5 x unloaded p99 "
            f"({bar:.1f} ms)",
            crit.ttft_p99_ms <= bar,
            f"{crit.ttft_p99_ms:.1f} ms{versus}",
        ))  # fmt: skip
    top = max(res.config.loads)
    retrying_top = next((c for c in classed if c.mode == RETRY and c.load == top), None)
    if retrying_top is not None:
        need = 0.9 * res.capacity_rps
        out.append(Verdict(
            f"{top:g}x retrying: total SLO goodput >= 90 % of capacity ({need:.2f} req/s)",
            retrying_top.slo_goodput_rps >= need,
            f"{retrying_top.slo_goodput_rps:.2f} req/s "
            f"({retrying_top.slo_goodput_rps / res.capacity_rps:.0%} of capacity)",
        ))  # fmt: skip
    for cell in classed:
        rates = [cell.of(n).attempt_rejection_rate for n, _ in MIX]
        out.append(Verdict(
            f"{cell.load:g}x {cell.mode}: rejections critical <= standard <= sheddable",
            rejections_ordered(rates),
            " / ".join(f"{r:.1%}" for r in rates),
        ))  # fmt: skip
    return out


def rejections_ordered(rates: Sequence[float]) -> bool:
    """Attempt rejection rates, most important class first, never fall with priority, and
    the most important class got some of its attempts admitted: shedding every attempt of
    every class is ordered too, and proves nothing."""
    return (
        bool(rates)
        and all(not math.isnan(r) for r in rates)
        and rates[0] < 1.0
        and all(a <= b + 1e-9 for a, b in itertools.pairwise(rates))
    )


def class_markdown(res: MixedResults) -> str:
    cfg = res.config
    rows = [
        "| offered | clients | class | requests | admitted (first try) | admitted (in the end) "
        "| rejected attempts | attempts / request | TTFT p50 / p99 ms | TTFT p99 from arrival ms "
        "| SLO goodput req/s |",
        "|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    for cell in res.cells:
        mode = cell.mode
        for c in cell.classes:
            rows.append(
                f"| {cell.load:g}x | {mode} | {c.cls} | {c.requests} | "
                f"{fmt_pct(c.admitted_first_ratio)} | {fmt_pct(c.admitted_ratio)} | "
                f"{fmt_pct(c.attempt_rejection_rate)} | "
                f"{c.attempts / c.requests if c.requests else math.nan:.2f} | "
                f"{fmt_ms(c.ttft_p50_ms)} / {fmt_ms(c.ttft_p99_ms)} | "
                f"{fmt_ms(c.ttft_from_arrival_p99_ms)} | {c.slo_goodput_rps:.2f} |"
            )
        rows.append(
            f"| {cell.load:g}x | {mode} | **all** | {sum(c.requests for c in cell.classes)} | "
            f"| | | {cell.attempts_rps:.1f} attempts/s | | | "
            f"**{cell.slo_goodput_rps:.2f}** (goodput {cell.goodput_rps:.2f}) |"
        )
    verdicts = "\n".join(f"- {v.name}: {v.detail}: {MARK[v.met]}" for v in class_targets(res))
    mix = ", ".join(f"{int(w * 100)} % {n}" for n, w in MIX)
    return f"""## Overload with request classes

Command (took {res.seconds:.0f} s):

```sh
{res.command}
```

Workers: 2 simulated engines, each `--kv-total-blocks {cfg.kv_total_blocks} --block-size \
{cfg.block_size} --max-num-seqs {cfg.max_num_seqs} --max-num-batched-tokens \
{cfg.max_num_batched_tokens} --speedup {cfg.speedup:g}`; every request a streaming chat \
completion of {cfg.prompt_tokens} prompt tokens and `max_tokens` {cfg.max_tokens}; traffic \
{mix}, Poisson, the class in `{CLASS_HEADER}`. Thresholds on: \
`active_decode_blocks_threshold` {cfg.decode_threshold}, \
`active_prefill_tokens_threshold_frac` {cfg.prefill_frac_threshold}. Each cell: \
{cfg.cell_seconds:g} s of arrivals, the first {cfg.warmup:g} s not counted, {cfg.grace:g} s \
for the last requests. Retrying clients: at most {res.retry.max_attempts} attempts, each \
retry after `Retry-After` plus a uniform backoff in [0, min({res.retry.cap:g}, \
{res.retry.base:g} x 2^(n-1))] s. "flat": the same arrivals with every class at share 1 \
(what happens without classes). "critical alone": only the critical requests of that load \
(20 % of its rate), nothing else: the critical TTFT the other classes' overload is compared \
with.

Classes file:

```yaml
{res.classes_yaml.strip()}
```

Unloaded (one request at a time): TTFT p50 {res.unloaded_ttft_p50_ms:.1f} ms, p99 \
{res.unloaded_ttft_p99_ms:.1f} ms. Capacity: **{res.capacity_rps:.2f} req/s**.

{chr(10).join(rows)}

Requests: those that arrived after warm-up. Admitted: the share whose first attempt, or \
whose last, got a 200. Rejected attempts: overload replies / attempts. TTFT: of the admitted \
attempt, from its start; "from arrival" adds the time spent on rejections and backoff. SLO \
goodput: 2xx streams completed inside the window after warm-up whose TTFT was at most 2 x \
the unloaded p99 ({2 * res.unloaded_ttft_p99_ms:.0f} ms).

Targets (cells where critical traffic alone fits capacity, i.e. {dict(MIX)["critical"]:.0%} \
x offered <= 1; the rejection order in every cell, met only where some critical attempts \
were admitted, since shedding everything is ordered too):

{verdicts}

![admitted per class](classes-admitted.png)
![TTFT per class](classes-ttft.png)
"""
