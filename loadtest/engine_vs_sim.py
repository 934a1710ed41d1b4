"""The simulated worker against the real engine under the same load.

``python -m loadtest.engine_vs_sim [--levels 1,2,4] [--rounds 3] [--out docs]``

One llama.cpp ``llama-server`` serving SmolLM2-135M on this CPU (2 slots, 1024 tokens of
context, 1 thread), with its sidecar agent; one simulated worker (``llmworker.sim``) sized
alike (64 KV blocks of 16 tokens, 2 sequences at once) with its default step costs; and one
simulated worker with ``--profile llamacpp-cpu`` (the same size, and step costs set to the
engine's as measured), all at real pace. At each level of
concurrency, ``--rounds`` waves of that many identical streaming chat completions go straight
to each worker (no router). Measured per worker and level: TTFT and inter-token time (median
and p90 of all requests and gaps), and from the load events each publishes (the engine's agent,
the simulator itself) the peak KV blocks in use, the peak active prefill tokens, and whether it
was busy (share of the time) under the thresholds given (``--decode-threshold`` x KV total,
``--prefill-threshold`` tokens). Every prompt starts with its own number, so llama.cpp
cannot reuse one from its prompt cache (the simulator has none). Writes
``engine-vs-sim.md`` and ``.json`` under ``--out``.
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

from extproc.devstack import AgentProcess, SimProcess, free_port, wait_until
from extproc.devstack.llamacpp import LlamaServer
from extproc.events.schema import ConfigEvent, LoadEvent, decode
from llmworker.profiles import LLAMACPP_CPU

MODEL = "smollm2"
PROFILED = f"sim-{LLAMACPP_CPU}"  # the worker id of the simulator with the profile
PROMPT = "Write a very long story about a lighthouse keeper and the sea. " * 10
MAX_TOKENS = 48
BLOCK = 16
CTX = 1024
SLOTS = 2


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

    def close(self) -> None:
        self.sock.close()
        self.ctx.term()


async def one_request(http: aiohttp.ClientSession, url: str, level: Level, n: int) -> None:
    # The number comes first, so no request shares a prompt prefix with an earlier one:
    # llama.cpp would reuse it from a slot's cache, the simulator has no such cache.
    body = {
        "model": MODEL,
        "messages": [{"role": "user", "content": f"{n}. {PROMPT}"}],
        "max_tokens": MAX_TOKENS,
        "ignore_eos": True,
        "stream": True,
    }
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
            choices = chunk.get("choices") or [{}]
            if (choices[0].get("delta") or {}).get("content"):
                stamps.append(time.monotonic())
    if not stamps:
        level.errors += 1
        return
    level.ttft_ms.append((stamps[0] - start) * 1e3)
    level.itl_ms.extend((b - a) * 1e3 for a, b in itertools.pairwise(stamps))


async def measure(
    workers: dict[str, str], events: Events, levels: list[int], rounds: int
) -> list[Level]:
    results: list[Level] = []
    numbers = itertools.count(1)
    timeout = aiohttp.ClientTimeout(total=300)
    # A fresh connection per request: llama-server closes idle keep-alive connections, and a
    # request sent on one just closed fails with "Server disconnected".
    connector = aiohttp.TCPConnector(force_close=True)
    async with aiohttp.ClientSession(timeout=timeout, connector=connector) as http:
        for name, url in workers.items():
            await one_request(http, url, Level(name, 0), next(numbers))  # warm up
            for concurrency in levels:
                level = Level(name, concurrency, kv_total=events.kv_total.get(name, 0))
                events.level = {name: level}
                level.started = time.monotonic()
                for _ in range(rounds):
                    await asyncio.gather(
                        *(one_request(http, url, level, next(numbers)) for _ in range(concurrency))
                    )
                level.ended = time.monotonic()
                await asyncio.sleep(0.3)  # the last load events of the level
                events.level = {}
                results.append(level)
                print(f"{name} c={concurrency}: done", file=sys.stderr, flush=True)
    return results


def write(out: Path, rows: list[dict[str, Any]], args: argparse.Namespace, secs: float) -> None:
    out.mkdir(parents=True, exist_ok=True)
    settings = {k: v for k, v in vars(args).items() if k not in ("out", "log_dir")}
    (out / "engine-vs-sim.json").write_text(
        json.dumps({"rows": rows, "args": settings}, indent=1, default=str)
    )
    head = (
        "| worker | concurrent | TTFT p50 / p90 ms | inter-token p50 / p90 ms "
        "| peak KV blocks / total | peak prefill tokens | time busy |\n"
        "|---|---|---|---|---|---|---|\n"
    )
    lines = [
        f"| {r['worker']} | {r['concurrency']} | {r['ttft_p50_ms']} / {r['ttft_p90_ms']} "
        f"| {r['itl_p50_ms']} / {r['itl_p90_ms']} | {r['peak_kv_blocks']} / "
        f"{r['kv_total_blocks']} | {r['peak_prefill_tokens']} | {r['busy_share']:.0%} |"
        for r in rows
    ]
    text = (
        "# Simulated worker against the real engine\n\n"
        "Written by `python -m loadtest.engine_vs_sim` "
        f"(levels {args.levels}, {args.rounds} rounds each, {secs:.0f} s). Workers: "
        f"`llama.cpp` is `llama-server` with SmolLM2-135M (`--ctx-size {CTX} --parallel "
        f"{SLOTS} --threads 1`) and its agent; `sim` the simulated worker sized alike "
        f"(`--kv-total-blocks {CTX // BLOCK} --block-size {BLOCK} --max-num-seqs {SLOTS}`) "
        f"with its default step costs; `{PROFILED}` the simulated worker with "
        f"`--profile {LLAMACPP_CPU}` (the same size, the engine's measured step costs). "
        f"Each request: a {len(PROMPT)}-character prompt after its own number, {MAX_TOKENS} "
        "output tokens, streamed, straight to the worker. Peaks are of the load each worker "
        "reported (the engine through its agent, the simulator itself); time busy is the "
        "share of the level's time its last report was above `active_decode_blocks_threshold` "
        f"{args.decode_threshold} or `active_prefill_tokens_threshold` "
        f"{args.prefill_threshold}.\n\n"
        + head
        + "\n".join(lines)
        + "\n\nWhat the differences mean: [worker.md](worker.md#the-simulator-against-llamacpp).\n"
    )
    (out / "engine-vs-sim.md").write_text(text)


async def run(args: argparse.Namespace, log_dir: Path) -> list[dict[str, Any]]:
    events = Events()
    listener = asyncio.get_running_loop().create_task(events.run())
    server = LlamaServer(log_dir, name="llama-server", ctx=CTX, parallel=SLOTS, threads=1)
    agent = AgentProcess(
        [
            "--engine", "llamacpp", "--engine-url", server.url, "--model", MODEL,
            "--endpoint", server.endpoint, "--worker-id", "llama.cpp", "--block-size", str(BLOCK),
            "--publish", events.endpoint,
        ],
        log_dir=log_dir,
    )  # fmt: skip
    sims: dict[str, tuple[SimProcess, int]] = {}
    try:
        for name, flags in (
            ("sim", ["--kv-total-blocks", str(CTX // BLOCK), "--block-size", str(BLOCK),
                     "--max-num-seqs", str(SLOTS)]),
            (PROFILED, ["--profile", LLAMACPP_CPU]),
        ):  # fmt: skip
            port = free_port()
            common = ["--port", str(port), "--model", MODEL, "--worker-id", name]
            sims[name] = (
                SimProcess([*common, *flags, "--publish", events.endpoint], log_dir=log_dir),
                port,
            )
        for proc, port in sims.values():
            await asyncio.to_thread(wait_until, partial(proc.healthy, port), 20, "sim up")
        await asyncio.to_thread(
            wait_until, lambda: len(events.kv_total) == 3, 30, "the three workers announced"
        )
        workers = {"llama.cpp": server.url}
        workers.update({name: f"http://127.0.0.1:{port}" for name, (_, port) in sims.items()})
        levels = await measure(workers, events, args.levels, args.rounds)
    finally:
        listener.cancel()
        agent.stop()
        for proc, _ in sims.values():
            proc.stop()
        server.stop()
        events.close()
    return [lv.row(args.decode_threshold, args.prefill_threshold) for lv in levels]


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
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
    started = time.monotonic()
    with tempfile.TemporaryDirectory(prefix="engine-vs-sim-") as tmp:
        log_dir = args.log_dir or Path(tmp)
        log_dir.mkdir(parents=True, exist_ok=True)
        rows = asyncio.run(run(args, log_dir))
    write(args.out, rows, args, time.monotonic() - started)
    print((args.out / "engine-vs-sim.md").read_text())
    return 0


if __name__ == "__main__":
    sys.exit(main())
