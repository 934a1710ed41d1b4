"""The ext_proc handler with plain protobuf messages: no Envoy, no sockets.

Each test feeds a session the serialized messages Envoy would send and reads the
serialized reply back, so it checks the mapping from a decision to the reply bytes.
"""

from __future__ import annotations

import asyncio
import json

import pytest
from envoy.config.core.v3 import base_pb2
from envoy.service.ext_proc.v3 import external_processor_pb2 as ep
from prometheus_client import generate_latest

from extproc.admin.diagnostics import worker_view
from extproc.core.busy import BusyThresholds
from extproc.core.pool import WorkerPool
from extproc.core.scheduling import Scheduler, is_free
from extproc.core.worker import Ticket
from extproc.handlers.processor import (
    REQUEST_NAMESPACE,
    ExtProcHandler,
    ObserverSession,
    RequestSession,
)
from extproc.handlers.replies import DESTINATION_HEADER, LB_NAMESPACE
from extproc.handlers.router_queue import RouterQueue
from extproc.metrics.registry import Metrics

CHAT = "/v1/chat/completions"


class Clock:
    t = 100.0

    def __call__(self) -> float:
        return self.t


HALF = BusyThresholds(0.5)


def make(
    th: BusyThresholds = HALF, status: int = 529, busy_statuses: tuple[int, ...] = (429, 503)
) -> ExtProcHandler:
    pool = WorkerPool(th, clock=Clock())
    return ExtProcHandler(
        pool, Scheduler(pool), Metrics(), overload_status=status, worker_busy_statuses=busy_statuses
    )


def headers(
    path: str,
    method: str = "POST",
    end: bool = False,
    read: str | None = None,
    extra: dict[str, str] | None = None,
) -> bytes:
    """Request headers; ``read``: the model the prefix reader forwarded (None: no reader)."""
    pairs = {":path": path, ":method": method, **(extra or {})}
    hm = base_pb2.HeaderMap(
        headers=[base_pb2.HeaderValue(key=k, raw_value=v.encode()) for k, v in pairs.items()]
    )
    req = ep.ProcessingRequest(request_headers=ep.HttpHeaders(headers=hm, end_of_stream=end))
    if read is not None:
        req.metadata_context.filter_metadata[REQUEST_NAMESPACE].update({"model": read})
    return req.SerializeToString()


def body(payload: object | bytes) -> bytes:
    raw = payload if isinstance(payload, bytes) else json.dumps(payload).encode()
    return ep.ProcessingRequest(
        request_body=ep.HttpBody(body=raw, end_of_stream=True)
    ).SerializeToString()


def response_headers(status: int, end: bool = False, extra: dict[str, str] | None = None) -> bytes:
    pairs = {":status": str(status), **(extra or {})}
    hm = base_pb2.HeaderMap(
        headers=[base_pb2.HeaderValue(key=k, raw_value=v.encode()) for k, v in pairs.items()]
    )
    return ep.ProcessingRequest(
        response_headers=ep.HttpHeaders(headers=hm, end_of_stream=end)
    ).SerializeToString()


def reply(session: RequestSession | ObserverSession, message: bytes) -> ep.ProcessingResponse:
    assert isinstance(session, RequestSession)
    raw = session.receive(message)
    assert isinstance(raw, bytes), raw
    return ep.ProcessingResponse.FromString(raw)


def chat(handler: ExtProcHandler, model: str = "m", content: str = "hi") -> ep.ProcessingResponse:
    """The reply that decides a chat request: on its headers if it can be, else on its body."""
    session = handler.open_session({})
    assert isinstance(session, RequestSession)
    first = reply(session, headers(CHAT))
    if first.WhichOneof("response") == "immediate_response":
        return first
    assert first.WhichOneof("response") == "request_headers"
    return reply(session, body({"model": model, "messages": [{"content": content}]}))


def local(resp: ep.ProcessingResponse) -> tuple[int, dict[str, str], dict[str, object]]:
    imm = resp.immediate_response
    hdrs = {h.header.key: h.header.raw_value.decode() for h in imm.headers.set_headers}
    return imm.status.code, hdrs, json.loads(imm.body)


