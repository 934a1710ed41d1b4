"""vLLM's own KV-cache events over ZeroMQ: decoded at the edge, counted per rank.

vLLM started with ``--kv-events-config '{"enable_kv_cache_events": true, "publisher": "zmq",
"endpoint": "tcp://HOST:PORT", "topic": "kv-events"}'`` publishes one message per engine step
that changed its prefix cache. Its PUB socket *connects* when the endpoint names a host (it
binds only to ``*``, ``::``, ipc or inproc), so :class:`KvEventSubscriber` binds the SUB side.
With data parallelism rank ``r`` publishes to ``PORT + r``.

A message has three frames: the topic, the sequence number (8 bytes, big-endian, from 0, one
per message and per rank), and a msgpack ``KVEventBatch`` ``[ts, events, data_parallel_rank]``
whose events are maps tagged ``type``:

- ``BlockStored``: blocks that just became full (one event may list several) and are now in
  the prefix cache under these hashes. A block is stored when it is *full*: a prompt under one
  block (128 tokens on CPU) stores nothing, and a request's last, partial block never does.
- ``BlockRemoved``: cached blocks evicted, which vLLM does when it hands a free block to a
  new allocation. It is not the end of a request: a finished request's blocks stay cached,
  with no event, until they are evicted.
- ``AllBlocksCleared``: the prefix cache was reset.

The structs below are ours, written after vLLM's ``vllm/distributed/kv_events.py`` (0.32);
fields this module does not use (``token_ids``, ``lora_id``, ...) are skipped while
decoding, and an event type it does not know is counted and skipped, not an error.

What the counts mean, per rank (:class:`RankKv`):

- ``stored_total``: blocks stored since the agent started, a counter. Its growth between two
  scrapes is what the agent adds to the blocks in use that the last scrape showed
  (docs/worker.md, "vLLM's KV events").
- ``cached_blocks``: blocks stored and not removed, counted per copy (vLLM may store the
  same hash in several blocks: four requests with one prompt stored it four times). This is
  the prefix cache's content, in use or not; it is not the blocks in use.

Sequence gaps, a publisher that restarted (its sequence went back) and malformed messages
are logged and counted (:class:`KvEventStats`); none of them stops the subscriber.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections import Counter
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

import msgspec
import zmq
import zmq.asyncio
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily
from prometheus_client.registry import Collector

log = logging.getLogger("llmworker.kv_events")

BlockHash = int | bytes
"""vLLM 0.32 sends 64-bit integers; some versions send the hash's bytes."""


# ---------------------------------------------------------------------------
# the wire format (typed structs; decoded with msgspec)


class BlockStored(msgspec.Struct, tag="BlockStored", tag_field="type", frozen=True):
    block_hashes: list[BlockHash]
    parent_block_hash: BlockHash | None = None
    block_size: int | None = None
    medium: str | None = None


class BlockRemoved(msgspec.Struct, tag="BlockRemoved", tag_field="type", frozen=True):
    block_hashes: list[BlockHash]
    medium: str | None = None


class AllBlocksCleared(msgspec.Struct, tag="AllBlocksCleared", tag_field="type", frozen=True):
    medium: str | None = None


KvEvent = BlockStored | BlockRemoved | AllBlocksCleared
KNOWN_TYPES = ("BlockStored", "BlockRemoved", "AllBlocksCleared")


class KVEventBatch(msgspec.Struct, array_like=True, frozen=True):
    """``[ts, events, data_parallel_rank]``; each event is decoded on its own."""

    ts: float
    events: list[msgspec.Raw]
    data_parallel_rank: int | None = None


class _Tagged(msgspec.Struct):
    type: str = ""


_batch_decoder = msgspec.msgpack.Decoder(KVEventBatch)
_event_decoder = msgspec.msgpack.Decoder(KvEvent)
_tag_decoder = msgspec.msgpack.Decoder(_Tagged)


class FrameError(ValueError):
    """A message that is not a vLLM KV-event message; ``reason`` labels the counter."""

    def __init__(self, reason: str, message: str) -> None:
        super().__init__(message)
        self.reason = reason


@dataclass(frozen=True, slots=True)
class Message:
    """One decoded message: its sequence number, batch and known events."""

    seq: int
    ts: float
    dp_rank: int
    events: tuple[KvEvent, ...]
    skipped: tuple[tuple[str, str], ...] = ()  # (reason, detail) of events not decoded


