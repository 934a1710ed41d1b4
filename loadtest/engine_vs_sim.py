"""The simulated worker against the real engines under the same load.

``python -m loadtest.engine_vs_sim [--engines llamacpp,vllm] [--levels 1,2,4] [--rounds 3]
[--out docs]``

For each engine named, one after the other (never two real engines at once):

- ``llamacpp``: one llama.cpp ``llama-server`` serving SmolLM2-135M on this CPU (2 slots,
  1024 tokens of context, 1 thread), with its sidecar agent; one simulated worker
  (``llmworker.sim``) sized alike (64 KV blocks of 16 tokens, 2 sequences at once) with its
  default step costs; and one simulated worker with ``--profile llamacpp-cpu`` (the same
  size, and step costs set to the engine's as measured);
- ``vllm``: one vLLM server of the same model (``.venv-vllm``, ``make vllm``; 4 sequences,
  a KV cache of 9 blocks of 128 tokens, of which vLLM keeps one aside, no prefix caching),
  with its agent; one simulated worker sized alike (9 blocks of 128, 4 sequences) with its
  default step costs; and one with ``--profile vllm-cpu`` (the same size, vLLM's step costs
  as measured, its null block and SmolLM2's chat template).

All run at real pace. At each level of
concurrency, ``--rounds`` waves of that many identical streaming chat completions go straight
to each worker (no router). Measured per worker and level: TTFT and inter-token time (median
and p90 of all requests and gaps), and from the load events each publishes (the engine's agent,
the simulator itself) the peak KV blocks in use, the peak active prefill tokens, and whether it
was busy (share of the time) under the thresholds given (``--decode-threshold`` x KV total,
``--prefill-threshold`` tokens), the peak of the waiting requests each reported, and the
preemptions at that level (the increase of ``vllm:num_preemptions_total`` on the worker's
``/metrics``: vLLM's own and the simulator's; llama.cpp never preempts). The vLLM workers'
requests also ask for their usage, so the table shows the prompt tokens each counted (vLLM
by its tokenizer and chat template, the simulator by 4 bytes a token). Every prompt starts
with its own number, so no engine can reuse one from its prompt cache (the simulator has
none). Writes ``engine-vs-sim.md`` and ``.json`` under ``--out``.
"""

from __future__ import annotations

import argparse
import asyncio
import itertools
import json
import sys
import tempfile
import time
from dataclasses import dataclass, field
from functools import partial
from pathlib import Path
from typing import Any

import aiohttp
import zmq
import zmq.asyncio

from extproc.devstack import AgentProcess, SimProcess, free_port, metric_sums, wait_until
from extproc.devstack.llamacpp import LlamaServer
from extproc.devstack.procs import Proc
from extproc.devstack.vllm import BLOCK_SIZE as VLLM_BLOCK
from extproc.devstack.vllm import VllmServer
from extproc.events.schema import ConfigEvent, LoadEvent, decode
from llmworker.profiles import LLAMACPP_CPU, VLLM_CPU

MODEL = "smollm2"
PROFILED = f"sim-{LLAMACPP_CPU}"  # the worker id of the simulator with the profile
PROMPT = "Write a very long story about a lighthouse keeper and the sea. " * 10
MAX_TOKENS = 48
BLOCK = 16
CTX = 1024
SLOTS = 2
LLAMACPP = "llamacpp"
VLLM = "vllm"
ENGINES = (LLAMACPP, VLLM)
# vLLM: 4 sequences over 9 blocks of 128 tokens (8 hold tokens). A request is 163 prompt
# tokens for SmolLM2 (its chat template included) and 96 output tokens: two blocks for its
# prompt, a third for its last few tokens, so four together outgrow the cache at the end.
VLLM_SEQS = 4
VLLM_BLOCKS = 9
VLLM_MAX_TOKENS = 96
VLLM_PROFILED = f"sim-{VLLM_CPU}"
PREEMPTIONS = "vllm:num_preemptions_total"