def counter(handler: ExtProcHandler, name: str, **labels: str) -> float:
    value = handler.metrics.registry.get_sample_value(name, labels)
    return value or 0.0


def test_other_paths_pass_through_and_drop_a_client_destination_header() -> None:
    handler = make()
    session = handler.open_session({})
    resp = reply(session, headers("/v1/other", "GET", extra={DESTINATION_HEADER: "10.0.0.1:1"}))
    mutation = resp.request_headers.response.header_mutation
    assert list(mutation.remove_headers) == [DESTINATION_HEADER]
    assert resp.mode_override.request_body_mode == resp.mode_override.NONE
    assert counter(handler, "extproc_decisions_total", outcome="passthrough") == 1


def test_bad_body_is_400_naming_the_problem() -> None:
    handler = make()
    session = handler.open_session({})
    reply(session, headers(CHAT))
    status, hdrs, payload = local(reply(session, body(b"{not json")))
    assert status == 400 and hdrs["content-type"] == "application/json"
    assert payload["type"] == "Bad Request" and payload["code"] == 400
    assert "JSON" in str(payload["message"])
    empty = handler.open_session({})
    status, _, payload = local(reply(empty, headers(CHAT, end=True)))
    assert status == 400 and "empty" in str(payload["message"])


def test_no_workers_503_and_unknown_model_404() -> None:
    handler = make()
    assert local(chat(handler))[0] == 503
    handler.pool.announce("w", model="other", endpoint="127.0.0.1:9")
    status, _, payload = local(chat(handler))
    assert (status, payload["message"]) == (404, "Model not found")


def test_routed_sets_header_and_metadata_and_close_releases_the_estimate() -> None:
    handler = make()
    pool = handler.pool
    pool.announce("a", model="m", endpoint="127.0.0.1:1", kv_total_blocks=100)
    pool.announce("b", model="m", endpoint="127.0.0.1:2", kv_total_blocks=100)
    pool.report_load("b", active_decode_blocks=90)  # busy: never the pick, never a fallback
    session = handler.open_session({})
    reply(session, headers(CHAT))
    resp = reply(session, body({"model": "m", "prompt": "x" * 400}))
    mutation = resp.request_body.response.header_mutation
    assert {h.header.key: h.header.raw_value for h in mutation.set_headers} == {
        DESTINATION_HEADER: b"127.0.0.1:1",
        "x-envoy-max-retries": b"0",
        "x-envoy-retriable-status-codes": b"429,503",
    }
    assert list(mutation.remove_headers) == []
    meta = resp.dynamic_metadata.fields[LB_NAMESPACE].struct_value.fields
    assert meta[DESTINATION_HEADER].string_value == "127.0.0.1:1"
    rank = pool.workers["a"].ranks[0]
    assert (rank.inflight, rank.est_prefill, rank.est_blocks) == (1, 100, 7)
    session.close()
    session.close()  # idempotent
    assert (rank.inflight, rank.est_prefill, rank.est_blocks) == (0, 0, 0)


def test_every_worker_busy_is_the_overload_reply_with_retry_after() -> None:
    handler = make(status=503)
    handler.pool.announce("a", model="m", endpoint="127.0.0.1:1", kv_total_blocks=10)
    handler.pool.report_load("a", active_decode_blocks=6)
    status, hdrs, payload = local(chat(handler))
    assert status == 503 and hdrs["retry-after"] == "1"
    assert payload == {
        "message": "Service temporarily overloaded",
        "type": "Service Unavailable",
        "code": 503,
    }
    assert (
        counter(
            handler, "dynamo_frontend_model_rejection_total", model="m", endpoint="chat_completions"
        )
        == 1
    )
    # A threshold change is seen by the very next request.
    handler.pool.set_thresholds("m", BusyThresholds(0.9))
    assert chat(handler).WhichOneof("response") == "request_body"


