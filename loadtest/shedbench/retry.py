"""How the OpenAI SDKs retry, for clients that behave like the ones an operator's users run.

openai-python (``_base_client.py``: ``_should_retry``, ``_calculate_retry_timeout``;
``_constants.py``) retries 408, 409, 429, every 5xx (so 529) and a connection error,
``DEFAULT_MAX_RETRIES = 2`` times. Before retry ``n`` (0 for the first) it waits what the
server asked, ``retry-after-ms`` first, then ``Retry-After`` (seconds or an HTTP date),
when that is in (0, 60] s; otherwise ``min(0.5 x 2^n, 8)`` s times a jitter uniform in
(0.75, 1]. ``x-should-retry: true|false`` overrides the status. Every attempt carries
``x-stainless-retry-count``: 0 on the first, then 1 and 2 (``_build_headers``).
"""

from __future__ import annotations

import random
from dataclasses import dataclass

from loadtest.shedbench.client import Outcome

RETRY_COUNT_HEADER = "x-stainless-retry-count"


def server_wait(out: Outcome) -> float | None:
    """What the server asked to wait, in seconds: ``retry-after-ms`` first, then
    ``Retry-After``; None when it sent neither."""
    if out.retry_after_ms is not None:
        return out.retry_after_ms / 1e3
    return out.retry_after


@dataclass(frozen=True)
class OpenAIRetry:
    """The OpenAI SDK's retries (module docstring); ``max_retries`` after the first attempt."""

    max_retries: int = 2
    initial: float = 0.5  # INITIAL_RETRY_DELAY
    cap: float = 8.0  # MAX_RETRY_DELAY
    honoured_up_to: float = 60.0  # a server's wait above this falls back to the backoff

    @property
    def max_attempts(self) -> int:
        return self.max_retries + 1

    def retries(self, out: Outcome) -> bool:
        """The SDK would retry this answer."""
        if out.should_retry in ("true", "false"):
            return out.should_retry == "true"
        return out.status in (0, 408, 409, 429) or out.status >= 500

    def wait(self, attempt: int, out: Outcome, rng: random.Random) -> float:
        """Seconds before attempt ``attempt + 1``, after attempt ``attempt`` (from 1) got
        ``out``."""
        asked = server_wait(out)
        if asked is not None and 0 < asked <= self.honoured_up_to:
            return asked
        backoff = min(self.initial * 2.0 ** (attempt - 1), self.cap)
        return backoff * (1 - 0.25 * rng.random())

    def headers(self, attempt: int) -> dict[str, str]:
        """What the SDK adds to attempt ``attempt`` (from 1): the retries taken before it."""
        return {RETRY_COUNT_HEADER: str(attempt - 1)}

    def describe(self) -> str:
        return (
            f"the OpenAI SDK's: {self.max_retries} retries of 408, 409, 429, 5xx and "
            "connection errors, none after `x-should-retry: false`; before each, "
            "`retry-after-ms`, else `Retry-After`, when in "
            f"(0, {self.honoured_up_to:g}] s, else {self.initial:g} s x 2^n (at most "
            f"{self.cap:g} s) x a jitter in (0.75, 1]; each attempt numbered in "
            f"`{RETRY_COUNT_HEADER}` (0, 1, 2)"
        )
