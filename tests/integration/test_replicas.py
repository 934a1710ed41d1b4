"""Two Envoy + extproc pairs that decide as one (docs/replicas.md), through real Envoys.

Both extprocs connect to one forwarder (python -m extproc.events.forwarder): the test's
publisher announces workers to its XSUB port, each extproc's event socket connects to its
XPUB port, and each extproc publishes its estimates to the XSUB port. Workers never send
load here (reports "paused"), so what a replica knows of the other's requests comes only
from the shared estimates.
"""

from __future__ import annotations

import concurrent.futures
import json
import os
import signal
import sys
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest

from extproc.devstack import (
    Envoy,
    Extproc,
    Proc,
    Publisher,
    free_port,
    get_json,
    http,
    wait_until,
)

CHAT = "/v1/chat/completions"
TTL = 1.0


@dataclass
class Pair:
    ext: Extproc
    envoy: Envoy


@dataclass
class Fleet:
    a: Pair
    b: Pair
    pub: Publisher
    workers: dict[str, int]

    def endpoint(self, name: str) -> str:
        return f"127.0.0.1:{self.workers[name]}"

    def announce(self, worker_id: str, model: str, name: str) -> None:
        for pair in (self.a, self.b):
            self.pub.announce(pair.ext, worker_id, model, self.endpoint(name))


def start_pair(log_dir: Path, xsub: str, xpub: str, workers: dict[str, int], rid: str) -> Pair:
    ext = Extproc(
        log_dir,
        [
            "--event-bind",
            "",
            "--event-connect",
            xpub,
            "--replica-publish",
            xsub,
            "--replica-id",
            rid,
            "--replica-ttl",
            str(TTL),
            "--replica-interval",
            "0.3",
            "--active-prefill-tokens-threshold",
            "1000",
            "--worker-ttl",
            "60",
        ],
    )
    return Pair(ext, Envoy(log_dir, ext, list(workers.values())))


@pytest.fixture(scope="module")
def fleet(log_dir: Path, echo_workers: dict[str, int]) -> Iterator[Fleet]:
    xsub, xpub = f"tcp://127.0.0.1:{free_port()}", f"tcp://127.0.0.1:{free_port()}"
    forwarder = Proc(
        "forwarder",
        [sys.executable, "-m", "extproc.events.forwarder", "--xsub", xsub, "--xpub", xpub],
        log_dir,
    )
    a = start_pair(log_dir, xsub, xpub, echo_workers, "replica-a")
    b = start_pair(log_dir, xsub, xpub, echo_workers, "replica-b")
    pub = Publisher(xsub)
    yield Fleet(a, b, pub, echo_workers)
    pub.close()
    for pair in (a, b):
        pair.envoy.stop()
        pair.ext.stop()
    forwarder.stop()


def chat(model: str, tokens: int) -> dict[str, Any]:
    return {"model": model, "messages": [{"role": "user", "content": "x" * (4 * tokens)}]}


def post(pair: Pair, model: str, tokens: int, hold_ms: int = 0) -> tuple[int, str | None]:
    headers = {"x-test-delay-ms": str(hold_ms)} if hold_ms else {}
    status, hdrs, _ = http("POST", pair.envoy.url + CHAT, chat(model, tokens), headers, 20)
    return status, hdrs.get("x-worker-id")


def state(pair: Pair, worker_id: str) -> str:
    return str(pair.ext.workers()[worker_id]["state"])


def prefill(pair: Pair, worker_id: str) -> int:
    rank = pair.ext.workers()[worker_id]["ranks"][0]
    return int(rank["effective"].get("active_prefill_tokens") or 0)


