"""Locust users for the OpenAI API behind the load-shedding Envoy.

    locust -f loadtest/locustfile.py --host http://localhost:8000            # web UI on :8089
    locust -f loadtest/locustfile.py --host http://localhost:8000 --headless -u 20 -r 10 -t 30s

One user class, four weighted tasks, each reported under its own name:

==============  ======  ==========================================================
name            weight  request
==============  ======  ==========================================================
chat-stream     6       streaming chat, short prompt, 64 output tokens
chat            3       non-streaming chat, short prompt, 32 output tokens
long-output     1       streaming completion, 512 output tokens
long-prompt     1       streaming chat, ~4,000-token prompt, 16 output tokens
==============  ======  ==========================================================

What lands in the statistics (and in ``--csv`` / ``--html`` reports):

- ``POST <name>``: requests that got a 2xx, with the **whole** response time (to the last
  byte of a stream, not to the headers); any other status, a cut stream or a connection
  error is a failure.
- ``REJECTED <name>``: overload replies, counted as successes: shedding is the behaviour
  under test, not an error. An overload reply is one with the status
  ``DYN_HTTP_OVERLOAD_STATUS_CODE`` (default 529), or any reply with the extproc's
  ``x-shed-reason`` header (a request class may answer 429 or 503, docs/classes.md).
- ``TTFT <name>``: time to the first streamed token, one sample per stream.
- ``ITL <name>``: inter-token latency, one sample per gap between two streamed events that
  carry text (an engine that sends several tokens per event gives one gap per event).

Options (flag or environment variable; also in the web UI):

- ``--model`` / ``LOADTEST_MODEL``: the ``model`` of every request (default ``sim-model``).
- ``--retries N`` / ``LOADTEST_RETRIES``: retry a rejected request up to N times (default 0:
  off), waiting ``uniform(0, min(retry-max, retry-base x 2^attempt))`` seconds (exponential
  backoff with full jitter); with ``--retry-after`` at least the reply's ``Retry-After``.
  Every rejected attempt is counted under ``REJECTED``; a retry that succeeds counts once
  under ``POST``.
- ``--retry-base`` (0.5 s), ``--retry-max`` (8 s), ``--retry-after`` / ``LOADTEST_RETRY_AFTER``.
- ``--class-mix`` / ``LOADTEST_CLASS_MIX``: request classes and their weights, e.g.
  ``critical=20,standard=50,sheddable=30``; each request draws one and sends it in
  ``--class-header`` (``LOADTEST_CLASS_HEADER``, default ``x-request-class``; with the shipped
  Envoy configs ``x-api-tier`` and ``premium=20,standard=50,batch=30`` go through its tier
  routes). Every row's name then ends in `` [<class>]``, so each class has its own
  requests, rejections, TTFT and ITL. Default: no class header, names as above.

Only locust and the standard library are imported, so the file also runs in the stock
``locustio/locust`` container image.
"""

from __future__ import annotations

import json
import math
import os
import random
import time
from collections.abc import Mapping
from typing import Any

# locust first: it monkey-patches the standard library (gevent) before requests loads ssl.
from locust import HttpUser, between, events, task
from locust.argument_parser import LocustArgumentParser
from requests import RequestException, Response

REJECTED = "REJECTED"
TTFT = "TTFT"
ITL = "ITL"
DEFAULT_OVERLOAD_STATUS = 529

SHORT_PROMPT = "Explain in two sentences why a load balancer sheds load when every worker is busy."
# ~4,000 prompt tokens by the router's estimate (UTF-8 bytes / 4).
LONG_PROMPT = "Summarise this log. " + " ".join(
    f"line {i}: worker ok, kv usage normal, queue empty." for i in range(360)
)


def overload_status(env: Mapping[str, str] = os.environ) -> int:
    """The overload status as the extproc reads it: 200-999, else 529."""
    text = env.get("DYN_HTTP_OVERLOAD_STATUS_CODE", "").strip()
    try:
        value = int(text)
    except ValueError:
        return DEFAULT_OVERLOAD_STATUS
    return value if 200 <= value <= 999 else DEFAULT_OVERLOAD_STATUS


