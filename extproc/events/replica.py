"""Tell the other extproc replicas what this one has in flight and which thresholds changed.

One ZeroMQ PUB socket connects to the other replicas' event sockets (or to a forwarder,
:mod:`extproc.events.forwarder`, that all of them connect to). It sends this replica's
whole router estimate (``estimate``) when it changes — at most one message per
``min_gap`` seconds, so a burst costs a few messages, not one per request — and every
``interval`` seconds regardless, with every change made here of a model's thresholds and
latency targets (``thresholds``), so that a replica that joins later learns the current
values. ``close`` says ``replica_bye``. See docs/replicas.md.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections.abc import Callable, Sequence
from typing import Any

import aiozmq
import zmq

from extproc.background import REPLICA_PUBLISHER, Guard
from extproc.core.classes import ClassRegistry
from extproc.core.peers import own_estimates
from extproc.core.pool import WorkerPool
from extproc.events.curve import CurveClient
from extproc.events.schema import (
    ClassEvent,
    EstimateEvent,
    ReplicaByeEvent,
    ThresholdsEvent,
    encode,
)

log = logging.getLogger("extproc.events.replica")


class ReplicaPublisher:
    """The sending half of replica sharing; the receiving half is the event subscriber."""

    def __init__(
        self,
        pool: WorkerPool,
        endpoints: Sequence[str],
        *,
        interval: float = 1.0,
        min_gap: float = 0.0005,
        curve: CurveClient | None = None,
        on_sent: Callable[[str], None] | None = None,
        classes: ClassRegistry | None = None,
        guard: Guard | None = None,
    ) -> None:
        if not pool.replica.replica_id:
            raise ValueError("replica sharing needs the pool's replica_id")
        self.pool = pool
        self.endpoints = tuple(endpoints)
        self.interval = interval
        self.min_gap = min_gap
        self.curve = curve
        self.on_sent = on_sent
        self.classes = classes
        self.sent = 0
        # A send that raises is counted and the publisher goes on: the heartbeat beats on,
        # and the next change of the estimate is sent.
        self.guard = guard or Guard(REPLICA_PUBLISHER)
        self._transport: Any = None
        self._pending: asyncio.TimerHandle | None = None
        self._last_sent = float("-inf")
        self._heartbeat: asyncio.Task[None] | None = None
        self._loop: asyncio.AbstractEventLoop | None = None

    async def start(self) -> None:
        loop = self._loop = asyncio.get_running_loop()
        self._transport, _ = await aiozmq.create_zmq_connection(aiozmq.ZmqProtocol, zmq.PUB)
        tr = self._transport
        tr.setsockopt(zmq.SNDHWM, 10_000)
        tr.setsockopt(zmq.LINGER, 200)
        tr.setsockopt(zmq.RECONNECT_IVL, 100)
        tr.setsockopt(zmq.RECONNECT_IVL_MAX, 500)
        if self.curve is not None:
            self.curve.apply(tr)
        for endpoint in self.endpoints:
            await tr.connect(endpoint)
        self.pool.replica.on_estimates = self._estimates_changed
        self.pool.threshold_versions.listeners.append(self._send_thresholds)
        if self.classes is not None:
            self.classes.versions.listeners.append(self._send_class)
        self._heartbeat = loop.create_task(self._beat(), name="replica-heartbeat")

    def _estimates_changed(self) -> None:
        """Called on every change of our estimate: send soon, coalescing a burst."""
        if self._pending is not None or self._loop is None:
            return
        delay = self._last_sent + self.min_gap - self._loop.time()
        self._pending = self._loop.call_later(max(0.0, delay), self.guard.call, self._send_estimate)

    def _send_estimate(self) -> None:
        self._pending = None
        if self._loop is not None:
            self._last_sent = self._loop.time()
        replica_id = self.pool.replica.replica_id
        self._send(EstimateEvent(replica_id=replica_id, ranks=own_estimates(self.pool)))

    def _send_thresholds(self, model: str) -> None:
        version, writer = self.pool.threshold_versions.stamps[model]
        th = self.pool.thresholds_for(model)
        self._send(
            ThresholdsEvent(
                replica_id=self.pool.replica.replica_id,
                model=model,
                version=version,
                writer=writer,
                active_decode_blocks_threshold=th.active_decode_blocks,
                active_prefill_tokens_threshold=th.active_prefill_tokens,
                active_prefill_tokens_threshold_frac=th.active_prefill_tokens_frac,
                ttft_p99_target_ms=th.ttft_p99_target_ms,
                itl_p99_target_ms=th.itl_p99_target_ms,
            )
        )

    def _send_class(self, name: str) -> None:
        assert self.classes is not None
        version, writer = self.classes.versions.stamps[name]
        settings = {
            k: v for k, v in self.classes.table.by_name(name).as_dict().items() if k != "name"
        }
        self._send(
            ClassEvent(
                replica_id=self.pool.replica.replica_id,
                name=name,
                version=version,
                writer=writer,
                settings=settings,
            )
        )

    async def _beat(self) -> None:
        while True:
            self.guard.call(self._send_all)
            await asyncio.sleep(self.interval)

    def _send_all(self) -> None:
        """One heartbeat: the estimate, and every change made here of thresholds and classes."""
        self._send_estimate()
        for model in list(self.pool.threshold_versions.stamps):
            self._send_thresholds(model)
        if self.classes is not None:
            for name in list(self.classes.versions.stamps):
                self._send_class(name)

    def _send(self, event: EstimateEvent | ThresholdsEvent | ClassEvent | ReplicaByeEvent) -> None:
        if self._transport is None:
            return
        try:
            frames = encode(event)
            self._transport.write(frames)
            self.sent += 1
            if self.on_sent is not None:
                self.on_sent(frames[0].decode())
        except zmq.ZMQError as exc:  # pragma: no cover - PUB drops rather than fails
            log.warning("cannot send a replica message: %s", exc)

    async def close(self) -> None:
        """Say ``replica_bye`` and close the socket."""
        if self._heartbeat is not None:
            self._heartbeat.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._heartbeat
            self._heartbeat = None
        if self._pending is not None:
            self._pending.cancel()
            self._pending = None
        if self.pool.replica.on_estimates == self._estimates_changed:
            self.pool.replica.on_estimates = None
        if self._transport is not None:
            self._send(ReplicaByeEvent(replica_id=self.pool.replica.replica_id))
            self._transport.close()  # LINGER (200 ms) lets ZeroMQ deliver the bye
            self._transport = None
