"""The shedder on real engines: Envoy -> extproc -> two llama.cpp ``llama-server`` processes
serving SmolLM2-135M on this CPU, each with its sidecar agent (``--engine llamacpp``).

Load that should not count as the router's own is put on an engine directly (a streaming
completion to its port, not through Envoy), so that only the agent's reports can make it busy.
Without the engine installed the module fails under CI and skips elsewhere, saying why.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import math
import signal
import socket
import threading
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from functools import partial
from http.client import HTTPConnection, HTTPException
from pathlib import Path
from typing import Any

import pytest

from extproc.devstack import AgentProcess, Envoy, Extproc, ProcessExited, http
from extproc.devstack import wait_until as _wait_until
from extproc.devstack.llamacpp import (
    LlamaServer,
)
from extproc.devstack.prom import metric_sums
from extproc.events.schema import ConfigEvent, LoadEvent
from llmworker.llamacpp import parse_slots
from tests.llmworker.support import Subscriber
from tests.support.engine import require_engine

MODEL = "smollm2"
CTX = 1024  # tokens per engine, 512 per slot
PARALLEL = 2
BLOCK = 16
KV_TOTAL = CTX // BLOCK  # 64 blocks per engine
SCRAPE = 0.1  # the agents' --interval, seconds
# 131 prompt tokens for SmolLM2's tokenizer (9 blocks, measured); the router would count
# ceil(bytes / 4), but these prompts reach the engines directly.
PROMPT = "Write a very long story about a lighthouse keeper and the sea. " * 10
# The machine is shared and has 2 cores: conditions get generous deadlines.
WAIT = 60.0


require_engine()


def wait_until(cond: Callable[[], Any], what: str, timeout: float = WAIT) -> Any:
    return _wait_until(cond, timeout, what)


def _add_served_by(cfg: dict[str, Any]) -> None:
    """Every reply says which worker Envoy sent it to (``x-served-by``)."""
    listener = cfg["static_resources"]["listeners"][0]
    hcm = listener["filter_chains"][0]["filters"][0]["typed_config"]
    for vhost in hcm["route_config"]["virtual_hosts"]:
        vhost.setdefault("response_headers_to_add", []).append(
            {"header": {"key": "x-served-by", "value": "%UPSTREAM_HOST%"}}
        )


class Held:
    """A streaming completion kept open in a thread until :meth:`close` (which cancels it)."""

    def __init__(self, port: int, *, max_tokens: int = 360, prompt: str = PROMPT) -> None:
        self.port = port
        self.body = json.dumps(
            {
                "model": MODEL,
                "prompt": prompt,
                "max_tokens": max_tokens,
                "ignore_eos": True,
                "stream": True,
            }
        ).encode()
        self.chunks = 0
        self.status: int | None = None
        self.done = threading.Event()
        self._conn = HTTPConnection("127.0.0.1", port, timeout=120)
        self._thread = threading.Thread(target=self._run, daemon=True)
        self._thread.start()

    def _run(self) -> None:
        try:
            self._conn.request(
                "POST", "/v1/completions", self.body, {"content-type": "application/json"}
            )
            response = self._conn.getresponse()
            self.status = response.status
            while line := response.readline():
                if line.startswith(b"data: "):
                    self.chunks += 1
        except (OSError, HTTPException, AttributeError, ValueError):
            pass  # closed by close() (http.client may trip over its own closed file)
        finally:
            self.done.set()

    def close(self) -> None:
        sock = self._conn.sock
        if sock is not None:
            with contextlib.suppress(OSError):
                sock.shutdown(socket.SHUT_RDWR)
        self._conn.close()
        self._thread.join(10)


@dataclass
class Engine:
    server: LlamaServer
    agent: AgentProcess
    worker_id: str

    def slots_text(self) -> str:
        return http("GET", self.server.url + "/slots")[2].decode()

    def metrics(self) -> dict[str, float]:
        return metric_sums(http("GET", self.server.url + "/metrics")[2].decode())


class RealStack:
    """Envoy + extproc + ``n`` llama-servers with their agents (agent 0 also publishes to a
    test subscriber)."""

    def __init__(self, log_dir: Path, n: int = 2, tag: str = "") -> None:
        self.sub = Subscriber()
        self.engines: list[Engine] = []
        self.held: list[Held] = []  # requests put straight on the engines by a test
        self.ext = Extproc(log_dir, ["--router-mode", "kv"])
        servers: list[LlamaServer] = []
        try:
            for i in range(n):
                servers.append(
                    LlamaServer(log_dir, name=f"llama{tag}-{i}", ctx=CTX, parallel=PARALLEL)
                )
            self.envoy = Envoy(log_dir, self.ext, [s.port for s in servers], tweak=_add_served_by)
            for i, server in enumerate(servers):
                worker_id = f"llama{tag}-{i}"
                publish = ["--publish", self.ext.event_endpoint]
                if i == 0:
                    publish += ["--publish", self.sub.endpoint]
                agent = AgentProcess(
                    [
                        "--engine", "llamacpp", "--engine-url", server.url, "--model", MODEL,
                        "--endpoint", server.endpoint, "--worker-id", worker_id,
                        "--block-size", str(BLOCK), "--interval", str(SCRAPE), *publish,
                    ],
                    log_dir=log_dir,
                    name=f"agent-{worker_id}",
                )  # fmt: skip
                self.engines.append(Engine(server, agent, worker_id))
            wait_until(self._all_announced, "both agents announced")
        except BaseException:
            self.close(servers)
            raise

    def _all_announced(self) -> bool:
        for engine in self.engines:
            engine.agent.check_alive()
        workers = self.ext.workers()
        return all(e.worker_id in workers for e in self.engines)

    def close(self, servers: list[LlamaServer] | None = None) -> None:
        for engine in self.engines:
            engine.agent.stop()
        for server in servers if servers is not None else [e.server for e in self.engines]:
            server.stop()
        if hasattr(self, "envoy"):
            self.envoy.stop()
        self.ext.stop()
        self.sub.close()

    # --- the router's view -----------------------------------------------------------

    def worker(self, engine: Engine) -> dict[str, Any]:
        return self.ext.workers()[engine.worker_id]

    def rank0(self, engine: Engine) -> dict[str, Any]:
        rank: dict[str, Any] = self.worker(engine)["ranks"][0]
        return rank

    def thresholds(self, **values: Any) -> None:
        status, _, body = http(
            "POST", self.ext.admin + "/busy_threshold", {"model": MODEL, **values}
        )
        assert status == 200, body

    def reset_thresholds(self) -> None:
        self.thresholds(
            disable=[
                "active_decode_blocks_threshold",
                "active_prefill_tokens_threshold",
                "active_prefill_tokens_threshold_frac",
            ]
        )

    def chat(self, max_tokens: int = 8, **extra: Any) -> tuple[int, dict[str, str], bytes]:
        body = {
            "model": MODEL,
            "messages": [{"role": "user", "content": "Say hello."}],
            "max_tokens": max_tokens,
            **extra,
        }
        return http("POST", self.envoy.url + "/v1/chat/completions", body, timeout=60)

    def idle(self) -> bool:
        """Every engine idle as its agent reported it, and no router estimate left."""
        for engine in self.engines:
            rank = self.rank0(engine)
            if rank["reported"]["active_decode_blocks"] != 0:
                return False
            if rank["router_estimate"]["requests_in_flight"]:
                return False
        return True


@pytest.fixture(scope="module")
def stack(log_dir: Path) -> Iterator[RealStack]:
    started = time.monotonic()
    real = RealStack(log_dir)
    print(f"real-engine stack up in {time.monotonic() - started:.1f} s")
    yield real
    real.close()


@pytest.fixture
def s(stack: RealStack) -> Iterator[RealStack]:
    """The module's stack, idle, with no thresholds, and left that way."""
    wait_until(stack.idle, "engines idle")
    yield stack
    for h in stack.held:
        h.close()
    stack.held.clear()
    stack.reset_thresholds()
    wait_until(stack.idle, "engines idle again")


