"""vLLM's own KV events: decoding, the per-rank counts, gaps, restarts and malformed
messages, all through real ZMQ sockets; and the agent publishing the blocks vLLM stores
between two scrapes.

The frames in ``data/vllm_kv_events.bin`` are what a real vLLM 0.32.0 sent (format in
``data/README.md``); the pages in ``data/`` are its ``/metrics``.
"""

from __future__ import annotations

import asyncio
import logging
import struct
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass
from pathlib import Path

import aiohttp
import msgspec
import pytest
import zmq
import zmq.asyncio
from aiohttp import web

from extproc.devstack import async_wait_until as wait_until
from extproc.devstack import free_port
from extproc.events.schema import ConfigEvent, LoadEvent
from llmworker.agent import Agent, worker_view
from llmworker.agent_settings import parse_args
from llmworker.engine_metrics import MetricsParseError, parse_engine_metrics, ttft_delta
from llmworker.vllm_kv_events import (
    BlockRemoved,
    BlockStored,
    KvEventSubscriber,
    decode_message,
)
from tests.llmworker.support import Subscriber

DATA = Path(__file__).parent / "data"
IDLE = (DATA / "vllm_metrics_idle.txt").read_text()
USAGE_LINE = 'vllm:kv_cache_usage_perc{engine="0",model_name="smollm2"} 0.0'
TOPIC = b"kv-events"


def read_frames(path: Path) -> list[list[bytes]]:
    """The messages in the capture: u32 frame count, then per frame u32 length and bytes."""
    data = path.read_bytes()
    messages: list[list[bytes]] = []
    pos = 0
    while pos < len(data):
        (count,) = struct.unpack_from(">I", data, pos)
        pos += 4
        frames = []
        for _ in range(count):
            (length,) = struct.unpack_from(">I", data, pos)
            pos += 4
            frames.append(data[pos : pos + length])
            pos += length
        messages.append(frames)
    return messages


CAPTURED = read_frames(DATA / "vllm_kv_events.bin")


def page(held: int) -> str:
    """The real idle page of a vLLM with 10 blocks, with ``held`` of its 9 usable in use."""
    assert USAGE_LINE in IDLE
    return IDLE.replace(USAGE_LINE, USAGE_LINE.replace(" 0.0", f" {held / 9!r}"))


def frames(seq: int, events: list[object], rank: int = 0) -> list[bytes]:
    """A message as vLLM sends it."""
    return [TOPIC, seq.to_bytes(8, "big"), msgspec.msgpack.encode([1e9 + seq, events, rank])]


def stored(*hashes: int) -> dict[str, object]:
    return {
        "type": "BlockStored",
        "block_hashes": list(hashes),
        "parent_block_hash": None,
        "token_ids": list(range(128 * len(hashes))),
        "block_size": 128,
        "lora_id": None,
        "medium": "GPU",
    }


def removed(*hashes: int) -> dict[str, object]:
    return {"type": "BlockRemoved", "block_hashes": list(hashes), "medium": "GPU"}


class Publisher:
    """vLLM's side: a real PUB socket that connects to the subscriber's endpoint."""

    def __init__(self, endpoint: str) -> None:
        self.ctx = zmq.asyncio.Context()
        self.sock = self.ctx.socket(zmq.PUB)
        self.sock.setsockopt(zmq.LINGER, 0)
        self.sock.connect(endpoint)

    async def connect(self, sub: KvEventSubscriber) -> None:
        """Send empty batches of rank 99 (a rank the tests do not look at) until one
        arrives: the connection is up, and what is sent next arrives in order."""
        seq = 0
        while not sub.state.ranks.get(99):
            await self.sock.send_multipart(frames(seq, [], rank=99))
            seq += 1
            await asyncio.sleep(0.01)

    async def send(self, *messages: list[bytes]) -> None:
        for message in messages:
            await self.sock.send_multipart(message)

    def close(self) -> None:
        self.sock.close(0)
        self.ctx.term()


@pytest.fixture
async def kv_sub() -> AsyncIterator[KvEventSubscriber]:
    sub = KvEventSubscriber([f"tcp://127.0.0.1:{free_port()}"], "kv-events")
    sub.start()
    yield sub
    await sub.stop()


