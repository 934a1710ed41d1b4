"""Generated tokens in the ext_proc handler: whichever stream carries the response body
counts them, never both, and a response whose body reaches no stream is reported.

Plain protobuf messages in, serialized replies out: no Envoy, no sockets.
"""

from __future__ import annotations

import logging

import pytest
from envoy.extensions.filters.http.ext_proc.v3 import processing_mode_pb2
from envoy.service.ext_proc.v3 import external_processor_pb2 as ep

from extproc.admin.diagnostics import UNOBSERVED_WARNING_SECONDS, workers_view
from extproc.core.busy import BusyThresholds
from extproc.core.pool import WorkerPool
from extproc.core.scheduling import Scheduler
from extproc.core.worker import Rank
from extproc.handlers.processor import ExtProcHandler, ObserverSession, RequestSession
from extproc.metrics.registry import Metrics
from tests.handlers.test_processor import (
    CHAT,
    Clock,
    body,
    counter,
    headers,
    reply,
    response_headers,
    trailers,
)

PM = processing_mode_pb2.ProcessingMode
UNOBSERVED = "extproc_output_unobserved_responses_total"
WARNING = "no ext_proc stream received its body"
SSE = {"content-type": "text/event-stream"}
# Prompt tokens of a request decided on its headers: ceil(content-length / 4).
PROMPT = 10


def make(track: bool = True) -> ExtProcHandler:
    pool = WorkerPool(BusyThresholds(0.5), track_output_blocks=track, clock=Clock())
    pool.announce("a", model="m", endpoint="127.0.0.1:1", kv_total_blocks=100, block_size=16)
    return ExtProcHandler(pool, Scheduler(pool), Metrics())


def rank(handler: ExtProcHandler) -> Rank:
    return handler.pool.workers["a"].ranks[0]


def with_body_mode(message: bytes, response_body_mode: int | None) -> bytes:
    """``message`` as the first of its stream: with the filter's ``protocol_config``."""
    if response_body_mode is None:
        return message
    req = ep.ProcessingRequest.FromString(message)
    req.protocol_config.response_body_mode = response_body_mode
    return req.SerializeToString()


def routed(
    handler: ExtProcHandler, request_id: str = "r1", body_mode: int | None = None
) -> RequestSession:
    """A chat request decided on its headers (the prefix reader read the model)."""
    session = handler.open_session({})
    assert isinstance(session, RequestSession)
    first = headers(
        CHAT, read="m", extra={"content-length": str(4 * PROMPT), "x-request-id": request_id}
    )
    resp = reply(session, with_body_mode(first, body_mode))
    assert resp.request_headers.response.header_mutation.set_headers, "not routed"
    return session


def observer(
    handler: ExtProcHandler, request_id: str = "r1", body_mode: int | None = PM.STREAMED
) -> ObserverSession:
    session = handler.open_session({"x-extproc-role": "observe"})
    assert isinstance(session, ObserverSession)
    first = headers(CHAT, extra={"x-request-id": request_id})
    session.receive(with_body_mode(first, body_mode))
    return session


def chunk(tokens: int, end: bool = False) -> bytes:
    events = b'data: {"choices":[{"delta":{"content":"x"}}]}\n\n' * tokens
    return ep.ProcessingRequest(
        response_body=ep.HttpBody(body=events, end_of_stream=end)
    ).SerializeToString()


def deliver(session: RequestSession | ObserverSession, message: bytes) -> None:
    if isinstance(session, RequestSession):
        reply(session, message)
    else:
        session.receive(message)


# ----- the mode overrides keep the filter's streamed response body -------------------------


@pytest.mark.parametrize(
    ("body_mode", "kept"),
    [(PM.STREAMED, PM.STREAMED), (None, PM.NONE), (PM.NONE, PM.NONE), (PM.BUFFERED, PM.NONE)],
    ids=["streamed", "no-protocol-config", "none", "buffered"],
)
def test_the_overrides_keep_a_streamed_response_body(body_mode: int | None, kept: int) -> None:
    handler = make()
    # Decided on the headers: the reply to the response headers holds the stream open.
    session = routed(handler, body_mode=body_mode)
    resp = reply(session, response_headers(200, extra=SSE))
    assert resp.mode_override.response_trailer_mode == PM.SEND
    assert resp.mode_override.response_body_mode == kept
    # Decided on the body: the reply to the request headers asks for it.
    exact = handler.open_session({})
    assert isinstance(exact, RequestSession)
    resp = reply(exact, with_body_mode(headers(CHAT), body_mode))
    assert resp.mode_override.request_body_mode == PM.BUFFERED
    assert resp.mode_override.response_body_mode == kept


# ----- counted once, by the first stream that delivers the body ----------------------------


@pytest.mark.parametrize("first", ["routing", "observer"])
def test_output_is_counted_once_when_both_streams_deliver_the_body(first: str) -> None:
    handler = make()
    session = routed(handler, body_mode=PM.STREAMED)
    watcher = observer(handler)
    reply(session, response_headers(200, extra=SSE))
    r = rank(handler)
    assert (r.est_prefill, r.est_blocks) == (PROMPT, 1)  # prefill ends at the first token
    streams: list[RequestSession | ObserverSession] = [session, watcher]
    if first == "observer":
        streams.reverse()
    # Both streams see every chunk (Envoy sends each to both filters), in either order.
    for tokens in (3, 20, 7):
        for stream in streams:
            deliver(stream, chunk(tokens))
    assert session.st.routed is not None and session.st.routed.ticket.generated == 30
    assert (r.est_prefill, r.est_blocks) == (0, 3)  # ceil((10 + 30) / 16)
    # The last chunk ends the response on the routing stream: released, counted no more.
    deliver(session, chunk(5, end=True))
    deliver(watcher, chunk(5, end=True))
    assert (r.inflight, r.est_blocks, r.est_prefill) == (0, 0, 0)
    session.close()
    watcher.close()
    assert counter(handler, UNOBSERVED) == 0


