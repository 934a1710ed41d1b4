"""Everything a request holds is released however it ends: finished, failed, or the client
gone at any point (headers, mid-body, mid-stream). Real Envoy, real sockets."""

from __future__ import annotations

import asyncio
import json
import random
from typing import Any

import pytest

from extproc.devstack import wait_until
from tests.conftest import GRPC_SERVERS, Stack


@pytest.fixture(scope="module", params=GRPC_SERVERS)
def stack(make_stack: Any, request: pytest.FixtureRequest) -> Stack:
    return make_stack(["--grpc-server", request.param, "--worker-ttl", "120"])


def _request(body: bytes, headers: dict[str, str], path: str = "/v1/completions") -> bytes:
    head = "".join(f"{k}: {v}\r\n" for k, v in headers.items())
    return (
        f"POST {path} HTTP/1.1\r\nhost: x\r\ncontent-type: application/json\r\n"
        f"content-length: {len(body)}\r\n{head}\r\n"
    ).encode() + body


async def _one(port: int, kind: str, rng: random.Random) -> str:
    body = json.dumps(
        {
            "model": "rel",
            "prompt": "x" * rng.randint(1, 4000),
            "stream": kind in ("stream", "drop_mid_stream"),
        }
    ).encode()
    headers: dict[str, str] = {"x-test-chunks": "30", "x-test-delay-ms": "10"}
    if kind == "worker_error":
        headers = {"x-test-status": rng.choice(["500", "502", "400"])}
    elif kind == "worker_reject":
        headers = {"x-test-status": "503", "x-test-overloaded": "1"}
    elif kind == "hang_then_drop":
        headers = {"x-test-hang": "1"}
    reader, writer = await asyncio.open_connection("127.0.0.1", port)
    try:
        raw = _request(body, headers)
        if kind == "drop_headers":
            writer.write(raw[: raw.index(b"\r\n\r\n")])  # headers only, never the body
            await writer.drain()
            await asyncio.sleep(rng.uniform(0, 0.05))
            return kind
        if kind == "drop_mid_body":
            writer.write(raw[: len(raw) - len(body) // 2])
            await writer.drain()
            await asyncio.sleep(rng.uniform(0, 0.05))
            return kind
        writer.write(raw)
        await writer.drain()
        if kind in ("drop_mid_stream", "hang_then_drop"):
            if kind == "drop_mid_stream":
                # A 529 (workers marked overloaded by a worker_reject) has no stream.
                await asyncio.wait_for(reader.readuntil(b"\r\n\r\n"), 10)
            await asyncio.sleep(rng.uniform(0.01, 0.1))
            return kind
        await asyncio.wait_for(reader.readuntil(b"\r\n\r\n"), 10)
        return kind
    finally:
        writer.close()


async def test_estimates_return_to_zero_after_random_disconnects_and_errors(stack: Stack) -> None:
    for name in "abc":
        stack.pub.announce(stack.ext, f"rel-{name}", "rel", stack.endpoint(name))
    rng = random.Random(7)
    kinds = [
        "ok",
        "stream",
        "worker_error",
        "worker_reject",
        "drop_headers",
        "drop_mid_body",
        "drop_mid_stream",
        "hang_then_drop",
    ]
    plan = [rng.choice(kinds) for _ in range(400)]
    plan[::25] = ["worker_reject"] * len(plan[::25])  # a few; each marks a worker for 1 s
    plan = [k if k != "worker_reject" or i % 25 == 0 else "ok" for i, k in enumerate(plan)]
    sem = asyncio.Semaphore(32)

    async def run(kind: str) -> str:
        async with sem:
            return await _one(stack.envoy.port, kind, rng)

    done = await asyncio.wait_for(asyncio.gather(*(run(k) for k in plan)), 120)
    assert sorted(done) == sorted(plan)
    assert {"drop_headers", "drop_mid_body", "drop_mid_stream", "hang_then_drop"} <= set(plan)

    def all_zero() -> bool:
        workers = stack.ext.workers()
        return all(
            r["router_estimate"]
            == {"requests_in_flight": 0, "active_decode_blocks": 0, "active_prefill_tokens": 0}
            for wid, w in workers.items()
            if wid.startswith("rel-")
            for r in w["ranks"]
        )

    await asyncio.to_thread(wait_until, all_zero, 30, "every router estimate back to 0")
