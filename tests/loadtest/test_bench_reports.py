"""The results files of the storm, stream and replicas benchmarks, written from plain values:
the Markdown is generated from the JSON alone and carries the run's command, time, load and
machine, and the storm's goal fails on anything that reached the worker or went unanswered."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest

from loadtest import replicas, resultfile, storm, stream_bench
from tests.loadtest.test_bench import RUN


def _written(tmp_path: Path, name: str, data: dict[str, Any], render: Any) -> list[str]:
    report = resultfile.write(tmp_path, name, data, render)
    back = json.loads((tmp_path / f"{name}-results.json").read_text())
    assert (tmp_path / f"{name}-results.md").read_text() == report == render(back)
    lines = report.splitlines()
    assert RUN["command"] in lines
    assert any(f"`{RUN['loadavg_before']}`" in ln and f"`{RUN['loadavg_after']}`" in ln
               for ln in lines)  # fmt: skip
    return lines


def storm_result(**changes: Any) -> dict[str, Any]:
    r = {"clients": 4000, "duration": 8.0, "requests": 60000, "rejections_per_s": 7500.0,
         "p50_ms": 120.04, "p99_ms": 900.0, "non_529": 0, "socket_errors": "none",
         "streams_failed": 0, "failure_mode_allowed": 0, "message_timeouts": 0,
         "reached_worker": 0, "extproc_connections": 41, "outbound_flood": 0,
         "protocol_errors_in_log": 0, "extproc_cpu_us_per_request": 38.5}  # fmt: skip
    return {**r, **changes}


def test_storm_report_and_a_held_goal(tmp_path: Path) -> None:
    data = {"run": RUN, "results": [storm_result()],
            "settings": {"duration": 8.0, "threads": 2, "config": "envoy.yaml",
                         "grpc_server": "builtin", "clients": [4000], "nofile": 20000}}  # fmt: skip
    lines = _written(tmp_path, "storm", data, storm.render)
    assert storm.HEADER in lines
    assert (
        "| 4000 | 60000 | 7500 | 120.0 | 900.0 | 0 | 0 | 0 | 0 | 0 | 41 | 0 | 0 | 38.5 | none |"
        in lines
    )
    assert ("- 4,000 clients: none reached the worker, no ext_proc stream failed, timed out or "
            "failed open, every request answered 529 (60,000): met") in lines  # fmt: skip


@pytest.mark.parametrize(
    ("changes", "says"),
    [
        ({"reached_worker": 75, "message_timeouts": 75},
         "reached the worker 75; message timeouts 75"),
        ({"streams_failed": 3, "failure_mode_allowed": 3},
         "ext_proc streams failed 3; failed open 3"),
        ({"socket_errors": "connect 0, read 0, write 0, timeout 12"},
         "socket errors 12 (connect 0, read 0, write 0, timeout 12)"),
        ({"non_529": 4}, "answers other than 529 4"),
        ({"requests": 0}, "no request answered"),
    ],
)  # fmt: skip
def test_storm_goal_is_missed_on_any_leak_or_unanswered_client(
    changes: dict[str, Any], says: str
) -> None:
    assert storm.goal(storm_result(**changes)) == f"- 4,000 clients: {says}: **missed**"


def test_stream_report(tmp_path: Path) -> None:
    designs = {
        "none": stream_bench.summary([5.0, 5.1, 5.2, 9.0], 0.0016, 1600),
        "blocking": stream_bench.summary([5.3, 5.4, 5.5, 12.0], 0.16, 1600),
        "observe": stream_bench.summary([5.1, 5.2, 5.3, 10.0], 0.08, 1600),
    }
    data = {"run": RUN, "designs": designs,
            "settings": {"streams": 8, "tokens": 200, "interval_ms": 5, "rounds": 1}}  # fmt: skip
    lines = _written(tmp_path, "stream", data, stream_bench.render)
    assert "| none | 5.20 | 9.00 | +0.00 | +0.00 | 1 |" in lines
    assert "| blocking | 5.50 | 12.00 | +0.30 | +3.00 | 100 |" in lines
    assert "| observe | 5.30 | 10.00 | +0.10 | +1.00 | 50 |" in lines


def test_replicas_report(tmp_path: Path) -> None:
    data = {
        "run": RUN,
        "settings": {"burst": 48, "workers": 3, "hold": 2.0, "rounds": 2, "prompt_tokens": 300,
                     "threshold": 1000, "capacity": 4},
        "cases": {"one": [{"w0": 4, "w1": 4, "w2": 4}, {"w0": 4, "w1": 4, "w2": 4}],
                  "two, not sharing": [{"w0": 8, "w1": 8, "w2": 8}, {"w0": 8, "w1": 7, "w2": 8}],
                  "two, sharing": [{"w0": 5, "w1": 4, "w2": 5}, {"w0": 4, "w2": 6}]},
        "propagation_s": [0.0012, 0.0016, 0.0230],
        "estimates_idle_per_s": 1.04,
        "estimates_burst_per_s": 6.2,
    }  # fmt: skip
    lines = _written(tmp_path, "replicas", data, replicas.render)
    assert "| one | 4,4,4; 4,4,4 | 12, 12 | 4 | +0 |" in lines
    assert "| two, not sharing | 8,8,8; 8,7,8 | 24, 23 | 8 | +4 |" in lines
    assert "| two, sharing | 5,4,5; 4,0,6 | 14, 10 | 6 | +2 |" in lines
    assert ("- threshold POST on one replica seen on the other: median 1.6 ms, max 23.0 ms "
            "(3 POSTs; the other replica is read right after the POST returns, then every "
            "20 ms)") in lines  # fmt: skip
    assert any(
        ln.startswith("- estimate messages a replica sends: 1.0/s idle, 6.2/s") for ln in lines
    )


def test_run_records_the_command_the_load_and_the_machine() -> None:
    run = resultfile.Run("python -m loadtest.storm --clients 10").finish()
    assert run["command"] == "python -m loadtest.storm --clients 10"
    for key in ("loadavg_before", "loadavg_after"):
        assert len(run[key].split()) == 5, run[key]
    assert run["machine"]["cpus"] >= 1 and run["machine"]["envoy"].count(".") == 2
    assert run["started_utc"] <= run["finished_utc"] and run["seconds"] >= 0
    assert run["code"] != "unknown" and run["code"].split()[0].isalnum(), run["code"]
    assert f"Code at commit `{run['code']}`." in resultfile.header("t", run)
