"""--router-track-output-blocks through the real Envoy (docs/routing.md).

Generated tokens are counted from the response body on whichever ext_proc stream carries
it: the observer filter of envoy/envoy-track-output.yaml, or the routing filter itself when
it streams the response body (envoy/envoy.yaml with ``response_body_mode: STREAMED``). With
either wiring a paced stream of 240 tokens grows its request's block estimate token by
token, turns its worker busy when the blocks pass the threshold, and gives its blocks back
when the client leaves mid-stream. A wiring that delivers no body is reported: a counter,
one warning line, and the fix on /debug/workers and the status page.

The simulated engine below runs without --publish: only its config is announced, so the
router's own estimate is all the decode-block check sees. Long generations grow the
KV use of each request. With the flag, the estimate grows with the streamed tokens
and the worker turns busy (529) before its KV cache overflows; without it, the
estimate stays at the prompt blocks, nothing is rejected and the engine preempts.
"""

from __future__ import annotations

import asyncio
import json
import os
import queue
import re
import threading
from collections.abc import Iterator
from http.client import HTTPConnection, HTTPResponse
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from typing import Any

import aiohttp
import pytest

from extproc.devstack import (
    PYTHON,
    ROOT,
    Envoy,
    Extproc,
    Proc,
    Publisher,
    free_port,
    get_json,
    http,
    metric_value,
    wait_until,
)
from tests.support.envoy_wirings import stream_response_body

KV_BLOCKS = 64
# Slow enough, with the limit at 70 % of the cache, that the streamed tokens reach the
# extproc well before the cache fills even on a machine loaded well past its cores: the
# 19 blocks (304 tokens) between the limit (44) and a full cache take the engine about 0.3 s
# with five requests decoding.
SPEEDUP = 4
THRESHOLD = 0.7


def _sim(log_dir: Path, name: str) -> tuple[Proc, int]:
    port = free_port()
    proc = Proc(
        name,
        [
            PYTHON,
            "-m",
            "llmworker.sim",
            "--host",
            "127.0.0.1",
            "--port",
            str(port),
            "--model",
            "m",
            "--worker-id",
            name,
            "--kv-total-blocks",
            str(KV_BLOCKS),
            "--block-size",
            "16",
            "--max-num-seqs",
            "32",
            "--max-num-batched-tokens",
            "256",
            "--dp-size",
            "1",
            "--speedup",
            str(SPEEDUP),
        ],
        log_dir,
    )
    wait_until(
        lambda: http("GET", f"http://127.0.0.1:{port}/health", timeout=1)[0] == 200, 15, "sim up"
    )
    return proc, port


def _engine(port: int) -> tuple[float, float]:
    text = http("GET", f"http://127.0.0.1:{port}/metrics")[2].decode()

    def value(name: str) -> float:
        m = re.search(rf"^{re.escape(name)}(?:{{[^}}]*}})? (\S+)$", text, re.M)
        return float(m.group(1)) if m else 0.0

    return value("vllm:num_preemptions_total"), value("vllm:kv_cache_usage_perc")


async def _drive(url: str, sim_port: int, n: int) -> list[tuple[int, float, float]]:
    """Start n long generations 40 ms apart; per request: status and the engine's
    preemption count and KV usage when the reply status arrived."""
    out: list[tuple[int, float, float]] = []
    body = {"model": "m", "prompt": "x" * 64, "max_tokens": 240, "stream": True}

    async def one(session: aiohttp.ClientSession, delay: float) -> None:
        await asyncio.sleep(delay)
        async with session.post(url + "/v1/completions", json=body) as resp:
            preempt, usage = await asyncio.to_thread(_engine, sim_port)
            out.append((resp.status, preempt, usage))
            await resp.read()

    async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=60)) as session:
        await asyncio.gather(*(one(session, i * 0.04) for i in range(n)))
    return out


