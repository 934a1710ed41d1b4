"""The Endpoint Picker protocol mode of the handler, with plain protobuf messages: the
subset hint read from the request's metadata, and the replies it gets."""

from __future__ import annotations

import json
import logging

import pytest
from envoy.config.core.v3 import base_pb2
from envoy.extensions.filters.http.ext_proc.v3 import processing_mode_pb2
from envoy.service.ext_proc.v3 import external_processor_pb2 as ep
from google.protobuf import struct_pb2

from extproc.core.busy import BusyThresholds
from extproc.core.pool import WorkerPool
from extproc.core.scheduling import Scheduler
from extproc.handlers import processor, replies
from extproc.handlers.processor import ExtProcHandler, RequestSession
from extproc.handlers.replies import DESTINATION_HEADER, LB_NAMESPACE
from extproc.handlers.subset_hint import (
    LOG_EVERY,
    SUBSET_KEY,
    SUBSET_NAMESPACE,
    MalformedHint,
    SubsetHints,
    parse_subset,
)
from extproc.metrics.registry import Metrics

CHAT = "/v1/chat/completions"
A, B = "10.0.0.1:8000", "10.0.0.2:8000"


class Clock:
    t = 100.0

    def __call__(self) -> float:
        return self.t


def make(protocol: str = "epp", fallbacks: int = 0) -> ExtProcHandler:
    pool = WorkerPool(BusyThresholds(0.5), clock=Clock())
    for wid, endpoint, blocks in (("a", A, 1), ("b", B, 0)):
        pool.announce(wid, model="m", endpoint=endpoint, kv_total_blocks=10)
        pool.report_load(wid, active_decode_blocks=blocks)
    return ExtProcHandler(
        pool, Scheduler(pool, max_fallbacks=fallbacks), Metrics(), protocol=protocol
    )


def value(hint: object) -> struct_pb2.Value:
    v = struct_pb2.Value()
    if isinstance(hint, list):
        v.list_value.SetInParent()
        v.list_value.extend(hint)
    elif isinstance(hint, str):
        v.string_value = hint
    elif isinstance(hint, bool):
        v.bool_value = hint
    elif isinstance(hint, (int, float)):
        v.number_value = hint
    elif isinstance(hint, dict):
        v.struct_value.update(hint)
    return v


def request_headers(hint: object = None, extra: dict[str, str] | None = None) -> bytes:
    pairs = {":path": CHAT, ":method": "POST", **(extra or {})}
    hm = base_pb2.HeaderMap(
        headers=[base_pb2.HeaderValue(key=k, raw_value=v.encode()) for k, v in pairs.items()]
    )
    req = ep.ProcessingRequest(request_headers=ep.HttpHeaders(headers=hm))
    if hint is not None:
        req.metadata_context.filter_metadata[SUBSET_NAMESPACE].fields[SUBSET_KEY].CopyFrom(
            value(hint)
        )
    return req.SerializeToString()


def body(model: str = "m") -> bytes:
    raw = json.dumps({"model": model, "messages": [{"content": "hi"}]}).encode()
    return ep.ProcessingRequest(
        request_body=ep.HttpBody(body=raw, end_of_stream=True)
    ).SerializeToString()


def decide(handler: ExtProcHandler, hint: object = None, **kw: str) -> ep.ProcessingResponse:
    """The reply that decides one chat request (on its headers or on its body)."""
    session = handler.open_session({})
    assert isinstance(session, RequestSession)
    raw = session.receive(request_headers(hint, kw or None))
    assert isinstance(raw, bytes)
    first = ep.ProcessingResponse.FromString(raw)
    if first.WhichOneof("response") == "immediate_response":
        return first
    raw = session.receive(body())
    assert isinstance(raw, bytes)
    return ep.ProcessingResponse.FromString(raw)


