"""``make demo ENGINE=vllm``: the local stack on two real vLLM engines.

The demo (``python -m extproc.devstack --engine vllm --free-ports``) comes up with two vLLM
servers serving SmolLM2 and their agents; a chat through Envoy gets generated text; six long
stories through Envoy, each from its own prompt of 3 KV blocks, make every worker busy by its
KV use and the answer is a 529, with ``/debug/workers`` naming the check; a vLLM server killed
with SIGKILL is reported, leaves no engine core behind, and the other worker serves; Ctrl-C
stops everything. Without vLLM installed the module fails under CI and skips elsewhere.
"""

from __future__ import annotations

import contextlib
import json
import os
import re
import signal
import subprocess
import sys
import threading
from http.client import HTTPConnection
from pathlib import Path
from typing import Any

import pytest

from extproc.devstack import ROOT, get_json, http, wait_until
from tests.deploy.test_devstack import _children, _gone
from tests.support.vllm_engine import require_vllm

MODEL = "smollm2"
STORY = "Tell me a long story about the sea and the lighthouse keeper. " * 25  # ~330 tokens
START = 400.0  # two vLLM servers, the extproc and Envoy starting on a loaded 2-core machine
WAIT = 90.0

pytestmark = [pytest.mark.envoy, pytest.mark.timeout(900)]

require_vllm()


class VllmDemo:
    """The demo on vLLM as a subprocess, its output read as it comes."""

    def __init__(self, logs: Path) -> None:
        self.proc = subprocess.Popen(
            [sys.executable, "-m", "extproc.devstack", "--engine", "vllm", "--free-ports",
             "--logs", str(logs)],
            cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
        )  # fmt: skip
        self.lines: list[str] = []
        self._reader = threading.Thread(target=self._read, daemon=True)
        self._reader.start()
        banner = self.wait_line(r"Stack is up: Envoy http://localhost:(\d+) .*admin :(\d+)", START)
        self.url = f"http://127.0.0.1:{banner[1]}"
        self.admin = f"http://127.0.0.1:{banner[2]}"
        listed = self.wait_line(r"-> vLLM workers (.*)", 5)[1]
        self.ports = {w: int(p) for w, p in re.findall(r"(\S+) :(\d+)", listed)}

    def _read(self) -> None:
        assert self.proc.stdout is not None
        for line in self.proc.stdout:
            self.lines.append(line.rstrip("\n"))

    def output(self) -> str:
        return "\n".join(self.lines)

    def wait_line(self, pattern: str, timeout: float, start: int = 0) -> re.Match[str]:
        def found() -> re.Match[str] | None:
            for line in self.lines[start:]:
                if match := re.search(pattern, line):
                    return match
            assert self.proc.poll() is None or self._reader.is_alive(), self.output()
            return None

        try:
            return wait_until(found, timeout, f"a line matching {pattern!r}")
        except AssertionError as exc:
            raise AssertionError(f"{exc}\noutput:\n{self.output()}") from None

    def workers(self) -> dict[str, Any]:
        return {w["worker_id"]: w for w in get_json(self.admin + "/debug/workers")["workers"]}

    def chat(self) -> tuple[int, dict[str, str], bytes]:
        body = {"model": MODEL, "messages": [{"role": "user", "content": "Hello"}],
                "max_tokens": 24}  # fmt: skip
        return http("POST", self.url + "/v1/chat/completions", body, timeout=120)

    def stop(self) -> int:
        """Ctrl-C; the exit code (everything is killed by PID if it does not stop)."""
        running = _children(self.proc.pid)
        self.proc.send_signal(signal.SIGINT)
        try:
            return self.proc.wait(60)
        except subprocess.TimeoutExpired:
            for pid in [*running, self.proc.pid]:
                with contextlib.suppress(ProcessLookupError):
                    os.kill(pid, signal.SIGKILL)
            self.proc.wait(10)
            raise


