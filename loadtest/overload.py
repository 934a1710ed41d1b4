"""Overload benchmark: goodput and latency against offered load, busy thresholds off and on,
and the recovery after an overload.

Starts its own stack on free 127.0.0.1 ports (Envoy with the repo's filter chain, the
extproc, and two workers that publish their load: simulated vLLM-like engines, or with
``--engine llamacpp`` two llama.cpp ``llama-server`` serving SmolLM2-135M on this CPU, or
with ``--engine vllm`` two vLLM servers of the same model, each with its agent), then:

1. **unloaded** — one request at a time: the reference p99 TTFT;
2. **capacity** — closed-loop sweep of concurrency with thresholds off; capacity is the
   completed req/s at the knee (the smallest concurrency within 5 % of the best);
3. **cells** — open-loop arrivals (Poisson, seeded) at ``--loads`` x capacity, each with
   thresholds off and on (set at run time with ``POST /busy_threshold``);
4. **recovery** — thresholds on: ``--recovery-rounds`` overload phases at each of
   ``--recovery-loads`` x capacity, each followed by probes at a steady rate: the time from
   the phase's end to the first admitted probe and to >= 95 % admitted over a sliding
   window (``loadtest/shedbench/recovery.py`` defines both exactly).

Every request is the same streaming chat completion. Per cell: goodput (2xx completed per
second inside the arrival window, after warm-up), p50/p99 TTFT and p99 end-to-end latency of
the accepted requests that arrived after warm-up, rejection rate, the workers' preemptions
(on vLLM its own ``vllm:num_preemptions_total``, read from each engine before and after the
cell) and waiting queue, and the CPU each part of the stack used. Requests
still running ``--grace`` seconds after the window are cancelled and count at the cut-off
time (the percentile is then a lower bound, shown as ``>=``). Writes a markdown table, a JSON
file and two PNG plots under ``--out`` (``overload-*``, ``overload-llamacpp-*`` or
``overload-vllm-*``).

    python -m loadtest.overload                      # ~5-6 minutes on 2 cores
    python -m loadtest.overload --loads 1,3 --cell-seconds 10   # quicker look
    python -m loadtest.overload --engine llamacpp    # ~7 minutes on 2 cores
    python -m loadtest.overload --engine vllm        # ~8 minutes on 2 cores
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import os
import random
import shlex
import sys
import tempfile
import time
from collections.abc import Iterator, Sequence
from dataclasses import dataclass, field
from pathlib import Path

import aiohttp

from extproc.devstack import ROOT
from loadtest.shedbench.arrivals import open_loop
from loadtest.shedbench.capacity import measure_unloaded, sweep_capacity
from loadtest.shedbench.config import ENGINES, LLAMACPP, SIM, Config
from loadtest.shedbench.cpu import CpuMeter
from loadtest.shedbench.plots import plot
from loadtest.shedbench.recovery import RecoveryPlan, measure_recovery
from loadtest.shedbench.report import Results, markdown
from loadtest.shedbench.results import log, write_results
from loadtest.shedbench.stack import Stack, started_stack
from loadtest.shedbench.stats import Cell, summarize
from loadtest.shedbench.vllm_workers import VLLM, VllmWorkers, check_config
from loadtest.shedbench.workers import EngineSamples, sample, wait_idle


@dataclass
class VllmResults(Results):
    """A run on vLLM: also each engine's preemptions per cell and the machine's load."""

    # Per cell, in the order of ``cells``: the increase of each engine's
    # vllm:num_preemptions_total from just before its arrivals to after it drained.
    engine_preemptions: list[list[int]] = field(default_factory=list)
    # /proc/loadavg as read at the start and at the end of the run.
    proc_loadavg: list[str] = field(default_factory=list)


def proc_loadavg() -> str:
    return Path("/proc/loadavg").read_text().strip()


def preemption_deltas(before: Sequence[float], after: Sequence[float]) -> list[int]:
    """Each engine's preemptions between two reads of its counter. A counter that went down
    (the engine restarted) is an error: the cell's count would be wrong."""
    if len(before) != len(after):
        raise ValueError(f"preemption counters: {len(before)} engines before, {len(after)} after")
    deltas = []
    for i, (b, a) in enumerate(zip(before, after, strict=True)):
        if a < b:
            raise RuntimeError(
                f"engine {i + 1}: vllm:num_preemptions_total went down from {b:g} to {a:g} "
                "(restarted during the cell)"
            )
        deltas.append(round(a - b))
    return deltas


