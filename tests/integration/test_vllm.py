"""The shedder on real vLLM: Envoy -> extproc -> two vLLM servers serving SmolLM2-135M on this
CPU, each with its sidecar agent (``--engine vllm``), started once for the module.

Each engine runs at most 4 sequences of 1024 tokens, has a KV cache of 17 blocks of 128 tokens
(``--num-gpu-blocks-override``; vLLM keeps one aside, 16 hold tokens) and answers 503 once 3
requests are unfinished (``--max-num-queued-reqs 3``). Load that should not count as the
router's own is put on an engine directly (a streaming completion to its port, not through
Envoy), so that only the agent's reports can make it busy. Without vLLM installed (``make
vllm``) the module fails under CI and skips elsewhere, saying why.
"""

from __future__ import annotations

import contextlib
import json
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
import zmq

from extproc.devstack import AgentProcess, Envoy, Extproc, http, metric_value
from extproc.devstack import wait_until as _wait_until
from extproc.devstack.prom import metric_sums
from extproc.devstack.vllm import VllmServer, compute_dtype
from extproc.events.schema import ConfigEvent, LoadEvent, decode
from tests.support.vllm_engine import require_vllm

MODEL = "smollm2"
BLOCKS = 17  # per engine: 16 for tokens, one kept aside by vLLM
MAX_SEQS = 4
MAX_QUEUED = 3  # unfinished requests (running + waiting) before vLLM answers 503
SCRAPE = 0.2  # the agents' --interval, seconds
# About 330 prompt tokens (3 blocks of 128) for SmolLM2's tokenizer. Each held request starts
# with its own number, so that vLLM's prefix cache cannot share their blocks.
STORY = "Tell me a long story about the sea and the lighthouse keeper. " * 25
OVERLOADED = b'{"message":"Service temporarily overloaded","type":"Overloaded","code":529}'
# The machine is shared and has 2 cores, and vLLM is slow on it: generous deadlines.
WAIT = 90.0
START = 400.0  # two vLLM servers starting together on a loaded machine

pytestmark = [pytest.mark.envoy, pytest.mark.timeout(600)]

require_vllm()


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
    """A streaming completion on one engine, kept open in a thread until :meth:`close`
    (which drops the connection: vLLM then aborts the request and frees its blocks)."""

    numbers = iter(range(1, 1_000_000))

    def __init__(self, port: int, *, max_tokens: int = 200) -> None:
        prompt = f"Story {next(self.numbers)}. {STORY}"
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
        self._conn = HTTPConnection("127.0.0.1", port, timeout=300)
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

    def close(self) -> None:
        sock = self._conn.sock
        if sock is not None:
            with contextlib.suppress(OSError):
                sock.shutdown(socket.SHUT_RDWR)
        self._conn.close()
        self._thread.join(10)


@dataclass
class Engine:
    server: VllmServer
    agent: AgentProcess
    worker_id: str

    def metrics(self) -> dict[str, float]:
        return metric_sums(http("GET", self.server.url + "/metrics")[2].decode())

    def metrics_text(self) -> str:
        return http("GET", self.server.url + "/metrics")[2].decode()


