"""Deadline admission on the real engine: Envoy -> extproc -> two llama.cpp engines serving
SmolLM2-135M on this CPU (2 slots each), each with its sidecar agent publishing its slots.

One engine pair per module. The router first measures the engines (a few streamed chats
through Envoy: their prefill and how long a request holds a slot); then each test fills all
four slots with streamed generations through Envoy, so that the router counts them in flight
and a next request must wait for a slot:

- a target its wait does not fit: answered 529 at once (``x-shed-reason: deadline``,
  ``retry-after-ms``), in well under the target;
- the target removed: the plain thresholds (none here: nothing is shed) admit the very next
  request, which waits for its slot at the engine;
- a target longer than the fills' remaining time: held in the router, not sent to wait at
  the engine, and served when a fill ends and frees its slot.

TTFT is taken at the first response body byte (the observer filter of
envoy-track-output.yaml). No thresholds are configured: the target alone decides. Without
the engine installed the module fails under CI and skips elsewhere, saying why.
"""

from __future__ import annotations

import asyncio
import json
import time
from collections.abc import Coroutine, Iterator
from dataclasses import dataclass
from typing import Any

import aiohttp
import pytest

from extproc.core.busy import TTFT_TARGET
from extproc.devstack import (
    ROOT,
    AgentProcess,
    Envoy,
    Extproc,
    cli_flags,
    http,
    metric_value,
    wait_until,
)
from extproc.devstack.llamacpp import LlamaServer
from tests.support.engine import require_engine

MODEL = "smollm2"
SLOTS = 2  # per engine
CHAT = {
    "model": MODEL,
    "messages": [{"role": "user", "content": "Hi"}],
    "max_tokens": 24,
    "stream": True,
}
# A fill holds its slot for its 100 tokens: 3-8 s here with four running on 2 shared cores.
FILL = {
    "model": MODEL,
    "prompt": "Once upon a time",
    "max_tokens": 100,
    "ignore_eos": True,
    "stream": True,
}
WAIT = 60.0  # the machine is shared and has 2 cores: conditions get generous deadlines


require_engine()


@dataclass
class Stack:
    ext: Extproc
    envoy: Envoy
    worker_ids: tuple[str, ...]

    def target(self, **body: Any) -> dict[str, Any]:
        status, _, raw = http("POST", self.ext.admin + "/busy_threshold", {"model": MODEL, **body})
        assert status == 200, raw
        out: dict[str, Any] = json.loads(raw)
        return out

    def deadline(self) -> dict[str, dict[str, Any]]:
        """Each worker's deadline view in /debug/workers."""
        return {w: v["deadline"] for w, v in self.ext.workers().items() if w in self.worker_ids}

    def metric(self, name: str, labels: dict[str, str] | None = None) -> float:
        return metric_value(self.ext.metrics(), name, labels) or 0.0


@pytest.fixture(scope="module")
def stack(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Stack]:
    logs = tmp_path_factory.mktemp("llamacpp-deadline")
    ext = Extproc(logs, ["--worker-ttl", "60"])
    servers: list[LlamaServer] = []
    agents: list[AgentProcess] = []
    envoy = None
    try:
        for i in range(2):
            servers.append(LlamaServer(logs, name=f"llama-{i}", ctx=1024, parallel=SLOTS))
        ids = tuple(f"llama-{i}" for i in range(2))
        for worker_id, server in zip(ids, servers, strict=True):
            flags = cli_flags(
                engine="llamacpp", engine_url=server.url, model=MODEL,
                endpoint=server.endpoint, worker_id=worker_id, block_size=16, interval=0.1,
                publish=ext.event_endpoint,
            )  # fmt: skip
            agents.append(AgentProcess(flags, log_dir=logs, name=f"agent-{worker_id}"))
        envoy = Envoy(
            logs,
            ext,
            [s.port for s in servers],
            source=ROOT / "envoy" / "envoy-track-output.yaml",
        )
        wait_until(lambda: set(ids) <= set(ext.workers()), WAIT, "both agents announced")
        st = Stack(ext, envoy, ids)
        wait_until(
            lambda: all(v["slots"] == SLOTS for v in st.deadline().values()),
            WAIT,
            "both engines reported their slots",
        )
        yield st
    finally:
        if envoy is not None:
            envoy.stop()
        for agent in agents:
            agent.stop()
        for server in servers:
            server.stop()
        ext.stop()


@dataclass
class Result:
    status: int
    headers: dict[str, str]
    first_byte: float  # s after sending
    done: float


async def send(session: aiohttp.ClientSession, url: str, path: str, body: Any) -> Result:
    start = time.monotonic()
    async with session.post(url + path, json=body) as resp:
        first = None
        async for _ in resp.content.iter_any():
            if first is None:
                first = time.monotonic() - start
        end = time.monotonic() - start
        headers = {k.lower(): v for k, v in resp.headers.items()}
        return Result(resp.status, headers, end if first is None else first, end)


