"""Fuzzing ext_proc sessions: random messages in random order, then the real HTTP/2 server.

Properties of a session (``ExtProcHandler.open_session``):
- ``receive`` raises for one thing only: bytes that do not parse as a ``ProcessingRequest``
  (``google.protobuf.message.DecodeError``). Envoy never sends such bytes; the transport
  ends that stream with grpc-status INTERNAL (``H2Connection._deliver``), a clean stream end
  that closes the session and releases its estimate. Anything that parses gets a reply.
- a routing session's reply is bytes that parse as a ``ProcessingResponse`` whose oneof is
  the phase asked (``request_headers`` for a message with no phase) or an
  ``immediate_response`` that is not the 500 of a caught handler error; an observer
  session replies ``None``; no handler error is logged.
- after ``close()`` every router estimate in the pool is 0 (inflight, blocks, prefill).
Cases are drawn by derandomized hypothesis runs (the same cases every run).
"""

from __future__ import annotations

import asyncio
import json
import logging
from collections.abc import Iterator
from typing import Any

import grpc
import pytest
from envoy.config.core.v3 import base_pb2
from envoy.service.ext_proc.v3 import external_processor_pb2 as ep
from google.protobuf.message import DecodeError
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from extproc.core.busy import BusyThresholds
from extproc.core.pool import WorkerPool
from extproc.core.scheduling import Scheduler
from extproc.handlers import replies
from extproc.handlers.processor import PROCESS_PATH, ROLE_METADATA, ExtProcHandler
from extproc.handlers.router_queue import RouterQueue
from extproc.metrics.registry import Metrics
from extproc.transport.h2server import GrpcServer

EXAMPLES = 120
STREAMS = 40
RUN = {"examples": 0, "messages": 0, "undecodable": 0, "immediate": 0, "routed": 0, "deferred": 0}

PHASES = [
    "request_headers",
    "request_body",
    "request_trailers",
    "response_headers",
    "response_body",
    "response_trailers",
    None,
]
CHAT = "/v1/chat/completions"
MB = 1_000_000


class Clock:
    t = 100.0

    def __call__(self) -> float:
        return self.t


def make_handler(queued: bool = False) -> ExtProcHandler:
    """Two models on three workers; ``queued``: a router queue that a few requests fill."""
    share = 0.5 if queued else None
    pool = WorkerPool(BusyThresholds(0.5, 100_000), queue_threshold=share, clock=Clock())
    batch = 8 if queued else None  # queue limit floor(0.5 x 8) = 4 prefill tokens a worker
    pool.announce("a", model="m", endpoint="127.0.0.1:8000", kv_total_blocks=1000,
                  max_num_batched_tokens=batch)  # fmt: skip
    pool.announce("b", model="m", endpoint="127.0.0.1:8001", kv_total_blocks=50, dp_size=2,
                  max_num_batched_tokens=batch)  # fmt: skip
    pool.announce("c", model="n", endpoint="127.0.0.1:8002", kv_total_blocks=10,
                  max_num_batched_tokens=batch)  # fmt: skip
    queue = RouterQueue(0.2) if queued else None
    if queue is not None:
        pool.on_capacity = queue.notify
    return ExtProcHandler(pool, Scheduler(pool, queue_threshold=share), Metrics(), queue=queue)


def estimates(pool: WorkerPool) -> list[tuple[str, int, int, int, int]]:
    """Every rank whose router estimate is not 0."""
    return [
        (w.worker_id, r.index, r.inflight, r.est_blocks, r.est_prefill)
        for w, r in pool.inflight()
        if r.inflight or r.est_blocks or r.est_prefill
    ]


# ----- messages --------------------------------------------------------------------------