def decode_message(frames: Sequence[bytes], topic: bytes) -> Message:
    """Decode ``[topic, seq, batch]``; FrameError names what is wrong. Events that fail
    alone are skipped and listed in ``skipped``."""
    if len(frames) != 3:
        raise FrameError("frames", f"{len(frames)} frames, expected 3 (topic, seq, batch)")
    if frames[0] != topic:
        raise FrameError("topic", f"topic {frames[0][:40]!r}, expected {topic!r}")
    if len(frames[1]) != 8:
        raise FrameError(
            "seq", f"sequence frame of {len(frames[1])} bytes, expected 8 (big-endian)"
        )
    seq = int.from_bytes(frames[1], "big")
    try:
        batch = _batch_decoder.decode(frames[2])
    except msgspec.DecodeError as exc:
        raise FrameError("batch", f"seq {seq}: not a KVEventBatch: {exc}") from None
    rank = batch.data_parallel_rank or 0
    if rank < 0:
        raise FrameError("batch", f"seq {seq}: data_parallel_rank {rank}, expected >= 0")
    events: list[KvEvent] = []
    skipped: list[tuple[str, str]] = []
    for i, raw in enumerate(batch.events):
        try:
            events.append(_event_decoder.decode(raw))
        except msgspec.DecodeError as exc:
            kind = ""
            with contextlib.suppress(msgspec.DecodeError):
                kind = _tag_decoder.decode(raw).type
            if kind and kind not in KNOWN_TYPES:
                skipped.append(("unknown-type", f"seq {seq} event {i}: type {kind!r}"))
            else:
                skipped.append(("event", f"seq {seq} event {i}: {exc}"))
    return Message(seq, batch.ts, rank, tuple(events), tuple(skipped))


# ---------------------------------------------------------------------------
# per-rank counts (no I/O)


@dataclass(slots=True)
class RankKv:
    """What the events say about one rank."""

    stored_total: int = 0  # blocks stored since the start (a counter)
    removed_total: int = 0
    copies: Counter[BlockHash] = field(default_factory=Counter)
    cached_blocks: int = 0  # stored, not removed (per copy)
    last_seq: int | None = None
    last_ts: float | None = None  # the engine's clock (batch ts) of the last message
    block_size: int | None = None

    def apply(self, event: KvEvent) -> int:
        """Apply one event; the number of blocks it stored."""
        if isinstance(event, BlockStored):
            n = len(event.block_hashes)
            self.copies.update(event.block_hashes)
            self.cached_blocks += n
            self.stored_total += n
            if event.block_size:
                self.block_size = event.block_size
            return n
        if isinstance(event, BlockRemoved):
            for h in event.block_hashes:
                if self.copies.get(h, 0) > 0:
                    self.copies[h] -= 1
                    if not self.copies[h]:
                        del self.copies[h]
                    self.cached_blocks -= 1
                self.removed_total += 1
            return 0
        self.clear()
        return 0

    def clear(self) -> None:
        self.copies.clear()
        self.cached_blocks = 0


@dataclass(slots=True)
class KvEventStats:
    """The subscriber's counters."""

    messages: int = 0
    events: Counter[str] = field(default_factory=Counter)  # by type
    lost: int = 0  # messages missing from the sequence
    gaps: int = 0
    restarts: int = 0
    malformed: Counter[str] = field(default_factory=Counter)  # by reason
    first_at: float | None = None  # monotonic time of the first message


class KvEventState:
    """Every rank's :class:`RankKv`, fed decoded messages; gap and restart bookkeeping."""

    def __init__(self) -> None:
        self.ranks: dict[int, RankKv] = {}
        self.stats = KvEventStats()
        self._gap_logged_at = -1e9

    def rank(self, dp_rank: int) -> RankKv:
        return self.ranks.setdefault(dp_rank, RankKv())

    def stored_total(self, dp_rank: int) -> int:
        r = self.ranks.get(dp_rank)
        return r.stored_total if r is not None else 0

    def malformed(self, reason: str, detail: str) -> None:
        first = reason not in self.stats.malformed
        self.stats.malformed[reason] += 1
        level = logging.WARNING if first else logging.DEBUG
        log.log(
            level,
            "malformed vLLM KV-event message (%s, %d so far): %s",
            reason,
            self.stats.malformed[reason],
            detail,
        )

    def feed(self, message: Message) -> int:
        """Apply one message; the blocks it stored."""
        stats = self.stats
        stats.messages += 1
        if stats.first_at is None:
            stats.first_at = time.monotonic()
        for reason, detail in message.skipped:
            self.malformed(reason, detail)
        rank = self.rank(message.dp_rank)
        last = rank.last_seq
        if last is None:
            if message.seq:
                log.info(
                    "vLLM KV events of rank %d: first message has seq %d (joined late)",
                    message.dp_rank,
                    message.seq,
                )
        elif message.seq <= last:
            stats.restarts += 1
            log.warning(
                "vLLM KV events of rank %d: seq went back from %d to %d: the engine "
                "restarted; its cached blocks are forgotten",
                message.dp_rank,
                last,
                message.seq,
            )
            rank.clear()
        elif message.seq > last + 1:
            lost = message.seq - last - 1
            stats.lost += lost
            stats.gaps += 1
            now = time.monotonic()
            if now - self._gap_logged_at >= 5.0:
                self._gap_logged_at = now
                log.warning(
                    "vLLM KV events of rank %d: %d message(s) lost (seq %d after %d; %d lost "
                    "in all): the blocks in use are re-anchored at the next scrape",
                    message.dp_rank,
                    lost,
                    message.seq,
                    last,
                    stats.lost,
                )
        rank.last_seq, rank.last_ts = message.seq, message.ts
        stored = 0
        for event in message.events:
            stats.events[type(event).__name__] += 1
            stored += rank.apply(event)
        return stored


