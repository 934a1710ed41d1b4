"""Event wire format (docs/events.md) and the real ZMQ subscriber applying it to the pool."""

from __future__ import annotations

import asyncio
import itertools
import json
from typing import Any

import msgspec
import pytest
import zmq
import zmq.asyncio

from extproc.core.busy import BusyThresholds
from extproc.core.pool import WorkerPool
from extproc.devstack import free_port
from extproc.events.schema import (
    ByeEvent,
    ConfigEvent,
    EventRejected,
    LoadEvent,
    decode,
    encode,
)
from extproc.events.subscriber import DRAIN_BATCH, EventBindError, EventSubscriber
from extproc.metrics.registry import Metrics

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
        *(
            (
                b"load",
                mp({"v": 1, "worker_id": "w", "active_decode_blocks": 3, key: bad}),
                "bad_schema",
            )
            for key in ("num_requests_waiting", "request_active_slots", "request_total_slots")
            for bad in (True, False, 60.0, -1, "4", [4])
        ),
        (b"load", b'{"worker_id": "w", "num_requests_waiting": 60.0}', "bad_schema"),
        (b"load", b'{"worker_id": "w", "request_total_slots": true}', "bad_schema"),
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


def test_queue_and_slot_fields_decode_and_default_to_not_reported() -> None:
    fields = {"num_requests_waiting": 3, "request_active_slots": 8, "request_total_slots": 0}
    for payload in (
        mp({"v": 1, "worker_id": "w", **fields}),
        json.dumps({"worker_id": "w", **fields}).encode(),
    ):
        ev = decode(b"load", payload)
        assert isinstance(ev, LoadEvent)
        assert (ev.num_requests_waiting, ev.request_active_slots, ev.request_total_slots) == (
            3,
            8,
            0,
        )
    bare = decode(b"load", mp({"v": 1, "worker_id": "w"}))
    assert isinstance(bare, LoadEvent)
    assert (bare.num_requests_waiting, bare.request_active_slots, bare.request_total_slots) == (
        None,
        None,
        None,
    )
    big = decode(b"load", mp({"worker_id": "w", "request_total_slots": 2**63}))
    assert isinstance(big, LoadEvent) and big.request_total_slots == 2**63


def test_a_bad_queue_field_names_itself() -> None:
    with pytest.raises(EventRejected) as exc:
        decode(
            b"load", mp({"worker_id": "w", "active_decode_blocks": 1, "request_active_slots": -2})
        )
    assert exc.value.reason == "bad_schema" and "request_active_slots" in exc.value.detail
    with pytest.raises(EventRejected) as exc:
        decode(b"load", json.dumps({"worker_id": "w", "num_requests_waiting": True}).encode())
    assert "num_requests_waiting" in exc.value.detail


def test_encode_round_trips() -> None:
    for ev in (
        ConfigEvent(worker_id="w", model="m", endpoint="h:1", kv_total_blocks=5, dp_size=2),
        LoadEvent(worker_id="w", dp_rank=1, active_decode_blocks=3, seq=9),
        LoadEvent(
            worker_id="w", num_requests_waiting=2, request_active_slots=4, request_total_slots=4
        ),
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


async def _inproc_subscriber(name: str) -> tuple[WorkerPool, Metrics, EventSubscriber]:
    pool = WorkerPool(BusyThresholds(0.5))
    metrics = Metrics()
    sub = EventSubscriber(pool, metrics)
    await sub.start([name], [])
    return pool, metrics, sub


async def _backlog(pool: WorkerPool, name: str, messages: list[list[bytes]]) -> None:
    """Queue ``messages`` on the subscriber's socket while the event loop is not running.

    inproc on aiozmq's own context: a send lands in the SUB's queue at once, so the whole
    list is waiting when the loop next turns."""
    pub: zmq.Socket[bytes] = zmq.Context.instance().socket(zmq.PUB)
    pub.setsockopt(zmq.LINGER, 0)
    pub.setsockopt(zmq.SNDHWM, 0)
    pub.connect(name)
    join = [b"config", mp({**CFG, "worker_id": "join"})]
    deadline = asyncio.get_running_loop().time() + 5
    while "join" not in pool.workers:  # PUB/SUB joins late
        assert asyncio.get_running_loop().time() < deadline, "subscriber never joined"
        pub.send_multipart(join)
        await asyncio.sleep(0.01)
    for frames in messages:  # no await in here: the loop stands still
        pub.send_multipart(frames)
    pub.close()


async def test_a_backlog_is_read_in_bounded_batches_between_other_work() -> None:
    """A flood of events neither takes one loop turn per event (slow) nor holds the loop
    until it is drained (requests would wait): at most a batch per turn."""
    name = "inproc://events-backlog"
    pool, metrics, sub = await _inproc_subscriber(name)
    try:
        n = 2000
        loads = [[b"load", mp({"v": 1, "worker_id": "w", "active_prefill_tokens": k,
                               "seq": k})] for k in range(1, n + 1)]  # fmt: skip
        await _backlog(pool, name, [[b"config", mp(CFG)], *loads])
        loop = asyncio.get_running_loop()
        seen: list[int] = []

        def tick() -> None:  # once per loop turn: how far the subscriber has got
            w = pool.workers.get("w")
            seen.append((w.last_seq or 0) if w else 0)
            if seen[-1] < n:
                loop.call_soon(tick)

        began = loop.time()
        loop.call_soon(tick)
        await _until(lambda: pool.workers["w"].last_seq == n)
        steps = [b - a for a, b in itertools.pairwise(seen) if b > a]
        # Other work ran between batches (a turn of 128 events is ~1 ms of loop time)...
        assert max(steps) <= min(2 * DRAIN_BATCH, 128), max(steps)
        # ...and the backlog did not take a turn per event: 8 or more a turn on average.
        assert len(steps) <= n / 8, len(steps)
        assert pool.workers["w"].ranks[0].reported_prefill == n  # in order: the last wins
        assert counter(metrics, "extproc_events_total", {"topic": "load"}) == n
        assert counter(metrics, "extproc_events_lost_total") == 0
        # The time it took is counted, and is part of the time that passed.
        spent = counter(metrics, "extproc_event_seconds_total")
        assert 0 < spent <= loop.time() - began, spent
    finally:
        sub.close()


async def test_bad_messages_inside_a_batch_are_dropped_alone() -> None:
    """Frames are read message by message in a batch too: a 3-frame or 1-frame message in
    the middle is dropped whole and its neighbours are applied."""
    name = "inproc://events-bad-batch"
    pool, metrics, sub = await _inproc_subscriber(name)
    try:

        def load(k: int) -> list[bytes]:
            return [b"load", mp({"v": 1, "worker_id": "w", "active_prefill_tokens": k, "seq": k})]

        messages = [[b"config", mp(CFG)]]
        for k in range(1, 101):
            messages.append(load(k))
            if k == 30:
                messages.append([b"load", mp({"v": 1, "worker_id": "w"}), b"extra"])
            if k == 60:
                messages.append([b"load"])
            if k == 90:
                messages.append([b"gossip", b"{}"])
        await _backlog(pool, name, messages)
        await _until(lambda: pool.workers["w"].last_seq == 100)
        assert counter(metrics, "extproc_events_dropped_total", {"reason": "bad_frames"}) == 2
        assert counter(metrics, "extproc_events_dropped_total", {"reason": "unknown_topic"}) == 1
        assert counter(metrics, "extproc_events_total", {"topic": "load"}) == 100
        assert counter(metrics, "extproc_events_lost_total") == 0
        assert pool.workers["w"].ranks[0].reported_prefill == 100
    finally:
        sub.close()