header_keys = st.one_of(
    st.sampled_from(
        [":path", ":method", ":status", "x-request-id", "x-worker-overloaded", "content-type"]
    ),
    st.text(max_size=10),
)
header_values = st.one_of(
    st.sampled_from(
        [
            CHAT,
            "/v1/completions",
            "/v1/models",
            "/v1/other?x=1",
            "POST",
            "GET",
            "HEAD",
            "200",
            "529",
            "503",
            "abc",
            "",
            "1",
            " 1 ",
            "-5",
            "99999999999999999999",
            "r1",
        ]
    ),
    st.text(max_size=20),
)


@st.composite
def header_map(draw: st.DrawFn) -> base_pb2.HeaderMap:
    pairs = draw(st.lists(st.tuples(header_keys, header_values), max_size=6))
    if draw(st.booleans()):  # most streams look like an inference request
        pairs = [(":path", CHAT), (":method", "POST"), *pairs]
    giant = draw(st.integers(0, 19))
    if giant == 0:  # many headers
        pairs += [(f"x-h{i}", "y" * 20) for i in range(2000)]
    elif giant == 1:  # a gigantic value
        pairs.append((draw(header_keys), "v" * MB))
    raw = draw(st.booleans())
    return base_pb2.HeaderMap(
        headers=[
            base_pb2.HeaderValue(key=k, raw_value=v.encode("utf-8", "surrogatepass"))
            if raw
            else base_pb2.HeaderValue(key=k, value=v)
            for k, v in pairs
        ]
    )


json_bodies = st.one_of(
    st.fixed_dictionaries(
        {"model": st.sampled_from(["m", "n", "ghost"])},
        optional={
            "messages": st.one_of(
                st.just([{"role": "user", "content": "hi"}]),
                st.integers(0, 9).map(lambda i: [{"content": "x" * (MB if i == 0 else 10)}]),
                st.lists(st.dictionaries(st.text(max_size=5), st.text(max_size=5)), max_size=3),
                st.integers(),
            ),
            "prompt": st.one_of(st.text(max_size=30), st.just(["a", "b"]), st.none()),
            "stream": st.one_of(st.booleans(), st.just("yes")),
            "max_tokens": st.integers(),
        },
    ),
    st.recursive(
        st.one_of(st.none(), st.booleans(), st.integers(), st.floats(), st.text(max_size=8)),
        lambda inner: st.one_of(
            st.lists(inner, max_size=3), st.dictionaries(st.text(max_size=6), inner, max_size=3)
        ),
        max_leaves=6,
    ),
)
bodies = st.one_of(
    json_bodies.map(lambda v: json.dumps(v).encode()),
    st.binary(max_size=40),
    st.sampled_from([b"", b"{", b"{not json", b"[1]", b"null", b'{"model": 1}', b"\xff\xfe"]),
    st.sampled_from(
        [
            b'data: {"choices": [{"delta": {"content": "a"}}]}\n\n',
            b'{"usage": {"completion_tokens": 5}}',
            b'{"usage": {"completion_tokens": -3}}',
            b"data: [DONE]\n\n",
        ]
    ),
)


@st.composite
def message(draw: st.DrawFn) -> bytes:
    if draw(st.integers(0, 9)) == 0:
        return draw(st.binary(max_size=60))
    phase = draw(st.sampled_from(PHASES))
    end = draw(st.booleans())
    if phase in ("request_headers", "response_headers"):
        hm = draw(header_map()) if draw(st.integers(0, 5)) else None
        msg = ep.ProcessingRequest(**{phase: ep.HttpHeaders(headers=hm, end_of_stream=end)})
    elif phase in ("request_body", "response_body"):
        msg = ep.ProcessingRequest(**{phase: ep.HttpBody(body=draw(bodies), end_of_stream=end)})
    elif phase is not None:
        msg = ep.ProcessingRequest(**{phase: ep.HttpTrailers(trailers=draw(header_map()))})
    else:
        msg = ep.ProcessingRequest()
    return msg.SerializeToString()