# ---------------------------------------------------------------------------
# the socket


class KvEventSubscriber:
    """A SUB socket bound on ``endpoints`` (one per rank) feeding a :class:`KvEventState`;
    ``on_stored(dp_rank)`` runs after each message that stored blocks."""

    def __init__(
        self,
        endpoints: Sequence[str],
        topic: str,
        on_stored: Callable[[int], None] | None = None,
    ) -> None:
        self.endpoints = tuple(endpoints)
        self.topic = topic.encode()
        self.state = KvEventState()
        self._on_stored = on_stored
        self._ctx: zmq.asyncio.Context | None = None
        self._sock: zmq.asyncio.Socket | None = None
        self._task: asyncio.Task[None] | None = None

    def start(self) -> None:
        """Bind (OSError naming the endpoint if it cannot) and receive in the background."""
        self._ctx = zmq.asyncio.Context()
        sock = self._ctx.socket(zmq.SUB)
        sock.setsockopt(zmq.LINGER, 0)
        sock.setsockopt(zmq.RCVHWM, 100_000)
        sock.setsockopt(zmq.SUBSCRIBE, self.topic)
        self._sock = sock
        for endpoint in self.endpoints:
            try:
                sock.bind(endpoint)
            except zmq.ZMQError as exc:
                self.close()
                raise OSError(f"--kv-events-bind: cannot bind {endpoint}: {exc}") from None
        self._task = asyncio.get_running_loop().create_task(self._receive(), name="kv-events")

    def collector(self) -> Collector:
        """The counters as Prometheus series (``llmworker_kv_events_*``)."""
        return _StatsCollector(self.state)

    async def stop(self) -> None:
        if self._task is not None:
            self._task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._task
            self._task = None
        self.close()

    def close(self) -> None:
        if self._sock is not None:
            self._sock.close(0)
            self._sock = None
        if self._ctx is not None:
            self._ctx.term()
            self._ctx = None

    async def _receive(self) -> None:
        assert self._sock is not None
        while True:
            frames = await self._sock.recv_multipart()
            self.handle(frames)

    def handle(self, frames: Sequence[bytes]) -> None:
        """Decode and apply one message; never raises for what the message holds."""
        try:
            message = decode_message(frames, self.topic)
        except FrameError as exc:
            self.state.malformed(exc.reason, str(exc))
            return
        stored = self.state.feed(message)
        if stored and self._on_stored is not None:
            self._on_stored(message.dp_rank)


class _StatsCollector(Collector):
    def __init__(self, state: KvEventState) -> None:
        self.state = state

    def collect(self) -> list[CounterMetricFamily | GaugeMetricFamily]:
        st = self.state.stats
        messages = CounterMetricFamily(
            "llmworker_kv_events_messages", "vLLM KV-event messages received and decoded"
        )
        messages.add_metric([], st.messages)
        events = CounterMetricFamily(
            "llmworker_kv_events", "vLLM KV events applied, by type", labels=["type"]
        )
        for kind in KNOWN_TYPES:
            events.add_metric([kind], st.events.get(kind, 0))
        lost = CounterMetricFamily(
            "llmworker_kv_events_lost", "vLLM KV-event messages missing from the sequence"
        )
        lost.add_metric([], st.lost)
        restarts = CounterMetricFamily(
            "llmworker_kv_events_restarts", "times a vLLM KV-event sequence went back"
        )
        restarts.add_metric([], st.restarts)
        malformed = CounterMetricFamily(
            "llmworker_kv_events_malformed",
            "vLLM KV-event messages or events not decoded, by reason",
            labels=["reason"],
        )
        for reason, n in sorted(st.malformed.items()):
            malformed.add_metric([reason], n)
        cached = GaugeMetricFamily(
            "llmworker_kv_events_cached_blocks",
            "blocks stored and not removed per the events (the prefix cache, in use or not)",
            labels=["dp_rank"],
        )
        for rank, kv in sorted(self.state.ranks.items()):
            cached.add_metric([str(rank)], kv.cached_blocks)
        return [messages, events, lost, restarts, malformed, cached]
