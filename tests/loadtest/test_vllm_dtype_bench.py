"""``python -m loadtest.vllm_dtype``: its report from plain measurements (the engines it
starts are the real vLLM's of ``tests/integration/test_vllm.py``), and its bad flags."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from loadtest import resultfile
from loadtest.vllm_dtype import NAME, main, render

RUN = {
    "command": "python -m loadtest.vllm_dtype",
    "code": "abc1234",
    "started_utc": "2026-12-06 10:00:00",
    "finished_utc": "2026-12-06 10:04:00",
    "seconds": 240.0,
    "loadavg_before": "0.5 0.5 0.5 1/100 1",
    "loadavg_after": "1.5 1.0 0.7 1/100 2",
    "machine": {"cpus": 2, "cpu_model": "AMD EPYC", "kernel": "6.1", "python": "3.11.7",
                "envoy": "1.36.2"},
}  # fmt: skip


def test_the_report_gives_each_dtypes_medians_and_the_choice(tmp_path: Path) -> None:
    data = {
        "run": RUN,
        "vllm": "0.32.0",
        "avx512": [],
        "chosen": "float32",
        "dtypes": [
            {"dtype": "bfloat16", "single_ttft_s": [2.1, 2.4, 2.2],
             "single_total_s": [5.0, 5.6, 5.2], "at_once_ttft_s": [2.5, 9.8, 9.8, 9.9],
             "at_once_wall_s": 22.7},
            {"dtype": "float32", "single_ttft_s": [0.46, 0.57, 0.5],
             "single_total_s": [4.7, 4.5, 4.6], "at_once_ttft_s": [1.6, 1.6, 1.7, 1.7],
             "at_once_wall_s": 11.7},
        ],
    }  # fmt: skip
    report = resultfile.write(tmp_path, NAME, data, render)
    assert json.loads((tmp_path / f"{NAME}-results.json").read_text())["chosen"] == "float32"
    assert (tmp_path / f"{NAME}-results.md").read_text() == report
    rows = [line for line in report.splitlines() if line.startswith("| ")]
    assert rows[1] == "| bfloat16 | 2,200 | 5,200 | 9,800 | 22,700 |", rows
    assert rows[2] == "| float32 | 500 | 4,600 | 1,650 | 11,700 |", rows
    assert "AVX-512 flags: none; `compute_dtype()` here: `float32`" in report
    assert "- float32: TTFT one at a time, each ms: 460, 570, 500" in report


@pytest.mark.parametrize("argv", [["--singles", "0"], ["--dtypes", ","]])
def test_bad_flags_are_refused_naming_them(
    argv: list[str], capsys: pytest.CaptureFixture[str]
) -> None:
    with pytest.raises(SystemExit) as exc:
        main(argv)
    assert exc.value.code == 2
    err = capsys.readouterr().err
    assert "--dtypes" in err and "--singles" in err and "expected" in err, err
