"""The request path end to end: client -> real Envoy -> extproc (gRPC) -> echo worker."""

from __future__ import annotations

import concurrent.futures
import json
import socket
import time
from typing import Any

import pytest

from extproc.devstack import get_json, http, metric_value, wait_until
from tests.conftest import GRPC_SERVERS, Stack

OVERLOADED_529 = b'{"message":"Service temporarily overloaded","type":"Overloaded","code":529}'
CHAT = "/v1/chat/completions"


def chat(model: str, text: str = "hello") -> dict[str, Any]:
    return {"model": model, "messages": [{"role": "user", "content": text}]}


@pytest.fixture(scope="module", params=GRPC_SERVERS)
def stack(make_stack: Any, request: pytest.FixtureRequest) -> Stack:
    return make_stack(
        [
            "--grpc-server",
            request.param,
            "--active-decode-blocks-threshold",
            "0.5",
            "--active-prefill-tokens-threshold",
            "1000",
            "--worker-ttl",
            "30",
        ]
    )


def set_state(stack: Stack, worker_id: str, pred: Any) -> None:
    wait_until(lambda: pred(stack.ext.workers()[worker_id]), 5, f"{worker_id} state")


def announce(stack: Stack, worker_id: str, model: str, name: str, **extra: Any) -> None:
    stack.pub.announce(stack.ext, worker_id, model, stack.endpoint(name), **extra)


def load(stack: Stack, worker_id: str, state: str, **fields: Any) -> None:
    stack.pub.load(worker_id, **fields)
    set_state(
        stack,
        worker_id,
        lambda w: (
            w["state"] == state
            and all(
                w["ranks"][fields.get("dp_rank", 0)]["reported"].get(k) == v
                for k, v in fields.items()
                if k != "dp_rank"
            )
        ),
    )


def upstream_requests(stack: Stack) -> int:
    status, _, body = http(
        "GET",
        f"http://127.0.0.1:{stack.envoy.admin_port}/stats?filter=^cluster.workers.upstream_rq_total$",
    )
    assert status == 200
    return int(body.decode().split(":")[1])


def test_stack_serves_ext_proc_on_the_named_server(
    stack: Stack, request: pytest.FixtureRequest
) -> None:
    server = request.node.callspec.params["stack"]
    assert f"({server} server)" in stack.ext.proc.log()


def test_free_worker_serves_and_busy_worker_is_skipped(stack: Stack) -> None:
    announce(stack, "free-1", "m-free", "a", kv_total_blocks=100)
    announce(stack, "free-2", "m-free", "b", kv_total_blocks=100)
    load(stack, "free-1", "busy", active_decode_blocks=51)
    load(stack, "free-2", "free", active_decode_blocks=50)  # strict >: 50 is not busy
    for _ in range(6):
        status, headers, body = http("POST", stack.envoy.url + CHAT, chat("m-free"))
        assert status == 200, body
        assert headers["x-worker-id"] == "b"
        assert json.loads(body)["destination"] == stack.endpoint("b")


def test_worker_announcing_a_new_endpoint_is_routed_there(stack: Stack) -> None:
    """A restarted pod keeps its worker_id and comes back at a new address."""
    announce(stack, "moving", "m-move", "a")
    status, headers, _ = http("POST", stack.envoy.url + CHAT, chat("m-move"))
    assert (status, headers["x-worker-id"]) == (200, "a")
    stack.pub.config("moving", "m-move", stack.endpoint("b"))
    wait_until(
        lambda: stack.ext.workers()["moving"]["endpoint"] == stack.endpoint("b"), 5, "new endpoint"
    )
    for _ in range(4):
        status, headers, body = http("POST", stack.envoy.url + CHAT, chat("m-move"))
        assert (status, headers["x-worker-id"]) == (200, "b"), body
        assert json.loads(body)["destination"] == stack.endpoint("b")


