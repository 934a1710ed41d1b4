"""``make demo ENGINE=llamacpp``: the local stack on two real llama.cpp engines.

The demo (``python -m extproc.devstack --engine llamacpp --free-ports``) comes up with two
llama.cpp engines (``python -m llmworker.llama_server``) serving SmolLM2 and their agents; a
chat through Envoy gets generated text; with both slots of both engines generating long
answers every worker is busy by its KV use and the answer is a 529, with ``/debug/workers``
naming the check; a dead engine, then a dead agent, is reported and restarted like a
simulated worker; Ctrl-C stops everything. The banner names the demo's TTFT target (2 s),
which the extproc holds. Without the engine installed the module fails under CI and skips
elsewhere, saying why.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
from http.client import HTTPConnection
from pathlib import Path
from typing import Any

from extproc.devstack import get_json, http, wait_until
from extproc.devstack.llamacpp import is_engine
from tests.deploy.test_devstack import Demo, _children, _gone
from tests.support.engine import require_engine

MODEL = "smollm2"
# The machine is shared and has 2 cores: conditions get generous deadlines.
WAIT = 45.0


require_engine()


def _chat(demo: Demo, max_tokens: int = 24) -> tuple[int, dict[str, str], bytes]:
    body = {
        "model": MODEL,
        "messages": [{"role": "user", "content": "Hello"}],
        "max_tokens": max_tokens,
    }
    return http("POST", demo.url + "/v1/chat/completions", body, timeout=60)


def _long_generation(engine_url: str) -> HTTPConnection:
    """A streamed completion put straight on an engine and left open: it holds a slot, and
    the context it fills, for its 480 tokens. Only the agent's reports show it to the router."""
    conn = HTTPConnection(engine_url.removeprefix("http://"), timeout=120)
    body = {"model": MODEL, "prompt": "Once upon a time", "max_tokens": 480,
            "ignore_eos": True, "stream": True}  # fmt: skip
    conn.request("POST", "/v1/completions", json.dumps(body), {"content-type": "application/json"})
    resp = conn.getresponse()
    assert resp.status == 200, (resp.status, resp.read())
    return conn


def _workers(demo: Demo) -> dict[str, Any]:
    """``/debug/workers`` by worker id."""
    return {w["worker_id"]: w for w in get_json(demo.admin + "/debug/workers")["workers"]}


def _processes(demo: Demo) -> dict[str, int]:
    """The demo's children by role: extproc, envoy, and per worker its engine and agent."""
    named: dict[str, int] = {}
    for pid in _children(demo.proc.pid):
        try:
            argv = [a.decode() for a in Path(f"/proc/{pid}/cmdline").read_bytes().split(b"\0") if a]
        except OSError:
            continue
        if "--worker-id" in argv:
            named[argv[argv.index("--worker-id") + 1] + "-agent"] = pid
        elif is_engine(argv):
            port = argv[argv.index("--port") + 1]
            worker = next(w for w, u in demo.worker_urls.items() if u.endswith(f":{port}"))
            named[worker] = pid
        elif argv[1:3] == ["-m", "extproc"]:
            named["extproc"] = pid
        elif Path(argv[0]).name == "envoy":
            named["envoy"] = pid
    return named


