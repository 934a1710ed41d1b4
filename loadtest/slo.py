"""Latency-target benchmark: does a TTFT p99 target hold, with as much admitted as the best
fixed thresholds, through load phases and a worker that slows down?

Starts its own stack on free 127.0.0.1 ports (Envoy with the output-observing filter chain
and an access log, the extproc, two workers: simulated vLLM-like engines, or with
``--engine llamacpp`` two llama.cpp ``llama-server`` serving SmolLM2-135M on this CPU, each
with its agent), then:

1. **unloaded**: one request at a time, the reference TTFT; the target defaults to 4 x its
   p50, rounded up to 10 ms (``--target-ms`` sets it);
2. **capacity**: the closed-loop sweep of ``loadtest.overload``, thresholds off;
3. **modes**, one after the other, each over the same phases (``--phases``, default
   1x -> 3x -> 10x -> 1x of capacity, seeded Poisson arrivals of retrying clients), with
   one worker ``--slow-factor`` x slower in the middle of the 3x phase: thresholds
   off; the shipped thresholds (``--shipped``); every ``--sweep`` candidate (the best of
   these and the shipped ones is "the best fixed thresholds"); the target mode (the
   target set with ``POST /busy_threshold`` beside the shipped thresholds, its ceiling;
   ``--target-ceiling`` sets others), and on the simulated workers "target alone" (no
   threshold: the ceiling is a full worker);
4. **TTFT sources**: the extproc's, the engines' and Envoy's TTFT against the clients'.

Writes ``slo-results.md``/``.json`` and one ``slo-<mode>.png`` per mode under ``--out``
(``slo-llamacpp-*`` on llama.cpp).

    python -m loadtest.slo                                   # ~10 minutes on 2 cores
    python -m loadtest.slo --engine llamacpp                 # ~15 minutes
    python -m loadtest.slo --phases 1:10,3:20,10:10,1:10 --slow-at 5 --slow-for 8 \\
        --sweep '' --capacity 20                             # a quick look, ~2 minutes
"""

from __future__ import annotations

import argparse
import asyncio
import math
import random
import shlex
import sys
import tempfile
import time
from collections.abc import Sequence
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

import aiohttp

from extproc.devstack import ROOT, http, wait_until
from loadtest.shedbench.capacity import measure_unloaded, sweep_capacity
from loadtest.shedbench.classes import Retry
from loadtest.shedbench.config import ENGINES, LLAMACPP, MODEL, SIM, Config
from loadtest.shedbench.phases import Phase, PhasedRun, PhasePlan, run_phases
from loadtest.shedbench.results import log, write_results
from loadtest.shedbench.slo_report import (
    OFF,
    SHIPPED,
    TARGET,
    TARGET_ALONE,
    SloResults,
    file_prefix,
    markdown,
    plot,
    total_slo_goodput,
)
from loadtest.shedbench.stack import THRESHOLDS, Stack
from loadtest.shedbench.ttft_sources import (
    AccessLine,
    access_log_tweak,
    compare,
    parse_access_log,
    split,
)
from loadtest.shedbench.windows import Mode, ModeResult, recovery_text, summarize_run
from loadtest.shedbench.workers import wait_idle

TARGET_FIELD = "ttft_p99_target_ms"
# The default target, in multiples of the unloaded TTFT p50 (steadier than its p99 on a
# loaded machine): room for a worker twice as slow and a short queue, tighter than what the
# shipped thresholds hold when one worker slows down.
TARGET_X_UNLOADED = 4


class NoLatencyTarget(RuntimeError):
    """The extproc refused a latency target: a build without the controller."""


def set_mode(stack: Stack, mode: Mode, targets: bool) -> None:
    """The mode's thresholds and target with ``POST /busy_threshold``; ``targets``: the
    extproc knows latency targets (then one not in the mode is disabled)."""
    body: dict[str, Any] = {"model": MODEL}
    values = (mode.decode, None, mode.prefill_frac)  # no absolute prefill threshold
    body.update({n: v for n, v in zip(THRESHOLDS, values, strict=True) if v is not None})
    body["disable"] = [n for n, v in zip(THRESHOLDS, values, strict=True) if v is None]
    if mode.target_ms is not None:
        body[TARGET_FIELD] = mode.target_ms
    elif targets:
        body["disable"].append(TARGET_FIELD)
    status, _, reply = http("POST", stack.ext.admin + "/busy_threshold", body)
    if status == 422 and mode.target_ms is not None:
        raise NoLatencyTarget(
            f"the target mode needs an extproc with latency targets: POST /busy_threshold "
            f"{{{TARGET_FIELD!r}: {mode.target_ms:g}}} -> 422: {reply.decode()[:300]}; "
            "run without it with --no-target-mode"
        )
    if status != 200:
        raise RuntimeError(f"POST /busy_threshold {body} -> {status}: {reply!r}")