def test_kv_mode_picks_least_loaded(stack: Stack) -> None:
    announce(stack, "ll-1", "m-ll", "a", kv_total_blocks=100)
    announce(stack, "ll-2", "m-ll", "b", kv_total_blocks=1000)
    load(stack, "ll-1", "free", active_decode_blocks=20)  # 20 %
    load(stack, "ll-2", "free", active_decode_blocks=100)  # 10 %: less loaded
    status, headers, _ = http("POST", stack.envoy.url + CHAT, chat("m-ll"))
    assert (status, headers["x-worker-id"]) == (200, "b")


def test_all_busy_gives_529_with_exact_body(stack: Stack) -> None:
    announce(stack, "busy-1", "m-busy", "a", kv_total_blocks=10)
    announce(stack, "busy-2", "m-busy", "b", max_num_batched_tokens=64)
    load(stack, "busy-1", "busy", active_decode_blocks=6)
    load(stack, "busy-2", "busy", active_prefill_tokens=1001)
    before = upstream_requests(stack)
    for path, endpoint in (
        (CHAT, "chat_completions"),
        ("/v1/completions", "completions"),
        ("/v1/embeddings", "embeddings"),
        ("/v1/responses", "responses"),
    ):
        body = chat("m-busy") if path == CHAT else {"model": "m-busy", "prompt": "x", "input": "x"}
        status, headers, reply = http("POST", stack.envoy.url + path, body)
        assert status == 529
        assert reply == OVERLOADED_529
        assert headers["content-type"] == "application/json"
        assert 1 <= int(headers["retry-after"]) <= 60
        value = metric_value(
            stack.ext.metrics(),
            "dynamo_frontend_model_rejection_total",
            {"model": "m-busy", "endpoint": endpoint},
        )
        assert value == 1.0
    assert upstream_requests(stack) == before, "a rejected request reached a worker"
    # One worker frees up: served at once, no waiting for anything else.
    load(stack, "busy-2", "free", active_prefill_tokens=1000)
    status, headers, _ = http("POST", stack.envoy.url + CHAT, chat("m-busy"))
    assert (status, headers["x-worker-id"]) == (200, "b")


def test_dp_ranks_worker_busy_only_when_every_reported_rank_is(stack: Stack) -> None:
    announce(stack, "dp-1", "m-dp", "c", kv_total_blocks=100, dp_size=2)
    # Only rank 0 has data and it is busy: rank 1 without data does not count.
    load(stack, "dp-1", "busy", dp_rank=0, active_decode_blocks=90)
    assert http("POST", stack.envoy.url + CHAT, chat("m-dp"))[0] == 529
    # Rank 1 reports free: the worker is free again.
    load(stack, "dp-1", "free", dp_rank=1, active_decode_blocks=10)
    status, headers, _ = http("POST", stack.envoy.url + CHAT, chat("m-dp"))
    assert (status, headers["x-worker-id"]) == (200, "c")
    # Both ranks busy (rank 1 by its own kv_total override): 529.
    load(stack, "dp-1", "busy", dp_rank=1, active_decode_blocks=10, kv_total_blocks=12)
    assert http("POST", stack.envoy.url + CHAT, chat("m-dp"))[0] == 529


def test_unknown_model_is_404(stack: Stack) -> None:
    announce(stack, "nf-1", "m-known", "a")
    status, headers, body = http("POST", stack.envoy.url + CHAT, chat("no-such-model"))
    assert status == 404
    assert headers["content-type"] == "application/json"
    assert body == b'{"message":"Model not found","type":"Not Found","code":404}'


@pytest.mark.parametrize(
    ("raw", "fragment"),
    [
        (b"{not json", "not valid JSON"),
        (b"[1, 2]", "must be a JSON object"),
        (b'"text"', "must be a JSON object"),
        (b"{}", "no 'model'"),
        (b'{"model": null}', "no 'model'"),
        (b'{"model": 7}', "'model' must be a string"),
        (b"", "empty"),
    ],
)
def test_bad_body_is_400_decided_locally(stack: Stack, raw: bytes, fragment: str) -> None:
    before = upstream_requests(stack)
    status, headers, body = http("POST", stack.envoy.url + CHAT, raw)
    assert status == 400
    assert headers["content-type"] == "application/json"
    reply = json.loads(body)
    assert reply["type"] == "Bad Request" and reply["code"] == 400
    assert fragment in reply["message"]
    assert set(reply) == {"message", "type", "code"}
    assert upstream_requests(stack) == before


