"""Latency-target benchmark: does a TTFT p99 target hold by itself, with no threshold and
nothing tuned, through load phases and a worker that slows down, against the best fixed
thresholds a sweep finds?

Starts its own stack on free 127.0.0.1 ports (Envoy with the output-observing filter chain
and an access log, the extproc, two workers: simulated vLLM-like engines, or with
``--engine llamacpp`` two llama.cpp ``llama-server`` serving SmolLM2-135M on this CPU, each
with its agent), then:

1. **unloaded**: one request at a time, the reference TTFT; the target defaults to 4 x its
   p50 and at least 2 x its p99, rounded up to 10 ms (``--target-ms`` sets it);
2. **capacity at target**: the highest Poisson arrival rate whose TTFT p99 stays within the
   target with thresholds off and no target, by a search (doubling from
   ``--capacity-start`` while the target holds, then bisecting to 10 %; one probe of
   ``--capacity-seconds`` per rate, at most ``--capacity-probes``);
3. **the fixed-threshold sweep**: every ``--sweep`` candidate and the shipped thresholds on
   short overload phases (``--sweep-phases``); the one with the most SLO-good user requests
   is "the best fixed thresholds";
4. **modes**, one after the other, each over the same phases (``--phases``, default
   1x -> 3x -> 10x -> 1x of the capacity at target, seeded Poisson arrivals (each phase
   with the count its rate names) of clients
   that retry like the OpenAI SDK), one worker ``--slow-factor`` x slower in the middle of
   the 3x phase: the shipped thresholds (``--shipped``), the sweep's best, the target alone
   (``POST /busy_threshold`` with ``ttft_p99_target_ms`` and every threshold disabled),
   and thresholds off;
5. **classes** (unless ``--no-classes``): a second stack whose extproc has a classes file
   with a target per class, the target alone, the same 1x arrivals flat and with classes;
6. **TTFT sources**: the extproc's, the engines' and Envoy's TTFT against the clients'.

Writes ``slo-results.md``/``.json`` and one ``slo-<mode>.png`` per mode under ``--out``
(``slo-llamacpp-*`` on llama.cpp), and judges the target alone's goals (met, missed or not
tested).

    python -m loadtest.slo                         # ~12 minutes on 2 cores
    python -m loadtest.slo --engine llamacpp       # ~30 minutes
    python -m loadtest.slo --quick                 # every part, shortened: ~1.5 minutes
"""

from __future__ import annotations

import argparse
import asyncio
import json
import math
import random
import shlex
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass, replace
from pathlib import Path
from typing import Any

import aiohttp

from extproc.devstack import ROOT, Extproc, http, wait_until
from loadtest.shedbench.arrivals import given_count, open_loop
from loadtest.shedbench.capacity import (
    MIN_JUDGED,
    PROBE_STRETCH,
    RateProbe,
    judge_probe,
    measure_unloaded,
    probe_seconds,
    search_capacity,
)
from loadtest.shedbench.classes import Request
from loadtest.shedbench.config import LLAMACPP, MODEL, SIM, Config
from loadtest.shedbench.phases import Phase, PhasedRun, PhasePlan, run_phases
from loadtest.shedbench.results import log, write_results
from loadtest.shedbench.retry import OpenAIRetry
from loadtest.shedbench.slo_report import (
    OFF,
    SHIPPED,
    TARGET_ALONE,
    ClassesRun,
    ClassStats,
    SloResults,
    SweepRow,
    file_prefix,
    markdown,
    plot,
    total_slo_goodput,
)
from loadtest.shedbench.stack import THRESHOLDS, Stack
from loadtest.shedbench.stats import percentile
from loadtest.shedbench.ttft_sources import (
    AccessLines,
    access_log_tweak,
    compare,
    parse_access_log,
    split,
)
from loadtest.shedbench.windows import Mode, ModeResult, recovery_text, slo_good, summarize_run
from loadtest.shedbench.workers import Workers, wait_idle, workers_for

TARGET_FIELD = "ttft_p99_target_ms"
# Seconds to wait for a mode's lines in Envoy's access log: its file is written every 10 s.
ACCESS_LOG_WAIT = 12.0
VLLM = "vllm"
ENGINES = (SIM, LLAMACPP, VLLM)
# The default target, in multiples of the unloaded TTFT p50 (steadier than its p99 on a
# loaded machine): room for a worker twice as slow and a short queue; and at least this many
# times the unloaded p99, for an engine whose idle TTFT has a long tail (vLLM on 2 shared
# cores: p50 100 ms, p99 360 ms), or no rate would hold the target even idle.
TARGET_X_UNLOADED = 4
TARGET_X_UNLOADED_P99 = 2
# The classes of the classes run (docs/classes.md), each request drawn with these shares.
CLASS_MIX: tuple[tuple[str, float], ...] = (
    ("critical", 0.2),
    ("standard", 0.5),
    ("sheddable", 0.3),
)