async def run(cfg: Config, stack: Stack, command: str, plan: RecoveryPlan | None) -> Results:
    started = time.monotonic()
    loadavg_text = [proc_loadavg()]
    engine_preemptions: list[list[int]] = []
    per_engine = getattr(stack.engines, "preemptions", None)
    load_average = [os.getloadavg()[0]]
    rng = random.Random(cfg.seed)
    connector = aiohttp.TCPConnector(limit=0, force_close=False)
    timeout = aiohttp.ClientTimeout(total=None, sock_connect=5)
    async with aiohttp.ClientSession(connector=connector, timeout=timeout) as session:
        stack.thresholds(False)
        # 1. unloaded: one request at a time
        unloaded = await measure_unloaded(session, stack, cfg, rng, full=3)
        log(f"unloaded: TTFT p50 {unloaded.ttft_p50_ms:.1f} ms p99 "
            f"{unloaded.ttft_p99_ms:.1f} ms, e2e p99 {unloaded.e2e_p99_ms:.0f} ms")  # fmt: skip
        await wait_idle(session, stack.engines)

        # 2. capacity: closed-loop sweep, thresholds off
        if cfg.capacity:
            sweep: list[dict[str, float]] = []
            knee = {"concurrency": 0, "completed_rps": cfg.capacity}
        else:
            sweep, knee = await sweep_capacity(session, stack, cfg, rng)
        capacity = knee["completed_rps"]
        log(
            f"capacity {capacity:.2f} req/s"
            + (f" at the knee c={knee['concurrency']:g}" if sweep else "")
        )

        # 3. the cells: open loop at multiples of capacity, thresholds off then on
        cells: list[Cell] = []
        for load in cfg.loads:
            for on in (False, True):
                stack.thresholds(on)
                rate = load * capacity
                before = await stack.engines.load(session)
                counters = await per_engine(session) if per_engine else []
                samples = EngineSamples()
                sampler = asyncio.create_task(
                    sample(session, stack.engines, cfg.cell_seconds, samples)
                )
                meter = CpuMeter({**stack.processes(), "client": [os.getpid()]})
                meter.start()
                # The same arrivals and bodies with thresholds off and on.
                arrivals = random.Random(f"{cfg.seed}-{load}")
                outcomes = await open_loop(session, stack.url, cfg, rate, arrivals)
                cpu = meter.stop()
                await sampler
                await wait_idle(session, stack.engines)
                after = await stack.engines.load(session)
                samples.preemptions = after.preemptions - before.preemptions
                if per_engine:
                    deltas = preemption_deltas(counters, await per_engine(session))
                    engine_preemptions.append(deltas)
                    samples.preemptions = sum(deltas)
                slo = 2 * unloaded.ttft_p99_ms / 1e3
                cell = summarize(cfg, load, on, rate, outcomes, samples, slo)
                cell.cpu = cpu
                cells.append(cell)
                log(
                    f"{load:g}x thresholds {'on ' if on else 'off'}: goodput "
                    f"{cell.goodput_rps:.2f}/s (SLO {cell.slo_goodput_rps:.2f}/s), TTFT p99 "
                    f"{cell.ttft_p99_ms:.0f} ms, e2e p99 "
                    f"{cell.e2e_p99_ms:.0f} ms, rejected {cell.rejection_rate:.0%}, "
                    f"preemptions {cell.preemptions}, waiting max {cell.waiting_max:.0f}"
                )

        # 4. recovery: overload phases, thresholds on, each followed by probes
        rounds = await measure_recovery(session, stack, cfg, plan, capacity) if plan else []
        stack.thresholds(False)
    results = Results(
        config=cfg,
        command=command,
        unloaded_ttft_p50_ms=unloaded.ttft_p50_ms,
        unloaded_ttft_p99_ms=unloaded.ttft_p99_ms,
        unloaded_e2e_p99_ms=unloaded.e2e_p99_ms,
        sweep=sweep,
        capacity_rps=capacity,
        knee_concurrency=int(knee["concurrency"]),
        cells=cells,
        seconds=time.monotonic() - started,
        load_average=[*load_average, os.getloadavg()[0]],
        recovery_plan=plan,
        recovery=rounds,
    )
    if cfg.engine != VLLM:
        return results
    return VllmResults(
        **vars(results),
        engine_preemptions=engine_preemptions,
        proc_loadavg=[*loadavg_text, proc_loadavg()],
    )


