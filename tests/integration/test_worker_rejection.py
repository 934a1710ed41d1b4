"""Worker-side rejections through the real Envoy: retried on another free worker, else turned
into the frontend overload reply, counted, and the worker skipped until its next load report
or 1 s (docs/routing.md). A rejection is a non-2xx with ``x-worker-overloaded: 1``, a 529, or
a status of ``--worker-busy-statuses`` (429 and 503 by default: what vLLM and llama-server
answer when they refuse work); the echo workers are real aiohttp servers answering them."""

from __future__ import annotations

import json
import time
from typing import Any

import pytest

from extproc.devstack import free_port, http, metric_value, wait_until
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
        ("502", {"x-test-status": "502"}),  # not in the busy list
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


def rejection_count(stack: Stack, model: str) -> float:
    labels = {"model": model, "endpoint": "completions"}
    return metric_value(stack.ext.metrics(), "dynamo_frontend_model_rejection_total", labels) or 0


def states(stack: Stack, model: str, names: str) -> dict[str, str]:
    workers = stack.ext.workers()
    return {n: workers[f"{model}-{n}"]["state"] for n in names}


@pytest.mark.parametrize("status", ["503", "429"])
def test_a_workers_own_busy_status_is_retried_on_the_next_listed_worker(
    stack: Stack, status: str
) -> None:
    """No x-worker-overloaded header: the status alone means busy, and Envoy retries it on
    the fallback the extproc listed (x-envoy-retriable-status-codes), not on the route's
    configured codes. The worker that refused is skipped for a moment even though the
    fallback served the request; the client never sees the refusal."""
    model = f"own-{status}"
    register(stack, model, "ab")
    before = envoy_stat(stack, "cluster.workers.upstream_rq_retry_success")
    retried = False
    for _ in range(4):
        got, headers, _ = http(
            "POST", stack.envoy.url + URL, req(model), reject("a", status, False)
        )
        assert (got, headers["x-worker-id"]) == (200, "b")
        if envoy_stat(stack, "cluster.workers.upstream_rq_retry_success") > before:
            retried = True
            break
    assert retried, "no request was picked for a and retried on b"
    assert rejection_count(stack, model) == 0
    assert states(stack, model, "ab") == {"a": "overloaded", "b": "free"}
    # A load report clears the mark at once.
    stack.pub.load(f"{model}-a", active_decode_blocks=0)
    wait_until(lambda: states(stack, model, "ab")["a"] == "free", timeout=5)


@pytest.mark.parametrize("status", ["503", "429"])
def test_every_listed_worker_refusing_is_the_overload_reply_and_marks_them_all(
    stack: Stack, status: str
) -> None:
    model = f"refuse-{status}"
    register(stack, model, "ab")
    retries = envoy_stat(stack, "cluster.workers.upstream_rq_retry")
    got, headers, body = http(
        "POST", stack.envoy.url + URL, req(model), reject("a,b", status, False)
    )
    assert (got, body) == (529, OVERLOADED)
    assert headers["x-shed-reason"] == "worker_overloaded"
    assert headers["retry-after"] == "1"
    assert envoy_stat(stack, "cluster.workers.upstream_rq_retry") > retries  # both were tried
    assert rejection_count(stack, model) == 1
    # The pick and the fallback Envoy retried on are both skipped: the next request is
    # answered by the extproc, no worker is asked.
    assert states(stack, model, "ab") == {"a": "overloaded", "b": "overloaded"}
    upstream = envoy_stat(stack, "cluster.workers.upstream_rq_total")
    got, headers, _ = http("POST", stack.envoy.url + URL, req(model))
    assert (got, headers["x-shed-reason"]) == (529, "worker_overloaded")
    assert envoy_stat(stack, "cluster.workers.upstream_rq_total") == upstream
    assert rejection_count(stack, model) == 2


