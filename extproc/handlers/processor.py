"""The ext_proc handler: one session per stream (HTTP request), thin over the decision core.

Flow for an inference request (POST /v1/chat/completions, /v1/completions,
/v1/embeddings, /v1/responses): request headers (continue) -> buffered request
body (parse, decide: route or local reply) -> response headers (turn a
worker-side rejection into the overload reply). The router's estimate for the
request is released when the stream ends, whatever ended it.

Sessions take and return serialized messages, so the same code runs behind the
builtin HTTP/2 server (``extproc.transport.h2server``) and behind grpcio's (``process``).
Replies that do not depend on the request are serialized once; the routing
reply is serialized once per worker endpoint.
"""

from __future__ import annotations

import logging
import time
from collections.abc import AsyncIterator, Awaitable, Callable, Mapping
from typing import Any

import grpc
from envoy.config.core.v3 import base_pb2
from envoy.extensions.filters.http.ext_proc.v3 import processing_mode_pb2
from envoy.service.ext_proc.v3 import external_processor_pb2 as ep
from envoy.type.v3 import http_status_pb2
from google.protobuf import duration_pb2, struct_pb2

from extproc.core.pool import Rank, Ticket, Worker, WorkerPool
from extproc.core.scheduling import Outcome, Scheduler
from extproc.handlers.output_tokens import sse_tokens, usage_tokens
from extproc.handlers.router_queue import RouterQueue
from extproc.metrics.registry import Metrics
from extproc.openai.errors import error_body
from extproc.openai.request import INFERENCE_PATHS, BadRequest, PromptTokenizer, parse_body

log = logging.getLogger("extproc.handlers.processor")

DESTINATION_HEADER = "x-gateway-destination-endpoint"
LB_NAMESPACE = "envoy.lb"
WORKER_OVERLOADED_HEADER = "x-worker-overloaded"
SERVICE_NAME = "envoy.service.ext_proc.v3.ExternalProcessor"
PROCESS_PATH = f"/{SERVICE_NAME}/Process"
# Other free workers listed after the pick, for Envoy to retry a worker-side rejection on.
MAX_FALLBACKS = 2
MAX_RETRIES_HEADER = "x-envoy-max-retries"
REQUEST_ID_HEADER = "x-request-id"
# gRPC initial metadata of the observability-mode filter (counts output tokens only).
ROLE_METADATA = "x-extproc-role"
_PM = processing_mode_pb2.ProcessingMode
# A reply now, or (first, rest): ``first`` now and the awaited ``rest`` after it.
Reply = bytes | tuple[bytes, Awaitable[bytes]]


def _serialize(msg: ep.ProcessingResponse) -> bytes:
    return msg.SerializeToString()


def _header(key: str, value: str | bytes) -> base_pb2.HeaderValue:
    raw = value if isinstance(value, bytes) else value.encode()
    return base_pb2.HeaderValue(key=key, raw_value=raw)


def immediate(
    status: int, body: bytes, headers: dict[str, str] | None = None, details: str = ""
) -> bytes:
    """A serialized local reply: status, JSON body, content-type and extra headers."""
    mutation = base_pb2.HeaderValueOption
    set_headers = [mutation(header=_header("content-type", "application/json"))]
    for k, v in (headers or {}).items():
        set_headers.append(mutation(header=_header(k, v)))
    return _serialize(
        ep.ProcessingResponse(
            immediate_response=ep.ImmediateResponse(
                status=http_status_pb2.HttpStatus(code=status),
                headers=ep.HeaderMutation(set_headers=set_headers),
                body=body,
                details=details,
            )
        )
    )


