"""Consistency of several replicas: the same burst against one replica and against two.

``python -m loadtest.replicas [--burst 48] [--workers 3] [--rounds 3]``

Echo workers that hold every request for ``--hold`` seconds, a prefill threshold that
lets each worker take ``capacity`` requests of the burst's prompt size, and worker load
reports paused, so what a replica knows of the other's requests comes only from the
shared estimates. The same burst goes to one replica, then is split across two replicas
without sharing, then with sharing. Reported per case: requests admitted by each worker
(all are in flight at once, so this is each worker's peak in flight) and how far the
busiest worker goes beyond the single-replica case. Also measured: how long a threshold
POST on one replica takes to show on the other, and the estimate messages per second a
replica sends, idle and during the burst. Written to ``docs/replicas-results.json`` (with the
command, the time, ``/proc/loadavg`` before and after and the machine; ``--out DIR``
elsewhere) and ``replicas-results.md`` generated from it.
"""

from __future__ import annotations

import argparse
import concurrent.futures
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
    free_port,
    get_json,
    http,
    metric_value,
    start_echo_worker,
    wait_until,
)
from loadtest import resultfile
from loadtest.resultfile import median

PROMPT_TOKENS = 300
THRESHOLD = 1000  # busy above 1000 prefill tokens: 4 requests of 300 tokens per worker
CAPACITY = THRESHOLD // PROMPT_TOKENS + 1


def start_replica(
    log_dir: Path, xsub: str, xpub: str, ports: list[int], name: str, share: bool
) -> tuple[Extproc, Envoy]:
    args = [
        "--event-bind",
        "",
        "--event-connect",
        xpub,
        "--active-prefill-tokens-threshold",
        str(THRESHOLD),
        "--worker-ttl",
        "600",
        "--replica-id",
        name,
    ]
    if share:
        args += ["--replica-publish", xsub]
    ext = Extproc(log_dir, args)
    return ext, Envoy(log_dir, ext, ports)


def burst(envoys: list[Envoy], n: int, hold: float) -> dict[str, int]:
    """``n`` requests at once, round-robin over ``envoys``; admitted requests per worker."""
    body = {"model": "m", "messages": [{"role": "user", "content": "x" * (4 * PROMPT_TOKENS)}]}
    headers = {"x-test-delay-ms": str(int(hold * 1000))}

    def one(i: int) -> str | None:
        status, hdrs, _ = http(
            "POST", envoys[i % len(envoys)].url + "/v1/chat/completions", body, headers, 30
        )
        return hdrs.get("x-worker-id") if status == 200 else None

    with concurrent.futures.ThreadPoolExecutor(n) as pool:
        served = list(pool.map(one, range(n)))
    counts: dict[str, int] = {}
    for worker in served:
        if worker is not None:
            counts[worker] = counts.get(worker, 0) + 1
    return counts


def estimates_sent(ext: Extproc) -> float:
    text = ext.metrics()
    return metric_value(text, "extproc_replica_messages_sent_total", {"topic": "estimate"}) or 0.0


def propagation(a: Extproc, b: Extproc, rounds: int) -> list[float]:
    """Seconds from a threshold POST on ``a`` until ``b`` serves the same value."""
    took = []
    for i in range(rounds):
        value = 2000 + i
        started = time.monotonic()
        status, _, _ = http(
            "POST",
            a.admin + "/busy_threshold",
            {"model": "m", "active_prefill_tokens_threshold": value},
        )
        assert status == 200

        def seen(v: int = value) -> bool:
            entries = get_json(b.admin + "/busy_threshold")["thresholds"]
            return any(e["active_prefill_tokens_threshold"] == v for e in entries)

        wait_until(seen, 5, "threshold on the other replica")
        took.append(time.monotonic() - started)
    http(
        "POST",
        a.admin + "/busy_threshold",
        {"model": "m", "active_prefill_tokens_threshold": THRESHOLD},
    )
    return took


RESULTS_NAME = "replicas"
CASES = ("one", "two, not sharing", "two, sharing")
HEAD = (
    "| case | admitted per worker (each round) | admitted in total | busiest worker "
    "| beyond one replica |"
)


def table(data: dict[str, Any]) -> list[str]:
    workers = data["settings"]["workers"]
    cases = data["cases"]
    single = max(max(r.values(), default=0) for r in cases["one"])
    rows = [HEAD, "|---|---|---|---|---|"]
    for case in CASES:
        rounds = cases[case]
        per = "; ".join(",".join(str(r.get(f"w{i}", 0)) for i in range(workers)) for r in rounds)
        peak = max(max(r.values(), default=0) for r in rounds)
        totals = ", ".join(str(sum(r.values())) for r in rounds)
        rows.append(f"| {case} | {per} | {totals} | {peak} | {peak - single:+d} |")
    return rows