def test_worker_side_rejection_becomes_the_overload_reply_and_marks_the_worker() -> None:
    handler = make(BusyThresholds())
    handler.pool.announce("a", model="m", endpoint="127.0.0.1:1")
    session = handler.open_session({})
    assert isinstance(session, RequestSession)
    reply(session, headers(CHAT))
    reply(session, body({"model": "m", "prompt": "hello"}))
    resp = reply(session, response_headers(503, extra={"x-worker-overloaded": "1"}))
    status, hdrs, payload = local(resp)
    assert status == 529 and payload["type"] == "Overloaded" and hdrs["retry-after"] == "1"
    worker = handler.pool.workers["a"]
    assert worker.state(handler.pool.clock()) == "overloaded"
    assert worker.ranks[0].inflight == 0
    text = generate_latest(handler.metrics.registry).decode()
    assert 'dynamo_frontend_model_rejection_total{endpoint="chat_completions",model="m"} 1.0' in (
        text
    )


def test_envoys_own_reply_to_an_unreachable_worker_becomes_the_overload_reply() -> None:
    """x-upstream-failure (the shipped configs' local_reply_config) marks Envoy's 503 for a
    routed request it could not deliver; a worker's own 503 passes through."""
    handler = make(BusyThresholds())
    pool = handler.pool
    pool.announce("a", model="m", endpoint="127.0.0.1:1", kv_total_blocks=100)
    session = handler.open_session({})
    reply(session, headers(CHAT, read="m", extra={"content-length": "40"}))
    resp = reply(session, response_headers(503, extra={"x-upstream-failure": "URX,UF"}))
    status, hdrs, payload = local(resp)
    assert (status, payload["type"]) == (529, "Overloaded")
    assert hdrs["x-shed-reason"] == "worker_unreachable"
    worker = pool.workers["a"]
    assert worker.ranks[0].inflight == 0  # released
    assert counter(handler, "extproc_worker_unreachable_total", model="m") == 1
    # Skipped for a second, even though it goes on reporting load.
    pool.report_load("a", active_decode_blocks=0)
    assert worker.state(pool.clock()) == "overloaded"
    why = worker_view(pool, worker, pool.clock())["why"]
    assert why.startswith("Envoy could not reach it; skipped for"), why
    session = handler.open_session({})
    status, hdrs, _ = local(reply(session, headers(CHAT, read="m", extra={"content-length": "4"})))
    assert (status, hdrs["x-shed-reason"]) == (529, "worker_unreachable")
    # A 503 that the worker itself sent (no x-upstream-failure) is a refusal, not a fault.
    worker.overloaded_until = worker.unreachable_until = 0.0
    session = handler.open_session({})
    reply(session, headers(CHAT, read="m", extra={"content-length": "4"}))
    status, hdrs, _ = local(reply(session, response_headers(503)))
    assert (status, hdrs["x-shed-reason"]) == (529, "worker_overloaded")
    assert counter(handler, "extproc_worker_unreachable_total", model="m") == 1


def routed_session(handler: ExtProcHandler) -> RequestSession:
    """A chat request of model ``m``, routed (decided on its headers)."""
    session = handler.open_session({})
    assert isinstance(session, RequestSession)
    resp = reply(session, headers(CHAT, read="m", extra={"content-length": "40"}))
    assert resp.WhichOneof("response") == "request_headers", resp
    return session


