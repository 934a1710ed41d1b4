"""Event wire format (SPEC §3) and the real ZMQ subscriber applying it to the pool."""

from __future__ import annotations

import asyncio
import json
from typing import Any

import msgspec
import pytest
import zmq
import zmq.asyncio

from extproc.busy import BusyThresholds
from extproc.datastore import WorkerPool
from extproc.events.schema import (
    ByeEvent,
    ConfigEvent,
    EventRejected,
    LoadEvent,
    decode,
    encode,
)
from extproc.events.subscriber import EventBindError, EventSubscriber
from extproc.metrics import Metrics
from tests.support.stack import free_port

CFG = {"v": 1, "worker_id": "w", "model": "m", "endpoint": "127.0.0.1:8000"}


def mp(obj: Any) -> bytes:
    return msgspec.msgpack.encode(obj)


@pytest.mark.parametrize(
    ("topic", "payload", "reason"),
    [
        (b"config", mp({**CFG, "kv_total_blocks": True}), "bad_schema"),
        (b"config", mp({**CFG, "kv_total_blocks": 60.0}), "bad_schema"),
        (b"config", mp({**CFG, "kv_total_blocks": -1}), "bad_schema"),
        (b"config", mp({**CFG, "block_size": 0}), "bad_schema"),
        (b"config", mp({**CFG, "dp_size": 0}), "bad_schema"),
        (b"config", mp({**CFG, "worker_type": "router"}), "bad_schema"),
        (b"config", mp({"v": 1, "model": "m", "endpoint": "h:1"}), "bad_schema"),
        (b"config", mp({**CFG, "model": 5}), "bad_schema"),
        (b"config", mp({**CFG, "endpoint": "nohostport"}), "bad_endpoint"),
        (b"config", mp({**CFG, "endpoint": "h:0"}), "bad_endpoint"),
        (b"config", mp({**CFG, "endpoint": "h:65536"}), "bad_endpoint"),
        (b"config", mp({**CFG, "endpoint": "::1:80"}), "bad_endpoint"),
        (b"config", mp({**CFG, "v": 2}), "bad_version"),
        (b"config", mp({**CFG, "v": "1"}), "bad_schema"),
        (b"load", mp({"v": 1, "worker_id": "w", "active_prefill_tokens": -5}), "bad_schema"),
        (b"load", mp({"v": 1, "worker_id": "w", "seq": 1.5}), "bad_schema"),
        (b"load", mp({"v": 1, "worker_id": "w", "dp_rank": -1}), "bad_schema"),
        (b"load", mp([1, 2]), "bad_schema"),
        (b"load", b"\xc1\xc1", "bad_encoding"),
        (b"load", b"{not json", "bad_encoding"),
        (b"load", b"", "bad_encoding"),
        (b"bye", mp({"v": 1}), "bad_schema"),
        (b"hello", mp(CFG), "unknown_topic"),
    ],
)
def test_malformed_messages_are_rejected_with_a_reason(
    topic: bytes, payload: bytes, reason: str
) -> None:
    with pytest.raises(EventRejected) as exc:
        decode(topic, payload)
    assert exc.value.reason == reason


def test_valid_messages_msgpack_and_json() -> None:
    ev = decode(b"config", mp({**CFG, "extra_key": [1], "endpoint": "[::1]:9"}))
    assert isinstance(ev, ConfigEvent) and ev.endpoint == "[::1]:9"
    no_v = decode(b"load", json.dumps({"worker_id": "w", "active_decode_blocks": 3}).encode())
    assert isinstance(no_v, LoadEvent) and no_v.active_decode_blocks == 3 and no_v.dp_rank is None
    assert isinstance(decode(b"bye", b'{"v":1,"worker_id":"w"}'), ByeEvent)


def test_encode_round_trips() -> None:
    for ev in (
        ConfigEvent(worker_id="w", model="m", endpoint="h:1", kv_total_blocks=5, dp_size=2),
        LoadEvent(worker_id="w", dp_rank=1, active_decode_blocks=3, seq=9),
        ByeEvent(worker_id="w"),
    ):
        assert decode(*encode(ev)) == ev


async def _setup(**pool_kw: Any) -> tuple[WorkerPool, Metrics, EventSubscriber, zmq.asyncio.Socket]:
    pool = WorkerPool(BusyThresholds(0.5), **pool_kw)
    metrics = Metrics()
    sub = EventSubscriber(pool, metrics)
    endpoint = f"tcp://127.0.0.1:{free_port()}"
    await sub.start([endpoint], [])
    ctx = zmq.asyncio.Context.instance()
    pub = ctx.socket(zmq.PUB)
    pub.setsockopt(zmq.LINGER, 0)
    pub.setsockopt(zmq.SNDHWM, 0)  # the test itself must not drop
    pub.connect(endpoint)
    return pool, metrics, sub, pub


