"""The ZeroMQ SUB socket: receive worker events, validate, apply to the pool.

Binds (default ``tcp://127.0.0.1:5557``) and/or connects. Messages from one
publisher are applied in the order received. A malformed message is dropped
and counted by reason; nothing a publisher sends can stop the subscriber.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Callable
from typing import Any

import aiozmq
import zmq

from extproc.core.busy import BusyThresholds
from extproc.core.classes import ClassConfigError, ClassRegistry
from extproc.core.peers import PeerEstimates
from extproc.core.pool import EndpointNotAllowed, RankOutOfRange, WorkerPool
from extproc.core.worker import Worker
from extproc.events.curve import CurveServer
from extproc.events.schema import (
    DROP_FRAMES,
    DROP_NOT_ALLOWED,
    DROP_SCHEMA,
    ByeEvent,
    ClassEvent,
    ConfigEvent,
    EstimateEvent,
    Event,
    EventRejected,
    LoadEvent,
    ReplicaByeEvent,
    ThresholdsEvent,
    decode,
)
from extproc.metrics.registry import Metrics

log = logging.getLogger("extproc.events")


class EventBindError(RuntimeError):
    """The SUB socket could not bind or connect; the message names the endpoint."""


# Messages taken per turn of the event loop. aiozmq hands over one message per turn (and
# asks the socket for its state twice per message); the rest of what is already queued is
# read here directly. Bounded, so a flood of events holds up a request's ext_proc message
# by one batch at most: at ~10 µs an event, 16 take about 0.15 ms (64 doubled the latency
# a 50,000 events/s stream added at concurrency 1; 8 cost a fifth of the ingest rate).
DRAIN_BATCH = 16


# Told of a configured worker's engine-reported TTFT buckets (the latency controller).
EngineTtftSink = Callable[[Worker, list[tuple[float, int]]], None]
# Told of a worker whose ``config`` was applied (the resolver of announced host names).
AnnouncedSink = Callable[[Worker], None]


def apply_event(
    pool: WorkerPool,
    event: Event,
    peers: PeerEstimates | None = None,
    classes: ClassRegistry | None = None,
    engine_ttft: EngineTtftSink | None = None,
    announced: AnnouncedSink | None = None,
) -> None:
    """Hand one validated event to the pool; a refusal becomes :class:`EventRejected`.

    Messages of other extproc replicas apply only when sharing is on (``peers``). The
    engine's own TTFT buckets of a load event go to ``engine_ttft``, not to the pool; a worker
    whose ``config`` was applied, to ``announced``."""
    try:
        if type(event) is LoadEvent:
            worker = pool.report_load(
                event.worker_id,
                dp_rank=event.dp_rank or 0,
                active_decode_blocks=event.active_decode_blocks,
                active_prefill_tokens=event.active_prefill_tokens,
                kv_total_blocks=event.kv_total_blocks,
                seq=event.seq,
                num_requests_waiting=event.num_requests_waiting,
                request_active_slots=event.request_active_slots,
                request_total_slots=event.request_total_slots,
            )
            if event.ttft_seconds and engine_ttft is not None and worker.configured:
                engine_ttft(worker, event.ttft_seconds)
        elif type(event) is ConfigEvent:
            displaced = pool.announce(
                event.worker_id,
                model=event.model,
                endpoint=event.endpoint,
                kv_total_blocks=event.kv_total_blocks,
                block_size=event.block_size,
                max_num_batched_tokens=event.max_num_batched_tokens,
                dp_size=event.dp_size,
                worker_type=event.worker_type,
            )
            if announced is not None:
                announced(pool.workers[event.worker_id])
            for other in displaced:
                log.info(
                    "worker %s announced endpoint %s; worker %s, which held it, is removed",
                    event.worker_id,
                    event.endpoint,
                    other,
                )
        elif type(event) is ByeEvent:
            pool.leave(event.worker_id)
        elif peers is None or getattr(event, "replica_id", None) == pool.replica.replica_id:
            return  # sharing is off, or our own message echoed back by a forwarder
        elif type(event) is EstimateEvent:
            peers.snapshot(event.replica_id, event.ranks)
        elif type(event) is ThresholdsEvent:
            thresholds = BusyThresholds(
                event.active_decode_blocks_threshold,
                event.active_prefill_tokens_threshold,
                event.active_prefill_tokens_threshold_frac,
                event.ttft_p99_target_ms,
                event.itl_p99_target_ms,
            )
            pool.set_thresholds(event.model, thresholds, (event.version, event.writer))
        elif type(event) is ClassEvent:
            if classes is not None:
                classes.update_class(event.name, event.settings, (event.version, event.writer))
        else:
            assert type(event) is ReplicaByeEvent
            peers.leave(event.replica_id)
    except EndpointNotAllowed as exc:
        raise EventRejected(DROP_NOT_ALLOWED, str(exc)) from None
    except RankOutOfRange as exc:
        raise EventRejected(DROP_SCHEMA, str(exc)) from None
    except ClassConfigError as exc:
        raise EventRejected(DROP_SCHEMA, str(exc)) from None
    except KeyError:  # a class this replica does not have: its classes file differs
        raise EventRejected(DROP_SCHEMA, "class not configured here") from None


class _SubProtocol(aiozmq.ZmqProtocol):
    def __init__(self, sink: EventSubscriber) -> None:
        self.sink = sink
        self.sock: zmq.Socket[bytes] | None = None

    def connection_made(self, transport: aiozmq.ZmqTransport) -> None:
        self.sock = transport.get_extra_info("zmq_socket")

    def msg_received(self, data: list[bytes]) -> None:
        started = time.perf_counter()
        sink = self.sink
        sink.on_message(data)
        sock = self.sock
        if sock is not None:
            recv, noblock = sock.recv, zmq.NOBLOCK
            for _ in range(DRAIN_BATCH - 1):
                try:
                    part = recv(noblock, copy=False)
                except zmq.ZMQError:  # EAGAIN: nothing more queued (errors: aiozmq reports)
                    break
                frames = [part.bytes]
                while part.more:
                    part = recv(noblock, copy=False)
                    frames.append(part.bytes)
                sink.on_message(frames)
        sink.flush_counts()
        sink.metrics.event_seconds.inc(time.perf_counter() - started)

    def connection_lost(self, exc: Exception | None) -> None:
        self.sink.closed.set()


class EventSubscriber:
    """Owns the SUB socket and turns frames into pool updates."""

    def __init__(
        self,
        pool: WorkerPool,
        metrics: Metrics,
        rcvhwm: int = 200_000,
        curve: CurveServer | None = None,
        peers: PeerEstimates | None = None,
        classes: ClassRegistry | None = None,
    ) -> None:
        self.pool = pool
        self.peers = peers
        self.classes = classes
        self.metrics = metrics
        self.rcvhwm = rcvhwm
        self.curve = curve
        self.closed = asyncio.Event()
        self._transport: Any = None
        self._lost_reported = 0
        self._counts: dict[bytes, int] = {}  # well-formed events by topic, not yet flushed
        self.endpoints: list[str] = []
        # Where the engine-reported TTFT buckets of load events go (set by the wiring).
        self.on_engine_ttft: EngineTtftSink | None = None
        # Told of every worker whose ``config`` was applied (set by the wiring).
        self.on_announced: AnnouncedSink | None = None

    async def start(self, bind: list[str], connect: list[str]) -> None:
        self._transport, _ = await aiozmq.create_zmq_connection(lambda: _SubProtocol(self), zmq.SUB)
        tr = self._transport
        if self.curve is not None:
            self.curve.start(tr.get_extra_info("zmq_socket"))
        tr.setsockopt(zmq.RCVHWM, self.rcvhwm)
        tr.setsockopt(zmq.LINGER, 0)
        tr.subscribe(b"")
        for endpoint in bind:
            try:
                self.endpoints.append(await tr.bind(endpoint))
            except Exception as exc:
                tr.close()
                raise EventBindError(f"cannot bind event socket to {endpoint}: {exc}") from None
        for endpoint in connect:
            try:
                await tr.connect(endpoint)
            except Exception as exc:
                tr.close()
                raise EventBindError(f"cannot connect event socket to {endpoint}: {exc}") from None

    def on_message(self, frames: list[bytes]) -> None:
        """Apply one message; its count reaches the metrics at ``flush_counts()``."""
        try:
            if len(frames) != 2:
                raise EventRejected(DROP_FRAMES, f"{len(frames)} frames, expected 2")
            topic = frames[0]
            event = decode(topic, frames[1])
            apply_event(
                self.pool, event, self.peers, self.classes, self.on_engine_ttft, self.on_announced
            )
        except EventRejected as exc:
            self.metrics.dropped[exc.reason].inc()
            if log.isEnabledFor(logging.DEBUG):
                log.debug("dropped event: %s", exc)
            return
        except Exception:  # never let one message stop the subscriber
            log.exception("unexpected error applying an event; dropped")
            self.metrics.dropped[DROP_SCHEMA].inc()
            return
        counts = self._counts
        counts[topic] = counts.get(topic, 0) + 1

    def flush_counts(self) -> None:
        """Add the events counted since the last flush to the metrics (once per batch)."""
        m = self.metrics
        for topic, n in self._counts.items():
            m.topic[topic.decode()].inc(n)
        self._counts.clear()
        lost = self.pool.events_lost
        if lost != self._lost_reported:
            m.events_lost.inc(lost - self._lost_reported)
            self._lost_reported = lost

    def close(self) -> None:
        if self.curve is not None:
            self.curve.stop()
        if self._transport is not None:
            self._transport.close()
            self._transport = None