@dataclass
class Level:
    """One worker at one concurrency."""

    worker: str
    concurrency: int
    ttft_ms: list[float] = field(default_factory=list)
    itl_ms: list[float] = field(default_factory=list)
    peak_blocks: int = 0
    peak_prefill: int = 0
    kv_total: int = 0
    errors: int = 0
    started: float = 0.0
    ended: float = 0.0
    loads: list[tuple[float, int, int]] = field(default_factory=list)  # (time, blocks, prefill)
    peak_waiting: int | None = None  # None: the worker reported no waiting count
    preemptions: int | None = None  # None: the worker has no preemption counter
    prompt_tokens: list[int] = field(default_factory=list)  # as the worker counted them

    def busy_share(self, decode_threshold: float, prefill_threshold: int) -> float:
        """Share of the level's time the last reported load was busy (either check)."""
        busy_time, since, busy = 0.0, self.started, False
        for at, blocks, prefill in [*self.loads, (self.ended, 0, 0)]:
            if busy:
                busy_time += max(0.0, min(at, self.ended) - since)
            since = at
            busy = blocks > decode_threshold * self.kv_total or prefill > prefill_threshold
        span = self.ended - self.started
        return busy_time / span if span > 0 else 0.0

    def row(self, decode_threshold: float, prefill_threshold: int) -> dict[str, Any]:
        return {
            "worker": self.worker,
            "concurrency": self.concurrency,
            "requests": len(self.ttft_ms),
            "errors": self.errors,
            "ttft_p50_ms": _pct(self.ttft_ms, 50),
            "ttft_p90_ms": _pct(self.ttft_ms, 90),
            "itl_p50_ms": _pct(self.itl_ms, 50),
            "itl_p90_ms": _pct(self.itl_ms, 90),
            "peak_kv_blocks": self.peak_blocks,
            "kv_total_blocks": self.kv_total,
            "peak_prefill_tokens": self.peak_prefill,
            "busy_share": round(self.busy_share(decode_threshold, prefill_threshold), 3),
            "peak_waiting": self.peak_waiting,
            "preemptions": self.preemptions,
            "prompt_tokens": round(sum(self.prompt_tokens) / len(self.prompt_tokens))
            if self.prompt_tokens
            else None,
        }


def _pct(values: list[float], p: int) -> float | None:
    if not values:
        return None
    ordered = sorted(values)
    return round(ordered[min(len(ordered) - 1, round(p / 100 * (len(ordered) - 1)))], 1)


class Events:
    """A SUB socket that keeps the peak load each worker reports while ``recording``."""

    def __init__(self) -> None:
        self.ctx = zmq.asyncio.Context()
        self.sock = self.ctx.socket(zmq.SUB)
        self.sock.setsockopt(zmq.LINGER, 0)
        self.sock.setsockopt(zmq.SUBSCRIBE, b"")
        self.sock.bind("tcp://127.0.0.1:*")
        self.endpoint: str = self.sock.getsockopt_string(zmq.LAST_ENDPOINT)
        self.level: dict[str, Level] = {}
        self.kv_total: dict[str, int] = {}

    async def run(self) -> None:
        while True:
            topic, payload = await self.sock.recv_multipart()
            event = decode(topic, payload)
            if isinstance(event, ConfigEvent) and event.kv_total_blocks:
                self.kv_total[event.worker_id] = event.kv_total_blocks
            if not isinstance(event, LoadEvent):
                continue
            level = self.level.get(event.worker_id)
            if level is not None:
                blocks = event.active_decode_blocks or 0
                prefill = event.active_prefill_tokens or 0
                level.loads.append((time.monotonic(), blocks, prefill))
                level.peak_blocks = max(level.peak_blocks, blocks)
                level.peak_prefill = max(level.peak_prefill, prefill)
                if event.num_requests_waiting is not None:
                    level.peak_waiting = max(level.peak_waiting or 0, event.num_requests_waiting)

    def close(self) -> None:
        self.sock.close()
        self.ctx.term()