def read_access_log(path: Path, tag: str, expected: int) -> dict[int, AccessLine]:
    """The access log's lines of ``tag``, once ``expected`` are there (Envoy flushes every
    second) or after 5 s with what there is."""
    found: dict[int, AccessLine] = {}

    def complete() -> bool:
        nonlocal found
        found = parse_access_log(path.read_text() if path.exists() else "", tag)
        return len(found) >= expected

    try:
        wait_until(complete, 5, "the access log")
    except AssertionError:
        log(f"access log: {len(found)} of {expected} requests of this mode")
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


@dataclass(frozen=True)
class Options:
    plan: PhasePlan
    retry: Retry
    shipped: tuple[float | None, float | None]
    sweep: tuple[tuple[float | None, float | None], ...]
    target_ms: float | None
    target_mode: bool
    target_ceiling: tuple[float | None, float | None] = (None, None)
    target_alone: bool = False


async def run(cfg: Config, stack: Stack, opts: Options, log_path: Path, command: str) -> Any:
    started = time.monotonic()
    rng = random.Random(cfg.seed)
    connector = aiohttp.TCPConnector(limit=0)
    timeout = aiohttp.ClientTimeout(total=None, sock_connect=5)
    async with aiohttp.ClientSession(connector=connector, timeout=timeout) as session:
        off = Mode(OFF, None, None)
        set_mode(stack, off, targets=False)
        unloaded = await measure_unloaded(session, stack, cfg, rng)
        target_ms = opts.target_ms or 10 * math.ceil(TARGET_X_UNLOADED * unloaded.ttft_p50_ms / 10)
        log(f"unloaded: TTFT p50 {unloaded.ttft_p50_ms:.1f} ms, p99 {unloaded.ttft_p99_ms:.1f} "
            f"ms; target {target_ms:g} ms")  # fmt: skip
        await wait_idle(session, stack.engines, 30)
        sweep: list[dict[str, float]] = []
        if cfg.capacity:
            capacity = cfg.capacity
        else:
            sweep, knee = await sweep_capacity(session, stack, cfg, rng)
            capacity = knee["completed_rps"]
        log(f"capacity {capacity:.2f} req/s")

        modes = [off, Mode(SHIPPED, *opts.shipped)]
        modes += [Mode(f"fixed {_g(d)}/{_g(p)}", d, p) for d, p in opts.sweep]
        if opts.target_mode:
            modes.append(Mode(TARGET, *opts.target_ceiling, target_ms=target_ms))
            set_mode(stack, modes[-1], targets=True)  # fails now, not after the others
            if opts.target_alone:
                modes.append(Mode(TARGET_ALONE, None, None, target_ms=target_ms))
        results: list[ModeResult] = []
        by_mode: dict[str, list[dict[str, Any]]] = {}
        splits: dict[str, list[dict[str, Any]]] = {}
        measured: list[tuple[PhasedRun, dict[int, AccessLine]]] = []
        # "off" runs last: the queue it leaves behind (minutes of it on llama.cpp, whose
        # slots drop a request whose client left only as they take it) needs no draining.
        order = modes[1:] + modes[:1]
        for i, mode in enumerate(order):
            set_mode(stack, mode, targets=opts.target_mode)
            tag = f"{i}-"
            phased = await run_phases(session, stack, cfg, opts.plan, capacity, opts.retry, tag)
            name_workers(phased, stack)
            if mode is not off:
                await wait_idle(session, stack.engines, max(60.0, stack.engines.drain_timeout))
            answered = sum(1 for r in phased.requests if any(a.status for a in r.attempts))
            lines = read_access_log(log_path, tag, answered)
            if mode.name != OFF:  # its queue's TTFTs of seconds would drown the comparison
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
        set_mode(stack, off, targets=opts.target_mode)
    results.sort(key=lambda m: [x.name for x in modes].index(m.mode.name))
    fixed = [m for m in results if m.mode.name != OFF and m.mode.target_ms is None]
    best = max(fixed, key=total_slo_goodput)
    return SloResults(
        config=cfg,
        plan=opts.plan,
        retry=opts.retry,
        command=command,
        unloaded_ttft_p50_ms=unloaded.ttft_p50_ms,
        unloaded_ttft_p99_ms=unloaded.ttft_p99_ms,
        capacity_rps=capacity,
        sweep=sweep,
        target_ms=target_ms,
        modes=results,
        best_fixed=best.mode.name,
        sources=[s.row() for s in compare(measured)],
        sources_by_mode=by_mode,
        splits=splits,
        seconds=time.monotonic() - started,
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


def _phases(text: str) -> tuple[Phase, ...]:
    phases: list[Phase] = []
    for item in [x.strip() for x in text.split(",") if x.strip()]:
        load, _, seconds = item.partition(":")
        try:
            phase = Phase(float(load), float(seconds))
        except ValueError:
            raise ValueError(f"--phases: {item!r} is not load:seconds, e.g. 3:30") from None
        if not (phase.load > 0 and phase.seconds >= 5):
            raise ValueError(f"--phases: {item!r} needs a load > 0 and at least 5 seconds")
        phases.append(phase)
    if not phases:
        raise ValueError(f"--phases: {text!r} names no phase; expected e.g. 1:20,3:30")
    return tuple(phases)


# What a run on each engine uses unless a flag says otherwise. llama.cpp: two llama-server
# on 2 cores complete about 1.7 requests a second (docs/overload-llamacpp-results.md), so
# the requests are short and the phases twice as long, for as many requests per window as
# the controller and the 5-s windows can judge; the thresholds are the overload benchmark's
# (2 requests in the slots, no prompt waiting: 16 tokens is 1/32 of the 512-token batch).
ENGINE_DEFAULTS: dict[str, dict[str, Any]] = {
    SIM: {
        "kv_total_blocks": 640, "block_size": 16, "max_num_seqs": 48,
        "max_num_batched_tokens": 2048, "speedup": 1.0, "prompt_tokens": 512,
        "max_tokens": 128, "phases": "1:15,3:30,10:15,1:15", "slow_at": 10.0,
        "slow_for": 10.0, "shipped": "0.9:0.4", "sweep": "0.7:0.25,1:0.8",
        "target_ceiling": "0.9:0.4", "target_alone": True,
        "unloaded_probes": 201, "sweep_seconds": 14.0,
    },
    LLAMACPP: {
        "kv_total_blocks": 64, "block_size": 16, "max_num_seqs": 2,
        "max_num_batched_tokens": 512, "speedup": 1.0, "prompt_tokens": 32,
        "max_tokens": 32, "phases": "1:30,3:60,10:30,1:30", "slow_at": 20.0,
        "slow_for": 20.0, "shipped": "0.2:0.03125", "sweep": "0.1:0.03125,0.3:0.0625",
        "target_ceiling": "0.2:0.03125", "target_alone": False,
        "unloaded_probes": 41, "sweep_seconds": 24.0,
    },
}  # fmt: skip


def _by_engine(key: str) -> str:
    sim, llama = (ENGINE_DEFAULTS[e][key] for e in (SIM, LLAMACPP))
    return f"(default: {sim!r} on sim, {llama!r} on llamacpp)"


def parse_args(argv: Sequence[str] | None) -> tuple[Config, Options, Path]:
    p = argparse.ArgumentParser(
        prog="python -m loadtest.slo",
        description=__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    p.add_argument("--engine", choices=ENGINES, default=SIM,
                   help="the workers: two simulated engines, or two llama.cpp llama-server "
                   "with their agents (make engine installs it); the files are named slo-* "
                   "or slo-llamacpp-* (default: %(default)s)")  # fmt: skip
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
    req.add_argument("--max-attempts", type=int, default=3,
                     help="attempts per request, the first included "
                     "(default: %(default)s)")  # fmt: skip
    run = p.add_argument_group("phases and the slowdown")
    run.add_argument("--phases",
                     help="load:seconds per phase, load in multiples of capacity "
                     + _by_engine("phases"))  # fmt: skip
    run.add_argument("--slow-phase", type=int, default=2,
                     help="the phase (1-based) in which a worker slows down "
                     "(default: 2)")  # fmt: skip
    run.add_argument("--slow-at", type=float,
                     help="seconds into that phase " + _by_engine("slow_at"))  # fmt: skip
    run.add_argument("--slow-for", type=float,
                     help="how long it stays slow " + _by_engine("slow_for"))  # fmt: skip
    run.add_argument("--slow-factor", type=float, default=2.0,
                     help="how many times slower (default: %(default)s; llama.cpp: the "
                     "server is paused and resumed on a 100-ms duty cycle)")  # fmt: skip
    mode = p.add_argument_group("modes")
    mode.add_argument("--shipped",
                      help="decode:prefill_frac thresholds of the 'shipped' mode, also the "
                      "target mode's ceiling " + _by_engine("shipped")
                      + "; the overload benchmark's; the product ships with both off")  # fmt: skip
    mode.add_argument("--sweep",
                      help="more fixed thresholds to try, decode:prefill_frac, "
                      "comma-separated ('' = none) " + _by_engine("sweep"))  # fmt: skip
    mode.add_argument("--target-ceiling",
                      help="decode:prefill_frac thresholds configured beside the target in "
                      "the target mode, its ceiling; off:off = the target alone, whose "
                      "ceiling is a full worker " + _by_engine("target_ceiling"))  # fmt: skip
    mode.add_argument("--target-alone", action=argparse.BooleanOptionalAction,
                      help="also run the mode 'target alone': the target and no threshold, "
                      "its ceiling a full worker " + _by_engine("target_alone"))  # fmt: skip
    mode.add_argument("--target-ms", type=float,
                      help="the TTFT p99 target (default: 4 x the unloaded p50)")  # fmt: skip
    mode.add_argument("--no-target-mode", action="store_true",
                      help="skip the target mode (an extproc without latency targets)")  # fmt: skip
    p.add_argument("--unloaded-probes", type=int, help=_by_engine("unloaded_probes"))
    p.add_argument("--capacity", type=float, help="req/s: skip the sweep and use this")
    p.add_argument("--grace", type=float, default=5.0,
                   help="seconds the last streams get after the last phase")  # fmt: skip
    p.add_argument("--sweep-seconds", type=float, help=_by_engine("sweep_seconds"))
    p.add_argument("--seed", type=int, default=1)
    p.add_argument("--out", default=str(ROOT / "docs"), help="folder for the results and plots")
    a = p.parse_args(argv)
    for key, value in ENGINE_DEFAULTS[a.engine].items():
        if getattr(a, key) is None:
            setattr(a, key, value)
    try:
        phases = _phases(a.phases)
        shipped = _pair("--shipped", a.shipped)
        target_ceiling = _pair("--target-ceiling", a.target_ceiling)
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
    if a.max_attempts < 1:
        p.error(f"--max-attempts: {a.max_attempts} is not a count of 1 or more")
    for flag, value in (("--capacity", a.capacity), ("--grace", a.grace)):
        if value is not None and not value > 0:
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
        sweep_seconds=a.sweep_seconds,
        seed=a.seed,
        capacity=a.capacity,
        track_output_blocks=True,
        engine=a.engine,
        # A real model may end a reply before max_tokens; every request should cost the same.
        ignore_eos=a.engine == LLAMACPP,
        unloaded_probes=a.unloaded_probes,
    )
    plan = PhasePlan(
        phases=phases,
        slow_phase=a.slow_phase - 1,
        slow_at=a.slow_at,
        slow_for=a.slow_for,
        slow_factor=a.slow_factor,
    )
    retry = Retry(max_attempts=a.max_attempts)
    opts = Options(
        plan,
        retry,
        shipped,
        sweep,
        a.target_ms,
        not a.no_target_mode,
        target_ceiling,
        a.target_alone and not a.no_target_mode,
    )
    return cfg, opts, Path(a.out)


def main(argv: Sequence[str] | None = None) -> int:
    cfg, opts, out = parse_args(argv)
    command = shlex.join(["python", "-m", "loadtest.slo", *(argv or sys.argv[1:])])
    with tempfile.TemporaryDirectory(prefix="slo-") as tmp:
        log_path = Path(tmp) / "access.log"
        stack = Stack(cfg, Path(tmp), envoy_tweak=access_log_tweak(str(log_path)))
        try:
            log(f"stack up: {stack.describe()}")
            try:
                results = asyncio.run(run(cfg, stack, opts, log_path, command))
            except NoLatencyTarget as exc:
                print(f"python -m loadtest.slo: {exc}", file=sys.stderr)
                return 2
        finally:
            stack.close()
    write_results(out, file_prefix(cfg), results, markdown(results), plot)
    return 0


if __name__ == "__main__":
    sys.exit(main())
