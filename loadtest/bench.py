"""Side-by-side latency and throughput benchmark: Envoy -> worker vs Envoy -> extproc -> worker.

One Envoy has two listeners on the same worker cluster: ``direct`` (no ext_proc) and
``extproc`` (the repo's envoy/envoy.yaml filter chain). The worker is a second Envoy
answering every request with a fixed chat completion (direct_response), so the worker
costs the same on both paths and is never the bottleneck. Load comes from ``wrk``
(keep-alive HTTP/1.1, short non-streaming POSTs). Runs alternate direct / extproc for
several rounds; the report gives medians across rounds and the difference.
``--grpc-server builtin grpcio`` measures both gRPC servers in the same run (one
extproc and one Envoy each, all runs alternating).

    python -m loadtest.bench [--duration 5] [--rounds 3] [--response-phase SEND|SKIP]
                             [--grpc-server builtin grpcio]

Needs ``wrk`` on PATH (Debian: apt-get install wrk).
"""

from __future__ import annotations

import argparse
import copy
import json
import os
import re
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

from extproc.devstack import (
    Envoy,
    Extproc,
    Proc,
    Publisher,
    checkout_file,
    envoy_binary,
    free_port,
    http,
    metric_value,
    wait_until,
)

BODY = {
    "model": "bench",
    "messages": [{"role": "user", "content": "Say hi in one word."}],
    "max_tokens": 4,
}
REPLY = json.dumps(
    {
        "id": "cmpl-bench",
        "object": "chat.completion",
        "model": "bench",
        "choices": [
            {"index": 0, "message": {"role": "assistant", "content": "Hi"}, "finish_reason": "stop"}
        ],
        "usage": {"prompt_tokens": 5, "completion_tokens": 1, "total_tokens": 6},
    }
)


HCM = "type.googleapis.com/envoy.extensions.filters.network.http_connection_manager.v3."
ROUTER = "type.googleapis.com/envoy.extensions.filters.http.router.v3.Router"
ROUTER_FILTER = "envoy.filters.http.router"


def worker_config(port: int, admin_port: int) -> dict[str, Any]:
    """An Envoy that answers every request with REPLY: a worker that costs ~nothing."""
    route = {
        "match": {"prefix": "/"},
        "direct_response": {"status": 200, "body": {"inline_string": REPLY}},
        "response_headers_to_add": [
            {"header": {"key": "content-type", "value": "application/json"}}
        ],
    }
    hcm = {
        "@type": HCM + "HttpConnectionManager",
        "stat_prefix": "worker",
        "route_config": {"virtual_hosts": [{"name": "all", "domains": ["*"], "routes": [route]}]},
        "http_filters": [{"name": "envoy.filters.http.router", "typed_config": {"@type": ROUTER}}],
    }
    listener = {
        "name": "worker",
        "address": {"socket_address": {"address": "127.0.0.1", "port_value": port}},
        "filter_chains": [
            {
                "filters": [
                    {"name": "envoy.filters.network.http_connection_manager", "typed_config": hcm}
                ]
            }
        ],
    }
    admin = {"address": {"socket_address": {"address": "127.0.0.1", "port_value": admin_port}}}
    return {"admin": admin, "static_resources": {"listeners": [listener]}}


def add_direct_listener(port: int, response_phase: str) -> Any:
    def tweak(cfg: dict[str, Any]) -> None:
        listeners = cfg["static_resources"]["listeners"]
        main = listeners[0]["filter_chains"][0]["filters"][0]["typed_config"]
        for f in main["http_filters"]:
            if f["name"] == "envoy.filters.http.ext_proc":
                f["typed_config"]["processing_mode"]["response_header_mode"] = response_phase
        direct = copy.deepcopy(listeners[0])
        direct["name"] = "direct"
        direct["address"]["socket_address"]["port_value"] = port
        hcm = direct["filter_chains"][0]["filters"][0]["typed_config"]
        hcm["stat_prefix"] = "direct"
        hcm["http_filters"] = [f for f in hcm["http_filters"] if f["name"] == ROUTER_FILTER]
        for vh in hcm["route_config"]["virtual_hosts"]:
            for route in vh["routes"]:
                route.pop("typed_per_filter_config", None)
        listeners.append(direct)

    return tweak


LUA = """
wrk.method = "POST"
wrk.body   = [[%s]]
wrk.headers["Content-Type"] = "application/json"
"""

_UNITS = {"us": 1e-3, "ms": 1.0, "s": 1000.0}


def _ms(text: str) -> float:
    m = re.match(r"([\d.]+)(us|ms|s)", text)
    assert m, text
    return float(m.group(1)) * _UNITS[m.group(2)]


