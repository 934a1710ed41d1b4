"""Storm: thousands of keep-alive clients while every worker is busy.

Every request should be answered 529 by the extproc; none may reach a worker and no
ext_proc stream may fail (Envoy would fail open, or closed, on it). The stack: Envoy on
the repo's ``envoy/envoy.yaml`` (or ``--config``), the extproc (``--grpc-server``), and a
worker that is a second Envoy answering 200 with ``direct_response`` (so a request that
reaches it shows as a 200 and in ``cluster.workers.upstream_rq_total``). The extproc
knows one worker, kept busy by its load events (active prefill tokens above the
threshold). Load: ``wrk -t2 -cN -dDs`` of short chat POSTs; Envoy's admin ``/stats`` is
read before and after, and Envoy's log is searched for ``protocol_error``.

    python -m loadtest.storm --clients 4000 --duration 8 [--clients 8000 ...]

Writes ``docs/storm-results.json`` (each run, with the command, the time, ``/proc/loadavg``
before and after and the machine; ``--out DIR`` elsewhere) and ``storm-results.md`` generated
from it, with the goal judged per run.

Open files: Envoy needs about two per client and wrk one; the soft limit is raised to
the hard one for this process and its children, and a client count the hard limit
cannot carry is refused.
"""

from __future__ import annotations

import argparse
import json
import re
import resource
import shutil
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

from extproc.devstack import (
    ROOT,
    Envoy,
    Extproc,
    Proc,
    Publisher,
    envoy_binary,
    free_port,
    http,
    wait_until,
)
from loadtest import resultfile
from loadtest.bench import BODY, LUA, _ms, cpu_seconds, worker_config

# Envoy stats read before and after a run (deltas are reported).
STATS = {
    "streams_failed": "http.inference.ext_proc.streams_failed",
    "failure_mode_allowed": "http.inference.ext_proc.failure_mode_allowed",
    "message_timeouts": "http.inference.ext_proc.message_timeouts",
    "streams_started": "http.inference.ext_proc.streams_started",
    "reached_worker": "cluster.workers.upstream_rq_total",
    "extproc_connections": "cluster.extproc.upstream_cx_total",
    "extproc_flood": "cluster.extproc.http2.outbound_flood",
    "extproc_control_flood": "cluster.extproc.http2.outbound_control_flood",
}
FD_PER_CLIENT = 2
FD_SPARE = 1000


def raise_nofile() -> int:
    """Raise this process's open-file soft limit to the hard limit; return it."""
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    if soft != hard:
        resource.setrlimit(resource.RLIMIT_NOFILE, (hard, hard))
    return hard


def _raise_nofile_in_child() -> None:
    raise_nofile()


def envoy_stats(admin_port: int) -> dict[str, int]:
    _, _, body = http("GET", f"http://127.0.0.1:{admin_port}/stats", timeout=10)
    values: dict[str, int] = {}
    for line in body.decode().splitlines():
        name, sep, value = line.partition(": ")
        if sep and value.strip().isdigit():
            values[name] = int(value)
    return {key: values.get(name, 0) for key, name in STATS.items()}


@dataclass
class StormResult:
    clients: int
    duration: float
    requests: int
    rejections_per_s: float
    p50_ms: float
    p99_ms: float
    non_529: int
    socket_errors: str
    streams_failed: int
    failure_mode_allowed: int
    message_timeouts: int
    reached_worker: int
    extproc_connections: int
    outbound_flood: int
    protocol_errors_in_log: int
    extproc_cpu_us_per_request: float


