"""Overload with request classes: mixed traffic at 1x, 3x and 10x capacity, per class.

The stack is the overload benchmark's (``loadtest/overload.py``: Envoy with the repo's
filter chain, the extproc with ``--router-track-output-blocks``, two simulated engines that
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
import itertools
import json
import math
import random
import shlex
import sys
import tempfile
import time
from collections import Counter
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import aiohttp

from extproc.devstack import ROOT, http
from loadtest import overload
from loadtest.overload import Config, Outcome, Stack, log, percentile, request_body, send

# name -> share of the traffic; the order is the priority order.
MIX: tuple[tuple[str, float], ...] = (("critical", 0.2), ("standard", 0.5), ("sheddable", 0.3))
ORDER = {name: i for i, (name, _) in enumerate(MIX)}
CLASS_HEADER = "x-request-class"
OVERLOAD_STATUSES = frozenset({429, 503, 529})

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


@dataclass(frozen=True)
class Retry:
    """How a retrying client waits: ``Retry-After`` plus a full-jitter exponential backoff."""

    max_attempts: int = 6
    base: float = 0.25  # seconds: the first backoff is uniform in [0, base]
    cap: float = 4.0

    def delay(self, attempt: int, retry_after: float | None, rng: random.Random) -> float:
        """Seconds before attempt ``attempt + 1`` (``attempt`` counts from 1)."""
        backoff = rng.uniform(0.0, min(self.cap, self.base * 2 ** (attempt - 1)))
        return (retry_after if retry_after is not None else 0.0) + backoff


@dataclass(slots=True)
class Request:
    """One logical request: its class, first arrival and every attempt."""

    cls: str
    arrival: float
    attempts: list[Outcome] = field(default_factory=list)

    @property
    def last(self) -> Outcome:
        return self.attempts[-1]

    @property
    def admitted(self) -> bool:
        return bool(self.attempts) and self.last.status == 200


async def mixed_loop(
    session: aiohttp.ClientSession,
    url: str,
    cfg: Config,
    rate: float,
    rng: random.Random,
    retry: Retry | None,
    mix: Sequence[tuple[str, float]] = MIX,
) -> list[Request]:
    """Poisson arrivals of ``mix`` at ``rate``/s; bounded by count and by time."""
    t0 = time.monotonic()
    window = cfg.cell_seconds
    last_retry = window + cfg.grace / 2
    limit = int(rate * window * 2) + 10  # a hard cap on the count, whatever the RNG draws
    names = [n for n, _ in mix]
    weights = [w for _, w in mix]
    jitter = random.Random(rng.random())
    requests: list[Request] = []
    tasks: list[asyncio.Task[None]] = []

    async def client(req: Request, body: bytes) -> None:
        headers = {CLASS_HEADER: req.cls}
        while True:
            out = Outcome(arrival=time.monotonic() - t0)
            req.attempts.append(out)
            await send(session, url, body, out, t0, headers)
            if retry is None or out.status not in OVERLOAD_STATUSES:
                return
            if len(req.attempts) >= retry.max_attempts:
                return
            delay = retry.delay(len(req.attempts), out.retry_after, jitter)
            if time.monotonic() - t0 + delay > last_retry:
                return
            await asyncio.sleep(delay)

    at = rng.expovariate(rate)
    while at < window and len(requests) < limit:
        delay = at - (time.monotonic() - t0)
        if delay > 0:
            await asyncio.sleep(delay)
        req = Request(cls=rng.choices(names, weights)[0], arrival=at)
        requests.append(req)
        tasks.append(asyncio.create_task(client(req, request_body(cfg, rng))))
        at += rng.expovariate(rate)
    remaining = window + cfg.grace - (time.monotonic() - t0)
    if tasks:
        await asyncio.wait(tasks, timeout=max(0.0, remaining))
    cutoff = time.monotonic() - t0
    for task in tasks:
        task.cancel()
    await asyncio.gather(*tasks, return_exceptions=True)
    for req in requests:
        out = req.last if req.attempts else None
        if out is not None and out.status == 200 and not out.finished:
            out.e2e = cutoff - out.arrival  # cancelled at the cut-off: censored
            if out.ttft is None:
                out.ttft = out.e2e
    return requests


# --- statistics ---------------------------------------------------------------------------


@dataclass
class ClassCell:
    """One class in one cell."""

    cls: str
    requests: int
    attempts: int
    admitted: int
    admitted_first: int
    gave_up: int
    errors: int
    admitted_ratio: float
    admitted_first_ratio: float
    attempt_rejection_rate: float
    ttft_p50_ms: float
    ttft_p99_ms: float
    ttft_from_arrival_p99_ms: float
    goodput_rps: float
    slo_goodput_rps: float
    reasons: dict[str, int]  # rejected attempts by x-shed-reason


NO_RETRY, RETRY, FLAT, ALONE = "no retry", "retry", "no retry, flat", "critical alone"


@dataclass
class MixedCell:
    """``mode``: clients that never retry or retry (classes as configured), ``flat``
    (no retry, every class at share 1), or ``critical alone`` (the critical requests of
    the load with nothing else: the reference for the critical TTFT)."""

    load: float
    mode: str
    offered_rps: float
    classes: list[ClassCell]
    goodput_rps: float
    slo_goodput_rps: float
    attempts_rps: float
    mismatched_class: int

    def of(self, cls: str) -> ClassCell:
        return next(c for c in self.classes if c.cls == cls)

    @property
    def classed(self) -> bool:
        """Mixed traffic under the configured classes."""
        return self.mode in (NO_RETRY, RETRY)


def summarize(
    cfg: Config, load: float, mode: str, rate: float, reqs: list[Request], slo_s: float
) -> MixedCell:
    span = cfg.cell_seconds - cfg.warmup
    per_class: list[ClassCell] = []
    for name in dict.fromkeys(r.cls for r in sorted(reqs, key=lambda r: ORDER[r.cls])):
        mine = [r for r in reqs if r.cls == name]
        window = [r for r in mine if r.arrival >= cfg.warmup and r.attempts]
        admitted = [r for r in window if r.admitted]
        attempts = [a for r in window for a in r.attempts]
        rejected_attempts = [a for a in attempts if a.status in OVERLOAD_STATUSES]
        ttfts = [r.last.ttft for r in admitted if r.last.ttft is not None]
        from_arrival = [
            r.last.arrival + r.last.ttft - r.arrival for r in admitted if r.last.ttft is not None
        ]
        done = [
            a
            for r in mine
            for a in r.attempts
            if a.finished and cfg.warmup <= a.arrival + (a.e2e or 0) <= cfg.cell_seconds
        ]
        per_class.append(
            ClassCell(
                cls=name,
                requests=len(window),
                attempts=len(attempts),
                admitted=len(admitted),
                admitted_first=sum(1 for r in window if r.attempts[0].status == 200),
                gave_up=sum(1 for r in window if r.last.status in OVERLOAD_STATUSES),
                errors=sum(1 for r in window if r.last.status not in OVERLOAD_STATUSES | {200}),
                admitted_ratio=len(admitted) / len(window) if window else math.nan,
                admitted_first_ratio=(
                    sum(1 for r in window if r.attempts[0].status == 200) / len(window)
                    if window
                    else math.nan
                ),
                attempt_rejection_rate=len(rejected_attempts) / len(attempts)
                if attempts
                else math.nan,
                ttft_p50_ms=percentile(ttfts, 50) * 1e3,
                ttft_p99_ms=percentile(ttfts, 99) * 1e3,
                ttft_from_arrival_p99_ms=percentile(from_arrival, 99) * 1e3,
                goodput_rps=len(done) / span,
                slo_goodput_rps=sum(1 for a in done if (a.ttft or 0) <= slo_s) / span,
                reasons=dict(Counter(a.shed_reason or "none" for a in rejected_attempts)),
            )
        )
    all_attempts = [a for r in reqs for a in r.attempts if a.arrival >= cfg.warmup]
    return MixedCell(
        load=load,
        mode=mode,
        offered_rps=rate,
        classes=per_class,
        goodput_rps=sum(c.goodput_rps for c in per_class),
        slo_goodput_rps=sum(c.slo_goodput_rps for c in per_class),
        attempts_rps=len([a for a in all_attempts if a.arrival <= cfg.cell_seconds]) / span,
        mismatched_class=sum(
            1
            for r in reqs
            for a in r.attempts
            if a.status in OVERLOAD_STATUSES and a.shed_class != r.cls
        ),
    )


# --- the run --------------------------------------------------------------------------------


@dataclass
class MixedResults:
    config: Config
    retry: Retry
    classes_yaml: str
    command: str
    unloaded_ttft_p50_ms: float
    unloaded_ttft_p99_ms: float
    capacity_rps: float
    cells: list[MixedCell]
    seconds: float


def set_flat(stack: Stack, flat: bool, shares: dict[str, Any]) -> None:
    """Every class at share 1 (``flat``), or back to the shares of the classes file."""
    for name, _ in MIX:
        body = {"name": name, "share": 1.0 if flat else shares[name]}
        status, _, reply = http("POST", stack.ext.admin + "/classes", body)
        if status != 200:
            raise RuntimeError(f"POST /classes {body} -> {status}: {reply!r}")


def current_shares(stack: Stack) -> dict[str, Any]:
    status, _, reply = http("GET", stack.ext.admin + "/classes")
    if status != 200:
        raise RuntimeError(f"GET /classes -> {status}: {reply!r}")
    listed = {c["name"]: c["share"] for c in json.loads(reply)["classes"]}
    missing = [n for n, _ in MIX if n not in listed]
    if missing:
        raise RuntimeError(f"the classes file has no class {missing[0]!r}; it needs {MIX}")
    return listed


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
        solo = [
            await overload.probe(session, stack.url, cfg, rng, 4)
            for _ in range(overload.UNLOADED_PROBES)
        ]
        if not all(o.finished for o in solo):
            raise RuntimeError("an unloaded request did not finish")
        unloaded_p50 = percentile([o.ttft or 0 for o in solo[1:]], 50) * 1e3
        unloaded_p99 = percentile([o.ttft or 0 for o in solo[1:]], 99) * 1e3
        log(f"unloaded: TTFT p50 {unloaded_p50:.1f} ms, p99 {unloaded_p99:.1f} ms")
        await overload.wait_idle(session, stack.sim_ports, 30)
        capacity = (
            cfg.capacity
            or (await overload.sweep_capacity(session, stack, cfg, rng))[1]["completed_rps"]
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
            await overload.wait_idle(session, stack.sim_ports, 30)
            cell = summarize(cfg, load, mode, rate, reqs, 2 * unloaded_p99 / 1e3)
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
        unloaded_ttft_p50_ms=unloaded_p50,
        unloaded_ttft_p99_ms=unloaded_p99,
        capacity_rps=capacity,
        cells=cells,
        seconds=time.monotonic() - started,
    )


# --- targets and report ----------------------------------------------------------------------


@dataclass
class Verdict:
    name: str
    met: bool
    detail: str


def targets(res: MixedResults) -> list[Verdict]:
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
        ordered = all(a <= b + 1e-9 for a, b in itertools.pairwise(rates))
        out.append(Verdict(
            f"{cell.load:g}x {cell.mode}: rejections critical <= standard <= sheddable",
            ordered,
            " / ".join(f"{r:.1%}" for r in rates),
        ))  # fmt: skip
    return out


def _ms(value: float) -> str:
    return "—" if math.isnan(value) else f"{value:,.0f}"


def _pct(value: float) -> str:
    return "—" if math.isnan(value) else f"{value:.1%}"


def markdown(res: MixedResults) -> str:
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
                f"{_pct(c.admitted_first_ratio)} | {_pct(c.admitted_ratio)} | "
                f"{_pct(c.attempt_rejection_rate)} | "
                f"{c.attempts / c.requests if c.requests else math.nan:.2f} | "
                f"{_ms(c.ttft_p50_ms)} / {_ms(c.ttft_p99_ms)} | "
                f"{_ms(c.ttft_from_arrival_p99_ms)} | {c.slo_goodput_rps:.2f} |"
            )
        rows.append(
            f"| {cell.load:g}x | {mode} | **all** | {sum(c.requests for c in cell.classes)} | "
            f"| | | {cell.attempts_rps:.1f} attempts/s | | | "
            f"**{cell.slo_goodput_rps:.2f}** (goodput {cell.goodput_rps:.2f}) |"
        )
    verdicts = "\n".join(
        f"- {v.name}: {v.detail}: {'met' if v.met else '**missed**'}" for v in targets(res)
    )
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
x offered <= 1):

{verdicts}

![admitted per class](classes-admitted.png)
![TTFT per class](classes-ttft.png)
"""