def classes_yaml(target_ms: float) -> str:
    """The classes file of the classes run: a class's target is its deadline, critical and
    standard at the model's target, sheddable at twice it; every share 1 (no threshold is
    set in the target alone, so shares change nothing)."""
    return f"""\
default: standard
classes:
  critical:
    priority: 0
    share: 1.0
    ttft_p99_target_ms: {target_ms:g}
  standard:
    priority: 1
    share: 1.0
    ttft_p99_target_ms: {target_ms:g}
  sheddable:
    priority: 2
    share: 1.0
    ttft_p99_target_ms: {2 * target_ms:g}
"""


class BenchmarkError(RuntimeError):
    """The run cannot go on: the message says why and what to change."""


def set_mode(stack: Stack, mode: Mode) -> None:
    """The mode's thresholds and target with ``POST /busy_threshold``; what the mode does not
    set is disabled."""
    body: dict[str, Any] = {"model": MODEL}
    values = (mode.decode, None, mode.prefill_frac)  # no absolute prefill threshold
    body.update({n: v for n, v in zip(THRESHOLDS, values, strict=True) if v is not None})
    body["disable"] = [n for n, v in zip(THRESHOLDS, values, strict=True) if v is None]
    if mode.target_ms is not None:
        body[TARGET_FIELD] = mode.target_ms
    else:
        body["disable"].append(TARGET_FIELD)
    status, _, reply = http("POST", stack.ext.admin + "/busy_threshold", body)
    if status != 200:
        raise BenchmarkError(f"POST /busy_threshold {body} -> {status}: {reply.decode()[:300]}")


def read_access_log(path: Path, tag: str, expected: int) -> AccessLines:
    """The access log's lines of ``tag``, once ``expected`` attempts are there or after
    ``ACCESS_LOG_WAIT`` seconds with what there is (Envoy writes its file every 10 s, its
    ``--file-flush-interval-msec``, or sooner when its buffer fills)."""
    found: AccessLines = {}

    def complete() -> bool:
        nonlocal found
        found = parse_access_log(path.read_text() if path.exists() else "", tag)
        return len(found) >= expected

    try:
        wait_until(complete, ACCESS_LOG_WAIT, "the access log")
    except AssertionError:
        log(f"access log: {len(found)} of {expected} attempts of this mode")
    return found


def name_workers(run: PhasedRun, stack: Stack) -> None:
    """Attempts answered by an engine that does not name itself carry the upstream's
    host:port (``x-served-by``): the worker id it stands for."""
    ids = {
        f"127.0.0.1:{port}": wid
        for port, wid in zip(stack.engines.ports, stack.engines.ids, strict=True)
    }
    for req in run.requests:
        for attempt in req.attempts:
            attempt.worker = ids.get(attempt.worker, attempt.worker)


def write_attempts(path: Path, mode: str, run: PhasedRun, lines: AccessLines, append: bool) -> None:
    """Every attempt of one mode's run, one JSON object per line: ``mode``, ``request`` (its
    user request's number, ``x-bench-id``), ``class`` (its request class; empty: the
    default), ``attempt`` (0, 1, 2), ``arrival_s`` (from the
    run's start), ``status`` (0: no response), ``ttft_ms`` (from the attempt's start; None:
    no first token), ``cut_off`` (an admitted stream still open when the mode's run ended and
    cancelled then: a ``ttft_ms`` without a first token is the time it had waited so far),
    ``retry_after_ms`` and ``shed_reason`` (of a refusal), ``worker``; and
    from Envoy's access log, on each attempt's own line (by ``x-stainless-retry-count``):
    ``predicted_ms`` (``x-ttft-predicted-ms``) and ``worker_ms`` (to the first upstream body
    byte)."""
    with path.open("a" if append else "w", encoding="utf-8") as f:
        for number, req in enumerate(run.requests):
            for k, a in enumerate(req.attempts):
                row: dict[str, Any] = {
                    "mode": mode,
                    "request": number,
                    "class": req.cls,
                    "attempt": k,
                    "arrival_s": round(a.arrival, 4),
                    "status": a.status,
                    "ttft_ms": None if a.ttft is None else round(a.ttft * 1e3, 1),
                    "cut_off": a.status == 200 and not a.finished,
                    "retry_after_ms": a.retry_after_ms,
                    "shed_reason": a.shed_reason,
                    "worker": a.worker,
                }
                line = lines.get((number, k))
                if line is not None:
                    row["predicted_ms"] = line.predicted_ms
                    row["worker_ms"] = line.body_ms
                f.write(json.dumps(row) + "\n")


def code_version() -> str:
    """The commit the stack ran, and whether its code had uncommitted changes."""
    try:
        sha = subprocess.run(
            ["git", "-C", str(ROOT), "rev-parse", "--short", "HEAD"],
            capture_output=True, text=True, timeout=10, check=True,
        ).stdout.strip()  # fmt: skip
        changed = subprocess.run(
            ["git", "-C", str(ROOT), "status", "--porcelain", "--", "extproc", "llmworker",
             "loadtest", "envoy"],
            capture_output=True, text=True, timeout=10, check=True,
        ).stdout.split("\n")  # fmt: skip
    except (OSError, subprocess.SubprocessError):
        return "unknown (not a git checkout)"
    dirty = sorted({line[3:].split("/")[0] for line in changed if line.strip()})
    return sha + (f" with uncommitted changes in {', '.join(dirty)}" if dirty else " (clean)")


