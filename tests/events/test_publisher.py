"""EventPublisher against a real SUB socket bound on a random port, as the extproc binds."""

from __future__ import annotations

import asyncio
import time
from collections.abc import AsyncIterator

import pytest
import zmq

from extproc.events.publisher import EventPublisher
from extproc.events.schema import ByeEvent, ConfigEvent, LoadEvent
from tests.llmworker.support import Subscriber

CONFIG = ConfigEvent(
    worker_id="w-1",
    model="m",
    endpoint="127.0.0.1:8001",
    kv_total_blocks=100,
    block_size=16,
    max_num_batched_tokens=512,
    dp_size=2,
)


@pytest.fixture
async def sub() -> AsyncIterator[Subscriber]:
    s = Subscriber()
    yield s
    s.close()


async def test_config_first_then_loads_with_increasing_seq(sub: Subscriber) -> None:
    pub = EventPublisher(sub.endpoint, CONFIG, heartbeat=30)
    pub.update_load(0, active_decode_blocks=1, active_prefill_tokens=2)
    pub.update_load(1, active_decode_blocks=3, active_prefill_tokens=4, kv_total_blocks=50)
    async with pub:
        assert await sub.next() == CONFIG
        first = await sub.next()
        second = await sub.next()
        assert first == LoadEvent(
            worker_id="w-1", dp_rank=0, active_decode_blocks=1, active_prefill_tokens=2, seq=1
        )
        assert second == LoadEvent(
            worker_id="w-1",
            dp_rank=1,
            active_decode_blocks=3,
            active_prefill_tokens=4,
            kv_total_blocks=50,
            seq=2,
        )
        pub.update_load(0, active_decode_blocks=9, active_prefill_tokens=0)
        third = await sub.next()
        assert isinstance(third, LoadEvent) and third.seq == 3
        assert (third.active_decode_blocks, third.active_prefill_tokens) == (9, 0)
        assert pub.seq == 3


async def test_queue_and_slot_counts_go_out_with_the_load_and_a_change_in_them_is_sent(
    sub: Subscriber,
) -> None:
    async with EventPublisher(sub.endpoint, CONFIG, heartbeat=30) as pub:
        await sub.next_of(ConfigEvent)
        pub.update_load(
            0,
            active_decode_blocks=4,
            num_requests_waiting=2,
            request_active_slots=8,
            request_total_slots=8,
        )
        first = await sub.next_of(LoadEvent)
        assert first == LoadEvent(
            worker_id="w-1",
            dp_rank=0,
            active_decode_blocks=4,
            num_requests_waiting=2,
            request_active_slots=8,
            request_total_slots=8,
            seq=first.seq,
        )
        # Only the waiting count changes: that alone is a new load message.
        pub.update_load(
            0,
            active_decode_blocks=4,
            num_requests_waiting=0,
            request_active_slots=8,
            request_total_slots=8,
        )
        second = await sub.next_of(LoadEvent)
        assert (second.num_requests_waiting, second.request_active_slots) == (0, 8)
        assert second.seq == (first.seq or 0) + 1
        # Left out: not reported.
        pub.update_load(0, active_decode_blocks=4)
        third = await sub.next_of(LoadEvent)
        assert (third.num_requests_waiting, third.request_total_slots) == (None, None)


async def test_heartbeat_resends_config_and_every_rank(sub: Subscriber) -> None:
    async with EventPublisher(sub.endpoint, CONFIG, heartbeat=0.15) as pub:
        pub.update_load(0, active_decode_blocks=5)
        pub.update_load(1, active_decode_blocks=6)
        events = await sub.drain(0.6)
    configs = [e for e in events if isinstance(e, ConfigEvent)]
    loads = [e for e in events if isinstance(e, LoadEvent)]
    assert len(configs) >= 3  # at the join, then every 0.15 s
    for rank, blocks in ((0, 5), (1, 6)):
        mine = [e for e in loads if e.dp_rank == rank]
        assert len(mine) >= 3 and all(e.active_decode_blocks == blocks for e in mine)
    seqs = [e.seq or 0 for e in loads]
    assert seqs == list(range(seqs[0], seqs[0] + len(seqs)))  # one number per load message


