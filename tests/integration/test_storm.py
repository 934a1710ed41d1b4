"""A storm of rejections: thousands of keep-alive clients while every worker is busy.

Through the real Envoy and extproc (``loadtest/storm.py``). Envoy ends every ext_proc
stream with a RST_STREAM; with thousands of streams on one HTTP/2 connection to the
extproc it queued more than ``max_outbound_control_frames`` (1000) of them at once, reset
the connection, and every stream on it failed open: requests reached busy workers. The
repo's configs cap the streams per connection (``max_concurrent_streams``), so Envoy
spreads them over more connections and none fails.
"""

from __future__ import annotations

import os
import resource
import shutil
import subprocess
import time
from pathlib import Path
from typing import Any

import pytest

from extproc.devstack import PYTHON, ROOT
from loadtest.storm import FD_PER_CLIENT, FD_SPARE, StormResult, storm

CLIENTS = 4000
SECONDS = 3.0
H2 = "envoy.extensions.upstreams.http.v3.HttpProtocolOptions"

# A storm needs the machine to itself (it skips when the load average says otherwise):
# `make test` runs it alone, before the tests it runs in parallel.
pytestmark = [pytest.mark.slow, pytest.mark.serial]


LOAD_SETTLE_SECONDS = 60.0


@pytest.fixture
def storm_machine() -> None:
    """wrk, enough open files, and a machine not already saturated by other work."""
    if not shutil.which("wrk"):
        pytest.skip("wrk not found (Debian: apt-get install wrk)")
    hard = resource.getrlimit(resource.RLIMIT_NOFILE)[1]
    if hard < CLIENTS * FD_PER_CLIENT + FD_SPARE:
        need = CLIENTS * FD_PER_CLIENT + FD_SPARE
        pytest.skip(f"{CLIENTS} clients need ~{need} open files; ulimit -Hn is {hard}")
    # A storm measures Envoy and the extproc at full speed: with the run queue already
    # twice the cores, Envoy cannot send the burst that floods, nor answer in time.
    # Work that just ended (an install, the previous module) leaves the 1-minute average
    # high for a while: give it up to a minute to settle before judging the machine.
    cores = os.cpu_count() or 1
    deadline = time.monotonic() + LOAD_SETTLE_SECONDS
    while (load := os.getloadavg()[0]) > 2 * cores and time.monotonic() < deadline:
        time.sleep(1.0)
    if load > 2 * cores:
        pytest.skip(f"load average {load:.1f} on {cores} cores: other work saturates the machine")


def _one_connection_per_thread(cfg: dict[str, Any]) -> None:
    """The earlier config: one connection per Envoy thread carries every ext_proc stream."""
    for cluster in cfg["static_resources"]["clusters"]:
        if cluster["name"] == "extproc":
            opts = cluster["typed_extension_protocol_options"][H2]
            opts["explicit_http_config"]["http2_protocol_options"]["max_concurrent_streams"] = (
                100000
            )


def _summary(r: StormResult) -> str:
    return (
        f"{r.requests} requests, {r.rejections_per_s:.0f} rejections/s, p99 {r.p99_ms:.0f} ms, "
        f"{r.streams_failed} streams failed, {r.failure_mode_allowed} failed open, "
        f"{r.message_timeouts} timeouts, {r.reached_worker} reached the worker, "
        f"{r.extproc_connections} extproc connections, {r.protocol_errors_in_log} "
        f"protocol_error lines"
    )


@pytest.mark.usefixtures("storm_machine")
def test_storm_on_one_connection_per_thread_resets_it(tmp_path: Path) -> None:
    """The reproduction: the control-frame flood resets the connection, streams fail open."""
    r = storm(CLIENTS, SECONDS, tmp_path, tweak=_one_connection_per_thread)
    assert r.outbound_flood > 0, _summary(r)
    assert r.streams_failed > 0, _summary(r)
    # Streams failed open: past the shedder. How many of those requests then reach a worker
    # varies from run to run (one run on a slower machine: 313 failed open, none reached it).
    assert r.failure_mode_allowed > 0, _summary(r)
    assert r.protocol_errors_in_log > 0, _summary(r)


@pytest.mark.usefixtures("storm_machine")
def test_storm_with_the_repo_config_rejects_every_request(tmp_path: Path) -> None:
    r = storm(CLIENTS, SECONDS, tmp_path)
    assert r.requests > 0, _summary(r)
    assert r.outbound_flood == 0, _summary(r)
    assert r.streams_failed == 0, _summary(r)
    assert r.protocol_errors_in_log == 0, _summary(r)
    assert r.extproc_connections > 2, _summary(r)
    # On a quiet machine nothing reaches a worker (docs/transport.md). On a machine other
    # work keeps busy, some ext_proc messages may exceed the 1 s message_timeout and fail
    # open; only those may reach a worker.
    assert r.reached_worker <= r.message_timeouts, _summary(r)
    assert r.non_529 <= r.message_timeouts, _summary(r)


def test_bad_arguments_are_refused_with_the_field_and_value() -> None:
    def run(*args: str) -> subprocess.CompletedProcess[str]:
        return subprocess.run(
            [PYTHON, "-m", "loadtest.storm", *args],
            capture_output=True, text=True, timeout=60, cwd=ROOT,
        )  # fmt: skip

    bad = run("--clients", "0")
    assert bad.returncode == 2
    assert "--clients: 0 is not a positive number of connections" in bad.stderr
    hard = resource.getrlimit(resource.RLIMIT_NOFILE)[1]
    too_many = hard // FD_PER_CLIENT + 1
    refused = run("--clients", str(too_many), "--duration", "1")
    assert refused.returncode == 2
    assert f"--clients {too_many} needs about" in refused.stderr
    assert f"the hard limit (ulimit -Hn) is {hard}" in refused.stderr
