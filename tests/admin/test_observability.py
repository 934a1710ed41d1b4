"""Metrics, /health, /ready and /debug/workers after real traffic through Envoy."""

from __future__ import annotations

import json
from typing import Any

import pytest
from aiohttp.test_utils import TestClient, TestServer

from extproc.admin.app import Readiness, build_app
from extproc.core.busy import BusyThresholds
from extproc.core.pool import WorkerPool
from extproc.devstack import get_json, http, metric_value, wait_until
from extproc.metrics.registry import Metrics
from tests.conftest import Stack

CHAT = "/v1/chat/completions"


def chat(model: str) -> dict[str, Any]:
    return {"model": model, "messages": [{"role": "user", "content": "hi"}]}


@pytest.fixture(scope="module")
def stack(make_stack: Any) -> Stack:
    return make_stack(
        [
            "--active-decode-blocks-threshold",
            "0.5",
            "--active-prefill-tokens-threshold-frac",
            "1.0",
            "--worker-ttl",
            "4",
        ]
    )


def test_unlabelled_series_exist_at_zero_and_labelled_appear_with_use(stack: Stack) -> None:
    text = stack.ext.metrics()
    assert metric_value(text, "extproc_events_lost_total") == 0
    assert metric_value(text, "extproc_streams") == 0
    assert metric_value(text, "extproc_grpc_connections") == 0
    assert metric_value(text, "extproc_decision_seconds_count") == 0
    assert metric_value(text, "extproc_router_queue_wait_seconds_count") == 0
    assert "dynamo_frontend_model_rejection_total{" not in text
    assert "extproc_decisions_total{" not in text
    for name in (
        "dynamo_frontend_model_rejection_total",
        "extproc_decisions_total",
        "extproc_events_total",
        "extproc_events_dropped_total",
        "extproc_workers",
        "dynamo_frontend_worker_active_decode_blocks",
        "dynamo_frontend_worker_active_prefill_tokens",
        "extproc_router_queue_depth",
    ):
        assert f"# TYPE {name}" in text, name


def test_metrics_after_traffic(stack: Stack) -> None:
    pub, ext, url = stack.pub, stack.ext, stack.envoy.url
    assert http("POST", url + CHAT, chat("m"))[0] == 503  # no workers yet
    pub.announce(
        ext,
        "mx-1",
        "m",
        stack.endpoint("a"),
        kv_total_blocks=100,
        max_num_batched_tokens=64,
        worker_type="prefill",
        dp_size=2,
    )
    pub.announce(ext, "mx-2", "m", stack.endpoint("b"), kv_total_blocks=100)
    pub.load("mx-1", dp_rank=0, active_decode_blocks=60, active_prefill_tokens=3)
    pub.load("mx-1", dp_rank=1, active_decode_blocks=7, active_prefill_tokens=65)
    pub.load("mx-2", active_decode_blocks=51)
    pub.send("load", b"\xc1")  # dropped: bad_encoding
    pub.send("nope", {"v": 1})  # dropped: unknown_topic
    wait_until(
        lambda: (
            ext.workers()["mx-1"]["state"] == "busy" and ext.workers()["mx-2"]["state"] == "busy"
        ),
        5,
        "all busy",
    )
    for path, _label, n in (
        (CHAT, "chat_completions", 2),
        ("/v1/completions", "completions", 1),
        ("/v1/embeddings", "embeddings", 3),
        ("/v1/responses", "responses", 1),
    ):
        for _ in range(n):
            assert http("POST", url + path, {"model": "m", "prompt": "x", "input": "x"})[0] == 529
    assert http("POST", url + CHAT, chat("other"))[0] == 404
    assert http("POST", url + CHAT, b"{")[0] == 400
    assert http("GET", url + "/passthrough")[0] == 200
    pub.load("mx-2", active_decode_blocks=1)
    wait_until(lambda: ext.workers()["mx-2"]["state"] == "free", 5, "mx-2 free")
    assert http("POST", url + CHAT, chat("m"))[0] == 200

    text = ext.metrics()
    for label, n in (
        ("chat_completions", 2),
        ("completions", 1),
        ("embeddings", 3),
        ("responses", 1),
    ):
        got = metric_value(
            text, "dynamo_frontend_model_rejection_total", {"model": "m", "endpoint": label}
        )
        assert got == n, label
    for outcome, n in (
        ("routed", 1),
        ("overloaded", 7),
        ("no_workers", 1),
        ("model_not_found", 1),
        ("bad_request", 1),
        ("passthrough", 1),
    ):
        assert metric_value(text, "extproc_decisions_total", {"outcome": outcome}) == n, outcome
    assert metric_value(text, "extproc_decision_seconds_count") == 10
    assert metric_value(text, "extproc_events_dropped_total", {"reason": "bad_encoding"}) == 1
    assert metric_value(text, "extproc_events_dropped_total", {"reason": "unknown_topic"}) == 1
    assert (metric_value(text, "extproc_events_total", {"topic": "config"}) or 0) >= 2
    assert (metric_value(text, "extproc_events_total", {"topic": "load"}) or 0) >= 4
    blocks = {"worker_id": "mx-1", "dp_rank": "1", "worker_type": "prefill"}
    assert metric_value(text, "dynamo_frontend_worker_active_decode_blocks", blocks) == 7
    assert metric_value(text, "dynamo_frontend_worker_active_prefill_tokens", blocks) == 65
    assert metric_value(text, "extproc_workers", {"state": "busy"}) == 1
    assert metric_value(text, "extproc_workers", {"state": "free"}) == 1
    assert get_json(ext.admin + "/health") == {
        "status": "healthy",
        "workers": {"free": 1, "busy": 1, "overloaded": 0},
    }

    # A worker that leaves takes its series with it.
    pub.bye("mx-1")
    wait_until(lambda: "mx-1" not in ext.workers(), 5, "bye")
    text = ext.metrics()
    assert 'worker_id="mx-1"' not in text
    assert 'worker_id="mx-2"' in text