@st.composite
def stream_messages(draw: st.DrawFn) -> list[bytes]:
    """Often the real order (headers, body, response headers, body), then random."""
    out = []
    prefix = draw(st.sampled_from(["none", "headers", "routed"]))
    if prefix != "none":
        out.append(
            ep.ProcessingRequest(
                request_headers=ep.HttpHeaders(
                    headers=base_pb2.HeaderMap(
                        headers=[
                            base_pb2.HeaderValue(key=":path", raw_value=CHAT.encode()),
                            base_pb2.HeaderValue(key=":method", raw_value=b"POST"),
                            base_pb2.HeaderValue(key="x-request-id", raw_value=b"r1"),
                        ]
                    )
                )
            ).SerializeToString()
        )
    if prefix == "routed":
        body = json.dumps({"model": draw(st.sampled_from("mn")), "prompt": "hi"}).encode()
        out.append(
            ep.ProcessingRequest(
                request_body=ep.HttpBody(body=body, end_of_stream=True)
            ).SerializeToString()
        )
    out += draw(st.lists(message(), min_size=1, max_size=6))
    return out


# ----- one message, checked --------------------------------------------------------------


def _parses(message: bytes) -> str | None:
    """The phase of a message, or raise DecodeError."""
    return ep.ProcessingRequest.FromString(message).WhichOneof("request")


def check_reply(message: bytes, reply: Any) -> bool:
    """Check one reply; True if it is the first half of a deferred one (more to read)."""
    RUN["messages"] += 1
    phase = _parses(message)
    assert isinstance(reply, bytes), type(reply)  # no router queue in-process: not deferred
    resp = ep.ProcessingResponse.FromString(reply)
    got = resp.WhichOneof("response")
    if got is None and resp.HasField("override_message_timeout"):
        assert phase == "request_body", phase  # only a decision waits in the queue
        RUN["deferred"] += 1
        return True
    if got == "immediate_response":
        assert reply != replies.INTERNAL_ERROR, "a handler error became a 500"
        # /v1/models (200), bad request, model not found, no workers, overloaded
        assert resp.immediate_response.status.code in (200, 400, 404, 503, 529), resp
        RUN["immediate"] += 1
        return False
    assert got == (phase or "request_headers"), (phase, got)
    if resp.request_body.response.header_mutation.set_headers:
        RUN["routed"] += 1
    return False


class _Errors(logging.Handler):
    def __init__(self) -> None:
        super().__init__(logging.ERROR)
        self.records: list[logging.LogRecord] = []

    def emit(self, record: logging.LogRecord) -> None:
        # Logged and let through, as processor.py does: bytes that do not parse on an
        # observer stream; a response ``:status`` that is not a number (Envoy sends 3 digits).
        exc = record.exc_info[0] if record.exc_info else None
        message = record.getMessage()
        if exc is DecodeError and message == "error counting output tokens; ignored":
            return
        if exc is ValueError and message == "error handling ext_proc response_headers message":
            return
        self.records.append(record)


@pytest.fixture
def handler_errors() -> Iterator[_Errors]:
    errors = _Errors()
    log = logging.getLogger("extproc.handlers")
    log.addHandler(errors)
    yield errors
    log.removeHandler(errors)


def run_sessions(handler: ExtProcHandler, streams: list[tuple[bool, list[bytes]]]) -> None:
    """Open one session per stream, deliver their messages interleaved, close them all."""
    sessions = [
        (handler.open_session({ROLE_METADATA: "observe"} if observe else {}), list(msgs))
        for observe, msgs in streams
    ]
    while any(msgs for _, msgs in sessions):
        for session, msgs in sessions:
            if not msgs:
                continue
            msg = msgs.pop(0)
            try:
                reply = session.receive(msg)
            except DecodeError:
                with pytest.raises(DecodeError):
                    _parses(msg)
                RUN["undecodable"] += 1
                msgs.clear()  # the transport ends this stream
                continue
            if type(session).__name__ == "ObserverSession":
                assert reply is None  # an observer swallows even undecodable bytes
                RUN["messages"] += 1
            else:
                check_reply(msg, reply)
    for session, _ in sessions:
        session.close()


