"""One streaming chat completion through Envoy, and what came back of it."""

from __future__ import annotations

import asyncio
import contextlib
import email.utils
import json
import random
import time
from dataclasses import dataclass

import aiohttp

from loadtest.shedbench.config import MODEL, Config


@dataclass(slots=True)
class Outcome:
    """One request: times in seconds from the start of its phase."""

    arrival: float
    status: int = 0  # 0 = no response (connection error or cancelled before headers)
    ttft: float | None = None
    e2e: float | None = None
    finished: bool = False
    error: str = ""
    retry_after: float | None = None  # of a rejection, in seconds (``Retry-After``)
    retry_after_ms: float | None = None  # of a rejection, ``retry-after-ms``
    should_retry: str = ""  # of a rejection, ``x-should-retry`` (``true``/``false``)
    shed_class: str = ""  # x-shed-class of a rejection: the class the extproc decided on
    shed_reason: str = ""  # x-shed-reason of a rejection: the check that fired
    # The worker that served an answer: its x-worker-id (the simulated engine sends one),
    # else the x-served-by a benchmark's Envoy adds (the upstream's host:port).
    worker: str = ""


def request_body(cfg: Config, rng: random.Random, max_tokens: int | None = None) -> bytes:
    # estimate_tokens counts ceil(UTF-8 bytes / 4): 4 bytes per prompt token.
    words = "".join(rng.choice("abcdefghij") for _ in range(3))
    text = ((words + " ") * cfg.prompt_tokens)[: 4 * cfg.prompt_tokens]
    body: dict[str, object] = {
        "model": MODEL,
        "messages": [{"role": "user", "content": text}],
        "max_tokens": max_tokens or cfg.max_tokens,
        "stream": True,
    }
    if cfg.ignore_eos:
        body["ignore_eos"] = True
    return json.dumps(body).encode()


SERVED_BY = "x-served-by"  # %UPSTREAM_HOST%, added by :func:`ttft_sources.access_log_tweak`


async def send(
    session: aiohttp.ClientSession,
    url: str,
    body: bytes,
    out: Outcome,
    t0: float,
    headers: dict[str, str] | None = None,
) -> None:
    """POST one streaming chat; fill ``out`` as the response arrives."""
    headers = {"content-type": "application/json", **(headers or {})}
    try:
        async with session.post(url, data=body, headers=headers) as resp:
            out.status = resp.status
            out.worker = resp.headers.get("x-worker-id") or resp.headers.get(SERVED_BY) or ""
            if resp.status != 200:
                out.retry_after = retry_after_seconds(resp.headers.get("retry-after", ""))
                with contextlib.suppress(ValueError):
                    out.retry_after_ms = float(resp.headers.get("retry-after-ms", ""))
                out.should_retry = resp.headers.get("x-should-retry", "")
                out.shed_class = resp.headers.get("x-shed-class", "")
                out.shed_reason = resp.headers.get("x-shed-reason", "")
                await resp.read()
                out.e2e = time.monotonic() - t0 - out.arrival
                return
            async for chunk in resp.content.iter_any():
                if out.ttft is None and b"data:" in chunk:
                    out.ttft = time.monotonic() - t0 - out.arrival
                if chunk.endswith(b"data: [DONE]\n\n"):
                    break
            out.e2e = time.monotonic() - t0 - out.arrival
            out.finished = out.ttft is not None
    except aiohttp.ClientError as exc:
        out.error = type(exc).__name__


def retry_after_seconds(value: str) -> float | None:
    """``Retry-After`` as seconds: a number, or an HTTP date (from now); None otherwise."""
    with contextlib.suppress(ValueError):
        return float(value)
    parsed = email.utils.parsedate_tz(value)
    if parsed is None:
        return None
    return float(email.utils.mktime_tz(parsed) - time.time())


def censor(out: Outcome, cutoff: float) -> None:
    """An admitted stream cancelled at ``cutoff``: it counts at the time it had waited so far."""
    if out.status == 200 and not out.finished:
        out.e2e = cutoff - out.arrival
        if out.ttft is None:
            out.ttft = out.e2e


async def probe(
    session: aiohttp.ClientSession,
    url: str,
    cfg: Config,
    rng: random.Random,
    max_tokens: int | None = None,
) -> Outcome:
    """One request on an idle stack."""
    out = Outcome(arrival=0.0)
    await asyncio.wait_for(
        send(session, url, request_body(cfg, rng, max_tokens), out, time.monotonic()), 30
    )
    return out