def run_wrk(url: str, clients: int, duration: float, threads: int, tmp: Path) -> dict[str, Any]:
    script = tmp / "storm.lua"
    # Count statuses so that a 200 (a worker answered) is told from a 529.
    script.write_text(
        LUA % json.dumps({**BODY, "model": "storm"})
        + """
local counts = {}
local thread_list = {}
function setup(thread) table.insert(thread_list, thread) end
function init(args) statuses = {} end
function response(status, headers, body) statuses[status] = (statuses[status] or 0) + 1 end
function done(summary, latency, requests)
  for _, t in ipairs(thread_list) do
    local s = t:get("statuses")
    for k, v in pairs(s) do counts[k] = (counts[k] or 0) + v end
  end
  for k, v in pairs(counts) do io.write(string.format("status %d %d\\n", k, v)) end
end
"""
    )
    out = subprocess.run(
        ["wrk", f"-t{threads}", f"-c{clients}", f"-d{duration:g}s", "--latency",
         "--timeout", "10s", "-s", str(script), url + "/v1/chat/completions"],
        capture_output=True, text=True, timeout=duration + 60, check=True,
        preexec_fn=_raise_nofile_in_child,
    ).stdout  # fmt: skip
    (tmp / "wrk.txt").write_text(out)
    pct = dict(re.findall(r"^\s+(50|99)%\s+(\S+)\s*$", out, re.M))
    if "99" not in pct:
        raise RuntimeError(f"wrk gave no latency distribution (no reply at all?):\n{out}")
    total = int(re.search(r"(\d+) requests in", out).group(1))  # type: ignore[union-attr]
    errors = re.search(r"Socket errors: (.*)", out)
    statuses = {int(k): int(v) for k, v in re.findall(r"^status (\d+) (\d+)$", out, re.M)}
    return {
        "total": total,
        "p50": _ms(pct["50"]),
        "p99": _ms(pct["99"]),
        "statuses": statuses,
        "socket_errors": errors.group(1).strip() if errors else "none",
        "raw": out,
    }


def storm(
    clients: int,
    duration: float,
    tmp: Path,
    *,
    source: Path = ROOT / "envoy" / "envoy.yaml",
    tweak: Callable[[dict[str, Any]], None] | None = None,
    grpc_server: str = "builtin",
    threads: int = 2,
) -> StormResult:
    """One storm run on a fresh stack; returns what Envoy and wrk saw."""
    hard = raise_nofile()
    need = clients * FD_PER_CLIENT + FD_SPARE
    if need > hard:
        raise SystemExit(
            f"--clients {clients} needs about {need} open files per process, "
            f"the hard limit (ulimit -Hn) is {hard}: use at most "
            f"{(hard - FD_SPARE) // FD_PER_CLIENT}"
        )
    procs: list[Any] = []
    try:
        wport, wadmin = free_port(), free_port()
        wcfg = tmp / "worker.json"
        wcfg.write_text(json.dumps(worker_config([wport], wadmin)))
        worker = Proc(
            "worker-envoy",
            [envoy_binary(), "-c", str(wcfg), "--disable-hot-restart", "--concurrency", "1",
             "-l", "error"],
            tmp,
        )  # fmt: skip
        procs.append(worker)
        wait_until(lambda: http("GET", f"http://127.0.0.1:{wport}/")[0] == 200, 20, "worker")
        ext = Extproc(
            tmp,
            ["--active-prefill-tokens-threshold", "1000", "--log-level", "WARNING",
             "--worker-ttl", "86400", "--grpc-server", grpc_server, "--startup-grace", "0"],
        )  # fmt: skip
        procs.append(ext)
        envoy = Envoy(tmp, ext, [wport], tweak=tweak, source=source)
        procs.append(envoy)
        pub = Publisher(ext.event_endpoint)
        pub.announce(ext, "storm-1", "storm", f"127.0.0.1:{wport}", kv_total_blocks=1000)
        pub.load("storm-1", active_prefill_tokens=5000)
        wait_until(lambda: ext.workers()["storm-1"]["state"] == "busy", 5, "busy worker")
        # One request first: every worker is busy, so this is a 529 from the extproc.
        status = http("POST", envoy.url + "/v1/chat/completions", {**BODY, "model": "storm"})[0]
        assert status == 529, f"expected 529 with every worker busy, got {status}"
        before = envoy_stats(envoy.admin_port)
        cpu0 = cpu_seconds(ext.proc.pid)
        r = run_wrk(envoy.url, clients, duration, threads, tmp)
        cpu1 = cpu_seconds(ext.proc.pid)
        # Streams still closing when wrk stops are counted once Envoy is done with them.
        time.sleep(0.5)
        after = envoy_stats(envoy.admin_port)
        # All of Envoy's stats, for a closer look at a run (the path is in the report).
        (tmp / "envoy-stats.txt").write_bytes(
            http("GET", f"http://127.0.0.1:{envoy.admin_port}/stats", timeout=10)[2]
        )
        delta = {k: after[k] - before[k] for k in STATS}
        log = envoy.proc.log()
        rejected = r["statuses"].get(529, 0)
        return StormResult(
            clients=clients,
            duration=duration,
            requests=r["total"],
            rejections_per_s=round(rejected / duration, 1),
            p50_ms=r["p50"],
            p99_ms=r["p99"],
            non_529=sum(v for k, v in r["statuses"].items() if k != 529),
            socket_errors=r["socket_errors"],
            streams_failed=delta["streams_failed"],
            failure_mode_allowed=delta["failure_mode_allowed"],
            message_timeouts=delta["message_timeouts"],
            reached_worker=delta["reached_worker"],
            extproc_connections=after["extproc_connections"],
            # Connections to the extproc Envoy reset for queueing too many frames.
            outbound_flood=delta["extproc_flood"] + delta["extproc_control_flood"],
            protocol_errors_in_log=log.count("protocol_error"),
            extproc_cpu_us_per_request=round((cpu1 - cpu0) / max(r["total"], 1) * 1e6, 1),
        )
    finally:
        for p in reversed(procs):
            p.stop()


