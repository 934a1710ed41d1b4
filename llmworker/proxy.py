"""The agent's reverse proxy in front of the engine (``--listen``), see :mod:`llmworker.agent`.

Requests are forwarded as they come and responses, SSE included, streamed back
chunk by chunk with their status and headers. Inference requests pass
worker-side admission first, and their prompt tokens (``ceil(UTF-8 bytes / 4)``,
as the router counts them) stay in a :class:`PrefillLedger` from dispatch until
the first SSE event that carries generated text (a non-streaming request: until
its response arrives), charged to the rank with the fewest such tokens.
``GET /metrics`` returns the engine's metrics plus the proxy's own registry.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any

import aiohttp
import msgspec
from aiohttp import web
from multidict import CIMultiDict
from prometheus_client import CollectorRegistry, generate_latest
from yarl import URL

from extproc.openai.request import INFERENCE_PATHS, BadRequest, parse_body
from llmworker.admission import Admission, Overloaded
from llmworker.httpserver import json_error, listen, rejection_response
from llmworker.netaddr import join_url

log = logging.getLogger("llmworker.proxy")

_HOP_BY_HOP = frozenset(
    {
        "connection",
        "keep-alive",
        "proxy-authenticate",
        "proxy-authorization",
        "proxy-connection",
        "te",
        "trailer",
        "trailers",
        "transfer-encoding",
        "upgrade",
        "host",
        "content-length",
    }
)


# ---------------------------------------------------------------------------
# proxy-side prefill accounting


@dataclass(slots=True)
class PrefillTicket:
    """Prompt tokens of one proxied request, charged to ``rank`` until released."""

    rank: int
    tokens: int
    released: bool = False


class PrefillLedger:
    """Prompt tokens of proxied requests that have no first token yet, per rank."""

    def __init__(self, on_change: Callable[[], None] = lambda: None) -> None:
        self._pending: list[int] = [0]
        self._on_change = on_change

    def resize(self, dp_size: int) -> None:
        """Track at least ``dp_size`` ranks (never shrinks: tickets may be out)."""
        if dp_size > len(self._pending):
            self._pending.extend([0] * (dp_size - len(self._pending)))

    def per_rank(self) -> list[int]:
        return list(self._pending)

    def add(self, tokens: int) -> PrefillTicket:
        """Charge ``tokens`` to the rank with the fewest pending tokens."""
        rank = min(range(len(self._pending)), key=self._pending.__getitem__)
        ticket = PrefillTicket(rank, max(0, tokens))
        if ticket.tokens:
            self._pending[rank] += ticket.tokens
            self._on_change()
        return ticket

    def release(self, ticket: PrefillTicket) -> None:
        """The request produced its first token or ended; safe to call twice."""
        if ticket.released:
            return
        ticket.released = True
        if ticket.tokens:
            self._pending[ticket.rank] -= ticket.tokens
            self._on_change()


def _carries_text(payload: Any) -> bool:
    """Whether an OpenAI stream chunk carries generated output."""
    if not isinstance(payload, dict):
        return False
    choices = payload.get("choices")
    if isinstance(choices, list):
        for choice in choices:
            if not isinstance(choice, dict):
                continue
            if choice.get("text"):
                return True
            delta = choice.get("delta")
            if isinstance(delta, dict) and any(
                delta.get(k) for k in ("content", "reasoning_content", "reasoning", "tool_calls")
            ):
                return True
        return False
    kind = payload.get("type")  # Responses API: {"type": "response.output_text.delta", ...}
    return isinstance(kind, str) and kind.endswith(".delta") and bool(payload.get("delta"))


class FirstTokenWatcher:
    """Fed the bytes of an SSE response; says when the first generated text passes."""

    LIMIT = 1024 * 1024

    def __init__(self) -> None:
        self._buffer = b""

    def feed(self, chunk: bytes) -> bool:
        """True once an event carrying generated text has been seen in the stream."""
        self._buffer = (self._buffer + chunk).replace(b"\r\n", b"\n")
        while (end := self._buffer.find(b"\n\n")) >= 0:
            event, self._buffer = self._buffer[:end], self._buffer[end + 2 :]
            data = b"\n".join(
                line[5:].removeprefix(b" ")
                for line in event.split(b"\n")
                if line.startswith(b"data:")
            )
            if not data or data == b"[DONE]":
                continue
            try:
                payload = msgspec.json.decode(data)
            except msgspec.DecodeError:
                continue
            if _carries_text(payload):
                return True
        return len(self._buffer) > self.LIMIT  # not SSE as we know it: stop counting


# ---------------------------------------------------------------------------
# the reverse proxy


def _forward_headers(headers: Mapping[str, str], connection: str | None) -> CIMultiDict[str]:
    drop = set(_HOP_BY_HOP)
    if connection:
        drop.update(token.strip().lower() for token in connection.split(","))
    out: CIMultiDict[str] = CIMultiDict()
    for name, value in headers.items():
        if name.lower() not in drop:
            out.add(name, value)
    return out


class EngineProxy:
    """aiohttp reverse proxy in front of the engine, with admission and prefill accounting."""

    def __init__(
        self,
        engine_url: URL,
        admission: Admission,
        ledger: PrefillLedger,
        registry: CollectorRegistry,
        shutdown_timeout: float = 5.0,
    ) -> None:
        self.engine_url = engine_url
        self.admission = admission
        self.ledger = ledger
        self.registry = registry
        self.shutdown_timeout = shutdown_timeout
        self.port = 0
        self._session: aiohttp.ClientSession | None = None
        self._runner: web.AppRunner | None = None

    async def start(self, host: str, port: int) -> int:
        """Listen on ``host:port``; the bound port."""
        self._session = aiohttp.ClientSession(
            auto_decompress=False,
            timeout=aiohttp.ClientTimeout(total=None, connect=10, sock_connect=10),
            connector=aiohttp.TCPConnector(limit=0),
        )
        app = web.Application(client_max_size=64 * 1024 * 1024)
        app.router.add_route("*", "/{tail:.*}", self._handle)
        # A client disconnect cancels the handler, and so the upstream request.
        self._runner, self.port = await listen(app, host, port, self.shutdown_timeout)
        return self.port

    async def stop(self) -> None:
        if self._runner is not None:
            await self._runner.cleanup()
            self._runner = None
        if self._session is not None:
            await self._session.close()
            self._session = None

    async def _handle(self, request: web.Request) -> web.StreamResponse:
        body = await request.read()
        if request.method == "GET" and request.path == "/metrics":
            return await self._metrics(request)
        if request.method != "POST" or request.path not in INFERENCE_PATHS:
            return await self._forward(request, body, None)
        try:
            async with self.admission.slot():
                ticket = self.ledger.add(_prompt_tokens(body))
                try:
                    return await self._forward(request, body, ticket)
                finally:
                    self.ledger.release(ticket)
        except Overloaded:
            return rejection_response(self.admission)

    async def _forward(
        self, request: web.Request, body: bytes, ticket: PrefillTicket | None
    ) -> web.StreamResponse:
        assert self._session is not None
        url = join_url(self.engine_url, request.raw_path)
        headers = _forward_headers(request.headers, request.headers.get("connection"))
        try:
            upstream = await self._session.request(
                request.method,
                url,
                headers=headers,
                data=body or None,
                allow_redirects=False,
                skip_auto_headers=("User-Agent", "Accept-Encoding", "Accept", "Content-Type"),
            )
        except (aiohttp.ClientError, OSError) as exc:
            return json_error(502, f"Engine at {self.engine_url} unreachable: {exc}")
        async with upstream:
            response = web.StreamResponse(status=upstream.status, reason=upstream.reason)
            response.headers.extend(
                _forward_headers(upstream.headers, upstream.headers.get("connection"))
            )
            length = upstream.headers.get("content-length")
            if (
                length is not None
                and length.isdigit()
                and "transfer-encoding" not in upstream.headers
            ):
                response.content_length = int(length)
            watcher: FirstTokenWatcher | None = None
            if ticket is not None:
                if upstream.content_type == "text/event-stream":
                    watcher = FirstTokenWatcher()
                else:
                    self.ledger.release(ticket)  # headers of a full response: generation done
            await response.prepare(request)
            try:
                async for chunk in upstream.content.iter_any():
                    if watcher is not None and ticket is not None and watcher.feed(chunk):
                        self.ledger.release(ticket)
                        watcher = None
                    await response.write(chunk)
                await response.write_eof()
            except aiohttp.ClientError as exc:
                log.warning("engine cut %s %s: %s", request.method, request.path, exc)
                if request.transport is not None:
                    request.transport.close()  # the client sees the cut too
            except BaseException:  # client gone (handler cancelled): the engine aborts too
                upstream.close()
                raise
        return response

    async def _metrics(self, request: web.Request) -> web.StreamResponse:
        assert self._session is not None
        try:
            async with self._session.get(
                join_url(self.engine_url, request.raw_path),
                skip_auto_headers=("Accept-Encoding",),
            ) as upstream:
                text = await upstream.read()
                status, content_type = upstream.status, upstream.headers.get("content-type")
        except (aiohttp.ClientError, OSError) as exc:
            return json_error(502, f"Engine at {self.engine_url} unreachable: {exc}")
        if status == 200:
            own = generate_latest(self.registry)
            text = _without_families(text, _family_names(own)) + own
        headers = {"content-type": content_type} if content_type else {}
        return web.Response(status=status, body=text, headers=headers)


def _family_names(text: bytes) -> frozenset[bytes]:
    """Metric family names declared by ``# TYPE`` lines."""
    return frozenset(line.split()[2] for line in text.splitlines() if line.startswith(b"# TYPE "))


def _without_families(text: bytes, names: frozenset[bytes]) -> bytes:
    """The exposition text minus the families in ``names`` (the proxy's own replace them)."""
    kept = []
    for line in text.splitlines():
        if line.startswith((b"# HELP ", b"# TYPE ")):
            name = line.split(maxsplit=3)[2] if line.count(b" ") >= 2 else b""
        else:
            name = line.split(b"{", 1)[0].split(b" ", 1)[0]
        if name.removesuffix(b"_total") not in names and name not in names:
            kept.append(line)
    return b"\n".join(kept) + b"\n" if kept else b""


def _prompt_tokens(body: bytes) -> int:
    try:
        return parse_body(body).prompt_tokens
    except BadRequest:
        return 0  # the engine answers the bad request itself