def backoff_seconds(attempt: int, base: float, cap: float, rng: random.Random) -> float:
    """Exponential backoff with full jitter before retry number ``attempt`` (0-based)."""
    return rng.uniform(0.0, min(cap, base * 2.0**attempt))


def retry_after_seconds(value: str | None) -> float:
    """A ``Retry-After`` header in whole seconds; 0 when absent or not a number."""
    try:
        return max(0.0, float(value or 0))
    except ValueError:
        return 0.0


def parse_class_mix(text: str) -> list[tuple[str, float]]:
    """``name=weight,...`` as (name, weight) pairs; ValueError naming the bad part."""
    mix: list[tuple[str, float]] = []
    for part in (p.strip() for p in text.split(",")):
        if not part:
            continue
        name, sep, weight = part.partition("=")
        name = name.strip()
        try:
            value = float(weight) if sep else math.nan
        except ValueError:
            value = math.nan
        if not name or not math.isfinite(value) or value <= 0:
            raise ValueError(
                f"--class-mix: {part!r} is not name=weight with a weight above 0 "
                "(e.g. critical=20,standard=50,sheddable=30)"
            )
        mix.append((name, value))
    return mix


def has_text(event: dict[str, Any]) -> bool:
    """Whether one streamed chat or completions event carries generated text."""
    for choice in event.get("choices") or ():
        delta = choice.get("delta")
        if delta.get("content") if isinstance(delta, dict) else choice.get("text"):
            return True
    return False


@events.init_command_line_parser.add_listener
def _add_arguments(parser: LocustArgumentParser) -> None:
    group = parser.add_argument_group("envoy-llm-shedder")
    group.add_argument(
        "--model", env_var="LOADTEST_MODEL", default="sim-model", help="model of every request"
    )
    group.add_argument(
        "--retries",
        type=int,
        env_var="LOADTEST_RETRIES",
        default=0,
        help="retry a rejected (overloaded) request up to N times; 0 = off",
    )
    group.add_argument(
        "--retry-base",
        type=float,
        env_var="LOADTEST_RETRY_BASE",
        default=0.5,
        help="seconds: backoff base, doubled on each retry (full jitter)",
    )
    group.add_argument(
        "--retry-max",
        type=float,
        env_var="LOADTEST_RETRY_MAX",
        default=8.0,
        help="seconds: longest backoff",
    )
    group.add_argument(
        "--retry-after",
        action="store_true",
        env_var="LOADTEST_RETRY_AFTER",
        default=False,
        help="wait at least the reply's Retry-After before a retry",
    )
    group.add_argument(
        "--class-mix",
        env_var="LOADTEST_CLASS_MIX",
        default="",
        help="request classes and weights, e.g. critical=20,standard=50,sheddable=30 "
        "(default: no class header)",
    )
    group.add_argument(
        "--class-header",
        env_var="LOADTEST_CLASS_HEADER",
        default="x-request-class",
        help="the header that names the class (x-api-tier with the shipped Envoy routes)",
    )


@events.init.add_listener
def _check_options(environment: Any, **_: Any) -> None:
    """Bad options stop the run at once, with the flag, the value and what was expected."""
    opts = environment.parsed_options
    try:
        parse_class_mix(getattr(opts, "class_mix", "") or "")
    except ValueError as exc:
        raise SystemExit(str(exc)) from None