def load_average() -> str:
    """``/proc/loadavg`` as it reads now (the machine is shared: the run says how busy)."""
    try:
        return Path("/proc/loadavg").read_text().strip()
    except OSError:
        return "unknown"


@dataclass(frozen=True)
class Options:
    plan: PhasePlan
    sweep_plan: PhasePlan
    retry: OpenAIRetry
    shipped: tuple[float | None, float | None]
    sweep: tuple[tuple[float | None, float | None], ...]
    target_ms: float | None
    capacity_start: float
    capacity_seconds: float
    capacity_warmup: float
    capacity_probes: int
    classes: bool
    classes_seconds: float
    requests_out: Path | None = None  # every attempt of the modes' and classes runs, JSON lines


@dataclass
class Measured:
    """The first stack's part of the results."""

    unloaded_p50_ms: float
    unloaded_p99_ms: float
    target_ms: float
    capacity: float
    probes: list[RateProbe]
    search: str
    sweep: list[SweepRow]
    modes: list[ModeResult]
    best_fixed: str
    sources: list[dict[str, Any]]
    by_mode: dict[str, list[dict[str, Any]]]
    splits: dict[str, list[dict[str, Any]]]


def _session() -> aiohttp.ClientSession:
    connector = aiohttp.TCPConnector(limit=0)
    timeout = aiohttp.ClientTimeout(total=None, sock_connect=5)
    return aiohttp.ClientSession(connector=connector, timeout=timeout)


async def find_capacity(
    session: aiohttp.ClientSession, stack: Stack, cfg: Config, opts: Options, target_ms: float
) -> tuple[float, list[RateProbe], str]:
    """The capacity at target (see :func:`search_capacity`), thresholds off, no retries."""
    how = (
        f"from {opts.capacity_start:g} req/s doubling while the target holds, halving while "
        f"it does not (down to 1/8 of it), then bisecting to within 10 %; each rate one probe "
        f"of {opts.capacity_seconds:g} s of Poisson arrivals without retries (longer at a "
        f"low rate, for 35 requests after the warm-up, at most {PROBE_STRETCH} x as long), "
        f"with the count the rate names (rate x seconds, before and after the warm-up "
        f"apart, placed uniformly at random as a Poisson process places a given count), "
        f"judged on those "
        f"after its first {opts.capacity_warmup:g} s (none refused or failed, at least 20, "
        f"their TTFT p99 within target); the rate found probed again, with other "
        f"arrivals, until it held twice (one that does not hold becomes the upper bound and "
        f"the search goes on below it); at most {opts.capacity_probes} probes"
    )
    if cfg.capacity:
        return cfg.capacity, [], "given with --capacity"
    seq = 0

    async def probe(rate: float) -> RateProbe:
        nonlocal seq
        seq += 1
        rng = random.Random(f"{cfg.seed}-capacity-{seq}")
        seconds = probe_seconds(rate, opts.capacity_seconds, opts.capacity_warmup)
        times = given_count(rate, seconds, opts.capacity_warmup, rng)
        outs = await open_loop(session, stack.url, cfg, rate, rng, seconds, cfg.grace, None, times)
        await wait_idle(session, stack.engines, max(60.0, stack.engines.drain_timeout))
        result = judge_probe(rate, outs, opts.capacity_warmup, target_ms)
        log(f"capacity probe {rate:.2f} req/s: TTFT p99 {result.ttft_p99_ms:.0f} ms of "
            f"{result.requests}, {'holds' if result.within else 'does not hold'}")  # fmt: skip
        return result

    capacity, probes = await search_capacity(probe, opts.capacity_start, opts.capacity_probes)
    if capacity <= 0:
        short = [p for p in probes if p.requests < MIN_JUDGED and p.ttft_p99_ms <= target_ms]
        why = (
            f"; at {', '.join(f'{p.rate:.3g}' for p in short)} req/s the p99 was within it "
            f"but fewer than {MIN_JUDGED} requests were judged: give a longer "
            "--capacity-seconds"
            if short
            else ""
        )
        raise BenchmarkError(
            f"no Poisson rate down to {probes[-1].rate:.3g} req/s held a TTFT p99 of "
            f"{target_ms:g} ms with thresholds off (the lowest measured p99: "
            f"{min(p.ttft_p99_ms for p in probes):.0f} ms){why}; give a --target-ms the idle "
            "workers can meet, or a --capacity"
        )
    return capacity, probes, how


