"""Overload benchmark: goodput and latency against offered load, busy thresholds off and on.

Starts its own stack on free 127.0.0.1 ports (Envoy with the repo's filter chain, the
extproc, two simulated vLLM-like workers that publish their load), then:

1. **unloaded** — one request at a time: the reference p99 TTFT;
2. **capacity** — closed-loop sweep of concurrency with thresholds off; capacity is the
   completed req/s at the knee (the smallest concurrency within 5 % of the best);
3. **cells** — open-loop arrivals (Poisson, seeded) at ``--loads`` x capacity, each with
   thresholds off and on (set at run time with ``POST /busy_threshold``).

Every request is the same streaming chat completion. Per cell: goodput (2xx completed per
second inside the arrival window, after warm-up), p50/p99 TTFT and p99 end-to-end latency of
the accepted requests that arrived after warm-up, rejection rate, the workers' preemptions
(``vllm:num_preemptions_total``) and waiting queue (``vllm:num_requests_waiting``). Requests
still running ``--grace`` seconds after the window are cancelled and count at the cut-off
time (the percentile is then a lower bound, shown as ``>=``). Writes a markdown table, a JSON
file and two PNG plots under ``--out``.

    python -m loadtest.overload                      # ~4-5 minutes on 2 cores
    python -m loadtest.overload --loads 1,3 --cell-seconds 10   # quicker look
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import math
import random
import shlex
import sys
import tempfile
import time
from collections.abc import Callable, Iterator, Sequence
from dataclasses import asdict, dataclass, field
from functools import partial
from pathlib import Path
from typing import Any

import aiohttp

from extproc.devstack import (
    ROOT,
    Envoy,
    Extproc,
    SimProcess,
    checkout_file,
    cli_flags,
    free_port,
    http,
    metric_sums,
    wait_until,
)

MODEL = "overload-model"
THRESHOLDS = ("active_decode_blocks_threshold", "active_prefill_tokens_threshold_frac")


@dataclass(frozen=True)
class Config:
    """Everything that shapes a run; printed with the results."""

    kv_total_blocks: int
    block_size: int
    max_num_seqs: int
    max_num_batched_tokens: int
    speedup: float
    prompt_tokens: int
    max_tokens: int
    decode_threshold: float | None
    prefill_frac_threshold: float | None
    loads: tuple[float, ...]
    cell_seconds: float
    warmup: float
    grace: float
    sweep_seconds: float
    seed: int
    capacity: float | None = None
    track_output_blocks: bool = False


# --- the stack -----------------------------------------------------------------------


class Stack:
    """Envoy -> extproc -> two publishing simulated workers, all children of this process."""

    def __init__(self, cfg: Config, log_dir: Path, extproc_args: Sequence[str] = ()) -> None:
        self.cfg = cfg
        self.procs: list[SimProcess] = []
        args = ["--log-level", "WARNING", *extproc_args]
        if cfg.track_output_blocks:
            args.append("--router-track-output-blocks")
        self.ext = Extproc(log_dir, args)
        self.sim_ports: list[int] = []
        try:
            for i in (1, 2):
                port = free_port()
                self.procs.append(
                    SimProcess(self.sim_args(i, port), log_dir=log_dir, name=f"sim-{i}")
                )
                self.sim_ports.append(port)
            for sim, port in zip(self.procs, self.sim_ports, strict=True):
                wait_until(partial(sim.healthy, port), 20, f"simulated worker on :{port}")
            wait_until(lambda: len(self.ext.workers()) == 2, 15, "both workers announced")
            self.envoy = Envoy(log_dir, self.ext, self.sim_ports, source=self.envoy_config)
        except BaseException:
            self.close()
            raise

    def sim_args(self, i: int, port: int) -> list[str]:
        c = self.cfg
        return cli_flags(
            host="127.0.0.1",
            port=port,
            model=MODEL,
            worker_id=f"sim-{i}",
            publish=self.ext.event_endpoint,
            kv_total_blocks=c.kv_total_blocks,
            block_size=c.block_size,
            max_num_seqs=c.max_num_seqs,
            max_num_batched_tokens=c.max_num_batched_tokens,
            dp_size=1,
            speedup=c.speedup,
            log_level="WARNING",
        )

    @property
    def envoy_config(self) -> Path:
        """Output tokens are observed only with the observer config (docs/envoy.md)."""
        name = "envoy-track-output.yaml" if self.cfg.track_output_blocks else "envoy.yaml"
        return checkout_file(f"envoy/{name}")

    @property
    def url(self) -> str:
        return self.envoy.url + "/v1/chat/completions"

    def thresholds(self, on: bool) -> None:
        body: dict[str, Any] = {"model": MODEL}
        values = (self.cfg.decode_threshold, self.cfg.prefill_frac_threshold)
        body["disable"] = [
            n for n, v in zip(THRESHOLDS, values, strict=True) if not on or v is None
        ]
        if on:
            body.update({n: v for n, v in zip(THRESHOLDS, values, strict=True) if v is not None})
        status, _, reply = http("POST", self.ext.admin + "/busy_threshold", body)
        if status != 200:
            raise RuntimeError(f"POST /busy_threshold -> {status}: {reply!r}")

    def close(self) -> None:
        envoy = getattr(self, "envoy", None)
        if envoy is not None:
            envoy.stop()
        for proc in self.procs:
            proc.stop()
        self.ext.stop()


# --- one request ---------------------------------------------------------------------


@dataclass(slots=True)
class Outcome:
    """One request: times in seconds from the start of its cell."""

    arrival: float
    status: int = 0  # 0 = no response (connection error or cancelled before headers)
    ttft: float | None = None
    e2e: float | None = None
    finished: bool = False
    error: str = ""
    retry_after: float | None = None  # of a rejection, in seconds
    shed_class: str = ""  # x-shed-class of a rejection: the class the extproc decided on
    shed_reason: str = ""  # x-shed-reason of a rejection: the check that fired


def request_body(cfg: Config, rng: random.Random, max_tokens: int | None = None) -> bytes:
    # estimate_tokens counts ceil(UTF-8 bytes / 4): 4 bytes per prompt token.
    words = "".join(rng.choice("abcdefghij") for _ in range(3))
    text = ((words + " ") * cfg.prompt_tokens)[: 4 * cfg.prompt_tokens]
    return json.dumps(
        {
            "model": MODEL,
            "messages": [{"role": "user", "content": text}],
            "max_tokens": max_tokens or cfg.max_tokens,
            "stream": True,
        }
    ).encode()


async def send(
    session: aiohttp.ClientSession,
    url: str,
    body: bytes,
    out: Outcome,
    t0: float,
    headers: dict[str, str] | None = None,
) -> None:
    """POST one streaming chat; fill ``out`` as the response arrives."""
    headers = {"content-type": "application/json", **(headers or {})}
    try:
        async with session.post(url, data=body, headers=headers) as resp:
            out.status = resp.status
            if resp.status != 200:
                with contextlib.suppress(ValueError):
                    out.retry_after = float(resp.headers.get("retry-after", ""))
                out.shed_class = resp.headers.get("x-shed-class", "")
                out.shed_reason = resp.headers.get("x-shed-reason", "")
                await resp.read()
                out.e2e = time.monotonic() - t0 - out.arrival
                return
            async for chunk in resp.content.iter_any():
                if out.ttft is None and b"data:" in chunk:
                    out.ttft = time.monotonic() - t0 - out.arrival
                if chunk.endswith(b"data: [DONE]\n\n"):
                    break
            out.e2e = time.monotonic() - t0 - out.arrival
            out.finished = out.ttft is not None
    except aiohttp.ClientError as exc:
        out.error = type(exc).__name__


# --- load patterns ---------------------------------------------------------------------

UNLOADED_PROBES = 201  # the first pays for the connection and is not counted


async def probe(
    session: aiohttp.ClientSession,
    url: str,
    cfg: Config,
    rng: random.Random,
    max_tokens: int | None = None,
) -> Outcome:
    """One request on an idle stack."""
    out = Outcome(arrival=0.0)
    await asyncio.wait_for(
        send(session, url, request_body(cfg, rng, max_tokens), out, time.monotonic()), 30
    )
    return out


async def closed_loop(
    session: aiohttp.ClientSession,
    url: str,
    cfg: Config,
    concurrency: int,
    seconds: float,
    rng: random.Random,
    stagger: float = 0.0,
) -> list[Outcome]:
    """``concurrency`` clients back to back for ``seconds``; in-flight ones are cancelled.

    Client ``i`` starts ``i / concurrency * stagger`` seconds late, so that requests do not
    all finish in lockstep.
    """
    t0 = time.monotonic()
    outcomes: list[Outcome] = []

    async def client(i: int) -> None:
        await asyncio.sleep(i / concurrency * stagger)
        while time.monotonic() - t0 < seconds:
            out = Outcome(arrival=time.monotonic() - t0)
            outcomes.append(out)
            await send(session, url, request_body(cfg, rng), out, t0)

    tasks = [asyncio.create_task(client(i)) for i in range(concurrency)]
    await asyncio.wait(tasks, timeout=seconds)
    for task in tasks:
        task.cancel()
    await asyncio.gather(*tasks, return_exceptions=True)
    return outcomes


async def open_loop(
    session: aiohttp.ClientSession,
    url: str,
    cfg: Config,
    rate: float,
    rng: random.Random,
) -> list[Outcome]:
    """Poisson arrivals at ``rate``/s for the cell; bounded by count and by time."""
    t0 = time.monotonic()
    window = cfg.cell_seconds
    limit = int(rate * window * 2) + 10  # a hard cap on the count, whatever the RNG draws
    outcomes: list[Outcome] = []
    tasks: list[asyncio.Task[None]] = []
    at = rng.expovariate(rate)
    while at < window and len(outcomes) < limit:
        delay = at - (time.monotonic() - t0)
        if delay > 0:
            await asyncio.sleep(delay)
        out = Outcome(arrival=at)
        outcomes.append(out)
        tasks.append(asyncio.create_task(send(session, url, request_body(cfg, rng), out, t0)))
        at += rng.expovariate(rate)
    remaining = window + cfg.grace - (time.monotonic() - t0)
    if tasks:
        await asyncio.wait(tasks, timeout=max(0.0, remaining))
    cutoff = time.monotonic() - t0
    for task in tasks:
        task.cancel()
    await asyncio.gather(*tasks, return_exceptions=True)
    for out in outcomes:
        if out.status == 200 and not out.finished:
            # Cancelled at the cut-off: censored at the time it had waited so far.
            out.e2e = cutoff - out.arrival
            if out.ttft is None:
                out.ttft = out.e2e
    return outcomes


# --- the workers' view -------------------------------------------------------------------


@dataclass
class SimSamples:
    """Queue samples taken while a cell runs, and the preemption counter around it."""

    waiting: list[float] = field(default_factory=list)
    running: list[float] = field(default_factory=list)
    kv_usage: list[float] = field(default_factory=list)
    preemptions: float = 0.0


async def scrape(session: aiohttp.ClientSession, ports: Sequence[int]) -> dict[str, float]:
    total: dict[str, float] = {}
    for port in ports:
        async with session.get(f"http://127.0.0.1:{port}/metrics") as resp:
            for name, value in metric_sums(await resp.text()).items():
                total[name] = total.get(name, 0.0) + value
    return total


async def sample_sims(
    session: aiohttp.ClientSession, ports: Sequence[int], seconds: float, samples: SimSamples
) -> None:
    deadline = time.monotonic() + seconds
    while time.monotonic() < deadline:
        m = await scrape(session, ports)
        samples.waiting.append(m.get("vllm:num_requests_waiting", 0.0))
        samples.running.append(m.get("vllm:num_requests_running", 0.0))
        samples.kv_usage.append(m.get("vllm:kv_cache_usage_perc", 0.0) / len(ports))
        await asyncio.sleep(0.25)


async def wait_idle(session: aiohttp.ClientSession, ports: Sequence[int], timeout: float) -> None:
    """Until both engines have nothing running or waiting (cancelled streams abort)."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        m = await scrape(session, ports)
        if m.get("vllm:num_requests_running", 0) + m.get("vllm:num_requests_waiting", 0) == 0:
            return
        await asyncio.sleep(0.1)
    raise RuntimeError(f"the simulated workers did not drain within {timeout:.0f} s")


