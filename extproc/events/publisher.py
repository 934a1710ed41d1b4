"""Publish a worker's ``config``, ``load`` and ``bye`` events to the extproc (docs/events.md).

An engine integrator needs three calls::

    from extproc.events.schema import ConfigEvent
    from extproc.events.publisher import EventPublisher

    config = ConfigEvent(
        worker_id="worker-a",
        model="my-model",
        endpoint="10.0.0.5:8001",  # where Envoy reaches this worker's OpenAI server
        kv_total_blocks=4096,
        block_size=16,
        max_num_batched_tokens=2048,
    )
    async with EventPublisher("tcp://extproc:5557", config) as publisher:
        ...
        # whenever the engine's KV or prefill queue changes (cheap, never blocks); the
        # queue and slot counts are optional (3 waiting, 8 of at most 8 sequences running):
        publisher.update_load(
            0, active_decode_blocks=812, active_prefill_tokens=300,
            num_requests_waiting=3, request_active_slots=8, request_total_slots=8,
        )
        # a runtime config change is announced at once:
        publisher.update_config(kv_total_blocks=8192)
    # leaving the block sends ``bye``

The publisher connects (the extproc SUB socket binds), so it can start before
or after the extproc and survives its restarts: ZeroMQ reconnects on its own.
It sends ``config`` when the first subscriber joins (messages sent before that
would be lost), on every change and every ``heartbeat`` seconds;
``load`` is coalesced and sent at most every ``debounce`` seconds, and every
rank's load is repeated with each heartbeat. Whenever a subscriber (re)joins,
config and loads are re-sent at once, so a restarted extproc learns the state
without waiting for a heartbeat.

Sending never blocks the caller. The socket is an XPUB with ``XPUB_NODROP``, so
a subscriber that stops reading fills the high-water mark and the next
messages are dropped and counted in :attr:`EventPublisher.dropped` instead of
piling up in memory.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from types import TracebackType
from typing import Any

import aiozmq
import msgspec
import zmq

from extproc.events.curve import CurveClient
from extproc.events.schema import (
    TTFT_BOUNDS,
    TTFT_BUCKETS_MAX,
    TTFT_COUNT_MAX,
    ByeEvent,
    ConfigEvent,
    EventRejected,
    LoadEvent,
    decode,
    encode,
)

log = logging.getLogger(__name__)


class PublisherError(RuntimeError):
    """The publisher cannot start (bad endpoint) or was used after close()."""


@dataclass(frozen=True, slots=True)
class _RankLoad:
    active_decode_blocks: int | None
    active_prefill_tokens: int | None
    kv_total_blocks: int | None
    num_requests_waiting: int | None = None
    request_active_slots: int | None = None
    request_total_slots: int | None = None


class _SocketEvents(aiozmq.ZmqProtocol):
    """Receives XPUB subscription notices and tracks the transport's life."""

    def __init__(self, publisher: EventPublisher) -> None:
        self._publisher = publisher
        self.closed: asyncio.Future[None] = asyncio.get_running_loop().create_future()

    def msg_received(self, data: list[bytes]) -> None:
        # First byte 1 = subscribe, 0 = unsubscribe; the rest is the topic prefix.
        if data and data[0][:1] == b"\x01":
            self._publisher._subscriber_joined()

    def connection_lost(self, exc: BaseException | None) -> None:
        if not self.closed.done():
            self.closed.set_result(None)


def _validated(config: ConfigEvent) -> ConfigEvent:
    """The config if it passes the subscriber's own checks, else ValueError."""
    topic, payload = encode(config)
    try:
        decode(topic, payload)
    except EventRejected as exc:
        raise ValueError(f"invalid worker config: {exc.detail}") from None
    return config