async def run_main(cfg: Config, stack: Stack, opts: Options, log_path: Path) -> Measured:
    rng = random.Random(cfg.seed)
    async with _session() as session:
        off = Mode(OFF, None, None)
        set_mode(stack, off)
        unloaded = await measure_unloaded(session, stack, cfg, rng)
        default = max(
            TARGET_X_UNLOADED * unloaded.ttft_p50_ms,
            TARGET_X_UNLOADED_P99 * unloaded.ttft_p99_ms,
        )
        target_ms = opts.target_ms or 10 * math.ceil(default / 10)
        log(f"unloaded: TTFT p50 {unloaded.ttft_p50_ms:.1f} ms, p99 {unloaded.ttft_p99_ms:.1f} "
            f"ms; target {target_ms:g} ms")  # fmt: skip
        await wait_idle(session, stack.engines, 30)
        capacity, probes, how = await find_capacity(session, stack, cfg, opts, target_ms)
        log(f"capacity at target {capacity:.2f} req/s")

        shipped = Mode(SHIPPED, *opts.shipped)
        sweep: list[SweepRow] = []
        best_sweep = shipped
        if opts.sweep:
            others = [(d, p) for d, p in opts.sweep if (d, p) != opts.shipped]
            candidates = [shipped] + [Mode(f"fixed {_g(d)}/{_g(p)}", d, p) for d, p in others]
            scored: list[tuple[int, Mode]] = []
            for i, mode in enumerate(candidates):
                set_mode(stack, mode)
                phased = await run_phases(
                    session, stack, cfg, opts.sweep_plan, capacity, opts.retry, f"s{i}-"
                )
                await wait_idle(session, stack.engines, max(60.0, stack.engines.drain_timeout))
                result = summarize_run(phased, opts.sweep_plan, mode, target_ms)
                good = round(total_slo_goodput(result))
                per_phase = [p.slo_goodput_rps for p in result.phases]
                sweep.append(SweepRow(mode.name, mode.decode, mode.prefill_frac, per_phase, good))
                scored.append((good, mode))
                log(f"sweep {mode.name}: {good} SLO-good user requests")
            best_sweep = max(scored, key=lambda s: s[0])[1]

        modes = [shipped] + ([best_sweep] if best_sweep is not shipped else [])
        modes += [Mode(TARGET_ALONE, None, None, target_ms=target_ms), off]
        set_mode(stack, modes[-2])  # an extproc that refuses a target fails now
        set_mode(stack, off)
        results: list[ModeResult] = []
        by_mode: dict[str, list[dict[str, Any]]] = {}
        splits: dict[str, list[dict[str, Any]]] = {}
        measured: list[tuple[PhasedRun, AccessLines]] = []
        # "off" runs last: the queue it leaves behind needs no draining.
        for i, mode in enumerate(modes):
            set_mode(stack, mode)
            tag = f"{i}-"
            phased = await run_phases(session, stack, cfg, opts.plan, capacity, opts.retry, tag)
            name_workers(phased, stack)
            if mode is not off:
                await wait_idle(session, stack.engines, max(60.0, stack.engines.drain_timeout))
            answered = sum(1 for r in phased.requests for a in r.attempts if a.status)
            lines = read_access_log(log_path, tag, answered)
            if opts.requests_out is not None:
                write_attempts(opts.requests_out, mode.name, phased, lines, append=i > 0)
            if mode is not off:  # its queue's TTFTs of seconds would drown the comparison
                measured.append((phased, lines))
            by_mode[mode.name] = [s.row() for s in compare([(phased, lines)])]
            splits[mode.name] = [asdict(s) for s in split(phased, lines, target_ms)]
            result = summarize_run(phased, opts.plan, mode, target_ms)
            results.append(result)
            log(f"{mode.name}: SLO goodput per phase "
                + " / ".join(f"{p.slo_goodput_rps:.1f}" for p in result.phases)
                + " req/s, windows within target "
                + " / ".join(f"{p.windows_within}/{p.windows_judged}" for p in result.phases)
                + ", recovery: "
                + recovery_text(result.recovery_s))  # fmt: skip
        set_mode(stack, off)
    fixed = [m for m in results if m.mode.name != OFF and m.mode.target_ms is None]
    best = max(fixed, key=total_slo_goodput)
    return Measured(
        unloaded_p50_ms=unloaded.ttft_p50_ms,
        unloaded_p99_ms=unloaded.ttft_p99_ms,
        target_ms=target_ms,
        capacity=capacity,
        probes=probes,
        search=how,
        sweep=sweep,
        modes=results,
        best_fixed=best.mode.name,
        sources=[s.row() for s in compare(measured)],
        by_mode=by_mode,
        splits=splits,
    )


def class_stats(reqs: list[Request], cls: str, seconds: float, target_ms: float) -> ClassStats:
    mine = [r for r in reqs if r.attempts and (cls == "all" or r.cls == cls)]
    ttfts = [t for r in mine if (t := r.user_ttft) is not None]
    return ClassStats(
        cls=cls,
        requests=len(mine),
        admitted_first=sum(1 for r in mine if r.attempts[0].status == 200),
        admitted=sum(1 for r in mine if r.admitted),
        slo_good=sum(1 for r in mine if slo_good(r, 0.0, seconds, target_ms / 1e3)),
        user_ttft_p99_ms=percentile(ttfts, 99) * 1e3,
    )