@pytest.mark.parametrize("track", [True, False], ids=["flag-on", "flag-off"])
async def test_long_outputs_rejected_before_kv_overflow_only_with_the_flag(
    tmp_path: Path, track: bool
) -> None:
    sim, sim_port = _sim(tmp_path, f"sim-{track}")
    args = ["--active-decode-blocks-threshold", str(THRESHOLD), "--worker-ttl", "120"]
    ext = Extproc(tmp_path, [*args, "--router-track-output-blocks"] if track else args)
    # Output tokens are counted from streamed bodies: the observer config.
    envoy = Envoy(tmp_path, ext, [sim_port], source=ROOT / "envoy" / "envoy-track-output.yaml")
    pub = Publisher(ext.event_endpoint)
    try:
        pub.announce(
            ext, "sim", "m", f"127.0.0.1:{sim_port}", kv_total_blocks=KV_BLOCKS, block_size=16
        )
        results = await _drive(envoy.url, sim_port, 14)
        statuses = [r[0] for r in results]
        preemptions, _ = _engine(sim_port)
        if track:
            rejected = [r for r in results if r[0] == 529]
            assert rejected, statuses
            first = rejected[0]
            assert first[1] == 0, f"engine preempted before the first 529: {results}"
            assert first[2] < 1.0, f"KV full before the first 529: {results}"
        else:
            assert 529 not in statuses, statuses
            assert preemptions > 0, "expected the engine's KV cache to overflow without the flag"

        def released() -> bool:
            est = ext.workers()["sim"]["ranks"][0]["router_estimate"]
            return est == {
                "requests_in_flight": 0,
                "active_decode_blocks": 0,
                "active_prefill_tokens": 0,
            }

        await asyncio.to_thread(wait_until, released, 10, "estimate back to 0")
    finally:
        pub.close()
        envoy.stop()
        ext.stop()
        sim.stop()


# ----- a paced stream of generated tokens, both wirings ---------------------------------

MODEL = "paced"
WORKER = "paced-w"
BLOCK = 16
# Decode-block limit: floor(0.25 x 40) = 10 blocks, so the worker is busy at 11.
PACED_KV_BLOCKS = 40
PACED_THRESHOLD = 0.25
GENERATED = 240
STEP = 16  # tokens per step: the estimate is checked after each
EVENT = b'data: {"choices":[{"index":0,"text":"tok"}]}\n\n'
UNOBSERVED = "extproc_output_unobserved_responses_total"
IDLE = {"requests_in_flight": 0, "active_decode_blocks": 0, "active_prefill_tokens": 0}


class PacedWorker:
    """A real HTTP worker on 127.0.0.1 whose SSE streams the test paces: each request gets
    its response headers at once (as vLLM sends them), then ``emit(n)`` writes n token
    events to the stream being served and ``finish()`` ends it."""

    def __init__(self) -> None:
        self.port = free_port()
        self.commands: queue.Queue[int] = queue.Queue()
        self.requests = 0
        commands = self.commands
        worker = self

        class Handler(BaseHTTPRequestHandler):
            protocol_version = "HTTP/1.1"

            def do_POST(self) -> None:
                self.rfile.read(int(self.headers.get("content-length", "0")))
                worker.requests += 1
                self.send_response(200)
                self.send_header("content-type", "text/event-stream")
                self.send_header("transfer-encoding", "chunked")
                self.end_headers()
                self.close_connection = True
                try:
                    while (n := commands.get(timeout=60)) > 0:
                        self._chunk(EVENT * n)
                    if n == 0:
                        self._chunk(b"data: [DONE]\n\n")
                        self.wfile.write(b"0\r\n\r\n")
                except (queue.Empty, OSError):
                    pass  # nobody paced it for a minute, or Envoy went away

            def _chunk(self, data: bytes) -> None:
                self.wfile.write(b"%x\r\n%s\r\n" % (len(data), data))

            def log_message(self, *args: Any) -> None:
                pass

        self.server = ThreadingHTTPServer(("127.0.0.1", self.port), Handler)
        self.server.daemon_threads = True
        self.thread = threading.Thread(target=self.server.serve_forever, daemon=True)
        self.thread.start()

    @property
    def endpoint(self) -> str:
        return f"127.0.0.1:{self.port}"

    def emit(self, tokens: int) -> None:
        self.commands.put(tokens)

    def finish(self) -> None:
        self.commands.put(0)

    def stop(self) -> None:
        self.commands.put(-1)  # a stream still served ends without [DONE]
        self.server.shutdown()
        self.server.server_close()