def destination(resp: ep.ProcessingResponse) -> tuple[str, str]:
    """(header value, envoy.lb metadata value) of a routing reply."""
    common = resp.request_body.response
    sets = {h.header.key: h.header.raw_value.decode() for h in common.header_mutation.set_headers}
    meta = resp.dynamic_metadata.fields[LB_NAMESPACE].struct_value.fields
    return sets[DESTINATION_HEADER], meta[DESTINATION_HEADER].string_value


def test_the_pick_goes_in_header_and_metadata_alike_and_nothing_else() -> None:
    resp = decide(make())
    header, meta = destination(resp)
    assert header == meta == B  # the less loaded
    common = resp.request_body.response
    assert [h.header.key for h in common.header_mutation.set_headers] == [DESTINATION_HEADER]
    assert list(common.header_mutation.remove_headers) == []
    assert common.clear_route_cache


def test_with_fallbacks_the_list_is_the_same_in_header_and_metadata() -> None:
    header, meta = destination(decide(make(fallbacks=2)))
    assert header == meta == f"{B},{A}"


def test_the_envoy_protocol_ignores_the_subset_hint() -> None:
    resp = decide(make("envoy"), [A])
    sets = {h.header.key: h.header.raw_value.decode() for h in
            resp.request_body.response.header_mutation.set_headers}  # fmt: skip
    assert sets[DESTINATION_HEADER] == B
    assert "x-envoy-max-retries" in sets  # the shipped Envoy wiring's reply


@pytest.mark.parametrize("hint", [[A], A, f" {A} ,", [f"{A},{A}"]])
def test_the_subset_in_each_shape_is_honoured(hint: object) -> None:
    assert destination(decide(make(), hint)) == (A, A)


@pytest.mark.parametrize("hint", [[], "", " , "])
def test_an_empty_subset_is_an_immediate_503_on_the_headers(hint: object) -> None:
    resp = decide(make(), hint)
    assert resp.WhichOneof("response") == "immediate_response"
    assert resp.immediate_response.status.code == 503
    assert json.loads(resp.immediate_response.body)["code"] == 503


def test_every_subset_endpoint_busy_is_the_overload_reply() -> None:
    handler = make()
    handler.pool.report_load("a", active_decode_blocks=9)
    resp = decide(handler, [A])
    imm = resp.immediate_response
    assert imm.status.code == 529
    hdrs = {h.header.key: h.header.raw_value.decode() for h in imm.headers.set_headers}
    assert hdrs["x-shed-reason"] == "active_decode_blocks_threshold"
    assert 1 <= int(hdrs["retry-after"]) <= 60


def test_an_unknown_model_is_404_as_in_the_envoy_wiring() -> None:
    session = make().open_session({})
    assert isinstance(session, RequestSession)
    session.receive(request_headers([A]))
    raw = session.receive(body("nope"))
    assert isinstance(raw, bytes)
    assert ep.ProcessingResponse.FromString(raw).immediate_response.status.code == 404


@pytest.mark.parametrize(
    ("hint", "says"),
    [
        (7, "number_value"),
        (True, "bool_value"),
        ({"a": 1}, "struct_value"),
        ([1], "list entry 1.0 is not a string"),
        (["10.0.0.1"], "'10.0.0.1' is not host:port"),
        ("pod-a:8000", "'pod-a' is not an IP address"),
        ("10.0.0.1:99999", "outside 1-65535"),
    ],
)
def test_a_malformed_hint_is_absent_and_logged_naming_it(
    hint: object, says: str, caplog: pytest.LogCaptureFixture
) -> None:
    handler = make()
    handler.pool.report_load("b", active_decode_blocks=9)  # only a is free
    with caplog.at_level(logging.WARNING, "extproc.handlers"):
        assert destination(decide(handler, hint)) == (A, A)
    (line,) = [r.getMessage() for r in caplog.records]
    assert says in line and SUBSET_KEY in line and "expected a list of" in line
    assert handler.subset_hints is not None and handler.subset_hints.malformed == 1
    assert handler.metrics.registry.get_sample_value("extproc_subset_hint_malformed_total") == 1