def hold(s: RealStack, engine: Engine, **kwargs: Any) -> Held:
    h = Held(engine.server.port, **kwargs)
    s.held.append(h)
    return h


def reported_blocks(s: RealStack, engine: Engine) -> int:
    return int(s.rank0(engine)["reported"]["active_decode_blocks"] or 0)


# --- routing and shedding --------------------------------------------------------------


def test_request_goes_to_the_engine_that_is_free(s: RealStack) -> None:
    busy, free = s.engines
    hold(s, busy)
    wait_until(lambda: reported_blocks(s, busy) >= 8, "the held engine reported as loaded")
    for _ in range(3):
        status, headers, body = s.chat()
        assert status == 200, body
        assert headers["x-served-by"] == free.server.endpoint
        text = json.loads(body)["choices"][0]["message"]["content"]
        assert isinstance(text, str) and text


def _all_busy(s: RealStack) -> bool:
    return all(s.worker(e)["state"] == "busy" for e in s.engines)


def test_every_engine_busy_by_kv_gives_529_until_one_frees(s: RealStack) -> None:
    # Busy above 0.1 x 64 = 6.4 blocks: one held request (about 8 blocks of prompt) does it.
    s.thresholds(active_decode_blocks_threshold=0.1)
    streams = [hold(s, e) for e in s.engines]
    wait_until(lambda: _all_busy(s), "both engines busy by their reported KV use")
    for engine in s.engines:
        assert s.rank0(engine)["fired"] == "active_decode_blocks_threshold"
    status, headers, body = s.chat()
    assert status == 529, body
    assert int(headers["retry-after"]) >= 1
    streams[1].close()
    free = s.engines[1]
    wait_until(lambda: s.worker(free)["state"] == "free", "the released engine free")
    status, headers, body = s.chat()
    assert (status, headers["x-served-by"]) == (200, free.server.endpoint), body


