"""``python -m loadtest.events_bench``: the ingest run, shortened, against the real extproc
(the publisher, the window and the counts; the rates are the benchmark's business), and the
results file written from plain values."""

from __future__ import annotations

import json
import subprocess
from pathlib import Path
from typing import Any

from extproc.devstack import PYTHON, ROOT
from loadtest import events_bench, resultfile
from tests.loadtest.test_bench import RUN


def test_ingest_run_applies_every_event_it_sent(tmp_path: Path) -> None:
    cmd = [PYTHON, "-m", "loadtest.events_bench", "--ingest-only",
           "--ingest-seconds", "1", "--workers", "8", "--out", str(tmp_path)]  # fmt: skip
    run = subprocess.run(cmd, capture_output=True, text=True, timeout=120, cwd=ROOT)
    assert run.returncode == 0, run.stdout[-2000:] + run.stderr[-3000:]
    data = json.loads((tmp_path / "events-results.json").read_text())
    ing = data["ingest"]
    assert ing["sent"] > 1000 and ing["received"] == ing["sent"], ing
    assert ing["ingested_rate"] > 0 and ing["publisher_rate"] > 0, ing
    assert ing["lost_seq"] == 0 and ing["cpu_us_per_event"] > 0, ing
    assert data["runs"] == [] and data["run"]["command"].endswith(f"--out {tmp_path}")
    report = (tmp_path / "events-results.md").read_text()
    assert events_bench.ingest_row(ing) in report.splitlines()
    assert run.stdout.strip() == report.strip()


def _run(path: str, events: bool, c: int, p50: float, rps: float, ev: float = 0.0,
         cpu: float | None = None) -> dict[str, Any]:  # fmt: skip
    return {"path": path, "events": events, "concurrency": c, "p50": p50, "p99": 2 * p50,
            "rps": rps, "events_rate": ev, "loop_share": 0.3 if events else 0.0,
            "ext_cpu_us": cpu, "total": 100, "non2xx": 0}  # fmt: skip


def results() -> dict[str, Any]:
    runs = []
    for _ in range(3):
        runs += [
            _run("direct", False, 1, 1.0, 900), _run("direct", True, 1, 1.2, 800, 49_000),
            _run("extproc", False, 1, 1.3, 700, 0, 150),
            _run("extproc", True, 1, 1.8, 600, 49_500, 160),
            _run("direct", False, 32, 10, 2000), _run("direct", True, 32, 12, 1800, 48_000),
            _run("extproc", False, 32, 14, 1500, 0, 80),
            _run("extproc", True, 32, 16, 1260, 40_000, 90),
        ]  # fmt: skip
    return {
        "run": RUN,
        "settings": {"rate": 50_000, "workers": 64, "ingest_seconds": 5, "ingest_only": False,
                     "duration": 5, "rounds": 3, "concurrency": [1, 32]},
        "ingest": {"sent": 400_000, "publisher_rate": 80_000.0, "publisher_cpu_share": 0.9,
                   "ingested_rate": 61_234.5, "received": 400_000, "lost_seq": 0,
                   "cpu_us_per_event": 14.04, "extproc_cpu_share": 0.86},
        "runs": runs,
    }  # fmt: skip


def test_goals_with_events_compare_both_paths_under_the_same_events() -> None:
    assert events_bench.goals(results()) == [
        "- ingest: 61,234 load events/s vs ≥ 50,000/s: met",
        "- with 50,000 events/s: added latency at c=1, p50: +0.600 ms vs ≤ +0.5 ms: **missed**",
        "- with 50,000 events/s: added latency at c=1, p99: +1.200 ms vs ≤ +1.5 ms: met",
        "- with 50,000 events/s: accepted req/s at c=32: 0.70x direct vs ≥ 0.8x: **missed**",
        "- with 50,000 events/s at c=1: the extproc took in 49,500 events/s during the "
        "requests (99% of the paced rate): met (≥ 95 %)",
        "- with 50,000 events/s at c=32: the extproc took in 40,000 events/s during the "
        "requests (80% of the paced rate): **missed** (≥ 95 %)",
    ]


def test_report_is_written_from_the_json(tmp_path: Path) -> None:
    data = results()
    report = resultfile.write(tmp_path, "events", data, events_bench.render)
    lines = report.splitlines()
    assert (
        "| 80,000 | **61,234** | 14.0 µs | 86% of a core | 90% of a core | 400,000 / 400,000 | 0 |"
        in lines
    )
    assert "| 1 | direct | 0 | 0% | 1.000 | 2.000 | 900 | — |" in lines
    assert "| 1 | extproc + events | 49,500 | 30% | 1.800 | 3.600 | 600 | 160 |" in lines
    assert "| 32 | extproc: events added / ratio | | | +2.000 | +4.000 | 0.84x | |" in lines
    assert "python -m loadtest.bench --duration 3" in lines  # the run's command, as given
    assert all(g in lines for g in events_bench.goals(data))
    assert report == events_bench.render(json.loads((tmp_path / "events-results.json").read_text()))