@pytest.mark.parametrize("status", [429, 503, 529])
def test_a_busy_status_from_the_worker_is_the_overload_reply(status: int) -> None:
    """The default list (429, 503) and 529 mean "busy": the overload reply, counted, and the
    pick and every fallback Envoy retried on are skipped until their next load report."""
    handler = make(BusyThresholds())
    pool = handler.pool
    for name, port in (("a", 1), ("b", 2), ("c", 3)):
        pool.announce(name, model="m", endpoint=f"127.0.0.1:{port}", kv_total_blocks=100)
    pool.announce("x", model="other", endpoint="127.0.0.1:2", kv_total_blocks=100)
    session = routed_session(handler)
    resp = reply(session, response_headers(status, extra={"content-type": "application/json"}))
    got, hdrs, payload = local(resp)
    assert (got, payload["code"], hdrs["retry-after"]) == (529, 529, "1")
    assert hdrs["x-shed-reason"] == "worker_overloaded"
    now = pool.clock()
    assert {w.worker_id: w.state(now) for w in pool.workers.values()} == {
        "a": "overloaded",
        "b": "overloaded",
        "c": "overloaded",
        "x": "free",  # same endpoint, another model: not among the fallbacks
    }
    assert all(r.inflight == 0 for w in pool.workers.values() for r in w.ranks)
    assert counter(handler, "extproc_worker_unreachable_total", model="m") == 0
    key = {"model": "m", "endpoint": "chat_completions"}
    assert counter(handler, "dynamo_frontend_model_rejection_total", **key) == 1
    # The next decision skips them all; a load report lifts a mark at once.
    again = headers(CHAT, read="m", extra={"content-length": "40"})
    status_now, hdrs, _ = local(reply(handler.open_session({}), again))
    assert (status_now, hdrs["x-shed-reason"]) == (529, "worker_overloaded")
    pool.report_load("b", active_decode_blocks=0)
    assert pool.workers["b"].state(pool.clock()) == "free"


@pytest.mark.parametrize("status", [200, 204, 400, 404, 500, 502])
def test_other_worker_statuses_pass_through(status: int) -> None:
    handler = make(BusyThresholds())
    handler.pool.announce("a", model="m", endpoint="127.0.0.1:1", kv_total_blocks=100)
    session = routed_session(handler)
    resp = reply(session, response_headers(status))
    assert resp.WhichOneof("response") == "response_headers"
    assert handler.pool.workers["a"].state(handler.pool.clock()) == "free"


def test_a_2xx_with_the_overloaded_header_passes_through() -> None:
    handler = make(BusyThresholds())
    handler.pool.announce("a", model="m", endpoint="127.0.0.1:1", kv_total_blocks=100)
    session = routed_session(handler)
    resp = reply(session, response_headers(200, extra={"x-worker-overloaded": "1"}))
    assert resp.WhichOneof("response") == "response_headers"


def test_a_custom_list_replaces_the_default() -> None:
    handler = make(BusyThresholds(), busy_statuses=(408, 500))
    handler.pool.announce("a", model="m", endpoint="127.0.0.1:1", kv_total_blocks=100)
    resp = reply(routed_session(handler), response_headers(503))
    assert resp.WhichOneof("response") == "response_headers"  # not in the list
    session = handler.open_session({})
    reply(session, headers(CHAT))
    routed = reply(session, body({"model": "m", "prompt": "x"}))
    mutation = routed.request_body.response.header_mutation
    sent = {h.header.key: h.header.raw_value for h in mutation.set_headers}
    assert sent["x-envoy-retriable-status-codes"] == b"408,500"
    assert local(reply(session, response_headers(500)))[0] == 529


def test_an_empty_list_passes_a_workers_503_and_removes_the_retry_header() -> None:
    handler = make(BusyThresholds(), busy_statuses=())
    handler.pool.announce("a", model="m", endpoint="127.0.0.1:1", kv_total_blocks=100)
    session = handler.open_session({})
    assert isinstance(session, RequestSession)
    routed = reply(session, headers(CHAT, read="m", extra={"content-length": "40"}))
    mutation = routed.request_headers.response.header_mutation
    assert "x-envoy-retriable-status-codes" not in {h.header.key for h in mutation.set_headers}
    assert list(mutation.remove_headers) == ["x-envoy-retriable-status-codes"]
    for status in (503, 429):
        resp = reply(routed_session(handler), response_headers(status))
        assert resp.WhichOneof("response") == "response_headers"
    # 529 and the header still mean busy.
    assert local(reply(session, response_headers(529)))[0] == 529


