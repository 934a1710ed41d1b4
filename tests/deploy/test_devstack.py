"""``make demo``: the local stack comes up on localhost:8000 and Ctrl-C stops all of it."""

from __future__ import annotations

import contextlib
import json
import os
import re
import shlex
import shutil
import signal
import socket
import subprocess
import sys
import threading
import time
from collections import Counter
from http.client import HTTPConnection
from pathlib import Path

import pytest

from extproc.devstack import ROOT, http, wait_until
from extproc.devstack.workers import exit_status

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


# --- a worker dies in the running demo ------------------------------------------------------

CHAT = {"model": "sim-model", "messages": [{"role": "user", "content": "Hello"}]}
OVERLOAD_BODY = {"message": "Service temporarily overloaded", "type": "Overloaded", "code": 529}


class Demo:
    """``python -m extproc.devstack --free-ports`` as a subprocess, its output read as it comes."""

    def __init__(self, logs: Path, *args: str) -> None:
        self.proc = subprocess.Popen(
            [sys.executable, "-m", "extproc.devstack", "--free-ports", "--logs", str(logs), *args],
            cwd=ROOT,
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            text=True,
        )
        self.lines: list[str] = []
        self._reader = threading.Thread(target=self._read, daemon=True)
        self._reader.start()
        banner = self.wait_line(r"Stack is up: Envoy http://localhost:(\d+) .*admin :(\d+)", 90)
        self.url = f"http://127.0.0.1:{banner[1]}"
        self.admin = f"http://127.0.0.1:{banner[2]}"
        listed = self.wait_line(r"-> (?:simulated|llama\.cpp) workers (.*)", 5)[1]
        self.worker_urls = {
            w: f"http://127.0.0.1:{p}" for w, p in re.findall(r"(\S+) :(\d+)", listed)
        }

    def _read(self) -> None:
        assert self.proc.stdout is not None
        for line in self.proc.stdout:
            self.lines.append(line.rstrip("\n"))

    def output(self) -> str:
        return "\n".join(self.lines)

    def wait_line(self, pattern: str, timeout: float, start: int = 0) -> re.Match[str]:
        """The first output line from ``start`` on that matches ``pattern``."""

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

    def children(self) -> dict[str, int]:
        """The stack's processes by name: extproc, envoy, and each worker by its id."""
        named: dict[str, int] = {}
        for pid in _children(self.proc.pid):
            with contextlib.suppress(OSError):
                argv = Path(f"/proc/{pid}/cmdline").read_bytes().split(b"\0")
                args = [a.decode() for a in argv if a]
                if "--worker-id" in args:
                    named[args[args.index("--worker-id") + 1]] = pid
                elif args[1:3] == ["-m", "extproc"]:
                    named["extproc"] = pid
                elif Path(args[0]).name == "envoy":
                    named["envoy"] = pid
        return named

    def workers(self) -> dict[str, dict[str, object]]:
        reply = json.loads(http("GET", self.admin + "/debug/workers")[2])
        return {w["worker_id"]: w for w in reply["workers"]}

    def chat(self) -> tuple[int, dict[str, str], bytes]:
        return http("POST", self.url + "/v1/chat/completions", CHAT)

    def stop(self) -> int:
        """Ctrl-C; the exit code (everything is killed by PID if it does not stop)."""
        running = _children(self.proc.pid)
        self.proc.send_signal(signal.SIGINT)
        try:
            return self.proc.wait(30)
        except subprocess.TimeoutExpired:
            for pid in [*running, self.proc.pid]:
                with contextlib.suppress(ProcessLookupError):
                    os.kill(pid, signal.SIGKILL)
            self.proc.wait(10)
            raise


def _gone(pid: int) -> bool:
    status = Path(f"/proc/{pid}/status")
    try:
        return "zombie" in status.read_text().lower()
    except OSError:
        return True


def _hold_stream(url: str) -> tuple[HTTPConnection, dict[str, str]]:
    """A long streamed generation, left open: its worker keeps KV blocks in use."""
    conn = HTTPConnection(url.removeprefix("http://"), timeout=30)
    body = {**CHAT, "stream": True, "max_tokens": 3000}
    conn.request("POST", "/v1/chat/completions", json.dumps(body),
                 {"content-type": "application/json"})  # fmt: skip
    resp = conn.getresponse()
    assert resp.status == 200, (resp.status, resp.read())
    return conn, {k.lower(): v for k, v in resp.getheaders()}


