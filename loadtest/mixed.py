"""Overload with request classes: mixed traffic at 1x, 3x and 10x capacity, per class.

The stack is the overload benchmark's (``loadtest/shedbench/stack.py``: Envoy with the
repo's filter chain, the extproc with ``--router-track-output-blocks``, two simulated engines that
publish their load), with the extproc given a classes file (``--classes-file``; by default
the one below) and the busy thresholds on throughout. Traffic is a Poisson stream of the
same streaming chat completion; each request draws its class (``x-request-class``):
20 % critical, 50 % standard, 30 % sheddable. Then:

1. **unloaded**: one request at a time, the reference p99 TTFT;
2. **capacity**: the overload benchmark's closed-loop sweep (thresholds off), or
   ``--capacity``;
3. **cells**: each of ``--loads`` x capacity, once with clients that never retry and once
   with clients that retry a rejection (429, 503, 529) after ``Retry-After`` plus an
   exponential backoff with full jitter, at most ``--max-attempts`` attempts, the last no
   later than ``--grace`` / 2 seconds after the arrival window;
4. **flat**: the no-retry cells again at ``--flat-loads`` with every class at share 1
   (``POST /classes``): what the classes buy, on the same arrivals;
5. **critical alone**: for each load where critical traffic fits capacity, its critical
   requests alone (20 % of the rate): the critical TTFT without the other classes.

Per class and cell: requests that arrived after warm-up, the share admitted (first attempt
and in the end), attempts per request, TTFT p50/p99 of the admitted attempt (from that
attempt's start) and of the whole request (from its first attempt, backoff included), and
goodput and SLO goodput (2xx streams completed inside the window after warm-up; SLO: the
attempt's TTFT at most 2 x the unloaded p99). Every rejection's ``x-shed-class`` must be
the class the request sent, or the run fails. Writes ``classes-results.md``, ``.json`` and
two plots under ``--out``.

    python -m loadtest.mixed                          # about 6 minutes on 2 cores
    python -m loadtest.mixed --loads 3 --cell-seconds 8 --capacity 19.5   # a quick look
"""

from __future__ import annotations

import argparse
import asyncio
import random
import shlex
import sys
import tempfile
import time
from collections.abc import Sequence
from pathlib import Path

import aiohttp

from extproc.devstack import ROOT
from loadtest.shedbench.capacity import measure_unloaded, sweep_capacity
from loadtest.shedbench.classes import (
    ALONE,
    FLAT,
    MIX,
    NO_RETRY,
    RETRY,
    MixedCell,
    Retry,
    current_shares,
    mixed_loop,
    set_flat,
    summarize_classes,
)
from loadtest.shedbench.config import Config
from loadtest.shedbench.plots import class_plot
from loadtest.shedbench.report import MixedResults, class_markdown
from loadtest.shedbench.results import log, write_results
from loadtest.shedbench.stack import Stack, started_stack
from loadtest.shedbench.workers import wait_idle

DEFAULT_CLASSES = """\
# python -m loadtest.mixed's classes (docs/classes.md, "Choosing shares"). Below the
# critical limits, the lower classes leave a band that only critical requests may use:
# 35 % of the KV-block limit for standard, 50 % for sheddable. Their prefill share keeps
# floor(0.4 x 0.6 x 2048) = 491 tokens, under one 512-token prompt, so a critical prompt
# may still join a worker where one prompt is waiting, and nothing else may.
default: standard
classes:
  critical:
    priority: 0
    share: 1.0
  standard:
    priority: 1
    share:
      active_decode_blocks_threshold: 0.65
      active_prefill_tokens_threshold: 0.6
      active_prefill_tokens_threshold_frac: 0.6
  sheddable:
    priority: 2
    share:
      active_decode_blocks_threshold: 0.5
      active_prefill_tokens_threshold: 0.6
      active_prefill_tokens_threshold_frac: 0.6
"""


