"""--router-queue-threshold through the real Envoy: hold, FIFO, dispatch on release, time out."""

from __future__ import annotations

import asyncio
import functools
import json
import time
from typing import Any

import pytest

from extproc.devstack import http, metric_value, wait_until
from tests.conftest import GRPC_SERVERS, Stack

URL = "/v1/completions"
PROMPT_101 = "x" * 404  # 101 prompt tokens: one request fills a worker's queue limit of 100
# The default config decides on the headers and estimates prompt tokens from the body's
# size (docs/request-path.md): ceil(content-length / 4), a little above 101.
ESTIMATE = -(-len(json.dumps({"model": "m", "prompt": PROMPT_101})) // 4)


@pytest.fixture(scope="module", params=GRPC_SERVERS)
def stack(make_stack: Any, request: pytest.FixtureRequest) -> Stack:
    s = make_stack(
        [
            "--grpc-server",
            request.param,
            "--router-queue-threshold",
            "1.0",
            "--router-queue-timeout",
            "1.5",
            "--worker-ttl",
            "120",
        ]
    )
    s.pub.announce(s.ext, "q-1", "m", s.endpoint("a"), max_num_batched_tokens=100)
    return s


async def _post(
    stack: Stack,
    headers: dict[str, str],
    prompt: str = PROMPT_101,
) -> tuple[int, float, bytes]:
    def call() -> tuple[int, float, bytes]:
        status, _, body = http(
            "POST", stack.envoy.url + URL, {"model": "m", "prompt": prompt}, headers, timeout=20
        )
        return status, time.monotonic(), body

    return await asyncio.to_thread(call)


def _depth_is(stack: Stack, n: int) -> bool:
    return _depth(stack) == n


def _depth(stack: Stack) -> float:
    return metric_value(stack.ext.metrics(), "extproc_router_queue_depth", {"model": "m"}) or 0


async def test_waits_then_dispatches_when_the_worker_frees(stack: Stack) -> None:
    # The first must still run when the second reaches the router (each step waits through
    # /metrics: 600 ms was too short on 2 busy cores), and end before the second times out
    # in the queue (1.5 s).
    start = time.monotonic()
    first = asyncio.create_task(_post(stack, {"x-test-delay-ms": "1200"}))
    await asyncio.to_thread(
        wait_until,
        lambda: (
            stack.ext.workers()["q-1"]["ranks"][0]["router_estimate"]["active_prefill_tokens"]
            == ESTIMATE
        ),
        5,
        "first in",
    )
    second = asyncio.create_task(_post(stack, {}))
    await asyncio.to_thread(wait_until, lambda: _depth(stack) == 1, 5, "second queued")
    (s1, _, b1), (s2, t2, b2) = await asyncio.gather(first, second)
    assert (s1, s2) == (200, 200)
    # The second reached the worker only after the first's 1.2 s there had passed: read on
    # the worker's clock, not on the client threads' (a busy core can note the first reply
    # 200 ms late, after the second's).
    assert json.loads(b2)["received"] >= json.loads(b1)["received"] + 1.2
    assert t2 - start >= 1.15
    text = stack.ext.metrics()
    assert metric_value(text, "extproc_router_queue_wait_seconds_count") == 1
    assert _depth(stack) == 0


async def test_fifo_order(stack: Stack) -> None:
    # The blocker must still run while the three are queued one after another (each waits
    # for the queue depth through /metrics: 400 ms was too short on 2 busy cores), and end
    # before the first of them times out in the queue (1.5 s). The order is the one in which
    # they reached the worker (its clock), not the one in which the client threads noted the
    # replies: 50 ms apart, a busy core's thread scheduling could swap those.
    blocker = asyncio.create_task(_post(stack, {"x-test-delay-ms": "1200"}))
    await asyncio.to_thread(
        wait_until,
        lambda: (
            stack.ext.workers()["q-1"]["ranks"][0]["router_estimate"]["requests_in_flight"] == 1
        ),
        5,
        "blocker in",
    )
    waiters = []
    for i in range(3):
        waiters.append(asyncio.create_task(_post(stack, {"x-test-delay-ms": "50"})))
        await asyncio.to_thread(wait_until, functools.partial(_depth_is, stack, i + 1), 5, "queued")
    results = await asyncio.gather(blocker, *waiters)
    assert all(r[0] == 200 for r in results)
    reached = [json.loads(r[2])["received"] for r in results[1:]]
    assert reached == sorted(reached), "queued requests reached the worker out of arrival order"


async def test_wait_is_bounded_and_ends_in_the_overload_reply(stack: Stack) -> None:
    before = (
        metric_value(stack.ext.metrics(), "extproc_decisions_total", {"outcome": "queue_timeout"})
        or 0
    )
    hog = asyncio.create_task(_post(stack, {"x-test-delay-ms": "3000"}))
    await asyncio.to_thread(
        wait_until,
        lambda: (
            stack.ext.workers()["q-1"]["ranks"][0]["router_estimate"]["requests_in_flight"] == 1
        ),
        5,
        "hog in",
    )
    started = time.monotonic()
    status, ended, body = await _post(stack, {})
    assert status == 529
    assert body == b'{"message":"Service temporarily overloaded","type":"Overloaded","code":529}'
    assert 1.4 <= ended - started < 3.0  # the queue timeout, within Envoy's extended timer
    text = stack.ext.metrics()
    assert metric_value(text, "extproc_decisions_total", {"outcome": "queue_timeout"}) == before + 1
    assert (await hog)[0] == 200


async def test_small_requests_are_not_held_and_disconnect_leaves_queue(stack: Stack) -> None:
    # Under the limit: no queueing at all.
    status, _, body = await _post(stack, {}, prompt="hi")
    assert status == 200 and json.loads(body)["worker_id"] == "a"
    hog = asyncio.create_task(_post(stack, {"x-test-delay-ms": "1200"}))
    await asyncio.to_thread(
        wait_until,
        lambda: (
            stack.ext.workers()["q-1"]["ranks"][0]["router_estimate"]["requests_in_flight"] == 1
        ),
        5,
        "hog in",
    )
    _reader, writer = await asyncio.open_connection("127.0.0.1", stack.envoy.port)
    body = json.dumps({"model": "m", "prompt": "hi"}).encode()
    writer.write(
        b"POST /v1/completions HTTP/1.1\r\nhost: x\r\ncontent-type: application/json\r\n"
        b"content-length: %d\r\n\r\n" % len(body) + body
    )
    await writer.drain()
    await asyncio.to_thread(wait_until, lambda: _depth(stack) == 1, 5, "queued")
    writer.close()
    await asyncio.to_thread(wait_until, lambda: _depth(stack) == 0, 5, "left the queue")
    assert (await hog)[0] == 200
    await asyncio.to_thread(
        wait_until,
        lambda: (
            stack.ext.workers()["q-1"]["ranks"][0]["router_estimate"]["requests_in_flight"] == 0
        ),
        5,
        "all released",
    )