class VllmStack:
    """Envoy + extproc + two vLLM servers with their agents (agent 0 also publishes to a
    ZMQ SUB socket of the test, :meth:`events`)."""

    def __init__(self, log_dir: Path) -> None:
        self.zmq = zmq.Context()
        self.sub = self.zmq.socket(zmq.SUB)
        self.sub.setsockopt(zmq.LINGER, 0)
        self.sub.setsockopt(zmq.SUBSCRIBE, b"")
        self.sub.bind("tcp://127.0.0.1:*")
        sub_endpoint = self.sub.getsockopt_string(zmq.LAST_ENDPOINT)
        self.engines: list[Engine] = []
        self.held: list[Held] = []  # requests put straight on the engines by a test
        self.ext = Extproc(log_dir, ["--router-mode", "kv"])
        servers: list[VllmServer] = []
        try:
            for i in range(2):  # both start at once, each computing on a CPU of its own
                servers.append(
                    VllmServer(
                        log_dir,
                        name=f"vllm-{i}",
                        max_num_seqs=MAX_SEQS,
                        num_gpu_blocks_override=BLOCKS,
                        max_num_queued_reqs=MAX_QUEUED,
                        cpus=str(i),
                        wait=False,
                    )
                )
            for server in servers:
                server.wait_ready(START)
            self.envoy = Envoy(log_dir, self.ext, [s.port for s in servers], tweak=_add_served_by)
            for i, server in enumerate(servers):
                worker_id = f"vllm-{i}"
                also = ["--publish", sub_endpoint] if i == 0 else []
                agent = AgentProcess(
                    [
                        "--engine", "vllm", "--engine-url", server.url, "--model", MODEL,
                        "--endpoint", server.endpoint, "--worker-id", worker_id,
                        "--interval", str(SCRAPE), "--max-num-seqs", str(MAX_SEQS),
                        "--publish", self.ext.event_endpoint, *also,
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

    def close(self, servers: list[VllmServer] | None = None) -> None:
        for h in self.held:
            h.close()
        for engine in self.engines:
            engine.agent.stop()
        for server in servers if servers is not None else [e.server for e in self.engines]:
            server.stop()
        if hasattr(self, "envoy"):
            self.envoy.stop()
        self.ext.stop()
        self.sub.close(0)
        self.zmq.term()

    def events(self, seconds: float) -> list[ConfigEvent | LoadEvent]:
        """Agent 0's config and load events that arrive within ``seconds`` (what came
        before is dropped first)."""
        while self.sub.poll(0):
            self.sub.recv_multipart()
        got: list[ConfigEvent | LoadEvent] = []
        deadline = time.monotonic() + seconds
        while (left := deadline - time.monotonic()) > 0:
            if self.sub.poll(int(left * 1000)):
                event = decode(*self.sub.recv_multipart())
                if isinstance(event, ConfigEvent | LoadEvent):
                    got.append(event)
        return got

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
        return http("POST", self.envoy.url + "/v1/chat/completions", body, timeout=120)

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
def stack(log_dir: Path) -> Iterator[VllmStack]:
    started = time.monotonic()
    real = VllmStack(log_dir)
    print(f"vLLM stack up in {time.monotonic() - started:.1f} s")
    yield real
    real.close()
    print(f"vLLM module done in {time.monotonic() - started:.1f} s")


@pytest.fixture
def s(stack: VllmStack) -> Iterator[VllmStack]:
    """The module's stack, idle, with no thresholds, and left that way."""
    wait_until(stack.idle, "engines idle")
    yield stack
    for h in stack.held:
        h.close()
    stack.held.clear()
    stack.reset_thresholds()
    if all(e.server.alive() for e in stack.engines):
        wait_until(stack.idle, "engines idle again")


def hold(s: VllmStack, engine: Engine, **kwargs: Any) -> Held:
    h = Held(engine.server.port, **kwargs)
    s.held.append(h)
    return h


def reported_blocks(s: VllmStack, engine: Engine) -> int:
    return int(s.rank0(engine)["reported"]["active_decode_blocks"] or 0)


def _all_busy(s: VllmStack) -> bool:
    return all(s.worker(e)["state"] == "busy" for e in s.engines)


def test_engines_compute_in_the_dtype_this_cpu_is_fast_in(s: VllmStack) -> None:
    dtype = compute_dtype()  # bfloat16 with AVX-512, float32 without
    for engine in s.engines:
        assert f"dtype=torch.{dtype}," in engine.server.log(), engine.server.log()[-3000:]


# --- routing and shedding --------------------------------------------------------------


def test_request_goes_to_the_engine_that_is_free(s: VllmStack) -> None:
    busy, free = s.engines
    hold(s, busy)
    wait_until(lambda: reported_blocks(s, busy) >= 3, "the held engine reported as loaded")
    for _ in range(3):
        status, headers, body = s.chat()
        assert status == 200, body
        assert headers["x-served-by"] == free.server.endpoint
        text = json.loads(body)["choices"][0]["message"]["content"]
        assert isinstance(text, str) and text


def test_every_engine_busy_by_kv_gives_529_until_one_frees(s: VllmStack) -> None:
    # Busy above 0.25 x 17 = 4.25 blocks: two held requests (3 blocks of prompt each) do it.
    s.thresholds(active_decode_blocks_threshold=0.25)
    for engine in s.engines:
        hold(s, engine)
        hold(s, engine)
    wait_until(lambda: _all_busy(s), "both engines busy by their reported KV use")
    for engine in s.engines:
        assert s.rank0(engine)["fired"] == "active_decode_blocks_threshold"
        # vLLM itself holds those blocks: 6 or more of its 16.
        assert engine.metrics()["vllm:kv_cache_usage_perc"] >= 6 / 16
    status, headers, body = s.chat()
    assert (status, body) == (529, OVERLOADED)
    assert int(headers["retry-after"]) >= 1
    free = s.engines[1]
    for h in s.held[2:]:  # the second engine's
        h.close()
    wait_until(lambda: s.worker(free)["state"] == "free", "the released engine free")
    status, headers, body = s.chat()
    assert (status, headers["x-served-by"]) == (200, free.server.endpoint), body


def test_sse_stream_holds_its_router_estimate_until_it_ends(s: VllmStack) -> None:
    body = {
        "model": MODEL,
        "messages": [{"role": "user", "content": "Tell me a long story."}],
        "max_tokens": 40,
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


def _running(engine: Engine, n: int) -> bool:
    return engine.metrics()["vllm:num_requests_running"] == n


def _admission_rejections(engine: Engine) -> float:
    labels = {"reason": "max_num_queued_reqs"}
    value = metric_value(engine.metrics_text(), "vllm:admission_rejections_total", labels)
    return value or 0.0


def test_vllm_queue_limit_503_becomes_the_overload_reply(s: VllmStack) -> None:
    # No thresholds: the router sends the request; each engine already has MAX_QUEUED
    # unfinished requests, so vLLM answers 503 (--max-num-queued-reqs), Envoy tries the
    # other engine, which answers 503 too, and the client gets the overload reply.
    for engine in s.engines:
        for _ in range(MAX_QUEUED):
            hold(s, engine, max_tokens=400)
    for engine in s.engines:
        wait_until(partial(_running, engine, MAX_QUEUED), f"{engine.worker_id}: all running")
    before = [_admission_rejections(e) for e in s.engines]
    rejected_before = metric_value(
        s.ext.metrics(),
        "dynamo_frontend_model_rejection_total",
        {"model": MODEL, "endpoint": "chat_completions"},
    )
    status, headers, body = s.chat()
    assert (status, body) == (529, OVERLOADED)
    assert "retry-after" in headers
    after = [_admission_rejections(e) for e in s.engines]
    assert sum(after) > sum(before), (before, after)
    rejected = metric_value(
        s.ext.metrics(),
        "dynamo_frontend_model_rejection_total",
        {"model": MODEL, "endpoint": "chat_completions"},
    )
    assert (rejected or 0) == (rejected_before or 0) + 1
    assert all(h.status == 200 for h in s.held), [h.status for h in s.held]


# --- the agent against vLLM's own page ------------------------------------------------------


def _vllm_view(engine: Engine) -> tuple[int, int, int]:
    """(KV blocks held, requests waiting, requests running) as vLLM's /metrics says now.
    ``kv_cache_usage_perc`` is a fraction of the blocks that hold tokens: all but one."""
    m = engine.metrics()
    held = round(m["vllm:kv_cache_usage_perc"] * (BLOCKS - 1))
    return held, int(m["vllm:num_requests_waiting"]), int(m["vllm:num_requests_running"])


View = tuple[int, int, int]


def _window(
    s: VllmStack, engine: Engine, steady: Callable[[View], object] = lambda v: v
) -> tuple[View, list[LoadEvent]]:
    """vLLM's view, then 5 scrapes' time to settle, the view again, the agent's load events
    over the next 5 scrapes and the view a third time, returned once the three views are the
    same (the engine was steady meanwhile) in what ``steady`` takes of them (default: all).
    The settling keeps out an event whose scrape was read before the engine steadied but
    published late (an agent slowed by a busy CPU)."""

    def attempt() -> tuple[View, list[LoadEvent]] | None:
        before = steady(_vllm_view(engine))
        s.events(5 * SCRAPE)
        settled = steady(_vllm_view(engine))
        events = [e for e in s.events(5 * SCRAPE) if isinstance(e, LoadEvent)]
        after = _vllm_view(engine)
        return (after, events) if before == settled == steady(after) and events else None

    window: tuple[View, list[LoadEvent]] = wait_until(attempt, "a steady window")
    return window


def test_agent_queue_fields_agree_with_vllms_own_page(s: VllmStack) -> None:
    engine = s.engines[0]  # its agent also publishes to the test
    config = next(e for e in s.events(3.0) if isinstance(e, ConfigEvent))
    assert (config.block_size, config.kv_total_blocks) == (128, BLOCKS)
    (_, waiting, running), events = _window(s, engine)
    assert (waiting, running) == (0, 0)
    for event in events:
        assert (event.num_requests_waiting, event.request_active_slots) == (0, 0)
        assert event.request_total_slots == MAX_SEQS
        assert (event.active_decode_blocks, event.active_prefill_tokens) == (0, 0)
    for tries_left in reversed(range(3)):
        held = [hold(s, engine) for _ in range(3)]
        wait_until(partial(_running, engine, 3), "three running")
        # Steady in what is compared: the KV blocks grow as the three generate, and a window
        # steady in those too may come only after they have ended.
        (_, waiting, running), events = _window(s, engine, steady=lambda v: v[1:])
        if running == 3 or not tries_left:
            break
        # The three ended before a steady window came (a busy CPU slows the agent's
        # scrapes, not vLLM's generation): three new ones, from an idle engine.
        for h in held:
            h.close()
        wait_until(partial(_running, engine, 0), "the three ended")
    assert (waiting, running) == (0, 3)
    for event in events:
        assert (event.num_requests_waiting, event.request_active_slots) == (0, 3), event
        assert event.request_total_slots == MAX_SEQS


def test_agent_kv_blocks_agree_with_vllms_own_page(s: VllmStack) -> None:
    engine = s.engines[0]
    for _ in range(3):  # 9 of the 16 blocks that hold tokens: more than half
        hold(s, engine)
    wait_until(partial(_running, engine, 3), "three running")
    wait_until(lambda: _vllm_view(engine)[0] >= 9, "nine blocks held")
    (held, _, _), events = _window(s, engine)
    assert [e.active_decode_blocks for e in events] == [held] * len(events), (held, events)


# --- the official OpenAI SDK through Envoy ---------------------------------------------------


def test_openai_sdk_chat_and_stream(s: VllmStack) -> None:
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
            # A sampled answer may be one word ("Five."): vLLM's min_tokens makes it a stream.
            extra_body={"min_tokens": 8},
        )
        if chunk.choices
    ]
    assert len(pieces) > 3 and "".join(pieces).strip()


def test_openai_sdk_retries_a_529_after_retry_after(s: VllmStack) -> None:
    import openai

    s.thresholds(active_decode_blocks_threshold=0.25)
    for engine in s.engines:
        hold(s, engine)
        hold(s, engine)
    wait_until(lambda: _all_busy(s), "both engines busy")
    seen: list[tuple[float, int, str | None]] = []

    def record(response: Any) -> None:  # the SDK's HTTP client's response
        seen.append((time.monotonic(), response.status_code, response.headers.get("retry-after")))
        if response.status_code == 529:
            for h in s.held:  # the fleet frees while the client waits Retry-After
                h.close()

    client = openai.OpenAI(
        base_url=s.envoy.url + "/v1",
        api_key="unused",
        max_retries=5,  # the first retry may still find the engines busy on a loaded machine
        timeout=120,
        http_client=openai.DefaultHttpxClient(event_hooks={"response": [record]}),
    )
    reply = client.chat.completions.create(
        model=MODEL, messages=[{"role": "user", "content": "Hi."}], max_tokens=8
    )
    assert reply.choices[0].message.content is not None
    assert seen[0][1] == 529 and seen[0][2] is not None, seen
    retry_after = int(seen[0][2])
    assert seen[-1][1] == 200, seen
    assert seen[1][0] - seen[0][0] >= retry_after * 0.95, seen


# --- engines killed (last: it leaves the module's stack without engines) -------------------


def test_kill_9_one_engine_is_skipped_and_none_left_is_529(s: VllmStack) -> None:
    first, second = s.engines
    first.server.send_signal(signal.SIGKILL)
    assert first.server.stop() == -signal.SIGKILL
    assert first.server.session() == []  # its engine core went with it
    for _ in range(4):
        status, headers, body = s.chat()
        assert (status, headers.get("x-served-by")) == (200, second.server.endpoint), body
    wait_until(lambda: "publishing nothing new" in first.agent.log(), "the agent says so")
    log = first.agent.log()
    assert f"GET {first.server.url}/metrics failed" in log, log
    second.server.send_signal(signal.SIGKILL)
    assert second.server.stop() == -signal.SIGKILL
    status, headers, body = s.chat()
    assert (status, body) == (529, OVERLOADED)
    assert int(headers["retry-after"]) >= 1
