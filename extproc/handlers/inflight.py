"""A routed request from dispatch to stream end: the one owner of its life after the decision.

The ext_proc handler decides a request and hands the :class:`~extproc.core.scheduling.Routed`
decision to :meth:`InFlightTable.start`; from then on the :class:`InFlight` it gets back is
told what the response does, already read from the ext_proc messages:

- its headers (:meth:`InFlight.response_headers`): a worker-side rejection or Envoy's own
  503 becomes the overload reply; when an Envoy retry served the request elsewhere (the
  served host differs from the pick), the estimate follows it;
- its body chunks (:meth:`InFlight.response_body`), from the routing stream or from the
  observability filter's stream, whichever delivers one first: generated tokens are counted
  into the pool's estimate; the first body byte of a streamed response is its first token,
  which deadline admission learns from (and, with a TTFT target, counts as met or not);
- its end (:meth:`InFlight.response_over`, :meth:`InFlight.end`): the estimate is released,
  whatever ended the stream, and deadline admission told (before the release, whose
  capacity listener may dispatch a held request into the freed slot).

Each request keeps three timestamps of the pool's clock, per worker that served it:
``dispatched_at`` (the decision), ``first_byte_at`` (the first response body byte, from
either stream) and ``ended_at`` (the stream's end). No I/O; the hot path allocates one
:class:`InFlight` per routed request.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Hashable

from extproc.core.classes import RequestClass
from extproc.core.latency import DeadlineAdmission
from extproc.core.pool import WorkerPool
from extproc.core.scheduling import Routed
from extproc.core.worker import Ticket
from extproc.handlers.output_tokens import sse_tokens, usage_tokens
from extproc.handlers.replies import Replies
from extproc.metrics.registry import UNOBSERVED_OUTPUT_FIX, Metrics

log = logging.getLogger("extproc.handlers")

# Whose response-body chunks count a request's generated tokens: the first stream that
# delivers one (the routing stream, when its filter streams the response body, or the
# observer's); the other stream's chunks of that request are not counted again.
ROUTING_STREAM = 1
OBSERVER_STREAM = 2


class InFlightTable:
    """Every routed request of this process whose stream is open, and what they share:
    the pool their estimates live in, deadline admission whose estimates their timings
    feed, the replies and metrics of a response that turns into a local reply."""

    def __init__(
        self,
        pool: WorkerPool,
        metrics: Metrics,
        replies: Replies,
        busy_statuses: frozenset[int],
        admission: DeadlineAdmission | None = None,
    ) -> None:
        self.pool = pool
        self.metrics = metrics
        self.replies = replies
        self.busy_statuses = busy_statuses
        self.admission = admission
        # Routed requests by x-request-id, for the observability filter's streams.
        self.live: dict[str, InFlight] = {}
        # Set once an observability-mode stream arrives: output is counted from bodies.
        self.observed = False
        # Logged once: streamed responses end while no stream delivers their body.
        self._unobserved_warned = False

    def start(
        self,
        decision: Routed,
        *,
        model: str,
        request_class: RequestClass | None,
        endpoint_label: str | None,
        request_id: str | None,
        stream: bool,
        body_streamed: bool,
        duplex_response: bool,
        key: Hashable | None = None,
        arrived: float | None = None,
        held: float = 0.0,
        target_s: float | None = None,
    ) -> InFlight:
        """The request was routed: it is in flight from now on, its estimate held by the
        decision's ticket until :meth:`InFlight.end`. ``key`` names it to deadline
        admission (default: the :class:`InFlight`); ``arrived``: when it reached the router
        (pool clock), ``held`` of that spent held for a slot; ``target_s``: its TTFT target,
        whose meeting is counted at its first body byte."""
        ticket = decision.ticket
        req = InFlight(self, ticket, decision.fallbacks, model, request_class)
        req.endpoint_label = endpoint_label
        req.request_id = request_id
        req.stream = stream
        req.body_streamed = body_streamed
        req.duplex_response = duplex_response
        req.key = req if key is None else key
        req.arrived = ticket.started if arrived is None else arrived
        req.target_s = target_s
        admission = self.admission
        if admission is not None:
            admission.dispatched(
                req.key, ticket.worker, ticket.prompt_tokens, ticket.started, arrived, held
            )
        if request_id is not None:
            self.live[request_id] = req
        return req

    def paired(self, request_id: str) -> InFlight | None:
        """The routed request an observer stream with this ``x-request-id`` belongs to."""
        return self.live.get(request_id)

    def output_unobserved(self) -> None:
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


class InFlight:
    """One routed request, from its dispatch to the end of its stream."""

    __slots__ = (
        "arrived",
        "body_streamed",
        "class_name",
        "dispatched_at",
        "duplex_response",
        "ended_at",
        "endpoint_label",
        "fallbacks",
        "first_byte_at",
        "key",
        "model",
        "observed",
        "ok",
        "output_source",
        "request_class",
        "request_id",
        "stream",
        "streaming",
        "table",
        "target_s",
        "ticket",
    )

    def __init__(
        self,
        table: InFlightTable,
        ticket: Ticket,
        fallbacks: tuple[str, ...],
        model: str,
        request_class: RequestClass | None,
    ) -> None:
        self.table = table
        # The estimate held for the request; it names the worker serving it now.
        self.ticket = ticket
        self.fallbacks = fallbacks  # endpoints Envoy retries a refusal on, in order
        self.model = model
        self.request_class = request_class
        # The request's class while classes are configured, else "".
        self.class_name = request_class.name if request_class is not None else ""
        self.endpoint_label: str | None = None
        self.request_id: str | None = None
        # The response is Server-Sent Events (the body's "stream", or the response says so).
        self.stream = False
        # How the routing filter sends the response body: streamed, or in full duplex.
        self.body_streamed = False
        self.duplex_response = False
        # An observer stream that receives the response body is paired with this one.
        self.observed = False
        # ROUTING_STREAM or OBSERVER_STREAM once a response-body chunk arrived, else 0.
        self.output_source = 0
        # A streamed 2xx response began (it was not over at its headers).
        self.streaming = False
        # The response headers said 2xx.
        self.ok = False
        # What names it to deadline admission, when it reached the router, and its TTFT
        # target (None: none), whose meeting is counted at its first body byte.
        self.key: Hashable = self
        self.arrived = ticket.started
        self.target_s: float | None = None
        # The request's timeline on the pool's clock (0.0: not yet): the decision, the
        # first response body byte (either stream), the end of the stream.
        self.dispatched_at = ticket.started
        self.first_byte_at = 0.0
        self.ended_at = 0.0

    # ----- the response ------------------------------------------------------------------

    def response_headers(
        self,
        status: int,
        *,
        flagged: bool = False,
        unreachable: bool = False,
        served: str = "",
        event_stream: bool = False,
        end_of_stream: bool = False,
    ) -> bytes | None:
        """The response headers, as read: the local reply that replaces a refused response,
        else None (the response goes on). ``flagged``: the worker said it is overloaded;
        ``unreachable``: Envoy's own reply to a connection it could not make; ``served``:
        the ``ip:port`` that served it, "" when not said."""
        if event_stream:
            self.stream = True  # decided on the headers: the body's "stream" was not read
        ok = self.ok = 200 <= status < 300
        if not ok:
            if unreachable and status >= 500:
                return self._worker_unreachable()
            if flagged or status == 529 or status in self.table.busy_statuses:
                return self._worker_rejected()
        ticket = self.ticket
        if served and not ticket.worker.serves_at(served):
            self._served_elsewhere(served)
        if end_of_stream:
            self._release(completed=ok)
        elif self.stream and ok:
            self._output_begins()
        return None

    def response_body(self, body: bytes, end_of_stream: bool, source: int) -> None:
        """A response body chunk from ``source`` (ROUTING_STREAM or OBSERVER_STREAM)."""
        first = bool(body) and not self.first_byte_at
        if first:
            self.first_byte_at = self.table.pool.clock()
        self._count_output(body, source)
        if first and self.stream:
            self._first_token(self.first_byte_at)
        if end_of_stream and source == ROUTING_STREAM:
            self._release(completed=self.ok)

    def response_over(self) -> None:
        """The response's trailers: it is over."""
        self._release(completed=self.ok)

    def end(self) -> None:
        """The routing stream ended, whatever ended it: the estimate is released.

        A request whose response headers were 2xx counts as completed for deadline
        admission, its end now: with a filter that sends no response body (or whose body
        end was not seen) the end of the ext_proc stream is the only end the router sees.
        The handler cannot tell Envoy's close after the response from a client's reset
        mid-response: the transport ends the session the same way (Envoy's ext_proc filter
        closes its stream when the HTTP stream goes, whichever way it goes). Both free the
        engine's slot now (on a client's reset Envoy resets the upstream request too), so
        both are a time the request held its slot. A stream that ended before 2xx headers
        (a refusal, a client gone before the response) is not."""
        table = self.table
        if self.streaming and not (
            self.output_source or self.observed or self.body_streamed or self.duplex_response
        ):
            table.output_unobserved()
        self.ended_at = table.pool.clock()
        self._release(completed=self.ok)
        if self.request_id is not None:
            table.live.pop(self.request_id, None)

    def _release(self, completed: bool = False) -> None:
        """The request is over: deadline admission learns its end (``completed``: its 2xx
        response finished, not cut short), then the pool releases its estimate
        (idempotent)."""
        table = self.table
        ticket = self.ticket
        if ticket.released:
            return
        admission = table.admission
        if admission is not None:
            now = table.pool.clock()
            admission.ended(self.key, ticket.worker, now, ticket.generated, completed)
        table.pool.release(ticket)

    def _first_token(self, at: float) -> None:
        """A streamed response's first token reached the router at ``at``: deadline
        admission learns the worker's prefill from it, and a request with a target counts
        as having met it or not (measured from its arrival at the router)."""
        table = self.table
        admission = table.admission
        if admission is None or self.ticket.released:
            return
        admission.first_byte(self.key, self.ticket.worker, at)
        target = self.target_s
        if target is not None:
            met = admission.ttft_measured(self.model, at - self.arrived, target)
            table.metrics.ttft_target_met.labels(self.model, "true" if met else "false").inc()

    # ----- a response refused, or served elsewhere ------------------------------------

    def _served_elsewhere(self, endpoint: str) -> None:
        """An Envoy retry moved the request off its pick (refused, reset, or a busy status):
        its estimate follows it to the worker at ``endpoint``, or is released when that is
        not a known worker of the model. Envoy tries the pick, then the listed fallbacks in
        order, so the pick and every fallback listed before ``endpoint`` refused it: each is
        skipped until its next load report or 1 s, as after a worker-side rejection."""
        table = self.table
        pool = table.pool
        ticket = self.ticket
        model = ticket.worker.model
        refused = [ticket.worker]
        if endpoint in self.fallbacks:
            for fallback in self.fallbacks[: self.fallbacks.index(endpoint)]:
                worker = pool.worker_at(fallback, model)
                if worker is not None:
                    refused.append(worker)
        served = pool.worker_at(endpoint, model)
        admission = table.admission
        if admission is not None:
            old = ticket.worker
            now = pool.clock()
            admission.ended(self.key, old, now)
            if served is not None:
                admission.dispatched(self.key, served, ticket.prompt_tokens, now)
        pool.move(ticket, served)
        for worker in refused:
            pool.mark_overloaded(worker)
        kind = "unknown" if served is None else "worker"
        table.metrics.served_elsewhere.labels(model, kind).inc()

    def _worker_unreachable(self) -> bytes:
        """Envoy's own 503 for a routed request (the worker refused or reset the connection
        and no listed fallback took it): skip the worker for a while and answer the overload
        reply, as when it is busy; the request never reached an engine."""
        table = self.table
        worker = self.ticket.worker
        table.pool.mark_unreachable(worker)
        self._release()
        table.metrics.worker_unreachable.labels(self.model).inc()
        table.metrics.rejections.labels(self.model, self.endpoint_label or "").inc()
        log.warning(
            "worker %s (%s) unreachable from Envoy: skipped for 1 s", worker.worker_id,
            worker.endpoint,
        )  # fmt: skip
        retry_after = table.pool.retry_after(self.model)
        return table.replies.overload(retry_after, "worker_unreachable", self.request_class)

    def _worker_rejected(self) -> bytes:
        """A worker-side rejection that Envoy's retries did not absorb: the pick and every
        fallback Envoy retried it on refused, so each is skipped until its next load report
        or 1 s; counted and answered as our own overload reply."""
        table = self.table
        pool = table.pool
        pool.mark_overloaded(self.ticket.worker)
        for endpoint in self.fallbacks:
            worker = pool.by_endpoint.get((endpoint, self.model))
            if worker is not None:
                pool.mark_overloaded(worker)
        self._release()
        table.metrics.rejections.labels(self.model, self.endpoint_label or "").inc()
        return table.replies.overload(1, "worker_overloaded", self.request_class)

    # ----- generated tokens -------------------------------------------------------------

    def _output_begins(self) -> None:
        """A streamed 2xx response began. Without a stream that delivers its body, prefill
        is over now; with one, at the first generated token."""
        self.streaming = True
        table = self.table
        ticket = self.ticket
        if not (table.observed or self.body_streamed or self.duplex_response):
            # No stream delivers its body: its headers are the nearest to a first token
            # the router sees (deadline admission learns from them; no TTFT is counted).
            admission = table.admission
            if admission is not None and ticket.in_prefill:
                admission.first_byte(self.key, ticket.worker, table.pool.clock())
            table.pool.prefill_done(ticket)

    def _count_output(self, body: bytes, source: int) -> None:
        """Count the generated tokens in a response-body chunk from ``source``; the first
        stream to deliver a chunk of a request counts all of its output."""
        ticket = self.ticket
        if ticket.released:
            return
        if self.output_source != source:
            if self.output_source:
                return  # the other stream counts this request's output
            self.output_source = source
        if self.stream or body.startswith(b"data:"):
            # Server-Sent Events, also when neither the body's "stream" (decided on the
            # headers) nor a text/event-stream content type said so.
            self.stream = True
            tokens = sse_tokens(body)
        else:
            usage = usage_tokens(body)
            tokens = 0 if usage is None else usage - ticket.generated
        if tokens > 0:
            table = self.table
            table.pool.generated(ticket, tokens)
            admission = table.admission
            if admission is not None and self.stream:  # the engine's step, from the gaps
                admission.tokens(self.key, ticket.worker, table.pool.clock(), tokens)