async def run_classes(
    cfg: Config,
    stack: Stack,
    opts: Options,
    capacity: float,
    target_ms: float,
    yaml: str,
    log_path: Path,
) -> ClassesRun:
    """The same 1x arrivals flat (no class header: the default class) and with classes;
    with ``--requests-out``, every attempt of both runs too (modes ``classes: flat`` and
    ``classes: mixed``)."""
    plan = PhasePlan(phases=(Phase(1.0, opts.classes_seconds),), slow_phase=0, slow_at=0.0,
                     slow_for=0.0)  # fmt: skip
    cells: dict[str, list[ClassStats]] = {}
    async with _session() as session:
        set_mode(stack, Mode(TARGET_ALONE, None, None, target_ms=target_ms))
        for i, (label, mix) in enumerate((("flat", ()), ("classes", CLASS_MIX))):
            phased = await run_phases(
                session, stack, cfg, plan, capacity, opts.retry, f"c{i}-", mix=mix
            )
            name_workers(phased, stack)
            await wait_idle(session, stack.engines, max(60.0, stack.engines.drain_timeout))
            if opts.requests_out is not None:
                tag = f"c{i}-"
                answered = sum(1 for r in phased.requests for a in r.attempts if a.status)
                lines = read_access_log(log_path, tag, answered)
                mode = "classes: mixed" if mix else "classes: flat"
                write_attempts(opts.requests_out, mode, phased, lines, append=True)
            names = ["all"] + ([n for n, _ in CLASS_MIX] if mix else [])
            cells[label] = [
                class_stats(phased.requests, n, opts.classes_seconds, target_ms) for n in names
            ]
            log(f"classes run, {label}: " + "; ".join(
                f"{c.cls} {c.admitted_first}/{c.requests} admitted first, {c.slo_good} SLO-good"
                for c in cells[label]))  # fmt: skip
    return ClassesRun(
        classes_yaml=yaml,
        mix=list(CLASS_MIX),
        load=1.0,
        seconds=opts.classes_seconds,
        flat=cells["flat"],
        classed=cells["classes"],
    )


def _g(value: float | None) -> str:
    return "off" if value is None else f"{value:g}"


# --- command line -----------------------------------------------------------------------------


def _pair(flag: str, text: str) -> tuple[float | None, float | None]:
    """``decode:prefill_frac``, each a number >= 0 or ``off``."""
    parts = text.split(":")
    if len(parts) != 2:
        raise ValueError(f"{flag}: {text!r} is not decode:prefill_frac, e.g. 0.7:0.3")
    out: list[float | None] = []
    for part in parts:
        if part.strip().lower() in ("off", "none"):
            out.append(None)
            continue
        try:
            value = float(part)
        except ValueError:
            raise ValueError(f"{flag}: {part!r} in {text!r} is not a number or 'off'") from None
        if not (math.isfinite(value) and value >= 0):
            raise ValueError(f"{flag}: {part!r} in {text!r} is not a number >= 0")
        out.append(value)
    return out[0], out[1]


def _phases(flag: str, text: str, shortest: float = 5.0) -> tuple[Phase, ...]:
    phases: list[Phase] = []
    for item in [x.strip() for x in text.split(",") if x.strip()]:
        load, _, seconds = item.partition(":")
        try:
            phase = Phase(float(load), float(seconds))
        except ValueError:
            raise ValueError(f"{flag}: {item!r} is not load:seconds, e.g. 3:30") from None
        if not (phase.load > 0 and phase.seconds >= shortest):
            raise ValueError(f"{flag}: {item!r} needs a load > 0 and at least {shortest:g} seconds")
        phases.append(phase)
    if not phases:
        raise ValueError(f"{flag}: {text!r} names no phase; expected e.g. 1:20,3:30")
    return tuple(phases)


