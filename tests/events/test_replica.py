"""Two extproc replicas sharing estimates and thresholds through a real forwarder process."""

from __future__ import annotations

import asyncio
import functools
import subprocess
import sys
import time
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass

import pytest

from extproc.core.busy import BusyThresholds
from extproc.core.peers import PeerEstimates
from extproc.core.pool import WorkerPool
from extproc.core.scheduling import Routed, Scheduler
from extproc.devstack import free_port
from extproc.events.publisher import EventPublisher
from extproc.events.replica import ReplicaPublisher
from extproc.events.schema import ConfigEvent
from extproc.events.subscriber import EventSubscriber
from extproc.metrics.registry import Metrics


async def until(cond: Callable[[], object], timeout: float = 5.0, what: str = "") -> float:
    """Wait for ``cond``; returns the seconds it took."""
    started = time.monotonic()
    while not cond():
        if time.monotonic() - started > timeout:
            raise AssertionError(f"timed out after {timeout}s waiting for {what}")
        await asyncio.sleep(0.001)
    return time.monotonic() - started


@dataclass
class Replica:
    pool: WorkerPool
    peers: PeerEstimates
    sub: EventSubscriber
    pub: ReplicaPublisher


@pytest.fixture
async def forwarder() -> AsyncIterator[tuple[str, str]]:
    xsub, xpub = f"tcp://127.0.0.1:{free_port()}", f"tcp://127.0.0.1:{free_port()}"
    proc = subprocess.Popen(
        [sys.executable, "-m", "extproc.events.forwarder", "--xsub", xsub, "--xpub", xpub],
        stderr=subprocess.PIPE,
    )
    try:
        yield xsub, xpub
    finally:
        proc.terminate()
        try:
            code = proc.wait(5)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait(5)
            raise
    assert code == 0


async def replica(name: str, xsub: str, xpub: str, ttl: float = 1.0) -> Replica:
    pool = WorkerPool(BusyThresholds(None, 1000))
    pool.replica.replica_id = name
    peers = PeerEstimates(pool, ttl=ttl)
    sub = EventSubscriber(pool, Metrics(), peers=peers)
    await sub.start([], [xpub])
    pub = ReplicaPublisher(pool, [xsub], interval=0.2)
    await pub.start()
    return Replica(pool, peers, sub, pub)


async def test_estimates_and_thresholds_reach_the_other_replica(
    forwarder: tuple[str, str],
) -> None:
    xsub, xpub = forwarder
    a, b = await replica("r-a", xsub, xpub), await replica("r-b", xsub, xpub)
    worker = EventPublisher(
        xsub, ConfigEvent(worker_id="w", model="m", endpoint="127.0.0.1:9", kv_total_blocks=100)
    )
    try:
        await worker.start()
        await until(lambda: "w" in a.pool.workers and "w" in b.pool.workers, what="worker")
        # A burst dispatched on A shows on B as A's estimate, before any load report.
        sched = Scheduler(a.pool)
        tickets = []
        for _ in range(3):
            decision = sched.decide("m", 300)
            assert isinstance(decision, Routed)
            tickets.append(decision.ticket)
        rank_b = b.pool.workers["w"].ranks[0]
        await until(lambda: rank_b.peer_inflight == 3, what="A's estimate on B")
        assert rank_b.prefill_tokens == 900 and not b.pool.workers["w"].busy
        decision = Scheduler(b.pool).decide("m", 200)  # 1100 > 1000 on both replicas
        assert isinstance(decision, Routed)
        await until(lambda: a.pool.workers["w"].busy, what="B's request makes w busy on A")
        assert b.pool.workers["w"].busy
        for t in tickets:
            a.pool.release(t)
        await until(lambda: rank_b.peer_inflight == 0, what="A's release on B")
        b.pool.release(decision.ticket)
        # A threshold change on B applies on A.
        b.pool.set_thresholds("m", BusyThresholds(0.5, None, None))
        took = await until(
            lambda: a.pool.thresholds_for("m") == BusyThresholds(0.5), what="threshold on A"
        )
        assert took < 1.0  # measured at about 2 ms by loadtest.replicas; loose for busy CI
        # A replica that joins later learns the current values from the heartbeat.
        c = await replica("r-c", xsub, xpub)
        try:
            await until(lambda: c.pool.thresholds_for("m") == BusyThresholds(0.5), what="join")
        finally:
            await c.pub.close()
            c.sub.close()
    finally:
        await worker.close()
        for r in (a, b):
            await r.pub.close()
            r.sub.close()