def test_a_worker_whose_port_was_taken_while_it_was_down_comes_back_on_another(
    tmp_path: Path,
) -> None:
    """kill -9 of sim-1, then another program takes its port (as another demo or test may
    while it is down): the restart says so, starts sim-1 on another free port, and the
    extproc routes to it there."""
    demo = Demo(tmp_path, "--worker-ttl", "5")
    try:
        wait_until(lambda: {"sim-1", "sim-2"} <= set(demo.workers()), 30, "both workers known")
        before = demo.children()
        port = int(demo.worker_urls["sim-1"].rsplit(":", 1)[1])
        os.kill(before["sim-1"], signal.SIGKILL)
        demo.wait_line(r"sim-1 exited \(killed by SIGKILL\)", 10)
        wait_until(lambda: "sim-1" not in demo.children(), 10, "sim-1 reaped")
        with socket.socket() as squatter:
            squatter.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)  # past TIME_WAIT
            squatter.bind(("127.0.0.1", port))
            squatter.listen()
            os.kill(demo.proc.pid, signal.SIGUSR1)
            moved = demo.wait_line(rf"sim-1: port {port} is taken now; trying :(\d+)", 30)
            back = demo.wait_line(r"sim-1 started again on :(\d+) \(pid (\d+)\)", 30)
            assert back[1] == moved[1] != str(port), (moved[0], back[0])
            assert demo.children()["sim-1"] == int(back[2])
            endpoint = f"127.0.0.1:{back[1]}"
            wait_until(
                lambda: demo.workers().get("sim-1", {}).get("endpoint") == endpoint,
                20,
                "sim-1 known at its new port",
            )
        assert demo.proc.poll() is None
    finally:
        demo.stop()