def _all_slots_decoding(engine: Engine) -> bool:
    return all(x.is_processing and x.n_decoded > 0 for x in parse_slots(engine.slots_text()))


def test_every_engine_busy_by_waiting_prompts_gives_529(s: RealStack) -> None:
    # No KV threshold: only the prefill check. Two held requests fill an engine's two
    # slots; a third waits (llamacpp:requests_deferred), and its prompt counts as prefill.
    s.thresholds(active_prefill_tokens_threshold=50)
    for engine in s.engines:
        for _ in range(PARALLEL):
            hold(s, engine)
    for engine in s.engines:
        wait_until(partial(_all_slots_decoding, engine), f"{engine.worker_id}: slots decoding")
    # Every slot decoding but nothing waiting: not busy by prefill (once the agents have
    # reported the end of the prefills).
    wait_until(lambda: {s.worker(e)["state"] for e in s.engines} == {"free"}, "both free")
    for engine in s.engines:
        hold(s, engine, max_tokens=8)
    wait_until(lambda: _all_busy(s), "both engines busy by waiting prompts")
    for engine in s.engines:
        rank = s.rank0(engine)
        assert rank["fired"] == "active_prefill_tokens_threshold"
        assert rank["reported"]["active_prefill_tokens"] > 50
        assert engine.metrics()["llamacpp:requests_deferred"] >= 1
    status, _, body = s.chat()
    assert status == 529, body


def test_sse_stream_holds_its_router_estimate_until_it_ends(s: RealStack) -> None:
    body = {
        "model": MODEL,
        "messages": [{"role": "user", "content": "Tell me a long story."}],
        "max_tokens": 120,
        "ignore_eos": True,
        "stream": True,
    }
    raw = json.dumps(body).encode()
    conn = HTTPConnection("127.0.0.1", s.envoy.port, timeout=120)
    conn.request("POST", "/v1/chat/completions", raw, {"content-type": "application/json"})
    response = conn.getresponse()
    assert response.status == 200
    served = response.getheader("x-served-by")
    engine = next(e for e in s.engines if e.server.endpoint == served)
    events: list[bytes] = []
    seen_in_flight = False
    while line := response.readline():
        if line.startswith(b"data: "):
            events.append(line)
            if len(events) == 3:
                estimate = s.rank0(engine)["router_estimate"]
                assert estimate["requests_in_flight"] == 1, estimate
                assert estimate["active_decode_blocks"] >= 1, estimate
                seen_in_flight = True
    conn.close()
    assert seen_in_flight and events[-1] == b"data: [DONE]\n", events[-3:]
    assert len(events) > 10
    wait_until(
        lambda: s.rank0(engine)["router_estimate"]["requests_in_flight"] == 0,
        "the router's estimate released after the stream ended",
        timeout=10,
    )