@settings(
    max_examples=EXAMPLES,
    derandomize=True,
    deadline=None,
    database=None,
    suppress_health_check=list(HealthCheck),
)
@given(streams=st.lists(st.tuples(st.integers(0, 4).map(lambda i: i == 0), stream_messages()),
                        min_size=1, max_size=3))  # fmt: skip
def _fuzz_sessions(streams: list[tuple[bool, list[bytes]]]) -> None:
    handler = make_handler()
    run_sessions(handler, streams)
    assert estimates(handler.pool) == []
    assert handler.inflight.live == {}
    RUN["examples"] += 1


def test_fuzzed_sessions_reply_or_end_cleanly_and_release_every_estimate(
    handler_errors: _Errors,
) -> None:
    RUN.update(dict.fromkeys(RUN, 0))
    _fuzz_sessions()
    print(f"\next_proc session fuzz: {RUN}")
    assert handler_errors.records == [], [r.getMessage() for r in handler_errors.records]
    assert RUN["examples"] == EXAMPLES
    assert RUN["undecodable"] > 5 and RUN["immediate"] > 20 and RUN["routed"] > 20


# ----- through the builtin HTTP/2 server and grpcio's client ------------------------------


def _seeded_streams(n: int) -> list[list[bytes]]:
    out: list[list[bytes]] = []

    @settings(
        max_examples=n,
        derandomize=True,
        deadline=None,
        database=None,
        suppress_health_check=list(HealthCheck),
    )
    @given(msgs=stream_messages())
    def collect(msgs: list[bytes]) -> None:
        out.append(msgs)

    collect()
    assert len(out) >= n // 2
    return out


async def _one_stream(channel: grpc.aio.Channel, msgs: list[bytes]) -> tuple[str, int]:
    """Send the messages one by one, reading each reply; (how it ended, replies read)."""
    call = channel.stream_stream(
        PROCESS_PATH, request_serializer=None, response_deserializer=None
    )()
    n = 0
    for msg in msgs:
        try:
            await call.write(msg)
        except (grpc.aio.AioRpcError, asyncio.InvalidStateError):
            break  # the server already ended the stream
        try:
            reply = await call.read()
        except grpc.aio.AioRpcError:  # ended with a non-OK status: checked below
            break
        if reply is grpc.aio.EOF:
            break
        if check_reply(msg, reply):  # waits in the router queue: the decision follows
            rest = await call.read()
            assert rest is not grpc.aio.EOF
            assert not check_reply(msg, rest)
        n += 1
    else:
        await call.done_writing()
        assert await call.read() is grpc.aio.EOF
    code = await call.code()
    if code != grpc.StatusCode.OK:
        # Only a message that is not a ProcessingRequest ends a stream early.
        assert code == grpc.StatusCode.INTERNAL, (code, await call.details())
        bad = msgs[n]
        with pytest.raises(DecodeError):
            _parses(bad)
    return code.name, n


async def _hold(channel: grpc.aio.Channel, model: str) -> grpc.aio.StreamStreamCall:
    """A routed request that stays in flight: its prompt fills a rank's queue limit."""
    call = channel.stream_stream(
        PROCESS_PATH, request_serializer=None, response_deserializer=None
    )()
    headers, _ = stream_messages_valid()
    await call.write(headers)
    await call.read()
    body = json.dumps({"model": model, "prompt": "x" * 400}).encode()
    await call.write(
        ep.ProcessingRequest(
            request_body=ep.HttpBody(body=body, end_of_stream=True)
        ).SerializeToString()
    )
    resp = ep.ProcessingResponse.FromString(await call.read())
    assert resp.request_body.response.header_mutation.set_headers, resp  # routed
    return call


