"""What observing streamed response bodies costs: inter-token latency and extproc CPU per token.

Three Envoy configurations, same echo worker (SSE, one token per event at a fixed
interval), same load, one run:

- ``none``: response bodies are not sent to the extproc (response_body_mode NONE);
- ``blocking``: the routing filter gets every body chunk (STREAMED) and Envoy waits
  for its reply before forwarding the chunk;
- ``observe``: a second ext_proc filter in observability_mode gets the chunks;
  Envoy does not wait, the extproc does not reply.

    python -m loadtest.stream_bench [--streams 8] [--tokens 200] [--interval-ms 5] [--rounds 3]

Reports client-side inter-token gaps (p50/p99, ms), their excess over ``none``, and
the extproc's CPU seconds (user+system, from /proc) per streamed token, in
``docs/stream-results.json`` (with the command, the time, ``/proc/loadavg`` before and after
and the machine; ``--out DIR`` elsewhere) and ``stream-results.md`` generated from it.
"""

from __future__ import annotations

import argparse
import asyncio
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import aiohttp

from extproc.devstack import Envoy, Extproc, Publisher, checkout_file, start_echo_worker
from loadtest import resultfile

EXT_PROC = "envoy.filters.http.ext_proc"


def _filters(cfg: dict[str, Any]) -> list[dict[str, Any]]:
    hcm = cfg["static_resources"]["listeners"][0]["filter_chains"][0]["filters"][0]
    return hcm["typed_config"]["http_filters"]


def design(name: str) -> Any:
    """``none`` is envoy/envoy.yaml, ``observe`` envoy/envoy-track-output.yaml, both as
    shipped; ``blocking`` is envoy.yaml with STREAMED response bodies."""

    def tweak(cfg: dict[str, Any]) -> None:
        if name == "blocking":
            main = next(f for f in _filters(cfg) if f["name"] == EXT_PROC)
            main["typed_config"]["processing_mode"]["response_body_mode"] = "STREAMED"

    return tweak


def source(name: str) -> Path:
    return checkout_file(
        "envoy/" + ("envoy-track-output.yaml" if name == "observe" else "envoy.yaml")
    )


def cpu_seconds(pid: int) -> float:
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


async def one_stream(
    session: aiohttp.ClientSession, url: str, tokens: int, interval_ms: int
) -> list[float]:
    body = {"model": "m", "prompt": "hi", "stream": True}
    headers = {"x-test-chunks": str(tokens), "x-test-delay-ms": str(interval_ms)}
    gaps: list[float] = []
    async with session.post(url + "/v1/completions", json=body, headers=headers) as resp:
        assert resp.status == 200, resp.status
        last: float | None = None
        buf = b""
        async for chunk in resp.content.iter_any():
            now = time.perf_counter()
            buf += chunk
            events = buf.count(b"\n\n")
            buf = buf[buf.rfind(b"\n\n") + 2 :] if events else buf
            for _ in range(events):
                if last is not None:
                    gaps.append((now - last) * 1000)
                last = now
    return gaps


async def run_load(url: str, streams: int, tokens: int, interval_ms: int) -> list[float]:
    async with aiohttp.ClientSession() as session:
        results = await asyncio.wait_for(
            asyncio.gather(
                *(one_stream(session, url, tokens, interval_ms) for _ in range(streams))
            ),
            timeout=60 + tokens * interval_ms / 1000 * 3,
        )
    return [g for r in results for g in r]


def pct(values: list[float], p: float) -> float:
    values = sorted(values)
    return values[min(len(values) - 1, int(p / 100 * len(values)))]


RESULTS_NAME = "stream"
DESIGNS = ("none", "blocking", "observe")


def summary(gaps: list[float], cpu_s: float, tokens: int) -> dict[str, float]:
    """One design's inter-token gaps (ms) and extproc CPU, as the results file keeps them."""
    return {
        "itl_p50_ms": pct(gaps, 50),
        "itl_p99_ms": pct(gaps, 99),
        "itl_mean_ms": statistics.mean(gaps) if gaps else float("nan"),
        "gaps": len(gaps),
        "tokens": tokens,
        "extproc_cpu_s": cpu_s,
    }


HEAD = "| design | ITL p50 ms | ITL p99 ms | added p50 | added p99 | extproc CPU µs/token |"


def table(data: dict[str, Any]) -> list[str]:
    d = data["designs"]
    base50, base99 = d["none"]["itl_p50_ms"], d["none"]["itl_p99_ms"]
    rows = [HEAD, "|---|---|---|---|---|---|"]
    for name in DESIGNS:
        r = d[name]
        rows.append(
            f"| {name} | {r['itl_p50_ms']:.2f} | {r['itl_p99_ms']:.2f} "
            f"| {r['itl_p50_ms'] - base50:+.2f} | {r['itl_p99_ms'] - base99:+.2f} "
            f"| {r['extproc_cpu_s'] / max(r['tokens'], 1) * 1e6:.0f} |"
        )
    return rows


