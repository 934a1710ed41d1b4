"""The router's estimate follows the worker that served the request, through the real Envoy.

The extproc picks worker A (the least loaded) and lists B as its fallback. A refuses the
connection (nothing listens on its port) or answers 503 (a busy status), so Envoy's retry
moves the request to B, which serves a long SSE stream. Envoy names the host that served
the response (``x-gateway-destination-endpoint-served``, set by the inference routes from
``%UPSTREAM_HOST%``), so during the stream the estimate is on B and not on A; the header
never reaches the client; after the stream every estimate is 0. Both shipped wirings:
``envoy/envoy.yaml`` and ``envoy/envoy-track-output.yaml`` (docs/routing.md).
"""

from __future__ import annotations

import http.client
import json
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest

from extproc.devstack import Envoy, free_port, metric_value, wait_until
from extproc.devstack.procs import checkout_file
from extproc.handlers.processor import SERVED_HEADER
from tests.conftest import Stack

IDLE = {"requests_in_flight": 0, "active_decode_blocks": 0, "active_prefill_tokens": 0}
CHUNKS = 40
DELAY_MS = 100  # a 4 s stream: long enough to look at the estimates while it runs


@dataclass
class Wiring:
    name: str
    envoy: Envoy
    dead_port: int  # a member of the workers cluster with nothing listening


@pytest.fixture(scope="module")
def stack(make_stack: Any) -> Stack:
    stack: Stack = make_stack(["--worker-ttl", "120", "--router-track-output-blocks"])
    return stack


@pytest.fixture(scope="module", params=["envoy.yaml", "envoy-track-output.yaml"])
def wiring(stack: Stack, log_dir: Path, request: pytest.FixtureRequest) -> Iterator[Wiring]:
    dead = free_port()
    ports = [dead, stack.workers["a"], stack.workers["b"]]
    envoy = Envoy(log_dir, stack.ext, ports, source=checkout_file(f"envoy/{request.param}"))
    yield Wiring(request.param.removesuffix(".yaml"), envoy, dead)
    envoy.stop()


def estimate(stack: Stack, worker_id: str) -> dict[str, int]:
    est: dict[str, int] = stack.ext.workers()[worker_id]["ranks"][0]["router_estimate"]
    return est


def open_stream(
    wiring: Wiring, model: str, extra: dict[str, str]
) -> tuple[http.client.HTTPConnection, http.client.HTTPResponse]:
    conn = http.client.HTTPConnection("127.0.0.1", wiring.envoy.port, timeout=20)
    body = json.dumps(
        {"model": model, "stream": True, "messages": [{"role": "user", "content": "hi " * 40}]}
    )
    conn.request(
        "POST",
        "/v1/chat/completions",
        body,
        {
            "content-type": "application/json",
            "x-test-chunks": str(CHUNKS),
            "x-test-delay-ms": str(DELAY_MS),
            **extra,
        },
    )
    return conn, conn.getresponse()


def read_events(resp: http.client.HTTPResponse, n: int) -> list[bytes]:
    events: list[bytes] = []
    while len(events) < n:
        line = resp.readline()
        assert line, f"the stream ended after {len(events)} events"
        if line.strip():
            events.append(line.strip())
    return events


@pytest.mark.parametrize("fault", ["refused", "503"])
def test_the_estimate_is_on_the_worker_that_serves_the_stream(
    stack: Stack, wiring: Wiring, fault: str
) -> None:
    model = f"served-{fault}-{wiring.name}"
    a, b = f"{model}-A", f"{model}-B"
    if fault == "refused":
        a_endpoint = f"127.0.0.1:{wiring.dead_port}"
        steer: dict[str, str] = {}
    else:
        a_endpoint = stack.endpoint("a")
        steer = {"x-test-status": "503", "x-test-status-for": "a"}  # echo worker "a" only
    stack.pub.announce(stack.ext, a, model, a_endpoint, kv_total_blocks=1000)
    stack.pub.announce(stack.ext, b, model, stack.endpoint("b"), kv_total_blocks=1000)
    # B reports some load (free, no thresholds): A is the least loaded, so it is the pick.
    stack.pub.load(b, active_decode_blocks=100)
    wait_until(
        lambda: stack.ext.workers()[b]["ranks"][0]["reported"]["active_decode_blocks"] == 100,
        10,
        "B's load report",
    )
    assert estimate(stack, a) == estimate(stack, b) == IDLE

    conn, resp = open_stream(wiring, model, steer)
    try:
        assert resp.status == 200, resp.read()
        assert resp.headers["x-worker-id"] == "b"
        assert resp.headers[SERVED_HEADER] is None  # removed before the client
        # The response headers reached the client after the extproc handled them: the
        # estimate has moved already.
        on_b = estimate(stack, b)
        assert estimate(stack, a) == IDLE, "the pick still counts a request it never served"
        assert on_b["requests_in_flight"] == 1 and on_b["active_decode_blocks"] > 0, on_b
        read_events(resp, CHUNKS // 2)
        mid = estimate(stack, b)
        assert estimate(stack, a) == IDLE
        assert mid["requests_in_flight"] == 1, mid
        if wiring.name == "envoy-track-output":
            # The observer counts generated tokens on B's ticket: no prefill left there. It
            # does not hold the stream back, so it may lag the client by a little.
            wait_until(
                lambda: estimate(stack, b)["active_prefill_tokens"] == 0, 1.5, "first token on B"
            )
        rest = read_events(resp, CHUNKS // 2 + 1)
        assert rest[-1] == b"data: [DONE]"
    finally:
        conn.close()
    wait_until(lambda: estimate(stack, a) == estimate(stack, b) == IDLE, 10, "estimates 0")
    moved = metric_value(
        stack.ext.metrics(), "extproc_served_elsewhere_total", {"model": model, "served": "worker"}
    )
    assert moved == 1
