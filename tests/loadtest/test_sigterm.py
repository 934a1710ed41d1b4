"""SIGTERM stops a benchmark the way Ctrl-C does: the workers, the extproc and Envoy it
started are stopped with it, not left running (SIGTERM's default action would end the
benchmark at once and skip the code that stops them)."""

from __future__ import annotations

import os
import signal
import subprocess
import time
from collections.abc import Callable
from pathlib import Path

import pytest

from extproc.devstack import PYTHON, ROOT


def children(pid: int) -> set[int]:
    """The live processes whose parent is ``pid``, from /proc."""
    out = set()
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        try:
            stat = (entry / "stat").read_text()
        except OSError:
            continue
        fields = stat[stat.rindex(")") + 2 :].split()  # state, ppid, ...
        if int(fields[1]) == pid and fields[0] != "Z":
            out.add(int(entry.name))
    return out


def alive(pid: int) -> bool:
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return False
    return stat[stat.rindex(")") + 2] != "Z"


def wait_for(what: str, check: Callable[[], bool], seconds: float) -> None:
    deadline = time.monotonic() + seconds
    while not check():
        if time.monotonic() > deadline:
            raise AssertionError(f"not within {seconds:g} s: {what}")
        time.sleep(0.1)


@pytest.mark.timeout(120)
def test_sigterm_stops_the_benchmark_and_every_process_it_started(tmp_path: Path) -> None:
    err = tmp_path / "stderr.log"
    cmd = [PYTHON, "-m", "loadtest.slo", "--quick", "--capacity", "4", "--target-ms", "100",
           "--out", str(tmp_path / "out")]  # fmt: skip
    with err.open("wb") as f:
        bench = subprocess.Popen(cmd, stdout=subprocess.DEVNULL, stderr=f, cwd=ROOT)
    started: set[int] = set()
    try:
        wait_for("the stack is up", lambda: b"stack up" in err.read_bytes(), 60)
        started = children(bench.pid)
        assert len(started) >= 4, started  # the extproc, two workers, Envoy
        os.kill(bench.pid, signal.SIGTERM)
        assert bench.wait(timeout=60) == 130, err.read_text()[-2000:]
        wait_for("its processes stopped", lambda: not any(alive(p) for p in started), 30)
        assert "stopped: the processes it started were stopped" in err.read_text()
    finally:  # whatever happened, nothing of this test is left running
        if bench.poll() is None:
            bench.kill()
            bench.wait()
        for pid in started:
            if alive(pid):
                os.kill(pid, signal.SIGKILL)