async def _replay(sub: KvEventSubscriber, messages: list[list[bytes]]) -> int:
    """Send ``messages`` through a real PUB socket; wait until all of them were handled.
    The messages decoded before them (the connection's probes)."""
    pub = Publisher(sub.endpoints[0])
    st = sub.state.stats
    try:
        await pub.connect(sub)
        before = st.messages
        start = st.messages + sum(st.malformed.values())
        await pub.send(*messages)
        await wait_until(
            lambda: st.messages + sum(st.malformed.values()) >= start + len(messages),
            what="every message handled",
        )
    finally:
        pub.close()
    return before


# --- decoding -----------------------------------------------------------------------------


def test_the_captured_messages_decode_into_typed_events() -> None:
    messages = [decode_message(f, TOPIC) for f in CAPTURED]
    assert [m.seq for m in messages] == list(range(9))
    assert {m.dp_rank for m in messages} == {0}
    assert all(not m.skipped for m in messages)
    first = messages[0].events[0]
    assert isinstance(first, BlockStored)
    assert (len(first.block_hashes), first.block_size, first.medium) == (2, 128, "GPU")
    assert first.parent_block_hash is None
    assert isinstance(messages[3].events[0], BlockRemoved)
    # Four requests with one prompt: vLLM stored one hash in three blocks in one batch.
    assert len({e.block_hashes[0] for e in messages[2].events}) == 1  # type: ignore[union-attr]


async def test_replaying_the_capture_counts_blocks_per_rank(kv_sub: KvEventSubscriber) -> None:
    await _replay(kv_sub, CAPTURED)
    st = kv_sub.state.stats
    assert (st.lost, st.gaps, st.restarts, dict(st.malformed)) == (0, 0, 0, {})
    assert st.events == {"BlockStored": 9, "BlockRemoved": 3}
    rank = kv_sub.state.ranks[0]
    # 10 blocks stored, 3 evicted: 7 still cached (in use or not), as vLLM left them.
    assert (rank.stored_total, rank.removed_total, rank.cached_blocks) == (10, 3, 7)
    assert (rank.last_seq, rank.block_size) == (8, 128)


# --- gaps, restarts, malformed messages ----------------------------------------------------


async def test_a_sequence_gap_is_logged_and_counted(
    kv_sub: KvEventSubscriber, caplog: pytest.LogCaptureFixture
) -> None:
    caplog.set_level(logging.INFO, logger="llmworker.kv_events")
    await _replay(kv_sub, [frames(1, [stored(1)]), frames(5, [stored(2)])])
    st = kv_sub.state.stats
    assert (st.lost, st.gaps, st.restarts) == (3, 1, 0)
    assert kv_sub.state.ranks[0].stored_total == 2  # what arrived still counts
    gaps = [r.getMessage() for r in caplog.records if "lost" in r.getMessage()]
    assert gaps == [
        "vLLM KV events of rank 0: 3 message(s) lost (seq 5 after 1; 3 lost in all): "
        "the blocks in use are re-anchored at the next scrape"
    ]


async def test_a_restarted_engine_starts_its_sequence_again(
    kv_sub: KvEventSubscriber, caplog: pytest.LogCaptureFixture
) -> None:
    caplog.set_level(logging.WARNING, logger="llmworker.kv_events")
    messages = [frames(1, [stored(1, 2)]), frames(2, [stored(3)]), frames(0, [stored(9)])]
    await _replay(kv_sub, messages)
    st, rank = kv_sub.state.stats, kv_sub.state.ranks[0]
    assert (st.restarts, st.lost) == (1, 0)
    # The old engine's cache is gone; only what the new one stored is cached.
    assert (rank.cached_blocks, rank.stored_total, rank.last_seq) == (1, 4, 0)
    assert any("seq went back from 2 to 0" in r.getMessage() for r in caplog.records)