def test_malformed_hints_are_logged_at_most_once_a_minute_with_a_count() -> None:
    clock = Clock()
    hints = SubsetHints(clock)
    meta = {SUBSET_NAMESPACE: struct_pb2.Struct()}
    meta[SUBSET_NAMESPACE].fields[SUBSET_KEY].CopyFrom(value(7))
    logger = logging.getLogger("extproc.handlers")
    seen: list[str] = []
    handler = logging.Handler()
    handler.emit = lambda record: seen.append(record.getMessage())  # type: ignore[method-assign]
    logger.addHandler(handler)
    try:
        for _ in range(50):
            assert hints.read(meta) is None
        clock.t += LOG_EVERY / 2
        assert hints.read(meta) is None
        assert len(seen) == 1 and "(1 malformed hint(s)" in seen[0]
        clock.t += LOG_EVERY
        assert hints.read(meta) is None
        assert len(seen) == 2 and "(51 malformed hint(s)" in seen[1]
    finally:
        logger.removeHandler(handler)
    assert hints.malformed == 52


def test_parse_subset_keeps_order_and_drops_repeats() -> None:
    assert parse_subset(value([B, f"{A}, {B}", "[::1]:80"])) == (B, A, "[::1]:80")
    with pytest.raises(MalformedHint):
        parse_subset(struct_pb2.Value())


def test_absent_hints_read_as_none() -> None:
    hints = SubsetHints()
    assert hints.read({}) is None
    other = struct_pb2.Struct()
    other.update({"something-else": [A]})
    assert hints.read({SUBSET_NAMESPACE: other}) is None


# ----- FULL_DUPLEX_STREAMED bodies -------------------------------------------------------

DUPLEX = processing_mode_pb2.ProcessingMode.FULL_DUPLEX_STREAMED


def duplex_headers(path: str = CHAT, method: str = "POST") -> bytes:
    hm = base_pb2.HeaderMap(
        headers=[
            base_pb2.HeaderValue(key=":path", raw_value=path.encode()),
            base_pb2.HeaderValue(key=":method", raw_value=method.encode()),
        ]
    )
    req = ep.ProcessingRequest(request_headers=ep.HttpHeaders(headers=hm))
    req.protocol_config.request_body_mode = DUPLEX
    req.protocol_config.response_body_mode = DUPLEX
    return req.SerializeToString()


def chunk(kind: str, data: bytes, end: bool) -> bytes:
    body = ep.HttpBody(body=data, end_of_stream=end)
    if kind == "request_body":
        return ep.ProcessingRequest(request_body=body).SerializeToString()
    return ep.ProcessingRequest(response_body=body).SerializeToString()


def streamed(raw: bytes, kind: str) -> tuple[bytes, bool]:
    resp = ep.ProcessingResponse.FromString(raw)
    assert resp.WhichOneof("response") == kind
    out = getattr(resp, kind).response.body_mutation.streamed_response
    return out.body, out.end_of_stream


def test_a_duplex_body_is_gathered_then_the_headers_answered_and_the_body_sent_on() -> None:
    handler = make()
    session = handler.open_session({})
    assert isinstance(session, RequestSession)
    raw = json.dumps({"model": "m", "messages": [{"content": "hi"}]}).encode()
    assert session.receive(duplex_headers()) is None
    assert session.receive(chunk("request_body", raw[:10], False)) is None
    out = session.receive(chunk("request_body", raw[10:], True))
    assert isinstance(out, list) and len(out) == 2
    first = ep.ProcessingResponse.FromString(out[0])
    assert first.WhichOneof("response") == "request_headers"
    sets = {h.header.key: h.header.raw_value.decode()
            for h in first.request_headers.response.header_mutation.set_headers}  # fmt: skip
    meta = first.dynamic_metadata.fields[LB_NAMESPACE].struct_value.fields
    assert sets[DESTINATION_HEADER] == meta[DESTINATION_HEADER].string_value == B
    assert streamed(out[1], "request_body") == (raw, True)
    # The response body goes back chunk by chunk, and the estimate ends with it.
    worker = handler.pool.workers["b"]
    assert worker.ranks[0].inflight == 1
    ok = ep.ProcessingRequest(
        response_headers=ep.HttpHeaders(
            headers=base_pb2.HeaderMap(
                headers=[base_pb2.HeaderValue(key=":status", raw_value=b"200")]
            )
        )
    )
    reply = session.receive(ok.SerializeToString())
    assert isinstance(reply, bytes)
    assert ep.ProcessingResponse.FromString(reply).HasField("response_headers")
    reply = session.receive(chunk("response_body", b'{"usage":', False))
    assert isinstance(reply, bytes) and streamed(reply, "response_body") == (b'{"usage":', False)
    reply = session.receive(chunk("response_body", b"{}}", True))
    assert isinstance(reply, bytes) and streamed(reply, "response_body") == (b"{}}", True)
    assert worker.ranks[0].inflight == 0


