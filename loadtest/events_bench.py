"""Event-plane benchmark: how fast the extproc ingests worker load events, and what a steady
event stream does to the request path, side by side in one run.

1. Ingest: a publisher process sends msgpack ``load`` events as fast as it can for
   ``--ingest-seconds`` (``--workers`` workers in turn, each with its own ``seq``). The
   extproc's ``extproc_events_total{topic="load"}`` over that window is the ingest rate; its
   CPU from ``/proc`` gives the cost per event; ``extproc_events_lost_total`` and the gap
   between sent and received show anything dropped on the way.
2. Alongside requests: the ``bench.py`` stack (Envoy with a ``direct`` and an ``extproc``
   listener on a worker that is itself an Envoy), ``wrk`` at each ``--concurrency``, runs
   alternating between no events and a publisher pacing ``--rate`` events/s. The direct path
   runs with the publisher too, so the publisher's own CPU on these shared cores shows as
   the difference on ``direct``, and the extproc's share as the rest.

    python -m loadtest.events_bench [--rate 50000] [--duration 5] [--rounds 3]
    python -m loadtest.events_bench --ingest-only          # part 1 alone (no wrk needed)

Writes ``docs/events-results.json`` (every run, with the command, the time, ``/proc/loadavg``
before and after and the machine; ``--out DIR`` elsewhere) and ``events-results.md`` generated
from it, with the goals and their verdicts.

The publisher is this script run with ``--publish ENDPOINT``; it prints what it sent as JSON.
"""

from __future__ import annotations

import argparse
import json
import shutil
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import msgspec
import zmq

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
    python_module,
    wait_until,
)
from loadtest import resultfile
from loadtest.bench import BODY, add_direct_listener, cpu_seconds, run_wrk, worker_config
from loadtest.resultfile import median

THRESHOLD = 1000  # --active-prefill-tokens-threshold: the bench worker stays under it
EVENT_MODEL = "events"  # the event-only workers serve a model no request asks for
FAST_RATE = 200_000  # events encoded per second of an as-fast-as-possible run


# ----- the publisher (a process of its own) -----------------------------------------------


def encoded_events(workers: int, count: int) -> list[bytes]:
    """``count`` msgpack ``load`` payloads, round robin over ``ev-0..ev-{workers-1}`` and
    ``bench-1``, each worker with its own rising ``seq``."""
    ids = [f"ev-{i}" for i in range(workers)] + ["bench-1"]
    enc = msgspec.msgpack.Encoder()
    out = []
    for k in range(count):
        wid = ids[k % len(ids)]
        n = k // len(ids) + 1
        out.append(
            enc.encode(
                {
                    "v": 1,
                    "worker_id": wid,
                    "active_decode_blocks": n % 900,
                    # bench-1 stays free (under THRESHOLD); the others go above and below.
                    "active_prefill_tokens": n % 500 if wid == "bench-1" else n % 2000,
                    "seq": n,
                }
            )
        )
    return out


def publish(endpoint: str, workers: int, rate: float, seconds: float) -> int:
    """Send ``load`` events for ``seconds``: paced at ``rate``/s, or (``rate`` 0) as fast as
    the socket takes them. Payloads are encoded before the clock starts, so the publisher
    costs these shared cores little more than the sends. Prints the counts as JSON."""
    count = int(rate * seconds) + 1 if rate > 0 else int(FAST_RATE * seconds)
    payloads = encoded_events(workers, count)
    # XPUB: a PUB that also hears the subscription, so nothing is sent before the extproc
    # listens (a plain PUB drops what it sends before then).
    ctx = zmq.Context()
    sock = ctx.socket(zmq.XPUB)
    sock.setsockopt(zmq.SNDHWM, 0)  # never drop here: what is not ingested queues up
    sock.setsockopt(zmq.LINGER, 30_000)  # what is queued at the end still goes out
    sock.setsockopt(zmq.RCVTIMEO, 10_000)
    sock.connect(endpoint)
    if sock.recv()[:1] != b"\x01":
        raise RuntimeError("expected a subscription from the extproc")
    send = sock.send_multipart
    sent = 0
    cpu0 = time.process_time()
    started = time.monotonic()
    end = started + seconds
    while sent < count:
        now = time.monotonic()
        if now >= end:
            break
        due = min(sent + 5000 if rate <= 0 else int((now - started) * rate) + 1, count)
        for payload in payloads[sent:due]:
            send([b"load", payload])
        sent = max(sent, due)
        if rate > 0:
            time.sleep(max(0.001, started + sent / rate - time.monotonic()))
    elapsed = time.monotonic() - started
    cpu = time.process_time() - cpu0
    sock.close()
    ctx.term()  # waits (up to the linger) until what is queued has gone out
    print(json.dumps({"sent": sent, "seconds": elapsed, "cpu_s": cpu}), flush=True)
    return 0