async def test_malformed_messages_are_counted_by_reason_and_never_stop_the_socket(
    kv_sub: KvEventSubscriber, caplog: pytest.LogCaptureFixture
) -> None:
    caplog.set_level(logging.WARNING, logger="llmworker.kv_events")
    seq1 = (1).to_bytes(8, "big")
    bad = [
        [TOPIC, seq1],  # two frames
        [TOPIC + b"-other", seq1, msgspec.msgpack.encode([0.0, [], 0])],  # another topic
        [TOPIC, b"\x01", msgspec.msgpack.encode([0.0, [], 0])],  # a 1-byte sequence
        [TOPIC, seq1, b"\xc1 not msgpack"],
        [TOPIC, seq1, msgspec.msgpack.encode({"ts": 0.0})],  # a map, not a batch
        [TOPIC, seq1, msgspec.msgpack.encode(["now", [], 0])],  # ts not a number
        frames(1, [{"type": "BlockMoved", "block_hashes": [1]}, stored(4)]),
        frames(2, [{"type": "BlockStored"}, removed(4), 7]),
        frames(3, [stored(5)]),  # and a good one after them all
    ]
    probes = await _replay(kv_sub, bad)
    st = kv_sub.state.stats
    assert st.malformed == {
        "frames": 1,
        "topic": 1,
        "seq": 1,
        "batch": 3,
        "unknown-type": 1,
        "event": 2,
    }
    assert st.messages == probes + 3  # the three decodable ones
    rank = kv_sub.state.ranks[0]
    assert (rank.stored_total, rank.removed_total, rank.cached_blocks) == (2, 1, 1)
    assert (st.lost, st.restarts) == (0, 0)
    warned = [r.getMessage() for r in caplog.records]
    assert any(m.startswith("malformed vLLM KV-event message (seq, 1 so far)") for m in warned)
    assert any("type 'BlockMoved'" in m for m in warned)


# --- the agent -------------------------------------------------------------------------------


@dataclass
class FakeVllm:
    """A /metrics page whose text the test changes (a real vLLM's page, edited)."""

    text: str
    url: str = ""
    hits: int = 0


@pytest.fixture
async def fake_vllm() -> AsyncIterator[FakeVllm]:
    engine = FakeVllm(text=page(0))

    async def metrics(request: web.Request) -> web.Response:
        engine.hits += 1
        return web.Response(text=engine.text)

    app = web.Application()
    app.router.add_get("/metrics", metrics)
    runner = web.AppRunner(app)
    await runner.setup()
    await web.TCPSite(runner, "127.0.0.1", 0).start()
    engine.url = f"http://127.0.0.1:{runner.addresses[0][1]}"
    yield engine
    await runner.cleanup()


def _agent(engine: FakeVllm, sub: Subscriber, *flags: str) -> Agent:
    settings, _ = parse_args(
        [
            "--engine", "vllm", "--engine-url", engine.url, "--model", "smollm2",
            "--worker-id", "w", "--endpoint", "127.0.0.1:8000", "--publish", sub.endpoint,
            "--max-num-seqs", "4", *flags,
        ],
        environ={},
    )  # fmt: skip
    return Agent(settings)


async def _next_load(sub: Subscriber, want: Callable[[LoadEvent], bool]) -> LoadEvent:
    while True:
        event = await sub.next_of(LoadEvent)
        if want(event):
            return event


async def test_blocks_vllm_stores_between_scrapes_are_published_at_once(
    fake_vllm: FakeVllm,
) -> None:
    sub = Subscriber()
    kv_bind = f"tcp://127.0.0.1:{free_port()}"
    # One scrape at the start, the next in 60 s: only the events can change the load.
    agent = _agent(fake_vllm, sub, "--interval", "60", "--kv-events-bind", kv_bind)
    fake_vllm.text = page(2)
    await agent.start()
    assert agent.kv_events is not None
    pub = Publisher(kv_bind)
    try:
        config = await sub.next_of(ConfigEvent)
        assert (config.block_size, config.kv_total_blocks) == (128, 10)
        first = await sub.next_of(LoadEvent)
        assert first.active_decode_blocks == 2  # the scrape: 2 of the 9 usable blocks
        await pub.connect(agent.kv_events)
        await pub.send(frames(1, [stored(11, 12)]))
        load = await _next_load(sub, lambda e: e.active_decode_blocks != 2)
        assert load.active_decode_blocks == 4
        # Evictions do not lower it (vLLM evicts when it allocates) ...
        await pub.send(frames(2, [removed(11), stored(13)]))
        assert (
            await _next_load(sub, lambda e: e.active_decode_blocks != 4)
        ).active_decode_blocks == 5
        # ... and it never goes past the 9 blocks that can hold tokens.
        await pub.send(frames(3, [stored(*range(20, 40))]))
        assert (
            await _next_load(sub, lambda e: e.active_decode_blocks != 5)
        ).active_decode_blocks == 9
        # The next scrape re-anchors: the engine's own count wins again (the requests ended).
        fake_vllm.text = page(1)
        await agent.scrape_once()
        assert (
            await _next_load(sub, lambda e: e.active_decode_blocks != 9)
        ).active_decode_blocks == 1
        assert agent.kv_events.state.ranks[0].cached_blocks == 22
    finally:
        pub.close()
        await agent.stop()
        sub.close()


