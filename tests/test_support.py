"""The test harness's own promises that the other tests rely on."""

from __future__ import annotations

import os
import signal
import socket
import subprocess
from pathlib import Path

import pytest

from extproc.devstack import (
    PYTHON,
    Proc,
    ProcessExited,
    WaitTimeout,
    free_port,
    metric_samples,
    metric_sums,
    metric_value,
    wait_until,
)


def test_free_port_is_outside_the_ephemeral_range_and_never_repeats() -> None:
    low = int(Path("/proc/sys/net/ipv4/ip_local_port_range").read_text().split()[0])
    ports = [free_port() for _ in range(200)]
    assert len(set(ports)) == len(ports)
    # Outgoing connections take their local port from low upwards; none can take these.
    assert all(1024 <= p < low for p in ports), [p for p in ports if not 1024 <= p < low]
    for p in ports[:20]:
        with socket.socket() as s:
            s.bind(("127.0.0.1", p))  # still free


METRICS = """\
# HELP extproc_decisions_total Decisions by outcome.
# TYPE extproc_decisions_total counter
extproc_decisions_total{outcome="routed"} 3.0
extproc_decisions_total{outcome="overloaded"} 2.0
# HELP extproc_streams Open streams.
# TYPE extproc_streams gauge
extproc_streams 1.0
# TYPE extproc_workers gauge
extproc_workers{model="m,n",state="busy"} 4.0
extproc_workers{model="m,n",state="free"} 5.0
# TYPE vllm:num_requests_waiting gauge
vllm:num_requests_waiting{engine="0"} 7.0
vllm:num_requests_waiting{engine="1"} 1.0
"""


def test_metric_value_picks_one_series_by_labels() -> None:
    assert metric_value(METRICS, "extproc_decisions_total", {"outcome": "routed"}) == 3.0
    assert metric_value(METRICS, "extproc_decisions_total", {"outcome": "x"}) is None
    # No labels asked: only the series without labels.
    assert metric_value(METRICS, "extproc_decisions_total") is None
    assert metric_value(METRICS, "extproc_streams") == 1.0
    # A subset of the labels is enough; a comma inside a quoted value is no separator.
    assert metric_value(METRICS, "extproc_workers", {"state": "free"}) == 5.0
    assert metric_value(METRICS, "extproc_workers", {"model": "m,n"}) == 4.0
    assert metric_value(METRICS, "extproc_missing") is None
    assert metric_sums(METRICS)["vllm:num_requests_waiting"] == 8.0
    assert metric_sums(METRICS)["extproc_decisions_total"] == 5.0
    assert {s.name for s in metric_samples(METRICS)} >= {"extproc_streams", "extproc_workers"}


def test_metric_reading_rejects_malformed_text() -> None:
    with pytest.raises(ValueError):
        metric_value('extproc_streams{state="x" 1\n', "extproc_streams")


def test_proc_keeps_its_output_and_stops_by_pid(tmp_path: Path) -> None:
    quiet = Proc("quiet", [PYTHON, "-c", "print('hello', flush=True); import time; time.sleep(60)"])
    logged = Proc("logged", [PYTHON, "-c", "import sys; sys.stderr.write('to stderr')"], tmp_path)
    try:
        # The whole line: unbuffered, print writes "hello" and its newline apart.
        wait_until(lambda: "hello\n" in quiet.log(), 10, "the first line")
        assert quiet.alive()
    finally:
        assert quiet.stop() == -signal.SIGTERM
    assert not quiet.alive() and quiet.log() == "hello\n"  # still readable once stopped
    wait_until(lambda: not logged.alive(), 10, "the second process to exit")
    assert logged.stop() == 0
    assert (tmp_path / "logged.log").read_text() == "to stderr"
    with pytest.raises(ProcessExited, match="logged exited with 0:\nto stderr"):
        logged.check_alive()


def test_a_nice_proc_runs_at_that_niceness_under_its_own_pid() -> None:
    base = os.getpriority(os.PRIO_PROCESS, 0)
    proc = Proc(
        "nice",
        [PYTHON, "-c", "import os, time; print(os.getpid(), flush=True); time.sleep(60)"],
        nice=19,
    )
    try:
        wait_until(lambda: proc.log().strip() != "", 10, "the child's PID")
        assert int(proc.log()) == proc.pid
        assert os.getpriority(os.PRIO_PROCESS, proc.pid) == min(19, base + 19)
    finally:
        proc.stop()
    with pytest.raises(ValueError, match="nice: 20 is not a niceness from 0 to 19"):
        Proc("too nice", [PYTHON, "-c", "pass"], nice=20)


def test_a_nice_proc_in_a_session_of_its_own_lowers_the_session_too() -> None:
    """With autogroup scheduling each session shares the CPUs equally whatever its
    processes' niceness: a process at nice 19 alone in its session would compete with the
    caller's session as an equal. Its session's group gets the niceness as well."""
    group = Path("/proc/self/autogroup")
    if not group.exists():
        pytest.skip("this kernel has no autogroup scheduling (/proc/self/autogroup)")
    proc = Proc(
        "nice session",
        [PYTHON, "-c", "import time; time.sleep(60)"],
        nice=19,
        new_session=True,
    )
    try:
        line = Path(f"/proc/{proc.pid}/autogroup").read_text()
        assert line.split()[-2:] == ["nice", "19"], line
        # A group of its own. The caller's file is empty when it runs in the kernel's root
        # group (a session started before autogroups were enabled, or a container's init).
        assert line.split()[:1] != group.read_text().split()[:1]
    finally:
        proc.stop()
    same = Proc("same session", [PYTHON, "-c", "import time; time.sleep(60)"], nice=19)
    try:  # without a session of its own, the caller's group is left alone
        assert Path(f"/proc/{same.pid}/autogroup").read_text() == group.read_text()
    finally:
        same.stop()


def test_wait_until_names_what_it_waited_for() -> None:
    with pytest.raises(WaitTimeout, match=r"timed out after 0.1s waiting for the moon"):
        wait_until(lambda: False, 0.1, "the moon")


def test_the_harness_does_not_import_the_worker_side() -> None:
    """The router package starts llmworker as a subprocess only, never imports it."""
    code = (
        "import sys, extproc.devstack, extproc.devstack.__main__, extproc.devstack.echo_worker\n"
        "print(sorted(m for m in sys.modules if m.split('.')[0] == 'llmworker'))"
    )
    run = subprocess.run([PYTHON, "-c", code], capture_output=True, text=True, timeout=60)
    assert run.returncode == 0, run.stderr
    assert run.stdout.strip() == "[]"