@pytest.mark.parametrize("queued", [False, True], ids=["direct", "router-queue"])
async def test_fuzzed_streams_through_the_http2_server_end_cleanly_and_it_keeps_serving(
    handler_errors: _Errors, queued: bool
) -> None:
    """Streams go 8 at a time, so with a router queue some wait and get a deferred reply."""
    handler = make_handler(queued)
    server = GrpcServer(PROCESS_PATH, handler.open_session)
    await server.start("127.0.0.1", 0)
    options = [("grpc.max_receive_message_length", -1), ("grpc.max_send_message_length", -1)]
    ended: dict[str, int] = {}
    RUN["deferred"] = 0
    streams = _seeded_streams(STREAMS)
    try:
        async with grpc.aio.insecure_channel(
            f"127.0.0.1:{server.ports[0]}", options=options
        ) as channel:
            holders = [await _hold(channel, model) for model in "mmmn"] if queued else []
            for i in range(0, len(streams), 8):
                batch = [_one_stream(channel, msgs) for msgs in streams[i : i + 8]]
                for code, _ in await asyncio.wait_for(asyncio.gather(*batch), 10):
                    ended[code] = ended.get(code, 0) + 1
            for call in holders:
                await call.done_writing()
                assert await call.read() is grpc.aio.EOF
            # Still serving: a valid request is routed.
            valid = stream_messages_valid()
            code, n = await asyncio.wait_for(_one_stream(channel, valid), 10)
            assert (code, n) == ("OK", 2)
        loop = asyncio.get_running_loop()
        deadline = loop.time() + 5
        while handler.metrics.registry.get_sample_value("extproc_streams"):  # sessions close
            assert loop.time() < deadline, "sessions not closed"
            await asyncio.sleep(0.01)
        assert estimates(handler.pool) == []
    finally:
        await server.stop(1.0)
    print(
        f"\next_proc fuzz through HTTP/2 ({'router queue' if queued else 'direct'}): "
        f"{sum(ended.values())} streams, ended {ended}, deferred replies {RUN['deferred']}"
    )
    assert handler_errors.records == [], [r.getMessage() for r in handler_errors.records]
    assert ended.get("OK", 0) > len(streams) // 2 and ended.get("INTERNAL", 0) >= 1
    assert (RUN["deferred"] > 0) is queued


def stream_messages_valid(request_id: str | None = None) -> list[bytes]:
    pairs = [(":path", CHAT), (":method", "POST")]
    if request_id is not None:
        pairs.append(("x-request-id", request_id))
    headers = ep.ProcessingRequest(
        request_headers=ep.HttpHeaders(
            headers=base_pb2.HeaderMap(
                headers=[base_pb2.HeaderValue(key=k, raw_value=v.encode()) for k, v in pairs]
            )
        )
    )
    body = ep.ProcessingRequest(
        request_body=ep.HttpBody(body=b'{"model": "m", "prompt": "hi"}', end_of_stream=True)
    )
    return [headers.SerializeToString(), body.SerializeToString()]


def test_a_second_request_body_after_routing_is_let_through_and_leaks_no_estimate() -> None:
    """Found by fuzzing: a second body decided again and the first estimate was never freed."""
    handler = make_handler()
    session = handler.open_session({})
    headers, body = stream_messages_valid()
    session.receive(headers)
    first = ep.ProcessingResponse.FromString(session.receive(body))
    assert first.request_body.response.header_mutation.set_headers  # routed
    assert len(estimates(handler.pool)) == 1
    again = session.receive(body)
    assert again == replies.CONTINUE_REQUEST_BODY
    assert len(estimates(handler.pool)) == 1
    session.close()
    assert estimates(handler.pool) == []


def test_request_headers_again_after_routing_change_nothing_and_leak_no_stream() -> None:
    """Found by fuzzing: a second x-request-id left the first in the live map forever."""
    handler = make_handler()
    session = handler.open_session({})
    headers, body = stream_messages_valid(request_id="r1")
    session.receive(headers)
    session.receive(body)
    assert set(handler.inflight.live) == {"r1"}
    again, _ = stream_messages_valid(request_id="r2")
    assert session.receive(again) == replies.CONTINUE_REQUEST_HEADERS
    assert set(handler.inflight.live) == {"r1"}
    session.close()
    assert handler.inflight.live == {} and estimates(handler.pool) == []
