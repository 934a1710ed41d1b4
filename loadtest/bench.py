"""Side-by-side latency and throughput benchmark: Envoy -> worker vs Envoy -> extproc -> worker.

One Envoy has two listeners on the same worker cluster: ``direct`` (no ext_proc) and
``extproc`` (the repo's envoy/envoy.yaml filter chain). The worker is a second Envoy
answering every request with a fixed chat completion (direct_response), so the worker
costs the same on both paths and is never the bottleneck. Load comes from ``wrk``
(keep-alive HTTP/1.1, short non-streaming POSTs). Runs alternate direct / extproc for
several rounds; the report gives medians across rounds and the difference.

``--prompt-sizes short 1k 64k 512k`` repeats every case with a chat body of about that
many bytes (the prompt is in the one user message; ``model`` is the first key), so the
cost against prompt size is measured side by side with the direct path in one run.
Rejections are measured in two states: ``all`` (every worker of every model busy: the
answer cannot depend on the body) and ``model`` (the requested model's only worker is
busy, another model has a free one: the body must be read to know the model).
CPU per request is read from /proc for Envoy and the extproc around each run.
``--grpc-server builtin grpcio`` measures both gRPC servers in the same run (one
extproc and one Envoy each, all runs alternating).

    python -m loadtest.bench [--duration 5] [--rounds 3] [--response-phase SEND|SKIP]
                             [--grpc-server builtin grpcio] [--prompt-sizes short 64k 512k]
                             [--busy-cases all model] [--request-path prefix exact]

Needs ``wrk`` on PATH (Debian: apt-get install wrk).
"""

from __future__ import annotations

import argparse
import copy
import functools
import json
import os
import re
import shutil
import signal
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


# Far above any prompt the bench sends (512 KB is ~130k estimated tokens, x32 in flight):
# only the busy worker's reported load crosses it.
PREFILL_THRESHOLD = 100_000_000
BUSY_LOAD = 2 * PREFILL_THRESHOLD


def prompt_size(text: str) -> int | None:
    """``short`` (None: the fixed short prompt), or bytes as ``1k``, ``64k``, ``512k``, ``2m``."""
    m = re.fullmatch(r"(\d+)([kKmM]?)", text)
    if text == "short":
        return None
    if not m or int(m.group(1)) <= 0:
        raise argparse.ArgumentTypeError(
            f"--prompt-sizes: {text!r} is not a size; expected 'short' or a positive number "
            "of bytes with an optional k or m suffix (1k, 64k, 512k)"
        )
    return int(m.group(1)) * {"": 1, "k": 1024, "m": 1024 * 1024}[m.group(2).lower()]