def chat(session: aiohttp.ClientSession, stack: Stack) -> Coroutine[Any, Any, Result]:
    return send(session, stack.envoy.url, "/v1/chat/completions", CHAT)


async def measured(session: aiohttp.ClientSession, stack: Stack) -> None:
    """Streamed chats until every worker has a completion rate (the router learns how
    long a request holds a slot from the streams it sees end)."""
    for _ in range(12):
        if all(v["completion_rate_per_s"] for v in stack.deadline().values()):
            break
        got = await asyncio.gather(chat(session, stack), chat(session, stack))
        assert [r.status for r in got] == [200, 200], got
    assert all(v["completion_rate_per_s"] for v in stack.deadline().values()), stack.deadline()


async def fill(session: aiohttp.ClientSession, stack: Stack) -> list[asyncio.Task[Result]]:
    """Four streamed generations through Envoy, until the router counts both slots of both
    workers taken by them. A target they all fit is set first: each goes to a free slot
    (the plain rule, blind to slots, might put three on one worker)."""
    stack.target(**{TTFT_TARGET: 25_000})
    fills = [
        asyncio.create_task(send(session, stack.envoy.url, "/v1/completions", FILL))
        for _ in range(2 * SLOTS)
    ]

    def full() -> bool:
        return all(v["occupancy"] >= SLOTS for v in stack.deadline().values())

    await asyncio.to_thread(wait_until, full, WAIT, "every slot taken by a fill")
    return fills


async def test_a_wait_past_the_target_is_rejected_at_once_and_removing_it_admits(
    stack: Stack,
) -> None:
    timeout = aiohttp.ClientTimeout(total=WAIT)
    async with aiohttp.ClientSession(timeout=timeout) as session:
        await measured(session, stack)
        fills = await fill(session, stack)

        # The fills run far longer than the chats the router measured: once they have run
        # past those, every worker's predicted wait for a slot is past a 300 ms target (just
        # after they start, it is about half a chat's slot time, which on a fast machine may
        # fit, and the request would be held instead).
        def waits_past_target() -> bool:
            return all((v["predicted_wait_ms"] or 0) > 300 for v in stack.deadline().values())

        await asyncio.to_thread(wait_until, waits_past_target, WAIT, "every wait past 300 ms")
        assert stack.target(**{TTFT_TARGET: 300})[TTFT_TARGET] == 300
        refused = await chat(session, stack)
        assert refused.status == 529, refused
        assert refused.done < 0.2, refused  # at once: well under the 300 ms target
        assert refused.headers["x-shed-reason"] == "deadline", refused.headers
        assert int(refused.headers["retry-after-ms"]) >= 1, refused.headers
        assert 1 <= int(refused.headers["retry-after"]) <= 60, refused.headers
        assert stack.metric("extproc_decisions_total", {"outcome": "deadline"}) >= 1
        assert all(v["occupancy"] >= SLOTS for v in stack.deadline().values())

        # The target removed: no thresholds are set, so the very next request is admitted
        # and waits for its slot at the engine.
        assert TTFT_TARGET not in stack.target(disable=[TTFT_TARGET])
        rejected = stack.metric("extproc_decisions_total", {"outcome": "deadline"})
        admitted = await chat(session, stack)
        assert admitted.status == 200, admitted
        assert stack.metric("extproc_decisions_total", {"outcome": "deadline"}) == rejected
        done = await asyncio.gather(*fills)
        assert {r.status for r in done} == {200}, done
        # It started only when a fill ended: it waited at the engine, not in the router.
        assert admitted.first_byte > 0.5, admitted


async def test_a_request_that_fits_is_held_and_served_when_a_slot_frees(stack: Stack) -> None:
    timeout = aiohttp.ClientTimeout(total=WAIT)
    async with aiohttp.ClientSession(timeout=timeout) as session:
        await measured(session, stack)
        held_before = stack.metric("extproc_held_wait_seconds_count")
        fills = await fill(session, stack)
        # The target, 25 s, is longer than what remains of the fills (and than the
        # predicted wait): the request is held in the router until a fill ends, then sent.
        waiting = asyncio.ensure_future(chat(session, stack))

        def held() -> bool:
            return stack.metric("extproc_held_requests", {"model": MODEL}) == 1

        await asyncio.to_thread(wait_until, held, 10, "the request held in the router")
        view = stack.deadline()
        assert sum(v["in_flight"] for v in view.values()) == 2 * SLOTS, view  # not sent yet
        assert not any(f.done() for f in fills), "a fill ended before the hold was seen"
        served = await waiting
        done = await asyncio.gather(*fills)
    assert {r.status for r in done} == {200}, done
    assert served.status == 200, served
    assert served.first_byte < 25.0, served  # within its target
    assert stack.metric("extproc_held_wait_seconds_count") == held_before + 1
    assert stack.metric("extproc_held_wait_seconds_sum") > 0.5  # held until a fill ended
    assert stack.metric("extproc_held_requests", {"model": MODEL}) == 0
    stack.target(disable=[TTFT_TARGET])