def test_demo_on_llamacpp_serves_sheds_when_every_slot_is_busy_and_stops(tmp_path: Path) -> None:
    demo = Demo(tmp_path, "--engine", "llamacpp")
    streams: list[HTTPConnection] = []
    after: dict[str, int] = {}
    try:
        banner = demo.output()
        assert f'Model "{MODEL}"' in banner, banner
        assert "active_decode_blocks_threshold 0.5" in banner, banner
        # The demo's TTFT target, named in the banner with how to change it, and in force.
        assert "TTFT target: 2000 ms for every model" in banner, banner
        assert "ARGS='--ttft-p99-target-ms X'" in banner and "--no-ttft-target" in banner
        status, _, raw = http("GET", demo.admin + "/busy_threshold")
        assert status == 200, raw
        targets = {e["model"]: e.get("ttft_p99_target_ms") for e in json.loads(raw)["thresholds"]}
        assert targets == {MODEL: 2000.0}, raw
        assert set(demo.worker_urls) == {"llama-1", "llama-2"}, demo.worker_urls
        started = _processes(demo)
        assert set(started) == {"extproc", "envoy", "llama-1", "llama-1-agent", "llama-2",
                                "llama-2-agent"}, started  # fmt: skip
        assert set(demo.workers()) == {"llama-1", "llama-2"}  # announced before the banner

        # Generated text through Envoy.
        status, _, reply = _chat(demo)
        assert status == 200, reply
        answer = json.loads(reply)
        assert answer["model"] == MODEL
        assert answer["usage"]["completion_tokens"] > 0
        assert answer["choices"][0]["message"]["content"].strip()

        # One long generation per engine: free still (one slot holds at most half the context).
        for url in demo.worker_urls.values():
            streams.append(_long_generation(url))
        wait_until(
            lambda: all(
                w["ranks"][0]["reported"]["active_decode_blocks"] >= 8
                for w in _workers(demo).values()
            ),
            WAIT,
            "both engines reported a long generation",
        )
        assert {w["state"] for w in _workers(demo).values()} == {"free"}
        # The second slot of each engine too: once both slots hold more than 32 blocks,
        # every worker is busy by its KV use and the answer comes from the extproc.
        for url in demo.worker_urls.values():
            streams.append(_long_generation(url))
        wait_until(
            lambda: {w["state"] for w in _workers(demo).values()} == {"busy"},
            WAIT,
            "every slot busy and both workers over half their context",
        )
        status, headers, reply = _chat(demo)
        assert status == 529, reply
        assert int(headers["retry-after"]) >= 1
        for worker in _workers(demo).values():
            assert worker["why"] == (
                "every rank with load data is busy: rank 0: active_decode_blocks_threshold"
            ), worker
            assert worker["ranks"][0]["reported"]["active_decode_blocks"] > 32, worker
        for conn in streams:
            conn.close()
        streams.clear()

        # The engine of llama-1 dies: reported, its agent stopped (it says bye), and the
        # printed command starts both again.
        os.kill(started["llama-1"], signal.SIGKILL)
        said = demo.wait_line(r"llama-1 exited \(killed by SIGKILL\); (.*) keep running", 10)
        assert said[1] == "Envoy, the extproc and llama-2", said[0]
        demo.wait_line(r"the extproc dropped llama-1 at once", 5)
        restart = demo.wait_line(r"Start it again:\s+(kill -USR1 \d+)", 5)[1]
        wait_until(lambda: "llama-1" not in demo.workers(), 10, "llama-1 dropped on its bye")
        status, _, reply = _chat(demo)
        assert status == 200, reply  # llama-2 serves
        subprocess.run(restart.split(), check=True, timeout=10)
        demo.wait_line(r"llama-1 started again on :\d+", WAIT)
        wait_until(lambda: "llama-1" in demo.workers(), 10, "llama-1 announced again")
        again = _processes(demo)
        assert set(again) == set(started) and again["llama-1"] != started["llama-1"], again

        # Its agent dies instead: reported by name, nothing said bye (the TTL drops the
        # worker), its engine is stopped; the same command brings both back.
        mark = len(demo.lines)
        os.kill(again["llama-1-agent"], signal.SIGKILL)
        said = demo.wait_line(r"llama-1 exited \((.*)\); .* Log: (\S+)", 10, start=mark)
        assert said[1] == "llama-1-agent killed by SIGKILL", said[0]
        assert said[2].endswith("llama-1-agent.log"), said[0]
        demo.wait_line(r"drops llama-1 when its worker TTL passes", 5, start=mark)
        wait_until(lambda: _gone(again["llama-1"]), 15, "llama-1's engine stopped")
        subprocess.run(restart.split(), check=True, timeout=10)
        demo.wait_line(r"llama-1 started again on :\d+", WAIT, start=mark)
        after = _processes(demo)
        assert set(after) == set(started), after
        assert after["llama-1-agent"] != again["llama-1-agent"], after
    finally:
        for conn in streams:
            conn.close()
        rc = demo.stop()
    assert rc == 0, demo.output()
    for pid in after.values():
        wait_until(lambda pid=pid: _gone(pid), 15, f"child {pid} stopped")
    assert "Traceback" not in demo.output(), demo.output()