# What a run on each engine uses unless a flag says otherwise. llama.cpp: two llama-server
# on 2 cores complete about 1.7 requests a second (docs/overload-llamacpp-results.md), so
# the requests are short and the phases twice as long, for as many requests per window;
# its thresholds are the overload benchmark's (2 requests in the slots, no prompt waiting:
# 16 tokens is 1/32 of the 512-token batch). vLLM on this CPU: 4 sequences per engine.
ENGINE_DEFAULTS: dict[str, dict[str, Any]] = {
    SIM: {
        "kv_total_blocks": 640, "block_size": 16, "max_num_seqs": 48,
        "max_num_batched_tokens": 2048, "speedup": 1.0, "prompt_tokens": 512,
        "max_tokens": 128, "phases": "1:15,3:30,10:15,1:15", "slow_at": 10.0,
        "slow_for": 10.0, "shipped": "0.9:0.4",
        "sweep": "0.5:0.25,0.7:0.25,0.7:0.4,1:0.4,1:0.8", "sweep_phases": "3:10,10:8",
        "unloaded_probes": 101, "capacity_start": 4.0, "capacity_seconds": 16.0,
        "capacity_warmup": 4.0, "capacity_probes": 10, "classes_seconds": 30.0,
    },
    LLAMACPP: {
        "kv_total_blocks": 64, "block_size": 16, "max_num_seqs": 2,
        "max_num_batched_tokens": 512, "speedup": 1.0, "prompt_tokens": 32,
        "max_tokens": 32, "phases": "1:30,3:60,10:30,1:30", "slow_at": 20.0,
        "slow_for": 20.0, "shipped": "0.2:0.03125", "sweep": "0.1:0.03125,0.3:0.0625",
        "sweep_phases": "3:20,10:15", "unloaded_probes": 41, "capacity_start": 0.5,
        "capacity_seconds": 40.0, "capacity_warmup": 8.0, "capacity_probes": 9,
        "classes_seconds": 60.0,
    },
    VLLM: {
        # The overload benchmark's shape: 7 blocks of 128 tokens, 4 sequences; busy above
        # 3.5 blocks or with a request's prompt waiting (64 of 2048 batched tokens).
        "kv_total_blocks": 7, "block_size": 128, "max_num_seqs": 4,
        "max_num_batched_tokens": 2048, "speedup": 1.0, "prompt_tokens": 32,
        "max_tokens": 64, "phases": "1:30,3:60,10:30,1:30", "slow_at": 20.0,
        # 101 unloaded requests: its idle TTFT has a long tail, and the p99 of 40 is their
        # largest, not a p99.
        "slow_for": 20.0, "shipped": "0.5:0.03125", "sweep": "0.3:0.03125,0.8:0.0625",
        "sweep_phases": "3:20,10:15", "unloaded_probes": 101, "capacity_start": 0.5,
        "capacity_seconds": 40.0, "capacity_warmup": 8.0, "capacity_probes": 9,
        "classes_seconds": 60.0,
    },
}  # fmt: skip
# --quick: every part of the run, shortened to a minute or two (a test of the report's
# shape, not of the goals: its phases are too short to judge them, no window is judged).
QUICK: dict[str, Any] = {
    "phases": "1:2,3:6,10:2,1:2", "slow_at": 1.0, "slow_for": 4.0, "sweep": "",
    "sweep_phases": "3:3", "unloaded_probes": 11, "capacity_seconds": 8.0,
    "capacity_warmup": 1.0, "capacity_probes": 3, "classes_seconds": 4.0, "grace": 2.0,
}  # fmt: skip


def _by_engine(key: str) -> str:
    values = ", ".join(f"{ENGINE_DEFAULTS[e][key]!r} on {e}" for e in ENGINES)
    return f"(default: {values})"