HEADER = (
    "| clients | requests | rejections/s | p50 ms | p99 ms | non-529 | streams failed "
    "| failed open | message timeouts | reached worker | extproc conns | outbound flood "
    "| protocol_error lines | extproc µs/req | socket errors |"
)


def row(r: dict[str, Any]) -> str:
    """A result (``StormResult`` as plain values) as a table row."""
    return (
        f"| {r['clients']} | {r['requests']} | {r['rejections_per_s']:.0f} | {r['p50_ms']:.1f} "
        f"| {r['p99_ms']:.1f} | {r['non_529']} | {r['streams_failed']} "
        f"| {r['failure_mode_allowed']} | {r['message_timeouts']} | {r['reached_worker']} "
        f"| {r['extproc_connections']} | {r['outbound_flood']} | {r['protocol_errors_in_log']} "
        f"| {r['extproc_cpu_us_per_request']} | {r['socket_errors']} |"
    )


def socket_error_count(text: str) -> int:
    """The sum of wrk's ``Socket errors: connect 0, read 0, write 0, timeout 3`` (``none``: 0)."""
    return sum(int(n) for n in re.findall(r"\b(\d+)\b", text))


def goal(r: dict[str, Any]) -> str:
    """Held when nothing reached the busy worker, no ext_proc stream failed, timed out or
    failed open, and every client got the overload reply (no other status, no socket error)."""
    problems = [
        f"{label} {r[key]}"
        for key, label in (
            ("reached_worker", "reached the worker"),
            ("streams_failed", "ext_proc streams failed"),
            ("failure_mode_allowed", "failed open"),
            ("message_timeouts", "message timeouts"),
            ("non_529", "answers other than 529"),
        )
        if r[key]
    ]
    errors = socket_error_count(r["socket_errors"])
    if errors:
        problems.append(f"socket errors {errors} ({r['socket_errors']})")
    if not r["requests"]:
        problems.append("no request answered")
    what = (
        "; ".join(problems)
        if problems
        else (
            "none reached the worker, no ext_proc stream failed, timed out or failed open, every "
            f"request answered 529 ({r['requests']:,})"
        )
    )
    return f"- {r['clients']:,} clients: {what}: {resultfile.verdict(not problems)}"


