"""Worker-side admission: cap requests at the worker's own ingress (docs/worker.md).

``--engine-request-limit N`` / ``DYN_ENGINE_REQUEST_LIMIT`` lets at most N
requests into the engine at once; up to Q more wait in a FIFO queue
(``DYN_DYNAMO_REQUEST_QUEUE_LIMIT``, default 16, at least 2, only read when N
is set). With both full, a request is rejected at once with the overload
status, ``x-worker-overloaded: 1`` and a flat JSON body. Off when N is unset.

Usage in any asyncio HTTP handler::

    config, warning = AdmissionConfig.from_env(flag_value)
    admission = Admission(config)
    try:
        async with admission.slot():
            ...  # run the request; the slot is released however this block ends
    except Overloaded:
        return reject(admission.rejection())

A waiting request whose task is cancelled (client gone) leaves the queue.
"""

from __future__ import annotations

import asyncio
from collections import deque
from collections.abc import AsyncIterator, Iterator, Mapping
from contextlib import asynccontextmanager
from dataclasses import dataclass
from typing import Annotated, Any, ClassVar

from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric
from prometheus_client.registry import Collector
from pydantic import (
    BeforeValidator,
    ValidationInfo,
    ValidatorFunctionWrapHandler,
    field_validator,
)
from pydantic_settings import NoDecode

from extproc.openai.errors import (
    DEFAULT_OVERLOAD_STATUS,
    OVERLOAD_STATUS_ENV,
    error_body,
    overload_status_from_env,
)
from llmworker.settings import OptWhole, SettingsError, Whole, WorkerSettings, option

ENGINE_LIMIT_ENV = "DYN_ENGINE_REQUEST_LIMIT"
QUEUE_LIMIT_ENV = "DYN_DYNAMO_REQUEST_QUEUE_LIMIT"
ENGINE_LIMIT_FLAG = "--engine-request-limit"
DEFAULT_QUEUE_LIMIT = 16
MIN_QUEUE_LIMIT = 2
OVERLOADED_HEADER = "x-worker-overloaded"
OVERLOADED_MESSAGE = "Server overloaded: worker at capacity"
ADMISSION_GROUP = "worker-side admission"
ADMISSION_ENVS = (ENGINE_LIMIT_ENV, QUEUE_LIMIT_ENV, OVERLOAD_STATUS_ENV)


class AdmissionConfigError(SettingsError):
    """A bad N or Q; the message names the flag or variable and the value."""


class Overloaded(Exception):
    """Engine and queue are both full: reject the request now."""


def _overload(v: Any) -> tuple[int, str | None]:
    if isinstance(v, tuple):
        return v
    return overload_status_from_env({OVERLOAD_STATUS_ENV: str(v)})


class AdmissionSettings(WorkerSettings):
    """The worker's admission settings: ``--engine-request-limit`` over the environment;
    the queue size and the overload status come from the environment only. Q is read only
    when N is set."""

    GROUPS: ClassVar[dict[str, tuple[str, str | None]]] = {"admission": (ADMISSION_GROUP, None)}

    engine_request_limit: OptWhole = option(
        None,
        ENGINE_LIMIT_FLAG,
        "admission",
        "requests inside the engine at once; unset = admission off",
        env=ENGINE_LIMIT_ENV,
        metavar="N",
        expected="an integer >= 1",
        ge=1,
    )
    queue_limit: Annotated[Whole, NoDecode] = option(
        DEFAULT_QUEUE_LIMIT,
        None,
        "admission",
        f"requests waiting for an engine slot (default {DEFAULT_QUEUE_LIMIT}, "
        f">= {MIN_QUEUE_LIMIT}, read only when N is set)",
        env=QUEUE_LIMIT_ENV,
        expected=f"an integer >= {MIN_QUEUE_LIMIT}",
        ge=MIN_QUEUE_LIMIT,
    )
    overload: Annotated[tuple[int, str | None], NoDecode, BeforeValidator(_overload)] = option(
        (DEFAULT_OVERLOAD_STATUS, None),
        None,
        "admission",
        f"HTTP status of rejections (default {DEFAULT_OVERLOAD_STATUS})",
        env=OVERLOAD_STATUS_ENV,
        expected="an integer in 200-999",
    )

    @field_validator("queue_limit", mode="wrap")
    @classmethod
    def _only_with_limit(
        cls, v: Any, handler: ValidatorFunctionWrapHandler, info: ValidationInfo
    ) -> int:
        if info.data.get("engine_request_limit") is None:
            return DEFAULT_QUEUE_LIMIT  # off (or N invalid): Q is not read
        return int(handler(v))

    def admission_config(self) -> tuple[AdmissionConfig, str | None]:
        """(config, warning about the overload status or None)."""
        status, warning = self.overload
        return AdmissionConfig(self.engine_request_limit, self.queue_limit, status), warning

    @classmethod
    def load(
        cls, engine_request_limit: str | int | None = None, environ: Mapping[str, str] | None = None
    ) -> AdmissionSettings:
        """Validate the flag value (wins) over the environment; AdmissionConfigError if bad."""
        flags = (
            {} if engine_request_limit is None else {"engine_request_limit": engine_request_limit}
        )
        try:
            return cls.read(flags, environ)
        except SettingsError as exc:
            raise AdmissionConfigError(str(exc)) from None


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
        return AdmissionSettings.load(engine_request_limit, environ).admission_config()


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
