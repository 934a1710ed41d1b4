"""The ext_proc handler: one session per stream (HTTP request), thin over the decision core.

Flow for an inference request (POST /v1/chat/completions, /v1/completions,
/v1/embeddings, /v1/responses), docs/request-path.md: request headers carrying the
model read from the start of the body (``extproc.request`` metadata) -> one
:meth:`~extproc.core.scheduling.Scheduler.decide` call, mapped to a pre-serialized
reply; without it, the same call before the model is known (``model=None``) answers on
the headers when the answer cannot depend on the model, else the headers ask for the
buffered body (parse, decide). A routed request is then handed to its
:class:`~extproc.handlers.inflight.InFlight`, which owns it until the stream ends: the
response messages are read here and told to it (a worker-side rejection it turns into the
overload reply, the host that served it, generated tokens, timings, the release of the
router's estimate); the response headers ask for the trailers so the stream lasts as long
as the response.

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

import asyncio
import functools
import logging
import time
from collections.abc import Awaitable, Callable, Collection, Hashable, Mapping
from dataclasses import replace
from typing import Any

from envoy.config.core.v3 import base_pb2
from envoy.extensions.filters.http.ext_proc.v3 import processing_mode_pb2
from envoy.service.ext_proc.v3 import external_processor_pb2 as ep

from extproc.core.classes import ClassRegistry, ClassTable, RequestClass
from extproc.core.deadline import Dispatch, Hold, Prediction, Reject, predict_ttft
from extproc.core.latency import DeadlineAdmission
from extproc.core.pool import WorkerPool
from extproc.core.scheduling import (
    MODEL_NOT_FOUND,
    NO_WORKERS,
    QUEUED,
    Decision,
    Deferred,
    Outcome,
    Queued,
    Rejected,
    Routed,
    Scheduler,
    is_free,
)
from extproc.core.worker import Rank, Worker
from extproc.handlers import replies
from extproc.handlers.body_budget import DEFAULT_BUDGET_MIB, MIB, BodyBudget
from extproc.handlers.held import HeldRequests, extension_seconds
from extproc.handlers.inflight import OBSERVER_STREAM, ROUTING_STREAM, InFlight, InFlightTable
from extproc.handlers.router_queue import RouterQueue
from extproc.handlers.subset_hint import SubsetHints
from extproc.metrics.registry import Metrics
from extproc.openai.request import INFERENCE_PATHS, BadRequest, PromptTokenizer, parse_body

log = logging.getLogger("extproc.handlers")

SERVICE_NAME = "envoy.service.ext_proc.v3.ExternalProcessor"
PROCESS_PATH = f"/{SERVICE_NAME}/Process"
WORKER_OVERLOADED_HEADER = "x-worker-overloaded"
# Set by the shipped Envoy configs' local_reply_config on Envoy's own reply to an upstream
# connection failure (response flags UF, UH, UC): the worker was never reached.
UPSTREAM_FAILURE_HEADER = "x-upstream-failure"
REQUEST_ID_HEADER = "x-request-id"
# The OpenAI SDKs (Python and Node) number each attempt of a request: 0 for the first, 1 and
# 2 for their retries after an overload reply. Deadline admission lets a retry yield its slot
# to first attempts while those are being refused (docs/latency-target.md).
RETRY_COUNT_HEADER = "x-stainless-retry-count"
# Set on a request dispatched by deadline admission (a TTFT target): the TTFT predicted for it
# when it was admitted, in ms (one decimal): on the worker it was sent to at once, or the one
# it was held on, its predicted wait included; never set by the plain threshold rule.
PREDICTED_TTFT_HEADER = "x-ttft-predicted-ms"
# Set by the shipped Envoy configs' inference routes on every upstream response to the
# host that served it (%UPSTREAM_HOST%, overwriting a worker's own), and removed before the
# client sees it. In the Endpoint Picker protocol the gateway says the same in the
# response's metadata, under envoy.lb, with this key.
SERVED_HEADER = "x-gateway-destination-endpoint-served"
# gRPC initial metadata of the observability-mode filter (counts output tokens only).
ROLE_METADATA = "x-extproc-role"
# The dynamic metadata namespace Envoy forwards with the request headers: ``model``, read
# from the start of the body by a filter ahead of ext_proc (envoy/envoy.yaml).
REQUEST_NAMESPACE = "extproc.request"
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


def _served_in_metadata(req: ep.ProcessingRequest) -> str:
    """The served host the gateway put in the response's metadata (envoy.lb namespace,
    x-gateway-destination-endpoint-served), or "" when it did not say."""
    meta = req.metadata_context.filter_metadata
    if replies.LB_NAMESPACE not in meta:
        return ""
    fields = meta[replies.LB_NAMESPACE].fields
    if SERVED_HEADER not in fields:
        return ""
    return fields[SERVED_HEADER].string_value


class _Stream:
    """Per-request state of one ext_proc stream up to its decision; once routed, the
    request's life is its ``routed``."""

    __slots__ = (
        "addresses",
        "arrived",
        "body_streamed",
        "deadline_from",
        "duplex_body",
        "duplex_request",
        "duplex_response",
        "endpoint_label",
        "held_prediction",
        "held_since",
        "model",
        "numbered",
        "phase",
        "prompt_tokens",
        "request_class",
        "request_id",
        "retry",
        "routed",
        "stream",
        "subset",
        "target_s",
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
        # The request's class (None without classes) and the variant of the pool's
        # shares it is decided under (the class, or its large-prompt share).
        self.request_class: RequestClass | None = None
        self.endpoint_label: str | None = None
        self.model = ""
        self.phase = "request_body"
        self.prompt_tokens = 0
        self.request_id: str | None = None
        self.retry = False  # the client numbers this attempt as a retry
        self.numbered = False  # the client numbers its attempts (its retries are matched)
        self.stream = False  # the body asked for a streamed response
        # The gateway's endpoint subset (Endpoint Picker protocol): None = not given; under
        # deadline admission, its workers and the address the gateway named for each.
        self.subset: tuple[str, ...] | None = None
        self.addresses: Mapping[Worker, str] | None = None
        self.variant = 0
        # The routed request, from its dispatch to the end of this stream.
        self.routed: InFlight | None = None
        # Deadline admission: when the request reached the router (pool clock), its TTFT
        # target (None: none), and when it was held for a slot (None: never).
        self.arrived = 0.0
        # When its deadline counts from: ``arrived``, or for a retry its user's first
        # attempt where the router can tell (DeadlineAdmission.user_arrival).
        self.deadline_from = 0.0
        self.target_s: float | None = None
        self.held_since: float | None = None
        # The TTFT predicted when it was held (its wait included): what it carries upstream.
        self.held_prediction: float | None = None


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
        admission: DeadlineAdmission | None = None,
        clock: Callable[[], float] = time.perf_counter,
        body_budget: BodyBudget | None = None,
    ) -> None:
        self.pool = pool
        # Bytes of full-duplex request bodies gathered before their decision, all streams.
        self.body_budget = body_budget or BodyBudget(DEFAULT_BUDGET_MIB * MIB)
        metrics.buffered_body_bytes.set_function(lambda: self.body_budget.used)
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
        # Every routed request from its dispatch to its stream's end.
        self.inflight = InFlightTable(
            pool, metrics, self.replies, frozenset(worker_busy_statuses), admission
        )
        # Deadline admission (models and classes with a TTFT target) and its held requests.
        self.admission = admission
        self.held = (
            HeldRequests(
                pool, admission, metrics, self._route_held, self._deadline_held, self._plain_held
            )
            if admission is not None
            else None
        )
        # While a request waits in the router queue Envoy must not time the message out.
        self._extend_timeout = replies.extend_timeout(
            int(queue.timeout) + 2 if queue is not None else 1
        )
        # Request classes (docs/classes.md): the table in force, None without classes.
        self._classes: ClassTable | None = None
        if classes is not None:
            self._on_classes(classes.table)
            classes.listeners.append(self._on_classes)

    def _on_classes(self, table: ClassTable) -> None:
        self._classes = table if table.enabled else None

    # ----- the pool's listeners (wired by the service) ---------------------------------

    def capacity_changed(self, model: str) -> None:
        """A slot may have freed for ``model`` (a stream ended, a worker joined, a
        threshold or target changed): wake the router queue, pump the held requests."""
        if self.queue is not None:
            self.queue.notify(model)
        if self.held is not None:
            self.held.pump(model)

    def load_reported(self, worker: Worker) -> None:
        """A load report was applied: the worker's estimate learns its queue fields, then
        its model's held requests may go."""
        if self.admission is not None:
            self.admission.load(worker)
        if self.held is not None:
            self.held.pump(worker.model)

    def classes_changed(self, _table: ClassTable) -> None:
        """A class's target may have changed: every held request is decided again."""
        if self.held is not None:
            self.held.pump_all()

    def close(self) -> None:
        if self.held is not None:
            self.held.close()

    def open_session(self, metadata: Mapping[str, str]) -> RequestSession | ObserverSession:
        """A session for one ext_proc stream, from its gRPC metadata."""
        self.metrics.streams.inc()
        if metadata.get(ROLE_METADATA) == "observe":
            self.inflight.observed = True
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
                return self._on_response_headers(st, req)
            if kind == "response_body":
                return self._on_response_body(st, req.response_body)
            if kind == "request_trailers" and st.duplex_body is not None:
                return self._duplex_decide(st, [replies.CONTINUES["request_trailers"]])
            if kind == "response_trailers" and st.routed is not None:
                st.routed.response_over()
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
        if self.held is not None and st.held_since is not None:
            self.held.drop(st)  # held for a slot: the client went away
        if st.routed is not None:
            st.routed.end()

    # ----- request phase ---------------------------------------------------------------

    def _on_request_headers(self, st: _Stream, req: ep.ProcessingRequest) -> Reply:
        if st.routed is not None:  # headers again after routing: one decision per stream
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
            elif key == RETRY_COUNT_HEADER:
                st.numbered = True
                st.retry = _header_value(h).strip() not in ("", "0")
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
        st.arrived = self.pool.clock()
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
        count = budget.refused(time.monotonic())
        if count is not None:
            log.warning(
                "request body budget full: %d bod%s refused with the overload reply since the "
                "last line; the full-duplex bodies being gathered (%d) hold %d of %d bytes "
                "(--request-body-budget-mib); counted in extproc_request_body_rejections_total",
                count, "y" if count == 1 else "ies", budget.streams, budget.used, budget.limit,
            )  # fmt: skip
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
        if st.routed is None or not isinstance(reply, bytes):
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
        if st.endpoint_label is None or st.routed is not None or st.model:
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
        admission = self.admission
        if admission is not None:
            cls = st.request_class
            st.target_s = admission.target_s(model, cls.name if cls is not None else "")
            if st.target_s is not None:
                deadline_reply = self._decide_by_deadline(st, st.target_s)
                self.metrics.decision_seconds.observe(self.clock() - started)
                return deadline_reply
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

    # ----- deadline admission (a TTFT target) -------------------------------------------

    def _decide_by_deadline(self, st: _Stream, target_s: float) -> Reply:
        """Dispatch, hold or reject a request with a TTFT target: the candidates are the
        workers the thresholds leave free (ceilings), within the gateway's endpoint subset
        when it names one; none: the plain rule's answer."""
        assert self.admission is not None and self.held is not None
        pool = self.pool
        model = st.model
        subset = st.subset
        if subset is None:
            workers = pool.by_model.get(model)
            if not workers:
                return self._reply(st, MODEL_NOT_FOUND if pool.by_model else NO_WORKERS)
        else:
            if not subset:
                return self._reply(st, NO_WORKERS)
            if model not in pool.by_model and pool.by_model:
                return self._reply(st, MODEL_NOT_FOUND)
            st.addresses = self.scheduler.gateway.members(model, subset)
            workers = list(st.addresses)
            if not workers:
                return self._reply(st, NO_WORKERS)
        now = pool.clock()
        variant = st.variant
        candidates = [w for w in workers if is_free(w, variant, now)]
        if not candidates:  # every worker busy by the thresholds: today's answer
            return self._reply(
                st, self.scheduler.decide(model, st.prompt_tokens, variant, subset=subset)
            )
        st.deadline_from = self.admission.user_arrival(model, st.arrived, st.retry, now)
        decision, preds = self.admission.admit(
            model,
            candidates,
            st.prompt_tokens,
            target_s,
            st.deadline_from,
            now,
            st.retry,
            st.request_class.priority if st.request_class is not None else 0,
            st.numbered,
        )
        best = min((p.ttft for p in preds if p.ttft is not None), default=None)
        if best is not None:
            self.metrics.predicted_ttft.labels(model).observe(best)
        # A retry refused because its user's target is past is not sent to measure a worker.
        late = st.deadline_from < st.arrived
        probe = None
        if type(decision) is not Dispatch and not late:
            probe = self.admission.probe(decision, preds, now)
        if log.isEnabledFor(logging.DEBUG):
            log.debug("%s", _explain(st, decision, preds, target_s, now, probe))
        if type(decision) is Dispatch:
            worker = next(w for w in candidates if w.worker_id == decision.worker)
            return self._route_to(st, worker, preds)
        if probe is not None:  # unreachable: measured again, once a second per worker
            worker = next(w for w in candidates if w.worker_id == probe)
            return self._route_to(st, worker, preds)
        if type(decision) is Hold:
            cls = st.request_class
            st.held_since = now
            st.held_prediction = next((p.ttft for p in preds if p.worker == decision.worker), None)
            future, wait = self.held.hold(
                st,
                model,
                decision,
                prompt_tokens=st.prompt_tokens,
                variant=variant,
                class_name=cls.name if cls is not None else "",
                arrived=st.deadline_from,
                only=None if subset is None else frozenset(w.worker_id for w in workers),
                lenient=self.admission.best_class(cls.priority if cls is not None else 0),
            )
            extension = self.replies.extension(extension_seconds(wait))
            return extension, self._wait_held(st, future)
        assert type(decision) is Reject
        return self._deadline_reply(st, decision)

    def _route_to(
        self, st: _Stream, worker: Worker, preds: list[Prediction] | None = None
    ) -> bytes:
        """Dispatch the request to ``worker`` (picked by its prediction): its least loaded
        rank that the thresholds leave free; fallbacks are the other free workers, the
        smallest predicted TTFT first."""
        variant = st.variant
        rank = _free_rank(worker, variant)
        ticket = self.pool.dispatch(worker, rank, st.prompt_tokens)
        now = self.pool.clock()
        addresses = st.addresses  # the gateway's subset: its workers, at its addresses

        def endpoint(w: Worker) -> str:
            return w.endpoint if addresses is None else addresses.get(w, w.endpoint)

        pool_workers = self.pool.by_model.get(st.model, ()) if addresses is None else addresses
        others = [
            w
            for w in pool_workers
            if w is not worker and is_free(w, variant, now) and endpoint(w) != endpoint(worker)
        ]
        if preds is not None:
            order = {p.worker: (p.ttft if p.ttft is not None else float("inf")) for p in preds}
            others.sort(key=lambda w: order.get(w.worker_id, float("inf")))
        limit = self.scheduler.max_fallbacks
        fallbacks = tuple(dict.fromkeys(endpoint(w) for w in others))[: max(0, limit)]
        routed = Routed(ticket, fallbacks, "" if addresses is None else endpoint(worker))
        reply = self._reply(st, routed)
        mine = next((p for p in preds if p.worker == worker.worker_id), None) if preds else None
        if mine is None or mine.ttft is None:
            return reply
        phase = "request_headers" if st.duplex_request else st.phase
        return reply + _predicted_header(mine.ttft, phase)

    def _deadline_reply(self, st: _Stream, decision: Reject) -> bytes:
        """The overload reply with ``x-shed-reason: deadline``, counted."""
        self.metrics.outcome["deadline"].inc()
        self.metrics.deadline_rejections.labels(st.model).inc()
        self.metrics.rejections.labels(st.model, st.endpoint_label or "").inc()
        self._count_class(st, st.model, "overloaded")
        final = False
        admission = self.admission
        if admission is not None:
            now = self.pool.clock()
            cls = st.request_class
            final = (
                st.numbered
                and st.target_s is not None
                and admission.no_retry_fits(
                    st.model,
                    st.prompt_tokens,
                    st.target_s,
                    st.deadline_from,
                    decision.retry_after_ms,
                    now,
                    cls.priority if cls is not None else 0,
                )
            )
            if not final:  # told not to retry, the SDK does not: no retry of it is due
                admission.told(st.model, st.deadline_from, decision.retry_after_ms, now)
        return self.replies.deadline(
            decision.retry_after, decision.retry_after_ms, st.request_class, final
        )

    async def _wait_held(self, st: _Stream, future: asyncio.Future[Any]) -> bytes:
        """Wait for the held request's reply; the router queue's when the plain rule,
        deciding it after its target was removed, queued it."""
        assert self.held is not None
        try:
            result = await future
        finally:
            self.held.drop(st)
        if isinstance(result, Queued):
            return await self._wait_in_queue(st)
        assert isinstance(result, bytes)
        return result

    def _route_held(self, key: Hashable, worker: Worker) -> bytes:
        """A held request given a free slot of ``worker``. Its upstream
        ``x-ttft-predicted-ms`` is the TTFT it was held on, its predicted wait included
        (the prediction admission decided on, as for a request dispatched at once), not its
        prediction now, which leaves out the time it was held."""
        assert isinstance(key, _Stream) and self.admission is not None
        est = self.admission.estimate(worker.worker_id)
        now = self.pool.clock()
        pred = predict_ttft(est, key.prompt_tokens, 0, now)
        if log.isEnabledFor(logging.DEBUG):
            log.debug(
                "deadline held, sent: request_id=%s model=%s worker=%s held_ms=%.1f"
                " prefill_ms=%.1f",
                key.request_id or "-", key.model, worker.worker_id,
                (now - (key.held_since or now)) * 1000, pred.prefill * 1000,
            )  # fmt: skip
        if key.held_prediction is not None:
            pred = replace(pred, ttft=key.held_prediction)
        return self._route_to(key, worker, [pred])

    def _deadline_held(self, key: Hashable, decision: Reject) -> bytes:
        assert isinstance(key, _Stream)
        if log.isEnabledFor(logging.DEBUG):
            now = self.pool.clock()
            log.debug(
                "deadline held, refused: request_id=%s model=%s held_ms=%.1f retry_after_ms=%d",
                key.request_id or "-", key.model,
                (now - (key.held_since or now)) * 1000, decision.retry_after_ms,
            )  # fmt: skip
        return self._deadline_reply(key, decision)

    def _plain_held(self, key: Hashable) -> bytes | Queued:
        """A held request whose target was removed: decided by the plain rule now."""
        assert isinstance(key, _Stream)
        st = key
        st.target_s = None
        queue = self.queue
        waiting = queue is not None and queue.waiting(st.model)
        decision = self.scheduler.decide(
            st.model, st.prompt_tokens, st.variant, waiting=waiting, subset=st.subset
        )
        if type(decision) is Queued:
            return QUEUED if queue is not None else self._reply(st, decision)
        return self._reply(st, decision)

    def _attempt(self, st: _Stream) -> Routed | Rejected | None:
        """The head of the queue decides again (it is the one waiting: no FIFO check)."""
        decision = self.scheduler.decide(st.model, st.prompt_tokens, st.variant, subset=st.subset)
        return None if isinstance(decision, Queued) else decision

    def _reply(self, st: _Stream, decision: Decision) -> bytes:
        """Map a decision to its pre-serialized reply and count it."""
        self.metrics.outcome[decision.outcome.value].inc()
        if type(decision) is Routed:
            held = 0.0 if st.held_since is None else self.pool.clock() - st.held_since
            st.routed = self.inflight.start(
                decision,
                model=st.model,
                request_class=st.request_class,
                endpoint_label=st.endpoint_label,
                request_id=st.request_id,
                stream=st.stream,
                body_streamed=st.body_streamed,
                duplex_response=st.duplex_response,
                key=st,
                arrived=st.arrived,
                held=held,
                target_s=st.target_s,
            )
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

    def _on_response_headers(self, st: _Stream, req: ep.ProcessingRequest) -> bytes:
        routed = st.routed
        if routed is None:
            return replies.CONTINUE_RESPONSE_HEADERS
        msg = req.response_headers
        status = 0
        flagged = unreachable = event_stream = False
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
                event_stream = True
        if self.subset_hints is not None:  # the Endpoint Picker protocol: also the metadata
            served = _served_in_metadata(req) or served
        refused = routed.response_headers(
            status,
            flagged=flagged,
            unreachable=unreachable,
            served=served,
            event_stream=event_stream,
            end_of_stream=msg.end_of_stream,
        )
        if refused is not None:
            return refused
        if st.phase == "request_headers" and not msg.end_of_stream:
            if st.body_streamed:
                return replies.CONTINUE_RESPONSE_HEADERS_HOLD_STREAMED
            return replies.CONTINUE_RESPONSE_HEADERS_HOLD
        return replies.CONTINUE_RESPONSE_HEADERS

    def _on_response_body(self, st: _Stream, msg: ep.HttpBody) -> bytes:
        if st.routed is not None:
            st.routed.response_body(msg.body, msg.end_of_stream, ROUTING_STREAM)
        if st.duplex_response:
            return replies.streamed_body("response_body", msg.body, msg.end_of_stream)
        return replies.CONTINUE_RESPONSE_BODY

    def _on_observed(self, obs: ObserverSession, message: bytes) -> None:
        """A message of the observability-mode filter: count output, reply nothing.

        Its stream is paired with the request's routing stream by ``x-request-id``.
        """
        try:
            req = ep.ProcessingRequest.FromString(message)
            kind = req.WhichOneof("request")
            if kind == "response_body":
                if obs.stream is not None:
                    body = req.response_body
                    obs.stream.response_body(body.body, body.end_of_stream, OBSERVER_STREAM)
            elif kind == "request_headers":
                for h in req.request_headers.headers.headers:
                    if h.key == REQUEST_ID_HEADER:
                        routed = obs.stream = self.inflight.paired(_header_value(h))
                        if routed is not None:
                            # Without a protocol_config (an older Envoy) assume it does.
                            routed.observed = (
                                not req.HasField("protocol_config")
                                or req.protocol_config.response_body_mode != _NO_BODY
                            )
                        break
        except Exception:  # an observer must never break the stream
            log.exception("error counting output tokens; ignored")