class PacedStack:
    def __init__(self, log_dir: Path, wiring: str) -> None:
        self.worker = PacedWorker()
        self.ext = Extproc(
            log_dir,
            [
                "--router-track-output-blocks",
                "--active-decode-blocks-threshold",
                str(PACED_THRESHOLD),
                "--worker-ttl",
                "120",
            ],
        )
        if wiring == "observer":
            source = ROOT / "envoy" / "envoy-track-output.yaml"
            self.envoy = Envoy(log_dir, self.ext, [self.worker.port], source=source)
        elif wiring == "main-filter-streamed":
            self.envoy = Envoy(log_dir, self.ext, [self.worker.port], tweak=stream_response_body)
        else:  # "no-body": the default config, which does not show the extproc the body
            self.envoy = Envoy(log_dir, self.ext, [self.worker.port])
        self.pub = Publisher(self.ext.event_endpoint)
        self.pub.announce(
            self.ext,
            WORKER,
            MODEL,
            self.worker.endpoint,
            kv_total_blocks=PACED_KV_BLOCKS,
            block_size=BLOCK,
        )

    def rank(self) -> dict[str, Any]:
        rank: dict[str, Any] = self.ext.workers()[WORKER]["ranks"][0]
        return rank

    def estimate(self) -> dict[str, int]:
        estimate: dict[str, int] = self.rank()["router_estimate"]
        return estimate

    def unobserved(self) -> float:
        return metric_value(self.ext.metrics(), UNOBSERVED) or 0.0

    def open_stream(self, path: str = "prefix") -> tuple[HTTPConnection, HTTPResponse]:
        """A streamed completion, once its response headers are in. ``path``: "prefix"
        (``model`` first: decided on the request headers) or "exact" (``model`` last: the
        extproc asks for the body and decides on it)."""
        fields: dict[str, Any] = {"prompt": "Tell me a long story.", "max_tokens": GENERATED}
        fields = {"model": MODEL, **fields} if path == "prefix" else {**fields, "model": MODEL}
        body = json.dumps({**fields, "stream": True})
        conn = HTTPConnection("127.0.0.1", self.envoy.port, timeout=30)
        conn.request("POST", "/v1/completions", body, {"content-type": "application/json"})
        resp = conn.getresponse()
        assert resp.status == 200, (resp.status, resp.read())
        return conn, resp

    def close(self) -> None:
        self.pub.close()
        self.envoy.stop()
        self.ext.stop()
        self.worker.stop()


def _read_events(resp: HTTPResponse, n: int) -> None:
    for _ in range(n):
        line = resp.readline()
        while line in (b"\r\n", b"\n"):
            line = resp.readline()
        assert line.startswith(b"data: {"), line