def routing_reply(endpoint: str, fallbacks: tuple[str, ...] = ()) -> bytes:
    """Continue upstream to ``endpoint``: envoy.lb metadata and the destination header.

    ``fallbacks`` follow the pick in the metadata (``a,b,c``): Envoy's override_host
    policy tries them in order when the route retries a worker-side rejection.
    ``x-envoy-max-retries`` caps the retries at the hosts listed, so a retry never
    falls through to the cluster's fallback policy (a worker of another model).
    """
    overwrite = base_pb2.HeaderValueOption.OVERWRITE_IF_EXISTS_OR_ADD
    meta = struct_pb2.Struct()
    meta.update({LB_NAMESPACE: {DESTINATION_HEADER: ",".join((endpoint, *fallbacks))}})
    return _serialize(
        ep.ProcessingResponse(
            request_body=ep.BodyResponse(
                response=ep.CommonResponse(
                    header_mutation=ep.HeaderMutation(
                        set_headers=[
                            base_pb2.HeaderValueOption(
                                header=_header(DESTINATION_HEADER, endpoint),
                                append_action=overwrite,
                            ),
                            base_pb2.HeaderValueOption(
                                header=_header(MAX_RETRIES_HEADER, str(len(fallbacks))),
                                append_action=overwrite,
                            ),
                        ]
                    )
                )
            ),
            dynamic_metadata=meta,
        )
    )


_CONTINUE_REQUEST_HEADERS = _serialize(ep.ProcessingResponse(request_headers=ep.HeadersResponse()))
_CONTINUE_REQUEST_BODY = _serialize(ep.ProcessingResponse(request_body=ep.BodyResponse()))
_CONTINUE_RESPONSE_HEADERS = _serialize(
    ep.ProcessingResponse(response_headers=ep.HeadersResponse())
)
_CONTINUE_RESPONSE_BODY = _serialize(ep.ProcessingResponse(response_body=ep.BodyResponse()))
_CONTINUE_REQUEST_TRAILERS = _serialize(
    ep.ProcessingResponse(request_trailers=ep.TrailersResponse())
)
_CONTINUE_RESPONSE_TRAILERS = _serialize(
    ep.ProcessingResponse(response_trailers=ep.TrailersResponse())
)
# Pass-through paths: drop a client-supplied destination header, stop processing.
_PASSTHROUGH = _serialize(
    ep.ProcessingResponse(
        request_headers=ep.HeadersResponse(
            response=ep.CommonResponse(
                header_mutation=ep.HeaderMutation(remove_headers=[DESTINATION_HEADER])
            )
        ),
        mode_override=_PM(
            request_body_mode=_PM.NONE,
            response_header_mode=_PM.SKIP,
            response_body_mode=_PM.NONE,
            request_trailer_mode=_PM.SKIP,
            response_trailer_mode=_PM.SKIP,
        ),
    )
)
_NO_WORKERS = immediate(503, error_body("Service temporarily unavailable", 503))
_MODEL_NOT_FOUND = immediate(404, error_body("Model not found", 404))
_INTERNAL_ERROR = immediate(
    500, error_body("Internal error in the load-shedding processor", 500), details="extproc_error"
)
_QUEUE = b"queue"  # sentinel: the request waits in the router queue
_CONTINUES = {
    "request_headers": _CONTINUE_REQUEST_HEADERS,
    "request_body": _CONTINUE_REQUEST_BODY,
    "response_headers": _CONTINUE_RESPONSE_HEADERS,
    "response_body": _CONTINUE_RESPONSE_BODY,
    "request_trailers": _CONTINUE_REQUEST_TRAILERS,
    "response_trailers": _CONTINUE_RESPONSE_TRAILERS,
}


def _header_value(h: Any) -> str:
    return h.raw_value.decode("latin-1") if h.raw_value else h.value


class _Stream:
    """Per-request state of one ext_proc stream."""

    __slots__ = (
        "endpoint_label",
        "model",
        "prompt_tokens",
        "request_id",
        "stream",
        "ticket",
        "worker",
    )

    def __init__(self) -> None:
        self.endpoint_label: str | None = None
        self.model = ""
        self.prompt_tokens = 0
        self.request_id: str | None = None
        self.stream = False
        self.ticket: Ticket | None = None
        self.worker: Worker | None = None