def _explain(
    st: _Stream,
    decision: Dispatch | Hold | Reject,
    preds: list[Prediction],
    target_s: float,
    now: float,
    probe: str | None,
) -> str:
    """One line for the debug log: why deadline admission dispatched, held or refused a
    request (each candidate's prediction and its parts, in ms)."""

    def ms(seconds: float | None) -> str:
        return "unknown" if seconds is None else f"{seconds * 1000:.1f}"

    cls = st.request_class
    head = (
        f"deadline {type(decision).__name__.lower()}: request_id={st.request_id or '-'}"
        f" model={st.model} class={cls.name if cls is not None else '-'}"
        f" prompt_tokens={st.prompt_tokens} retry={'yes' if st.retry else 'no'}"
        f" target_ms={ms(target_s)} left_ms={ms(target_s - (now - st.deadline_from))}"
    )
    if isinstance(decision, Dispatch):
        head += f" worker={decision.worker}"
    elif isinstance(decision, Hold):
        head += f" worker={decision.worker} wait_ms={ms(decision.wait)}"
        head += f" hold_until_ms={ms(decision.deadline - now)}"
    else:
        head += f" retry_after_ms={decision.retry_after_ms}"
        if decision.yielded:
            head += " yielded=yes"
        if decision.unreachable:
            head += " unreachable=yes"
        if probe is not None:
            head += f" probe={probe}"
    parts = [
        f"{p.worker}: ttft_ms={ms(p.ttft)} spread_ms={ms(p.spread)} wait_ms={ms(p.wait)}"
        f" prefill_ms={ms(p.prefill)} gateway_ms={ms(p.gateway)} ahead={p.ahead:g}"
        f" slot_free={'yes' if p.can_start else 'no'} occupancy={p.occupancy}"
        for p in preds
    ]
    return " | ".join([head, *parts])


