"""loadtest.bench: prompt sizes are parsed strictly, bodies have the size asked for, and the
results file holds every run, the goals and their verdicts."""

from __future__ import annotations

import argparse
import json
from pathlib import Path
from typing import Any

import pytest

from loadtest import bench, resultfile


@pytest.mark.parametrize(
    ("text", "size"), [("short", None), ("1k", 1024), ("64K", 65536), ("2m", 2 << 20), ("700", 700)]
)
def test_prompt_size_parses(text: str, size: int | None) -> None:
    assert bench.prompt_size(text) == size


@pytest.mark.parametrize("text", ["0", "1g", "-1k", "k", "big"])
def test_prompt_size_rejects_with_the_value_and_what_was_expected(text: str) -> None:
    with pytest.raises(argparse.ArgumentTypeError, match=f"'{text}'.*1k, 64k, 512k"):
        bench.prompt_size(text)


@pytest.mark.parametrize("size", [1024, 65536, 524288])
def test_chat_body_has_the_size_asked_for_and_model_first(size: int) -> None:
    text = json.dumps(bench.chat_body("m", size))
    assert len(text) == size
    assert text.startswith('{"model": "m"')
    assert bench.size_label(size) == f"{size // 1024}k"


def test_short_body_is_the_fixed_prompt() -> None:
    assert bench.chat_body("busy", None) == {**bench.BODY, "model": "busy"}


# --- the results file, from plain values --------------------------------------------------

RUN = {
    "command": "python -m loadtest.bench --duration 3",
    "started_utc": "2026-12-05 09:50:00",
    "finished_utc": "2026-12-05 09:55:30",
    "seconds": 330.0,
    "loadavg_before": "1.50 2.00 3.00 2/150 100",
    "loadavg_after": "2.50 2.10 3.00 3/160 200",
    "machine": {"cpus": 2, "cpu_model": "Test CPU", "kernel": "6.1", "python": "3.12.1",
                "envoy": "1.40.0"},
}  # fmt: skip


def _run(prompt: str, case: str, c: int, path: str, p50: float, p99: float, rps: float,
         cpu0: float = 100.0, cpu1: float | None = None) -> dict[str, Any]:  # fmt: skip
    return {"prompt": prompt, "case": case, "concurrency": c, "path": path, "p50": p50,
            "p99": p99, "rps": rps, "cpu0": cpu0, "cpu1": cpu1, "share0": 0.5,
            "share1": None if cpu1 is None else 0.25, "total": 1000, "non2xx": 0}  # fmt: skip


def results(short_busy_rps: float = 5000.0) -> dict[str, Any]:
    runs = []
    # Three rounds; the medians are the middle values: direct c=1 p50 1.0, extproc 1.4 ...
    for p50d, p50e in ((1.0, 1.4), (0.9, 1.3), (5.0, 9.0)):
        runs.append(_run("short", "ok", 1, "direct", p50d, 2.0, 900))
        runs.append(_run("short", "ok", 1, "extproc", p50e, 3.0, 700, 150, 80))
    for rps_d, rps_e in ((2000, 1700), (2100, 1500), (1900, 1600)):
        runs.append(_run("short", "ok", 32, "direct", 10, 20, rps_d))
        runs.append(_run("short", "ok", 32, "extproc", 12, 30, rps_e, 180, 60))
        runs.append(_run("short", "all", 32, "extproc", 3, 9, short_busy_rps, 90, 40))
        runs.append(_run("64k", "ok", 1, "direct", 1.0, 2.0, 800))
        runs.append(_run("64k", "ok", 1, "extproc", 2.2, 3.0, 600, 150, 80))
    return {
        "run": RUN,
        "settings": {"duration": 3, "rounds": 3, "concurrency": [1, 32],
                     "prompt_sizes": ["short", "64k"], "busy_cases": ["all"],
                     "response_phase": None, "config": "envoy.yaml",
                     "grpc_servers": ["builtin"], "request_paths": ["prefix"],
                     "extproc_args": []},
        "paths": ["direct", "extproc"],
        "runs": runs,
        "profiles": [{"prompt": "short", "case": "all", "path": "extproc",
                      "run": {"rps": 4800.0, "p50": 3.1}, "envoy_core_share": 0.9,
                      "extproc_core_share": 0.4, "perf": False,
                      "extproc_self": [[12.5, "data_received (h2/connection.py:10)"]]}],
        "decisions": {"extproc": {"routed": 12000, "overloaded": 30000}},
    }  # fmt: skip