def test_models_list_is_answered_from_discovered_models() -> None:
    handler = make()
    handler.pool.announce("a", model="m2", endpoint="127.0.0.1:1")
    handler.pool.announce("b", model="m1", endpoint="127.0.0.1:2")
    session = handler.open_session({})
    status, _, payload = local(reply(session, headers("/v1/models", "GET")))
    assert status == 200
    data = payload["data"]
    assert isinstance(data, list) and [m["id"] for m in data] == ["m1", "m2"]


def test_no_worker_at_all_is_answered_on_the_headers() -> None:
    handler = make()
    session = handler.open_session({})
    resp = reply(session, headers(CHAT))
    assert local(resp)[0] == 503
    assert counter(handler, "extproc_decisions_total", outcome="no_workers") == 1


def test_every_worker_of_every_model_busy_is_answered_on_the_headers() -> None:
    handler = make()
    pool = handler.pool
    pool.announce("a", model="m", endpoint="127.0.0.1:1", kv_total_blocks=10)
    pool.report_load("a", active_decode_blocks=6)
    session = handler.open_session({})
    status, hdrs, payload = local(reply(session, headers(CHAT)))
    assert (status, hdrs["retry-after"], payload["type"]) == (529, "1", "Overloaded")
    # One model served: the rejection is counted under it.
    labels = {"model": "m", "endpoint": "chat_completions"}
    assert counter(handler, "dynamo_frontend_model_rejection_total", **labels) == 1
    # Several models, all busy: counted under "*" (the body was not read).
    pool.announce("b", model="n", endpoint="127.0.0.1:2", kv_total_blocks=10)
    pool.report_load("b", active_decode_blocks=6)
    status, _, _ = local(reply(handler.open_session({}), headers(CHAT)))
    assert status == 529
    labels = {"model": "*", "endpoint": "chat_completions"}
    assert counter(handler, "dynamo_frontend_model_rejection_total", **labels) == 1
    assert counter(handler, "extproc_decisions_total", outcome="overloaded") == 2


def test_a_free_worker_of_another_model_means_the_body_decides() -> None:
    handler = make()
    pool = handler.pool
    pool.announce("a", model="m", endpoint="127.0.0.1:1", kv_total_blocks=10)
    pool.report_load("a", active_decode_blocks=6)
    pool.announce("b", model="n", endpoint="127.0.0.1:2", kv_total_blocks=10)
    session = handler.open_session({})
    assert reply(session, headers(CHAT)).WhichOneof("response") == "request_headers"
    resp = reply(session, body({"model": "m", "prompt": "hi"}))
    assert local(resp)[0] == 529
    labels = {"model": "m", "endpoint": "chat_completions"}
    assert counter(handler, "dynamo_frontend_model_rejection_total", **labels) == 1
    # An overloaded mark (worker-side rejection) counts as not free too.
    pool.mark_overloaded(pool.workers["b"])
    assert local(reply(handler.open_session({}), headers(CHAT)))[0] == 529


async def test_requests_waiting_in_the_router_queue_leave_the_answer_to_the_body() -> None:
    pool = WorkerPool(HALF, clock=Clock())
    queue = RouterQueue(timeout=30.0)
    handler = ExtProcHandler(pool, Scheduler(pool), Metrics(), queue=queue)
    pool.announce("a", model="m", endpoint="127.0.0.1:1", kv_total_blocks=10)
    pool.report_load("a", active_decode_blocks=6)
    assert local(reply(handler.open_session({}), headers(CHAT)))[0] == 529
    done = asyncio.Event()
    waiter = asyncio.create_task(queue.wait("m", lambda: True if done.is_set() else None))
    for _ in range(100):  # the task joins the queue on its first step
        if queue.waiting("m"):
            break
        await asyncio.sleep(0)
    assert queue.waiting("m")
    # Every worker is busy, but a request waits: FIFO keeps the order, the body decides.
    resp = reply(handler.open_session({}), headers(CHAT))
    assert resp.WhichOneof("response") == "request_headers"
    done.set()
    queue.notify("m")
    assert await asyncio.wait_for(waiter, 10.0) is True
    assert local(reply(handler.open_session({}), headers(CHAT)))[0] == 529


