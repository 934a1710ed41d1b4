"""The ext_proc handler: one session per stream (HTTP request), thin over the decision core.

Flow for an inference request (POST /v1/chat/completions, /v1/completions,
/v1/embeddings, /v1/responses), docs/request-path.md: request headers carrying the
model read from the start of the body (``extproc.request`` metadata) -> one
:meth:`~extproc.core.scheduling.Scheduler.decide` call, mapped to a pre-serialized
reply; without it, the same call before the model is known (``model=None``) answers on
the headers when the answer cannot depend on the model, else the headers ask for the
buffered body (parse, decide). Then the response headers (turn a worker-side rejection
into the overload reply; move the estimate to the host that served the response when an
Envoy retry moved it off the pick; ask for the trailers so the stream lasts as long as the
response). Response-body chunks count generated tokens, from this stream when its filter
streams the body or from the observer filter's stream, whichever delivers a chunk of the
request first. For a model with a latency target the same points time the request: its
time to first token and mean inter-token gap feed the worker's latency controller. The
router's estimate for the request is released when the stream ends, whatever ended it.

Sessions take and return serialized messages, so any gRPC server can drive them
(``extproc.transport``): ``receive`` answers with reply bytes, a list of them (a
full-duplex body decided: the headers' reply, then the body sent on), ``None`` (no reply),
or ``(first, rest)`` when the answer waits in the router queue: ``first`` now, the
awaited ``rest`` after it.

A filter in FULL_DUPLEX_STREAMED mode (what Kubernetes gateways configure) sends the body
in chunks without waiting for the headers' reply: the chunks are gathered, the decision is
made on the whole body, and the headers are answered then; every body chunk, both ways, is
sent back unchanged as the mode requires.
"""

from __future__ import annotations

import functools
import logging
import time
from collections.abc import Awaitable, Callable, Collection, Mapping
from typing import Any

from envoy.extensions.filters.http.ext_proc.v3 import processing_mode_pb2
from envoy.service.ext_proc.v3 import external_processor_pb2 as ep

from extproc.core.classes import ClassRegistry, ClassTable, RequestClass
from extproc.core.latency import LatencyControl
from extproc.core.pool import WorkerPool
from extproc.core.scheduling import (
    Decision,
    Deferred,
    Outcome,
    Queued,
    Rejected,
    Routed,
    Scheduler,
)
from extproc.core.worker import Ticket
from extproc.handlers import replies
from extproc.handlers.body_budget import DEFAULT_BUDGET_MIB, MIB, BodyBudget
from extproc.handlers.output_tokens import sse_tokens, usage_tokens
from extproc.handlers.router_queue import RouterQueue
from extproc.handlers.subset_hint import SubsetHints
from extproc.metrics.registry import UNOBSERVED_OUTPUT_FIX, Metrics
from extproc.openai.request import INFERENCE_PATHS, BadRequest, PromptTokenizer, parse_body

log = logging.getLogger("extproc.handlers")

SERVICE_NAME = "envoy.service.ext_proc.v3.ExternalProcessor"
PROCESS_PATH = f"/{SERVICE_NAME}/Process"
WORKER_OVERLOADED_HEADER = "x-worker-overloaded"
# Set by the shipped Envoy configs' local_reply_config on Envoy's own reply to an upstream
# connection failure (response flags UF, UH, UC): the worker was never reached.
UPSTREAM_FAILURE_HEADER = "x-upstream-failure"
REQUEST_ID_HEADER = "x-request-id"
# Set by the shipped Envoy configs' inference routes on every upstream response to the
# host that served it (%UPSTREAM_HOST%, overwriting a worker's own), and removed before the
# client sees it.
SERVED_HEADER = "x-gateway-destination-endpoint-served"
# gRPC initial metadata of the observability-mode filter (counts output tokens only).
ROLE_METADATA = "x-extproc-role"
# The dynamic metadata namespace Envoy forwards with the request headers: ``model``, read
# from the start of the body by a filter ahead of ext_proc (envoy/envoy.yaml).
REQUEST_NAMESPACE = "extproc.request"
# Whose response-body chunks count a request's generated tokens: the first stream that
# delivers one (the routing stream, when its filter streams the response body, or the
# observer's); the other stream's chunks of that request are not counted again.
ROUTING_STREAM = 1
OBSERVER_STREAM = 2
_STREAMED = processing_mode_pb2.ProcessingMode.STREAMED
_NO_BODY = processing_mode_pb2.ProcessingMode.NONE
_FULL_DUPLEX = processing_mode_pb2.ProcessingMode.FULL_DUPLEX_STREAMED
# The largest request body gathered from a FULL_DUPLEX_STREAMED filter before deciding
# (a BUFFERED filter has Envoy's own per_connection_buffer_limit_bytes); every stream's
# gathered bytes also come out of one process-wide budget (BodyBudget).
MAX_DUPLEX_BODY = 32 * 1024 * 1024
# The reason header of the overload reply to a body refused for want of budget.
BODY_BUDGET_REASON = "body_budget"
# A reply now (one message, or several in order), or (first, rest): ``first`` now and the
# awaited ``rest`` after it.
Replies = bytes | list[bytes]
Reply = Replies | tuple[bytes, Awaitable[Replies]]