def test_demo_keeps_serving_when_a_worker_dies_and_takes_it_back(tmp_path: Path) -> None:
    """kill -9 of sim-1: the stack says so and keeps running; requests go to sim-2, a 529
    (not Envoy's 503) when sim-2 is busy too, sim-1 leaves /debug/workers after its TTL,
    and the printed command brings it back, where it is picked again."""
    ttl = 15.0  # room for the steps below on a loaded machine before sim-1 is dropped
    demo = Demo(tmp_path, "--worker-ttl", str(ttl))
    stream: HTTPConnection | None = None
    try:
        wait_until(lambda: {"sim-1", "sim-2"} <= set(demo.workers()), 30, "both workers known")
        wait_until(lambda: demo.chat()[0] == 200, 20, "a routed request")
        before = demo.children()
        assert set(before) == {"extproc", "envoy", "sim-1", "sim-2"}, before
        os.kill(demo.proc.pid, signal.SIGUSR1)  # nothing to restart yet: it says so
        demo.wait_line(r"SIGUSR1: every worker is running, none to start again", 10)
        assert demo.children() == before

        os.kill(before["sim-1"], signal.SIGKILL)
        said = demo.wait_line(r"sim-1 exited \(killed by SIGKILL\); (.*) keep running", 10)
        assert said[1] == "Envoy, the extproc and sim-2", said[0]
        restart = demo.wait_line(r"Start it again:\s+(kill -USR1 \d+)", 5)[1]
        assert restart == f"kill -USR1 {demo.proc.pid}"
        wait_until(lambda: "sim-1" not in demo.children(), 10, "sim-1 reaped")
        assert demo.children() == {k: v for k, v in before.items() if k != "sim-1"}
        assert "sim-1" in demo.workers()  # still a candidate until its TTL

        # Routed around the dead worker (Envoy retries the refused connection on sim-2).
        for _ in range(5):
            status, headers, reply = demo.chat()
            assert (status, headers.get("x-worker-id")) == (200, "sim-2"), (status, reply)

        # sim-2 busy too: a long generation sent to it directly, so that no estimate of the
        # extproc's sits on the dead sim-1, and a strict KV check. None is left: 529.
        stream, headers = _hold_stream(demo.worker_urls["sim-2"])
        assert headers["x-worker-id"] == "sim-2"
        strict = {"model": "sim-model", "active_decode_blocks_threshold": 0.0}
        assert http("POST", demo.url + "/busy_threshold", strict)[0] == 200
        wait_until(lambda: demo.workers()["sim-2"]["state"] == "busy", 10, "sim-2 busy")
        # Until its TTL drops sim-1, every answer is the overload reply, never Envoy's 503
        # for the dead worker (a pick of sim-1 comes back marked x-upstream-failure).
        reasons: Counter[str | None] = Counter()
        deadline = time.monotonic() + ttl + 10
        while "sim-1" in demo.workers():
            assert time.monotonic() < deadline, "sim-1 still listed long after its TTL"
            status, headers, reply = demo.chat()
            assert status == 529, (status, headers, reply)
            assert json.loads(reply) == OVERLOAD_BODY
            assert headers["retry-after"].isdigit()
            reasons[headers.get("x-shed-reason")] += 1
            time.sleep(0.05)  # pace the probes: about 20 a second
        print("529s while sim-1 was listed, by x-shed-reason:", dict(reasons))
        assert reasons["worker_unreachable"] >= 1, reasons  # Envoy's 503, turned into a 529

        # Dropped after its TTL; sim-2 stays, and the answer is still the overload reply.
        assert demo.workers()["sim-2"]["state"] == "busy"
        status, _, reply = demo.chat()
        assert (status, json.loads(reply)) == (529, OVERLOAD_BODY)

        # The printed command starts it again, under the stack; it is picked again.
        subprocess.run(shlex.split(restart), check=True, timeout=10)
        back = demo.wait_line(r"sim-1 started again on :\d+ \(pid (\d+)\)", 30)
        assert demo.children()["sim-1"] == int(back[1])
        wait_until(lambda: demo.workers().get("sim-1", {}).get("state") == "free", 15,
                   "sim-1 known and free again")  # fmt: skip
        status, headers, reply = demo.chat()
        assert (status, headers.get("x-worker-id")) == (200, "sim-1"), (status, reply)
        stream.close()
        stream = None
        after = demo.children()
        assert demo.proc.poll() is None
    finally:
        if stream is not None:
            stream.close()
        rc = demo.stop()
    assert rc == 0, demo.output()
    for pid in after.values():
        wait_until(lambda pid=pid: _gone(pid), 15, f"child {pid} stopped")


@pytest.mark.parametrize("part", ["envoy", "extproc"])
def test_demo_stops_when_envoy_or_the_extproc_dies(tmp_path: Path, part: str) -> None:
    """Without either the stack cannot serve: it stops, says why, and leaves nothing behind."""
    demo = Demo(tmp_path)
    try:
        children = demo.children()
        assert set(children) == {"extproc", "envoy", "sim-1", "sim-2"}, children
        os.kill(children[part], signal.SIGKILL)
        said = demo.wait_line(rf"stopped: {part} exited \(killed by SIGKILL\)", 10)
        assert "everything stops" in said.string
        rc = demo.proc.wait(30)
    finally:
        if demo.proc.poll() is None:
            demo.stop()
    assert rc == 1, demo.output()
    for pid in children.values():
        wait_until(lambda pid=pid: _gone(pid), 15, f"child {pid} stopped")


def test_exit_status_names_the_signal_or_the_code() -> None:
    assert exit_status(-signal.SIGKILL) == "killed by SIGKILL"
    assert exit_status(-signal.SIGTERM) == "killed by SIGTERM"
    assert exit_status(1) == "exit status 1"
    assert exit_status(0) == "exit status 0"
    assert exit_status(-200) == "killed by signal 200"


