"""Side-by-side latency and throughput benchmark: Envoy -> worker vs Envoy -> extproc -> worker.

One Envoy has two listeners on the same worker cluster: ``direct`` (no ext_proc) and
``extproc`` (the repo's envoy/envoy.yaml filter chain). The worker is a second Envoy
answering every request with a fixed chat completion (direct_response), so the worker
costs the same on both paths and is never the bottleneck. Load comes from ``wrk``
(keep-alive HTTP/1.1, short non-streaming POSTs). Runs alternate direct / extproc for
several rounds; the report gives medians across rounds and the difference.

Every case runs with the short prompt and again with chat bodies of about 64 KB and 512 KB
(``--prompt-sizes short 1k 64k 512k`` picks others; the prompt is in the one user message,
``model`` is the first key), so the cost against prompt size is measured side by side with
the direct path in one run.
Rejections are measured in two states: ``all`` (every worker of every model busy: the
answer cannot depend on the body) and ``model`` (the requested model's only worker is
busy, another model has a free one: the body must be read to know the model).
CPU per request is read from /proc for Envoy and the extproc around each run.
``--grpc-server builtin grpcio`` measures both gRPC servers in the same run (one
extproc and one Envoy each, all runs alternating).

Every run of wrk goes into ``docs/bench-results.json`` (``--out DIR`` elsewhere), with the
command, the time, ``/proc/loadavg`` before and after and the machine; ``bench-results.md``,
generated from that JSON, holds the medians, the goals with their verdicts and the profiles.

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
from loadtest import resultfile
from loadtest.resultfile import median

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


def profile_run(out: Path, pids: list[int], run: Any) -> dict[str, Any]:
    """Profile Envoy (perf, ``pids[0]``) and the extproc (py-spy, ``pids[1]``) during ``run``.

    Writes ``out``-envoy.txt (perf report, self time by symbol) and ``out``-extproc.txt
    (py-spy's collapsed stacks: self samples by function, then whole stacks). Returns what
    ``run`` returned, the extproc's CPU share of a core over it, and the py-spy summary
    (``[percent of samples, function]``, highest first) for the results file."""
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
                [
                    spy,
                    "record",
                    "--gil",
                    "-r",
                    "200",
                    "-p",
                    str(pids[1]),
                    "-f",
                    "raw",
                    "-o",
                    str(collapsed),
                ],
                stdout=subprocess.DEVNULL,
                stderr=subprocess.DEVNULL,
            )
        )
    time.sleep(1.0)  # both attached
    cpu0, t0 = [cpu_seconds(pid) for pid in pids], time.monotonic()
    result = run()
    wall = time.monotonic() - t0
    shares = [(cpu_seconds(pid) - c) / wall for pid, c in zip(pids, cpu0, strict=True)]
    for t in tools:
        t.send_signal(signal.SIGINT)
    for t in tools:
        t.wait(30)
    summary: dict[str, Any] = {
        "run": result,
        "envoy_core_share": shares[0],
        "extproc_core_share": shares[1],
        "extproc_self": [],
        "perf": perf_data.exists(),
    }
    if perf_data.exists():
        report = subprocess.run(
            ["perf", "report", "-i", str(perf_data), "--no-children", "--stdio", "-g", "none",
             "--sort", "dso,symbol", "--percent-limit", "0.7"],
            capture_output=True, text=True, timeout=120,
        ).stdout  # fmt: skip
        Path(f"{out}-envoy.txt").write_text(f"run: {result}\n{report}")
        perf_data.unlink()
    if collapsed.exists():
        top = self_time(collapsed.read_text().splitlines())
        summary["extproc_self"] = top
        text = "\n".join(f"{pct:5.1f}%  {leaf}" for pct, leaf in top)
        Path(f"{out}-extproc.txt").write_text(f"run: {result}\nself time by function:\n{text}\n")
    return summary


def self_time(collapsed: list[str], top: int = 30) -> list[list[Any]]:
    """py-spy's raw (collapsed) stacks, ``a;b;leaf N`` a line: the share of samples each
    leaf function took, in percent to 0.1, highest first, at most ``top``."""
    counts: dict[str, int] = {}
    total = 0
    for line in collapsed:
        stack, _, n = line.rpartition(" ")
        if not stack or not n.isdigit():
            continue
        total += int(n)
        leaf = stack.rsplit(";", 1)[-1]
        counts[leaf] = counts.get(leaf, 0) + int(n)
    ranked = sorted(counts.items(), key=lambda kv: (-kv[1], kv[0]))[:top]
    return [[round(n * 100 / max(total, 1), 1), leaf] for leaf, n in ranked]


def _label(kind: str, servers: list[str], path: str, paths: list[str]) -> str:
    parts = ([kind] if len(servers) > 1 else []) + ([path] if len(paths) > 1 else [])
    return f"extproc ({', '.join(parts)})" if parts else "extproc"


# --- the results file -----------------------------------------------------------------------

RESULTS_NAME = "bench"
METRICS = ("p50", "p99", "rps", "cpu0", "cpu1", "share0", "share1")


def medians(data: dict[str, Any]) -> dict[tuple[str, str, int, str], dict[str, float]]:
    """(prompt, case, concurrency, path) -> the median of each metric over its rounds."""
    groups: dict[tuple[str, str, int, str], list[dict[str, Any]]] = {}
    for r in data["runs"]:
        groups.setdefault((r["prompt"], r["case"], r["concurrency"], r["path"]), []).append(r)
    out = {}
    for key, rs in groups.items():
        out[key] = {
            m: median([r[m] for r in rs]) for m in METRICS if all(r.get(m) is not None for r in rs)
        }
    return out


def goal_factor(prompt: str) -> int:
    """The goals hold as they are for short prompts, and within 2x for larger ones."""
    return 1 if prompt == "short" else 2


def goals(data: dict[str, Any]) -> list[str]:
    """One line per goal and extproc path, from the medians: the figure, the bound, the
    verdict. A goal whose runs are not in the file is left out."""
    med = medians(data)
    s = data["settings"]
    many = len(data["paths"]) > 2
    lines = []
    for prompt in s["prompt_sizes"]:
        f = goal_factor(prompt)
        for path in data["paths"]:
            if path == "direct":
                continue
            who = f"{prompt}, {path}" if many else prompt
            d1, e1 = med.get((prompt, "ok", 1, "direct")), med.get((prompt, "ok", 1, path))
            if d1 and e1:
                for q, bound in (("p50", 0.5 * f), ("p99", 1.5 * f)):
                    added = e1[q] - d1[q]
                    lines.append(
                        f"- {who}: added latency at c=1, {q}: {added:+.3f} ms vs ≤ "
                        f"+{bound:g} ms: {resultfile.verdict(added <= bound)}"
                    )
            d32, e32 = med.get((prompt, "ok", 32, "direct")), med.get((prompt, "ok", 32, path))
            if d32 and e32:
                ratio, bound = e32["rps"] / d32["rps"], 0.8 / f
                lines.append(
                    f"- {who}: accepted req/s at c=32: {ratio:.2f}x direct vs ≥ {bound:g}x: "
                    f"{resultfile.verdict(ratio >= bound)}"
                )
            busy = med.get((prompt, "all", 32, path))
            if d32 and busy:
                ratio, bound = busy["rps"] / d32["rps"], 2.0 / f
                lines.append(
                    f"- {who}: rejections/s with every worker busy at c=32: {ratio:.2f}x "
                    f"direct's accepted req/s vs ≥ {bound:g}x: {resultfile.verdict(ratio >= bound)}"
                )
    return lines


TABLE_HEAD = (
    "| prompt | c | path | p50 ms | p99 ms | req/s | Envoy µs/req | extproc µs/req "
    "| Envoy core | extproc core |"
)


def _pct(value: float | None) -> str:
    return "—" if value is None else f"{value:.0%}"


def table(data: dict[str, Any]) -> list[str]:
    med = medians(data)
    s = data["settings"]
    rows = [TABLE_HEAD, "|---|---|---|---|---|---|---|---|---|---|"]
    for prompt in s["prompt_sizes"]:
        for c in s["concurrency"]:
            dv = med.get((prompt, "ok", c, "direct"))
            if dv is None:
                continue
            rows.append(
                f"| {prompt} | {c} | direct | {dv['p50']:.3f} | {dv['p99']:.3f} "
                f"| {dv['rps']:.0f} | {dv['cpu0']:.0f} | — | {_pct(dv.get('share0'))} | — |"
            )
            for path in data["paths"]:
                e = med.get((prompt, "ok", c, path))
                if path == "direct" or e is None:
                    continue
                rows.append(
                    f"| {prompt} | {c} | {path} | {e['p50']:.3f} | {e['p99']:.3f} "
                    f"| {e['rps']:.0f} | {e['cpu0']:.0f} | {e['cpu1']:.0f} "
                    f"| {_pct(e.get('share0'))} | {_pct(e.get('share1'))} |"
                )
                rows.append(
                    f"| {prompt} | {c} | {path}: added / ratio | {e['p50'] - dv['p50']:+.3f} "
                    f"| {e['p99'] - dv['p99']:+.3f} | {e['rps'] / dv['rps']:.2f}x "
                    f"| {e['cpu0'] / dv['cpu0']:.2f}x | | | |"
                )
        for case in s["busy_cases"]:
            d32 = med.get((prompt, "ok", 32, "direct"))
            for path in data["paths"]:
                b = med.get((prompt, case, 32, path))
                if path == "direct" or b is None:
                    continue
                ratio = f" ({b['rps'] / d32['rps']:.2f}x direct)" if d32 else ""
                what = "every worker busy" if case == "all" else "model busy"
                rows.append(
                    f"| {prompt} | 32 | {path}, {what} (529) | {b['p50']:.3f} | {b['p99']:.3f} "
                    f"| {b['rps']:.0f}{ratio} | {b['cpu0']:.0f} | {b['cpu1']:.0f} "
                    f"| {_pct(b.get('share0'))} | {_pct(b.get('share1'))} |"
                )
    return rows


def render(data: dict[str, Any]) -> str:
    """The Markdown report of a ``make bench`` run, from its results JSON."""
    s = data["settings"]
    parts = [
        resultfile.header(
            "Request path: Envoy straight to the worker vs through the extproc", data["run"]
        ),
        f"wrk -t1 keep-alive HTTP/1.1 non-streaming chat POSTs, {s['duration']:g} s per run, "
        f"rounds alternating between the paths: {s['rounds']}, medians of the rounds. The worker "
        "is an Envoy answering a fixed chat completion (`direct_response`); `direct` is a "
        "listener of the extproc path's Envoy with only the router, on the same cluster. "
        f"Envoy config `{s['config']}`, ext_proc response_header_mode "
        f"{s['response_phase'] or 'as configured'}, gRPC server {', '.join(s['grpc_servers'])}, "
        f"request path {', '.join(s['request_paths'])}. µs/req: user + system CPU (from "
        "`/proc`) per request; core: the process's CPU over the run's wall time (100 % = one "
        "core). Prompt sizes are JSON bodies of about that many bytes.\n",
        "\n".join(table(data)) + "\n",
    ]
    lines = goals(data)
    if lines:
        parts.append(
            "### Goals\n\nAt concurrency 1 the added latency is the extproc path's median p50 "
            "(p99) minus the direct path's; at concurrency 32, ratios of median req/s. Prompts "
            "other than `short` are held to the same goals within 2x (added latency bounds "
            "doubled, ratios halved).\n\n" + "\n".join(lines) + "\n"
        )
    if data.get("decisions"):
        parts.append(
            "### Decisions\n\n"
            + "\n".join(
                f"- {path}: routed {d['routed']:,.0f}, overloaded {d['overloaded']:,.0f}"
                for path, d in data["decisions"].items()
            )
            + "\n"
        )
    for prof in data.get("profiles", []):
        run = prof["run"]
        top = "\n".join(f"| {pct:.1f} % | `{leaf}` |" for pct, leaf in prof["extproc_self"][:12])
        parts.append(
            f"### Profile: {prof['prompt']}, {prof['case']}, c=32, {prof['path']}\n\n"
            f"One more run under py-spy (200 samples/s, those holding the GIL): {run['rps']:.0f} "
            f"req/s, p50 "
            f"{run['p50']:.3f} ms. Envoy used {prof['envoy_core_share']:.0%} of a core, the "
            f"extproc {prof['extproc_core_share']:.0%}. The extproc's self time by function "
            "(share of its samples):\n\n| samples | function |\n|---|---|\n" + top + "\n"
        )
    return "\n".join(parts)


def main(argv: list[str] | None = None) -> int:
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
        default=[None, 64 * 1024, 512 * 1024],
        metavar="SIZE",
        help="request body sizes: 'short' and/or bytes as 1k, 64k, 512k (default: short 64k "
        "512k, the sizes the goals name)",
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
        "(pip install py-spy) and Envoy with perf (Debian: linux-perf); summaries in DIR, "
        "the extproc's in the results file too",
    )
    parser.add_argument(
        "--out",
        type=Path,
        default=resultfile.DOCS,
        metavar="DIR",
        help=f"where {RESULTS_NAME}-results.json and .md are written (default: docs/)",
    )
    parser.add_argument(
        "--name",
        default=RESULTS_NAME,
        help="the results files' name, NAME-results.json and .md, so that a run of other "
        "options does not replace the default run's (default: %(default)s)",
    )
    args = parser.parse_args(argv)
    if not re.fullmatch(r"[\w.-]+", args.name):
        parser.error(f"--name: {args.name!r} is not a file name; expected letters, digits, . _ -")
    for flag, values in (("--concurrency", args.concurrency), ("--rounds", [args.rounds])):
        bad = [v for v in values if v < 1]
        if bad:
            parser.error(f"{flag}: {bad[0]} is not a count of 1 or more")
    if not args.duration > 0:
        parser.error(f"--duration: {args.duration:g} is not a positive number of seconds")
    if not shutil.which("wrk"):
        print("wrk not found: apt-get install wrk", file=sys.stderr)
        return 2
    config = Path(args.config)
    if not config.is_file():
        config = checkout_file(f"envoy/{args.config}")
    if not config.is_file():
        print(f"--config: {args.config!r} is not a file here or under envoy/", file=sys.stderr)
        return 2
    run = resultfile.Run(
        resultfile.command_line("loadtest.bench", sys.argv[1:] if argv is None else argv)
    )
    data = measure(args, config)
    data["run"] = run.finish()
    print(resultfile.write(args.out, args.name, data, render))
    return 0


def measure(args: argparse.Namespace, config: Path) -> dict[str, Any]:
    """Every run of the benchmark, as plain values for the results file."""
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
            def once() -> tuple[dict[str, float], list[float], float]:
                before = [cpu_seconds(pid) for pid in pids[name]]
                t0 = time.monotonic()
                r = run_wrk(urls[name], body, conns, args.duration, tmp)
                return r, before, time.monotonic() - t0

            try:
                r, before, wall = once()
            except RuntimeError:  # one bad run (a loaded machine): once more
                r, before, wall = once()
            for i, pid in enumerate(pids[name]):
                used = cpu_seconds(pid) - before[i]
                r[f"cpu{i}"] = used / max(r["total"], 1) * 1e6
                r[f"share{i}"] = used / wall
            print(
                f"  {name} c={conns} {body['model']} {len(json.dumps(body))} B: {r}",
                file=sys.stderr,
            )
            return r

        set_busy({"busy-1"})
        for url in urls.values():  # warm up connections and caches
            run_wrk(url, BODY, 4, 1, tmp)

        runs: list[dict[str, Any]] = []
        sizes = [size_label(s) for s in args.prompt_sizes]
        for size, label in zip(args.prompt_sizes, sizes, strict=True):
            body = chat_body("bench", size)
            set_busy({"busy-1"})
            for conns in args.concurrency:
                for rnd in range(args.rounds):
                    for name in urls:
                        r = measured(name, body, conns)
                        if r["non2xx"]:
                            sample = http("POST", urls[name] + "/v1/chat/completions", body)
                            raise AssertionError(
                                f"{name} c={conns} {label}: {r['non2xx']} non-2xx, e.g. "
                                f"{sample[0]} {sample[2][:200]!r}"
                            )
                        runs.append({"prompt": label, "case": "ok", "concurrency": conns,
                                     "path": name, "round": rnd + 1, **r})  # fmt: skip
            for case in args.busy_cases:
                set_busy({"bench-1", "busy-1"} if case == "all" else {"busy-1"})
                busy_body = chat_body("bench" if case == "all" else "busy", size)
                for rnd in range(args.rounds):
                    for name in urls:
                        if name == "direct":
                            continue
                        r = measured(name, busy_body, 32)
                        assert r["non2xx"] == r["total"], f"{name}: expected only 529s"
                        runs.append({"prompt": label, "case": case, "concurrency": 32,
                                     "path": name, "round": rnd + 1, **r})  # fmt: skip
            set_busy({"busy-1"})

        profiles = []
        if args.profile is not None:
            args.profile.mkdir(parents=True, exist_ok=True)
            name = next(n for n in urls if n != "direct")
            for size, label in zip(args.prompt_sizes, sizes, strict=True):
                for case, model in (("ok", "bench"), ("all", "bench")):
                    set_busy({"bench-1", "busy-1"} if case == "all" else {"busy-1"})
                    summary = profile_run(
                        args.profile / f"{label}-{case}",
                        pids[name],
                        lambda model=model, size=size: run_wrk(
                            urls[name], chat_body(model, size), 32, args.duration, tmp
                        ),
                    )
                    profiles.append({"prompt": label, "case": case, "path": name, **summary})
            set_busy({"busy-1"})

        decisions = {}
        for kind, ext in exts.items():
            text = ext.metrics()
            decisions[kind] = {
                outcome: metric_value(text, "extproc_decisions_total", {"outcome": outcome}) or 0
                for outcome in ("routed", "overloaded")
            }
        settings = {
            "duration": args.duration,
            "rounds": args.rounds,
            "concurrency": args.concurrency,
            "prompt_sizes": sizes,
            "busy_cases": args.busy_cases,
            "response_phase": args.response_phase,
            "config": config.name,
            "grpc_servers": servers,
            "request_paths": args.request_path,
            "extproc_args": args.extproc_arg,
        }
        return {
            "settings": settings,
            "paths": list(urls),
            "runs": runs,
            "profiles": profiles,
            "decisions": decisions,
        }
    finally:
        for p in reversed(procs):
            p.stop()


if __name__ == "__main__":
    from loadtest import run_stoppable

    sys.exit(run_stoppable(main))