def run_wrk(
    url: str, body: dict[str, Any], conns: int, duration: float, tmp: Path
) -> dict[str, float]:
    script = tmp / f"post-{abs(hash(json.dumps(body)))}.lua"
    script.write_text(LUA % json.dumps(body))
    out = subprocess.run(
        [
            "wrk",
            "-t1",
            f"-c{conns}",
            f"-d{duration:g}s",
            "--latency",
            "-s",
            str(script),
            url + "/v1/chat/completions",
        ],
        capture_output=True,
        text=True,
        timeout=duration + 30,
        check=True,
    ).stdout
    pct = dict(re.findall(r"^\s+(50|99)%\s+(\S+)$", out, re.M))
    rps = float(re.search(r"Requests/sec:\s+([\d.]+)", out).group(1))  # type: ignore[union-attr]
    total = int(re.search(r"(\d+) requests in", out).group(1))  # type: ignore[union-attr]
    m = re.search(r"Non-2xx or 3xx responses: (\d+)", out)
    non2xx = int(m.group(1)) if m else 0
    errors = re.search(r"Socket errors: (.*)", out)
    return {
        "p50": _ms(pct["50"]),
        "p99": _ms(pct["99"]),
        "rps": rps,
        "total": total,
        "non2xx": non2xx,
        "socket_errors": 0 if not errors else 1,
    }


def cpu_seconds(pid: int) -> float:
    """User + system CPU seconds a process has used so far (from /proc)."""
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def _label(kind: str, servers: list[str]) -> str:
    return "extproc" if len(servers) == 1 else f"extproc ({kind})"