async def _until(cond: Any, timeout: float = 5.0) -> None:
    loop = asyncio.get_running_loop()
    deadline = loop.time() + timeout
    while True:
        try:
            if cond():
                return
        except KeyError:  # not arrived yet
            pass
        assert loop.time() < deadline, "condition not met in time"
        await asyncio.sleep(0.005)


async def _join(pool: WorkerPool, pub: zmq.asyncio.Socket) -> None:
    """PUB/SUB joins late: send a config until it lands."""

    async def send_until() -> None:
        while "join" not in pool.workers:
            await pub.send_multipart([b"config", mp({**CFG, "worker_id": "join"})])
            await asyncio.sleep(0.01)

    await asyncio.wait_for(send_until(), 5)


def counter(metrics: Metrics, name: str, labels: dict[str, str] | None = None) -> float:
    value = metrics.registry.get_sample_value(name, labels or {})
    return value or 0.0


async def test_subscriber_applies_in_order_and_drops_bad_without_change() -> None:
    pool, metrics, sub, pub = await _setup()
    try:
        await _join(pool, pub)
        await pub.send_multipart([b"config", mp({**CFG, "kv_total_blocks": 100})])
        await pub.send_multipart(
            [b"load", mp({"v": 1, "worker_id": "w", "active_decode_blocks": 70, "seq": 1})]
        )
        # Bad ones in between: none may change state or stop the subscriber.
        await pub.send_multipart(
            [b"load", mp({"v": 1, "worker_id": "w", "active_decode_blocks": True})]
        )
        await pub.send_multipart([b"load", b"\xc1"])
        await pub.send_multipart([b"load"])
        await pub.send_multipart([b"load", mp({"v": 1, "worker_id": "w"}), b"extra"])
        await pub.send_multipart([b"nope", mp(CFG)])
        await pub.send_multipart([b"config", mp({**CFG, "v": 7, "model": "changed"})])
        await pub.send_multipart(
            [b"load", mp({"v": 1, "worker_id": "w", "active_decode_blocks": 10, "seq": 4})]
        )
        await _until(lambda: pool.workers["w"].ranks[0].reported_blocks == 10)
        assert pool.workers["w"].model == "m"
        assert not pool.workers["w"].busy
        assert counter(metrics, "extproc_events_dropped_total", {"reason": "bad_schema"}) == 1
        assert counter(metrics, "extproc_events_dropped_total", {"reason": "bad_encoding"}) == 1
        assert counter(metrics, "extproc_events_dropped_total", {"reason": "bad_frames"}) == 2
        assert counter(metrics, "extproc_events_dropped_total", {"reason": "unknown_topic"}) == 1
        assert counter(metrics, "extproc_events_dropped_total", {"reason": "bad_version"}) == 1
        assert counter(metrics, "extproc_events_lost_total") == 2
        assert counter(metrics, "extproc_events_total", {"topic": "load"}) == 2
        await pub.send_multipart([b"bye", b'{"v":1,"worker_id":"w"}'])
        await _until(lambda: "w" not in pool.workers)
    finally:
        pub.close(0)
        sub.close()


async def test_subscriber_ingests_a_burst_without_loss() -> None:
    pool, metrics, sub, pub = await _setup()
    try:
        await _join(pool, pub)
        await pub.send_multipart([b"config", mp({**CFG, "kv_total_blocks": 1000})])
        n = 20_000
        for i in range(1, n + 1):
            await pub.send_multipart(
                [
                    b"load",
                    mp({"v": 1, "worker_id": "w", "seq": i, "active_decode_blocks": i % 1000}),
                ]
            )
        await _until(lambda: pool.workers["w"].last_seq == n, 20)
        assert counter(metrics, "extproc_events_lost_total") == 0
        assert pool.workers["w"].ranks[0].reported_blocks == n % 1000
    finally:
        pub.close(0)
        sub.close()


async def test_bind_failure_names_the_endpoint() -> None:
    pool, metrics, sub, pub = await _setup()
    try:
        taken = sub.endpoints[0]
        other = EventSubscriber(pool, metrics)
        with pytest.raises(EventBindError, match=taken.replace(".", r"\.")):
            await other.start([taken], [])
    finally:
        pub.close(0)
        sub.close()


async def test_subscriber_connects_to_a_binding_publisher() -> None:
    pool = WorkerPool(BusyThresholds())
    metrics = Metrics()
    ctx = zmq.asyncio.Context.instance()
    pub = ctx.socket(zmq.PUB)
    pub.setsockopt(zmq.LINGER, 0)
    endpoint = f"tcp://127.0.0.1:{free_port()}"
    pub.bind(endpoint)
    sub = EventSubscriber(pool, metrics)
    await sub.start([], [endpoint])
    try:
        await _join(pool, pub)
        assert pool.by_model["m"][0].worker_id == "join"
    finally:
        pub.close(0)
        sub.close()