def trailers() -> bytes:
    return ep.ProcessingRequest(response_trailers=ep.HttpTrailers()).SerializeToString()


def test_model_read_from_the_body_prefix_is_decided_on_the_headers() -> None:
    handler = make()
    pool = handler.pool
    pool.announce("a", model="m", endpoint="127.0.0.1:1", kv_total_blocks=100)
    session = handler.open_session({})
    assert isinstance(session, RequestSession)
    resp = reply(session, headers(CHAT, read="m", extra={"content-length": "401"}))
    # The routing reply answers the headers message: the body never comes.
    assert resp.WhichOneof("response") == "request_headers"
    mutation = resp.request_headers.response.header_mutation
    assert {h.header.key: h.header.raw_value for h in mutation.set_headers} == {
        DESTINATION_HEADER: b"127.0.0.1:1",
        "x-envoy-max-retries": b"0",
        "x-envoy-retriable-status-codes": b"429,503",
    }
    assert list(mutation.remove_headers) == []
    meta = resp.dynamic_metadata.fields[LB_NAMESPACE].struct_value.fields
    assert meta[DESTINATION_HEADER].string_value == "127.0.0.1:1"
    rank = pool.workers["a"].ranks[0]
    # Prompt tokens from the body size: ceil(401 / 4).
    assert (rank.inflight, rank.est_prefill, rank.est_blocks) == (1, 101, 7)
    # A streamed response: Envoy is asked for the trailers so that the stream (and the
    # estimate) lasts until the response ends; the stream is recognised by its type.
    resp = reply(session, response_headers(200, extra={"content-type": "text/event-stream"}))
    assert resp.WhichOneof("response") == "response_headers"
    assert resp.mode_override.response_trailer_mode == resp.mode_override.SEND
    assert (rank.inflight, rank.est_prefill, rank.est_blocks) == (1, 0, 7)  # prefill over
    reply(session, trailers())
    assert (rank.inflight, rank.est_blocks) == (0, 0)
    session.close()
    assert (rank.inflight, rank.est_prefill, rank.est_blocks) == (0, 0, 0)


def test_without_trailers_the_estimate_lasts_until_the_stream_closes() -> None:
    handler = make()
    handler.pool.announce("a", model="m", endpoint="127.0.0.1:1", kv_total_blocks=100)
    session = handler.open_session({})
    reply(session, headers(CHAT, read="m", extra={"content-length": "40"}))
    rank = handler.pool.workers["a"].ranks[0]
    reply(session, response_headers(200))
    assert rank.inflight == 1  # the response goes on after its headers
    session.close()  # the response ended or the client went away: Envoy ends the stream
    assert rank.inflight == 0


def test_a_status_that_is_not_a_number_is_no_status(caplog: pytest.LogCaptureFixture) -> None:
    handler = make()
    handler.pool.announce("a", model="m", endpoint="127.0.0.1:1", kv_total_blocks=100)
    rank = handler.pool.workers["a"].ranks[0]
    for status in ("abc", "\uff12\uff10\uff10", "", "-5"):
        session = handler.open_session({})
        reply(session, headers(CHAT, read="m", extra={"content-length": "40"}))
        hm = base_pb2.HeaderMap(
            headers=[base_pb2.HeaderValue(key=":status", raw_value=status.encode())]
        )
        message = ep.ProcessingRequest(response_headers=ep.HttpHeaders(headers=hm))
        resp = reply(session, message.SerializeToString())
        assert resp.WhichOneof("response") == "response_headers", status
        assert rank.inflight == 1  # not a worker-side rejection: the response goes on
        session.close()
        assert rank.inflight == 0
    assert not [r for r in caplog.records if r.exc_info], caplog.text