def test_a_busy_status_mark_expires_within_a_second(stack: Stack) -> None:
    register(stack, "lapse", "ab")
    got, headers, _ = http("POST", stack.envoy.url + URL, req("lapse"), reject("a,b", "503", False))
    assert (got, headers["x-shed-reason"]) == (529, "worker_overloaded")
    marked = time.monotonic()
    assert set(states(stack, "lapse", "ab").values()) == {"overloaded"}
    wait_until(lambda: set(states(stack, "lapse", "ab").values()) == {"free"}, 5, "marks expired")
    elapsed = time.monotonic() - marked
    assert 0.5 <= elapsed <= 2.5, elapsed  # 1 s, polled through the admin API
    got, headers, _ = http("POST", stack.envoy.url + URL, req("lapse"))
    assert got == 200 and headers["x-worker-id"] in ("a", "b")


def test_busy_statuses_turned_off_pass_the_workers_503_through(make_stack: Any) -> None:
    s = make_stack([], {"EXTPROC_WORKER_BUSY_STATUSES": ""})
    for n in "ab":
        s.pub.announce(s.ext, f"off-{n}", "off", s.endpoint(n))
    got, headers, body = http("POST", s.envoy.url + URL, req("off"), reject("a,b", "503", False))
    assert got == 503 and json.loads(body)["worker_id"] == headers["x-worker-id"]
    assert envoy_stat(s, "cluster.workers.upstream_rq_retry") == 0  # not retried either
    assert states(s, "off", "ab") == {"a": "free", "b": "free"}
    assert rejection_count(s, "off") == 0
    assert http("POST", s.envoy.url + URL, req("off"), reject("a,b", "429", False))[0] == 429
    # Nor can a client ask for the retries itself.
    asked = {**reject("a,b", "503", False), "x-envoy-retriable-status-codes": "503"}
    assert http("POST", s.envoy.url + URL, req("off"), asked)[0] == 503
    assert envoy_stat(s, "cluster.workers.upstream_rq_retry") == 0
    # A 529 and x-worker-overloaded: 1 still mean busy.
    got, headers, _ = http("POST", s.envoy.url + URL, req("off"), reject("a,b", "503"))
    assert (got, headers["x-shed-reason"]) == (529, "worker_overloaded")


def test_a_custom_list_of_busy_statuses(make_stack: Any) -> None:
    s = make_stack(["--worker-busy-statuses", "500"])
    for n in "ab":
        s.pub.announce(s.ext, f"custom-{n}", "custom", s.endpoint(n))
    for _ in range(4):  # a 500 from one worker is retried on the other
        got, headers, _ = http("POST", s.envoy.url + URL, req("custom"), reject("a", "500", False))
        assert (got, headers["x-worker-id"]) == (200, "b")
    # a refused (500) and b served: a is skipped until its next load report.
    s.pub.load("custom-a", active_decode_blocks=0)
    wait_until(lambda: states(s, "custom", "ab")["a"] == "free", timeout=5)
    # 503 is not in the list: the worker's reply reaches the client.
    assert http("POST", s.envoy.url + URL, req("custom"), reject("a,b", "503", False))[0] == 503
    assert states(s, "custom", "ab") == {"a": "free", "b": "free"}
    got, headers, _ = http("POST", s.envoy.url + URL, req("custom"), reject("a,b", "500", False))
    assert (got, headers["x-shed-reason"]) == (529, "worker_overloaded")
    assert states(s, "custom", "ab") == {"a": "overloaded", "b": "overloaded"}


@pytest.fixture(scope="module")
def dead_stack(log_dir: Any, echo_workers: dict[str, int]) -> Any:
    """A stack whose Envoy also lists a port nothing listens on."""
    s = Stack(log_dir, {**echo_workers, "dead": free_port()}, [])
    yield s
    s.close()


def test_envoys_own_503_for_an_unreachable_worker_keeps_its_handling(dead_stack: Stack) -> None:
    """Envoy's local 503 (x-upstream-failure) is not the worker's 503: worker_unreachable."""
    s = dead_stack
    s.pub.announce(s.ext, "gone", "gone", s.endpoint("dead"))
    got, headers, body = http("POST", s.envoy.url + URL, req("gone"))
    assert (got, body) == (529, OVERLOADED)
    assert headers["x-shed-reason"] == "worker_unreachable"
    text = s.ext.metrics()
    assert metric_value(text, "extproc_worker_unreachable_total", {"model": "gone"}) == 1
    assert s.ext.workers()["gone"]["state"] == "overloaded"