def test_spoofed_destination_header_never_chooses_upstream(stack: Stack) -> None:
    announce(stack, "sp-1", "m-spoof", "a", kv_total_blocks=100)
    announce(stack, "sp-2", "m-spoof", "b", kv_total_blocks=100)
    load(stack, "sp-1", "busy", active_decode_blocks=99)
    load(stack, "sp-2", "free", active_decode_blocks=1)
    spoof = {"x-gateway-destination-endpoint": stack.endpoint("a")}
    for _ in range(4):
        status, headers, body = http("POST", stack.envoy.url + CHAT, chat("m-spoof"), spoof)
        assert (status, headers["x-worker-id"]) == (200, "b")
        assert json.loads(body)["destination"] == stack.endpoint("b")
    # Pass-through paths: the header is removed before it reaches any worker.
    status, _, body = http("GET", stack.envoy.url + "/some/other/path", None, spoof)
    assert status == 200
    assert json.loads(body)["destination"] is None


def test_long_prompt_crosses_the_grpc_windows_and_the_body_limit_is_envoys(stack: Stack) -> None:
    announce(stack, "big-1", "m-big", "a", kv_total_blocks=100)
    load(stack, "big-1", "free", active_decode_blocks=0)
    # 6 MiB: more than one stream window (4 MiB) and grpcio's default message limit.
    raw = json.dumps(chat("m-big", "x" * (6 << 20))).encode()
    status, headers, body = http("POST", stack.envoy.url + CHAT, raw, timeout=30)
    assert (status, headers["x-worker-id"]) == (200, "a"), body[:200]
    assert json.loads(body)["body_len"] == len(raw)
    wait_until(
        lambda: (
            stack.ext.workers()["big-1"]["ranks"][0]["router_estimate"]["requests_in_flight"] == 0
        ),
        5,
        "estimate released",
    )
    # Over the listener's buffer limit (32 MiB): Envoy's 413, nothing reaches a worker.
    before = upstream_requests(stack)
    raw = json.dumps(chat("m-big", "x" * (33 << 20))).encode()
    status, _, _ = http("POST", stack.envoy.url + CHAT, raw, timeout=30)
    assert status == 413
    assert upstream_requests(stack) == before
    stack.pub.bye("big-1")


def test_open_streams_and_connections_are_in_metrics(
    stack: Stack, request: pytest.FixtureRequest
) -> None:
    announce(stack, "gauge-1", "m-gauge", "b", kv_total_blocks=100)
    load(stack, "gauge-1", "free", active_decode_blocks=0)

    def streams() -> float | None:
        return metric_value(stack.ext.metrics(), "extproc_streams")

    wait_until(lambda: streams() == 0, 5, "no stream open before")
    req = {"model": "m-gauge", "prompt": "hi", "stream": True}
    slow = {"x-test-chunks": "4", "x-test-delay-ms": "250"}
    with concurrent.futures.ThreadPoolExecutor(2) as pool:
        calls = [
            pool.submit(http, "POST", stack.envoy.url + "/v1/completions", req, slow)
            for _ in range(2)
        ]
        wait_until(lambda: streams() == 2, 5, "one open stream per request in flight")
        assert [c.result()[0] for c in calls] == [200, 200]
    wait_until(lambda: streams() == 0, 5, "streams closed when the requests end")
    text = stack.ext.metrics()
    if request.node.callspec.params["stack"] == "builtin":
        assert (metric_value(text, "extproc_grpc_connections") or 0) >= 1
        for reason in ("protocol_error", "keepalive_timeout"):
            labels = {"reason": reason}
            assert metric_value(text, "extproc_grpc_connections_closed_total", labels) == 0
    else:  # grpcio's server does not say
        assert metric_value(text, "extproc_grpc_connections") is None
    stack.pub.bye("gauge-1")