# --- statistics --------------------------------------------------------------------------


def percentile(values: Sequence[float], q: float) -> float:
    """Nearest-rank percentile (q in 0-100); NaN for no values."""
    if not values:
        return math.nan
    ordered = sorted(values)
    rank = max(1, math.ceil(q / 100 * len(ordered)))
    return ordered[rank - 1]


@dataclass
class Cell:
    """The measured numbers of one offered load and threshold setting."""

    load: float
    thresholds: bool
    offered_rps: float
    sent_rps: float
    sent: int
    accepted: int
    rejected: int
    errors: int
    unfinished: int
    goodput_rps: float
    slo_goodput_rps: float
    ttft_p50_ms: float
    ttft_p99_ms: float
    e2e_p99_ms: float
    censored_p99: bool
    rejection_rate: float
    preemptions: int
    waiting_max: float
    waiting_mean: float
    kv_usage_mean: float


def summarize(
    cfg: Config,
    load: float,
    on: bool,
    rate: float,
    outcomes: list[Outcome],
    samples: SimSamples,
    ttft_slo_s: float,
    overload_status: int = 529,
) -> Cell:
    """The cell's numbers; ``ttft_slo_s`` is the TTFT that counts into the SLO goodput."""
    window = [o for o in outcomes if o.arrival >= cfg.warmup]
    accepted = [o for o in window if o.status == 200]
    rejected = [o for o in window if o.status == overload_status]
    done = [o for o in outcomes if o.finished and cfg.warmup <= o.arrival + (o.e2e or 0)]
    done_in_window = [o for o in done if o.arrival + (o.e2e or 0) <= cfg.cell_seconds]
    unfinished = [o for o in accepted if not o.finished]
    ttfts = [o.ttft for o in accepted if o.ttft is not None]
    e2es = [o.e2e for o in accepted if o.e2e is not None]
    e2e_p99 = percentile(e2es, 99)
    return Cell(
        load=load,
        thresholds=on,
        offered_rps=rate,
        sent_rps=len(window) / (cfg.cell_seconds - cfg.warmup),
        sent=len(window),
        accepted=len(accepted),
        rejected=len(rejected),
        errors=len(window) - len(accepted) - len(rejected),
        unfinished=len(unfinished),
        goodput_rps=len(done_in_window) / (cfg.cell_seconds - cfg.warmup),
        slo_goodput_rps=sum(1 for o in done_in_window if (o.ttft or 0) <= ttft_slo_s)
        / (cfg.cell_seconds - cfg.warmup),
        ttft_p50_ms=percentile(ttfts, 50) * 1e3,
        ttft_p99_ms=percentile(ttfts, 99) * 1e3,
        e2e_p99_ms=e2e_p99 * 1e3,
        censored_p99=bool(unfinished) and any((o.e2e or 0) >= e2e_p99 for o in unfinished),
        rejection_rate=len(rejected) / len(window) if window else 0.0,
        preemptions=int(samples.preemptions),
        waiting_max=max(samples.waiting, default=0.0),
        waiting_mean=sum(samples.waiting) / len(samples.waiting) if samples.waiting else 0.0,
        kv_usage_mean=sum(samples.kv_usage) / len(samples.kv_usage) if samples.kv_usage else 0.0,
    )