async def one_request(
    http: aiohttp.ClientSession, url: str, level: Level, n: int, max_tokens: int, usage: bool
) -> None:
    # The number comes first, so no request shares a prompt prefix with an earlier one:
    # llama.cpp would reuse it from a slot's cache, the simulator has no such cache.
    body: dict[str, Any] = {
        "model": MODEL,
        "messages": [{"role": "user", "content": f"{n}. {PROMPT}"}],
        "max_tokens": max_tokens,
        "ignore_eos": True,
        "stream": True,
    }
    if usage:
        body["stream_options"] = {"include_usage": True}
    start = time.monotonic()
    stamps: list[float] = []
    async with http.post(url + "/v1/chat/completions", json=body) as response:
        if response.status != 200:
            level.errors += 1
            await response.read()
            return
        async for line in response.content:
            if not line.startswith(b"data: ") or line.startswith(b"data: [DONE]"):
                continue
            chunk = json.loads(line[6:])
            if chunk.get("usage"):
                level.prompt_tokens.append(chunk["usage"]["prompt_tokens"])
            choices = chunk.get("choices") or [{}]
            if (choices[0].get("delta") or {}).get("content"):
                stamps.append(time.monotonic())
    if not stamps:
        level.errors += 1
        return
    level.ttft_ms.append((stamps[0] - start) * 1e3)
    level.itl_ms.extend((b - a) * 1e3 for a, b in itertools.pairwise(stamps))


async def preemptions(http: aiohttp.ClientSession, url: str) -> float | None:
    """The worker's ``vllm:num_preemptions_total``; None if it prints none (llama.cpp)."""
    async with http.get(url + "/metrics") as response:
        return metric_sums(await response.text()).get(PREEMPTIONS)


async def measure(
    workers: dict[str, str],
    events: Events,
    levels: list[int],
    rounds: int,
    max_tokens: int = MAX_TOKENS,
    usage: bool = False,
) -> list[Level]:
    results: list[Level] = []
    numbers = itertools.count(1)
    request = partial(one_request, max_tokens=max_tokens, usage=usage)
    timeout = aiohttp.ClientTimeout(total=300)
    # A fresh connection per request: llama-server closes idle keep-alive connections, and a
    # request sent on one just closed fails with "Server disconnected".
    connector = aiohttp.TCPConnector(force_close=True)
    async with aiohttp.ClientSession(timeout=timeout, connector=connector) as http:
        for name, url in workers.items():
            await request(http, url, Level(name, 0), next(numbers))  # warm up
            for concurrency in levels:
                level = Level(name, concurrency, kv_total=events.kv_total.get(name, 0))
                events.level = {name: level}
                before = await preemptions(http, url)
                level.started = time.monotonic()
                for _ in range(rounds):
                    await asyncio.gather(
                        *(request(http, url, level, next(numbers)) for _ in range(concurrency))
                    )
                level.ended = time.monotonic()
                await asyncio.sleep(0.3)  # the last load events of the level
                events.level = {}
                after = await preemptions(http, url)
                if before is not None and after is not None:
                    level.preemptions = round(after - before)
                results.append(level)
                print(f"{name} c={concurrency}: done", file=sys.stderr, flush=True)
    return results


NOTES = "<!-- notes: kept as they are when the tables above are written again -->"
"""Everything below this line of ``engine-vs-sim.md`` is written by hand and kept."""


def engine_of(row: dict[str, Any]) -> str:
    """The engine a row's run was about (rows written before vLLM had no ``engine`` key)."""
    return str(row.get("engine") or LLAMACPP)