@pytest.mark.parametrize("source", ["routing", "observer"])
def test_either_stream_alone_counts_the_output(source: str) -> None:
    handler = make()
    if source == "routing":
        session = routed(handler, body_mode=PM.STREAMED)
        stream: RequestSession | ObserverSession = session
    else:
        session = routed(handler)
        stream = observer(handler)
    reply(session, response_headers(200, extra=SSE))
    for _ in range(4):
        deliver(stream, chunk(10))
    r = rank(handler)
    assert (r.inflight, r.est_prefill, r.est_blocks) == (1, 0, 4)  # ceil((10 + 40) / 16)
    session.close()
    assert (r.inflight, r.est_blocks) == (0, 0)
    assert counter(handler, UNOBSERVED) == 0


def test_an_sse_body_is_counted_as_a_stream_without_its_content_type() -> None:
    handler = make()
    session = routed(handler, body_mode=PM.STREAMED)  # decided on the headers: no "stream"
    reply(session, response_headers(200))
    for _ in range(2):
        deliver(session, chunk(10))
    assert session.st.routed is not None and session.st.routed.ticket.generated == 20
    assert (rank(handler).est_prefill, rank(handler).est_blocks) == (0, 2)


def test_without_a_stream_that_delivers_the_body_prefill_ends_at_the_headers() -> None:
    handler = make()
    session = routed(handler, body_mode=PM.NONE)
    reply(session, response_headers(200, extra=SSE))
    assert (rank(handler).est_prefill, rank(handler).est_blocks) == (0, 1)


# ----- a streamed response whose body reached no stream ------------------------------------


def _stream_without_body(handler: ExtProcHandler, **kwargs: object) -> RequestSession:
    session = routed(handler, **kwargs)  # type: ignore[arg-type]
    reply(session, response_headers(200, extra=SSE))
    return session


def test_streams_ending_unobserved_are_counted_and_warned_once(
    caplog: pytest.LogCaptureFixture,
) -> None:
    handler = make()
    caplog.set_level(logging.WARNING, "extproc.handlers")
    for n in (1, 2, 3):
        session = _stream_without_body(handler, request_id=f"r{n}")
        reply(session, trailers())  # the response ended (a trailers message, or none)
        session.close()
        assert counter(handler, UNOBSERVED) == n
    warnings = [r.getMessage() for r in caplog.records if WARNING in r.getMessage()]
    assert len(warnings) == 1, warnings
    assert "use envoy/envoy-track-output.yaml, or stream the response body" in warnings[0]
    view = workers_view(handler.pool, metrics=handler.metrics)["output_tracking"]
    assert view["unobserved_responses"] == 3
    assert 0 <= view["last_unobserved_age_s"] < 60
    assert "use envoy/envoy-track-output.yaml" in view["warning"]
    # Once the wiring is fixed the warning goes away; the counter keeps the total.
    assert handler.metrics.output_unobserved_at is not None
    handler.metrics.output_unobserved_at -= UNOBSERVED_WARNING_SECONDS
    view = workers_view(handler.pool, metrics=handler.metrics)["output_tracking"]
    assert view["unobserved_responses"] == 3
    assert view["warning"] is None


def test_without_the_flag_nothing_is_reported(caplog: pytest.LogCaptureFixture) -> None:
    handler = make(track=False)
    _stream_without_body(handler).close()
    assert counter(handler, UNOBSERVED) == 0
    assert not [r for r in caplog.records if WARNING in r.getMessage()]
    view = workers_view(handler.pool, metrics=handler.metrics)["output_tracking"]
    assert view == {
        "track_output_blocks": False,
        "unobserved_responses": 0,
        "last_unobserved_age_s": None,
        "warning": None,
    }


@pytest.mark.parametrize(
    "case",
    ["body-seen", "routing-streams-client-left-early", "observer-paired", "not-2xx", "json"],
)
def test_responses_that_are_not_reported(case: str) -> None:
    handler = make()
    if case == "body-seen":  # a config without protocol_config that streams the body
        session = _stream_without_body(handler)
        reply(session, chunk(2))
    elif case == "routing-streams-client-left-early":  # gone before the first token
        session = _stream_without_body(handler, body_mode=PM.STREAMED)
    elif case == "observer-paired":  # its chunks may arrive after the routing stream ends
        session = routed(handler)
        observer(handler)
        reply(session, response_headers(200, extra=SSE))
    elif case == "not-2xx":
        session = routed(handler)
        reply(session, response_headers(500, extra=SSE))
    else:  # a non-streamed response
        session = routed(handler)
        reply(session, response_headers(200, extra={"content-type": "application/json"}))
    session.close()
    assert counter(handler, UNOBSERVED) == 0


def test_an_observer_that_receives_no_body_does_not_count_as_one() -> None:
    handler = make()
    session = routed(handler)
    observer(handler, body_mode=PM.NONE)
    reply(session, response_headers(200, extra=SSE))
    session.close()
    assert counter(handler, UNOBSERVED) == 1


def test_a_stream_decided_on_its_body_is_reported_too() -> None:
    handler = make()
    session = handler.open_session({})
    assert isinstance(session, RequestSession)
    reply(session, headers(CHAT, extra={"x-request-id": "r1"}))
    resp = reply(session, body({"model": "m", "stream": True, "prompt": "hi"}))
    assert resp.WhichOneof("response") == "request_body"
    reply(session, response_headers(200, extra=SSE))
    session.close()
    assert counter(handler, UNOBSERVED) == 1