# --- the run ------------------------------------------------------------------------------


@dataclass
class Results:
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

    def loads_present(self) -> list[float]:
        return sorted({c.load for c in self.cells})


def log(msg: str) -> None:
    print(f"[{time.strftime('%H:%M:%S')}] {msg}", file=sys.stderr, flush=True)


async def run(cfg: Config, stack: Stack, command: str) -> Results:
    started = time.monotonic()
    rng = random.Random(cfg.seed)
    connector = aiohttp.TCPConnector(limit=0, force_close=False)
    timeout = aiohttp.ClientTimeout(total=None, sock_connect=5)
    async with aiohttp.ClientSession(connector=connector, timeout=timeout) as session:
        stack.thresholds(False)
        # 1. unloaded: one request at a time (TTFT does not depend on max_tokens here)
        solo = [await probe(session, stack.url, cfg, rng, 4) for _ in range(UNLOADED_PROBES)]
        full = [await probe(session, stack.url, cfg, rng) for _ in range(3)]
        if not all(o.finished for o in solo + full):
            raise RuntimeError("an unloaded request did not finish")
        unloaded_p50 = percentile([o.ttft or 0 for o in solo[1:]], 50) * 1e3
        unloaded_p99 = percentile([o.ttft or 0 for o in solo[1:]], 99) * 1e3
        unloaded_e2e = percentile([o.e2e or 0 for o in full], 99) * 1e3
        log(f"unloaded: {len(solo)} requests, TTFT p50 {unloaded_p50:.1f} ms p99 "
            f"{unloaded_p99:.1f} ms, e2e p99 {unloaded_e2e:.0f} ms")  # fmt: skip
        await wait_idle(session, stack.sim_ports, 30)

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
                before = await scrape(session, stack.sim_ports)
                samples = SimSamples()
                sampler = asyncio.create_task(
                    sample_sims(session, stack.sim_ports, cfg.cell_seconds, samples)
                )
                # The same arrivals and bodies with thresholds off and on.
                arrivals = random.Random(f"{cfg.seed}-{load}")
                outcomes = await open_loop(session, stack.url, cfg, rate, arrivals)
                await sampler
                await wait_idle(session, stack.sim_ports, 30)
                after = await scrape(session, stack.sim_ports)
                key = "vllm:num_preemptions_total"
                samples.preemptions = after.get(key, 0) - before.get(key, 0)
                cell = summarize(cfg, load, on, rate, outcomes, samples, 2 * unloaded_p99 / 1e3)
                cells.append(cell)
                log(
                    f"{load:g}x thresholds {'on ' if on else 'off'}: goodput "
                    f"{cell.goodput_rps:.2f}/s (SLO {cell.slo_goodput_rps:.2f}/s), TTFT p99 "
                    f"{cell.ttft_p99_ms:.0f} ms, e2e p99 "
                    f"{cell.e2e_p99_ms:.0f} ms, rejected {cell.rejection_rate:.0%}, "
                    f"preemptions {cell.preemptions}, waiting max {cell.waiting_max:.0f}"
                )
        stack.thresholds(False)
    return Results(
        config=cfg,
        command=command,
        unloaded_ttft_p50_ms=unloaded_p50,
        unloaded_ttft_p99_ms=unloaded_p99,
        unloaded_e2e_p99_ms=unloaded_e2e,
        sweep=sweep,
        capacity_rps=capacity,
        knee_concurrency=int(knee["concurrency"]),
        cells=cells,
        seconds=time.monotonic() - started,
    )