def test_sse_stream_passes_through_intact(stack: Stack) -> None:
    announce(stack, "sse-1", "m-sse", "c", kv_total_blocks=100)
    load(stack, "sse-1", "free", active_decode_blocks=0)
    req = {"model": "m-sse", "prompt": "hi", "stream": True}
    shape = {"x-test-chunks": "20", "x-test-delay-ms": "5"}
    direct = http("POST", f"http://{stack.endpoint('c')}/v1/completions", req, shape)
    through = http("POST", stack.envoy.url + "/v1/completions", req, shape)
    assert through[0] == 200
    assert through[1]["content-type"] == "text/event-stream"
    assert through[2] == direct[2]
    assert through[2].count(b"data: ") == 21 and through[2].endswith(b"data: [DONE]\n\n")
    # The router's estimate for the stream is released when it ends.
    wait_until(
        lambda: (
            stack.ext.workers()["sse-1"]["ranks"][0]["router_estimate"]["requests_in_flight"] == 0
        ),
        5,
        "estimate released",
    )


def test_router_estimate_alone_drives_rejection(stack: Stack) -> None:
    """A worker that sends config but no load is judged by what is in flight."""
    announce(stack, "est-1", "m-est", "a")
    held = socket.create_connection(("127.0.0.1", stack.envoy.port))
    body = json.dumps(chat("m-est", "x" * 4008)).encode()  # 1002 prompt tokens > 1000
    held.sendall(
        b"POST /v1/chat/completions HTTP/1.1\r\nhost: x\r\ncontent-type: application/json\r\n"
        b"x-test-hang: 1\r\ncontent-length: %d\r\n\r\n" % len(body) + body
    )
    try:
        set_state(stack, "est-1", lambda w: w["state"] == "busy")
        assert http("POST", stack.envoy.url + CHAT, chat("m-est"))[0] == 529
    finally:
        held.close()
    # Client gone: the estimate returns to zero and the worker is free again.
    set_state(
        stack,
        "est-1",
        lambda w: (
            w["state"] == "free" and w["ranks"][0]["router_estimate"]["requests_in_flight"] == 0
        ),
    )
    assert http("POST", stack.envoy.url + CHAT, chat("m-est"))[0] == 200


def test_bye_removes_worker_at_once(stack: Stack) -> None:
    announce(stack, "bye-1", "m-bye", "a")
    announce(stack, "bye-2", "m-bye", "b")
    stack.pub.bye("bye-1")
    wait_until(lambda: "bye-1" not in stack.ext.workers(), 5, "bye applied")
    for _ in range(3):
        status, headers, _ = http("POST", stack.envoy.url + CHAT, chat("m-bye"))
        assert (status, headers["x-worker-id"]) == (200, "b")
    stack.pub.bye("bye-2")
    wait_until(lambda: "bye-2" not in stack.ext.workers(), 5, "bye applied")
    assert http("POST", stack.envoy.url + CHAT, chat("m-bye"))[0] == 404


def test_models_listed_from_discovered_workers(stack: Stack) -> None:
    announce(stack, "models-1", "m-listed", "a")
    status, _, body = http("GET", stack.envoy.url + "/v1/models")
    assert status == 200
    assert "m-listed" in [m["id"] for m in json.loads(body)["data"]]


def test_metrics_and_busy_threshold_routed_to_admin_on_8000(stack: Stack) -> None:
    status, _, body = http("GET", stack.envoy.url + "/metrics")
    assert status == 200 and b"extproc_decisions_total" in body
    status, _, body = http("GET", stack.envoy.url + "/busy_threshold")
    assert status == 200 and "thresholds" in json.loads(body)


# --- separate stacks: no workers yet, overload status variants, TTL --------------------


