"""A request's router estimate lasts until its response ends or the client goes away.

On the default config (envoy/envoy.yaml) a request whose model is the first key of its
body is decided on the request-headers message, and Envoy would close the ext_proc
stream right after the response headers (the last message it expects). The estimate
must outlive that: through a long SSE stream, and until a client that leaves
mid-stream or while the worker hangs is gone (docs/request-path.md).
"""

from __future__ import annotations

import http.client
import json
from typing import Any

import pytest

from extproc.devstack import wait_until
from tests.conftest import GRPC_SERVERS, Stack

MODEL = "life"
WORKER = "life-a"


@pytest.fixture(scope="module", params=GRPC_SERVERS)
def stack(make_stack: Any, request: pytest.FixtureRequest) -> Stack:
    stack: Stack = make_stack(["--grpc-server", request.param, "--worker-ttl", "120"])
    stack.pub.announce(stack.ext, WORKER, MODEL, stack.endpoint("a"), kv_total_blocks=1000)
    return stack


def _estimate(stack: Stack) -> dict[str, int]:
    estimate: dict[str, int] = stack.ext.workers()[WORKER]["ranks"][0]["router_estimate"]
    return estimate


def _in_flight(stack: Stack) -> int:
    return _estimate(stack)["requests_in_flight"]


def _idle(stack: Stack) -> bool:
    return _estimate(stack) == {
        "requests_in_flight": 0,
        "active_decode_blocks": 0,
        "active_prefill_tokens": 0,
    }


def _open_stream(stack: Stack, chunks: int, delay_ms: int) -> http.client.HTTPResponse:
    """Start a streamed chat completion; return the response once its headers are in."""
    conn = http.client.HTTPConnection("127.0.0.1", stack.envoy.port, timeout=20)
    body = json.dumps(
        {"model": MODEL, "stream": True, "messages": [{"role": "user", "content": "hi"}]}
    )
    conn.request(
        "POST",
        "/v1/chat/completions",
        body,
        {
            "content-type": "application/json",
            "x-test-chunks": str(chunks),
            "x-test-delay-ms": str(delay_ms),
        },
    )
    resp = conn.getresponse()
    assert resp.status == 200, resp.read()
    assert resp.headers["x-worker-id"] == "a"
    return resp


def _read_events(resp: http.client.HTTPResponse, n: int) -> None:
    for _ in range(n):
        line = resp.readline()
        while line in (b"\r\n", b"\n"):
            line = resp.readline()
        assert line.startswith(b"data: "), line


def test_a_long_sse_stream_holds_its_estimate_until_it_ends(stack: Stack) -> None:
    wait_until(lambda: _idle(stack), 10, "no request in flight before")
    resp = _open_stream(stack, chunks=30, delay_ms=50)
    # Response headers are long past (Envoy has had every message it asks for), the
    # stream goes on: the estimate is still there, checked again at several points.
    for _ in range(3):
        _read_events(resp, 5)
        assert _in_flight(stack) == 1
    rest = resp.read()
    assert rest.rstrip().endswith(b"data: [DONE]")
    resp.close()
    wait_until(lambda: _idle(stack), 10, "estimate released when the stream ended")


def test_a_client_gone_mid_stream_releases_the_estimate(stack: Stack) -> None:
    wait_until(lambda: _idle(stack), 10, "no request in flight before")
    resp = _open_stream(stack, chunks=600, delay_ms=50)  # 30 s if nobody left
    _read_events(resp, 3)
    assert _in_flight(stack) == 1
    resp.close()  # the client goes away mid-stream
    wait_until(lambda: _idle(stack), 10, "estimate released when the client left")


def test_a_client_gone_while_the_worker_hangs_releases_the_estimate(stack: Stack) -> None:
    wait_until(lambda: _idle(stack), 10, "no request in flight before")
    conn = http.client.HTTPConnection("127.0.0.1", stack.envoy.port, timeout=20)
    conn.request(
        "POST",
        "/v1/chat/completions",
        json.dumps({"model": MODEL, "messages": [{"role": "user", "content": "hi"}]}),
        {"content-type": "application/json", "x-test-hang": "1"},
    )
    wait_until(lambda: _in_flight(stack) == 1, 10, "request routed and held")
    conn.close()  # no response headers ever came
    wait_until(lambda: _idle(stack), 10, "estimate released when the client left")