def describe(engine: str, run: dict[str, Any]) -> str:
    """What was run for ``engine``, as the markdown says it."""
    head = (
        f"`python -m loadtest.engine_vs_sim --engines {engine}` (levels {run['levels']}, "
        f"{run['rounds']} rounds each"
        + (f", {run['seconds']:.0f} s" if run.get("seconds") else "")
        + (f"; `/proc/loadavg` before `{run['loadavg'][0]}`, after `{run['loadavg'][1]}`"
           if run.get("loadavg") else "")
        + "). "
    )  # fmt: skip
    if engine == LLAMACPP:
        return head + (
            f"Workers: `llama.cpp` is `llama-server` with SmolLM2-135M (`--ctx-size {CTX} "
            f"--parallel {SLOTS} --threads 1`) and its agent; `sim` the simulated worker sized "
            f"alike (`--kv-total-blocks {CTX // BLOCK} --block-size {BLOCK} --max-num-seqs "
            f"{SLOTS}`) with its default step costs; `{PROFILED}` the simulated worker with "
            f"`--profile {LLAMACPP_CPU}` (the same size, the engine's measured step costs). "
            f"Each request: a {len(PROMPT)}-character prompt after its own number, "
            f"{MAX_TOKENS} output tokens, streamed, straight to the worker."
        )
    return head + (
        f"Workers: `vLLM` is vLLM's OpenAI server with SmolLM2-135M (`--num-gpu-blocks-override "
        f"{VLLM_BLOCKS} --max-num-seqs {VLLM_SEQS} --max-model-len {vllm_max_model_len()} "
        f"--no-enable-prefix-caching --enforce-eager`, blocks of {VLLM_BLOCK} tokens, "
        f"{VLLM_BLOCKS - 1} of them for tokens) and its agent (`--engine vllm --max-num-seqs "
        f"{VLLM_SEQS}`); `sim-vllm` the simulated worker sized alike (`--kv-total-blocks "
        f"{VLLM_BLOCKS} --block-size {VLLM_BLOCK} --max-num-seqs {VLLM_SEQS}`) with its "
        f"default step costs; `{VLLM_PROFILED}` the simulated worker with `--profile "
        f"{VLLM_CPU} --kv-total-blocks {VLLM_BLOCKS}` (vLLM's measured step costs, its null "
        f"block, and the tokens SmolLM2's chat template adds to a prompt). Each request: "
        f"the same prompt, {VLLM_MAX_TOKENS} output tokens, "
        "streamed with its usage, straight to the worker."
    )


def write(
    out: Path, rows: list[dict[str, Any]], runs: dict[str, dict[str, Any]], args: argparse.Namespace
) -> None:
    """``engine-vs-sim.json`` and ``.md`` under ``out``: the rows of the engines run now, and
    those of the others as an earlier run left them; the notes below :data:`NOTES` kept."""
    out.mkdir(parents=True, exist_ok=True)
    json_path, md_path = out / "engine-vs-sim.json", out / "engine-vs-sim.md"
    old: dict[str, Any] = json.loads(json_path.read_text()) if json_path.is_file() else {}
    ran = set(runs)
    rows = [r for r in old.get("rows", []) if engine_of(r) not in ran] + rows
    rows.sort(key=lambda r: ENGINES.index(engine_of(r)))
    old_runs = old.get("runs") or ({LLAMACPP: old["args"]} if "args" in old else {})
    runs = {**{e: r for e, r in old_runs.items() if e not in ran}, **runs}
    settings = {k: v for k, v in vars(args).items() if k not in ("out", "log_dir", "engines")}
    json_path.write_text(
        json.dumps({"rows": rows, "runs": runs, "args": settings}, indent=1, default=str) + "\n"
    )
    head = (
        "| worker | concurrent | TTFT p50 / p90 ms | inter-token p50 / p90 ms "
        "| peak KV blocks / total | peak prefill tokens | time busy | peak waiting "
        "| preemptions | prompt tokens |\n"
        "|---|---|---|---|---|---|---|---|---|---|\n"
    )

    def cell(value: Any) -> str:
        return "—" if value is None else str(value)

    sections = []
    for engine in ENGINES:
        mine = [r for r in rows if engine_of(r) == engine]
        if not mine or engine not in runs:
            continue
        lines = [
            f"| {r['worker']} | {r['concurrency']} | {r['ttft_p50_ms']} / {r['ttft_p90_ms']} "
            f"| {r['itl_p50_ms']} / {r['itl_p90_ms']} | {r['peak_kv_blocks']} / "
            f"{r['kv_total_blocks']} | {r['peak_prefill_tokens']} | {r['busy_share']:.0%} "
            f"| {cell(r.get('peak_waiting'))} | {cell(r.get('preemptions'))} "
            f"| {cell(r.get('prompt_tokens'))} |"
            for r in mine
        ]
        title = "llama.cpp" if engine == LLAMACPP else "vLLM"
        sections.append(
            f"## {title}\n\n{describe(engine, runs[engine])}\n\n{head}" + "\n".join(lines)
        )
    run_args = next(iter(runs.values()))
    notes = ""
    if md_path.is_file() and NOTES in md_path.read_text():
        notes = md_path.read_text().split(NOTES, 1)[1].lstrip("\n")
    text = (
        "# Simulated worker against the real engine\n\n"
        "Written by `python -m loadtest.engine_vs_sim`. Peaks are of the load each worker "
        "reported (the engine through its agent, the simulator itself); time busy is the "
        "share of the level's time its last report was above `active_decode_blocks_threshold` "
        f"{run_args.get('decode_threshold', args.decode_threshold)} or "
        "`active_prefill_tokens_threshold` "
        f"{run_args.get('prefill_threshold', args.prefill_threshold)}; peak waiting is of the "
        "`num_requests_waiting` each reported; preemptions are the increase of "
        "`vllm:num_preemptions_total` on the worker's own page over the level (— where the "
        "worker has none: llama.cpp does not preempt); prompt tokens are the mean each worker "
        "counted for a request, from the usage of the streams (asked of the vLLM rows only).\n\n"
        + "\n\n".join(sections)
        + "\n\nWhat the differences mean: llama.cpp in "
        "[worker.md](worker.md#the-simulator-against-llamacpp), vLLM below.\n\n"
        + NOTES
        + "\n\n"
        + notes
    )
    md_path.write_text(text.rstrip("\n") + "\n")