def main() -> int:
    parser = argparse.ArgumentParser(
        prog="python -m loadtest.bench", description=__doc__.split("\n\n")[0]
    )
    parser.add_argument("--duration", type=float, default=5.0, help="seconds per run")
    parser.add_argument("--rounds", type=int, default=3, help="alternating rounds per case")
    parser.add_argument("--concurrency", type=int, nargs="+", default=[1, 32])
    parser.add_argument(
        "--response-phase",
        choices=["SEND", "SKIP"],
        default="SEND",
        help="ext_proc response_header_mode: SEND (default config: worker-side rejections "
        "are turned into the frontend reply) or SKIP (lean: one message less per request)",
    )
    parser.add_argument(
        "--config",
        default="envoy.yaml",
        choices=["envoy.yaml", "envoy-track-output.yaml"],
        help="Envoy config (under envoy/) of the extproc listener",
    )
    parser.add_argument(
        "--grpc-server",
        nargs="+",
        choices=["builtin", "grpcio"],
        default=["builtin"],
        help="the extproc's gRPC server(s); several are measured side by side in one run",
    )
    args = parser.parse_args()
    if not shutil.which("wrk"):
        print("wrk not found: apt-get install wrk", file=sys.stderr)
        return 2

    tmp = Path(tempfile.mkdtemp(prefix="bench-"))
    procs: list[Any] = []
    try:
        wport, wadmin = free_port(), free_port()
        wcfg = tmp / "worker.json"
        wcfg.write_text(json.dumps(worker_config(wport, wadmin)))
        worker = Proc(
            "worker-envoy",
            [
                envoy_binary(),
                "-c",
                str(wcfg),
                "--disable-hot-restart",
                "--concurrency",
                "1",
                "-l",
                "error",
            ],
            tmp,
        )
        procs.append(worker)
        wait_until(lambda: http("GET", f"http://127.0.0.1:{wport}/")[0] == 200, 20, "worker")

        servers = args.grpc_server
        exts: dict[str, Extproc] = {}
        urls = {}
        # The processes whose CPU a run through that path costs: its Envoy, its extproc.
        pids: dict[str, list[int]] = {}
        pubs = []
        for kind in servers:
            ext = Extproc(
                tmp,
                [
                    "--active-prefill-tokens-threshold",
                    "1000",
                    "--log-level",
                    "WARNING",
                    "--worker-ttl",
                    "86400",
                    "--grpc-server",
                    kind,
                ],
            )
            procs.append(ext)
            exts[kind] = ext
            direct_port = free_port()
            envoy = Envoy(
                tmp,
                ext,
                [wport],
                tweak=add_direct_listener(direct_port, args.response_phase),
                source=checkout_file(f"envoy/{args.config}"),
            )
            procs.append(envoy)
            pub = Publisher(ext.event_endpoint)
            pub.announce(ext, "bench-1", "bench", f"127.0.0.1:{wport}", kv_total_blocks=1000)
            pub.announce(ext, "busy-1", "busy", f"127.0.0.1:{wport}", kv_total_blocks=1000)
            pub.load("busy-1", active_prefill_tokens=5000)
            wait_until(lambda ext=ext: ext.workers()["busy-1"]["state"] == "busy", 5, "busy worker")
            pubs.append(pub)
            if "direct" not in urls:
                urls["direct"] = f"http://127.0.0.1:{direct_port}"
                pids["direct"] = [envoy.proc.pid]
            urls[_label(kind, servers)] = envoy.url
            pids[_label(kind, servers)] = [envoy.proc.pid, ext.proc.pid]

        def measured(name: str, body: dict[str, Any], conns: int) -> dict[str, float]:
            before = [cpu_seconds(pid) for pid in pids[name]]
            r = run_wrk(urls[name], body, conns, args.duration, tmp)
            for i, pid in enumerate(pids[name]):
                r[f"cpu{i}"] = (cpu_seconds(pid) - before[i]) / max(r["total"], 1) * 1e6
            return r

        def keep_busy() -> None:  # the busy worker stays busy past the TTL for long runs
            for pub in pubs:
                pub.load("busy-1", active_prefill_tokens=5000)

        for url in urls.values():  # warm up connections and caches
            run_wrk(url, BODY, 4, 1, tmp)

        results: dict[tuple[str, int], list[dict[str, float]]] = {}
        for conns in args.concurrency:
            for _ in range(args.rounds):
                for name in urls:
                    keep_busy()
                    r = measured(name, BODY, conns)
                    assert r["non2xx"] == 0, f"{name} c={conns}: {r['non2xx']} non-2xx replies"
                    results.setdefault((name, conns), []).append(r)
        rejections: dict[str, list[dict[str, float]]] = {}
        for _ in range(args.rounds):
            for name in urls:
                if name == "direct":
                    continue
                keep_busy()
                r = measured(name, {**BODY, "model": "busy"}, 32)
                assert r["non2xx"] == r["total"], "expected only 529s"
                rejections.setdefault(name, []).append(r)

        def med(rs: list[dict[str, float]], key: str) -> float:
            return statistics.median(r[key] for r in rs)

        print(
            f"\nwrk -t1, {args.duration:g} s per run, {args.rounds} alternating rounds, "
            "medians; worker = Envoy direct_response; one Envoy per extproc, same cluster; "
            f"ext_proc response_header_mode {args.response_phase}; envoy/{args.config}\n"
        )
        print("| concurrency | path | p50 ms | p99 ms | req/s |")
        print("|---|---|---|---|---|")
        for conns in args.concurrency:
            d = {k: med(results[("direct", conns)], k) for k in ("p50", "p99", "rps")}
            print(f"| {conns} | direct | {d['p50']:.3f} | {d['p99']:.3f} | {d['rps']:.0f} |")
            for name in urls:
                if name == "direct":
                    continue
                e = {k: med(results[(name, conns)], k) for k in ("p50", "p99", "rps")}
                print(f"| {conns} | {name} | {e['p50']:.3f} | {e['p99']:.3f} | {e['rps']:.0f} |")
                print(
                    f"| {conns} | {name}: added / ratio | +{e['p50'] - d['p50']:.3f} | "
                    f"+{e['p99'] - d['p99']:.3f} | {e['rps'] / d['rps']:.2f}x |"
                )
        for name, rs in rejections.items():
            print(
                f"| 32 | {name}, all busy (529) | {med(rs, 'p50'):.3f} | {med(rs, 'p99'):.3f} "
                f"| {med(rs, 'rps'):.0f} |"
            )
        print("\nCPU per request, µs (user + system, from /proc; medians):\n")
        print("| concurrency | path | Envoy | extproc |")
        print("|---|---|---|---|")
        for conns in args.concurrency:
            for name in urls:
                rs = results[(name, conns)]
                ext_cpu = f"{med(rs, 'cpu1'):.0f}" if name != "direct" else "—"
                print(f"| {conns} | {name} | {med(rs, 'cpu0'):.0f} | {ext_cpu} |")
        for name, rs in rejections.items():
            print(f"| 32 | {name}, all busy | {med(rs, 'cpu0'):.0f} | {med(rs, 'cpu1'):.0f} |")
        for kind, ext in exts.items():
            text = ext.metrics()
            routed, over = (
                metric_value(text, "extproc_decisions_total", {"outcome": outcome}) or 0
                for outcome in ("routed", "overloaded")
            )
            print(f"\nextproc ({kind}) decisions: routed={routed:g} overloaded={over:g}")
        return 0
    finally:
        for p in reversed(procs):
            p.stop()
        time.sleep(0)


if __name__ == "__main__":
    sys.exit(main())