# --- the agent against the engine's own pages -------------------------------------------


def _engine_view(engine: Engine) -> tuple[int, int, int]:
    """(KV blocks held, requests deferred, slots busy) from the engine itself, now."""
    metrics = engine.metrics()
    slots = parse_slots(engine.slots_text())
    held = sum(x.n_tokens for x in slots if x.is_processing)
    return (
        math.ceil(held / BLOCK),
        int(metrics["llamacpp:requests_deferred"]),
        int(metrics["llamacpp:requests_processing"]),
    )


def _reported(s: RealStack, engine: Engine, waiting: int) -> bool:
    """The router has the agent's report of two decoding slots and ``waiting`` deferred."""
    reported = s.rank0(engine)["reported"]
    prefill = reported["active_prefill_tokens"] or 0
    return bool((reported["active_decode_blocks"] or 0) >= 16 and (prefill > 0) == (waiting > 0))


def test_agent_events_agree_with_the_engines_own_pages(s: RealStack) -> None:
    engine = s.engines[0]  # its agent also publishes to s.sub

    async def window() -> tuple[tuple[int, int, int], list[LoadEvent], tuple[int, int, int]]:
        """The engine's own view, then the agent's events for 3 scrapes, then the engine's."""
        await s.sub.drain(0.05)  # forget what came before
        before = await asyncio.to_thread(_engine_view, engine)
        start = time.monotonic()
        events: list[LoadEvent] = []
        while time.monotonic() - start < 3 * SCRAPE or not events:
            events.append(await s.sub.next_of(LoadEvent, timeout=5))
        after = await asyncio.to_thread(_engine_view, engine)
        return before, events, after

    async def check() -> None:
        config = await s.sub.next_of(ConfigEvent, timeout=5)  # repeated every heartbeat
        assert (config.kv_total_blocks, config.block_size) == (KV_TOTAL, BLOCK)
        # Idle: the agent says exactly what the engine says.
        before, events, after = await window()
        assert before == after == (0, 0, 0)
        assert {(e.active_decode_blocks, e.active_prefill_tokens) for e in events} == {(0, 0)}
        # Decoding: every event lies between what the engine said one scrape before the
        # window and at its end (KV only grows while the streams decode).
        for _ in range(PARALLEL):
            hold(s, engine)
        await asyncio.to_thread(wait_until, partial(_all_slots_decoding, engine), "decoding")
        await asyncio.to_thread(wait_until, partial(_reported, s, engine, 0), "reported")
        before, events, after = await window()
        growth = math.ceil(2 * 200 * SCRAPE / BLOCK)  # at most 200 tokens/s per slot
        assert before[1:] == after[1:] == (0, PARALLEL)
        for event in events:
            assert event.active_decode_blocks is not None
            assert before[0] - growth <= event.active_decode_blocks <= after[0], (before, after)
            assert event.active_prefill_tokens == 0
        # One request waiting: the agent reports its prompt as prefill.
        hold(s, engine, max_tokens=8)
        await asyncio.to_thread(
            wait_until, lambda: _engine_view(engine)[1] == 1, "one request deferred"
        )
        await asyncio.to_thread(wait_until, partial(_reported, s, engine, 1), "reported")
        before, events, after = await window()
        assert before[1] == after[1] == 1, (before, after)
        assert all((e.active_prefill_tokens or 0) > 0 for e in events[1:]), events

    asyncio.run(check())


# --- the official OpenAI SDK through Envoy ---------------------------------------------------


