"""A storm of rejections: thousands of keep-alive clients while every worker is busy.

Through the real Envoy and extproc (``loadtest/storm.py``). Envoy ends every ext_proc
stream with a RST_STREAM; with thousands of streams on one HTTP/2 connection to the
extproc it queued more than ``max_outbound_control_frames`` (1000) of them at once, reset
the connection, and every stream on it failed open: requests reached busy workers. The
repo's configs cap the streams per connection (``max_concurrent_streams``), so Envoy
spreads them over more connections and none fails.
"""

from __future__ import annotations

import resource
import shutil
from pathlib import Path
from typing import Any

import pytest

from loadtest.storm import FD_PER_CLIENT, FD_SPARE, StormResult, storm

CLIENTS = 4000
SECONDS = 3.0
H2 = "envoy.extensions.upstreams.http.v3.HttpProtocolOptions"

pytestmark = pytest.mark.slow


@pytest.fixture(autouse=True)
def _needs() -> None:
    if not shutil.which("wrk"):
        pytest.skip("wrk not found (Debian: apt-get install wrk)")
    hard = resource.getrlimit(resource.RLIMIT_NOFILE)[1]
    if hard < CLIENTS * FD_PER_CLIENT + FD_SPARE:
        need = CLIENTS * FD_PER_CLIENT + FD_SPARE
        pytest.skip(f"{CLIENTS} clients need ~{need} open files; ulimit -Hn is {hard}")


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


def test_storm_on_one_connection_per_thread_resets_it(tmp_path: Path) -> None:
    """The reproduction: the control-frame flood resets the connection, streams fail open."""
    r = storm(CLIENTS, SECONDS, tmp_path, tweak=_one_connection_per_thread)
    assert r.outbound_flood > 0, _summary(r)
    assert r.streams_failed > 0, _summary(r)
    assert r.reached_worker > 0, _summary(r)
    assert r.protocol_errors_in_log > 0, _summary(r)


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