def vllm_max_model_len() -> int:
    """vLLM starts only if one sequence of ``--max-model-len`` fits the blocks that hold
    tokens (all but one)."""
    return min(1024, (VLLM_BLOCKS - 1) * VLLM_BLOCK)


async def start_sims(
    sims: dict[str, list[str]], events: Events, log_dir: Path, procs: list[Proc]
) -> dict[str, str]:
    """Start the simulated workers (appended to ``procs``); their URLs once healthy."""
    urls: dict[str, str] = {}
    for name, flags in sims.items():
        port = free_port()
        common = ["--port", str(port), "--model", MODEL, "--worker-id", name]
        proc = SimProcess([*common, *flags, "--publish", events.endpoint], log_dir=log_dir)
        procs.append(proc)
        await asyncio.to_thread(wait_until, partial(proc.healthy, port), 20, f"{name} up")
        urls[name] = f"http://127.0.0.1:{port}"
    return urls


async def run_engine(
    engine: str, args: argparse.Namespace, log_dir: Path, events: Events
) -> list[dict[str, Any]]:
    """One real engine with its agent, and its two simulated workers, measured in turn."""
    procs: list[Proc] = []
    try:
        if engine == LLAMACPP:
            server: LlamaServer | VllmServer = LlamaServer(
                log_dir, name="llama-server", ctx=CTX, parallel=SLOTS, threads=1
            )
            procs.append(server)
            real, flags = "llama.cpp", ["--engine", LLAMACPP, "--block-size", str(BLOCK)]
            sims = {
                "sim": ["--kv-total-blocks", str(CTX // BLOCK), "--block-size", str(BLOCK),
                        "--max-num-seqs", str(SLOTS)],
                PROFILED: ["--profile", LLAMACPP_CPU],
            }  # fmt: skip
            max_tokens, usage = MAX_TOKENS, False
        else:
            server = VllmServer(
                log_dir,
                name="vllm",
                served_model=MODEL,
                max_model_len=vllm_max_model_len(),
                max_num_seqs=VLLM_SEQS,
                num_gpu_blocks_override=VLLM_BLOCKS,
                extra=["--max-num-batched-tokens", "2048", "--no-enable-prefix-caching"],
            )
            procs.append(server)
            real, flags = "vLLM", ["--engine", VLLM, "--max-num-seqs", str(VLLM_SEQS)]
            sims = {
                "sim-vllm": ["--kv-total-blocks", str(VLLM_BLOCKS), "--block-size",
                             str(VLLM_BLOCK), "--max-num-seqs", str(VLLM_SEQS)],
                VLLM_PROFILED: ["--profile", VLLM_CPU, "--kv-total-blocks", str(VLLM_BLOCKS)],
            }  # fmt: skip
            max_tokens, usage = VLLM_MAX_TOKENS, True
        procs.append(
            AgentProcess(
                [*flags, "--engine-url", server.url, "--model", MODEL, "--endpoint",
                 server.endpoint, "--worker-id", real, "--publish", events.endpoint],
                log_dir=log_dir,
                name=f"agent-{engine}",
            )
        )  # fmt: skip
        workers = {real: server.url, **await start_sims(sims, events, log_dir, procs)}
        await asyncio.to_thread(
            wait_until,
            lambda: all(w in events.kv_total for w in workers),
            60,
            f"the {len(workers)} workers announced",
        )
        levels = await measure(workers, events, args.levels, args.rounds, max_tokens, usage)
    finally:
        for proc in reversed(procs):
            proc.stop()
    return [
        {"engine": engine, **lv.row(args.decode_threshold, args.prefill_threshold)} for lv in levels
    ]


def loadavg() -> str:
    return Path("/proc/loadavg").read_text().strip()


async def run(
    args: argparse.Namespace, log_dir: Path
) -> tuple[list[dict[str, Any]], dict[str, dict[str, Any]]]:
    """Every engine of ``args.engines`` in turn: the rows, and per engine what was run."""
    events = Events()
    listener = asyncio.get_running_loop().create_task(events.run())
    rows: list[dict[str, Any]] = []
    runs: dict[str, dict[str, Any]] = {}
    try:
        for engine in args.engines:
            started, before = time.monotonic(), loadavg()
            rows += await run_engine(engine, args, log_dir, events)
            runs[engine] = {
                "levels": args.levels,
                "rounds": args.rounds,
                "decode_threshold": args.decode_threshold,
                "prefill_threshold": args.prefill_threshold,
                "seconds": round(time.monotonic() - started, 1),
                "loadavg": [before, loadavg()],
            }
    finally:
        listener.cancel()
        events.close()
    return rows, runs


def _engines(text: str) -> list[str]:
    names = [x.strip() for x in text.split(",") if x.strip()]
    for name in names:
        if name not in ENGINES:
            raise argparse.ArgumentTypeError(
                f"{name!r} is not an engine; expected some of {', '.join(ENGINES)}, comma-separated"
            )
    if not names:
        raise argparse.ArgumentTypeError(f"no engine named; expected some of {', '.join(ENGINES)}")
    return list(dict.fromkeys(names))


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument(
        "--engines",
        type=_engines,
        default=list(ENGINES),
        help="real engines to compare with, in turn (the rows of the others are kept from "
        "the last run's JSON); default: %(default)s",
    )
    parser.add_argument(
        "--levels",
        type=lambda t: [int(x) for x in t.split(",")],
        default=[1, 2, 4],
        help="concurrency levels, comma-separated",
    )
    parser.add_argument("--rounds", type=int, default=3, help="waves per level")
    parser.add_argument("--decode-threshold", type=float, default=0.5, help="KV fraction")
    parser.add_argument("--prefill-threshold", type=int, default=200, help="tokens")
    parser.add_argument("--out", type=Path, default=Path("docs"), help="output folder")
    parser.add_argument(
        "--log-dir", type=Path, help="keep the processes' logs here (default: a temporary folder)"
    )
    args = parser.parse_args(argv)
    if not 1 <= args.rounds <= 50 or not all(1 <= c <= 64 for c in args.levels):
        parser.error("--rounds must be 1-50 and every level 1-64")
    with tempfile.TemporaryDirectory(prefix="engine-vs-sim-") as tmp:
        log_dir = args.log_dir or Path(tmp)
        log_dir.mkdir(parents=True, exist_ok=True)
        rows, runs = asyncio.run(run(args, log_dir))
    write(args.out, rows, runs, args)
    print((args.out / "engine-vs-sim.md").read_text())
    return 0


if __name__ == "__main__":
    from loadtest import run_stoppable

    sys.exit(run_stoppable(main))