def test_decided_on_headers_a_busy_or_unknown_model_is_answered_there() -> None:
    handler = make()
    pool = handler.pool
    pool.announce("a", model="m", endpoint="127.0.0.1:1", kv_total_blocks=10)
    pool.report_load("a", active_decode_blocks=6)
    pool.announce("b", model="n", endpoint="127.0.0.1:2", kv_total_blocks=10)
    length = {"content-length": "40"}
    status, hdrs, _ = local(reply(handler.open_session({}), headers(CHAT, read="m", extra=length)))
    assert (status, hdrs["retry-after"]) == (529, "1")
    labels = {"model": "m", "endpoint": "chat_completions"}
    assert counter(handler, "dynamo_frontend_model_rejection_total", **labels) == 1
    status, _, _ = local(reply(handler.open_session({}), headers(CHAT, read="x", extra=length)))
    assert status == 404


def test_no_model_in_the_prefix_means_the_body_decides_and_a_bad_body_is_400() -> None:
    handler = make()
    pool = handler.pool
    pool.announce("a", model="m", endpoint="127.0.0.1:1", kv_total_blocks=10)
    pool.report_load("a", active_decode_blocks=6)  # every worker busy
    session = handler.open_session({})
    resp = reply(session, headers(CHAT, read="", extra={"content-length": "1"}))
    # Not decided on the headers, even with every worker busy: Envoy is asked for the
    # buffered body, whatever the filter's configured body mode.
    assert resp.WhichOneof("response") == "request_headers"
    assert resp.mode_override.request_body_mode == resp.mode_override.BUFFERED
    assert local(reply(session, body(b"{")))[0] == 400
    # Without content-length (a chunked upload) the body decides too.
    session = handler.open_session({})
    resp = reply(session, headers(CHAT, read="m"))
    assert resp.mode_override.request_body_mode == resp.mode_override.BUFFERED
    assert local(reply(session, body({"model": "m", "prompt": "x"})))[0] == 529


# ----- request classes (docs/classes.md) ------------------------------------------------

CLASSES = {
    "default": "standard",
    "trusted_marker": {"header": "x-class-trusted", "value": "envoy"},
    "classes": {
        "critical": {"share": 1.0},
        "standard": {"share": 0.9},
        "sheddable": {"share": 0.7, "status": 429, "retry_after": 7},
    },
}


def classed(th: BusyThresholds = HALF) -> ExtProcHandler:
    from extproc.core.classes import ClassRegistry, parse_table

    pool = WorkerPool(th, clock=Clock())
    registry = ClassRegistry(parse_table(CLASSES), pool)
    handler = ExtProcHandler(pool, Scheduler(pool), Metrics(), classes=registry)
    pool.announce("a", model="m", endpoint="127.0.0.1:1", kv_total_blocks=100)
    pool.report_load("a", active_decode_blocks=40)  # 40 %: busy for sheddable (35) only
    return handler


def classed_request(handler: ExtProcHandler, extra: dict[str, str]) -> ep.ProcessingResponse:
    session = handler.open_session({})
    first = reply(session, headers(CHAT, read="m", extra={"content-length": "100", **extra}))
    return first


def test_a_sheddable_request_is_rejected_with_its_status_and_why() -> None:
    handler = classed()
    trusted = {"x-class-trusted": "envoy"}
    resp = classed_request(handler, {"x-request-class": "sheddable", **trusted})
    status, hdrs, payload = local(resp)
    assert (status, hdrs["retry-after"]) == (429, "7")
    assert hdrs["x-shed-reason"] == "active_decode_blocks_threshold"
    assert hdrs["x-shed-class"] == "sheddable"
    assert payload == {
        "message": "Service temporarily overloaded",
        "type": "Too Many Requests",
        "code": 429,
    }
    for name in ("critical", "standard"):
        routed = classed_request(handler, {"x-request-class": name, **trusted})
        assert routed.WhichOneof("response") == "request_headers"
        assert routed.request_headers.response.header_mutation.set_headers
    labels = {"model": "m", "endpoint": "chat_completions"}
    for cls, outcome in (("sheddable", "overloaded"), ("critical", "routed")):
        value = counter(
            handler, "extproc_requests_by_class_total", **labels, **{"class": cls}, outcome=outcome
        )
        assert value == 1


