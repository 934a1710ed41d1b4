"""The state file keeps latency targets with the thresholds, and only while they are set."""

from __future__ import annotations

import json
from pathlib import Path

from extproc.admin.state import RuntimeState
from extproc.core.busy import BusyThresholds
from extproc.core.pool import WorkerPool


def test_a_target_survives_a_restart_and_its_absence_too(tmp_path: Path) -> None:
    path = tmp_path / "state.json"
    pool = WorkerPool(BusyThresholds(None, 500))
    state = RuntimeState(path, pool, None)
    state.watch()
    pool.set_thresholds("m", BusyThresholds(None, 500, None, 300.0))
    pool.set_thresholds("n", BusyThresholds(0.5, 500))
    saved = json.loads(path.read_text())["thresholds"]
    assert saved["m"]["ttft_p99_target_ms"] == 300.0 and "itl_p99_target_ms" not in saved["m"]
    assert "ttft_p99_target_ms" not in saved["n"]

    again = WorkerPool(BusyThresholds(None, 500, None, 999.0))  # a target from the flags
    assert RuntimeState(path, again, None).load() == 2
    assert again.thresholds_for("m") == BusyThresholds(None, 500, None, 300.0)
    assert again.thresholds_for("n") == BusyThresholds(0.5, 500)  # turned off at runtime
