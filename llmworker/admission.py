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
from contextvars import ContextVar
from dataclasses import dataclass
from typing import Annotated, Any

from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric
from prometheus_client.registry import Collector
from pydantic import (
    BeforeValidator,
    Field,
    ValidationError,
    ValidationInfo,
    ValidatorFunctionWrapHandler,
    field_validator,
)
from pydantic_core import PydanticCustomError
from pydantic_settings import (
    BaseSettings,
    EnvSettingsSource,
    NoDecode,
    PydanticBaseSettingsSource,
    SettingsConfigDict,
)

from extproc.openai.errors import (
    DEFAULT_OVERLOAD_STATUS,
    OVERLOAD_STATUS_ENV,
    error_body,
    overload_status_from_env,
)

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


def _count(minimum: int) -> BeforeValidator:
    """Digits only (an optional '+'; spaces ignored), at least ``minimum``."""

    def check(v: Any) -> int | None:
        if v is None:
            return None  # the default of an optional count
        text = str(v).strip()
        if text.isascii() and text.lstrip("+").isdigit() and int(text) >= minimum:
            return int(text)
        raise PydanticCustomError("count", "expected an integer >= {minimum}", {"minimum": minimum})

    return BeforeValidator(check)


def _overload(v: Any) -> tuple[int, str | None]:
    if isinstance(v, tuple):
        return v
    return overload_status_from_env({OVERLOAD_STATUS_ENV: str(v)})


class _Environment(EnvSettingsSource):
    """pydantic-settings' environment source over a given mapping; blank values are unset."""

    def __init__(self, settings_cls: type[BaseSettings], environ: Mapping[str, str]) -> None:
        self._environ = environ
        super().__init__(settings_cls)

    def _load_env_vars(self) -> Mapping[str, str | None]:
        return {k: v for k, v in self._environ.items() if v.strip()}


_ENVIRON: ContextVar[Mapping[str, str] | None] = ContextVar("llmworker_environ", default=None)


class AdmissionSettings(BaseSettings):
    """The worker's admission settings: ``--engine-request-limit`` over the environment.

    Each field reads its variable through pydantic-settings; the flag, when given,
    is passed in and wins. Q is read only when N is set.
    """

    model_config = SettingsConfigDict(
        frozen=True, extra="ignore", populate_by_name=True, case_sensitive=True
    )

    engine_request_limit: Annotated[int | None, _count(1)] = Field(
        None, validation_alias=ENGINE_LIMIT_ENV
    )
    queue_limit: Annotated[int, NoDecode, _count(MIN_QUEUE_LIMIT)] = Field(
        DEFAULT_QUEUE_LIMIT, validation_alias=QUEUE_LIMIT_ENV
    )
    overload: Annotated[tuple[int, str | None], NoDecode, BeforeValidator(_overload)] = Field(
        (DEFAULT_OVERLOAD_STATUS, None), validation_alias=OVERLOAD_STATUS_ENV
    )

    @field_validator("queue_limit", mode="wrap")
    @classmethod
    def _only_with_limit(
        cls, v: Any, handler: ValidatorFunctionWrapHandler, info: ValidationInfo
    ) -> int:
        if info.data.get("engine_request_limit") is None:
            return DEFAULT_QUEUE_LIMIT  # off (or N invalid): Q is not read
        return int(handler(v))

    @classmethod
    def settings_customise_sources(
        cls,
        settings_cls: type[BaseSettings],
        init_settings: PydanticBaseSettingsSource,
        env_settings: PydanticBaseSettingsSource,
        dotenv_settings: PydanticBaseSettingsSource,
        file_secret_settings: PydanticBaseSettingsSource,
    ) -> tuple[PydanticBaseSettingsSource, ...]:
        environ = _ENVIRON.get()
        return (
            init_settings,
            _Environment(settings_cls, os.environ if environ is None else environ),
        )

    @classmethod
    def load(
        cls, engine_request_limit: str | int | None = None, environ: Mapping[str, str] | None = None
    ) -> AdmissionSettings:
        """Validate the flag value (wins) over the environment; AdmissionConfigError if bad."""
        env = os.environ if environ is None else environ
        flags: dict[str, Any] = {}
        if engine_request_limit is not None:
            flags["engine_request_limit"] = engine_request_limit
        token = _ENVIRON.set(env)
        try:
            return cls(**flags)
        except ValidationError as exc:
            err = exc.errors()[0]
            loc = str(err["loc"][0]) if err["loc"] else ""
            if loc in ("engine_request_limit", ENGINE_LIMIT_ENV):
                name, raw = (
                    (ENGINE_LIMIT_FLAG, str(engine_request_limit))
                    if flags
                    else (ENGINE_LIMIT_ENV, env.get(ENGINE_LIMIT_ENV))
                )
            else:
                name, raw = QUEUE_LIMIT_ENV, env.get(QUEUE_LIMIT_ENV)
            raise AdmissionConfigError(f"{name}={raw!r} is invalid: {err['msg']}") from None
        finally:
            _ENVIRON.reset(token)


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
        s = AdmissionSettings.load(engine_request_limit, environ)
        status, warning = s.overload
        return cls(s.engine_request_limit, s.queue_limit, status), warning


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