class ExtProcHandler:
    """Decides each request from the pool; never does I/O on the decision path."""

    def __init__(
        self,
        pool: WorkerPool,
        scheduler: Scheduler,
        metrics: Metrics,
        *,
        overload_status: int = 529,
        queue: RouterQueue | None = None,
        tokenizer: PromptTokenizer | None = None,
        clock: Callable[[], float] = time.perf_counter,
    ) -> None:
        self.pool = pool
        self.tokenizer = tokenizer
        self.queue = queue
        # While a request waits in the router queue Envoy must not time the message out.
        wait = int(queue.timeout) + 2 if queue is not None else 1
        self._extend_timeout = _serialize(
            ep.ProcessingResponse(override_message_timeout=duration_pb2.Duration(seconds=wait))
        )
        self.scheduler = scheduler
        self.metrics = metrics
        self.overload_status = overload_status
        self.clock = clock
        body = error_body("Service temporarily overloaded", overload_status)
        self._overloaded = {
            s: immediate(overload_status, body, {"retry-after": str(s)}) for s in range(1, 61)
        }
        self._models_reply: tuple[tuple[str, ...], bytes] | None = None
        self._routes: dict[tuple[str, ...], bytes] = {}
        # Routed requests by x-request-id, for the observability filter's streams.
        self._live: dict[str, _Stream] = {}
        # Set once an observability-mode stream arrives: output is counted from bodies.
        self._observed = False

    def open_session(self, metadata: Mapping[str, str]) -> _RequestSession | _ObserverSession:
        """A session for one ext_proc stream, from its gRPC metadata."""
        self.metrics.streams.inc()
        if metadata.get(ROLE_METADATA) == "observe":
            self._observed = True
            return _ObserverSession(self)
        return _RequestSession(self)

    def generic_handler(self) -> grpc.GenericRpcHandler:
        """The same sessions behind grpcio's asyncio server (``--grpc-server grpcio``)."""
        return grpc.method_handlers_generic_handler(
            SERVICE_NAME,
            {
                "Process": grpc.stream_stream_rpc_method_handler(
                    self.process,
                    request_deserializer=None,
                    response_serializer=None,
                )
            },
        )

    async def process(
        self, requests: AsyncIterator[bytes], context: grpc.aio.ServicerContext
    ) -> AsyncIterator[bytes]:
        session = self.open_session(dict(context.invocation_metadata() or ()))
        try:
            async for message in requests:
                reply = session.receive(message)
                if reply is None:
                    continue
                if isinstance(reply, tuple):
                    first, rest = reply
                    yield first
                    reply = await rest
                yield reply
        finally:
            session.close()

    def _on_message(self, st: _Stream, message: bytes) -> Reply:
        """One message of a routing stream: its reply (deferred while it waits in the queue)."""
        req = ep.ProcessingRequest.FromString(message)
        kind = req.WhichOneof("request")
        try:
            if kind == "request_body":
                reply = self._on_request_body(st, req.request_body)
                if reply is _QUEUE:
                    # Wait in the router: first tell Envoy to wait longer.
                    return (self._extend_timeout, self._wait_in_queue(st))
                return reply
            if kind == "request_headers":
                return self._on_request_headers(st, req.request_headers)
            if kind == "response_headers":
                return self._on_response_headers(st, req.response_headers)
            if kind == "response_body":
                return self._on_response_body(st, req.response_body)
            return _CONTINUES.get(kind or "", _CONTINUE_REQUEST_HEADERS)
        except Exception:
            log.exception("error handling ext_proc %s message", kind)
            if kind and kind.startswith("request"):
                return _INTERNAL_ERROR
            return _CONTINUES.get(kind or "", _CONTINUE_RESPONSE_HEADERS)

    def _on_stream_end(self, st: _Stream) -> None:
        if st.ticket is not None:
            self.pool.release(st.ticket)
        if st.request_id is not None:
            self._live.pop(st.request_id, None)

    # ----- request phase ---------------------------------------------------------------

    def _on_request_headers(self, st: _Stream, msg: ep.HttpHeaders) -> bytes:
        method = path = ""
        for h in msg.headers.headers:
            key = h.key
            if key == ":path":
                path = _header_value(h)
            elif key == ":method":
                method = _header_value(h)
            elif key == REQUEST_ID_HEADER:
                st.request_id = _header_value(h)
        path = path.split("?", 1)[0]
        label = INFERENCE_PATHS.get(path) if method == "POST" else None
        if label is None:
            if method in ("GET", "HEAD") and path == "/v1/models" and self.pool.by_model:
                self.metrics.outcome["passthrough"].inc()
                return self._models()
            self.metrics.outcome["passthrough"].inc()
            return _PASSTHROUGH
        st.endpoint_label = label
        if msg.end_of_stream:
            return self._bad_request("Request body is empty; expected a JSON object")
        return _CONTINUE_REQUEST_HEADERS

    def _on_request_body(self, st: _Stream, msg: ep.HttpBody) -> bytes:
        if st.endpoint_label is None:
            # Headers were not sent to us (per-route SKIP); nothing to decide on.
            return _CONTINUE_REQUEST_BODY
        started = self.clock()
        try:
            request = parse_body(msg.body, self.tokenizer)
        except BadRequest as exc:
            return self._bad_request(str(exc))
        st.model = model = request.model
        st.prompt_tokens = request.prompt_tokens
        st.stream = request.stream
        queue = self.queue
        if queue is not None and queue.waiting(model):
            outcome, worker, rank = Outcome.QUEUED, None, None  # FIFO: no overtaking
        else:
            outcome, worker, rank = self.scheduler.pick(model)
        if outcome is Outcome.QUEUED and queue is not None:
            self.metrics.decision_seconds.observe(self.clock() - started)
            return _QUEUE
        reply = self._reply(st, outcome, worker, rank)
        self.metrics.decision_seconds.observe(self.clock() - started)
        return reply

    async def _wait_in_queue(self, st: _Stream) -> bytes:
        assert self.queue is not None
        started = self.clock()
        result = await self.queue.wait(st.model, lambda: self._attempt(st.model))
        self.metrics.queue_wait.observe(self.clock() - started)
        if result is None:
            self.metrics.rejections.labels(st.model, st.endpoint_label or "").inc()
            self.metrics.outcome["queue_timeout"].inc()
            return self._overloaded[self.pool.retry_after(st.model)]
        return self._reply(st, *result)

    def _attempt(self, model: str) -> tuple[Outcome, Worker | None, Rank | None] | None:
        picked = self.scheduler.pick(model)
        return None if picked[0] is Outcome.QUEUED else picked

    def _reply(
        self, st: _Stream, outcome: Outcome, worker: Worker | None, rank: Rank | None
    ) -> bytes:
        model = st.model
        m = self.metrics
        if outcome is Outcome.ROUTED:
            assert worker is not None and rank is not None
            st.ticket = self.pool.dispatch(worker, rank, st.prompt_tokens)
            if st.request_id is not None:
                self._live[st.request_id] = st
            st.worker = worker
            key = (worker.endpoint, *self.scheduler.fallbacks(model, worker, MAX_FALLBACKS))
            reply = self._routes.get(key)
            if reply is None:
                if len(self._routes) > 4096:
                    self._routes.clear()
                reply = self._routes[key] = routing_reply(key[0], key[1:])
        elif outcome is Outcome.OVERLOADED:
            m.rejections.labels(model, st.endpoint_label).inc()
            reply = self._overloaded[self.pool.retry_after(model)]
        elif outcome is Outcome.NO_WORKERS:
            reply = _NO_WORKERS
        else:
            reply = _MODEL_NOT_FOUND
        m.outcome[outcome.value].inc()
        return reply

    def _bad_request(self, message: str) -> bytes:
        self.metrics.outcome["bad_request"].inc()
        return immediate(400, error_body(message, 400))

    def _models(self) -> bytes:
        models = tuple(self.pool.models())
        cached = self._models_reply
        if cached is None or cached[0] != models:
            import json

            body = json.dumps(
                {
                    "object": "list",
                    "data": [{"id": m, "object": "model", "owned_by": "extproc"} for m in models],
                },
                separators=(",", ":"),
            ).encode()
            cached = self._models_reply = (models, immediate(200, body))
        return cached[1]

    # ----- response phase ---------------------------------------------------------------

    def _on_response_headers(self, st: _Stream, msg: ep.HttpHeaders) -> bytes:
        worker = st.worker
        if worker is None:
            return _CONTINUE_RESPONSE_HEADERS
        status = 0
        flagged = False
        for h in msg.headers.headers:
            key = h.key
            if key == ":status":
                status = int(_header_value(h) or 0)
            elif key == WORKER_OVERLOADED_HEADER:
                flagged = _header_value(h).strip() == "1"
        if (flagged and not 200 <= status < 300) or status == 529:
            self.pool.mark_overloaded(worker)
            self.metrics.rejections.labels(st.model, st.endpoint_label or "").inc()
            if st.ticket is not None:
                self.pool.release(st.ticket)
            return self._overloaded[1]
        ticket = st.ticket
        if ticket is not None:
            if msg.end_of_stream:
                self.pool.release(ticket)
            elif st.stream and not self._observed and 200 <= status < 300:
                # No body observation: the stream has started, so prefill is over.
                self.pool.prefill_done(ticket)
        return _CONTINUE_RESPONSE_HEADERS

    def _on_response_body(self, st: _Stream, msg: ep.HttpBody) -> bytes:
        ticket = st.ticket
        if ticket is not None:
            self._count_output(st, msg.body)
            if msg.end_of_stream:
                self.pool.release(ticket)
        return _CONTINUE_RESPONSE_BODY

    def _count_output(self, st: _Stream, body: bytes) -> None:
        ticket = st.ticket
        if ticket is None or ticket.released:
            return
        if st.stream:
            tokens = sse_tokens(body)
        else:
            usage = usage_tokens(body)
            tokens = 0 if usage is None else usage - ticket.generated
        if tokens > 0:
            self.pool.generated(ticket, tokens)

    def _on_observed(self, obs: _ObserverSession, message: bytes) -> None:
        """A message of the observability-mode filter: count output, reply nothing.

        Its stream is paired with the request's routing stream by ``x-request-id``.
        """
        try:
            req = ep.ProcessingRequest.FromString(message)
            kind = req.WhichOneof("request")
            if kind == "response_body":
                if obs.stream is not None:
                    self._count_output(obs.stream, req.response_body.body)
            elif kind == "request_headers":
                for h in req.request_headers.headers.headers:
                    if h.key == REQUEST_ID_HEADER:
                        obs.stream = self._live.get(_header_value(h))
                        break
        except Exception:  # an observer must never break the stream
            log.exception("error counting output tokens; ignored")


class _RequestSession:
    """The routing stream of one HTTP request."""

    __slots__ = ("closed", "handler", "st")

    def __init__(self, handler: ExtProcHandler) -> None:
        self.handler = handler
        self.st = _Stream()
        self.closed = False

    def receive(self, message: bytes) -> Reply:
        return self.handler._on_message(self.st, message)

    def close(self) -> None:
        if not self.closed:
            self.closed = True
            self.handler._on_stream_end(self.st)
            self.handler.metrics.streams.dec()


class _ObserverSession:
    """A stream of the observability-mode filter (it never gets a reply)."""

    __slots__ = ("closed", "handler", "stream")

    def __init__(self, handler: ExtProcHandler) -> None:
        self.handler = handler
        self.stream: _Stream | None = None
        self.closed = False

    def receive(self, message: bytes) -> None:
        self.handler._on_observed(self, message)

    def close(self) -> None:
        self.stream = None
        if not self.closed:
            self.closed = True
            self.handler.metrics.streams.dec()
