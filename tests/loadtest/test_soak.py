"""``python -m loadtest.soak`` for 60 s: nothing left behind after a mixed load.

The script starts its own stack (Envoy, the extproc, two simulated engines and a spare
port that workers join and leave on). After the run every router estimate is 0, the
extproc's RSS and open fds are within 10 % (plus a small absolute slack for a run this
short) of the warm-up sample, the decisions add up to the requests, and every kind of
load actually happened: accepted, rejected, streamed, abandoned mid-stream, thresholds
changed, a worker leaving with a bye and one expiring after its TTL.
"""

from __future__ import annotations

import json
import subprocess
from pathlib import Path

from extproc.devstack import PYTHON, ROOT

SECONDS = 60


def test_soak_60_seconds_leaves_nothing_behind(tmp_path: Path) -> None:
    out = tmp_path / "soak.json"
    cmd = [
        PYTHON, "-m", "loadtest.soak", "--seconds", str(SECONDS), "--clients", "6",
        "--json", str(out), "--logs", str(tmp_path / "logs"),
    ]  # fmt: skip
    run = subprocess.run(cmd, capture_output=True, text=True, timeout=SECONDS + 90, cwd=ROOT)
    assert out.exists(), run.stdout[-3000:] + run.stderr[-3000:]
    res = json.loads(out.read_text())
    report = run.stdout[-4000:]

    # The end conditions, each on its own so that a failure names it.
    assert res["estimates_nonzero_at_end"] == {}, report
    assert res["ranks_checked"] == 2, report
    assert res["end"]["rss_kib"] <= res["rss_limit_kib"], report
    assert res["end"]["fds"] <= res["fd_limit"], report
    assert res["rss_limit_kib"] <= res["warmup"]["rss_kib"] * 1.1 + 4096 + 1, report
    assert res["unexpected_errors"] == [], report
    assert res["overdue"] == 0, report
    assert res["workers_at_end"] == ["sim-1", "sim-2"], report
    assert all(res["checks"].values()), res["checks"]
    assert run.returncode == 0, report + run.stderr[-3000:]

    # The load was mixed: every kind of request and outcome occurred.
    outcomes = res["outcomes"]
    assert outcomes.get("chat 200", 0) > 50, outcomes
    assert outcomes.get("stream 200 stream", 0) > 20, outcomes
    assert outcomes.get("abandon abandoned", 0) > 20, outcomes
    rejected = sum(v for k, v in outcomes.items() if k.endswith(" 529"))
    assert rejected > 50, outcomes
    assert sum(res["decisions"].values()) == res["requests"], res["decisions"]
    # 529s: the overloaded decisions, and Envoy's 503s for a killed worker turned into it.
    assert res["decisions"].get("overloaded", 0) + res["worker_unreachable"] == rejected
    assert set(res["threshold_phases"]) == {"off", "decode 0.05", "prefill 400", "all busy"}
    events = " ".join(res["worker_events"])
    assert "said bye" in events and "expired after the TTL" in events, events
    assert res["warmup"]["at"] >= SECONDS * 0.15 - 0.5