def _header_value(h: Any) -> str:
    return h.raw_value.decode("latin-1") if h.raw_value else h.value


class _Stream:
    """Per-request state of one ext_proc stream."""

    __slots__ = (
        "body_streamed",
        "duplex_body",
        "duplex_request",
        "duplex_response",
        "endpoint_label",
        "fallbacks",
        "first_token_at",
        "first_tokens",
        "last_token_at",
        "model",
        "observed",
        "output_source",
        "phase",
        "prompt_tokens",
        "request_class",
        "request_id",
        "stream",
        "streaming",
        "subset",
        "ticket",
        "timed",
        "variant",
    )

    def __init__(self) -> None:
        # The routing filter streams the response body (its protocol_config says so).
        self.body_streamed = False
        # The filter runs a body in FULL_DUPLEX_STREAMED mode (Kubernetes gateways): the
        # body comes in chunks whatever the replies, and each chunk is sent back.
        self.duplex_request = False
        self.duplex_response = False
        # The request body gathered so far, while the decision waits for all of it.
        self.duplex_body: bytearray | None = None
        # An observer stream that receives the response body is paired with this one.
        self.observed = False
        # ROUTING_STREAM or OBSERVER_STREAM once a response-body chunk arrived, else 0.
        self.output_source = 0
        # A streamed 2xx response began (it was not over at its headers).
        self.streaming = False
        # The request's class (None without classes) and the variant of the pool's
        # shares it is decided under (the class, or its large-prompt share).
        self.request_class: RequestClass | None = None
        self.endpoint_label: str | None = None
        self.fallbacks: tuple[str, ...] = ()  # endpoints Envoy retries a refusal on
        self.model = ""
        self.phase = "request_body"
        self.prompt_tokens = 0
        self.request_id: str | None = None
        self.stream = False
        # The gateway's endpoint subset (Endpoint Picker protocol): None = not given.
        self.subset: tuple[str, ...] | None = None
        self.ticket: Ticket | None = None
        self.variant = 0
        # The model has a latency target: the response is timed (pool clock).
        self.timed = False
        self.first_token_at = 0.0
        self.first_tokens = 0
        self.last_token_at = 0.0