class PublisherProc:
    """``python -m loadtest.events_bench --publish`` in the background; ``finish()`` returns
    its counts (the JSON line it prints last)."""

    def __init__(self, endpoint: str, workers: int, rate: float, seconds: float) -> None:
        args = [
            "--publish", endpoint,
            "--workers", str(workers), "--rate", str(rate), "--seconds", str(seconds),
        ]  # fmt: skip
        self.proc = Proc("publisher", python_module("loadtest.events_bench", args))
        self.seconds = seconds

    def done(self) -> bool:
        return not self.proc.alive()

    def finish(self) -> dict[str, Any]:
        wait_until(self.done, self.seconds + 30, "the publisher to finish")
        code, out = self.proc.stop(), self.proc.log()
        if code != 0:
            raise RuntimeError(f"publisher exited {code}: {out[-2000:]}")
        last = [line for line in out.splitlines() if line.startswith("{")][-1]
        counts: dict[str, Any] = json.loads(last)
        return counts

    def stop(self) -> None:
        self.proc.stop(5)


# ----- measuring -------------------------------------------------------------------------


def load_events(ext: Extproc) -> float:
    return metric_value(ext.metrics(), "extproc_events_total", {"topic": "load"}) or 0.0


def event_seconds(ext: Extproc) -> float:
    return metric_value(ext.metrics(), "extproc_event_seconds_total") or 0.0


def lost_events(ext: Extproc) -> float:
    return metric_value(ext.metrics(), "extproc_events_lost_total") or 0.0


def announce_event_workers(ext: Extproc, pub: Publisher, workers: int, endpoint: str) -> None:
    host, _, port = endpoint.rpartition(":")
    for i in range(workers):
        # One endpoint per worker: an endpoint serving a model is one engine.
        pub.config(f"ev-{i}", EVENT_MODEL, f"{host}:{int(port) + 1 + i}", kv_total_blocks=1000)
    wait_until(
        lambda: sum(w.startswith("ev-") for w in ext.workers()) == workers,
        20,
        f"{workers} event workers announced",
    )


def wait_for_drain(ext: Extproc) -> None:
    """Until the extproc has applied every queued event (its count stops moving)."""

    def drained() -> bool:
        a = load_events(ext)
        time.sleep(0.3)
        return load_events(ext) == a

    wait_until(drained, 60, "the event backlog to drain")


def ingest(ext: Extproc, workers: int, seconds: float) -> dict[str, float]:
    """Part 1: publish as fast as possible; what the extproc took in, per second."""
    before_events, before_lost = load_events(ext), lost_events(ext)
    pub = PublisherProc(ext.event_endpoint, workers, 0, seconds)
    try:
        # The window: from the first event applied to the publisher's exit.
        wait_until(lambda: load_events(ext) > before_events, 20, "the first events")
        t0, e0, c0 = time.monotonic(), load_events(ext), cpu_seconds(ext.proc.pid)
        wait_until(pub.done, seconds + 30, "the publisher to finish")
        t1, e1, c1 = time.monotonic(), load_events(ext), cpu_seconds(ext.proc.pid)
        counts = pub.finish()
    finally:
        pub.stop()
    sent = counts["sent"]

    wait_for_drain(ext)
    return {
        "sent": sent,
        "publisher_rate": sent / counts["seconds"],
        "publisher_cpu_share": counts["cpu_s"] / counts["seconds"],
        "ingested_rate": (e1 - e0) / (t1 - t0),
        "received": load_events(ext) - before_events,
        "lost_seq": lost_events(ext) - before_lost,
        "cpu_us_per_event": (c1 - c0) / max(e1 - e0, 1) * 1e6,
        "extproc_cpu_share": (c1 - c0) / (t1 - t0),
    }