def _story(url: str, n: int) -> HTTPConnection:
    """A streamed story through Envoy, left open: its worker holds its blocks."""
    conn = HTTPConnection(url.removeprefix("http://"), timeout=300)
    body = {"model": MODEL, "prompt": f"Story {n}. {STORY}", "max_tokens": 300,
            "ignore_eos": True, "stream": True}  # fmt: skip
    conn.request("POST", "/v1/completions", json.dumps(body), {"content-type": "application/json"})
    return conn


def _engines(demo: VllmDemo) -> dict[str, int]:
    """Each worker's vLLM server by worker id (the demo's children started with --port)."""
    named = {}
    for pid in _children(demo.proc.pid):
        with contextlib.suppress(OSError):
            argv = [a.decode() for a in Path(f"/proc/{pid}/cmdline").read_bytes().split(b"\0")]
            if "vllm.entrypoints.openai.api_server" in argv:
                port = int(argv[argv.index("--port") + 1])
                named[next(w for w, p in demo.ports.items() if p == port)] = pid
    return named


def _session(leader: int) -> list[int]:
    """Live processes in the session that ``leader`` started."""
    left = []
    for stat in Path("/proc").glob("[0-9]*/stat"):
        with contextlib.suppress(OSError, IndexError):
            fields = stat.read_text().rsplit(")", 1)[1].split()
            if int(fields[3]) == leader and fields[0] not in ("Z", "X"):
                left.append(int(stat.parent.name))
    return left


def test_demo_on_vllm_serves_sheds_by_kv_survives_kill_9_and_stops(tmp_path: Path) -> None:
    demo = VllmDemo(tmp_path)
    streams: list[HTTPConnection] = []
    engines: dict[str, int] = {}
    try:
        banner = demo.output()
        assert f'Model "{MODEL}"' in banner and "17 blocks of 128 tokens" in banner, banner
        assert "active_decode_blocks_threshold 0.5" in banner, banner
        assert set(demo.workers()) == set(demo.ports) == {"vllm-1", "vllm-2"}
        engines = _engines(demo)
        assert set(engines) == {"vllm-1", "vllm-2"}, engines

        status, _, reply = demo.chat()
        assert status == 200, reply
        answer = json.loads(reply)
        assert answer["model"] == MODEL and answer["choices"][0]["message"]["content"].strip()

        # Six stories of 3 blocks each: three per worker hold 9 of its 16 blocks, more than
        # half of 17; every worker busy, and the next request is shed.
        for n in range(1, 7):
            streams.append(_story(demo.url, n))
        wait_until(lambda: {w["state"] for w in demo.workers().values()} == {"busy"}, WAIT,
                   "both workers busy")  # fmt: skip
        status, headers, reply = demo.chat()
        assert status == 529, reply
        assert int(headers["retry-after"]) >= 1
        for worker in demo.workers().values():
            assert worker["why"] == (
                "every rank with load data is busy: rank 0: active_decode_blocks_threshold"
            ), worker
        for conn in streams:
            conn.close()
        streams.clear()
        wait_until(lambda: {w["state"] for w in demo.workers().values()} == {"free"}, WAIT,
                   "both workers free again")  # fmt: skip

        # vllm-1's server dies: reported, its engine core does not outlive it, its agent is
        # stopped (it says bye), vllm-2 serves; the printed command would start it again.
        os.kill(engines["vllm-1"], signal.SIGKILL)
        said = demo.wait_line(r"vllm-1 exited \(killed by SIGKILL\); (.*) keep running", 15)
        assert said[1] == "Envoy, the extproc and vllm-2", said[0]
        demo.wait_line(r"the extproc dropped vllm-1 at once", 5)
        demo.wait_line(r"Start it again:\s+kill -USR1 \d+", 5)
        assert _session(engines["vllm-1"]) == []
        wait_until(lambda: "vllm-1" not in demo.workers(), 10, "vllm-1 dropped on its bye")
        for _ in range(2):
            status, _, reply = demo.chat()
            assert status == 200, reply
    finally:
        for conn in streams:
            conn.close()
        rc = demo.stop()
    assert rc == 0, demo.output()
    for pid in engines.values():
        wait_until(lambda pid=pid: _gone(pid) and not _session(pid), 30, f"vLLM {pid} stopped")
    assert "Traceback" not in demo.output(), demo.output()
