"""``make demo``: the local stack comes up on localhost:8000 and Ctrl-C stops all of it."""

from __future__ import annotations

import contextlib
import json
import os
import shutil
import signal
import socket
import subprocess
import sys
from pathlib import Path

import pytest

from extproc.devstack import ROOT, http, wait_until

PORTS = (8000, 9002, 9003, 9901, 8101, 8102)


def _port_free(port: int) -> bool:
    with socket.socket() as s:
        s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)  # TIME_WAIT is fine
        try:
            s.bind(("127.0.0.1", port))
        except OSError:
            return False
    return True


def _children(pid: int) -> list[int]:
    out = subprocess.run(["ps", "-eo", "pid=,ppid="], capture_output=True, text=True).stdout
    return [int(p) for p, pp in (line.split() for line in out.splitlines()) if int(pp) == pid]


def test_demo_stack_serves_and_stops_cleanly(tmp_path: Path) -> None:
    if not all(_port_free(p) for p in PORTS):
        pytest.skip(f"the demo's fixed ports {PORTS} are in use on this machine")
    proc = subprocess.Popen(
        [
            sys.executable,
            "-m",
            "extproc.devstack",
            "--speedup",
            "20",
            "--logs",
            str(tmp_path),
            "--active-decode-blocks-threshold",
            "0.9",
        ],
        cwd=ROOT,
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        # As a shell script's background job gets it: SIGINT ignored. Ctrl-C must still work.
        preexec_fn=lambda: signal.signal(signal.SIGINT, signal.SIG_IGN),
    )
    try:

        def up() -> bool:
            assert proc.poll() is None, proc.stdout.read().decode() if proc.stdout else ""
            return http("GET", "http://127.0.0.1:9901/ready", timeout=1)[0] == 200

        wait_until(up, 60, "demo stack up")
        children = _children(proc.pid)
        assert len(children) == 4  # extproc, 2 simulated workers, envoy
        body = {"model": "sim-model", "messages": [{"role": "user", "content": "Hello"}]}
        wait_until(
            lambda: http("POST", "http://127.0.0.1:8000/v1/chat/completions", body)[0] == 200,
            20,
            "a routed request",
        )
        status, headers, reply = http("POST", "http://127.0.0.1:8000/v1/chat/completions", body)
        assert status == 200
        assert headers["x-worker-id"] in ("sim-1", "sim-2")
        assert json.loads(reply)["usage"]["prompt_tokens"] == 2
        thresholds = json.loads(http("GET", "http://127.0.0.1:8000/busy_threshold")[2])
        assert thresholds["thresholds"][0]["active_decode_blocks_threshold"] == 0.9
    finally:
        running = _children(proc.pid)
        proc.send_signal(signal.SIGINT)
        try:
            rc = proc.wait(30)
        except subprocess.TimeoutExpired:
            for pid in [*running, proc.pid]:  # leave nothing on the fixed ports
                with contextlib.suppress(ProcessLookupError):
                    os.kill(pid, signal.SIGKILL)
            proc.wait(10)
            raise
    assert rc == 0
    for pid in children:
        wait_until(
            lambda pid=pid: (
                not Path(f"/proc/{pid}").exists()
                or "zombie" in Path(f"/proc/{pid}/status").read_text().lower()
            ),
            15,
            f"child {pid} stopped",
        )
    assert all(_port_free(p) for p in PORTS)


def test_demo_outside_a_checkout_says_it_needs_one(tmp_path: Path) -> None:
    """The package installed on its own (here: a copy on PYTHONPATH) has no envoy/ beside it."""
    site = tmp_path / "site"
    skip = shutil.ignore_patterns("__pycache__")
    shutil.copytree(ROOT / "extproc", site / "extproc", ignore=skip)
    env = {**os.environ, "PYTHONPATH": str(site)}
    where = subprocess.run(
        [sys.executable, "-c", "import extproc; print(extproc.__file__)"],
        cwd=tmp_path, env=env, capture_output=True, text=True, timeout=30,
    )  # fmt: skip
    assert where.stdout.strip() == str(site / "extproc" / "__init__.py"), where
    run = subprocess.run(
        [sys.executable, "-m", "extproc.devstack", "--logs", str(tmp_path / "logs")],
        cwd=tmp_path, env=env, capture_output=True, text=True, timeout=60,
    )  # fmt: skip
    assert run.returncode == 2, run
    assert "envoy/envoy.yaml not found" in run.stderr
    assert "runs from a checkout of the repository (`make demo`" in run.stderr
    assert "Traceback" not in run.stderr
    assert not (tmp_path / "logs").exists()  # nothing was started