def test_a_rejected_duplex_body_is_the_one_local_reply() -> None:
    handler = make()
    handler.pool.report_load("a", active_decode_blocks=9)
    handler.pool.report_load("b", active_decode_blocks=9)
    session = handler.open_session({})
    assert isinstance(session, RequestSession)
    assert session.receive(duplex_headers()) is not None  # every worker busy: on the headers
    session = handler.open_session({})
    assert isinstance(session, RequestSession)
    handler.pool.report_load("b", active_decode_blocks=0)
    assert session.receive(duplex_headers()) is None
    out = session.receive(chunk("request_body", b"{not json", True))
    assert isinstance(out, bytes)
    assert ep.ProcessingResponse.FromString(out).immediate_response.status.code == 400


def test_a_duplex_passthrough_sends_every_chunk_on() -> None:
    session = make().open_session({})
    assert isinstance(session, RequestSession)
    first = session.receive(duplex_headers("/v1/other"))
    assert first == replies.PASSTHROUGH_DUPLEX
    out = session.receive(chunk("request_body", b"abc", True))
    assert isinstance(out, bytes) and streamed(out, "request_body") == (b"abc", True)


def test_a_duplex_body_larger_than_the_limit_is_400(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(processor, "MAX_DUPLEX_BODY", 8)
    session = make().open_session({})
    assert isinstance(session, RequestSession)
    assert session.receive(duplex_headers()) is None
    out = session.receive(chunk("request_body", b"0123456789", False))
    assert isinstance(out, bytes)
    imm = ep.ProcessingResponse.FromString(out).immediate_response
    assert imm.status.code == 400 and b"larger than 8 bytes" in imm.body


# ----- the served host in the response's metadata ----------------------------------------


def response_headers(served: str | None = None, header: str | None = None) -> bytes:
    """A 200 response's headers; ``served`` in the envoy.lb metadata, ``header`` as the
    x-gateway-destination-endpoint-served header (the Envoy wiring's way)."""
    pairs = {":status": "200", "content-type": "application/json"}
    if header is not None:
        pairs[processor.SERVED_HEADER] = header
    hm = base_pb2.HeaderMap(
        headers=[base_pb2.HeaderValue(key=k, raw_value=v.encode()) for k, v in pairs.items()]
    )
    req = ep.ProcessingRequest(response_headers=ep.HttpHeaders(headers=hm))
    if served is not None:
        lb = req.metadata_context.filter_metadata[LB_NAMESPACE]
        lb.fields[processor.SERVED_HEADER].string_value = served
    return req.SerializeToString()


def routed(handler: ExtProcHandler) -> RequestSession:
    """A session whose request was routed (to B, the less loaded)."""
    session = handler.open_session({})
    assert isinstance(session, RequestSession)
    session.receive(request_headers())
    session.receive(body())
    assert session.st.routed is not None and session.st.routed.ticket.worker.endpoint == B
    return session


def inflight(handler: ExtProcHandler) -> dict[str, int]:
    return {wid: w.ranks[0].inflight for wid, w in handler.pool.workers.items()}


def served_elsewhere(handler: ExtProcHandler, served: str) -> float:
    value = handler.metrics.registry.get_sample_value(
        "extproc_served_elsewhere_total", {"model": "m", "served": served}
    )
    return value or 0.0


def test_the_estimate_follows_the_served_host_named_in_the_metadata() -> None:
    handler = make()
    session = routed(handler)
    assert inflight(handler) == {"a": 0, "b": 1}
    session.receive(response_headers(served=A))  # an Envoy retry moved it to A
    assert inflight(handler) == {"a": 1, "b": 0}
    assert handler.pool.workers["b"].state(handler.pool.clock()) == "overloaded"
    assert served_elsewhere(handler, "worker") == 1
    session.close()
    assert inflight(handler) == {"a": 0, "b": 0}


def test_the_served_pick_in_the_metadata_changes_nothing() -> None:
    handler = make()
    session = routed(handler)
    session.receive(response_headers(served=B))
    assert inflight(handler) == {"a": 0, "b": 1}
    assert handler.pool.workers["b"].state(handler.pool.clock()) == "free"
    assert served_elsewhere(handler, "worker") == served_elsewhere(handler, "unknown") == 0


def test_an_unknown_served_host_in_the_metadata_releases_the_estimate() -> None:
    handler = make()
    session = routed(handler)
    session.receive(response_headers(served="10.9.9.9:8000"))
    assert inflight(handler) == {"a": 0, "b": 0}
    assert served_elsewhere(handler, "unknown") == 1


def test_the_envoy_protocol_reads_the_header_not_the_metadata() -> None:
    handler = make(protocol="envoy")
    session = routed(handler)
    session.receive(response_headers(served=A))
    assert inflight(handler) == {"a": 0, "b": 1}
    session.receive(response_headers(header=A))
    assert inflight(handler) == {"a": 1, "b": 0}


@pytest.mark.parametrize("protocol", ["epp", "envoy"])
def test_a_worker_announced_by_host_name_matches_its_address(protocol: str) -> None:
    """B announces ``worker-b:8000``; Envoy names the host it served from by its address.
    Once the name is resolved that address is B: nothing moves, B is not marked."""
    handler = make(protocol=protocol)
    pool = handler.pool
    pool.announce("b", model="m", endpoint="worker-b:8000", kv_total_blocks=10)
    pool.set_addresses("worker-b:8000", frozenset({B}))
    session = routed_to(handler, "worker-b:8000")
    served = {"served": B} if protocol == "epp" else {"header": B}
    session.receive(response_headers(**served))
    assert inflight(handler) == {"a": 0, "b": 1}
    assert pool.workers["b"].state(pool.clock()) == "free"
    assert served_elsewhere(handler, "worker") == served_elsewhere(handler, "unknown") == 0
    # Retried onto a name-announced worker: the estimate finds it by its address too.
    pool.announce("a", model="m", endpoint="worker-a:8000", kv_total_blocks=10)
    pool.set_addresses("worker-a:8000", frozenset({A}))
    pool.report_load("a", active_decode_blocks=4)  # free, more loaded than B
    other = routed_to(handler, "worker-b:8000")
    other.receive(response_headers(**({"served": A} if protocol == "epp" else {"header": A})))
    assert inflight(handler) == {"a": 1, "b": 1}
    assert served_elsewhere(handler, "worker") == 1


def routed_to(handler: ExtProcHandler, endpoint: str) -> RequestSession:
    session = handler.open_session({})
    assert isinstance(session, RequestSession)
    session.receive(request_headers())
    session.receive(body())
    assert session.st.routed is not None
    assert session.st.routed.ticket.worker.endpoint == endpoint
    return session


def test_without_the_name_resolved_the_address_is_another_host() -> None:
    """What the lookup prevents: an unresolved name never matches Envoy's address."""
    handler = make()
    handler.pool.announce("b", model="m", endpoint="worker-b:8000", kv_total_blocks=10)
    session = routed_to(handler, "worker-b:8000")
    session.receive(response_headers(served=B))
    assert served_elsewhere(handler, "unknown") == 1