RESULTS_NAME = "events"
INGEST_GOAL = 50_000  # load events/s


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="python -m loadtest.events_bench", description=__doc__.split("\n\n")[0]
    )
    parser.add_argument("--rate", type=float, default=50_000, help="paced events/s in part 2")
    parser.add_argument("--workers", type=int, default=64, help="event-only workers")
    parser.add_argument("--ingest-seconds", type=float, default=5.0)
    parser.add_argument("--ingest-only", action="store_true", help="part 1 only")
    parser.add_argument("--duration", type=float, default=5.0, help="seconds per wrk run")
    parser.add_argument("--rounds", type=int, default=3, help="alternating rounds per case")
    parser.add_argument("--concurrency", type=int, nargs="+", default=[1, 32])
    parser.add_argument(
        "--out",
        type=Path,
        default=resultfile.DOCS,
        metavar="DIR",
        help=f"where {RESULTS_NAME}-results.json and .md are written (default: docs/)",
    )
    parser.add_argument("--publish", metavar="ENDPOINT", help=argparse.SUPPRESS)
    parser.add_argument("--seconds", type=float, default=5.0, help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.publish:
        return publish(args.publish, args.workers, args.rate, args.seconds)
    if not args.ingest_only and not shutil.which("wrk"):
        print("wrk not found: apt-get install wrk (or --ingest-only)", file=sys.stderr)
        return 2
    run = resultfile.Run(
        resultfile.command_line("loadtest.events_bench", sys.argv[1:] if argv is None else argv)
    )
    data = measure(args)
    data["run"] = run.finish()
    print(resultfile.write(args.out, RESULTS_NAME, data, render))
    ing = data["ingest"]
    return 1 if args.ingest_only and ing["received"] != ing["sent"] else 0


def measure(args: argparse.Namespace) -> dict[str, Any]:
    """The ingest window and every wrk run, as plain values for the results file."""
    tmp = Path(tempfile.mkdtemp(prefix="events-bench-"))
    procs: list[Any] = []
    settings = {
        "rate": args.rate,
        "workers": args.workers,
        "ingest_seconds": args.ingest_seconds,
        "ingest_only": args.ingest_only,
        "duration": args.duration,
        "rounds": args.rounds,
        "concurrency": args.concurrency,
    }
    try:
        wport, wadmin = free_port(), free_port()
        (tmp / "worker.json").write_text(json.dumps(worker_config([wport], wadmin)))
        worker = Proc(
            "worker-envoy",
            [envoy_binary(), "-c", str(tmp / "worker.json"), "--disable-hot-restart",
             "--concurrency", "1", "-l", "error"],
            tmp,
        )  # fmt: skip
        procs.append(worker)
        wait_until(lambda: http("GET", f"http://127.0.0.1:{wport}/")[0] == 200, 20, "worker")
        ext = Extproc(
            tmp,
            ["--active-prefill-tokens-threshold", str(THRESHOLD), "--log-level", "WARNING",
             "--worker-ttl", "86400"],
        )  # fmt: skip
        procs.append(ext)
        pub = Publisher(ext.event_endpoint)
        endpoint = f"127.0.0.1:{wport}"
        pub.announce(ext, "bench-1", "bench", endpoint, kv_total_blocks=1000)
        announce_event_workers(ext, pub, args.workers, endpoint)

        ing = ingest(ext, args.workers, args.ingest_seconds)
        print(f"ingest: {ing}", file=sys.stderr, flush=True)
        if args.ingest_only:
            return {"settings": settings, "ingest": ing, "runs": []}

        direct_port = free_port()
        envoy = Envoy(
            tmp, ext, [wport], tweak=add_direct_listener(direct_port, "SEND"),
            source=checkout_file("envoy/envoy.yaml"),
        )  # fmt: skip
        procs.append(envoy)
        urls = {"direct": f"http://127.0.0.1:{direct_port}", "extproc": envoy.url}
        for url in urls.values():
            run_wrk(url, BODY, 4, 1, tmp)

        runs: list[dict[str, Any]] = []
        for conns in args.concurrency:
            for rnd in range(args.rounds):
                for name, url in urls.items():
                    for events in (False, True):
                        r = one_run(ext, url, conns, args, tmp, events, name == "extproc")
                        assert r["non2xx"] == 0, f"{name} c={conns}: {r['non2xx']} non-2xx"
                        print(f"  {name} c={conns} events={events}: {r}", file=sys.stderr)
                        runs.append({"path": name, "events": events, "concurrency": conns,
                                     "round": rnd + 1, **r})  # fmt: skip
        return {"settings": settings, "ingest": ing, "runs": runs}
    finally:
        for p in reversed(procs):
            p.stop()


def one_run(
    ext: Extproc, url: str, conns: int, args: argparse.Namespace, tmp: Path,
    events: bool, through_extproc: bool,
) -> dict[str, float]:  # fmt: skip
    """One wrk run, with a paced publisher running across it when ``events``."""
    pub = None
    before = load_events(ext), cpu_seconds(ext.proc.pid)
    if events:
        # Starts a little before wrk and ends a little after: the whole run sees events.
        pub = PublisherProc(ext.event_endpoint, args.workers, args.rate, args.duration + 1.5)
        wait_until(lambda: load_events(ext) > before[0], 10, "events to arrive")
    try:
        t0 = time.monotonic()
        e0, c0, s0 = load_events(ext), cpu_seconds(ext.proc.pid), event_seconds(ext)
        r = run_wrk(url, BODY, conns, args.duration, tmp)
        elapsed = time.monotonic() - t0
        r["events_rate"] = (load_events(ext) - e0) / elapsed
        r["loop_share"] = (event_seconds(ext) - s0) / elapsed
        r["ext_cpu_us"] = (cpu_seconds(ext.proc.pid) - c0) / max(r["total"], 1) * 1e6
        if not through_extproc:
            r["ext_cpu_us"] = float("nan")
        if pub is not None:
            pub.finish()
            wait_for_drain(ext)  # no backlog spills into the next run
    finally:
        if pub is not None:
            pub.stop()
    return r


# --- the report, from the results JSON --------------------------------------------------------

INGEST_HEAD = (
    "| publisher sent/s | extproc ingested/s | extproc CPU per event | "
    "extproc CPU | publisher CPU | received / sent | seq gaps |"
)
RUNS_HEAD = (
    "| concurrency | path | events/s ingested | loop on events | p50 ms | p99 ms "
    "| req/s | extproc CPU/request µs |"
)


def ingest_row(ing: dict[str, Any]) -> str:
    return (
        f"| {ing['publisher_rate']:,.0f} | **{ing['ingested_rate']:,.0f}** | "
        f"{ing['cpu_us_per_event']:.1f} µs | {ing['extproc_cpu_share']:.0%} of a core | "
        f"{ing['publisher_cpu_share']:.0%} of a core | "
        f"{ing['received']:,.0f} / {ing['sent']:,.0f} | {ing['lost_seq']:,.0f} |"
    )


def medians(data: dict[str, Any]) -> dict[tuple[str, bool, int], dict[str, float | None]]:
    """(path, events, concurrency) -> the median of each measure over the rounds."""
    groups: dict[tuple[str, bool, int], list[dict[str, Any]]] = {}
    for r in data["runs"]:
        groups.setdefault((r["path"], r["events"], r["concurrency"]), []).append(r)
    out: dict[tuple[str, bool, int], dict[str, float | None]] = {}
    for key, rs in groups.items():
        out[key] = {}
        for m in ("p50", "p99", "rps", "events_rate", "loop_share", "ext_cpu_us"):
            values = [r[m] for r in rs if r.get(m) is not None]
            out[key][m] = median(values) if values else None
    return out


def runs_table(data: dict[str, Any]) -> list[str]:
    med = medians(data)
    rows = [RUNS_HEAD, "|---|---|---|---|---|---|---|---|"]
    for conns in data["settings"]["concurrency"]:
        for name in ("direct", "extproc"):
            base = med.get((name, False, conns))
            ev = med.get((name, True, conns))
            if base is None or ev is None:
                continue
            for events, m in ((False, base), (True, ev)):
                cpu = m["ext_cpu_us"]
                rows.append(
                    f"| {conns} | {name}{' + events' if events else ''} | "
                    f"{m['events_rate']:,.0f} | {m['loop_share']:.0%} | {m['p50']:.3f} | "
                    f"{m['p99']:.3f} | {m['rps']:.0f} | {'—' if cpu is None else f'{cpu:.0f}'} |"
                )
            rows.append(
                f"| {conns} | {name}: events added / ratio | | | "
                f"{_n(ev['p50']) - _n(base['p50']):+.3f} | "
                f"{_n(ev['p99']) - _n(base['p99']):+.3f} | "
                f"{_n(ev['rps']) / _n(base['rps']):.2f}x | |"
            )
    return rows


def _n(value: float | None) -> float:
    if value is None:
        raise ValueError("a run without the measure")
    return value


def goals(data: dict[str, Any]) -> list[str]:
    """The ingest goal, and the request goals with events flowing: the extproc path with
    events against the direct path with the same events (so the publisher's own CPU on the
    shared cores counts on both sides)."""
    ing = data["ingest"]
    lines = [
        f"- ingest: {ing['ingested_rate']:,.0f} load events/s vs ≥ {INGEST_GOAL:,}/s: "
        f"{resultfile.verdict(ing['ingested_rate'] >= INGEST_GOAL)}"
    ]
    med = medians(data)
    rate = data["settings"]["rate"]
    d1, e1 = med.get(("direct", True, 1)), med.get(("extproc", True, 1))
    if d1 and e1:
        for q, bound in (("p50", 0.5), ("p99", 1.5)):
            added = _n(e1[q]) - _n(d1[q])
            lines.append(
                f"- with {rate:,.0f} events/s: added latency at c=1, {q}: {added:+.3f} ms vs "
                f"≤ +{bound:g} ms: {resultfile.verdict(added <= bound)}"
            )
    d32, e32 = med.get(("direct", True, 32)), med.get(("extproc", True, 32))
    if d32 and e32:
        ratio = _n(e32["rps"]) / _n(d32["rps"])
        lines.append(
            f"- with {rate:,.0f} events/s: accepted req/s at c=32: {ratio:.2f}x direct vs "
            f"≥ 0.8x: {resultfile.verdict(ratio >= 0.8)}"
        )
    for conns in data["settings"]["concurrency"]:
        e = med.get(("extproc", True, conns))
        if e:
            kept = _n(e["events_rate"]) / rate
            lines.append(
                f"- with {rate:,.0f} events/s at c={conns}: the extproc took in "
                f"{_n(e['events_rate']):,.0f} events/s during the requests ({kept:.0%} of "
                f"the paced rate): {resultfile.verdict(kept >= 0.95)} (≥ 95 %)"
            )
    return lines


def render(data: dict[str, Any]) -> str:
    """The Markdown report of a ``make bench-events`` run, from its results JSON."""
    s = data["settings"]
    parts = [
        resultfile.header(
            "Event plane: ingest rate, and requests with and without events", data["run"]
        ),
        f"Ingest: a publisher process sends msgpack `load` events for {s['workers'] + 1} "
        f"workers as fast as it can for {s['ingest_seconds']:g} s; the extproc's "
        '`extproc_events_total{topic="load"}` over that window is the ingest rate, its CPU '
        "from `/proc`.\n",
        INGEST_HEAD + "\n|---|---|---|---|---|---|---|\n" + ingest_row(data["ingest"]) + "\n",
    ]
    if data["runs"]:
        parts += [
            f"Requests with and without {s['rate']:,.0f} load events/s: wrk -t1 keep-alive "
            f"non-streaming chat POSTs, {s['duration']:g} s per run, rounds: {s['rounds']}, each "
            "alternating between the paths and between no events and a paced publisher, "
            "medians of the rounds. The direct path (Envoy without the ext_proc filter, "
            "same worker) runs with the same events, so the publisher's and the extproc's "
            'CPU on the shared cores shows on it too. "loop on events": '
            "`rate(extproc_event_seconds_total)`, the share of wall time the extproc's loop "
            "spent reading and applying events.\n",
            "\n".join(runs_table(data)) + "\n",
        ]
    parts.append(
        "### Goals\n\nIngest at least 50,000 load events/s; with that stream flowing, the "
        "request path's goals (extproc + events against direct + events), and the events "
        "taken in as fast as they are sent.\n\n" + "\n".join(goals(data)) + "\n"
    )
    return "\n".join(parts)


if __name__ == "__main__":
    from loadtest import run_stoppable

    sys.exit(run_stoppable(main))