class ExtProcHandler:
    """Decides each request from the pool; never does I/O on the decision path."""

    def __init__(
        self,
        pool: WorkerPool,
        scheduler: Scheduler,
        metrics: Metrics,
        *,
        overload_status: int = 529,
        worker_busy_statuses: Collection[int] = (429, 503),
        queue: RouterQueue | None = None,
        tokenizer: PromptTokenizer | None = None,
        classes: ClassRegistry | None = None,
        protocol: str = "envoy",
        latency: LatencyControl | None = None,
        clock: Callable[[], float] = time.perf_counter,
        body_budget: BodyBudget | None = None,
    ) -> None:
        self.pool = pool
        # Bytes of full-duplex request bodies gathered before their decision, all streams.
        self.body_budget = body_budget or BodyBudget(DEFAULT_BUDGET_MIB * MIB)
        metrics.buffered_body_bytes.set_function(lambda: self.body_budget.used)
        self.latency = latency
        self.scheduler = scheduler
        self.metrics = metrics
        self.tokenizer = tokenizer
        self.queue = queue
        self.clock = clock
        self.replies = replies.Replies(
            overload_status, tuple(sorted(worker_busy_statuses)), protocol
        )
        # ``epp``: the Endpoint Picker protocol, whose requests may carry a subset hint.
        self.subset_hints = SubsetHints() if protocol == "epp" else None
        self._busy_statuses = frozenset(worker_busy_statuses)
        # While a request waits in the router queue Envoy must not time the message out.
        self._extend_timeout = replies.extend_timeout(
            int(queue.timeout) + 2 if queue is not None else 1
        )
        # Routed requests by x-request-id, for the observability filter's streams.
        self._live: dict[str, _Stream] = {}
        # Set once an observability-mode stream arrives: output is counted from bodies.
        self._observed = False
        # Logged once: streamed responses end while no stream delivers their body.
        self._unobserved_warned = False
        # Request classes (docs/classes.md): the table in force, None without classes.
        self._classes: ClassTable | None = None
        if classes is not None:
            self._on_classes(classes.table)
            classes.listeners.append(self._on_classes)

    def _on_classes(self, table: ClassTable) -> None:
        self._classes = table if table.enabled else None

    def open_session(self, metadata: Mapping[str, str]) -> RequestSession | ObserverSession:
        """A session for one ext_proc stream, from its gRPC metadata."""
        self.metrics.streams.inc()
        if metadata.get(ROLE_METADATA) == "observe":
            self._observed = True
            return ObserverSession(self)
        return RequestSession(self)

    def _on_message(self, st: _Stream, message: bytes) -> Reply | None:
        """One message of a routing stream: its reply (deferred while it waits in the
        queue; none while a full-duplex body is gathered)."""
        req = ep.ProcessingRequest.FromString(message)
        kind = req.WhichOneof("request")
        try:
            if kind == "request_body":
                if st.duplex_request:
                    return self._on_duplex_request_body(st, req.request_body)
                return self._on_request_body(st, req.request_body)
            if kind == "request_headers":
                if req.HasField("protocol_config"):  # the first message of the stream
                    config = req.protocol_config
                    st.body_streamed = config.response_body_mode == _STREAMED
                    st.duplex_request = config.request_body_mode == _FULL_DUPLEX
                    st.duplex_response = config.response_body_mode == _FULL_DUPLEX
                if st.duplex_request:
                    return self._on_duplex_request_headers(st, req)
                return self._on_request_headers(st, req)
            if kind == "response_headers":
                return self._on_response_headers(st, req.response_headers)
            if kind == "response_body":
                return self._on_response_body(st, req.response_body)
            if kind == "request_trailers" and st.duplex_body is not None:
                return self._duplex_decide(st, [replies.CONTINUES["request_trailers"]])
            if kind == "response_trailers" and st.ticket is not None:
                self.pool.release(st.ticket)  # the response is over
            return replies.CONTINUES.get(kind or "", replies.CONTINUE_REQUEST_HEADERS)
        except Exception:
            log.exception("error handling ext_proc %s message", kind)
            if kind and kind.startswith("request"):
                return replies.INTERNAL_ERROR
            if kind == "response_body" and st.duplex_response:  # the chunk must go on
                body = req.response_body
                return replies.streamed_body(kind, body.body, body.end_of_stream)
            return replies.CONTINUES.get(kind or "", replies.CONTINUE_RESPONSE_HEADERS)

    def _on_stream_end(self, st: _Stream) -> None:
        self.body_budget.release(st)  # a body still being gathered (the client went away)
        if st.ticket is not None:
            if st.streaming and not (
                st.output_source or st.observed or st.body_streamed or st.duplex_response
            ):
                self._output_unobserved()
            self.pool.release(st.ticket)
            if st.last_token_at and self.latency is not None:
                self._time_itl(st, st.ticket)
        if st.request_id is not None:
            self._live.pop(st.request_id, None)

    # ----- request phase ---------------------------------------------------------------

    def _on_request_headers(self, st: _Stream, req: ep.ProcessingRequest) -> Reply:
        if st.ticket is not None:  # headers again after routing: one decision per stream
            return replies.CONTINUE_REQUEST_HEADERS
        msg = req.request_headers
        method = path = length = ""
        table = self._classes
        class_header, marker_header = (
            ("", "") if table is None else (table.header, table.marker_header)
        )
        class_name = marker = None
        for h in msg.headers.headers:
            key = h.key
            if key == ":path":
                path = _header_value(h)
            elif key == ":method":
                method = _header_value(h)
            elif key == REQUEST_ID_HEADER:
                st.request_id = _header_value(h)
            elif key == "content-length":
                length = _header_value(h)
            elif key == class_header:
                class_name = _header_value(h).strip()
            elif key == marker_header:
                marker = _header_value(h)
        path = path.split("?", 1)[0]
        label = INFERENCE_PATHS.get(path) if method == "POST" else None
        if label is None:
            self.metrics.outcome["passthrough"].inc()
            if method in ("GET", "HEAD") and path == "/v1/models" and self.pool.by_model:
                return self.replies.models(tuple(self.pool.models()))
            return replies.PASSTHROUGH
        st.endpoint_label = label
        if table is not None:
            if not table.trusts(marker):
                class_name = None  # the marker is required and absent: the header is ignored
            st.request_class, unknown = table.resolve(class_name)
            st.variant = table.variant(st.request_class, 0)
            if unknown:
                self.metrics.class_unknown.inc()
        if msg.end_of_stream:
            return self._bad_request("Request body is empty; expected a JSON object")
        meta = req.metadata_context.filter_metadata
        hints = self.subset_hints
        if hints is not None:
            malformed = hints.malformed
            st.subset = hints.read(meta)
            if hints.malformed != malformed:
                self.metrics.subset_hint_malformed.inc()
        if REQUEST_NAMESPACE in meta:
            # The prefix reader ran: "model" is what it read ("" when the body does not
            # start with it; then the body decides, so a malformed one is still a 400).
            model = meta[REQUEST_NAMESPACE].fields.get("model")
            name = model.string_value if model is not None else ""
            if name and length.isdigit() and self.tokenizer is None:
                # Decide now, the body stays in Envoy; prompt tokens are estimated from
                # the body size.
                tokens = -(-int(length) // 4)
                return self._decide(st, name, tokens, "request_headers", self.clock())
        else:
            # No prefix reader (a config in the exact mode): answer now when the reply
            # cannot depend on the body.
            early = self._decide_before_the_model(st)
            if early is not None:
                return early
        # The exact mode: Envoy buffers the body and sends it (the model is not known
        # yet, or a tokenizer counts the prompt).
        return replies.SEND_BODY_STREAMED if st.body_streamed else replies.SEND_BODY

    # ----- FULL_DUPLEX_STREAMED request bodies (Kubernetes gateways' default) ----------

    def _on_duplex_request_headers(self, st: _Stream, req: ep.ProcessingRequest) -> Reply | None:
        """The headers of a request whose body streams in full duplex: when the body
        decides, the headers are answered once it is all in (nothing now); else as usual."""
        reply = self._on_request_headers(st, req)
        if reply is replies.SEND_BODY or reply is replies.SEND_BODY_STREAMED:
            # A declared length is taken from the body budget now: refused before the
            # client sends the body, or sure of its room.
            for h in req.request_headers.headers.headers:
                if h.key == "content-length":
                    length = _header_value(h).strip()
                    if length.isascii() and length.isdigit():
                        refused = self._take_body(st, int(length))
                        if refused is not None:
                            return refused
                    break
            st.duplex_body = bytearray()
            return None
        if reply is replies.PASSTHROUGH:
            return replies.PASSTHROUGH_DUPLEX  # no mode override in this mode
        return reply

    def _on_duplex_request_body(self, st: _Stream, msg: ep.HttpBody) -> Reply | None:
        """A chunk of a full-duplex request body: gathered until the last one, then the
        decision; once the headers are answered, sent on as it came."""
        gathered = st.duplex_body
        if gathered is None:
            return replies.streamed_body("request_body", msg.body, msg.end_of_stream)
        refused = self._take_body(st, len(gathered) + len(msg.body))
        if refused is not None:
            st.duplex_body = None
            return refused
        gathered += msg.body
        if not msg.end_of_stream:
            return None
        return self._duplex_decide(st)

    def _take_body(self, st: _Stream, size: int) -> bytes | None:
        """Hold ``size`` bytes of the stream's body in the body budget: None once held;
        else the stream's bytes are released and the local reply is returned, 400 for a
        body larger than any may be, the overload reply while the bodies being gathered
        hold the budget."""
        budget = self.body_budget
        largest = min(MAX_DUPLEX_BODY, budget.largest)
        if size > largest:
            budget.release(st)
            self.metrics.body_rejected["too_large"].inc()
            return self._bad_request(
                f"Request body is larger than {largest} bytes; expected at most that"
            )
        if budget.take(st, size - budget.held(st)):
            return None
        budget.release(st)
        self.metrics.body_rejected["budget"].inc()
        return self.replies.overload(1, BODY_BUDGET_REASON, st.request_class)

    def _duplex_decide(self, st: _Stream, after: list[bytes] | None = None) -> Reply:
        """Decide on the gathered body. Routed: the headers reply (the destination), then
        the body sent on, then ``after`` (the trailers' reply when trailers ended the
        body); anything else is the one local reply."""
        assert st.duplex_body is not None
        body = bytes(st.duplex_body)
        st.duplex_body = None
        reply = self._on_request_body(st, ep.HttpBody(body=body, end_of_stream=True))
        forward = [replies.streamed_body("request_body", body, after is None), *(after or ())]
        budget = self.body_budget
        if isinstance(reply, tuple):
            first, rest = reply

            async def forwarded() -> Replies:
                try:  # the body waits in the queue: held in the budget until it goes on
                    return await self._then_forward(st, rest, forward)
                finally:
                    budget.release(st)

            return first, forwarded()
        budget.release(st)
        return self._with_forward(st, reply, forward)

    def _with_forward(self, st: _Stream, reply: Replies, forward: list[bytes]) -> Replies:
        if st.ticket is None or not isinstance(reply, bytes):
            return reply
        return [reply, *forward]

    async def _then_forward(
        self, st: _Stream, rest: Awaitable[Replies], forward: list[bytes]
    ) -> Replies:
        return self._with_forward(st, await rest, forward)

    def _decide_before_the_model(self, st: _Stream) -> bytes | None:
        """The reply when it cannot depend on the body, before Envoy sends the body; None
        when the body decides.

        No worker at all (503), or every worker of every model busy or overloaded (the
        overload reply, counted under the pool's only model or ``*``): whichever model the
        body names, the answer is the same, so it is given on the request-headers message.
        The body is never read, so a malformed one gets the overload reply rather than 400
        (docs/request-path.md). While requests wait in the router queue the body decides:
        FIFO keeps their order.
        """
        queue = self.queue
        waiting = queue is not None and any(queue.waiting(m) for m in self.pool.by_model)
        decision = self.scheduler.decide(None, 0, st.variant, waiting=waiting, subset=st.subset)
        if isinstance(decision, Deferred):
            return None
        st.model = decision.model  # one decision per stream: a later body is not decided
        return self._reply(st, decision)

    def _on_request_body(self, st: _Stream, msg: ep.HttpBody) -> Reply:
        if st.endpoint_label is None or st.ticket is not None or st.model:
            # Headers were not sent to us (per-route SKIP): nothing to decide on; or the
            # request was decided already (on its headers, with a config that sends the
            # body all the same, or routed): one decision (and one estimate) per stream.
            return replies.CONTINUE_REQUEST_BODY
        started = self.clock()
        try:
            request = parse_body(msg.body, self.tokenizer)
        except BadRequest as exc:
            return self._bad_request(str(exc))
        st.stream = request.stream
        return self._decide(st, request.model, request.prompt_tokens, "request_body", started)

    def _decide(
        self, st: _Stream, model: str, prompt_tokens: int, phase: str, started: float
    ) -> Reply:
        """Decide the request of ``model``, answering the message of ``phase``."""
        st.model = model
        st.prompt_tokens = prompt_tokens
        st.phase = phase
        if st.request_class is not None and self._classes is not None:
            st.variant = self._classes.variant(st.request_class, prompt_tokens)
        queue = self.queue
        waiting = queue is not None and queue.waiting(model)
        decision = self.scheduler.decide(
            model, prompt_tokens, st.variant, waiting=waiting, subset=st.subset
        )
        reply: Reply
        if type(decision) is Queued and queue is not None:
            reply = (self._extend_timeout, self._wait_in_queue(st))
        else:
            reply = self._reply(st, decision)
        self.metrics.decision_seconds.observe(self.clock() - started)
        return reply

    async def _wait_in_queue(self, st: _Stream) -> bytes:
        assert self.queue is not None
        started = self.clock()
        decision: Routed | Rejected | None = await self.queue.wait(
            st.model, functools.partial(self._attempt, st)
        )
        self.metrics.queue_wait.observe(self.clock() - started)
        if decision is None:
            self.metrics.rejections.labels(st.model, st.endpoint_label or "").inc()
            self.metrics.outcome["queue_timeout"].inc()
            self._count_class(st, st.model, "overloaded")
            retry_after = self.pool.retry_after(st.model)
            return self.replies.overload(retry_after, "queue_timeout", st.request_class)
        return self._reply(st, decision)

    def _attempt(self, st: _Stream) -> Routed | Rejected | None:
        """The head of the queue decides again (it is the one waiting: no FIFO check)."""
        decision = self.scheduler.decide(st.model, st.prompt_tokens, st.variant, subset=st.subset)
        return None if isinstance(decision, Queued) else decision

    def _reply(self, st: _Stream, decision: Decision) -> bytes:
        """Map a decision to its pre-serialized reply and count it."""
        self.metrics.outcome[decision.outcome.value].inc()
        if type(decision) is Routed:
            st.ticket = decision.ticket
            st.fallbacks = decision.fallbacks
            if self.latency is not None:
                st.timed = self.latency.timed(st.model, self._class_name(st))
                if st.timed and st.stream:  # a first token to wait for: overdue counts
                    self.latency.dispatched(decision.ticket, self._class_name(st))
            if st.request_id is not None:
                self._live[st.request_id] = st
            self._count_class(st, st.model, "routed")
            # A full-duplex body is decided before the headers are answered: the headers
            # reply carries the destination.
            phase = "request_headers" if st.duplex_request else st.phase
            return self.replies.route(decision.address, decision.fallbacks, phase)
        assert type(decision) is Rejected
        if decision.outcome is Outcome.OVERLOADED:
            self.metrics.rejections.labels(st.model, st.endpoint_label).inc()
            self._count_class(st, st.model, "overloaded")
        return self.replies.rejected(decision, st.request_class)

    def _count_class(self, st: _Stream, model: str, outcome: str) -> None:
        """Requests by class and outcome, when request classes are configured."""
        request_class = st.request_class
        if request_class is not None:
            name = request_class.name
            self.metrics.by_class.labels(model, st.endpoint_label, name, outcome).inc()

    def _bad_request(self, message: str) -> bytes:
        self.metrics.outcome["bad_request"].inc()
        return replies.bad_request(message)

    # ----- response phase ---------------------------------------------------------------

    def _on_response_headers(self, st: _Stream, msg: ep.HttpHeaders) -> bytes:
        ticket = st.ticket
        if ticket is None:
            return replies.CONTINUE_RESPONSE_HEADERS
        status = 0
        flagged = unreachable = False
        served = ""
        for h in msg.headers.headers:
            key = h.key
            if key == ":status":
                value = _header_value(h)
                # Envoy sends three digits; anything else is no status, not an error.
                status = int(value) if value.isascii() and value.isdigit() else 0
            elif key == WORKER_OVERLOADED_HEADER:
                flagged = _header_value(h).strip() == "1"
            elif key == UPSTREAM_FAILURE_HEADER:
                unreachable = True
            elif key == SERVED_HEADER:
                served = _header_value(h)
            elif key == "content-type" and _header_value(h).startswith("text/event-stream"):
                st.stream = True  # decided on the headers: the body's "stream" was not read
        if not 200 <= status < 300:
            if unreachable and status >= 500:
                return self._worker_unreachable(st, ticket)
            if flagged or status == 529 or status in self._busy_statuses:
                return self._worker_rejected(st, ticket)
        if served and served != ticket.worker.endpoint:
            self._served_elsewhere(st, ticket, served)
        if msg.end_of_stream:
            self.pool.release(ticket)
        elif st.stream and 200 <= status < 300:
            self._output_begins(st, ticket)
        if st.phase == "request_headers" and not msg.end_of_stream:
            if st.body_streamed:
                return replies.CONTINUE_RESPONSE_HEADERS_HOLD_STREAMED
            return replies.CONTINUE_RESPONSE_HEADERS_HOLD
        return replies.CONTINUE_RESPONSE_HEADERS

    def _served_elsewhere(self, st: _Stream, ticket: Ticket, endpoint: str) -> None:
        """An Envoy retry moved the request off its pick (refused, reset, or a busy status):
        its estimate follows it to the worker at ``endpoint``, or is released when that is
        not a known worker of the model. Envoy tries the pick, then the listed fallbacks in
        order, so the pick and every fallback listed before ``endpoint`` refused it: each is
        skipped until its next load report or 1 s, as after a worker-side rejection."""
        pool = self.pool
        model = ticket.worker.model
        refused = [ticket.worker]
        by_endpoint = pool.by_endpoint
        if endpoint in st.fallbacks:
            for fallback in st.fallbacks[: st.fallbacks.index(endpoint)]:
                worker = by_endpoint.get((fallback, model))
                if worker is not None:
                    refused.append(worker)
        served = by_endpoint.get((endpoint, model))
        pool.move(ticket, served)
        for worker in refused:
            pool.mark_overloaded(worker)
        self.metrics.served_elsewhere.labels(model, "unknown" if served is None else "worker").inc()

    def _worker_unreachable(self, st: _Stream, ticket: Ticket) -> bytes:
        """Envoy's own 503 for a routed request (the worker refused or reset the connection
        and no listed fallback took it): skip the worker for a while and answer the overload
        reply, as when it is busy; the request never reached an engine."""
        worker = ticket.worker
        self.pool.mark_unreachable(worker)
        self.pool.release(ticket)
        self.metrics.worker_unreachable.labels(st.model).inc()
        self.metrics.rejections.labels(st.model, st.endpoint_label or "").inc()
        log.warning(
            "worker %s (%s) unreachable from Envoy: skipped for 1 s", worker.worker_id,
            worker.endpoint,
        )  # fmt: skip
        retry_after = self.pool.retry_after(st.model)
        return self.replies.overload(retry_after, "worker_unreachable", st.request_class)

    def _worker_rejected(self, st: _Stream, ticket: Ticket) -> bytes:
        """A worker-side rejection that Envoy's retries did not absorb: the pick and every
        fallback Envoy retried it on refused, so each is skipped until its next load report
        or 1 s; counted and answered as our own overload reply."""
        self.pool.mark_overloaded(ticket.worker)
        by_endpoint = self.pool.by_endpoint
        for endpoint in st.fallbacks:
            worker = by_endpoint.get((endpoint, st.model))
            if worker is not None:
                self.pool.mark_overloaded(worker)
        self.pool.release(ticket)
        self.metrics.rejections.labels(st.model, st.endpoint_label or "").inc()
        return self.replies.overload(1, "worker_overloaded", st.request_class)

    # ----- generated tokens -------------------------------------------------------------

    def _output_begins(self, st: _Stream, ticket: Ticket) -> None:
        """A streamed 2xx response began. Without a stream that delivers its body, prefill
        is over now; with one, at the first generated token."""
        st.streaming = True
        if st.timed and self.latency is not None:
            # Decided on the headers, the request's "stream" was not read; its response
            # says it now (vLLM, SGLang and the simulated engine answer at once).
            self.latency.dispatched(ticket, self._class_name(st))
        if not (self._observed or st.body_streamed or st.duplex_response):
            if st.timed and ticket.in_prefill:
                self._time_first_token(st, ticket, 0)
            self.pool.prefill_done(ticket)

    def _output_unobserved(self) -> None:
        """A streamed 2xx response ended and no stream delivered its body: with
        --router-track-output-blocks its generated tokens went uncounted."""
        if not self.pool.track_output_blocks:
            return
        self.metrics.output_unobserved.inc()
        self.metrics.output_unobserved_at = time.monotonic()
        if not self._unobserved_warned:
            self._unobserved_warned = True
            log.warning(
                "--router-track-output-blocks is on, but a streamed response ended and no "
                "ext_proc stream received its body: generated tokens are not counted, so long "
                "generations never turn a worker busy. Fix: %s. Counted in "
                "extproc_output_unobserved_responses_total; not logged again.",
                UNOBSERVED_OUTPUT_FIX,
            )

    def _on_response_body(self, st: _Stream, msg: ep.HttpBody) -> bytes:
        ticket = st.ticket
        if ticket is not None:
            self._count_output(st, msg.body, ROUTING_STREAM)
            if msg.end_of_stream:
                self.pool.release(ticket)
        if st.duplex_response:
            return replies.streamed_body("response_body", msg.body, msg.end_of_stream)
        return replies.CONTINUE_RESPONSE_BODY

    def _count_output(self, st: _Stream, body: bytes, source: int) -> None:
        """Count the generated tokens in a response-body chunk from ``source``; the first
        stream to deliver a chunk of a request counts all of its output."""
        ticket = st.ticket
        if ticket is None or ticket.released:
            return
        if st.output_source != source:
            if st.output_source:
                return  # the other stream counts this request's output
            st.output_source = source
        if st.stream or body.startswith(b"data:"):
            # Server-Sent Events, also when neither the body's "stream" (decided on the
            # headers) nor a text/event-stream content type said so.
            st.stream = True
            tokens = sse_tokens(body)
        else:
            usage = usage_tokens(body)
            tokens = 0 if usage is None else usage - ticket.generated
        if tokens > 0:
            if st.timed and st.stream:
                self._time_first_token(st, ticket, tokens)
            self.pool.generated(ticket, tokens)

    # ----- latency measurement (models with a latency target) ----------------------------

    def _time_first_token(self, st: _Stream, ticket: Ticket, tokens: int) -> None:
        """A streamed response's first generated tokens (``tokens``; 0: its 2xx headers,
        when no stream delivers its body): the time to first token since the routing
        decision. Later chunks only mark the time of the latest token."""
        now = self.pool.clock()
        if st.first_token_at:
            st.last_token_at = now
            return
        st.first_token_at = now
        st.first_tokens = tokens
        assert self.latency is not None
        self.latency.observe_ttft(
            ticket.worker, now - ticket.started, not tokens, self._class_name(st)
        )

    def _time_itl(self, st: _Stream, ticket: Ticket) -> None:
        """The mean gap between the tokens after the first chunk, once the response ends."""
        gaps = ticket.generated - st.first_tokens
        if gaps > 0 and self.latency is not None:
            itl = (st.last_token_at - st.first_token_at) / gaps
            self.latency.observe_itl(ticket.worker, itl, self._class_name(st))

    def _class_name(self, st: _Stream) -> str:
        """The request's class while classes are configured, else ""."""
        return st.request_class.name if st.request_class is not None else ""

    def _on_observed(self, obs: ObserverSession, message: bytes) -> None:
        """A message of the observability-mode filter: count output, reply nothing.

        Its stream is paired with the request's routing stream by ``x-request-id``.
        """
        try:
            req = ep.ProcessingRequest.FromString(message)
            kind = req.WhichOneof("request")
            if kind == "response_body":
                if obs.stream is not None:
                    self._count_output(obs.stream, req.response_body.body, OBSERVER_STREAM)
            elif kind == "request_headers":
                for h in req.request_headers.headers.headers:
                    if h.key == REQUEST_ID_HEADER:
                        st = obs.stream = self._live.get(_header_value(h))
                        if st is not None:
                            # Without a protocol_config (an older Envoy) assume it does.
                            st.observed = (
                                not req.HasField("protocol_config")
                                or req.protocol_config.response_body_mode != _NO_BODY
                            )
                        break
        except Exception:  # an observer must never break the stream
            log.exception("error counting output tokens; ignored")


class RequestSession:
    """The routing stream of one HTTP request."""

    __slots__ = ("closed", "handler", "st")

    def __init__(self, handler: ExtProcHandler) -> None:
        self.handler = handler
        self.st = _Stream()
        self.closed = False

    def receive(self, message: bytes) -> Reply | None:
        return self.handler._on_message(self.st, message)

    def close(self) -> None:
        if not self.closed:
            self.closed = True
            self.handler._on_stream_end(self.st)
            self.handler.metrics.streams.dec()


class ObserverSession:
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