async def test_a_replica_that_says_bye_or_goes_silent_is_dropped(
    forwarder: tuple[str, str],
) -> None:
    xsub, xpub = forwarder
    a, b = await replica("r-a", xsub, xpub), await replica("r-b", xsub, xpub, ttl=0.6)
    worker = EventPublisher(xsub, ConfigEvent(worker_id="w", model="m", endpoint="127.0.0.1:9"))
    try:
        await worker.start()
        await until(lambda: "w" in a.pool.workers and "w" in b.pool.workers, what="worker")
        decision = Scheduler(a.pool).decide("m", 10)
        assert isinstance(decision, Routed)
        rank_b = b.pool.workers["w"].ranks[0]
        await until(lambda: rank_b.peer_inflight == 1, what="A's estimate on B")
        await a.pub.close()  # says replica_bye
        await until(lambda: rank_b.peer_inflight == 0, 0.5, "bye removes A's estimate")
        # Silent (killed) replica: publishes, then stops without a bye.
        a.pub = ReplicaPublisher(a.pool, [xsub], interval=0.2)
        await a.pub.start()
        await until(lambda: rank_b.peer_inflight == 1, what="A is back")
        transport = a.pub._transport
        a.pub._transport = None  # nothing more is sent, as if the process died
        a.pub._heartbeat.cancel()  # type: ignore[union-attr]
        # The service's sweeper calls expire() twice a second; here the wait does.
        took = await until(
            lambda: (b.peers.expire(), rank_b.peer_inflight == 0)[1], 3.0, "TTL drops silent A"
        )
        assert 0.3 < took < 3.0  # the TTL is 0.6 s
        transport.close()
    finally:
        await worker.close()
        await b.pub.close()
        a.sub.close()
        b.sub.close()


async def test_replica_messages_are_authenticated_with_curve(tmp_path: object) -> None:
    """Direct topology with CURVE: replicas share one server key pair and admit it."""
    from pathlib import Path

    from extproc.events.curve import CurveClient, CurveServer
    from extproc.events.keys import main as keys_main

    keys = Path(str(tmp_path)) / "keys"
    admitted = Path(str(tmp_path)) / "publishers"
    admitted.mkdir()
    for name in ("extproc", "stranger"):
        assert keys_main([str(keys), name]) == 0
    (admitted / "extproc.key").write_bytes((keys / "extproc.key").read_bytes())
    secret = keys / "extproc.key_secret"
    replicas = []
    for name in ("r-a", "r-b"):
        pool = WorkerPool(BusyThresholds(None, 1000))
        pool.replica.replica_id = name
        metrics = Metrics()
        server = CurveServer(secret, admitted, functools.partial(count_refused, metrics))
        sub = EventSubscriber(pool, metrics, curve=server, peers=PeerEstimates(pool, ttl=5))
        endpoint = f"tcp://127.0.0.1:{free_port()}"
        await sub.start([endpoint], [])
        replicas.append((pool, metrics, sub, endpoint))
    (pool_a, _, sub_a, _), (pool_b, metrics_b, sub_b, endpoint_b) = replicas
    pool_a.announce("w", model="m", endpoint="127.0.0.1:9")
    pool_b.announce("w", model="m", endpoint="127.0.0.1:9")
    own = CurveClient.from_files(secret, keys / "extproc.key")
    stranger = CurveClient.from_files(keys / "stranger.key_secret", keys / "extproc.key")
    pub_a = ReplicaPublisher(pool_a, [endpoint_b], interval=0.2, curve=own)
    pool_x = WorkerPool(BusyThresholds())
    pool_x.replica.replica_id = "intruder"
    pool_x.announce("w", model="m", endpoint="127.0.0.1:9")
    pub_x = ReplicaPublisher(pool_x, [endpoint_b], interval=0.2, curve=stranger)
    try:
        await pub_a.start()
        await pub_x.start()
        Scheduler(pool_x).decide("m", 5000)  # the intruder claims a full worker
        decision = Scheduler(pool_a).decide("m", 300)
        assert isinstance(decision, Routed)
        rank_b = pool_b.workers["w"].ranks[0]
        await until(lambda: rank_b.peer_inflight == 1, what="A's estimate on B")
        await until(
            lambda: (
                (
                    metrics_b.registry.get_sample_value(
                        "extproc_events_refused_total", {"reason": "unknown_key"}
                    )
                    or 0
                )
                >= 1
            ),
            what="the intruder refused",
        )
        assert rank_b.peer_prefill == 300 and "intruder" not in dict(b_peers(sub_b))
    finally:
        await pub_a.close()
        await pub_x.close()
        sub_a.close()
        sub_b.close()


