"""Worker-side rejections through the real Envoy: retried on another free worker, else turned
into the frontend overload reply, counted, and the worker skipped until its next load report
or 1 s (docs/routing.md)."""

from __future__ import annotations

import json
import time
from typing import Any

import pytest

from extproc.devstack import http, metric_value, wait_until
from tests.conftest import Stack

OVERLOADED = b'{"message":"Service temporarily overloaded","type":"Overloaded","code":529}'
URL = "/v1/completions"


def req(model: str) -> dict[str, Any]:
    return {"model": model, "prompt": "hi"}


def reject(names: str, status: str = "503", flagged: bool = True) -> dict[str, str]:
    h = {"x-test-status": status, "x-test-status-for": names}
    if flagged:
        h["x-test-overloaded"] = "1"
    return h


def envoy_stat(stack: Stack, name: str) -> int:
    url = f"http://127.0.0.1:{stack.envoy.admin_port}/stats?filter=^{name}$"
    body = http("GET", url)[2].decode()
    return int(body.split(":")[1]) if ":" in body else 0


@pytest.fixture(scope="module")
def stack(make_stack: Any) -> Stack:
    return make_stack(["--worker-ttl", "60"])  # no thresholds at all


def register(stack: Stack, model: str, names: str) -> None:
    for n in names:
        stack.pub.announce(stack.ext, f"{model}-{n}", model, stack.endpoint(n))


def test_rejection_is_retried_on_another_free_worker(stack: Stack) -> None:
    register(stack, "retry", "ab")
    before = envoy_stat(stack, "cluster.workers.upstream_rq_retry_success")
    for _ in range(4):
        status, headers, _ = http("POST", stack.envoy.url + URL, req("retry"), reject("a"))
        assert (status, headers["x-worker-id"]) == (200, "b")
    assert envoy_stat(stack, "cluster.workers.upstream_rq_retry_success") > before


@pytest.mark.parametrize(("status", "flagged"), [("503", True), ("429", True), ("529", False)])
def test_all_rejecting_gives_frontend_reply_and_marks_worker(
    stack: Stack, status: str, flagged: bool
) -> None:
    model = f"all-{status}"
    register(stack, model, "c")
    got, headers, body = http(
        "POST", stack.envoy.url + URL, req(model), reject("a,b,c", status, flagged)
    )
    assert (got, body) == (529, OVERLOADED)
    assert headers["content-type"] == "application/json"
    assert "retry-after" in headers
    text = stack.ext.metrics()
    assert (
        metric_value(
            text,
            "dynamo_frontend_model_rejection_total",
            {"model": model, "endpoint": "completions"},
        )
        == 1
    )
    # Marked: the next request is rejected locally, without reaching the worker.
    assert stack.ext.workers()[f"{model}-c"]["state"] == "overloaded"
    upstream = envoy_stat(stack, "cluster.workers.upstream_rq_total")
    assert http("POST", stack.envoy.url + URL, req(model))[0] == 529
    assert envoy_stat(stack, "cluster.workers.upstream_rq_total") == upstream
    # A load report clears the mark at once.
    stack.pub.load(f"{model}-c", active_decode_blocks=0)
    wait_until(lambda: stack.ext.workers()[f"{model}-c"]["state"] == "free", 5, "mark cleared")
    assert http("POST", stack.envoy.url + URL, req(model))[0] == 200


def test_mark_expires_after_one_second_without_thresholds_or_reports(stack: Stack) -> None:
    register(stack, "expire", "c")
    assert http("POST", stack.envoy.url + URL, req("expire"), reject("c"))[0] == 529
    marked = time.monotonic()
    assert stack.ext.workers()["expire-c"]["state"] == "overloaded"
    wait_until(lambda: stack.ext.workers()["expire-c"]["state"] == "free", 3, "mark expiry")
    assert time.monotonic() - marked >= 0.8
    assert http("POST", stack.envoy.url + URL, req("expire"))[0] == 200


@pytest.mark.parametrize(
    ("status", "headers"),
    [
        ("500", {"x-test-status": "500"}),  # an error, not an overload: passes through
        ("200", {"x-test-status": "200", "x-test-overloaded": "1"}),  # 2xx: header ignored
        ("503", {"x-test-status": "503"}),  # 503 without the header is the worker's own reply
    ],
)
def test_other_responses_pass_through(stack: Stack, status: str, headers: dict[str, str]) -> None:
    model = f"pass-{status}"
    register(stack, model, "a")
    got, _, body = http("POST", stack.envoy.url + URL, req(model), headers)
    assert got == int(status)
    assert json.loads(body)["worker_id"] == "a"
    assert stack.ext.workers()[f"{model}-a"]["state"] == "free"


def test_translated_reply_uses_configured_status(make_stack: Any) -> None:
    s = make_stack([], {"DYN_HTTP_OVERLOAD_STATUS_CODE": "503"})
    s.pub.announce(s.ext, "st-a", "m", s.endpoint("a"))
    status, _, body = http("POST", s.envoy.url + URL, req("m"), reject("a", "529", False))
    assert status == 503
    assert json.loads(body) == {
        "message": "Service temporarily overloaded",
        "type": "Service Unavailable",
        "code": 503,
    }