def test_goals_are_judged_on_the_medians_of_the_rounds() -> None:
    assert bench.goals(results()) == [
        "- short: added latency at c=1, p50: +0.400 ms vs ≤ +0.5 ms: met",
        "- short: added latency at c=1, p99: +1.000 ms vs ≤ +1.5 ms: met",
        "- short: accepted req/s at c=32: 0.80x direct vs ≥ 0.8x: met",
        "- short: rejections/s with every worker busy at c=32: 2.50x direct's accepted "
        "req/s vs ≥ 2x: met",
        # 64 KB: within 2x of the goals (1.2 ms added p50 against 1 ms: missed).
        "- 64k: added latency at c=1, p50: +1.200 ms vs ≤ +1 ms: **missed**",
        "- 64k: added latency at c=1, p99: +1.000 ms vs ≤ +3 ms: met",
    ]


def test_a_missed_rejection_goal_says_so() -> None:
    line = [g for g in bench.goals(results(short_busy_rps=3000)) if "rejections" in g]
    assert line == ["- short: rejections/s with every worker busy at c=32: 1.50x direct's "
                    "accepted req/s vs ≥ 2x: **missed**"]  # fmt: skip


def test_report_is_written_from_the_json_and_holds_the_run(tmp_path: Path) -> None:
    data = results()
    report = resultfile.write(tmp_path, "bench", data, bench.render)
    back = json.loads((tmp_path / "bench-results.json").read_text())
    assert back["runs"] == data["runs"] and back["run"] == RUN
    assert (tmp_path / "bench-results.md").read_text() == report == bench.render(back)
    lines = report.splitlines()
    assert "python -m loadtest.bench --duration 3" in lines
    assert any("`1.50 2.00 3.00 2/150 100`" in ln and "`2.50 2.10 3.00 3/160 200`" in ln
               and "2 CPUs (Test CPU)" in ln and "Envoy 1.40.0" in ln for ln in lines)  # fmt: skip
    assert bench.TABLE_HEAD in lines
    assert "| short | 1 | direct | 1.000 | 2.000 | 900 | 100 | — | 50% | — |" in lines
    assert "| short | 1 | extproc | 1.400 | 3.000 | 700 | 150 | 80 | 50% | 25% |" in lines
    assert "| short | 1 | extproc: added / ratio | +0.400 | +1.000 | 0.78x | 1.50x | | | |" in lines
    assert ("| short | 32 | extproc, every worker busy (529) | 3.000 | 9.000 "
            "| 5000 (2.50x direct) | 90 | 40 | 50% | 25% |") in lines  # fmt: skip
    assert "- extproc: routed 12,000, overloaded 30,000" in lines
    assert "| 12.5 % | `data_received (h2/connection.py:10)` |" in lines
    assert all(g in lines for g in bench.goals(data))


def test_nan_is_written_as_null_and_the_json_stays_strict(tmp_path: Path) -> None:
    resultfile.write(tmp_path, "x", {"a": float("nan"), "b": [1.5, float("inf")]}, str)
    assert json.loads((tmp_path / "x-results.json").read_text()) == {"a": None, "b": [1.5, None]}


def test_self_time_ranks_py_spy_leaves() -> None:
    collapsed = ["main;loop;read 30", "main;loop;decide 10", "main;other;read 10", "junk"]
    assert bench.self_time(collapsed) == [[80.0, "read"], [20.0, "decide"]]
