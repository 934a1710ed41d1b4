"""A plant that queues, for the deadline predictor's tests: engines simulated by events.

- Each engine runs ``slots`` requests at once; the others wait at it, first come first served.
- A request that gets a slot is prefilled in the engine's shared, serial prefill stage
  (continuous batching: prompts ahead of it in prefill delay it) at ``prefill_s_per_token``
  and ``prefill_fixed_s`` a request (an engine whose every prompt costs a batch of its own,
  as llama.cpp's on a CPU), then its first token comes ``overhead_s`` later; it then
  decodes ``output_tokens`` at ``decode_s_per_token`` and frees its slot. ``slowdown``
  multiplies its prefill and per-token costs (a worker that becomes slower:
  :meth:`Sim.slow_down`). With ``chunk_tokens``, a request's
  decode streams chunks of that many tokens, each at the slowdown of its time, and the
  router sees each (:meth:`Router.tokens`); without, the decode is one span, timed at start.
- Arrivals are Poisson (seeded), prompt and output lengths uniform; :meth:`Sim.add` adds
  others at given times with given lengths.
- The router sees each request ``gateway_s`` after it arrives (its own delay), and what an
  engine does ``net_s`` later (the network). An engine reports its waiting, running and slot
  counts after every change, unless ``reports`` is off (a worker that reports none).

The router under test is a callback object (:class:`Router`); the plant calls it on every
event with the current time and records the true TTFT each client sees.
"""

from __future__ import annotations

import heapq
import itertools
import random
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass, field
from functools import partial


@dataclass
class Params:
    slots: int = 8
    prefill_s_per_token: float = 0.0001  # 100 ms per 1000 prompt tokens
    prefill_fixed_s: float = 0.0
    overhead_s: float = 0.01
    decode_s_per_token: float = 0.01
    prompt_tokens: tuple[int, int] = (100, 2000)
    output_tokens: tuple[int, int] = (20, 300)
    gateway_s: float = 0.003
    net_s: float = 0.001
    reports: bool = True
    chunk_tokens: int = 0

    def mean_service(self) -> float:
        """Mean time a request holds a slot with no prefill contention."""
        p = sum(self.prompt_tokens) / 2 * self.prefill_s_per_token + self.prefill_fixed_s
        d = sum(self.output_tokens) / 2 * self.decode_s_per_token
        return p + self.overhead_s + d

    def capacity(self) -> float:
        """Requests per second with every slot always busy (no prefill contention)."""
        return self.slots / self.mean_service()


@dataclass
class Request:
    rid: int
    arrived: float
    prompt: int
    output: int
    first_token: float | None = None  # at the client (= at the router)
    ended: float | None = None
    outcome: str = "pending"  # dispatched, held, rejected, expired
    predicted: float | None = None
    worker: str | None = None
    decided: float | None = None  # when the router dispatched, held or rejected it

    @property
    def decision_delay(self) -> float | None:
        """From its arrival to the router's last decision on it."""
        return None if self.decided is None else self.decided - self.arrived

    @property
    def ttft(self) -> float | None:
        return None if self.first_token is None else self.first_token - self.arrived


class Router:
    """What the plant calls; by default every request goes to the first engine at once."""

    def arrive(self, sim: Sim, req: Request, now: float) -> None:
        next(iter(sim.engines.values())).dispatch(req, now)

    def first_byte(self, engine: Engine, req: Request, now: float) -> None:
        pass

    def tokens(self, engine: Engine, req: Request, count: int, now: float) -> None:
        pass

    def ended(self, engine: Engine, req: Request, now: float) -> None:
        pass

    def load(self, engine: Engine, waiting: int, active: int, total: int, now: float) -> None:
        pass