def test_openai_sdk_chat_and_stream(s: RealStack) -> None:
    import openai

    client = openai.OpenAI(base_url=s.envoy.url + "/v1", api_key="unused", max_retries=0)
    reply = client.chat.completions.create(
        model=MODEL, messages=[{"role": "user", "content": "Name a colour."}], max_tokens=12
    )
    assert reply.choices[0].message.content
    assert reply.usage is not None and reply.usage.completion_tokens > 0
    pieces = [
        chunk.choices[0].delta.content or ""
        for chunk in client.chat.completions.create(
            model=MODEL,
            messages=[{"role": "user", "content": "Count to five."}],
            max_tokens=24,
            stream=True,
        )
        if chunk.choices
    ]
    assert len(pieces) > 3 and "".join(pieces).strip()


def test_openai_sdk_retries_a_529_after_retry_after(s: RealStack) -> None:
    import openai

    s.thresholds(active_decode_blocks_threshold=0.1)
    streams = [hold(s, e) for e in s.engines]
    wait_until(lambda: _all_busy(s), "both engines busy")
    seen: list[tuple[float, int, str | None]] = []

    def record(response: Any) -> None:  # the SDK's HTTP client's response
        seen.append((time.monotonic(), response.status_code, response.headers.get("retry-after")))
        if response.status_code == 529:
            for h in streams:  # the fleet frees while the client waits Retry-After
                h.close()

    client = openai.OpenAI(
        base_url=s.envoy.url + "/v1",
        api_key="unused",
        max_retries=5,  # the first retry may still find the engines busy on a loaded machine
        http_client=openai.DefaultHttpxClient(event_hooks={"response": [record]}),
    )
    start = time.monotonic()
    reply = client.chat.completions.create(
        model=MODEL, messages=[{"role": "user", "content": "Hi."}], max_tokens=8
    )
    assert reply.choices[0].message.content is not None
    assert seen[0][1] == 529 and seen[0][2] is not None, seen
    retry_after = int(seen[0][2])
    assert seen[-1][1] == 200, seen
    assert seen[1][0] - seen[0][0] >= retry_after * 0.95, (seen, start)


# --- engines killed ----------------------------------------------------------------------------


def test_kill_9_one_engine_is_skipped_and_none_left_is_529(log_dir: Path) -> None:
    own = RealStack(log_dir, tag="-kill")
    try:
        first, second = own.engines
        first.server.send_signal(signal.SIGKILL)
        assert first.server.stop() == -signal.SIGKILL
        for _ in range(4):
            status, headers, body = own.chat()
            assert (status, headers.get("x-served-by")) == (200, second.server.endpoint), body
        wait_until(lambda: "publishing nothing new" in first.agent.log(), "the agent says so")
        log = first.agent.log()
        assert f"GET {first.server.url}/metrics failed" in log, log
        assert log.count("publishing nothing new") == 1, log  # one line, not one per scrape
        second.server.send_signal(signal.SIGKILL)
        assert second.server.stop() == -signal.SIGKILL
        status, headers, body = own.chat()
        assert status == 529, body
        assert int(headers["retry-after"]) >= 1
    finally:
        own.close()


def test_engine_without_metrics_stops_the_agent_naming_the_flag(log_dir: Path) -> None:
    server = LlamaServer(log_dir, name="llama-nometrics", ctx=256, parallel=1, metrics=False)
    agent = AgentProcess(
        [
            "--engine", "llamacpp", "--engine-url", server.url, "--model", MODEL,
            "--endpoint", server.endpoint, "--worker-id", "nometrics",
            "--publish", "tcp://127.0.0.1:9",
        ],
        log_dir=log_dir,
        name="agent-nometrics",
    )  # fmt: skip
    try:
        wait_until(lambda: agent.returncode is not None, "the agent exits", timeout=30)
        assert agent.returncode == 2, agent.log()
        log = agent.log()
        assert "answered HTTP 501" in log and "start llama-server with --metrics" in log, log
        assert "publishing nothing new" not in log, log
    finally:
        agent.stop()
        server.stop()


def test_process_helpers_report_a_dead_engine(log_dir: Path) -> None:
    with pytest.raises(ProcessExited):
        LlamaServer(log_dir, name="llama-bad", extra=["--no-such-flag"])