def test_the_class_header_counts_only_with_the_trusted_marker() -> None:
    handler = classed()
    # A client that names itself sheddable without the marker is the default class.
    resp = classed_request(handler, {"x-request-class": "sheddable"})
    assert resp.WhichOneof("response") == "request_headers"
    wrong = classed_request(handler, {"x-request-class": "sheddable", "x-class-trusted": "me"})
    assert wrong.WhichOneof("response") == "request_headers"
    unknown = classed_request(handler, {"x-request-class": "vip", "x-class-trusted": "envoy"})
    assert unknown.WhichOneof("response") == "request_headers"
    assert counter(handler, "extproc_request_class_unknown_total") == 1


def test_without_classes_the_overload_reply_still_says_why() -> None:
    handler = make()
    handler.pool.announce("a", model="m", endpoint="127.0.0.1:1", kv_total_blocks=10)
    handler.pool.report_load("a", active_decode_blocks=6)
    status, hdrs, _ = local(classed_request(handler, {"x-request-class": "sheddable"}))
    assert status == 529
    assert (hdrs["x-shed-reason"], hdrs["x-shed-class"]) == (
        "active_decode_blocks_threshold",
        "default",
    )


def test_the_estimate_follows_the_host_that_served_the_response() -> None:
    """Envoy's retry moved the request from the pick to another listed worker: the served
    header moves its estimate there; an unknown host releases it; the pick's own host or a
    failure reply moves nothing."""
    handler = make(BusyThresholds())
    pool = handler.pool
    for name, port in (("a", 1), ("b", 2)):
        pool.announce(name, model="m", endpoint=f"127.0.0.1:{port}")
    a, b = pool.workers["a"], pool.workers["b"]

    def routed() -> tuple[RequestSession, Ticket]:
        session = routed_session(handler)
        assert session.st.routed is not None
        return session, session.st.routed.ticket

    def inflight() -> tuple[int, int]:
        return a.ranks[0].inflight, b.ranks[0].inflight

    session, ticket = routed()
    pick = ticket.worker
    other = b if pick is a else a
    assert inflight() == ((1, 0) if pick is a else (0, 1))
    served = {"x-gateway-destination-endpoint-served": other.endpoint}
    resp = reply(session, response_headers(200, extra=served))
    assert resp.WhichOneof("response") == "response_headers"
    assert ticket.worker is other and other.ranks[0].inflight == 1 and pick.ranks[0].inflight == 0
    assert counter(handler, "extproc_served_elsewhere_total", model="m", served="worker") == 1
    # The pick refused it (Envoy retried): skipped until its next load report or 1 s.
    now = pool.clock()
    assert not is_free(pick, 0, now) and is_free(other, 0, now)
    session.close()
    assert inflight() == (0, 0)
    pool.report_load(pick.worker_id, active_decode_blocks=0)
    assert is_free(pick, 0, pool.clock())

    session, ticket = routed()
    reply(
        session,
        response_headers(200, extra={"x-gateway-destination-endpoint-served": "10.9.9.9:80"}),
    )
    assert ticket.released and inflight() == (0, 0)
    assert counter(handler, "extproc_served_elsewhere_total", model="m", served="unknown") == 1
    session.close()
    assert inflight() == (0, 0)

    session, ticket = routed()
    own = {"x-gateway-destination-endpoint-served": ticket.worker.endpoint}
    reply(session, response_headers(200, extra=own))
    assert not ticket.released and sum(inflight()) == 1
    session.close()

    # Envoy's own 503 after the fallback refused too: the failure path, not a move.
    session, ticket = routed()
    failed = {"x-upstream-failure": "UF", "x-gateway-destination-endpoint-served": "127.0.0.1:9"}
    assert local(reply(session, response_headers(503, extra=failed)))[0] == 529
    assert inflight() == (0, 0)
    assert counter(handler, "extproc_served_elsewhere_total", model="m", served="unknown") == 1
