"""Mixed traffic with request classes: the mix, retrying clients, and the numbers per class."""

from __future__ import annotations

import asyncio
import json
import math
import random
import time
from collections import Counter
from collections.abc import Coroutine, Sequence
from dataclasses import dataclass, field
from typing import Any, Protocol

import aiohttp

from extproc.devstack import http
from loadtest.shedbench.arrivals import poisson
from loadtest.shedbench.client import Outcome, censor, request_body, send
from loadtest.shedbench.config import Config
from loadtest.shedbench.stack import Stack
from loadtest.shedbench.stats import percentile

# name -> share of the traffic; the order is the priority order.
MIX: tuple[tuple[str, float], ...] = (("critical", 0.2), ("standard", 0.5), ("sheddable", 0.3))
ORDER = {name: i for i, (name, _) in enumerate(MIX)}
CLASS_HEADER = "x-request-class"
OVERLOAD_STATUSES = frozenset({429, 503, 529})


@dataclass(frozen=True)
class Retry:
    """How a retrying client waits: ``Retry-After`` plus a full-jitter exponential backoff."""

    max_attempts: int = 6
    base: float = 0.25  # seconds: the first backoff is uniform in [0, base]
    cap: float = 4.0

    def delay(self, attempt: int, retry_after: float | None, rng: random.Random) -> float:
        """Seconds before attempt ``attempt + 1`` (``attempt`` counts from 1)."""
        backoff = rng.uniform(0.0, min(self.cap, self.base * 2 ** (attempt - 1)))
        return (retry_after if retry_after is not None else 0.0) + backoff

    def retries(self, out: Outcome) -> bool:
        """Only an overload reply is retried."""
        return out.status in OVERLOAD_STATUSES

    def wait(self, attempt: int, out: Outcome, rng: random.Random) -> float:
        return self.delay(attempt, out.retry_after, rng)

    def headers(self, attempt: int) -> dict[str, str]:
        """What such a client adds to attempt ``attempt`` (from 1): nothing."""
        return {}


class RetryPolicy(Protocol):
    """When a client retries and how long it waits first."""

    @property
    def max_attempts(self) -> int: ...

    def retries(self, out: Outcome) -> bool:
        """This answer is retried (while attempts remain)."""
        ...

    def wait(self, attempt: int, out: Outcome, rng: random.Random) -> float:
        """Seconds before attempt ``attempt + 1``, after attempt ``attempt`` got ``out``."""
        ...

    def headers(self, attempt: int) -> dict[str, str]:
        """The headers the client adds to attempt ``attempt`` (from 1)."""
        ...


@dataclass(slots=True)
class Request:
    """One logical request: its class, first arrival and every attempt."""

    cls: str
    arrival: float
    attempts: list[Outcome] = field(default_factory=list)

    @property
    def last(self) -> Outcome:
        return self.attempts[-1]

    @property
    def admitted(self) -> bool:
        return bool(self.attempts) and self.last.status == 200

    @property
    def first_token_at(self) -> float | None:
        """When its first token came (from the same start as ``arrival``), if it did."""
        last = self.attempts[-1] if self.attempts else None
        if last is None or last.status != 200 or last.ttft is None:
            return None
        return last.arrival + last.ttft

    @property
    def user_ttft(self) -> float | None:
        """Seconds from its first attempt to its first token, retries and waits included."""
        at = self.first_token_at
        return None if at is None else at - self.arrival


async def attempts(
    session: aiohttp.ClientSession,
    url: str,
    body: bytes,
    req: Request,
    t0: float,
    retry: RetryPolicy | None,
    jitter: random.Random,
    last_retry: float,
    headers: dict[str, str] | None = None,
) -> None:
    """Send ``req`` until it is answered other than overloaded, or ``retry`` (None: never)
    gives up, or the next attempt would start after ``last_retry`` (seconds from ``t0``)."""
    while True:
        out = Outcome(arrival=time.monotonic() - t0)
        req.attempts.append(out)
        if retry is not None:
            headers = {**(headers or {}), **retry.headers(len(req.attempts))}
        await send(session, url, body, out, t0, headers)
        if retry is None or not retry.retries(out):
            return
        if len(req.attempts) >= retry.max_attempts:
            return
        delay = retry.wait(len(req.attempts), out, jitter)
        if time.monotonic() - t0 + delay > last_retry:
            return
        await asyncio.sleep(delay)


async def mixed_loop(
    session: aiohttp.ClientSession,
    url: str,
    cfg: Config,
    rate: float,
    rng: random.Random,
    retry: Retry | None,
    mix: Sequence[tuple[str, float]] = MIX,
) -> list[Request]:
    """Poisson arrivals of ``mix`` at ``rate``/s; bounded by count and by time."""
    last_retry = cfg.cell_seconds + cfg.grace / 2
    names = [n for n, _ in mix]
    weights = [w for _, w in mix]
    jitter = random.Random(rng.random())
    requests: list[Request] = []

    def launch(at: float, t0: float) -> Coroutine[Any, Any, None]:
        req = Request(cls=rng.choices(names, weights)[0], arrival=at)
        requests.append(req)
        headers = {CLASS_HEADER: req.cls}
        body = request_body(cfg, rng)
        return attempts(session, url, body, req, t0, retry, jitter, last_retry, headers)

    cutoff = await poisson(rate, cfg.cell_seconds, cfg.grace, rng, launch)
    for req in requests:
        if req.attempts:
            censor(req.last, cutoff)
    return requests