class Engine:
    """One worker's engine."""

    def __init__(self, sim: Sim, name: str, params: Params) -> None:
        self.sim, self.name, self.params = sim, name, params
        self.waiting: deque[Request] = deque()
        self.running = 0
        self.prefill_free_at = 0.0
        self.slowdown = 1.0

    def dispatch(self, req: Request, now: float) -> None:
        """The router sends ``req`` here now."""
        req.outcome, req.worker = "dispatched", self.name
        self.sim.at(now + self.params.net_s, partial(self._receive, req))

    def _receive(self, req: Request, now: float) -> None:
        if self.running < self.params.slots:
            self._start(req, now)
        else:
            self.waiting.append(req)
        self._report(now)

    def _start(self, req: Request, now: float) -> None:
        self.running += 1
        p = self.params
        prefill = (req.prompt * p.prefill_s_per_token + p.prefill_fixed_s) * self.slowdown
        done = max(now, self.prefill_free_at) + prefill
        self.prefill_free_at = done
        first = done + p.overhead_s
        self.sim.at(first + p.net_s, partial(self._first, req))
        if p.chunk_tokens:
            self.sim.at(first, partial(self._decode, req, req.output))
            return
        end = first + req.output * p.decode_s_per_token * self.slowdown
        self.sim.at(end, partial(self._end, req))

    def _decode(self, req: Request, left: int, now: float) -> None:
        """Decode the next chunk of ``req``'s ``left`` tokens at the slowdown of now."""
        if left <= 0:
            self._end(req, now)
            return
        n = min(left, self.params.chunk_tokens)
        done = now + n * self.params.decode_s_per_token * self.slowdown
        self.sim.at(done + self.params.net_s, partial(self._seen_tokens, req, n))
        self.sim.at(done, partial(self._decode, req, left - n))

    def _seen_tokens(self, req: Request, n: int, now: float) -> None:
        self.sim.router.tokens(self, req, n, now)

    def _first(self, req: Request, now: float) -> None:
        req.first_token = now
        self.sim.router.first_byte(self, req, now)

    def _end(self, req: Request, now: float) -> None:
        self.running -= 1
        if self.waiting:
            self._start(self.waiting.popleft(), now)
        self._report(now)
        self.sim.at(now + self.params.net_s, partial(self._seen_end, req))

    def _seen_end(self, req: Request, now: float) -> None:
        req.ended = now
        self.sim.router.ended(self, req, now)

    def _report(self, now: float) -> None:
        if self.params.reports:
            counts = (len(self.waiting), self.running, self.params.slots)
            self.sim.at(now + self.params.net_s, partial(self._deliver, counts))

    def _deliver(self, counts: tuple[int, int, int], now: float) -> None:
        self.sim.router.load(self, *counts, now)


@dataclass
class Sim:
    """Engines named ``w0``, ``w1``... with ``params`` each, and the arrivals."""

    params: Params
    router: Router
    seed: int = 1
    workers: int = 1
    requests: list[Request] = field(default_factory=list)

    def __post_init__(self) -> None:
        self.rng = random.Random(self.seed)
        self.events: list[tuple[float, int, Callable[[float], None]]] = []
        self.seq = itertools.count()
        self.engines = {f"w{i}": Engine(self, f"w{i}", self.params) for i in range(self.workers)}

    def capacity(self) -> float:
        return self.workers * self.params.capacity()

    def at(self, t: float, fn: Callable[[float], None]) -> None:
        heapq.heappush(self.events, (t, next(self.seq), fn))

    def slow_down(self, at: float, worker: str, factor: float) -> None:
        """From ``at`` on, ``worker`` takes ``factor`` times as long per token."""
        self.at(at, lambda now: setattr(self.engines[worker], "slowdown", factor))

    def add(self, t: float, prompt: int, output: int) -> Request:
        """One request arriving at ``t`` with these lengths, besides the Poisson ones."""
        req = Request(len(self.requests), t, prompt, output)
        self.requests.append(req)
        self.at(t + self.params.gateway_s, partial(self._arrive, req))
        return req

    def run(self, rate: Callable[[float], float], until: float) -> list[Request]:
        """Poisson arrivals at ``rate(t)`` per second until ``until``; then drain."""
        t = 0.0
        lo, hi = self.params.prompt_tokens
        olo, ohi = self.params.output_tokens
        while True:
            t += self.rng.expovariate(rate(t))
            if t >= until:
                break
            self.add(t, self.rng.randint(lo, hi), self.rng.randint(olo, ohi))
        while self.events:
            t, _, fn = heapq.heappop(self.events)
            fn(t)
        return self.requests

    def _arrive(self, req: Request, now: float) -> None:
        self.router.arrive(self, req, now)