def test_llama_demo_turns_the_kv_check_on_unless_a_threshold_is_given(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    from extproc.devstack.__main__ import _llama_thresholds

    for name in ("DYN_ACTIVE_DECODE_BLOCKS_THRESHOLD", "DYN_ACTIVE_PREFILL_TOKENS_THRESHOLD",
                 "DYN_ACTIVE_PREFILL_TOKENS_THRESHOLD_FRAC"):  # fmt: skip
        monkeypatch.delenv(name, raising=False)
    on = ["--active-decode-blocks-threshold", "0.5"]
    assert _llama_thresholds([]) == on
    assert _llama_thresholds(["--worker-ttl", "5"]) == [*on, "--worker-ttl", "5"]
    given = ["--active-prefill-tokens-threshold=200"]
    assert _llama_thresholds(given) == given
    assert _llama_thresholds(["--active-decode-blocks-threshold", "0.9"])[:2] == [
        "--active-decode-blocks-threshold", "0.9"]  # fmt: skip
    monkeypatch.setenv("DYN_ACTIVE_PREFILL_TOKENS_THRESHOLD", "100")
    assert _llama_thresholds([]) == []
    monkeypatch.setenv("DYN_ACTIVE_PREFILL_TOKENS_THRESHOLD", "")  # empty = off
    assert _llama_thresholds([]) == on


@pytest.mark.parametrize(
    ("missing", "expected"),
    [
        ("ModuleNotFoundError(\"No module named 'xllamacpp'\", name='xllamacpp')",
         "xllamacpp is not installed: make engine"),
        ("ImportError('libgomp.so.1: cannot open shared object file')",
         "xllamacpp does not load: libgomp.so.1: cannot open shared object file; it needs the "
         "OpenMP runtime libgomp.so.1 (Debian, Ubuntu: apt-get install libgomp1)"),
        ("LLAMA_SERVER", "LLAMA_SERVER={tmp}/llama-server does not exist"),
    ],
    ids=["not-installed", "no-libgomp", "no-binary"],
)  # fmt: skip
def test_llama_demo_without_the_engine_says_what_to_install(
    tmp_path: Path, missing: str, expected: str
) -> None:
    """xllamacpp not installed or not loading, or LLAMA_SERVER naming no file: exit 2 naming
    what to install or set, nothing started."""
    env = {k: v for k, v in os.environ.items() if k != "LLAMA_SERVER"}
    if missing == "LLAMA_SERVER":
        env["LLAMA_SERVER"] = str(tmp_path / "llama-server")
    else:  # a package of that name first on the path, failing as the real one would
        fake = tmp_path / "fake"
        (fake / "xllamacpp").mkdir(parents=True)
        (fake / "xllamacpp" / "__init__.py").write_text(f"raise {missing}\n")
        env["PYTHONPATH"] = str(fake)
    run = subprocess.run(
        [sys.executable, "-m", "extproc.devstack", "--engine", "llamacpp",
         "--logs", str(tmp_path / "logs")],
        cwd=ROOT, env=env, capture_output=True, text=True, timeout=60,
    )  # fmt: skip
    assert run.returncode == 2, run
    assert expected.format(tmp=tmp_path) in run.stderr, run.stderr
    assert "Traceback" not in run.stderr
    assert not (tmp_path / "logs").exists()


def test_a_second_signal_while_the_demo_stops_leaves_nothing_behind(tmp_path: Path) -> None:
    """``make demo`` stopped by a signal to its process group: make itself passes on a
    SIGINT after the SIGTERM, and a user may press Ctrl-C twice. Signals that come while
    the stack is stopping do not cut its stopping short."""
    demo = Demo(tmp_path)
    children: dict[str, int] = {}
    left: list[str] = []
    try:
        children = demo.children()
        assert set(children) == {"extproc", "envoy", "sim-1", "sim-2"}, children
        demo.proc.send_signal(signal.SIGTERM)
        deadline = time.monotonic() + 3.0
        while demo.proc.poll() is None and time.monotonic() < deadline:
            with contextlib.suppress(ProcessLookupError):
                demo.proc.send_signal(signal.SIGINT)  # again and again while it stops
            time.sleep(0.02)
        rc = demo.proc.wait(30)
        with contextlib.suppress(AssertionError):  # its stopping waited for each of them
            wait_until(lambda: all(_gone(pid) for pid in children.values()), 5, "stopped")
        left = [name for name, pid in children.items() if not _gone(pid)]
    finally:
        if demo.proc.poll() is None:
            demo.stop()
        for pid in children.values():  # whatever the outcome, nothing of it left running
            if not _gone(pid):
                with contextlib.suppress(ProcessLookupError):
                    os.kill(pid, signal.SIGKILL)
    assert not left, (left, demo.output())
    assert rc == 0, demo.output()
    assert "Traceback" not in demo.output()