async def test_debounce_coalesces_a_burst_and_spaces_sends(sub: Subscriber) -> None:
    async with EventPublisher(sub.endpoint, CONFIG, heartbeat=30, debounce=0.1) as pub:
        await sub.next_of(ConfigEvent)
        for i in range(1000):
            pub.update_load(0, active_decode_blocks=i)
        first = await sub.next()
        assert isinstance(first, LoadEvent) and first.active_decode_blocks == 999
        t_first = time.monotonic()
        pub.update_load(0, active_decode_blocks=1)
        pub.update_load(0, active_decode_blocks=2)
        second = await sub.next()
        assert isinstance(second, LoadEvent) and second.active_decode_blocks == 2
        assert time.monotonic() - t_first >= 0.08  # not before the debounce interval
        assert first.seq is not None and second.seq == first.seq + 1
        pub.update_load(0, active_decode_blocks=2)  # unchanged: nothing to send
        assert await sub.drain(0.2) == []


async def test_update_config_is_sent_at_once_and_validated(sub: Subscriber) -> None:
    async with EventPublisher(sub.endpoint, CONFIG, heartbeat=30) as pub:
        await sub.next_of(ConfigEvent)
        pub.update_config(kv_total_blocks=200)
        changed = await sub.next()
        assert isinstance(changed, ConfigEvent) and changed.kv_total_blocks == 200
        pub.update_config(kv_total_blocks=200)
        with pytest.raises(ValueError, match="endpoint"):
            pub.update_config(endpoint="no-port")
        with pytest.raises(ValueError, match="unknown"):
            pub.update_config(colour="red")
        assert pub.config.kv_total_blocks == 200
        assert await sub.drain(0.2) == []


async def test_bye_on_close(sub: Subscriber) -> None:
    pub = EventPublisher(sub.endpoint, CONFIG, heartbeat=30)
    await pub.start()
    await sub.next_of(ConfigEvent)
    await pub.close()
    assert await sub.next_of(ByeEvent) == ByeEvent(worker_id="w-1")
    await pub.close()  # idempotent


async def test_reconnects_to_a_restarted_subscriber_and_resends_state() -> None:
    first = Subscriber()
    endpoint = first.endpoint
    async with EventPublisher(endpoint, CONFIG, heartbeat=30, reconnect_ivl=0.05) as pub:
        pub.update_load(0, active_decode_blocks=7)
        await first.next_of(ConfigEvent)
        first.close()
        second = Subscriber(endpoint)  # the extproc restarted on the same port
        try:
            assert await second.next_of(ConfigEvent, timeout=5) == CONFIG
            load = await second.next_of(LoadEvent)
            assert load.active_decode_blocks == 7
        finally:
            second.close()


async def test_full_socket_drops_and_counts_without_blocking() -> None:
    stuck = Subscriber(RCVHWM=1, RCVBUF=4096)  # reads the first message, then no more
    try:
        pub = EventPublisher(
            stuck.endpoint,
            CONFIG,
            heartbeat=30,
            sndhwm=1,
            linger=0.2,
            sockopts={zmq.SNDBUF: 4096},
        )
        await pub.start()
        await stuck.next_of(ConfigEvent)
        started = time.monotonic()
        for i in range(200_000):
            pub.update_config(kv_total_blocks=i)
            if pub.dropped:
                break
            if i % 100 == 0:
                await asyncio.sleep(0)
        assert pub.dropped > 0
        assert time.monotonic() - started < 20
        t = time.monotonic()
        await pub.close()  # bye cannot get through; close still returns
        assert time.monotonic() - t < 2
    finally:
        stuck.close()


async def test_bad_arguments() -> None:
    with pytest.raises(ValueError, match="endpoint"):
        EventPublisher([], CONFIG)
    with pytest.raises(ValueError, match="heartbeat"):
        EventPublisher("tcp://127.0.0.1:1", CONFIG, heartbeat=0)
    with pytest.raises(ValueError, match="invalid worker config"):
        EventPublisher("tcp://127.0.0.1:1", ConfigEvent(worker_id="w", model="m", endpoint="x"))