@dataclass
class ClassCell:
    """One class in one cell."""

    cls: str
    requests: int
    attempts: int
    admitted: int
    admitted_first: int
    gave_up: int
    errors: int
    admitted_ratio: float
    admitted_first_ratio: float
    attempt_rejection_rate: float
    ttft_p50_ms: float
    ttft_p99_ms: float
    ttft_from_arrival_p99_ms: float
    goodput_rps: float
    slo_goodput_rps: float
    reasons: dict[str, int]  # rejected attempts by x-shed-reason


NO_RETRY, RETRY, FLAT, ALONE = "no retry", "retry", "no retry, flat", "critical alone"


@dataclass
class MixedCell:
    """``mode``: clients that never retry or retry (classes as configured), ``flat``
    (no retry, every class at share 1), or ``critical alone`` (the critical requests of
    the load with nothing else: the reference for the critical TTFT)."""

    load: float
    mode: str
    offered_rps: float
    classes: list[ClassCell]
    goodput_rps: float
    slo_goodput_rps: float
    attempts_rps: float
    mismatched_class: int

    def of(self, cls: str) -> ClassCell:
        return next(c for c in self.classes if c.cls == cls)

    @property
    def classed(self) -> bool:
        """Mixed traffic under the configured classes."""
        return self.mode in (NO_RETRY, RETRY)


def summarize_classes(
    cfg: Config, load: float, mode: str, rate: float, reqs: list[Request], slo_s: float
) -> MixedCell:
    """The cell's numbers per class; ``slo_s`` is the TTFT that counts into the SLO goodput."""
    span = cfg.cell_seconds - cfg.warmup
    per_class: list[ClassCell] = []
    for name in dict.fromkeys(r.cls for r in sorted(reqs, key=lambda r: ORDER[r.cls])):
        mine = [r for r in reqs if r.cls == name]
        window = [r for r in mine if r.arrival >= cfg.warmup and r.attempts]
        admitted = [r for r in window if r.admitted]
        attempts = [a for r in window for a in r.attempts]
        rejected_attempts = [a for a in attempts if a.status in OVERLOAD_STATUSES]
        ttfts = [r.last.ttft for r in admitted if r.last.ttft is not None]
        from_arrival = [
            r.last.arrival + r.last.ttft - r.arrival for r in admitted if r.last.ttft is not None
        ]
        done = [
            a
            for r in mine
            for a in r.attempts
            if a.finished and cfg.warmup <= a.arrival + (a.e2e or 0) <= cfg.cell_seconds
        ]
        first_ok = sum(1 for r in window if r.attempts[0].status == 200)
        per_class.append(
            ClassCell(
                cls=name,
                requests=len(window),
                attempts=len(attempts),
                admitted=len(admitted),
                admitted_first=first_ok,
                gave_up=sum(1 for r in window if r.last.status in OVERLOAD_STATUSES),
                errors=sum(1 for r in window if r.last.status not in OVERLOAD_STATUSES | {200}),
                admitted_ratio=len(admitted) / len(window) if window else math.nan,
                admitted_first_ratio=first_ok / len(window) if window else math.nan,
                attempt_rejection_rate=(
                    len(rejected_attempts) / len(attempts) if attempts else math.nan
                ),
                ttft_p50_ms=percentile(ttfts, 50) * 1e3,
                ttft_p99_ms=percentile(ttfts, 99) * 1e3,
                ttft_from_arrival_p99_ms=percentile(from_arrival, 99) * 1e3,
                goodput_rps=len(done) / span,
                slo_goodput_rps=sum(1 for a in done if (a.ttft or 0) <= slo_s) / span,
                reasons=dict(Counter(a.shed_reason or "none" for a in rejected_attempts)),
            )
        )
    all_attempts = [a for r in reqs for a in r.attempts if a.arrival >= cfg.warmup]
    return MixedCell(
        load=load,
        mode=mode,
        offered_rps=rate,
        classes=per_class,
        goodput_rps=sum(c.goodput_rps for c in per_class),
        slo_goodput_rps=sum(c.slo_goodput_rps for c in per_class),
        attempts_rps=len([a for a in all_attempts if a.arrival <= cfg.cell_seconds]) / span,
        mismatched_class=sum(
            1
            for r in reqs
            for a in r.attempts
            if a.status in OVERLOAD_STATUSES and a.shed_class != r.cls
        ),
    )


def set_flat(stack: Stack, flat: bool, shares: dict[str, Any]) -> None:
    """Every class at share 1 (``flat``), or back to the shares of the classes file."""
    for name, _ in MIX:
        body = {"name": name, "share": 1.0 if flat else shares[name]}
        status, _, reply = http("POST", stack.ext.admin + "/classes", body)
        if status != 200:
            raise RuntimeError(f"POST /classes {body} -> {status}: {reply!r}")


def current_shares(stack: Stack) -> dict[str, Any]:
    """Each class's share as the extproc has it (``GET /classes``); every class of :data:`MIX`."""
    status, _, reply = http("GET", stack.ext.admin + "/classes")
    if status != 200:
        raise RuntimeError(f"GET /classes -> {status}: {reply!r}")
    listed = {c["name"]: c["share"] for c in json.loads(reply)["classes"]}
    missing = [n for n, _ in MIX if n not in listed]
    if missing:
        raise RuntimeError(f"the classes file has no class {missing[0]!r}; it needs {MIX}")
    return listed
