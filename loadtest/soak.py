"""Soak: a mixed load for a set time, then check that nothing was left behind.

    python -m loadtest.soak --seconds 600 [--clients 8] [--json out.json]

Starts its own stack (Envoy from ``envoy/envoy.yaml``, the extproc, two simulated engines
that publish their load, and a third engine port that workers join and leave on) and
runs, for ``--seconds``:

- ``--clients`` client loops, each picking at random a plain chat completion, a streamed
  one (``"stream": true``, read to the end) or a streamed one it abandons after the first
  SSE chunk (closes the connection);
- busy thresholds changed at run time (``POST /busy_threshold``) every ``--phase``
  seconds, cycling through off, a decode-block threshold, a prefill-token threshold and
  one that makes every worker busy (so that part of the load is rejected with 529);
- a worker joining and leaving: a simulated engine started on the spare port, then
  stopped, alternately with SIGTERM (it says ``bye``) and SIGKILL (the extproc drops it
  after ``--worker-ttl``), with requests in flight.

Every loop ends by count and by time. Warm-up is the first 15 % of the run; the
extproc's RSS (VmRSS) and open file descriptors are sampled then and at the end, after
the load has stopped. The run passes (exit 0) when, at the end:

- every router estimate is 0 (``/debug/workers``: per rank ``router_estimate`` and
  ``other_replicas_estimate``, requests in flight, decode blocks, prefill tokens);
- RSS and fds are no more than 10 % above the warm-up sample; runs shorter than 10
  minutes also get an absolute slack of 4 MiB and 4 fds (a short run's warm-up sample
  is taken before the allocator and the connection pools have settled);
- no request failed except while a worker was exiting (a SIGKILLed worker cuts the
  requests it was serving), and every request ended within its timeout.

The report lists requests by outcome, errors, RSS/fds before and after and the end
estimates; ``--json`` writes it as JSON too.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import os
import random
import signal
import sys
import tempfile
import threading
import time
from collections import Counter
from dataclasses import dataclass, field
from functools import partial
from pathlib import Path
from typing import Any

import aiohttp

from extproc.devstack import (
    Envoy,
    Extproc,
    SimProcess,
    cli_flags,
    free_port,
    get_json,
    http,
    metric_samples,
    wait_until,
)

MODEL = "soak-model"
WARMUP_SHARE = 0.15
GROWTH = 0.10
SHORT_RUN = 600.0  # below this many seconds the absolute slack applies
SLACK_RSS_KIB = 4 * 1024
SLACK_FDS = 4
# Threshold phases: (name, body fields); "disable" lists the thresholds turned off.
ALL = ["active_decode_blocks_threshold", "active_prefill_tokens_threshold",
       "active_prefill_tokens_threshold_frac"]  # fmt: skip
PHASES: list[tuple[str, dict[str, Any]]] = [
    ("off", {"disable": ALL}),
    ("decode 0.05", {"active_decode_blocks_threshold": 0.05, "disable": ALL[1:]}),
    ("prefill 400", {"active_prefill_tokens_threshold": 400, "disable": [ALL[0], ALL[2]]}),
    ("all busy", {"active_decode_blocks_threshold": 0.0, "disable": ALL[1:]}),
]
KINDS = ("chat", "stream", "abandon")


def rss_kib(pid: int) -> int:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1])
    raise RuntimeError(f"no VmRSS for pid {pid}")


def open_fds(pid: int) -> int:
    return len(os.listdir(f"/proc/{pid}/fd"))


@dataclass
class Sample:
    at: float
    rss_kib: int
    fds: int


@dataclass
class Run:
    """What the run saw, filled by the client tasks and the controller thread."""

    outcomes: Counter[str] = field(default_factory=Counter)
    errors: Counter[str] = field(default_factory=Counter)
    unexpected_errors: list[str] = field(default_factory=list)
    overdue: int = 0  # requests that ran past their timeout
    # Worker-exit windows: (start, end, "bye" or "kill"); the open one has no end yet.
    exiting: list[tuple[float, float, str]] = field(default_factory=list)
    exit_open: tuple[float, str] | None = None
    events: list[str] = field(default_factory=list)
    samples: list[Sample] = field(default_factory=list)
    phases: Counter[str] = field(default_factory=Counter)
    lock: threading.Lock = field(default_factory=threading.Lock)

    def during_exit(self, started: float, ended: float) -> str | None:
        """How a worker was exiting while this request ran (None: none was)."""
        with self.lock:
            windows = [*self.exiting]
            if self.exit_open is not None:
                windows.append((self.exit_open[0], float("inf"), self.exit_open[1]))
        for a, b, how in windows:
            if a - 0.5 <= ended and started <= b + 1.0:
                return how
        return None

    def open_exit(self, how: str) -> None:
        with self.lock:
            self.exit_open = (time.monotonic(), how)

    def close_exit(self) -> None:
        with self.lock:
            assert self.exit_open is not None
            self.exiting.append((self.exit_open[0], time.monotonic(), self.exit_open[1]))
            self.exit_open = None


class SoakStack:
    """Envoy -> extproc -> two simulated engines, plus a spare port in the worker cluster."""

    def __init__(self, log_dir: Path, ttl: float, speedup: float) -> None:
        self.log_dir = log_dir
        self.speedup = speedup
        self.ext = Extproc(
            log_dir, ["--log-level", "WARNING", "--worker-ttl", str(ttl), "--startup-grace", "0"]
        )
        self.sims: list[SimProcess] = []
        self.ports = [free_port() for _ in range(3)]  # the last one: workers join and leave
        self.envoy: Envoy | None = None
        try:
            for i, port in enumerate(self.ports[:2], 1):
                self.start_sim(f"sim-{i}", port)
            wait_until(lambda: len(self.ext.workers()) == 2, 15, "both workers announced")
            self.envoy = Envoy(log_dir, self.ext, self.ports)
        except BaseException:
            self.close()
            raise

    def start_sim(self, worker_id: str, port: int) -> SimProcess:
        args = cli_flags(
            host="127.0.0.1", port=port, model=MODEL, worker_id=worker_id,
            publish=self.ext.event_endpoint, kv_total_blocks=256, block_size=16,
            max_num_seqs=16, max_num_batched_tokens=512, dp_size=1, speedup=self.speedup,
            heartbeat=0.5, shutdown_timeout=3, log_level="WARNING",
        )  # fmt: skip
        sim = SimProcess(args, log_dir=self.log_dir, name=worker_id)
        self.sims.append(sim)
        wait_until(partial(sim.healthy, port), 20, f"{worker_id} up")
        return sim

    @property
    def url(self) -> str:
        assert self.envoy is not None
        return self.envoy.url + "/v1/chat/completions"

    def close(self) -> None:
        if self.envoy is not None:
            self.envoy.stop()
        for sim in self.sims:
            sim.stop()
        self.ext.stop()


# --- clients ---------------------------------------------------------------------------


def body(rng: random.Random, stream: bool) -> bytes:
    words = rng.randint(100, 600)  # ~ 25..150 prompt tokens
    return json.dumps(
        {
            "model": MODEL,
            "messages": [{"role": "user", "content": "w " * (words // 2)}],
            "max_tokens": rng.randint(8, 48),
            "stream": stream,
        }
    ).encode()


async def one_request(
    session: aiohttp.ClientSession, url: str, kind: str, rng: random.Random, timeout: float
) -> str:
    """POST one request of ``kind``; its outcome (``200``, ``529``, ``abandoned``, ...)."""
    data = body(rng, kind != "chat")
    headers = {"content-type": "application/json"}
    async with session.post(
        url, data=data, headers=headers, timeout=aiohttp.ClientTimeout(total=timeout)
    ) as resp:
        if resp.status != 200 or kind == "chat":
            await resp.read()
            return str(resp.status)
        if kind == "abandon":
            await resp.content.readuntil(b"\n\n")  # the first SSE event
            resp.close()  # drop the connection mid-stream
            return "abandoned"
        raw = await resp.read()
        if not raw.rstrip().endswith(b"data: [DONE]"):
            return "stream cut"
        return "200 stream"


async def client(
    run: Run, url: str, seed: int, deadline: float, max_requests: int, timeout: float
) -> None:
    rng = random.Random(seed)
    conn = aiohttp.TCPConnector(limit=1, force_close=False)
    async with aiohttp.ClientSession(connector=conn) as session:
        for _ in range(max_requests):
            if time.monotonic() >= deadline:
                return
            kind = rng.choices(KINDS, weights=(5, 3, 2))[0]
            started = time.monotonic()
            try:
                outcome = await asyncio.wait_for(
                    one_request(session, url, kind, rng, timeout), timeout + 2
                )
            except TimeoutError:
                outcome = "error: timeout"
            except (aiohttp.ClientError, OSError) as exc:
                outcome = f"error: {type(exc).__name__}"
            ended = time.monotonic()
            if ended - started > timeout + 1:
                run.overdue += 1
            run.outcomes[f"{kind} {outcome}"] += 1
            failed = outcome.startswith(("error", "5")) or outcome == "stream cut"
            if failed and outcome != "529":
                how = run.during_exit(started, ended)
                run.errors[f"{outcome} ({how or 'no worker exiting'})"] += 1
                if how is None:
                    run.unexpected_errors.append(f"{kind} {outcome} at {started:.1f}-{ended:.1f}")
            await asyncio.sleep(rng.uniform(0, 0.01))


async def run_clients(
    run: Run, url: str, clients: int, seconds: float, timeout: float, seed: int
) -> None:
    deadline = time.monotonic() + seconds
    cap = int(seconds * 500) + 10  # far above what one client can send: time ends the loop
    await asyncio.gather(
        *(client(run, url, seed + i, deadline, cap, timeout) for i in range(clients))
    )


# --- the controller: thresholds, workers joining and leaving, samples ------------------


def set_phase(ext: Extproc, fields: dict[str, Any]) -> None:
    status, _, reply = http("POST", ext.admin + "/busy_threshold", {"model": MODEL, **fields})
    if status != 200:
        raise RuntimeError(f"POST /busy_threshold {fields} -> {status}: {reply!r}")


def controller(
    stack: SoakStack, run: Run, t0: float, seconds: float, phase: float, stop: threading.Event
) -> None:
    """Until ``seconds`` have passed: change thresholds every ``phase`` s, cycle a worker
    in and out of the spare port, sample RSS/fds at the end of warm-up and every 5 s."""
    ext, pid = stack.ext, stack.ext.proc.pid
    warmup_at = t0 + seconds * WARMUP_SHARE
    churn_period = max(8.0, min(40.0, seconds / 4))
    next_phase, phase_i = t0, 0
    next_churn, churn_n = t0 + seconds * 0.2, 0
    next_sample = warmup_at
    end = t0 + seconds
    churn: SimProcess | None = None
    churn_stop_at = 0.0
    for _ in range(int(seconds * 100) + 100):  # bounded by count too
        now = time.monotonic()
        if now >= end or stop.is_set():
            break
        if now >= next_phase:
            name, fields = PHASES[phase_i % len(PHASES)]
            set_phase(ext, fields)
            run.phases[name] += 1
            phase_i += 1
            next_phase += phase
        if now >= next_sample:
            run.samples.append(Sample(now - t0, rss_kib(pid), open_fds(pid)))
            next_sample += 5.0
        if churn is None and now >= next_churn and now + churn_period / 2 < end:
            churn_n += 1
            wid = f"joiner-{churn_n}"
            churn = stack.start_sim(wid, stack.ports[2])
            wait_until(lambda w=wid: w in ext.workers(), 10, f"{wid} announced")
            run.events.append(f"{now - t0:.1f}s {wid} joined")
            churn_stop_at = now + churn_period / 4
        elif churn is not None and now >= churn_stop_at:
            wid = churn.name
            bye = churn_n % 2 == 1
            run.open_exit("bye" if bye else "kill")
            churn.send_signal(signal.SIGTERM if bye else signal.SIGKILL)
            # The worker set: gone at once after its bye, after the TTL when killed.
            wait_until(lambda w=wid: w not in ext.workers(), 30, f"{wid} removed")
            churn.stop()
            run.close_exit()
            how = "said bye" if bye else "was SIGKILLed, expired after the TTL"
            run.events.append(f"{now - t0:.1f}s {wid} {how} ({time.monotonic() - now:.1f}s)")
            churn = None
            next_churn = time.monotonic() + churn_period / 4
        time.sleep(0.05)
    if churn is not None:  # the run ended while a worker had joined: it leaves with a bye
        run.open_exit("bye")
        churn.stop()
        wait_until(lambda w=churn.name: w not in ext.workers(), 30, f"{churn.name} removed")
        run.close_exit()
        run.events.append(f"{time.monotonic() - t0:.1f}s {churn.name} said bye (end of run)")


def by_label(text: str, name: str, label: str) -> dict[str, float]:
    return {s.labels[label]: s.value for s in metric_samples(text) if s.name == name}


def estimates(ext: Extproc) -> dict[str, dict[str, int]]:
    """Per worker/rank, the non-zero router and other-replica estimates."""
    out: dict[str, dict[str, int]] = {}
    for w in get_json(ext.admin + "/debug/workers")["workers"]:
        for r in w["ranks"]:
            for part in ("router_estimate", "other_replicas_estimate"):
                for k, v in r[part].items():
                    out.setdefault(f"{w['worker_id']}/{r['dp_rank']}", {})[f"{part}.{k}"] = v
    return out


def all_zero(est: dict[str, dict[str, int]]) -> bool:
    return all(v == 0 for rank in est.values() for v in rank.values())


def soak(args: argparse.Namespace) -> dict[str, Any]:
    log_dir = Path(args.logs) if args.logs else Path(tempfile.mkdtemp(prefix="soak-"))
    log_dir.mkdir(parents=True, exist_ok=True)
    stack = SoakStack(log_dir, args.worker_ttl, args.speedup)
    run = Run()
    stop = threading.Event()
    try:
        pid = stack.ext.proc.pid
        start = Sample(0.0, rss_kib(pid), open_fds(pid))
        t0 = time.monotonic()
        errors: list[BaseException] = []

        def control() -> None:
            try:
                controller(stack, run, t0, args.seconds, args.phase, stop)
            except BaseException as exc:  # reported after the clients stop
                errors.append(exc)

        thread = threading.Thread(target=control, name="soak-controller", daemon=True)
        thread.start()
        asyncio.run(
            run_clients(run, stack.url, args.clients, args.seconds, args.timeout, args.seed)
        )
        stop.set()
        thread.join(60)
        if errors:
            raise errors[0]
        if thread.is_alive():
            raise RuntimeError("the controller did not finish within 60 s of the end")
        loaded = time.monotonic() - t0
        # Quiet: the streams Envoy closes reach the extproc within a moment.
        with contextlib.suppress(AssertionError):  # reported below
            wait_until(lambda: all_zero(estimates(stack.ext)), 10, "estimates back to 0")
        end_est = estimates(stack.ext)
        end = Sample(time.monotonic() - t0, rss_kib(pid), open_fds(pid))
        metrics = stack.ext.metrics()
        decisions = by_label(metrics, "extproc_decisions_total", "outcome")
        unreachable = sum(by_label(metrics, "extproc_worker_unreachable_total", "model").values())
        workers = sorted(stack.ext.workers())
    finally:
        stop.set()
        stack.close()
    warm = run.samples[0] if run.samples else start
    short = args.seconds < SHORT_RUN
    rss_limit = warm.rss_kib * (1 + GROWTH) + (SLACK_RSS_KIB if short else 0)
    fd_limit = warm.fds * (1 + GROWTH) + (SLACK_FDS if short else 0)
    nonzero = {k: {n: v for n, v in r.items() if v} for k, r in end_est.items()}
    total = sum(run.outcomes.values())
    rejected = sum(v for k, v in run.outcomes.items() if k.endswith(" 529"))
    checks = {
        "estimates all 0": all_zero(end_est),
        # Every request reached the extproc (it never failed open) and got one decision;
        # the simulated engines never reject, so every 529 is the extproc's: a decision, or
        # Envoy's own 503 for a killed worker turned into the overload reply.
        "decisions = requests": sum(decisions.values()) == total,
        "529s = overloaded decisions + unreachable": decisions.get("overloaded", 0) + unreachable
        == rejected,
        "rss within limit": end.rss_kib <= rss_limit,
        "fds within limit": end.fds <= fd_limit,
        "no unexpected errors": not run.unexpected_errors,
        "none past its timeout": run.overdue == 0,
        "workers back to the two": workers == ["sim-1", "sim-2"],
    }
    return {
        "command": "python -m loadtest.soak " + " ".join(sys.argv[1:]),
        "seconds": args.seconds,
        "loaded_seconds": round(loaded, 1),
        "clients": args.clients,
        "requests": total,
        "outcomes": dict(sorted(run.outcomes.items())),
        "errors": dict(run.errors),
        "unexpected_errors": run.unexpected_errors[:20],
        "overdue": run.overdue,
        "decisions": {k: int(v) for k, v in sorted(decisions.items())},
        "worker_unreachable": unreachable,
        "threshold_phases": dict(run.phases),
        "worker_events": run.events,
        "workers_at_end": workers,
        "start": vars(start),
        "warmup": vars(warm),
        "end": vars(end),
        "samples": [vars(s) for s in run.samples],
        "rss_limit_kib": int(rss_limit),
        "fd_limit": int(fd_limit),
        "absolute_slack": {"rss_kib": SLACK_RSS_KIB, "fds": SLACK_FDS} if short else None,
        "estimates_nonzero_at_end": {k: v for k, v in nonzero.items() if v},
        "ranks_checked": len(end_est),
        "checks": checks,
        "passed": all(checks.values()),
        "logs": str(log_dir),
    }


def report(res: dict[str, Any]) -> str:
    lines = [
        f"soak: {res['seconds']} s, {res['clients']} clients, {res['requests']} requests "
        f"({res['requests'] / max(res['loaded_seconds'], 1):.0f}/s)",
        "requests by outcome:",
        *(f"  {k:<28} {v}" for k, v in res["outcomes"].items()),
        f"errors (all during a worker's exit unless listed): {res['errors'] or 'none'}",
        *(f"  unexpected: {e}" for e in res["unexpected_errors"]),
        f"extproc decisions by outcome: {res['decisions']}",
        f"threshold phases applied: {res['threshold_phases']}",
        "workers joining and leaving:",
        *(f"  {e}" for e in res["worker_events"]),
        "extproc RSS / open fds (warm-up = first 15 % of the run):",
        f"  start      {res['start']['rss_kib'] / 1024:7.1f} MiB  {res['start']['fds']:4d} fds",
        f"  warm-up    {res['warmup']['rss_kib'] / 1024:7.1f} MiB  {res['warmup']['fds']:4d} fds"
        f"  (at {res['warmup']['at']:.0f} s)",
        f"  end        {res['end']['rss_kib'] / 1024:7.1f} MiB  {res['end']['fds']:4d} fds",
        f"  limit      {res['rss_limit_kib'] / 1024:7.1f} MiB  {res['fd_limit']:4d} fds"
        + (
            f"  (10 % + absolute slack {SLACK_RSS_KIB // 1024} MiB / {SLACK_FDS} fds: "
            "a run under 10 minutes)"
            if res["absolute_slack"]
            else "  (10 %)"
        ),
        f"  max during run: {max((s['rss_kib'] for s in res['samples']), default=0) / 1024:.1f}"
        f" MiB, {max((s['fds'] for s in res['samples']), default=0)} fds",
        f"router estimates at end ({res['ranks_checked']} ranks): "
        + str(res["estimates_nonzero_at_end"] or "all 0"),
        f"workers at end: {res['workers_at_end']}",
        "checks: " + ", ".join(f"{k}: {'ok' if v else 'FAILED'}" for k, v in res["checks"].items()),
        f"logs: {res['logs']}",
    ]
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="python -m loadtest.soak",
        description=__doc__.split("\n\n")[0],
        formatter_class=argparse.ArgumentDefaultsHelpFormatter,
    )
    parser.add_argument("--seconds", type=float, default=600, help="length of the load")
    parser.add_argument("--clients", type=int, default=8, help="concurrent client loops")
    parser.add_argument("--phase", type=float, default=4, help="seconds per threshold phase")
    parser.add_argument("--worker-ttl", type=float, default=2, help="the extproc's worker TTL")
    parser.add_argument("--speedup", type=float, default=20, help="simulated engine speed-up")
    parser.add_argument("--timeout", type=float, default=30, help="per-request timeout, s")
    parser.add_argument("--seed", type=int, default=1, help="seed of the clients' choices")
    parser.add_argument("--json", default=None, help="also write the report as JSON here")
    parser.add_argument("--logs", default=None, help="folder for the logs (default: a temp dir)")
    args = parser.parse_args(argv)
    if args.seconds < 10:
        parser.error(f"--seconds {args.seconds}: expected at least 10 (warm-up, one worker cycle)")
    if args.clients < 1:
        parser.error(f"--clients {args.clients}: expected at least 1")
    res = soak(args)
    print(report(res), flush=True)
    if args.json:
        Path(args.json).write_text(json.dumps(res, indent=1))
    return 0 if res["passed"] else 1


if __name__ == "__main__":
    from loadtest import run_stoppable

    sys.exit(run_stoppable(main))