def test_a_worker_the_combined_estimate_fills_is_busy_on_both(fleet: Fleet) -> None:
    fleet.announce("fill", "m-fill", "a")
    with concurrent.futures.ThreadPoolExecutor(4) as pool:
        first = pool.submit(post, fleet.a, "m-fill", 600, 3000)
        # About 600 tokens: the estimate counts the whole body (docs/request-path.md).
        wait_until(lambda: prefill(fleet.a, "fill") >= 600, 5, "A's request on A")
        own = prefill(fleet.a, "fill")
        wait_until(lambda: prefill(fleet.b, "fill") == own, 5, "A's request seen on B")
        assert state(fleet.b, "fill") == "free"
        second = pool.submit(post, fleet.b, "m-fill", 600, 3000)
        # 1200 > 1000: busy on both replicas, before any load report.
        wait_until(lambda: state(fleet.a, "fill") == "busy", 5, "busy on A")
        assert state(fleet.b, "fill") == "busy"
        # Each replica alone would see 600 and route these; together they reject.
        assert post(fleet.a, "m-fill", 100)[0] == 529
        assert post(fleet.b, "m-fill", 100)[0] == 529
        assert first.result()[0] == 200 and second.result()[0] == 200
    wait_until(lambda: state(fleet.a, "fill") == "free", 5, "free on A after the requests")
    wait_until(lambda: state(fleet.b, "fill") == "free", 5, "free on B after the requests")


def test_a_burst_split_across_replicas_spreads_as_on_one(fleet: Fleet) -> None:
    for i, name in enumerate(("a", "b", "c")):
        fleet.announce(f"spread-{i}", "m-spread", name)
    n = 9
    with concurrent.futures.ThreadPoolExecutor(n) as pool:
        futures = [
            pool.submit(post, fleet.a if i % 2 else fleet.b, "m-spread", 50, 1500) for i in range(n)
        ]
        served = [f.result() for f in futures]
    assert all(status == 200 for status, _ in served), served
    per_worker = {name: sum(1 for _, w in served if w == name) for name in ("a", "b", "c")}
    # One replica would put 3 on each; no worker gets more than one more than that.
    assert max(per_worker.values()) <= n // 3 + 1, per_worker


def test_a_threshold_post_to_one_replica_changes_decisions_on_the_other(fleet: Fleet) -> None:
    fleet.announce("th", "m-th", "c")
    assert post(fleet.b, "m-th", 100)[0] == 200
    status, _, body = http(
        "POST",
        fleet.a.ext.admin + "/busy_threshold",
        {"model": "m-th", "active_prefill_tokens_threshold": 50},
    )
    assert status == 200, body
    wait_until(
        lambda: (
            get_json(fleet.b.ext.admin + "/busy_threshold")["thresholds"]
            == get_json(fleet.a.ext.admin + "/busy_threshold")["thresholds"]
        ),
        2,
        "same thresholds on both",
    )
    # 100 tokens > 50: the estimate of the request itself is checked on the next one.
    with concurrent.futures.ThreadPoolExecutor(2) as pool:
        held = pool.submit(post, fleet.b, "m-th", 100, 1500)
        wait_until(lambda: state(fleet.b, "th") == "busy", 5, "busy on B")
        assert post(fleet.b, "m-th", 10)[0] == 529
        assert held.result()[0] == 200
    http(
        "POST",
        fleet.b.ext.admin + "/busy_threshold",
        {"model": "m-th", "disable": ["active_prefill_tokens_threshold"]},
    )
    wait_until(
        lambda: (
            json.dumps(get_json(fleet.a.ext.admin + "/busy_threshold"))
            == json.dumps(get_json(fleet.b.ext.admin + "/busy_threshold"))
        ),
        2,
        "same thresholds again",
    )


def test_killing_a_replica_mid_burst_frees_its_workers_on_the_other_after_the_ttl(
    log_dir: Path, fleet: Fleet
) -> None:
    fleet.announce("kill", "m-kill", "b")
    with concurrent.futures.ThreadPoolExecutor(4) as pool:
        held = [pool.submit(post, fleet.a, "m-kill", 600, 4000) for _ in range(2)]
        wait_until(lambda: state(fleet.b, "kill") == "busy", 5, "A's burst fills kill on B")
        os.kill(fleet.a.ext.proc.pid, signal.SIGKILL)
        fleet.a.ext.proc.popen.wait(5)
        killed = time.monotonic()
        wait_until(lambda: state(fleet.b, "kill") == "free", TTL + 2, "freed on B")
        assert time.monotonic() - killed < TTL + 1.0
        for f in held:
            f.result()  # Envoy A answers (fails open or errors); nothing hangs