async def sweep_capacity(
    session: aiohttp.ClientSession, stack: Stack, cfg: Config, rng: random.Random
) -> tuple[list[dict[str, float]], dict[str, float]]:
    """Closed loop at each of :func:`sweep_levels` (thresholds as they are): every level's
    completed req/s, and the knee (the smallest concurrency within 5 % of the best)."""
    sweep: list[dict[str, float]] = []
    for concurrency in sweep_levels(cfg):
        outcomes = await closed_loop(
            session, stack.url, cfg, concurrency, cfg.sweep_seconds, rng, stagger=1.0
        )
        warm = cfg.sweep_seconds * 0.4  # the engine fills up, then preempts: skip that
        done = [o for o in outcomes if o.finished and o.arrival + (o.e2e or 0) >= warm]
        rps = len(done) / (cfg.sweep_seconds - warm)
        sweep.append({"concurrency": concurrency, "completed_rps": rps})
        log(f"sweep c={concurrency}: {rps:.2f} completed req/s")
        await wait_idle(session, stack.sim_ports, 30)
    best = max(s["completed_rps"] for s in sweep)
    return sweep, next(s for s in sweep if s["completed_rps"] >= 0.95 * best)


def sweep_levels(cfg: Config) -> list[int]:
    """Concurrencies around what the two KV caches hold at full length."""
    blocks_per_seq = math.ceil((cfg.prompt_tokens + cfg.max_tokens) / cfg.block_size)
    fits = 2 * max(1, cfg.kv_total_blocks // blocks_per_seq)
    levels = {max(1, round(fits * f)) for f in (1.0, 2.0, 3.0)}
    return sorted(levels)


# --- report --------------------------------------------------------------------------------


def _fmt_ms(value: float, censored: bool = False) -> str:
    if math.isnan(value):
        return "—"
    return (">= " if censored else "") + f"{value:,.0f}"


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
            f"{c.goodput_rps:.2f} | {c.slo_goodput_rps:.2f} | {_fmt_ms(c.ttft_p50_ms)} | "
            f"{_fmt_ms(c.ttft_p99_ms, c.censored_p99)} | "
            f"{_fmt_ms(c.e2e_p99_ms, c.censored_p99)} | {c.rejection_rate:.0%} | "
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
    return f"""## Overload: goodput and latency against offered load

Command (took {res.seconds:.0f} s):

```sh
{res.command}
```

Workers: 2 simulated engines, each `--kv-total-blocks {cfg.kv_total_blocks} --block-size \
{cfg.block_size} --max-num-seqs {cfg.max_num_seqs} --max-num-batched-tokens \
{cfg.max_num_batched_tokens} --speedup {cfg.speedup:g}`. Every request is a streaming chat \
completion of {cfg.prompt_tokens} prompt tokens and `max_tokens` {cfg.max_tokens}. Thresholds \
"on": `active_decode_blocks_threshold` {cfg.decode_threshold}, \
`active_prefill_tokens_threshold_frac` {cfg.prefill_frac_threshold} (set with \
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
(529) / requests sent. Preemptions: increase of `vllm:num_preemptions_total` over both workers \
during the cell; waiting: `vllm:num_requests_waiting` of both workers, sampled every 0.25 s.

{verdict}

![goodput](overload-goodput.png)
![latency](overload-latency.png)
"""


def _cell(res: Results, load: float, on: bool) -> Cell | None:
    return next((c for c in res.cells if c.load == load and c.thresholds == on), None)


def targets(res: Results) -> str:
    top = max(res.loads_present())
    on, off = _cell(res, top, True), _cell(res, top, False)
    peak = _cell(res, 1.0, True) or _cell(res, 1.0, False)
    if on is None or off is None or peak is None:
        return "Targets: not evaluated (need the 1x cells and the highest load on and off)."
    peak_goodput = max(c.goodput_rps for c in res.cells if c.load == 1.0)
    ttft_limit = 2 * res.unloaded_ttft_p99_ms
    ttft_ok = on.ttft_p99_ms <= ttft_limit
    goodput_ok = on.goodput_rps >= 0.9 * peak_goodput
    mark = {True: "met", False: "**missed**"}
    return (
        f"Targets at {top:g}x with thresholds on: p99 TTFT {on.ttft_p99_ms:,.0f} ms vs "
        f"<= 2 x unloaded p99 = {ttft_limit:,.0f} ms: {mark[ttft_ok]}; goodput "
        f"{on.goodput_rps:.2f} req/s vs >= 90 % of the 1x peak ({peak_goodput:.2f}) = "
        f"{0.9 * peak_goodput:.2f}: {mark[goodput_ok]}. With thresholds off at {top:g}x: "
        f"goodput {off.goodput_rps:.2f} req/s, p99 TTFT "
        f"{_fmt_ms(off.ttft_p99_ms, off.censored_p99)} ms, {off.preemptions} preemptions, "
        f"up to {off.waiting_max:.0f} requests waiting."
    )


def plot(res: Results, out: Path) -> list[Path]:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    paths: list[Path] = []
    series = {
        on: sorted((c for c in res.cells if c.thresholds == on), key=lambda c: c.load)
        for on in (False, True)
    }
    style = {False: ("thresholds off", "tab:red", "o"), True: ("thresholds on", "tab:blue", "s")}

    fig, ax = plt.subplots(figsize=(6.4, 4.2))
    for on, cells in series.items():
        label, color, marker = style[on]
        xs = [c.load for c in cells]
        ax.plot(xs, [c.goodput_rps for c in cells], marker=marker, color=color,
                label=f"goodput, {label}")  # fmt: skip
        ax.plot(xs, [c.slo_goodput_rps for c in cells], marker=marker, color=color,
                linestyle="--", alpha=0.6, label=f"SLO goodput, {label}")  # fmt: skip
    ax.axhline(res.capacity_rps, color="grey", linestyle=":", label="capacity (knee)")
    ax.set_xlabel("offered load (x capacity)")
    ax.set_ylabel("goodput (completed 2xx req/s)")
    ax.set_title("Goodput against offered load")
    ax.set_ylim(bottom=0)
    ax.grid(alpha=0.3)
    ax.legend(fontsize=8, title=f"SLO: TTFT <= {2 * res.unloaded_ttft_p99_ms:.0f} ms",
              title_fontsize=8)  # fmt: skip
    fig.tight_layout()
    paths.append(out / "overload-goodput.png")
    fig.savefig(paths[-1], dpi=110)
    plt.close(fig)

    fig, ax = plt.subplots(figsize=(6.4, 4.2))
    for on, cells in series.items():
        label, color, marker = style[on]
        xs = [c.load for c in cells]
        ax.plot(xs, [c.ttft_p99_ms for c in cells], marker=marker, color=color,
                label=f"TTFT p99, {label}")  # fmt: skip
        ax.plot(xs, [c.e2e_p99_ms for c in cells], marker=marker, color=color, linestyle="--",
                alpha=0.6, label=f"end-to-end p99, {label}")  # fmt: skip
    ax.axhline(2 * res.unloaded_ttft_p99_ms, color="grey", linestyle=":",
               label="2 x unloaded TTFT p99")  # fmt: skip
    ax.set_yscale("log")
    ax.set_xlabel("offered load (x capacity)")
    ax.set_ylabel("latency of accepted requests (ms, log)")
    ax.set_title("Latency against offered load")
    ax.grid(alpha=0.3, which="both")
    ax.legend(fontsize=8)
    fig.tight_layout()
    paths.append(out / "overload-latency.png")
    fig.savefig(paths[-1], dpi=110)
    plt.close(fig)
    return paths


# --- command line -----------------------------------------------------------------------------


def _threshold(text: str) -> float | None:
    return None if text.lower() in ("none", "off", "") else float(text)


def parse_args(argv: Sequence[str] | None) -> tuple[Config, Path]:
    p = argparse.ArgumentParser(
        prog="python -m loadtest.overload",
        description=__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    sim = p.add_argument_group("simulated workers (two, identical)")
    sim.add_argument("--kv-total-blocks", type=int, default=640)
    sim.add_argument("--block-size", type=int, default=16)
    sim.add_argument("--max-num-seqs", type=int, default=48)
    sim.add_argument("--max-num-batched-tokens", type=int, default=2048)
    sim.add_argument("--speedup", type=float, default=2.0)
    req = p.add_argument_group("requests (streaming chat completions)")
    req.add_argument("--prompt-tokens", type=int, default=512)
    req.add_argument("--max-tokens", type=int, default=128)
    thr = p.add_argument_group("thresholds 'on' ('none' leaves one off)")
    thr.add_argument("--decode-threshold", type=_threshold, default=0.9)
    thr.add_argument("--prefill-frac-threshold", type=_threshold, default=0.4)
    p.add_argument("--capacity", type=float, help="req/s: skip the sweep and use this")
    thr.add_argument(
        "--router-track-output-blocks",
        action=argparse.BooleanOptionalAction,
        default=True,
        help="start the extproc with --router-track-output-blocks and Envoy with "
        "envoy/envoy-track-output.yaml, which observes output tokens (default: yes; "
        "without: envoy/envoy.yaml)",
    )
    p.add_argument("--loads", default="0.5,1,2,3", help="multiples of capacity, comma-separated")
    p.add_argument("--cell-seconds", type=float, default=20.0)
    p.add_argument("--warmup", type=float, default=4.0)
    p.add_argument("--grace", type=float, default=5.0)
    p.add_argument("--sweep-seconds", type=float, default=14.0)
    p.add_argument("--seed", type=int, default=1)
    p.add_argument("--out", default=str(ROOT / "docs"), help="folder for the table and plots")
    a = p.parse_args(argv)
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
        loads=tuple(float(x) for x in a.loads.split(",")),
        cell_seconds=a.cell_seconds,
        warmup=a.warmup,
        grace=a.grace,
        sweep_seconds=a.sweep_seconds,
        seed=a.seed,
        capacity=a.capacity,
        track_output_blocks=a.router_track_output_blocks,
    )
    return cfg, Path(a.out)


@contextlib.contextmanager
def started_stack(cfg: Config, extproc_args: Sequence[str] = ()) -> Iterator[Stack]:
    with tempfile.TemporaryDirectory(prefix="overload-") as tmp:
        stack = Stack(cfg, Path(tmp), extproc_args)
        try:
            yield stack
        finally:
            stack.close()


def main(argv: Sequence[str] | None = None) -> int:
    cfg, out = parse_args(argv)
    command = shlex.join(["python", "-m", "loadtest.overload", *(argv or sys.argv[1:])])
    with started_stack(cfg) as stack:
        log(f"stack up: envoy {stack.envoy.url}, workers {stack.sim_ports}")
        results = asyncio.run(run(cfg, stack, command))
    write_results(out, "overload", results, markdown(results), plot)
    return 0


def write_results(
    out: Path, name: str, results: Any, report: str, plot: Callable[[Any, Path], object]
) -> None:
    """``<name>-results.json`` and ``.md`` and the plots under ``out``; the report printed."""
    out.mkdir(parents=True, exist_ok=True)
    (out / f"{name}-results.json").write_text(
        json.dumps(asdict(results), indent=2, default=str) + "\n"
    )
    (out / f"{name}-results.md").write_text(report)
    plot(results, out)
    print(report)


if __name__ == "__main__":
    sys.exit(main())