def render(data: dict[str, Any]) -> str:
    """The Markdown report of a ``make bench-replicas`` run, from its results JSON."""
    s = data["settings"]
    took = [t * 1000 for t in data["propagation_s"]]
    return "\n".join([
        resultfile.header("Replicas: one against two, with and without sharing", data["run"]),
        f"A burst of {s['burst']} requests of {s['prompt_tokens']} prompt tokens sent at once "
        f"from {s['burst']} threads, split evenly over the replicas; {s['workers']} echo "
        f"workers holding each request {s['hold']:g} s; prefill threshold {s['threshold']} "
        f"(capacity {s['capacity']} per worker); worker load reports paused, so what a "
        "replica knows of the other's requests comes only from the shared estimates; one "
        f"warm-up request per Envoy; rounds per case: {s['rounds']}.\n",
        "\n".join(table(data)) + "\n",
        f"- threshold POST on one replica seen on the other: median "
        f"{median(took):.1f} ms, max {max(took):.1f} ms ({len(took)} POSTs; the other "
        "replica is read right after the POST returns, then every 20 ms)",
        f"- estimate messages a replica sends: {data['estimates_idle_per_s']:.1f}/s idle, "
        f"{data['estimates_burst_per_s']:.1f}/s during the burst "
        "(`extproc_replica_messages_sent_total`)\n",
    ])  # fmt: skip


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--burst", type=int, default=48, help="requests per burst")
    parser.add_argument("--workers", type=int, default=3)
    parser.add_argument("--hold", type=float, default=2.0, help="seconds each request holds")
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument(
        "--out",
        type=Path,
        default=resultfile.DOCS,
        metavar="DIR",
        help=f"where {RESULTS_NAME}-results.json and .md are written (default: docs/)",
    )
    args = parser.parse_args(argv)
    for flag, value in (("--burst", args.burst), ("--workers", args.workers),
                        ("--rounds", args.rounds)):  # fmt: skip
        if value < 1:
            parser.error(f"{flag}: {value} is not a count of 1 or more")
    run = resultfile.Run(
        resultfile.command_line("loadtest.replicas", sys.argv[1:] if argv is None else argv)
    )
    log_dir = Path(tempfile.mkdtemp(prefix="replicas-bench-"))
    xsub, xpub = f"tcp://127.0.0.1:{free_port()}", f"tcp://127.0.0.1:{free_port()}"
    procs: list[Any] = [
        Proc(
            "forwarder",
            [sys.executable, "-m", "extproc.events.forwarder", "--xsub", xsub, "--xpub", xpub],
            log_dir,
        )
    ]
    workers = [start_echo_worker(log_dir, f"w{i}") for i in range(args.workers)]
    procs += [p for p, _ in workers]
    ports = [port for _, port in workers]
    pub = Publisher(xsub)
    results: dict[str, list[dict[str, int]]] = {case: [] for case in CASES}
    took: list[float] = []
    idle_rate = busy_rate = 0.0
    try:
        for case in CASES:
            share = case == "two, sharing"
            count = 1 if case == "one" else 2
            pairs = [
                start_replica(log_dir, xsub, xpub, ports, f"{case[:3]}-{i}", share)
                for i in range(count)
            ]
            for ext, _ in pairs:
                for i, port in enumerate(ports):
                    pub.announce(ext, f"w{i}", "m", f"127.0.0.1:{port}")
            for _, envoy in pairs:  # warm: Envoy's connection to its extproc is open
                burst([envoy], 1, 0.0)
            if share:
                a, b = pairs[0][0], pairs[1][0]
                idle0, t0 = estimates_sent(b), time.monotonic()
                time.sleep(3.0)  # a fixed window to count the idle messages in
                idle_rate = (estimates_sent(b) - idle0) / (time.monotonic() - t0)
            for _ in range(args.rounds):
                before, t0 = (estimates_sent(pairs[1][0]) if share else 0.0), time.monotonic()
                results[case].append(burst([envoy for _, envoy in pairs], args.burst, args.hold))
                if share:
                    busy_rate = (estimates_sent(pairs[1][0]) - before) / (time.monotonic() - t0)
            if share:
                took = propagation(a, b, 20)
            for ext, envoy in pairs:
                envoy.stop()
                ext.stop()
    finally:
        pub.close()
        for proc in procs:
            proc.stop()
    data = {
        "settings": {"burst": args.burst, "workers": args.workers, "hold": args.hold,
                     "rounds": args.rounds, "prompt_tokens": PROMPT_TOKENS,
                     "threshold": THRESHOLD, "capacity": CAPACITY},
        "cases": results,
        "propagation_s": took,
        "estimates_idle_per_s": idle_rate,
        "estimates_burst_per_s": busy_rate,
        "run": run.finish(),
    }  # fmt: skip
    print(resultfile.write(args.out, RESULTS_NAME, data, render))
    return 0


if __name__ == "__main__":
    from loadtest import run_stoppable

    sys.exit(run_stoppable(main))
