"""Load patterns: closed-loop clients, and seeded Poisson arrivals bounded in count and time."""

from __future__ import annotations

import asyncio
import random
import time
from collections.abc import Callable, Coroutine, Sequence
from typing import Any

import aiohttp

from loadtest.shedbench.client import Outcome, censor, request_body, send
from loadtest.shedbench.config import Config

Launch = Callable[[float, float], Coroutine[Any, Any, None]]


async def closed_loop(
    session: aiohttp.ClientSession,
    url: str,
    cfg: Config,
    concurrency: int,
    seconds: float,
    rng: random.Random,
    stagger: float = 0.0,
) -> list[Outcome]:
    """``concurrency`` clients back to back for ``seconds``; in-flight ones are cancelled.

    Client ``i`` starts ``i / concurrency * stagger`` seconds late, so that requests do not
    all finish in lockstep.
    """
    t0 = time.monotonic()
    outcomes: list[Outcome] = []

    async def client(i: int) -> None:
        await asyncio.sleep(i / concurrency * stagger)
        while time.monotonic() - t0 < seconds:
            out = Outcome(arrival=time.monotonic() - t0)
            outcomes.append(out)
            await send(session, url, request_body(cfg, rng), out, t0)

    tasks = [asyncio.create_task(client(i)) for i in range(concurrency)]
    await asyncio.wait(tasks, timeout=seconds)
    for task in tasks:
        task.cancel()
    await asyncio.gather(*tasks, return_exceptions=True)
    return outcomes


async def poisson(
    rate: float,
    window: float,
    grace: float,
    rng: random.Random,
    launch: Launch,
    t0: float | None = None,
    times: Sequence[float] | None = None,
) -> float:
    """Poisson arrivals at ``rate``/s in ``[0, window)``: the cut-off, seconds from the start.
    Given ``times`` (sorted, seconds from the start, e.g. :func:`given_count`), those
    arrivals instead of drawn ones.

    ``launch(at, t0)`` is called at each arrival (``at`` seconds after ``t0``, the start on
    the monotonic clock, by default now) and returns the coroutine to run; it may draw from
    ``rng``, between the draws of the arrival times, so that a seed gives the same arrivals
    and bodies. At
    most ``2 x rate x window + 10`` arrivals, whatever the draws; what still runs ``grace``
    seconds after the window is cancelled.
    """
    t0 = time.monotonic() if t0 is None else t0
    limit = int(rate * window * 2) + 10
    tasks: list[asyncio.Task[None]] = []
    given = iter(times) if times is not None else None
    at = next(given, window) if given is not None else rng.expovariate(rate)
    while at < window and len(tasks) < limit:
        delay = at - (time.monotonic() - t0)
        if delay > 0:
            await asyncio.sleep(delay)
        tasks.append(asyncio.create_task(launch(at, t0)))
        at = next(given, window) if given is not None else at + rng.expovariate(rate)
    remaining = window + grace - (time.monotonic() - t0)
    if tasks:
        await asyncio.wait(tasks, timeout=max(0.0, remaining))
    cutoff = time.monotonic() - t0
    for task in tasks:
        task.cancel()
    await asyncio.gather(*tasks, return_exceptions=True)
    return cutoff


def given_count(rate: float, window: float, warmup: float, rng: random.Random) -> list[float]:
    """Arrival times of a Poisson process at ``rate``/s in ``[0, window)`` given its count
    in each part: ``round(rate x warmup)`` in ``[0, warmup)`` and ``round(rate x (window -
    warmup))`` in ``[warmup, window)``, each uniform at random (how a Poisson process places
    a known count), sorted. A run judged after ``warmup`` then sees the rate it names: with
    drawn counts, a 12-s part at 9 req/s holds 108 +- 10 arrivals, as far from 9 req/s as
    the simulated workers' knee is wide."""
    if rate <= 0 or not 0 <= warmup <= window:
        raise ValueError(
            f"given_count: rate {rate!r}, window {window!r}, warmup {warmup!r}: expected a "
            "rate above 0 and 0 <= warmup <= window"
        )
    warm = [rng.uniform(0.0, warmup) for _ in range(round(rate * warmup))]
    judged = [rng.uniform(warmup, window) for _ in range(round(rate * (window - warmup)))]
    return sorted(t for t in warm + judged if t < window)


async def open_loop(
    session: aiohttp.ClientSession,
    url: str,
    cfg: Config,
    rate: float,
    rng: random.Random,
    window: float | None = None,
    grace: float | None = None,
    t0: float | None = None,
    times: Sequence[float] | None = None,
) -> list[Outcome]:
    """The same request at Poisson times (or at ``times``) for ``window`` (default: the
    cell's), each stream given until ``grace`` (default: the configured one) after it; see
    :func:`poisson`."""
    outcomes: list[Outcome] = []

    def launch(at: float, t0: float) -> Coroutine[Any, Any, None]:
        out = Outcome(arrival=at)
        outcomes.append(out)
        return send(session, url, request_body(cfg, rng), out, t0)

    span = cfg.cell_seconds if window is None else window
    cutoff = await poisson(
        rate, span, cfg.grace if grace is None else grace, rng, launch, t0, times
    )
    for out in outcomes:
        censor(out, cutoff)
    return outcomes