def chat_body(model: str, size: int | None) -> dict[str, Any]:
    """The chat request of ``model`` whose JSON is ``size`` bytes (None: BODY's prompt)."""
    body = {**BODY, "model": model}
    if size is None:
        return body
    empty = len(json.dumps({**body, "messages": [{"role": "user", "content": ""}]}))
    words = "lorem ipsum dolor sit amet " * (max(size - empty, 1) // 27 + 1)
    body["messages"] = [{"role": "user", "content": words[: max(size - empty, 1)]}]
    return body


def size_label(size: int | None) -> str:
    if size is None:
        return "short"
    return f"{size // 1024}k" if size % 1024 == 0 else f"{size}B"


HCM = "type.googleapis.com/envoy.extensions.filters.network.http_connection_manager.v3."
ROUTER = "type.googleapis.com/envoy.extensions.filters.http.router.v3.Router"
ROUTER_FILTER = "envoy.filters.http.router"


def worker_config(ports: list[int], admin_port: int) -> dict[str, Any]:
    """An Envoy that answers every request with REPLY: workers that cost ~nothing.

    One listener per port: each simulated worker has its own endpoint.
    """
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
    listeners = [
        {
            "name": f"worker-{port}",
            "address": {"socket_address": {"address": "127.0.0.1", "port_value": port}},
            "filter_chains": [
                {
                    "filters": [
                        {
                            "name": "envoy.filters.network.http_connection_manager",
                            "typed_config": hcm,
                        }
                    ]
                }
            ],
        }
        for port in ports
    ]
    admin = {"address": {"socket_address": {"address": "127.0.0.1", "port_value": admin_port}}}
    return {"admin": admin, "static_resources": {"listeners": listeners}}


LUA_FILTER = "envoy.filters.http.lua"


def add_direct_listener(port: int, response_phase: str | None, path: str = "prefix") -> Any:
    """Add the ``direct`` listener (router only); ``path`` ``exact`` drops the prefix reader
    from the extproc listener and buffers every body (the request path before it)."""

    def tweak(cfg: dict[str, Any]) -> None:
        listeners = cfg["static_resources"]["listeners"]
        main = listeners[0]["filter_chains"][0]["filters"][0]["typed_config"]
        if path == "exact":
            main["http_filters"] = [f for f in main["http_filters"] if f["name"] != LUA_FILTER]
        for f in main["http_filters"]:
            if f["name"] == "envoy.filters.http.ext_proc" and response_phase:
                f["typed_config"]["processing_mode"]["response_header_mode"] = response_phase
            if f["name"] == "envoy.filters.http.ext_proc" and path == "exact":
                f["typed_config"]["processing_mode"]["request_body_mode"] = "BUFFERED"
        direct = copy.deepcopy(listeners[0])
        direct["name"] = "direct"
        direct["address"]["socket_address"]["port_value"] = port
        hcm = direct["filter_chains"][0]["filters"][0]["typed_config"]
        hcm["stat_prefix"] = "direct"
        # Only the router: no ext_proc (nor any filter the extproc path adds).
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
    if "50" not in pct or "99" not in pct:
        raise RuntimeError(f"wrk reported no latency distribution for {url}:\n{out}")
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


def profile_run(out: Path, pids: list[int], run: Any) -> None:
    """Profile Envoy (perf, ``pids[0]``) and the extproc (py-spy, ``pids[1]``) during ``run``.

    Writes ``out``-envoy.txt (perf report, self time by symbol) and ``out``-extproc.txt
    (py-spy's collapsed stacks: self samples by function, then whole stacks)."""
    spy = shutil.which("py-spy") or str(Path(sys.executable).with_name("py-spy"))
    tools = []
    perf_data = out.with_suffix(".perf.data")
    if shutil.which("perf"):
        tools.append(
            subprocess.Popen(
                [
                    "perf",
                    "record",
                    "-q",
                    "-F",
                    "999",
                    "-g",
                    "-p",
                    str(pids[0]),
                    "-o",
                    str(perf_data),
                ],
                stdout=subprocess.DEVNULL,
                stderr=subprocess.DEVNULL,
            )
        )
    collapsed = out.with_suffix(".collapsed")
    if Path(spy).exists():
        tools.append(
            subprocess.Popen(
                [spy, "record", "-r", "200", "-p", str(pids[1]), "-f", "raw", "-o", str(collapsed)],
                stdout=subprocess.DEVNULL,
                stderr=subprocess.DEVNULL,
            )
        )
    time.sleep(1.0)  # both attached
    result = run()
    for t in tools:
        t.send_signal(signal.SIGINT)
    for t in tools:
        t.wait(30)
    if perf_data.exists():
        report = subprocess.run(
            ["perf", "report", "-i", str(perf_data), "--no-children", "--stdio", "-g", "none",
             "--sort", "dso,symbol", "--percent-limit", "0.7"],
            capture_output=True, text=True, timeout=120,
        ).stdout  # fmt: skip
        Path(f"{out}-envoy.txt").write_text(f"run: {result}\n{report}")
        perf_data.unlink()
    if collapsed.exists():
        self_time: dict[str, int] = {}
        total = 0
        lines = collapsed.read_text().splitlines()
        for line in lines:
            stack, _, n = line.rpartition(" ")
            total += int(n)
            leaf = stack.rsplit(";", 1)[-1]
            self_time[leaf] = self_time.get(leaf, 0) + int(n)
        top = sorted(self_time.items(), key=lambda kv: -kv[1])[:30]
        text = "\n".join(f"{n * 100 / max(total, 1):5.1f}%  {leaf}" for leaf, n in top)
        Path(f"{out}-extproc.txt").write_text(f"run: {result}\nself time by function:\n{text}\n")


def _label(kind: str, servers: list[str], path: str, paths: list[str]) -> str:
    parts = ([kind] if len(servers) > 1 else []) + ([path] if len(paths) > 1 else [])
    return f"extproc ({', '.join(parts)})" if parts else "extproc"


def main() -> int:
    parser = argparse.ArgumentParser(
        prog="python -m loadtest.bench", description=__doc__.split("\n\n")[0]
    )
    parser.add_argument("--duration", type=float, default=5.0, help="seconds per run")
    parser.add_argument("--rounds", type=int, default=3, help="alternating rounds per case")
    parser.add_argument("--concurrency", type=int, nargs="+", default=[1, 32])
    parser.add_argument(
        "--prompt-sizes",
        type=prompt_size,
        nargs="+",
        default=[None],
        metavar="SIZE",
        help="request body sizes: 'short' (default) and/or bytes as 1k, 64k, 512k",
    )
    parser.add_argument(
        "--busy-cases",
        nargs="*",
        choices=["all", "model"],
        default=["all", "model"],
        help="rejection runs at c=32: every worker busy ('all'), or only the requested "
        "model's worker ('model'); none to skip",
    )
    parser.add_argument(
        "--response-phase",
        choices=["SEND", "SKIP"],
        default=None,
        help="override the config's ext_proc response_header_mode: SEND (worker-side "
        "rejections are turned into the frontend reply by the extproc) or SKIP",
    )
    parser.add_argument(
        "--config",
        default="envoy.yaml",
        help="Envoy config (a file under envoy/ or a path) of the extproc listener",
    )
    parser.add_argument(
        "--grpc-server",
        nargs="+",
        choices=["builtin", "grpcio"],
        default=["builtin"],
        help="the extproc's gRPC server(s); several are measured side by side in one run",
    )
    parser.add_argument(
        "--request-path",
        nargs="+",
        choices=["prefix", "exact"],
        default=["prefix"],
        help="prefix: the config as is (decided on the request headers when the body starts "
        "with model); exact: without the prefix reader, every body buffered and sent to the "
        "extproc. Several are measured side by side (one extproc and Envoy each)",
    )
    parser.add_argument(
        "--extproc-arg",
        action="append",
        default=[],
        metavar="ARG",
        help="extra extproc command-line argument (repeat), e.g. --extproc-arg=--tokenizer=...",
    )
    parser.add_argument(
        "--profile",
        type=Path,
        default=None,
        metavar="DIR",
        help="after the runs, profile one c=32 run per prompt size: the extproc with py-spy "
        "(pip install py-spy) and Envoy with perf (Debian: linux-perf); summaries in DIR",
    )
    args = parser.parse_args()
    if not shutil.which("wrk"):
        print("wrk not found: apt-get install wrk", file=sys.stderr)
        return 2
    config = Path(args.config)
    if not config.is_file():
        config = checkout_file(f"envoy/{args.config}")
    if not config.is_file():
        print(f"--config: {args.config!r} is not a file here or under envoy/", file=sys.stderr)
        return 2

    tmp = Path(tempfile.mkdtemp(prefix="bench-"))
    procs: list[Any] = []
    try:
        # One endpoint per worker: the "bench" model's and the "busy" model's.
        wport, busy_port, wadmin = free_port(), free_port(), free_port()
        wcfg = tmp / "worker.json"
        wcfg.write_text(json.dumps(worker_config([wport, busy_port], wadmin)))
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
        pubs: list[tuple[Extproc, Publisher]] = []
        combos = [(k, path) for k in servers for path in args.request_path]
        for kind, path in combos:
            label = _label(kind, servers, path, args.request_path)
            ext = Extproc(
                tmp,
                [
                    "--active-prefill-tokens-threshold",
                    str(PREFILL_THRESHOLD),
                    "--log-level",
                    "WARNING",
                    "--worker-ttl",
                    "86400",
                    "--grpc-server",
                    kind,
                    *args.extproc_arg,
                ],
            )
            procs.append(ext)
            exts[label] = ext
            direct_port = free_port()
            envoy = Envoy(
                tmp,
                ext,
                [wport, busy_port],
                tweak=add_direct_listener(direct_port, args.response_phase, path),
                source=config,
            )
            procs.append(envoy)
            pub = Publisher(ext.event_endpoint)
            pub.announce(ext, "bench-1", "bench", f"127.0.0.1:{wport}", kv_total_blocks=1000)
            pub.announce(ext, "busy-1", "busy", f"127.0.0.1:{busy_port}", kv_total_blocks=1000)
            pubs.append((ext, pub))
            if "direct" not in urls:
                urls["direct"] = f"http://127.0.0.1:{direct_port}"
                pids["direct"] = [envoy.proc.pid]
            urls[label] = envoy.url
            pids[label] = [envoy.proc.pid, ext.proc.pid]

        def states_are(ext: Extproc, busy: set[str]) -> bool:
            states = ext.workers()
            return all((states[w]["state"] == "busy") == (w in busy) for w in ("bench-1", "busy-1"))

        def set_busy(busy: set[str]) -> None:
            """Workers in ``busy`` report a load above the threshold, the others none."""
            for ext, pub in pubs:
                for wid in ("bench-1", "busy-1"):
                    load = BUSY_LOAD if wid in busy else 0
                    pub.load(wid, active_prefill_tokens=load)
                wait_until(
                    functools.partial(states_are, ext, busy), 5, f"workers busy: {sorted(busy)}"
                )

        def measured(name: str, body: dict[str, Any], conns: int) -> dict[str, float]:
            before = [cpu_seconds(pid) for pid in pids[name]]
            try:
                r = run_wrk(urls[name], body, conns, args.duration, tmp)
            except RuntimeError:  # one bad run (a loaded machine): once more
                before = [cpu_seconds(pid) for pid in pids[name]]
                r = run_wrk(urls[name], body, conns, args.duration, tmp)
            for i, pid in enumerate(pids[name]):
                r[f"cpu{i}"] = (cpu_seconds(pid) - before[i]) / max(r["total"], 1) * 1e6
            print(
                f"  {name} c={conns} {body['model']} {len(json.dumps(body))} B: {r}",
                file=sys.stderr,
            )
            return r

        set_busy({"busy-1"})
        for url in urls.values():  # warm up connections and caches
            run_wrk(url, BODY, 4, 1, tmp)

        # (size, case, concurrency, path) -> runs; case "ok" = accepted requests.
        results: dict[tuple[str, str, int, str], list[dict[str, float]]] = {}
        sizes = [size_label(s) for s in args.prompt_sizes]
        for size, label in zip(args.prompt_sizes, sizes, strict=True):
            body = chat_body("bench", size)
            set_busy({"busy-1"})
            for conns in args.concurrency:
                for _ in range(args.rounds):
                    for name in urls:
                        r = measured(name, body, conns)
                        if r["non2xx"]:
                            sample = http("POST", urls[name] + "/v1/chat/completions", body)
                            raise AssertionError(
                                f"{name} c={conns} {label}: {r['non2xx']} non-2xx, e.g. "
                                f"{sample[0]} {sample[2][:200]!r}"
                            )
                        results.setdefault((label, "ok", conns, name), []).append(r)
            for case in args.busy_cases:
                set_busy({"bench-1", "busy-1"} if case == "all" else {"busy-1"})
                busy_body = chat_body("bench" if case == "all" else "busy", size)
                for _ in range(args.rounds):
                    for name in urls:
                        if name == "direct":
                            continue
                        r = measured(name, busy_body, 32)
                        assert r["non2xx"] == r["total"], f"{name}: expected only 529s"
                        results.setdefault((label, case, 32, name), []).append(r)
            set_busy({"busy-1"})

        if args.profile is not None:
            args.profile.mkdir(parents=True, exist_ok=True)
            name = next(n for n in urls if n != "direct")
            for size, label in zip(args.prompt_sizes, sizes, strict=True):
                for case, model in (("ok", "bench"), ("all", "bench")):
                    set_busy({"bench-1", "busy-1"} if case == "all" else {"busy-1"})
                    profile_run(
                        args.profile / f"{label}-{case}",
                        pids[name],
                        lambda model=model, size=size: run_wrk(
                            urls[name], chat_body(model, size), 32, args.duration, tmp
                        ),
                    )
            set_busy({"busy-1"})

        def med(rs: list[dict[str, float]], key: str) -> float:
            return statistics.median(r[key] for r in rs)

        phase = args.response_phase or "as configured"
        print(
            f"\nwrk -t1, {args.duration:g} s per run, {args.rounds} alternating rounds, "
            "medians; worker = Envoy direct_response; one Envoy per extproc, same cluster; "
            f"ext_proc response_header_mode {phase}; {config.name}; "
            f"{os.cpu_count()} CPUs, load average {os.getloadavg()[0]:.2f} at the end\n"
        )
        print("| prompt | c | path | p50 ms | p99 ms | req/s | Envoy µs/req | extproc µs/req |")
        print("|---|---|---|---|---|---|---|---|")
        for label in sizes:
            for conns in args.concurrency:
                d = results[(label, "ok", conns, "direct")]
                dv = {k: med(d, k) for k in ("p50", "p99", "rps", "cpu0")}
                print(
                    f"| {label} | {conns} | direct | {dv['p50']:.3f} | {dv['p99']:.3f} "
                    f"| {dv['rps']:.0f} | {dv['cpu0']:.0f} | — |"
                )
                for name in urls:
                    if name == "direct":
                        continue
                    rs = results[(label, "ok", conns, name)]
                    e = {k: med(rs, k) for k in ("p50", "p99", "rps", "cpu0", "cpu1")}
                    print(
                        f"| {label} | {conns} | {name} | {e['p50']:.3f} | {e['p99']:.3f} "
                        f"| {e['rps']:.0f} | {e['cpu0']:.0f} | {e['cpu1']:.0f} |"
                    )
                    print(
                        f"| {label} | {conns} | {name}: added / ratio | +{e['p50'] - dv['p50']:.3f}"
                        f" | +{e['p99'] - dv['p99']:.3f} | {e['rps'] / dv['rps']:.2f}x "
                        f"| {e['cpu0'] / dv['cpu0']:.2f}x | |"
                    )
            for case in args.busy_cases:
                dv_rps = (
                    med(results[(label, "ok", 32, "direct")], "rps")
                    if 32 in args.concurrency
                    else 0
                )
                for name in urls:
                    if name == "direct":
                        continue
                    rs = results[(label, case, 32, name)]
                    ratio = f" ({med(rs, 'rps') / dv_rps:.2f}x direct)" if dv_rps else ""
                    what = "every worker busy" if case == "all" else "model busy"
                    print(
                        f"| {label} | 32 | {name}, {what} (529) | {med(rs, 'p50'):.3f} "
                        f"| {med(rs, 'p99'):.3f} | {med(rs, 'rps'):.0f}{ratio} "
                        f"| {med(rs, 'cpu0'):.0f} | {med(rs, 'cpu1'):.0f} |"
                    )
        for kind, ext in exts.items():
            text = ext.metrics()
            routed, over = (
                metric_value(text, "extproc_decisions_total", {"outcome": outcome}) or 0
                for outcome in ("routed", "overloaded")
            )
            print(f"\n{kind} decisions: routed={routed:g} overloaded={over:g}")
        return 0
    finally:
        for p in reversed(procs):
            p.stop()
        time.sleep(0)


if __name__ == "__main__":
    sys.exit(main())