async def run(
    cfg: Config, retry: Retry, flat_loads: Sequence[float], stack: Stack, classes_yaml: str,
    command: str,
) -> MixedResults:  # fmt: skip
    started = time.monotonic()
    rng = random.Random(cfg.seed)
    connector = aiohttp.TCPConnector(limit=0, force_close=False)
    timeout = aiohttp.ClientTimeout(total=None, sock_connect=5)
    shares = current_shares(stack)
    async with aiohttp.ClientSession(connector=connector, timeout=timeout) as session:
        stack.thresholds(False)
        unloaded = await measure_unloaded(session, stack, cfg, rng)
        log(f"unloaded: TTFT p50 {unloaded.ttft_p50_ms:.1f} ms, "
            f"p99 {unloaded.ttft_p99_ms:.1f} ms")  # fmt: skip
        await wait_idle(session, stack.engines)
        capacity = (
            cfg.capacity or (await sweep_capacity(session, stack, cfg, rng))[1]["completed_rps"]
        )
        log(f"capacity {capacity:.2f} req/s")

        stack.thresholds(True)
        crit = dict(MIX)["critical"]
        plan = [(load, mode) for load in cfg.loads for mode in (NO_RETRY, RETRY)]
        plan += [(load, FLAT) for load in flat_loads]
        plan += [(load, ALONE) for load in cfg.loads if load * crit <= 1.0]
        cells: list[MixedCell] = []
        for load, mode in plan:
            set_flat(stack, mode == FLAT, shares)
            rate = load * capacity
            # The same arrivals in every mode; "critical alone" keeps only the critical ones'
            # rate (its own draws).
            arrivals = random.Random(f"{cfg.seed}-{load}")
            reqs = await mixed_loop(
                session, stack.url, cfg,
                rate * crit if mode == ALONE else rate,
                arrivals,
                retry if mode == RETRY else None,
                (("critical", 1.0),) if mode == ALONE else MIX,
            )  # fmt: skip
            await wait_idle(session, stack.engines)
            cell = summarize_classes(cfg, load, mode, rate, reqs, 2 * unloaded.ttft_p99_ms / 1e3)
            cells.append(cell)
            log(
                f"{load:g}x {mode}: SLO goodput {cell.slo_goodput_rps:.2f}/s; "
                + "; ".join(
                    f"{c.cls} admitted {c.admitted_ratio:.0%} TTFT p99 {c.ttft_p99_ms:.0f} ms "
                    f"{c.reasons}"
                    for c in cell.classes
                )
            )
            if cell.mismatched_class:
                raise RuntimeError(
                    f"{cell.mismatched_class} rejections named another class in x-shed-class"
                )
        set_flat(stack, False, shares)
        stack.thresholds(False)
    return MixedResults(
        config=cfg,
        retry=retry,
        classes_yaml=classes_yaml,
        command=command,
        unloaded_ttft_p50_ms=unloaded.ttft_p50_ms,
        unloaded_ttft_p99_ms=unloaded.ttft_p99_ms,
        capacity_rps=capacity,
        cells=cells,
        seconds=time.monotonic() - started,
    )


# --- command line ----------------------------------------------------------------------------


def parse_args(argv: Sequence[str] | None) -> tuple[Config, Retry, list[float], Path, Path | None]:
    p = argparse.ArgumentParser(
        prog="python -m loadtest.mixed",
        description=__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    p.add_argument("--classes-file", type=Path, help="YAML classes file (default: the one above)")
    p.add_argument("--loads", default="1,3,10", help="multiples of capacity, comma-separated")
    p.add_argument(
        "--flat-loads", default="3", help="loads to repeat with every class at share 1 ('' = none)"
    )
    p.add_argument("--capacity", type=float, help="req/s: skip the sweep and use this")
    p.add_argument("--cell-seconds", type=float, default=20.0)
    p.add_argument("--warmup", type=float, default=4.0)
    p.add_argument("--grace", type=float, default=6.0)
    p.add_argument("--sweep-seconds", type=float, default=14.0)
    p.add_argument("--max-attempts", type=int, default=Retry.max_attempts)
    p.add_argument("--backoff-base", type=float, default=Retry.base)
    p.add_argument("--backoff-cap", type=float, default=Retry.cap)
    p.add_argument("--decode-threshold", type=float, default=0.9)
    p.add_argument("--prefill-frac-threshold", type=float, default=0.4)
    p.add_argument("--seed", type=int, default=1)
    p.add_argument("--out", default=str(ROOT / "docs"), help="folder for the table and plots")
    a = p.parse_args(argv)
    if a.max_attempts < 1:
        p.error(f"--max-attempts: {a.max_attempts} is not a count of 1 or more")
    cfg = Config(
        kv_total_blocks=640,
        block_size=16,
        max_num_seqs=48,
        max_num_batched_tokens=2048,
        speedup=2.0,
        prompt_tokens=512,
        max_tokens=128,
        decode_threshold=a.decode_threshold,
        prefill_frac_threshold=a.prefill_frac_threshold,
        loads=tuple(float(x) for x in a.loads.split(",")),
        cell_seconds=a.cell_seconds,
        warmup=a.warmup,
        grace=a.grace,
        sweep_seconds=a.sweep_seconds,
        seed=a.seed,
        capacity=a.capacity,
        track_output_blocks=True,
    )
    retry = Retry(max_attempts=a.max_attempts, base=a.backoff_base, cap=a.backoff_cap)
    flat = [float(x) for x in a.flat_loads.split(",") if x.strip()]
    return cfg, retry, flat, Path(a.out), a.classes_file


def main(argv: Sequence[str] | None = None) -> int:
    cfg, retry, flat, out, classes_file = parse_args(argv)
    command = shlex.join(["python", "-m", "loadtest.mixed", *(argv or sys.argv[1:])])
    classes_yaml = classes_file.read_text() if classes_file else DEFAULT_CLASSES
    with tempfile.TemporaryDirectory(prefix="mixed-") as tmp:
        path = Path(tmp) / "classes.yaml"
        path.write_text(classes_yaml)
        with started_stack(cfg, ["--classes-file", str(path)]) as stack:
            log(f"stack up: {stack.describe()}")
            results = asyncio.run(run(cfg, retry, flat, stack, classes_yaml, command))
    write_results(out, "classes", results, class_markdown(results), class_plot)
    return 0


if __name__ == "__main__":
    from loadtest import run_stoppable

    sys.exit(run_stoppable(main))
