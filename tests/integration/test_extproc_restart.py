"""A restarted extproc knows the workers before it serves its first decision.

An extproc starts with an empty pool; each worker's publisher reconnects (ZeroMQ back-off,
at most 0.5 s) and re-sends its config to the new subscriber. ``--startup-grace`` (1 s)
keeps the ext_proc port closed until then, so no request meets an empty pool (a 503) and
``/ready`` turns 200 only with the workers known. Envoy fails open in the meantime; the
compose rehearsal checks that through Envoy (tests/test_compose_rehearsal.py).
"""

from __future__ import annotations

import socket
import subprocess
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

from extproc.devstack import (
    PYTHON,
    Extproc,
    Proc,
    Publisher,
    answers,
    free_port,
    get_json,
    http,
    wait_until,
)

MODEL = "restart-model"


@pytest.fixture
def sim(log_dir: Path) -> Iterator[tuple[Proc, int, str]]:
    """A simulated worker publishing to an event port that nothing has bound yet."""
    event_port = free_port()
    port = free_port()
    proc = Proc(
        "sim-restart",
        [PYTHON, "-m", "llmworker.sim", "--host", "127.0.0.1", "--port", str(port),
         "--model", MODEL, "--worker-id", "sim-restart",
         "--publish", f"tcp://127.0.0.1:{event_port}",
         # Config only on (re)subscription, not by the heartbeat, within the grace.
         "--heartbeat", "5", "--log-level", "WARNING"],
        log_dir,
    )  # fmt: skip
    try:
        # Running before the first extproc starts: its publisher has the whole grace to
        # connect even when the machine is slow to start a Python process.
        wait_until(lambda: answers(f"http://127.0.0.1:{port}/health"), 20, "sim up")
        yield proc, port, f"{event_port}"
    finally:
        proc.stop()


def _ports(event_port: str) -> tuple[int, int, int]:
    return free_port(), free_port(), int(event_port)


def _refused(port: int) -> bool:
    with socket.socket() as sock:
        sock.settimeout(1)
        return sock.connect_ex(("127.0.0.1", port)) != 0


def test_ready_means_the_workers_are_known_after_every_restart(
    log_dir: Path, sim: tuple[Proc, int, str]
) -> None:
    _, sim_port, event_port = sim
    ports = _ports(event_port)
    for attempt in range(3):
        extproc = Extproc(log_dir, ["--startup-grace", "1"], ports=ports, wait_ready=False)
        try:
            health = extproc.admin + "/health"

            def admin_up(url: str = health) -> bool:
                return http("GET", url, timeout=1)[0] == 200

            wait_until(admin_up, 15, "the admin API")
            # The grace: not ready, and the ext_proc port refuses connections (Envoy fails
            # open), for about a second.
            not_ready: list[float] = []
            deadline = time.monotonic() + 15
            while True:
                # Port first, then /ready: a port that accepted while /ready says not yet
                # means it served during the grace.
                refused = _refused(extproc.grpc_port)
                if http("GET", extproc.admin + "/ready", timeout=1)[0] == 200:
                    break
                assert time.monotonic() < deadline, extproc.proc.log()
                not_ready.append(time.monotonic())
                assert refused, "ext_proc served during the grace"
                time.sleep(0.05)
            assert not_ready and not_ready[-1] - not_ready[0] >= 0.7, not_ready
            # Ready: the worker is already known, so the first decision can route.
            workers = extproc.workers()
            assert set(workers) == {"sim-restart"}, f"restart {attempt}: {workers}"
            assert workers["sim-restart"]["endpoint"] == f"127.0.0.1:{sim_port}"
            assert not _refused(extproc.grpc_port)
            assert "1 worker(s) known after the startup grace" in extproc.proc.log()
        finally:
            assert extproc.stop() == 0, extproc.proc.log()


def test_startup_grace_0_serves_at_once(log_dir: Path) -> None:
    extproc = Extproc(log_dir, ["--startup-grace", "0"])
    try:
        assert "before serving ext_proc" not in extproc.proc.log()
        assert not _refused(extproc.grpc_port)
    finally:
        extproc.stop()


def test_a_grpc_port_in_use_is_an_error_at_once(log_dir: Path) -> None:
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = taken.getsockname()[1]
        proc = subprocess.run(
            [PYTHON, "-m", "extproc", "--grpc-port", str(port), "--admin-port", str(free_port()),
             "--event-bind", f"tcp://127.0.0.1:{free_port()}", "--startup-grace", "30"],
            capture_output=True, text=True, timeout=20,
        )  # fmt: skip
    assert proc.returncode == 1, proc.stderr
    assert f"cannot listen for ext_proc gRPC on 127.0.0.1:{port}" in proc.stderr


def test_runtime_changes_survive_a_restart_with_a_state_file(log_dir: Path) -> None:
    """Thresholds set with POST /busy_threshold come back after a restart (--state-file)."""
    state = log_dir / "state.json"
    args = ["--state-file", str(state), "--active-prefill-tokens-threshold", "500"]
    ext = Extproc(log_dir, args)
    pub = Publisher(ext.event_endpoint)
    try:
        pub.announce(ext, "st-w", "m-state", "127.0.0.1:9")
        status, _, body = http(
            "POST",
            ext.admin + "/busy_threshold",
            {"model": "m-state", "active_decode_blocks_threshold": 0.25},
        )
        assert status == 200, body
        assert state.is_file()
    finally:
        pub.close()
        ext.stop()
    ext = Extproc(log_dir, args, ports=ext.ports)
    try:
        entry = get_json(ext.admin + "/busy_threshold")["thresholds"]
        # Listed once the model is served again; the saved values are already in force.
        assert entry == [] or entry[0]["active_decode_blocks_threshold"] == 0.25
        pub = Publisher(ext.event_endpoint)
        pub.announce(ext, "st-w", "m-state", "127.0.0.1:9")
        entry = get_json(ext.admin + "/busy_threshold")["thresholds"]
        assert entry == [
            {
                "model": "m-state",
                "active_decode_blocks_threshold": 0.25,
                "active_prefill_tokens_threshold": 500,
                "active_prefill_tokens_threshold_frac": None,
            }
        ]
        pub.close()
    finally:
        ext.stop()
    state.write_text("{not json")
    bad = subprocess.run(
        [PYTHON, "-m", "extproc", *args], capture_output=True, text=True, timeout=30
    )
    assert bad.returncode == 2, bad.stderr
    assert f"cannot read the state file {state}" in bad.stderr