def render(data: dict[str, Any]) -> str:
    """The Markdown report of a stream benchmark run, from its results JSON."""
    s = data["settings"]
    return "\n".join([
        resultfile.header("Observing streamed response bodies: inter-token latency and CPU",
                          data["run"]),
        f"{s['streams']} concurrent streams x {s['tokens']} SSE events, the echo worker "
        f"writing one event every {s['interval_ms']} ms, through Envoy; rounds: "
        f"{s['rounds']}, each alternating between the designs. `none`: `envoy/envoy.yaml` "
        "as shipped (response bodies not sent to the extproc); `blocking`: the routing "
        "filter gets every body chunk (`STREAMED`) and Envoy waits for each reply; "
        "`observe`: `envoy/envoy-track-output.yaml`, a second filter in "
        "`observability_mode` (no reply awaited). Inter-token gaps measured at the client "
        "over every round (percentiles of all gaps); extproc CPU (user + system, from "
        "`/proc`) per streamed token.\n",
        "\n".join(table(data)) + "\n",
        "Mean gap: " + ", ".join(
            f"{n} {data['designs'][n]['itl_mean_ms']:.2f} ms" for n in DESIGNS
        ) + ".\n",
    ])  # fmt: skip


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="python -m loadtest.stream_bench", description=__doc__.split("\n\n")[0]
    )
    parser.add_argument("--streams", type=int, default=8, help="concurrent streams")
    parser.add_argument("--tokens", type=int, default=200, help="SSE events per stream")
    parser.add_argument("--interval-ms", type=int, default=5, help="worker's gap between events")
    parser.add_argument("--rounds", type=int, default=3, help="alternating rounds per design")
    parser.add_argument(
        "--out",
        type=Path,
        default=resultfile.DOCS,
        metavar="DIR",
        help=f"where {RESULTS_NAME}-results.json and .md are written (default: docs/)",
    )
    args = parser.parse_args(argv)
    counts = {"--streams": args.streams, "--tokens": args.tokens, "--rounds": args.rounds,
              "--interval-ms": args.interval_ms}  # fmt: skip
    for flag, value in counts.items():
        if value < 1:
            parser.error(f"{flag}: {value} is not a count of 1 or more")
    run = resultfile.Run(
        resultfile.command_line("loadtest.stream_bench", sys.argv[1:] if argv is None else argv)
    )
    tmp = Path(tempfile.mkdtemp(prefix="stream-bench-"))
    worker, port = start_echo_worker(tmp, "w")
    stacks: dict[str, tuple[Extproc, Envoy, Publisher]] = {}
    try:
        for name in DESIGNS:
            ext = Extproc(
                tmp,
                ["--log-level", "WARNING", "--worker-ttl", "3600", "--router-track-output-blocks"],
            )
            env = Envoy(tmp, ext, [port], tweak=design(name), source=source(name))
            pub = Publisher(ext.event_endpoint)
            pub.announce(ext, "w", "m", f"127.0.0.1:{port}", kv_total_blocks=100000)
            stacks[name] = (ext, env, pub)
        gaps: dict[str, list[float]] = {n: [] for n in DESIGNS}
        cpu: dict[str, float] = dict.fromkeys(DESIGNS, 0.0)
        ntok: dict[str, int] = dict.fromkeys(DESIGNS, 0)
        for name in DESIGNS:  # warm-up
            asyncio.run(run_load(stacks[name][1].url, 2, 20, args.interval_ms))
        for _ in range(args.rounds):
            for name in DESIGNS:
                ext, env, _ = stacks[name]
                c0 = cpu_seconds(ext.proc.pid)
                g = asyncio.run(run_load(env.url, args.streams, args.tokens, args.interval_ms))
                cpu[name] += cpu_seconds(ext.proc.pid) - c0
                ntok[name] += args.streams * args.tokens
                gaps[name].extend(g)
        # Sanity: every design released its streams' estimates.
        for name in DESIGNS:
            ext = stacks[name][0]
            rank = ext.workers()["w"]["ranks"][0]["router_estimate"]
            assert rank["requests_in_flight"] == 0, (name, rank)
    finally:
        for ext, env, pub in stacks.values():
            pub.close()
            env.stop()
            ext.stop()
        worker.stop()
    data = {
        "settings": {"streams": args.streams, "tokens": args.tokens,
                     "interval_ms": args.interval_ms, "rounds": args.rounds},
        "designs": {n: summary(gaps[n], cpu[n], ntok[n]) for n in DESIGNS},
        "run": run.finish(),
    }  # fmt: skip
    print(resultfile.write(args.out, RESULTS_NAME, data, render))
    return 0


if __name__ == "__main__":
    from loadtest import run_stoppable

    sys.exit(run_stoppable(main))
