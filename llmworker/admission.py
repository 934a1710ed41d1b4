"""Worker-side admission: cap requests at the worker's own ingress (docs/worker.md).

``--engine-request-limit N`` / ``DYN_ENGINE_REQUEST_LIMIT`` lets at most N
requests into the engine at once; up to Q more wait in a FIFO queue
(``DYN_DYNAMO_REQUEST_QUEUE_LIMIT``, default 16, at least 2, only read when N
is set). With both full, a request is rejected at once with the overload
status, ``x-worker-overloaded: 1`` and a flat JSON body. Off when N is unset.

Usage in any asyncio HTTP handler::

    admission = Admission(AdmissionConfig.from_env(flag_value))
    try:
        async with admission.slot():
            ...  # run the request; the slot is released however this block ends
    except Overloaded:
        return reject(admission.rejection())

A waiting request whose task is cancelled (client gone) leaves the queue.
"""

from __future__ import annotations

import asyncio
import os
from collections import deque
from collections.abc import AsyncIterator, Iterator, Mapping
from contextlib import asynccontextmanager
from dataclasses import dataclass

from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric
from prometheus_client.registry import Collector

from extproc.openai.errors import error_body, overload_status_from_env

ENGINE_LIMIT_ENV = "DYN_ENGINE_REQUEST_LIMIT"
QUEUE_LIMIT_ENV = "DYN_DYNAMO_REQUEST_QUEUE_LIMIT"
ENGINE_LIMIT_FLAG = "--engine-request-limit"
DEFAULT_QUEUE_LIMIT = 16
MIN_QUEUE_LIMIT = 2
OVERLOADED_HEADER = "x-worker-overloaded"
OVERLOADED_MESSAGE = "Server overloaded: worker at capacity"


class AdmissionConfigError(ValueError):
    """A bad N or Q; the message names the flag or variable and the value."""


class Overloaded(Exception):
    """Engine and queue are both full: reject the request now."""


def _parse_int(raw: str, name: str, minimum: int) -> int:
    text = raw.strip()
    if text.isascii() and text.lstrip("+").isdigit():
        value = int(text)
        if value >= minimum:
            return value
    raise AdmissionConfigError(f"{name}={raw!r} is invalid: expected an integer >= {minimum}")


@dataclass(frozen=True, slots=True)
class AdmissionConfig:
    """Validated limits; ``engine_request_limit`` None means admission is off."""

    engine_request_limit: int | None = None
    queue_limit: int = DEFAULT_QUEUE_LIMIT
    overload_status: int = 529

    @property
    def enabled(self) -> bool:
        return self.engine_request_limit is not None

    @classmethod
    def from_env(
        cls,
        engine_request_limit: str | int | None = None,
        environ: Mapping[str, str] | None = None,
    ) -> tuple[AdmissionConfig, str | None]:
        """(config, warning or None) from the flag value (wins) and the environment.

        Raises AdmissionConfigError for N <= 0, Q < 2 or a non-integer.
        """
        env = os.environ if environ is None else environ
        status, warning = overload_status_from_env(env)
        if engine_request_limit is not None and not isinstance(engine_request_limit, str):
            engine_request_limit = str(engine_request_limit)
        if engine_request_limit is not None:
            limit = _parse_int(engine_request_limit, ENGINE_LIMIT_FLAG, 1)
        else:
            raw = env.get(ENGINE_LIMIT_ENV)
            if raw is None or not raw.strip():
                return cls(overload_status=status), warning
            limit = _parse_int(raw, ENGINE_LIMIT_ENV, 1)
        raw_queue = env.get(QUEUE_LIMIT_ENV)
        if raw_queue is None or not raw_queue.strip():
            queue = DEFAULT_QUEUE_LIMIT
        else:
            queue = _parse_int(raw_queue, QUEUE_LIMIT_ENV, MIN_QUEUE_LIMIT)
        return cls(engine_request_limit=limit, queue_limit=queue, overload_status=status), warning


@dataclass(frozen=True, slots=True)
class Rejection:
    """The reply to a rejected request: status, headers and body."""

    status: int
    headers: dict[str, str]
    body: bytes


class Admission:
    """N engine slots and a FIFO queue of Q; with N unset, every request enters."""

    def __init__(self, config: AdmissionConfig) -> None:
        self.config = config
        self.in_engine = 0
        self.rejected_total = 0
        self._queue: deque[asyncio.Future[None]] = deque()
        self._rejection = Rejection(
            status=config.overload_status,
            headers={OVERLOADED_HEADER: "1", "content-type": "application/json"},
            body=error_body(OVERLOADED_MESSAGE, config.overload_status),
        )

    @property
    def queued(self) -> int:
        return len(self._queue)

    def rejection(self) -> Rejection:
        return self._rejection

    @asynccontextmanager
    async def slot(self) -> AsyncIterator[None]:
        """Hold an engine slot for the block; raise Overloaded at once if full."""
        limit = self.config.engine_request_limit
        if limit is None:
            self.in_engine += 1
            try:
                yield
            finally:
                self.in_engine -= 1
            return
        await self._acquire(limit)
        try:
            yield
        finally:
            self._release()

    async def _acquire(self, limit: int) -> None:
        # Live waiters exist only while every slot is taken, so this keeps FIFO order.
        if self.in_engine < limit:
            self.in_engine += 1
            return
        if len(self._queue) >= self.config.queue_limit:
            self.rejected_total += 1
            raise Overloaded(OVERLOADED_MESSAGE)
        waiter: asyncio.Future[None] = asyncio.get_running_loop().create_future()
        self._queue.append(waiter)
        try:
            await waiter  # _release() hands its slot over by resolving this
        except asyncio.CancelledError:
            if waiter.done() and not waiter.cancelled():
                self._release()  # the slot arrived as we were cancelled: pass it on
            elif waiter in self._queue:
                self._queue.remove(waiter)
            raise

    def _release(self) -> None:
        while self._queue:
            waiter = self._queue.popleft()
            if not waiter.done():
                waiter.set_result(None)  # the slot moves to the waiter; in_engine unchanged
                return
        self.in_engine -= 1

    def collector(self) -> Collector:
        """Prometheus collector of the three ``dynamo_*`` admission series."""
        return _AdmissionCollector(self)


class _AdmissionCollector(Collector):
    def __init__(self, admission: Admission) -> None:
        self._admission = admission

    def collect(self) -> Iterator[Metric]:
        a = self._admission
        rejected = CounterMetricFamily(
            "dynamo_rejection_request",
            "Requests rejected by worker-side admission (engine and queue full)",
        )
        rejected.add_metric([], a.rejected_total)
        yield rejected
        yield GaugeMetricFamily(
            "dynamo_engine_request", "Requests inside the engine", value=a.in_engine
        )
        yield GaugeMetricFamily(
            "dynamo_request_queue", "Requests waiting for an engine slot", value=a.queued
        )
