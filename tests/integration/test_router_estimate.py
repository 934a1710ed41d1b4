"""Router-side accounting through the real Envoy (docs/routing.md): reports lag, estimates not."""

from __future__ import annotations

import json
from collections import Counter
from concurrent.futures import ThreadPoolExecutor
from typing import Any

import pytest

from extproc.devstack import http, wait_until
from tests.conftest import Stack

PROMPT_100 = "x" * 400  # 100 prompt tokens, 7 blocks of 16
# The default config decides on the headers and estimates prompt tokens from the body's
# size (docs/request-path.md): ceil(content-length / 4), still 7 blocks of 16.
ESTIMATE = -(-len(json.dumps({"model": "burst", "prompt": PROMPT_100})) // 4)


@pytest.fixture(scope="module")
def stack(make_stack: Any) -> Stack:
    return make_stack(["--active-prefill-tokens-threshold", "250", "--worker-ttl", "120"])


def test_burst_spreads_across_workers_and_fills_them_before_any_report(stack: Stack) -> None:
    for name in "abc":
        stack.pub.announce(
            stack.ext, f"burst-{name}", "burst", stack.endpoint(name), kv_total_blocks=1000
        )
        stack.pub.load(f"burst-{name}", active_decode_blocks=0, active_prefill_tokens=0)
    wait_until(
        lambda: all(
            stack.ext.workers()[f"burst-{n}"]["last_load_age_s"] is not None for n in "abc"
        ),
        5,
        "first reports",
    )
    # From here on no worker reports anything: only the router's estimate moves.
    body = {"model": "burst", "prompt": PROMPT_100}
    hold = {"x-test-delay-ms": "2500"}

    def one(_: int) -> tuple[int, str | None]:
        status, headers, _body = http(
            "POST", stack.envoy.url + "/v1/completions", body, hold, timeout=20
        )
        return status, headers.get("x-worker-id")

    with ThreadPoolExecutor(10) as pool:
        futures = [pool.submit(one, i) for i in range(10)]
        # While they are in flight, every worker is busy by the estimate alone:
        # 3 x ~100 tokens > 250 on each.
        wait_until(
            lambda: all(stack.ext.workers()[f"burst-{n}"]["state"] == "busy" for n in "abc"),
            10,
            "estimate fills every worker",
        )
        views = stack.ext.workers()
        for n in "abc":
            rank = views[f"burst-{n}"]["ranks"][0]
            assert rank["reported"]["active_prefill_tokens"] == 0  # no report says so
            assert rank["router_estimate"]["active_prefill_tokens"] == 3 * ESTIMATE
            assert rank["router_estimate"]["active_decode_blocks"] == 21
            assert rank["fired"] == "active_prefill_tokens_threshold"
        results = [f.result() for f in futures]
    served = Counter(worker for status, worker in results if status == 200)
    assert served == {"a": 3, "b": 3, "c": 3}, results
    assert [s for s, _ in results].count(529) == 1
    wait_until(
        lambda: all(stack.ext.workers()[f"burst-{n}"]["state"] == "free" for n in "abc"),
        10,
        "released",
    )
