"""CURVE end to end: the extproc service and simulated workers as processes, keys in files."""

from __future__ import annotations

from pathlib import Path

from extproc.devstack import Extproc, SimProcess, free_port, metric_value, wait_until
from extproc.events.keys import main as keys_main


def test_only_workers_with_admitted_keys_are_heard(tmp_path: Path) -> None:
    keys, admitted = tmp_path / "keys", tmp_path / "publishers"
    admitted.mkdir()
    for name in ("extproc", "worker", "stranger"):
        assert keys_main([str(keys), name]) == 0
    (admitted / "worker.key").write_bytes((keys / "worker.key").read_bytes())
    ext = Extproc(
        tmp_path,
        [
            "--event-curve-secret-key",
            str(keys / "extproc.key_secret"),
            "--event-curve-publishers",
            str(admitted),
        ],
    )
    common = ["--model", "m", "--host", "127.0.0.1", "--publish", ext.event_endpoint]
    server_key = ["--curve-server-key", str(keys / "extproc.key")]
    sims = [
        SimProcess(
            [*common, "--port", str(free_port()), "--worker-id", "admitted",
             "--curve-secret-key", str(keys / "worker.key_secret"), *server_key],
            log_dir=tmp_path, name="sim-admitted",
        ),
        SimProcess(
            [*common, "--port", str(free_port()), "--worker-id", "stranger",
             "--curve-secret-key", str(keys / "stranger.key_secret"), *server_key],
            log_dir=tmp_path, name="sim-stranger",
        ),
        SimProcess(
            [*common, "--port", str(free_port()), "--worker-id", "plain"],
            log_dir=tmp_path, name="sim-plain",
        ),
    ]  # fmt: skip
    try:
        wait_until(lambda: "admitted" in ext.workers(), 15, "the admitted worker")

        def refused(reason: str) -> float:
            labels = {"reason": reason}
            return metric_value(ext.metrics(), "extproc_events_refused_total", labels) or 0.0

        wait_until(lambda: refused("unknown_key") >= 1, 10, "the stranger refused")
        wait_until(lambda: refused("handshake_failed") >= 1, 10, "the plain publisher refused")
        assert set(ext.workers()) == {"admitted"}
        assert "without CURVE" not in ext.proc.log()
    finally:
        for sim in sims:
            sim.stop()
        ext.stop()