class EventPublisher:
    """Publishes one worker's events over a ZeroMQ socket connected to ``endpoints``.

    ``endpoints``: one ZeroMQ endpoint (``tcp://host:port``) or several, each an
    extproc event socket. ``config``: the worker's registration; ``heartbeat``
    and ``debounce`` in seconds; ``sndhwm``: messages queued per subscriber
    before dropping; ``reconnect_ivl`` / ``reconnect_ivl_max``: ZeroMQ reconnect
    back-off in seconds (the maximum stays under the extproc's 1 s ``--startup-grace``,
    so a restarted extproc hears from every worker before it serves); ``linger``:
    seconds ``close()`` waits to deliver ``bye``;
    ``sockopts``: more ZeroMQ socket options, e.g. ``{zmq.TCP_KEEPALIVE: 1}``;
    ``curve``: this publisher's CURVE keys when the extproc requires them
    (:class:`~extproc.events.curve.CurveClient`, from key files).
    """

    def __init__(
        self,
        endpoints: str | Sequence[str],
        config: ConfigEvent,
        *,
        heartbeat: float = 2.0,
        debounce: float = 0.005,
        sndhwm: int = 10_000,
        reconnect_ivl: float = 0.1,
        reconnect_ivl_max: float = 0.5,
        linger: float = 1.0,
        sockopts: Mapping[int, int] | None = None,
        curve: CurveClient | None = None,
    ) -> None:
        self.endpoints: tuple[str, ...] = (
            (endpoints,) if isinstance(endpoints, str) else tuple(endpoints)
        )
        if not self.endpoints:
            raise ValueError("EventPublisher needs at least one endpoint")
        if heartbeat <= 0:
            raise ValueError(f"heartbeat must be > 0 seconds, got {heartbeat!r}")
        if debounce < 0:
            raise ValueError(f"debounce must be >= 0 seconds, got {debounce!r}")
        self._config = _validated(config)
        self.curve = curve
        self.heartbeat = heartbeat
        self.debounce = debounce
        self._linger = max(0.0, linger)
        self._sockopts: dict[int, int] = {
            zmq.SNDHWM: sndhwm,
            zmq.RECONNECT_IVL: max(1, int(reconnect_ivl * 1000)),
            zmq.RECONNECT_IVL_MAX: max(1, int(reconnect_ivl_max * 1000)),
            zmq.LINGER: max(0, int(linger * 1000)),
            zmq.XPUB_NODROP: 1,
            zmq.XPUB_VERBOSE: 1,
            **(sockopts or {}),
        }
        self._loads: dict[int, _RankLoad] = {}
        self._sent_loads: dict[int, _RankLoad] = {}
        # TTFT requests per bucket bound, by rank, not yet sent.
        self._ttft: dict[int, dict[float, int]] = {}
        self._dirty: set[int] = set()
        self._last_flush = float("-inf")
        self._flush_handle: asyncio.TimerHandle | None = None
        self._resend_handle: asyncio.Handle | None = None
        self._transport: Any = None
        self._protocol: _SocketEvents | None = None
        self._heartbeat_task: asyncio.Task[None] | None = None
        self._closed = False
        self._subscribed = False
        #: sequence number of the last ``load`` sent (0 = none yet)
        self.seq = 0
        #: messages handed to ZeroMQ
        self.sent = 0
        #: messages dropped because the socket was full
        self.dropped = 0

    @property
    def config(self) -> ConfigEvent:
        """The worker config last announced."""
        return self._config

    @property
    def worker_id(self) -> str:
        return self._config.worker_id

    async def start(self) -> None:
        """Open the socket, connect, send ``config`` and start the heartbeat."""
        if self._closed:
            raise PublisherError("EventPublisher was closed")
        if self._transport is not None:
            return
        loop = asyncio.get_running_loop()
        try:
            transport, protocol = await aiozmq.create_zmq_connection(
                lambda: _SocketEvents(self), zmq.XPUB, loop=loop
            )
        except OSError as exc:  # pragma: no cover - zmq context failure
            raise PublisherError(f"cannot open ZeroMQ socket: {exc}") from exc
        for option, value in self._sockopts.items():
            transport.setsockopt(option, value)
        if self.curve is not None:
            self.curve.apply(transport)
        for endpoint in self.endpoints:
            try:
                await transport.connect(endpoint)
            except (OSError, TypeError, ValueError) as exc:
                transport.close()
                raise PublisherError(f"cannot connect to {endpoint!r}: {exc}") from exc
        self._transport, self._protocol = transport, protocol
        self._send_all()
        self._heartbeat_task = loop.create_task(self._heartbeat_loop(), name="event-heartbeat")

    async def close(self) -> None:
        """Send ``bye`` and close the socket (waits up to ``linger`` to deliver)."""
        if self._closed:
            return
        self._closed = True
        for handle in (self._flush_handle, self._resend_handle):
            if handle is not None:
                handle.cancel()
        if self._heartbeat_task is not None:
            self._heartbeat_task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._heartbeat_task
        transport, protocol = self._transport, self._protocol
        if transport is None or protocol is None:
            return
        self._send(ByeEvent(worker_id=self._config.worker_id))
        transport.close()  # ZeroMQ keeps delivering for up to LINGER ms
        try:
            await asyncio.wait_for(asyncio.shield(protocol.closed), self._linger + 0.1)
        except TimeoutError:  # a stuck subscriber holds aiozmq's buffer: give up
            transport.abort()
        self._transport = None

    async def __aenter__(self) -> EventPublisher:
        await self.start()
        return self

    async def __aexit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        await self.close()

    def update_config(self, **changes: Any) -> None:
        """Change config fields (e.g. ``kv_total_blocks=8192``); sent at once if changed.

        Raises ValueError for an unknown field or a value the extproc would reject.
        """
        try:
            new = msgspec.structs.replace(self._config, **changes)
        except TypeError as exc:
            raise ValueError(f"unknown config field: {exc}") from None
        if new == self._config:
            return
        self._config = _validated(new)
        if self._transport is not None and not self._closed:
            self._send(self._config)

    def update_load(
        self,
        dp_rank: int,
        *,
        active_decode_blocks: int | None = None,
        active_prefill_tokens: int | None = None,
        kv_total_blocks: int | None = None,
        num_requests_waiting: int | None = None,
        request_active_slots: int | None = None,
        request_total_slots: int | None = None,
    ) -> None:
        """Record rank ``dp_rank``'s current load; a change is sent after the debounce.

        ``None`` means "not reported". Never blocks and never raises for load values;
        call it as often as the engine likes. The last three are the engine's queue and
        sequence slots on the rank: requests waiting at the engine, sequences running, and
        the most sequences it runs at once (0 = unknown).
        """
        load = _RankLoad(
            active_decode_blocks,
            active_prefill_tokens,
            kv_total_blocks,
            num_requests_waiting,
            request_active_slots,
            request_total_slots,
        )
        if self._loads.get(dp_rank) == load:
            return
        self._loads[dp_rank] = load
        self._dirty.add(dp_rank)
        if self._flush_handle is None and self._transport is not None and not self._closed:
            loop = asyncio.get_running_loop()
            delay = max(0.0, self._last_flush + self.debounce - loop.time())
            self._flush_handle = loop.call_later(delay, self._flush)

    def report_ttft(self, dp_rank: int, seconds: float) -> None:
        """One request's time to first token on rank ``dp_rank``, as the engine saw it:
        counted in its bucket of ``TTFT_BOUNDS`` (above the last: the last) and sent with
        the rank's next load message, once."""
        bound = next((b for b in TTFT_BOUNDS if seconds <= b), TTFT_BOUNDS[-1])
        self.report_ttft_counts(dp_rank, [(bound, 1)])

    def report_ttft_counts(self, dp_rank: int, counts: Sequence[tuple[float, int]]) -> None:
        """Requests per TTFT bucket (upper bound in seconds) since the last call: an
        engine's histogram delta. Sent with the rank's next load message, once."""
        pending = self._ttft.setdefault(dp_rank, {})
        for bound, n in counts:
            if n > 0:
                pending[bound] = min(pending.get(bound, 0) + n, TTFT_COUNT_MAX)
        if pending and dp_rank in self._loads:
            self._dirty.add(dp_rank)
            if self._flush_handle is None and self._transport is not None and not self._closed:
                loop = asyncio.get_running_loop()
                delay = max(0.0, self._last_flush + self.debounce - loop.time())
                self._flush_handle = loop.call_later(delay, self._flush)

    def _flush(self) -> None:
        self._flush_handle = None
        self._last_flush = asyncio.get_running_loop().time()
        dirty, self._dirty = self._dirty, set()
        for rank in sorted(dirty):
            load = self._loads[rank]
            if self._sent_loads.get(rank) != load or self._ttft.get(rank):
                self._send_load(rank, load)

    def _send_all(self) -> None:
        """Config, then the load of every rank (heartbeat and subscriber join)."""
        self._send(self._config)
        self._dirty.clear()
        for rank in sorted(self._loads):
            self._send_load(rank, self._loads[rank])

    def _subscriber_joined(self) -> None:
        # Until the first subscriber joins, ZeroMQ would discard every message.
        self._subscribed = True
        # One subscriber may subscribe to several topics at once: resend once.
        if self._resend_handle is None and not self._closed:
            self._resend_handle = asyncio.get_running_loop().call_soon(self._resend)

    def _resend(self) -> None:
        self._resend_handle = None
        if self._transport is not None and not self._closed:
            self._send_all()

    async def _heartbeat_loop(self) -> None:
        while True:
            await asyncio.sleep(self.heartbeat)
            self._send_all()

    def _send_load(self, rank: int, load: _RankLoad) -> None:
        if not self._subscribed:
            return  # nobody listens yet; the join re-sends everything
        self.seq += 1
        self._sent_loads[rank] = load
        ttft = self._ttft.pop(rank, None)
        self._send(
            LoadEvent(
                worker_id=self._config.worker_id,
                dp_rank=rank,
                active_decode_blocks=load.active_decode_blocks,
                active_prefill_tokens=load.active_prefill_tokens,
                kv_total_blocks=load.kv_total_blocks,
                seq=self.seq,
                num_requests_waiting=load.num_requests_waiting,
                request_active_slots=load.request_active_slots,
                request_total_slots=load.request_total_slots,
                ttft_seconds=sorted(ttft.items())[:TTFT_BUCKETS_MAX] if ttft else None,
            )
        )

    def _send(self, event: ConfigEvent | LoadEvent | ByeEvent) -> None:
        transport = self._transport
        if transport is None or not self._subscribed:
            return
        # aiozmq sends with DONTWAIT and buffers only what ZeroMQ refused (EAGAIN at
        # the high-water mark). Anything already buffered means "full": drop.
        if transport.get_write_buffer_size():
            self.dropped += 1
            return
        try:
            transport.write(encode(event))
        except Exception:  # never let publishing break the engine
            self.dropped += 1
            log.exception("dropping %s event", type(event).__name__)
            return
        self.sent += 1