async def test_agent_exposes_the_event_counters_through_its_proxy(fake_vllm: FakeVllm) -> None:
    fake_vllm.text = page(0)
    sub = Subscriber()
    kv_bind = f"tcp://127.0.0.1:{free_port()}"
    port = free_port()
    agent = _agent(fake_vllm, sub, "--kv-events-bind", kv_bind, "--listen", f"127.0.0.1:{port}")
    await agent.start()
    assert agent.kv_events is not None
    pub = Publisher(kv_bind)
    try:
        st = agent.kv_events.state.stats
        await pub.connect(agent.kv_events)
        await pub.send(frames(0, [stored(1, 2)]), frames(4, []), [TOPIC, b"x"])
        await wait_until(lambda: st.lost == 3 and st.malformed["frames"] == 1, what="counted")
        async with (
            aiohttp.ClientSession() as session,
            session.get(f"http://127.0.0.1:{port}/metrics") as r,
        ):
            text = await r.text()
        for line in (
            'llmworker_kv_events_total{type="BlockStored"} 1.0',
            "llmworker_kv_events_lost_total 3.0",
            'llmworker_kv_events_malformed_total{reason="frames"} 1.0',
            'llmworker_kv_events_cached_blocks{dp_rank="0"} 2.0',
        ):
            assert line in text, line
    finally:
        pub.close()
        await agent.stop()
        sub.close()


async def test_no_events_while_vllm_holds_blocks_warns_naming_kv_events_config(
    fake_vllm: FakeVllm, caplog: pytest.LogCaptureFixture
) -> None:
    caplog.set_level(logging.WARNING, logger="llmworker.agent")
    sub = Subscriber()
    kv_bind = f"tcp://127.0.0.1:{free_port()}"
    agent = _agent(
        fake_vllm,
        sub,
        *("--interval", "0.02", "--kv-events-bind", kv_bind, "--kv-events-timeout", "0.2"),
    )
    fake_vllm.text = page(1)  # one block held: a short prompt, which stores nothing
    await agent.start()
    try:
        await wait_until(lambda: fake_vllm.hits >= 20, what="twenty scrapes")
        assert not [r for r in caplog.records if "--kv-events-config" in r.getMessage()]
        fake_vllm.text = page(3)
        await wait_until(
            lambda: any("--kv-events-config" in r.getMessage() for r in caplog.records),
            what="the warning",
        )
        (warning,) = [
            r.getMessage() for r in caplog.records if "kv-events-config" in r.getMessage()
        ]
        assert warning.startswith(f"no KV event from vLLM on {kv_bind} although it has held")
        assert f'"endpoint": "{kv_bind}"' in warning
    finally:
        await agent.stop()
        sub.close()


async def test_a_taken_kv_events_port_stops_the_start_naming_the_flag(
    fake_vllm: FakeVllm,
) -> None:
    taken = KvEventSubscriber([f"tcp://127.0.0.1:{free_port()}"], "kv-events")
    taken.start()
    sub = Subscriber()
    agent = _agent(fake_vllm, sub, "--kv-events-bind", taken.endpoints[0])
    try:
        with pytest.raises(OSError, match=r"--kv-events-bind: cannot bind tcp://127\.0\.0\.1:"):
            await agent.start()
    finally:
        await agent.stop()
        await taken.stop()
        sub.close()


async def test_a_vllm_page_without_what_the_agent_needs_names_the_flag(
    fake_vllm: FakeVllm, caplog: pytest.LogCaptureFixture
) -> None:
    caplog.set_level(logging.WARNING, logger="llmworker.agent")
    lines = page(0).splitlines()
    fake_vllm.text = (
        "\n".join(x for x in lines if not x.startswith("vllm:cache_config_info")) + "\n"
    )
    sub = Subscriber()
    settings, _ = parse_args(
        [
            "--engine", "vllm", "--engine-url", fake_vllm.url, "--model", "smollm2",
            "--worker-id", "w", "--endpoint", "127.0.0.1:8000", "--publish", sub.endpoint,
        ],
        environ={},
    )  # fmt: skip
    agent = Agent(settings)
    await agent.start()
    try:
        config = await sub.next_of(ConfigEvent)
        assert (config.block_size, config.kv_total_blocks) == (16, None)
        warned = {r.getMessage().split(":")[0] for r in caplog.records}
        assert any("--block-size" in r.getMessage() for r in caplog.records), warned
        assert any("--kv-total-blocks" in r.getMessage() for r in caplog.records), warned
        assert any("--max-num-seqs" in r.getMessage() for r in caplog.records), warned
    finally:
        await agent.stop()
        sub.close()