class OpenAIUser(HttpUser):
    """A client of the OpenAI HTTP API: streaming and plain chat, long outputs, long prompts."""

    wait_time = between(0.2, 1.0)

    def on_start(self) -> None:
        opts = self.environment.parsed_options
        self.model: str = getattr(opts, "model", "sim-model")
        self.retries: int = max(0, getattr(opts, "retries", 0))
        self.retry_base: float = getattr(opts, "retry_base", 0.5)
        self.retry_max: float = getattr(opts, "retry_max", 8.0)
        self.honour_retry_after: bool = getattr(opts, "retry_after", False)
        self.overload = overload_status()
        self.rng = random.Random()
        mix = parse_class_mix(getattr(opts, "class_mix", "") or "")
        self.class_names = [name for name, _ in mix]
        self.class_weights = [weight for _, weight in mix]
        self.class_header: str = getattr(opts, "class_header", "x-request-class")

    @task(6)
    def chat_stream(self) -> None:
        self.generate("chat-stream", "/v1/chat/completions", self.chat(SHORT_PROMPT, 64, True))

    @task(3)
    def chat_plain(self) -> None:
        self.generate("chat", "/v1/chat/completions", self.chat(SHORT_PROMPT, 32, False))

    @task(1)
    def long_output(self) -> None:
        body = {
            "model": self.model,
            "prompt": "Write a long story about a patient load balancer.",
            "max_tokens": 512,
            "stream": True,
        }
        self.generate("long-output", "/v1/completions", body)

    @task(1)
    def long_prompt(self) -> None:
        self.generate("long-prompt", "/v1/chat/completions", self.chat(LONG_PROMPT, 16, True))

    def chat(self, prompt: str, max_tokens: int, stream: bool) -> dict[str, Any]:
        body: dict[str, Any] = {
            "model": self.model,
            "messages": [{"role": "user", "content": prompt}],
            "max_tokens": max_tokens,
            "stream": stream,
        }
        if stream:
            body["stream_options"] = {"include_usage": True}
        return body

    def generate(self, name: str, path: str, body: dict[str, Any]) -> None:
        """Send once, and again after a backoff while rejected and retries are left."""
        headers: dict[str, str] = {}
        if self.class_names:
            cls = self.rng.choices(self.class_names, self.class_weights)[0]
            headers[self.class_header] = cls
            name = f"{name} [{cls}]"
        for attempt in range(self.retries + 1):
            retry_after = self.send(name, path, body, headers)
            if retry_after is None or attempt == self.retries:
                return
            delay = backoff_seconds(attempt, self.retry_base, self.retry_max, self.rng)
            if self.honour_retry_after:
                delay = max(delay, retry_after)
            time.sleep(delay)  # gevent-patched: yields to the other users

    def send(
        self, name: str, path: str, body: dict[str, Any], headers: dict[str, str] | None = None
    ) -> float | None:
        """One request; the reply's Retry-After (seconds) if it was rejected, else None."""
        stream = bool(body.get("stream"))
        start = time.perf_counter()
        with self.client.post(
            path, json=body, name=name, stream=stream, catch_response=True, headers=headers
        ) as resp:
            meta = resp.request_meta
            if resp.status_code == self.overload or "x-shed-reason" in resp.headers:
                meta["request_type"] = REJECTED
                resp.success()
                return retry_after_seconds(resp.headers.get("retry-after"))
            if resp.status_code != 200:
                resp.failure(f"HTTP {resp.status_code}: {resp.text[:200]}")
                return None
            try:
                size = self.read_stream(name, resp, start) if stream else self.read_json(resp)
            except (RequestException, ValueError) as exc:
                resp.failure(f"{type(exc).__name__}: {exc}")
                return None
            meta["response_time"] = (time.perf_counter() - start) * 1000
            meta["response_length"] = size
            resp.success()
        return None

    def read_json(self, resp: Response) -> int:
        reply = resp.json()
        if not reply.get("choices"):
            raise ValueError(f"no choices in the reply: {resp.text[:200]}")
        return len(resp.content)

    def read_stream(self, name: str, resp: Response, start: float) -> int:
        """Read SSE events to ``[DONE]``, firing TTFT and ITL samples; the bytes read."""
        fire = self.environment.events.request.fire
        last: float | None = None
        size = 0
        for line in resp.iter_lines():
            size += len(line) + 1
            if not line.startswith(b"data:"):
                continue
            data = line[5:].strip()
            if data == b"[DONE]":
                return size
            now = time.perf_counter()
            if not has_text(json.loads(data)):
                continue  # e.g. the final usage event
            kind, since = (TTFT, start) if last is None else (ITL, last)
            fire(
                request_type=kind,
                name=name,
                response_time=(now - since) * 1000,
                response_length=0,
                exception=None,
                context={},
            )
            last = now
        raise ValueError("the stream ended without data: [DONE]")