def render(data: dict[str, Any]) -> str:
    """The Markdown report of a ``make bench-storm`` run, from its results JSON."""
    s = data["settings"]
    rows = [HEADER, "|" + "---|" * (HEADER.count(" | ") + 1), *map(row, data["results"])]
    return "\n".join([
        resultfile.header("Storm: every worker busy, thousands of keep-alive clients", data["run"]),
        f"wrk -t{s['threads']} -cN -d{s['duration']:g}s of short chat POSTs, one run per "
        f"client count on a fresh stack: Envoy on `envoy/{s['config']}`, the extproc "
        f"(`--grpc-server {s['grpc_server']}`) and a worker that is an Envoy `direct_response` "
        "(a request that reaches it is a 200 and counts in `cluster.workers.upstream_rq_total`). "
        "The one worker reports a load above the threshold, so every answer should be the "
        "extproc's 529. Envoy's `/stats` read before and after each run (deltas); its log "
        f"searched for `protocol_error`. Open files: the soft limit raised to {s['nofile']:,}.\n",
        "\n".join(rows) + "\n",
        "### Goal\n\nWith every worker busy and thousands of concurrent clients, no request "
        "reaches a worker because the extproc was slow or failed, and every client gets an "
        "answer.\n\n" + "\n".join(goal(r) for r in data["results"]) + "\n",
    ])  # fmt: skip


RESULTS_NAME = "storm"


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--clients", type=int, nargs="+", default=[4000],
                        help="keep-alive wrk connections (one run each)")  # fmt: skip
    parser.add_argument("--duration", type=float, default=8.0, help="seconds per run")
    parser.add_argument("--threads", type=int, default=2, help="wrk threads")
    parser.add_argument(
        "--config",
        default="envoy.yaml",
        choices=["envoy.yaml", "envoy-track-output.yaml"],
        help="Envoy config (under envoy/)",
    )
    parser.add_argument("--grpc-server", choices=["builtin", "grpcio"], default="builtin")
    parser.add_argument(
        "--out",
        type=Path,
        default=resultfile.DOCS,
        metavar="DIR",
        help=f"where {RESULTS_NAME}-results.json and .md are written (default: docs/)",
    )
    args = parser.parse_args(argv)
    for n in args.clients:
        if n < 1:
            parser.error(f"--clients: {n} is not a positive number of connections")
    if args.duration <= 0:
        parser.error(f"--duration: {args.duration} is not a positive number of seconds")
    hard = raise_nofile()
    for n in args.clients:
        if n * FD_PER_CLIENT + FD_SPARE > hard:
            parser.error(
                f"--clients {n} needs about {n * FD_PER_CLIENT + FD_SPARE} open files per "
                f"process, the hard limit (ulimit -Hn) is {hard}: use at most "
                f"{(hard - FD_SPARE) // FD_PER_CLIENT}"
            )
    if not shutil.which("wrk"):
        print("wrk not found: apt-get install wrk", file=sys.stderr)
        return 2
    run = resultfile.Run(
        resultfile.command_line("loadtest.storm", sys.argv[1:] if argv is None else argv)
    )
    results = []
    for n in args.clients:
        tmp = Path(tempfile.mkdtemp(prefix=f"storm-{n}-"))
        r = storm(
            n, args.duration, tmp, source=ROOT / "envoy" / args.config,
            grpc_server=args.grpc_server, threads=args.threads,
        )  # fmt: skip
        print(row(asdict(r)), file=sys.stderr, flush=True)
        results.append(asdict(r))
    data = {
        "settings": {"duration": args.duration, "threads": args.threads, "config": args.config,
                     "grpc_server": args.grpc_server, "clients": args.clients, "nofile": hard},
        "results": results,
        "run": run.finish(),
    }  # fmt: skip
    print(resultfile.write(args.out, RESULTS_NAME, data, render))
    return 0


if __name__ == "__main__":
    from loadtest import run_stoppable

    sys.exit(run_stoppable(main))