def _predicted_header(ttft_s: float, phase: str) -> bytes:
    """A reply to the message of ``phase`` that only sets :data:`PREDICTED_TTFT_HEADER`,
    serialized; appended to a cached routing reply it is merged into it (protobuf parses a
    concatenation of two messages as one, their repeated header mutations joined)."""
    option = base_pb2.HeaderValueOption(
        header=base_pb2.HeaderValue(
            key=PREDICTED_TTFT_HEADER, raw_value=f"{ttft_s * 1000:.1f}".encode()
        ),
        append_action=base_pb2.HeaderValueOption.OVERWRITE_IF_EXISTS_OR_ADD,
    )
    common = ep.CommonResponse(header_mutation=ep.HeaderMutation(set_headers=[option]))
    if phase == "request_headers":
        msg = ep.ProcessingResponse(request_headers=ep.HeadersResponse(response=common))
    else:
        msg = ep.ProcessingResponse(request_body=ep.BodyResponse(response=common))
    return msg.SerializeToString()


def _free_rank(worker: Worker, variant: int) -> Rank:
    """The worker's rank for a request: one the thresholds leave free for ``variant`` (or
    with no load data), the fewest requests in flight, then the least KV in use."""
    ranks = worker.ranks
    if len(ranks) == 1:
        return ranks[0]
    free = [r for r in ranks if not r.has_data or r.reason_for(variant) is None] or ranks

    def load(rank: Rank) -> tuple[int, float]:
        total = worker.kv_total(rank)
        blocks = rank.decode_blocks or 0
        return rank.inflight, (blocks / total if total else float(blocks))

    return min(free, key=load)


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
        self.stream: InFlight | None = None
        self.closed = False

    def receive(self, message: bytes) -> None:
        self.handler._on_observed(self, message)

    def close(self) -> None:
        self.stream = None
        if not self.closed:
            self.closed = True
            self.handler.metrics.streams.dec()