def test_no_workers_503_and_status_code_fallback_warning(make_stack: Any) -> None:
    s = make_stack(
        ["--active-prefill-tokens-threshold", "0"], {"DYN_HTTP_OVERLOAD_STATUS_CODE": "abc"}
    )
    status, headers, body = http("POST", s.envoy.url + CHAT, chat("anything"))
    assert status == 503
    assert body == (
        b'{"message":"Service temporarily unavailable","type":"Service Unavailable","code":503}'
    )
    assert headers["content-type"] == "application/json"
    s.pub.announce(s.ext, "abc-1", "m", s.endpoint("a"))
    s.pub.load("abc-1", active_prefill_tokens=1)
    wait_until(lambda: s.ext.workers()["abc-1"]["state"] == "busy", 5, "busy")
    status, _, body = http("POST", s.envoy.url + CHAT, chat("m"))
    assert (status, body) == (529, OVERLOADED_529)
    warnings = [ln for ln in s.ext.proc.log().splitlines() if "DYN_HTTP_OVERLOAD_STATUS_CODE" in ln]
    assert len(warnings) == 1 and " WARNING " in warnings[0]


@pytest.mark.parametrize(
    ("code", "type_"),
    [("503", "Service Unavailable"), (" 429 ", "Too Many Requests"), ("599", "Overloaded")],
)
def test_overload_status_env(make_stack: Any, code: str, type_: str) -> None:
    s = make_stack(
        ["--active-prefill-tokens-threshold", "0"], {"DYN_HTTP_OVERLOAD_STATUS_CODE": code}
    )
    s.pub.announce(s.ext, "st-1", "m", s.endpoint("a"))
    s.pub.load("st-1", active_prefill_tokens=1)
    wait_until(lambda: s.ext.workers()["st-1"]["state"] == "busy", 5, "busy")
    status, headers, body = http("POST", s.envoy.url + CHAT, chat("m"))
    n = int(code)
    assert status == n
    assert json.loads(body) == {
        "message": "Service temporarily overloaded",
        "type": type_,
        "code": n,
    }
    assert "retry-after" in headers


def test_ttl_expiry_removes_silent_worker(make_stack: Any) -> None:
    s = make_stack(["--worker-ttl", "1"])
    s.pub.announce(s.ext, "ttl-1", "m", s.endpoint("a"))
    # Heartbeats keep it: 2 s of loads every 0.2 s, longer than the TTL.
    deadline = time.monotonic() + 2.0
    while time.monotonic() < deadline:
        s.pub.load("ttl-1", active_decode_blocks=0)
        assert "ttl-1" in s.ext.workers()
        time.sleep(0.2)
    assert http("POST", s.envoy.url + CHAT, chat("m"))[0] == 200
    started = time.monotonic()
    wait_until(lambda: "ttl-1" not in s.ext.workers(), 5, "ttl expiry")
    assert time.monotonic() - started >= 0.5
    assert http("POST", s.envoy.url + CHAT, chat("m"))[0] == 503
    assert get_json(s.ext.admin + "/health")["workers"] == {"free": 0, "busy": 0, "overloaded": 0}


def test_runtime_thresholds_apply_to_the_very_next_request(make_stack: Any) -> None:
    s = make_stack([])  # started without any threshold: nothing is ever rejected for load
    s.pub.announce(s.ext, "rt-1", "m", s.endpoint("a"), kv_total_blocks=100)
    s.pub.load("rt-1", active_decode_blocks=80)
    wait_until(lambda: s.ext.workers()["rt-1"]["ranks"][0]["reported"]["age_s"] is not None, 5)
    assert http("POST", s.envoy.url + CHAT, chat("m"))[0] == 200
    post = s.envoy.url + "/busy_threshold"
    assert http("POST", post, {"model": "m", "active_decode_blocks_threshold": 0.5})[0] == 200
    assert http("POST", s.envoy.url + CHAT, chat("m"))[0] == 529  # no wait for a load event
    assert http("POST", post, {"model": "m", "active_decode_blocks_threshold": 0.8})[0] == 200
    assert http("POST", s.envoy.url + CHAT, chat("m"))[0] == 200  # 80 > 80 is false
    assert http("POST", post, {"model": "m", "active_decode_blocks_threshold": 0.1})[0] == 200
    assert http("POST", s.envoy.url + CHAT, chat("m"))[0] == 529
    off = {"model": "m", "disable": ["active_decode_blocks_threshold"]}
    status, _, body = http("POST", post, off)
    assert status == 200 and json.loads(body)["active_decode_blocks_threshold"] is None
    assert http("POST", s.envoy.url + CHAT, chat("m"))[0] == 200