def _ceil(a: int, b: int) -> int:
    return -(-a // b)


@pytest.mark.parametrize("path", ["prefix", "exact"])
@pytest.mark.parametrize("wiring", ["observer", "main-filter-streamed"])
def test_a_long_stream_turns_its_worker_busy_at_the_threshold_and_leaving_releases_it(
    tmp_path: Path, wiring: str, path: str
) -> None:
    stack = PacedStack(tmp_path, wiring)
    try:
        limit = stack.rank()["busy_limits"]["active_decode_blocks_threshold"]
        assert limit == 10
        conn, resp = stack.open_stream(path)
        # Routed: the prompt is in prefill until the first generated token, since a stream
        # delivers the body.
        wait_until(lambda: stack.estimate()["requests_in_flight"] == 1, 10, "routed")
        prompt = stack.estimate()["active_prefill_tokens"]
        assert 0 < prompt < BLOCK * limit // 2, prompt
        start = {
            "requests_in_flight": 1,
            "active_decode_blocks": _ceil(prompt, BLOCK),
            "active_prefill_tokens": prompt,
        }
        assert stack.estimate() == start
        busy_at = None
        for generated in range(STEP, GENERATED + 1, STEP):
            stack.worker.emit(STEP)
            _read_events(resp, STEP)
            blocks = _ceil(prompt + generated, BLOCK)
            want = {"requests_in_flight": 1, "active_decode_blocks": blocks,
                    "active_prefill_tokens": 0}  # fmt: skip
            wait_until(
                lambda w=want: stack.estimate() == w,
                10,
                f"{generated} tokens counted once: {want}",
            )
            state = stack.ext.workers()[WORKER]["state"]
            assert state == ("busy" if blocks > limit else "free"), (generated, blocks, state)
            if blocks > limit and busy_at is None:
                busy_at = generated
                # The worker's only stream fills it: the next request is shed.
                status, headers, _ = http(
                    "POST",
                    stack.envoy.url + "/v1/completions",
                    {"model": MODEL, "prompt": "hi", "stream": True},
                    timeout=10,
                )
                assert status == 529
                assert headers.get("x-shed-reason") == "active_decode_blocks_threshold"
        assert busy_at is not None and _ceil(prompt + busy_at, BLOCK) == limit + 1
        assert stack.estimate()["active_decode_blocks"] == _ceil(prompt + GENERATED, BLOCK)
        assert stack.worker.requests == 1  # the shed request never reached the worker
        # The client leaves mid-stream (the worker has more to say): the blocks come back.
        resp.close()
        conn.close()
        wait_until(lambda: stack.estimate() == IDLE, 10, "estimate released")
        assert stack.ext.workers()[WORKER]["state"] == "free"
        assert stack.unobserved() == 0
        assert "no ext_proc stream received its body" not in stack.ext.proc.log()
    finally:
        stack.close()


# ----- a wiring that delivers no body: said once, counted, and shown with the fix ---------


@pytest.fixture(scope="module")
def no_body_stack(tmp_path_factory: pytest.TempPathFactory) -> Iterator[PacedStack]:
    stack = PacedStack(tmp_path_factory.mktemp("no-body"), "no-body")
    yield stack
    stack.close()


def test_streams_whose_body_reaches_no_stream_are_counted_warned_once_and_shown(
    no_body_stack: PacedStack,
) -> None:
    stack = no_body_stack
    for n in (1, 2, 3):
        conn, resp = stack.open_stream()
        stack.worker.emit(5)
        _read_events(resp, 5)
        stack.worker.finish()
        assert resp.read().rstrip().endswith(b"data: [DONE]")
        conn.close()
        wait_until(lambda n=n: stack.unobserved() == n, 10, f"{n} unobserved responses")
    # Without the body the generated tokens never reached the estimate.
    wait_until(lambda: stack.estimate() == IDLE, 10, "estimate released")
    log = stack.ext.proc.log()
    assert log.count("no ext_proc stream received its body") == 1, log
    assert "use envoy/envoy-track-output.yaml" in log
    tracking = get_json(stack.ext.admin + "/debug/workers")["output_tracking"]
    assert tracking["track_output_blocks"] is True
    assert tracking["unobserved_responses"] == 3
    assert "3 streamed responses" in tracking["warning"]
    assert "use envoy/envoy-track-output.yaml, or stream the response body" in (tracking["warning"])
    assert 0 <= tracking["last_unobserved_age_s"] < 60
    status = get_json(stack.ext.admin + "/status.json")["output_tracking"]
    assert status["unobserved_responses"] == 3
    assert "use envoy/envoy-track-output.yaml, or stream the response body" in status["warning"]


CHROMIUM = "/usr/bin/chromium"


def test_the_status_page_names_the_fix(no_body_stack: PacedStack) -> None:
    if not os.path.exists(CHROMIUM):
        pytest.skip(f"{CHROMIUM} not found: apt-get install chromium")
    try:
        from playwright.sync_api import sync_playwright
    except ImportError:
        pytest.skip("playwright is not installed: pip install -e '.[test]'")
    stack = no_body_stack
    if not stack.unobserved():  # run alone: one unobserved stream first
        conn, resp = stack.open_stream()
        stack.worker.finish()
        resp.read()
        conn.close()
        wait_until(lambda: stack.unobserved() >= 1, 10, "an unobserved response")
    with sync_playwright() as p:
        browser = p.chromium.launch(executable_path=CHROMIUM, args=["--no-sandbox"])
        try:
            page = browser.new_page()
            page.goto(stack.ext.admin + "/status")
            line = page.locator("#warnings li.output-tracking")
            line.wait_for(timeout=10_000)
            assert page.locator("#warnings").is_visible()
            text = line.inner_text()
            assert "use envoy/envoy-track-output.yaml, or stream the response body" in text
        finally:
            browser.close()