def test_debug_workers_explains_why(stack: Stack) -> None:
    pub, ext = stack.pub, stack.ext
    pub.announce(ext, "dbg-1", "dbg", stack.endpoint("c"))  # no kv_total, no max_batched
    pub.load("dbg-1", active_decode_blocks=10**6, active_prefill_tokens=10**6)
    wait_until(
        lambda: ext.workers()["dbg-1"]["ranks"][0]["reported"]["active_decode_blocks"], 5, "load"
    )
    w = ext.workers()["dbg-1"]
    assert w["state"] == "free"
    rank = w["ranks"][0]
    assert "kv_total_blocks" in rank["cannot_fire"]["active_decode_blocks_threshold"]
    assert "max_num_batched_tokens" in rank["cannot_fire"]["active_prefill_tokens_threshold_frac"]
    assert rank["fired"] is None and rank["busy"] is False
    # Now give it the prerequisites: the decode check fires and the view says which one.
    pub.announce(
        ext, "dbg-1", "dbg", stack.endpoint("c"), kv_total_blocks=100, max_num_batched_tokens=64
    )
    pub.load("dbg-1", active_decode_blocks=51, active_prefill_tokens=0)
    wait_until(
        lambda: ext.workers()["dbg-1"]["ranks"][0]["reported"]["active_decode_blocks"] == 51,
        5,
        "the second load",
    )
    w = ext.workers()["dbg-1"]
    assert w["state"] == "busy"
    rank = w["ranks"][0]
    assert rank["fired"] == "active_decode_blocks_threshold"
    assert rank["busy_limits"] == {
        "active_decode_blocks_threshold": 50,
        "active_prefill_tokens_threshold": None,
        "active_prefill_tokens_threshold_frac": 64,
    }
    assert rank["effective"]["active_decode_blocks"] == 51
    assert rank["cannot_fire"] == {}
    assert "active_decode_blocks_threshold" in w["why"]

    # Config heartbeats keep the worker but load stops: the view says for how long.
    def stale() -> bool:
        pub.config(
            "dbg-1", "dbg", stack.endpoint("c"), kv_total_blocks=100, max_num_batched_tokens=64
        )
        reasons = ext.workers()["dbg-1"]["ranks"][0]["cannot_fire"]
        return "no load events for" in reasons.get("active_decode_blocks_threshold", "")

    wait_until(stale, 8, "stale load reported")


def test_debug_workers_decode_inactive_outside_kv_mode(make_stack: Any) -> None:
    s = make_stack(["--router-mode", "round-robin", "--active-decode-blocks-threshold", "0.1"])
    s.pub.announce(s.ext, "rr-1", "m", s.endpoint("a"), kv_total_blocks=10)
    s.pub.load("rr-1", active_decode_blocks=9)
    wait_until(
        lambda: s.ext.workers()["rr-1"]["ranks"][0]["reported"]["active_decode_blocks"], 5, "load"
    )
    w = s.ext.workers()["rr-1"]
    assert w["state"] == "free"
    assert "router mode is not kv" in w["ranks"][0]["cannot_fire"]["active_decode_blocks_threshold"]
    assert http("POST", s.envoy.url + CHAT, chat("m"))[0] == 200
    assert "router-mode kv" in s.ext.proc.log()


async def test_ready_is_503_until_grpc_and_events_are_up() -> None:
    pool = WorkerPool(BusyThresholds())
    readiness = Readiness()
    async with TestClient(TestServer(build_app(pool, Metrics(), readiness))) as client:
        resp = await client.get("/ready")
        assert resp.status == 503
        assert set(json.loads(await resp.text())["waiting_for"]) == {"grpc", "events"}
        readiness.events_bound = True
        assert (await client.get("/ready")).status == 503
        readiness.grpc_serving = True
        assert (await client.get("/ready")).status == 200
        health = await client.get("/health")
        assert health.status == 200
        assert (await health.json())["workers"] == {"free": 0, "busy": 0, "overloaded": 0}