def vllm_markdown(res: VllmResults) -> str:
    """What a run on vLLM adds to the report: each engine's preemptions per cell, and the
    machine's load around the run."""
    rows = [
        "| offered load | thresholds | preemptions vllm-1 | preemptions vllm-2 | total |",
        "|---|---|---|---|---|",
    ]
    for cell, counts in zip(res.cells, res.engine_preemptions, strict=True):
        rows.append(
            f"| {cell.load:g}x | {'on' if cell.thresholds else 'off'} | "
            + " | ".join(str(n) for n in counts)
            + f" | {sum(counts)} |"
        )
    start, end = [*res.proc_loadavg, "?", "?"][:2]
    return f"""
### Preemptions on each engine

vLLM's own counter `vllm:num_preemptions_total`, read from each engine's `/metrics` just \
before a cell's arrivals began and again once both engines had drained after it: a \
preemption is a running request whose KV blocks vLLM freed to make room (it is put back \
to wait and its prompt computed again).

{chr(10).join(rows)}

### The machine

The machine is shared: other work ran on its {os.cpu_count()} cores during the run, and \
its speed varied with it. `/proc/loadavg` at the start of the run: `{start}`; at its end: \
`{end}`.
"""


# --- command line -----------------------------------------------------------------------------


def _threshold(text: str) -> float | None:
    return None if text.lower() in ("none", "off", "") else float(text)


def _tokens(text: str) -> int | None:
    return None if text.lower() in ("none", "off", "") else int(text)


# What a run on each engine uses unless a flag says otherwise. llama.cpp: two llama-server
# on a 2-core CPU run about 2 requests a second, so the requests are short, the cells fewer
# and the probes slower; docs/overload-llamacpp-results.md says why each value was chosen.
ENGINE_DEFAULTS: dict[str, dict[str, object]] = {
    SIM: {
        "kv_total_blocks": 640, "block_size": 16, "max_num_seqs": 48,
        "max_num_batched_tokens": 2048, "speedup": 2.0,
        "prompt_tokens": 512, "max_tokens": 128,
        "decode_threshold": 0.9, "prefill_threshold": None, "prefill_frac_threshold": 0.4,
        "loads": "0.5,1,2,3", "unloaded_probes": 201, "sweep_seconds": 14.0,
        "recovery_loads": ",".join(f"{x:g}" for x in RecoveryPlan().loads),
        "recovery_rounds": RecoveryPlan().rounds, "probe_rate": RecoveryPlan().probe_rate,
        "probe_seconds": RecoveryPlan().probe_seconds, "recovery_window": RecoveryPlan().window,
    },
    LLAMACPP: {
        # 1024 tokens of context (64 blocks of 16), 2 slots, llama-server's batch 512.
        "kv_total_blocks": 64, "block_size": 16, "max_num_seqs": 2,
        "max_num_batched_tokens": 512, "speedup": 1.0,
        "prompt_tokens": 32, "max_tokens": 32,
        # Busy above 12 blocks (two requests in the slots) or with a prompt being evaluated.
        "decode_threshold": 0.2, "prefill_threshold": 16, "prefill_frac_threshold": None,
        "loads": "1,3,10", "unloaded_probes": 41,
        # 14 s at about 1 req/s would count 8 completions: too coarse for a capacity.
        "sweep_seconds": 24.0,
        # No recovery rounds: a probe costs nearly a whole request here (the prompt is most
        # of the work), so probes often enough to time recovery are an overload of their own.
        "recovery_loads": "",
        "recovery_rounds": 1, "probe_rate": 1.0, "probe_seconds": 10.0, "recovery_window": 6,
    },
    VLLM: {
        # 7 blocks of 128 tokens (vLLM keeps one aside: 6 hold tokens, 768), 4 sequences.
        # A request is about 100 prompt tokens and 64 output ones: one block for its prompt,
        # a second as it decodes, so four admitted together outgrow the cache and vLLM
        # preempts. One request decodes at 15-20 tokens/s here, four together at nearly
        # that each.
        "kv_total_blocks": 7, "block_size": 128, "max_num_seqs": 4,
        "max_num_batched_tokens": 2048, "speedup": 1.0,
        "prompt_tokens": 32, "max_tokens": 64,
        # Busy above 3.5 blocks (three requests: the agent reports round(usage x 7)) or with
        # a request waiting (the agent reports waiting x the mean prompt, about 100 tokens).
        "decode_threshold": 0.5, "prefill_threshold": 64, "prefill_frac_threshold": None,
        "loads": "1,3,10", "unloaded_probes": 41, "sweep_seconds": 24.0,
        # No recovery rounds: the run is kept within about 10 minutes on this machine.
        "recovery_loads": "",
        "recovery_rounds": 1, "probe_rate": 1.0, "probe_seconds": 10.0, "recovery_window": 6,
    },
}  # fmt: skip