def parse_args(argv: Sequence[str] | None) -> tuple[Config, Options, Path]:
    p = argparse.ArgumentParser(
        prog="python -m loadtest.slo",
        description=__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    p.add_argument("--engine", choices=ENGINES, default=SIM,
                   help="the workers: two simulated engines, two llama.cpp llama-server or "
                   "two vLLM servers with their agents (make engine / make vllm install "
                   "them); the files are named slo-* or slo-<engine>-* "
                   "(default: %(default)s)")  # fmt: skip
    p.add_argument("--quick", action="store_true",
                   help="every part, shortened to a minute or two: phases "
                   f"{QUICK['phases']}, no threshold sweep, short probes (a test of the "
                   "report, too short to judge the goals)")  # fmt: skip
    eng = p.add_argument_group(
        "workers (two, identical; on llamacpp the context is "
        "kv-total-blocks x block-size tokens and max-num-seqs its slots)"
    )
    for flag, kind in (("--kv-total-blocks", int), ("--block-size", int),
                       ("--max-num-seqs", int), ("--max-num-batched-tokens", int),
                       ("--speedup", float)):  # fmt: skip
        eng.add_argument(flag, type=kind, help=_by_engine(flag[2:].replace("-", "_")))
    req = p.add_argument_group("requests (streaming chat completions)")
    req.add_argument("--prompt-tokens", type=int, help=_by_engine("prompt_tokens"))
    req.add_argument("--max-tokens", type=int, help=_by_engine("max_tokens"))
    req.add_argument("--max-retries", type=int, default=2,
                     help="retries per user request after its first attempt, as the OpenAI "
                     "SDK's max_retries (default: %(default)s)")  # fmt: skip
    cap = p.add_argument_group("capacity at target")
    cap.add_argument("--capacity", type=float, help="req/s: skip the search and use this")
    cap.add_argument("--capacity-start", type=float, help=_by_engine("capacity_start"))
    cap.add_argument("--capacity-seconds", type=float, help=_by_engine("capacity_seconds"))
    cap.add_argument(
        "--capacity-warmup",
        type=float,
        help="seconds of each probe not judged " + _by_engine("capacity_warmup"),
    )
    cap.add_argument("--capacity-probes", type=int, help=_by_engine("capacity_probes"))
    run = p.add_argument_group("phases and the slowdown")
    run.add_argument("--phases",
                     help="load:seconds per phase, load in multiples of the capacity at "
                     "target " + _by_engine("phases"))  # fmt: skip
    run.add_argument("--slow-phase", type=int, default=2,
                     help="the phase (1-based) in which a worker slows down "
                     "(default: 2)")  # fmt: skip
    run.add_argument("--slow-at", type=float,
                     help="seconds into that phase " + _by_engine("slow_at"))  # fmt: skip
    run.add_argument("--slow-for", type=float,
                     help="how long it stays slow " + _by_engine("slow_for"))  # fmt: skip
    run.add_argument("--slow-factor", type=float, default=2.0,
                     help="how many times slower (default: %(default)s; the simulated engine "
                     "takes that many times as long per step; a real engine is paused and "
                     "resumed on a 100-ms duty cycle)")  # fmt: skip
    mode = p.add_argument_group("modes")
    mode.add_argument("--shipped",
                      help="decode:prefill_frac thresholds of the 'shipped' mode "
                      + _by_engine("shipped")
                      + "; the overload benchmark's; the product ships with both off")  # fmt: skip
    mode.add_argument("--sweep",
                      help="fixed thresholds to try beside the shipped ones, decode:prefill_frac, "
                      "comma-separated ('' = none) " + _by_engine("sweep"))  # fmt: skip
    mode.add_argument(
        "--sweep-phases", help="load:seconds of the sweep's phases " + _by_engine("sweep_phases")
    )
    mode.add_argument("--target-ms", type=float,
                      help="the TTFT p99 target (default: 4 x the unloaded p50, at least 2 x "
                      "its p99)")  # fmt: skip
    mode.add_argument(
        "--classes",
        action=argparse.BooleanOptionalAction,
        default=True,
        help="run the classes at 1x on a second stack (default: on)",
    )
    mode.add_argument("--classes-seconds", type=float, help=_by_engine("classes_seconds"))
    p.add_argument("--unloaded-probes", type=int, help=_by_engine("unloaded_probes"))
    p.add_argument(
        "--grace", type=float, help="seconds the last streams get after the last phase (default: 5)"
    )
    p.add_argument("--seed", type=int, default=1)
    p.add_argument("--out", default=str(ROOT / "docs"), help="folder for the results and plots")
    p.add_argument("--requests-out", metavar="FILE",
                   help="also write every attempt of the modes' and the classes runs to "
                   "FILE, a JSON object per line (its mode, request, class, attempt, arrival, "
                   "status, TTFT, refusal, "
                   "worker, and the access log's prediction and worker time), to look into "
                   "a missed goal request by request")  # fmt: skip
    a = p.parse_args(argv)
    defaults = {**ENGINE_DEFAULTS[a.engine], "grace": 5.0, **(QUICK if a.quick else {})}
    for key, value in defaults.items():
        if getattr(a, key) is None:
            setattr(a, key, value)
    try:
        phases = _phases("--phases", a.phases, 1.0 if a.quick else 5.0)
        sweep_phases = _phases("--sweep-phases", a.sweep_phases, 1.0)
        shipped = _pair("--shipped", a.shipped)
        sweep = tuple(_pair("--sweep", x) for x in a.sweep.split(",") if x.strip())
    except ValueError as exc:
        p.error(str(exc))
    if not 1 <= a.slow_phase <= len(phases):
        p.error(f"--slow-phase: {a.slow_phase} is not a phase of 1 to {len(phases)}")
    slow = phases[a.slow_phase - 1]
    if not (a.slow_at >= 0 and a.slow_for > 0 and a.slow_at + a.slow_for <= slow.seconds):
        p.error(f"--slow-at {a.slow_at:g} --slow-for {a.slow_for:g}: the slowdown must fit "
                f"in phase {a.slow_phase} ({slow.seconds:g} s)")  # fmt: skip
    if not 1 <= a.slow_factor <= 100:
        p.error(f"--slow-factor: {a.slow_factor:g} is not a factor from 1 to 100")
    if a.target_ms is not None and not 0 < a.target_ms <= 600000:
        p.error(f"--target-ms: {a.target_ms:g} is not a number of ms in (0, 600000]")
    if a.unloaded_probes < 2:
        p.error(f"--unloaded-probes: {a.unloaded_probes} is not a count of 2 or more "
                "(the first is not counted)")  # fmt: skip
    if not 0 <= a.max_retries <= 10:
        p.error(f"--max-retries: {a.max_retries} is not a count from 0 to 10")
    if a.capacity_probes < 1:
        p.error(f"--capacity-probes: {a.capacity_probes} is not a count of 1 or more")
    if not 0 <= a.capacity_warmup < a.capacity_seconds:
        p.error(f"--capacity-warmup: {a.capacity_warmup:g} is not from 0 to below "
                f"--capacity-seconds {a.capacity_seconds:g}")  # fmt: skip
    for flag, value in (("--capacity", a.capacity), ("--grace", a.grace),
                        ("--capacity-start", a.capacity_start),
                        ("--classes-seconds", a.classes_seconds)):  # fmt: skip
        if value is not None and not (math.isfinite(value) and value > 0):
            p.error(f"{flag}: {value:g} is not a positive number")
    cfg = Config(
        kv_total_blocks=a.kv_total_blocks,
        block_size=a.block_size,
        max_num_seqs=a.max_num_seqs,
        max_num_batched_tokens=a.max_num_batched_tokens,
        speedup=a.speedup,
        prompt_tokens=a.prompt_tokens,
        max_tokens=a.max_tokens,
        decode_threshold=shipped[0],
        prefill_frac_threshold=shipped[1],
        loads=tuple(ph.load for ph in phases),
        cell_seconds=sum(ph.seconds for ph in phases),
        warmup=0.0,
        grace=a.grace,
        sweep_seconds=a.capacity_seconds,
        seed=a.seed,
        capacity=a.capacity,
        track_output_blocks=True,
        engine=a.engine,
        # A real model may end a reply before max_tokens; every request should cost the same.
        ignore_eos=a.engine != SIM,
        unloaded_probes=a.unloaded_probes,
    )
    plan = PhasePlan(
        phases=phases,
        slow_phase=a.slow_phase - 1,
        slow_at=a.slow_at,
        slow_for=a.slow_for,
        slow_factor=a.slow_factor,
    )
    opts = Options(
        plan=plan,
        sweep_plan=replace(plan, phases=sweep_phases, slow_phase=0, slow_at=0.0, slow_for=0.0),
        retry=OpenAIRetry(max_retries=a.max_retries),
        shipped=shipped,
        sweep=sweep,
        target_ms=a.target_ms,
        capacity_start=a.capacity_start,
        capacity_seconds=a.capacity_seconds,
        capacity_warmup=a.capacity_warmup,
        capacity_probes=a.capacity_probes,
        classes=a.classes,
        classes_seconds=a.classes_seconds,
        requests_out=Path(a.requests_out) if a.requests_out else None,
    )
    return cfg, opts, Path(a.out)


def workers_factory(cfg: Config) -> Callable[[Config, Extproc, Path], Workers]:
    """The workers ``cfg.engine`` names (vLLM's module is imported only for vLLM)."""
    if cfg.engine != VLLM:
        return workers_for
    from loadtest.shedbench.vllm_workers import VllmWorkers

    return VllmWorkers


def main(argv: Sequence[str] | None = None) -> int:
    cfg, opts, out = parse_args(argv)
    command = shlex.join(["python", "-m", "loadtest.slo", *(argv or sys.argv[1:])])
    started = time.monotonic()
    before = load_average()
    code = code_version()  # what runs: the checkout at the start
    classes: ClassesRun | None = None
    try:
        with tempfile.TemporaryDirectory(prefix="slo-") as tmp:
            log_path = Path(tmp) / "access.log"
            stack = Stack(
                cfg, Path(tmp), workers=workers_factory(cfg),
                envoy_tweak=access_log_tweak(str(log_path)),
            )  # fmt: skip
            try:
                log(f"stack up: {stack.describe()}")
                got = asyncio.run(run_main(cfg, stack, opts, log_path))
            finally:
                stack.close()
        if opts.classes:
            with tempfile.TemporaryDirectory(prefix="slo-classes-") as tmp:
                yaml = classes_yaml(got.target_ms)
                path = Path(tmp) / "classes.yaml"
                path.write_text(yaml)
                log_path = Path(tmp) / "access.log"
                stack = Stack(
                    cfg, Path(tmp), ["--classes-file", str(path)], workers_factory(cfg),
                    envoy_tweak=access_log_tweak(str(log_path)),
                )  # fmt: skip
                try:
                    log(f"classes stack up: {stack.describe()}")
                    classes = asyncio.run(
                        run_classes(cfg, stack, opts, got.capacity, got.target_ms, yaml, log_path)
                    )
                finally:
                    stack.close()
    except BenchmarkError as exc:
        print(f"python -m loadtest.slo: {exc}", file=sys.stderr)
        return 2
    results = SloResults(
        config=cfg,
        plan=opts.plan,
        retry=opts.retry,
        command=command,
        unloaded_ttft_p50_ms=got.unloaded_p50_ms,
        unloaded_ttft_p99_ms=got.unloaded_p99_ms,
        capacity_rps=got.capacity,
        target_ms=got.target_ms,
        modes=got.modes,
        best_fixed=got.best_fixed,
        capacity_probes=got.probes,
        capacity_search=got.search,
        sweep=got.sweep,
        sweep_plan=opts.sweep_plan if got.sweep else None,
        classes=classes,
        sources=got.sources,
        sources_by_mode=got.by_mode,
        splits=got.splits,
        seconds=time.monotonic() - started,
        load_average={"before": before, "after": load_average()},
        code=code,
    )
    write_results(out, file_prefix(cfg), results, markdown(results), plot)
    return 0


if __name__ == "__main__":
    from loadtest import run_stoppable

    sys.exit(run_stoppable(main))