COLORS = {"critical": "tab:green", "standard": "tab:blue", "sheddable": "tab:orange"}


def _per_class(ax: Any, res: MixedResults, value: Callable[[ClassCell], float]) -> None:
    """One line per class and client kind (never retry, retrying) against the load."""
    modes = {NO_RETRY: ("no retry", "-", "o"), RETRY: ("retrying", "--", "s")}
    for mode, (label, style, marker) in modes.items():
        cells = sorted((c for c in res.cells if c.mode == mode), key=lambda c: c.load)
        for name, _ in MIX:
            ax.plot(
                [c.load for c in cells], [value(c.of(name)) for c in cells],
                marker=marker, linestyle=style, color=COLORS[name], label=f"{name}, {label}",
            )  # fmt: skip


def plot(res: MixedResults, out: Path) -> list[Path]:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    paths: list[Path] = []
    for name, title, ylabel, value in (
        ("classes-admitted.png", "Admitted per class against offered load",
         "requests admitted (%)", lambda c: 100 * c.admitted_ratio),
        ("classes-ttft.png", "TTFT p99 per class against offered load",
         "TTFT p99 of admitted requests (ms)", lambda c: c.ttft_p99_ms),
    ):  # fmt: skip
        fig, ax = plt.subplots(figsize=(6.4, 4.2))
        _per_class(ax, res, value)
        if name == "classes-admitted.png":
            ax.axhline(95, color="grey", linestyle=":", label="95 %")
            ax.set_ylim(0, 105)
        else:
            alone = sorted((c for c in res.cells if c.mode == ALONE), key=lambda c: c.load)
            if alone:
                ax.plot(
                    [c.load for c in alone], [c.of("critical").ttft_p99_ms for c in alone],
                    marker="^", linestyle=":", color="black", label="critical alone",
                )  # fmt: skip
            ax.axhline(1.5 * res.unloaded_ttft_p99_ms, color="grey", linestyle=":",
                       label="1.5 x unloaded p99")  # fmt: skip
            ax.set_ylim(bottom=0)
        ax.set_xscale("log")
        ax.set_xlabel("offered load (x capacity, log)")
        ax.set_ylabel(ylabel)
        ax.set_title(title)
        ax.grid(alpha=0.3, which="both")
        ax.legend(fontsize=7, ncol=2)
        fig.tight_layout()
        paths.append(out / name)
        fig.savefig(paths[-1], dpi=110)
        plt.close(fig)
    return paths


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
        with overload.started_stack(cfg, ["--classes-file", str(path)]) as stack:
            log(f"stack up: envoy {stack.envoy.url}, workers {stack.sim_ports}")
            results = asyncio.run(run(cfg, retry, flat, stack, classes_yaml, command))
    overload.write_results(out, "classes", results, markdown(results), plot)
    return 0


if __name__ == "__main__":
    sys.exit(main())