def _loads(flag: str, text: str, allow_none: bool = False) -> tuple[float, ...]:
    """Comma-separated multiples of capacity, each > 0."""
    parts = [x.strip() for x in text.split(",") if x.strip()]
    if not parts and not allow_none:
        raise ValueError(f"{flag}: {text!r} names no load; expected e.g. 1,3")
    loads: list[float] = []
    for part in parts:
        try:
            value = float(part)
        except ValueError:
            raise ValueError(f"{flag}: {part!r} is not a number; expected e.g. 1,3") from None
        if not value > 0:
            raise ValueError(f"{flag}: {part!r} is not a multiple of capacity above 0")
        loads.append(value)
    return tuple(loads)


def _by_engine(key: str) -> str:
    def shown(engine: str) -> str:
        value = ENGINE_DEFAULTS[engine][key]
        return f"{value if value != '' else repr(value)} on {engine}"

    return "default: " + ", ".join(shown(e) for e in ENGINE_DEFAULTS)


def parse_args(argv: Sequence[str] | None) -> tuple[Config, RecoveryPlan | None, Path]:
    p = argparse.ArgumentParser(
        prog="python -m loadtest.overload",
        description=__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    p.add_argument(
        "--engine",
        choices=(*ENGINES, VLLM),
        default=SIM,
        help="the workers: two simulated engines, two llama.cpp llama-server (make engine "
        "installs it) or two vLLM servers (make vllm), the real ones with their agents; the "
        "files are named overload-*, overload-llamacpp-* or overload-vllm-* "
        "(default: %(default)s)",
    )
    eng = p.add_argument_group(
        "workers (two, identical; on llamacpp the context is kv-total-blocks x block-size "
        "tokens over max-num-seqs slots; on vllm kv-total-blocks is "
        "--num-gpu-blocks-override and block-size must be 128)"
    )
    for flag, kind in (("--kv-total-blocks", int), ("--block-size", int),
                       ("--max-num-seqs", int), ("--max-num-batched-tokens", int),
                       ("--speedup", float)):  # fmt: skip
        eng.add_argument(flag, type=kind, help=_by_engine(flag[2:].replace("-", "_")))
    req = p.add_argument_group("requests (streaming chat completions)")
    req.add_argument("--prompt-tokens", type=int, help=_by_engine("prompt_tokens"))
    req.add_argument("--max-tokens", type=int, help=_by_engine("max_tokens"))
    thr = p.add_argument_group("thresholds 'on' ('none' leaves one off)")
    thr.add_argument("--decode-threshold", type=_threshold, help=_by_engine("decode_threshold"))
    thr.add_argument("--prefill-threshold", type=_tokens,
                     help="active_prefill_tokens_threshold, tokens; "
                     + _by_engine("prefill_threshold"))  # fmt: skip
    thr.add_argument("--prefill-frac-threshold", type=_threshold,
                     help=_by_engine("prefill_frac_threshold"))  # fmt: skip
    p.add_argument("--capacity", type=float, help="req/s: skip the sweep and use this")
    thr.add_argument(
        "--router-track-output-blocks",
        action=argparse.BooleanOptionalAction,
        default=True,
        help="start the extproc with --router-track-output-blocks and Envoy with "
        "envoy/envoy-track-output.yaml, which observes output tokens (default: yes; "
        "without: envoy/envoy.yaml)",
    )
    p.add_argument("--loads", help="multiples of capacity, comma-separated; " + _by_engine("loads"))
    p.add_argument("--unloaded-probes", type=int,
                   help="requests one at a time for the unloaded TTFT; "
                   + _by_engine("unloaded_probes"))  # fmt: skip
    p.add_argument("--cell-seconds", type=float, default=20.0)
    p.add_argument("--warmup", type=float, default=4.0)
    p.add_argument("--grace", type=float, default=5.0)
    p.add_argument("--sweep-seconds", type=float, help=_by_engine("sweep_seconds"))
    p.add_argument("--seed", type=int, default=1)
    p.add_argument("--out", default=str(ROOT / "docs"), help="folder for the table and plots")
    rec = p.add_argument_group("recovery after overload (thresholds on)")
    d = RecoveryPlan()
    rec.add_argument(
        "--recovery-loads",
        help="overload phases, multiples of capacity, comma-separated ('' = no recovery "
        "phase); " + _by_engine("recovery_loads"),
    )
    rec.add_argument("--recovery-rounds", type=int,
                     help="rounds per load; " + _by_engine("recovery_rounds"))  # fmt: skip
    rec.add_argument("--recovery-overload-seconds", type=float, default=d.overload_seconds,
                     help="length of each overload phase (default: %(default)s)")  # fmt: skip
    rec.add_argument("--probe-rate", type=float,
                     help="probes per second after it; " + _by_engine("probe_rate"))  # fmt: skip
    rec.add_argument("--probe-seconds", type=float,
                     help="how long the probes go on; " + _by_engine("probe_seconds"))  # fmt: skip
    rec.add_argument("--recovery-window", type=int,
                     help="probes in the sliding window of '95 %% admitted'; "
                     + _by_engine("recovery_window"))  # fmt: skip
    a = p.parse_args(argv)
    for key, value in ENGINE_DEFAULTS[a.engine].items():
        if getattr(a, key) is None:
            setattr(a, key, value)
    try:
        loads = _loads("--loads", a.loads)
        recovery_loads = _loads("--recovery-loads", a.recovery_loads, allow_none=True)
    except ValueError as exc:
        p.error(str(exc))
    for flag, value in (("--recovery-rounds", a.recovery_rounds),
                        ("--recovery-window", a.recovery_window)):  # fmt: skip
        if value < 1:
            p.error(f"{flag}: {value} is not a count of 1 or more")
    if a.unloaded_probes < 2:
        p.error(f"--unloaded-probes: {a.unloaded_probes} is not a count of 2 or more "
                "(the first is not counted)")  # fmt: skip
    for flag, value in (("--recovery-overload-seconds", a.recovery_overload_seconds),
                        ("--probe-rate", a.probe_rate),
                        ("--probe-seconds", a.probe_seconds)):  # fmt: skip
        if not value > 0:
            p.error(f"{flag}: {value:g} is not a positive number")
    if a.prefill_threshold is not None and a.prefill_threshold < 0:
        p.error(f"--prefill-threshold: {a.prefill_threshold} is not a token count >= 0")
    plan = RecoveryPlan(
        loads=recovery_loads,
        rounds=a.recovery_rounds,
        overload_seconds=a.recovery_overload_seconds,
        probe_rate=a.probe_rate,
        probe_seconds=a.probe_seconds,
        window=a.recovery_window,
    )
    if recovery_loads and plan.window > plan.probes:
        p.error(
            f"--recovery-window: {plan.window} probes do not fit in the {plan.probes} probes "
            f"of --probe-seconds {a.probe_seconds:g} at --probe-rate {a.probe_rate:g}"
        )
    cfg = Config(
        kv_total_blocks=a.kv_total_blocks,
        block_size=a.block_size,
        max_num_seqs=a.max_num_seqs,
        max_num_batched_tokens=a.max_num_batched_tokens,
        speedup=a.speedup,
        prompt_tokens=a.prompt_tokens,
        max_tokens=a.max_tokens,
        decode_threshold=a.decode_threshold,
        prefill_frac_threshold=a.prefill_frac_threshold,
        loads=loads,
        cell_seconds=a.cell_seconds,
        warmup=a.warmup,
        grace=a.grace,
        sweep_seconds=a.sweep_seconds,
        seed=a.seed,
        capacity=a.capacity,
        track_output_blocks=a.router_track_output_blocks,
        engine=a.engine,
        prefill_threshold=a.prefill_threshold,
        # A real model may end a reply before max_tokens; every request should cost the same.
        ignore_eos=a.engine != SIM,
        unloaded_probes=a.unloaded_probes,
    )
    if cfg.engine == VLLM:
        try:
            check_config(cfg)
        except ValueError as exc:
            p.error(str(exc))
    return cfg, plan if recovery_loads else None, Path(a.out)


@contextlib.contextmanager
def stack_for(cfg: Config) -> Iterator[Stack]:
    """The stack on the workers ``cfg.engine`` names, closed on the way out."""
    if cfg.engine != VLLM:
        with started_stack(cfg) as stack:
            yield stack
        return
    with tempfile.TemporaryDirectory(prefix="overload-vllm-") as tmp:
        stack = Stack(cfg, Path(tmp), workers=VllmWorkers)
        try:
            yield stack
        finally:
            stack.close()


def report(results: Results) -> str:
    text = markdown(results)
    if isinstance(results, VllmResults):
        text += vllm_markdown(results)
    return text


def main(argv: Sequence[str] | None = None) -> int:
    cfg, plan, out = parse_args(argv)
    command = shlex.join(["python", "-m", "loadtest.overload", *(argv or sys.argv[1:])])
    with stack_for(cfg) as stack:
        log(f"stack up: {stack.describe()}")
        results = asyncio.run(run(cfg, stack, command, plan))
    write_results(out, cfg.name, results, report(results), plot)
    return 0


if __name__ == "__main__":
    from loadtest import run_stoppable

    sys.exit(run_stoppable(main))