@pytest.mark.parametrize(
    ("flags", "message"),
    [
        (
            ["--kv-events-bind", "tcp://127.0.0.1:0"],
            "--kv-events-bind='tcp://127.0.0.1:0' is invalid: expected tcp://HOST:PORT to bind",
        ),
        (
            ["--kv-events-bind", "127.0.0.1:5570"],
            "--kv-events-bind='127.0.0.1:5570' is invalid",
        ),
        (
            ["--kv-events-bind", "tcp://127.0.0.1:65535", "--dp-size", "2"],
            "the last rank's port would be above 65535",
        ),
        (
            ["--engine", "sglang", "--kv-events-bind", "tcp://127.0.0.1:5570"],
            "--kv-events-bind is for --engine vllm",
        ),
        (["--kv-events-timeout", "0"], "--kv-events-timeout='0' is invalid"),
    ],
)
def test_bad_kv_events_flags_exit_2_naming_the_flag(
    flags: list[str], message: str, capsys: pytest.CaptureFixture[str]
) -> None:
    argv = [
        "--engine", "vllm", "--engine-url", "http://127.0.0.1:1", "--model", "m",
        "--worker-id", "w", "--endpoint", "127.0.0.1:9", "--publish", "tcp://127.0.0.1:9",
    ]  # fmt: skip
    if flags[0] == "--engine":
        argv[1] = flags[1]
        flags = flags[2:]
    with pytest.raises(SystemExit) as exc:
        parse_args([*argv, *flags], environ={})
    assert exc.value.code == 2
    assert message in capsys.readouterr().err


def test_data_parallel_ranks_bind_consecutive_ports() -> None:
    settings, _ = parse_args(
        [
            "--engine", "vllm", "--engine-url", "http://127.0.0.1:1", "--model", "m",
            "--worker-id", "w", "--endpoint", "127.0.0.1:9", "--publish", "tcp://127.0.0.1:9",
            "--kv-events-bind", "tcp://*:5570", "--dp-size", "3",
        ],
        environ={},
    )  # fmt: skip
    assert settings.kv_events_endpoints == ("tcp://*:5570", "tcp://*:5571", "tcp://*:5572")


def test_the_real_pages_give_ttft_and_prompt_length_as_the_mapping_table_says() -> None:
    """The rows of docs/worker.md not covered elsewhere, on the real vLLM's pages."""
    idle = parse_engine_metrics("vllm", IDLE).ranks[0]
    real = parse_engine_metrics("vllm", (DATA / "vllm_metrics_real.txt").read_text())
    after = parse_engine_metrics("vllm", (DATA / "vllm_metrics_after.txt").read_text()).ranks[0]
    # Four first tokens, each within 0.5 s, between the idle page and the last one.
    assert ttft_delta(idle.ttft_buckets, after.ttft_buckets) == [(0.5, 4)]
    # The prompt histogram fills when requests finish: none had in flight, so with one
    # request waiting the prefill estimate is omitted; after, the mean is 300 tokens.
    settings, _ = parse_args(
        [
            "--engine", "vllm", "--engine-url", "http://127.0.0.1:1", "--model", "m",
            "--worker-id", "w", "--endpoint", "127.0.0.1:9", "--publish", "tcp://127.0.0.1:9",
        ],
        environ={},
    )  # fmt: skip
    assert real.ranks[0].num_waiting == 1
    assert worker_view(real, settings).loads[0].active_prefill_tokens is None
    assert (after.avg_prompt_tokens, after.num_waiting) == (300.0, 0)
    assert real.max_num_batched_tokens is None  # not printed by this vLLM


def test_a_vllm_started_with_disable_log_stats_is_named() -> None:
    """What a real vLLM 0.32.0 started with --disable-log-stats served: /metrics answers 200
    with the process and Python series and no vllm: series at all."""
    page_without_stats = "\n".join(line for line in IDLE.splitlines() if "vllm:" not in line)
    assert "process_resident_memory_bytes" in page_without_stats
    with pytest.raises(MetricsParseError, match="started without --disable-log-stats"):
        parse_engine_metrics("vllm", page_without_stats)