def count_refused(metrics: Metrics, reason: str) -> None:
    metrics.refused[reason].inc()


def b_peers(sub: EventSubscriber) -> dict[str, int]:
    assert sub.peers is not None
    return sub.peers.inflight()


async def test_a_class_change_on_one_replica_applies_on_the_other(
    forwarder: tuple[str, str],
) -> None:
    from extproc.core.classes import ClassRegistry, parse_table

    xsub, xpub = forwarder
    table = {"default": "std", "classes": {"std": {"share": 1.0}, "shed": {"share": 0.7}}}
    pools, subs, pubs, registries = [], [], [], []
    for name in ("r-a", "r-b"):
        pool = WorkerPool(BusyThresholds(0.5))
        pool.replica.replica_id = name
        registry = ClassRegistry(parse_table(table), pool)
        sub = EventSubscriber(pool, Metrics(), peers=PeerEstimates(pool, ttl=5), classes=registry)
        await sub.start([], [xpub])
        pub = ReplicaPublisher(pool, [xsub], interval=0.2, classes=registry)
        await pub.start()
        pools.append(pool)
        subs.append(sub)
        pubs.append(pub)
        registries.append(registry)
    try:
        registries[0].update_class("shed", {"share": 0.4, "status": 429})
        await until(
            lambda: registries[1].table.by_name("shed").share.active_decode_blocks == 0.4,
            what="the class change on B",
        )
        assert registries[1].table.by_name("shed").status == 429
        assert pools[1].shares[1].active_decode_blocks == 0.4  # B's flags use it
        assert registries[1].versions.stamps["shed"] == (1, "r-a")
        # An older change (a late message) does not undo it.
        registries[1].update_class("shed", {"share": 0.9}, (1, "r-0"))
        assert registries[1].table.by_name("shed").share.active_decode_blocks == 0.4
    finally:
        for pub in pubs:
            await pub.close()
        for sub in subs:
            sub.close()


async def test_a_latency_target_is_shared_like_a_threshold(forwarder: tuple[str, str]) -> None:
    xsub, xpub = forwarder
    a, b = await replica("r-a", xsub, xpub), await replica("r-b", xsub, xpub)
    try:
        with_target = BusyThresholds(None, 1000, None, 350.0, 40.0)
        b.pool.set_thresholds("m", with_target)
        await until(lambda: a.pool.thresholds_for("m") == with_target, what="target on A")
        a.pool.set_thresholds("m", BusyThresholds(None, 1000))  # turned off on A
        await until(
            lambda: b.pool.thresholds_for("m") == BusyThresholds(None, 1000), what="off on B"
        )
    finally:
        for r in (a, b):
            await r.pub.close()
            r.sub.close()
