"""``python -m loadtest.overload`` end to end, shortened: one offered load, thresholds off and on.

The script starts its own stack (Envoy, the extproc, two simulated engines) and writes the
table, the JSON and the plots. At 3x capacity the run must show what the benchmark is for:
with thresholds off nothing is rejected and the engines queue; with them on a large share
gets 529 and the accepted requests start sooner. The latency bar itself (2x the unloaded
p99) is the full benchmark's business: a 4 s cell is too short and CI too noisy for it.
"""

from __future__ import annotations

import importlib.util
import json
import subprocess
from pathlib import Path

import pytest

from extproc.devstack import PYTHON, ROOT

pytestmark = pytest.mark.skipif(
    importlib.util.find_spec("matplotlib") is None,
    reason="matplotlib is not installed: pip install -e '.[loadtest]'",
)


def test_overload_benchmark_sheds_at_three_times_capacity(tmp_path: Path) -> None:
    out = tmp_path / "out"
    cmd = [
        PYTHON, "-m", "loadtest.overload",
        "--loads", "3", "--capacity", "19.5",
        "--cell-seconds", "6", "--warmup", "1", "--grace", "2",
        "--out", str(out),
    ]  # fmt: skip
    run = subprocess.run(cmd, capture_output=True, text=True, timeout=240, cwd=ROOT)
    assert run.returncode == 0, run.stderr[-3000:]

    for name in ("overload-results.md", "overload-results.json",
                 "overload-goodput.png", "overload-latency.png"):  # fmt: skip
        assert (out / name).stat().st_size > 0, name
    res = json.loads((out / "overload-results.json").read_text())
    cells = {c["thresholds"]: c for c in res["cells"]}
    off, on = cells[False], cells[True]
    assert off["load"] == on["load"] == 3.0
    assert off["sent"] == on["sent"] > 50  # the same seeded arrivals both times

    # Off: nothing shed, the engines queue up.
    assert off["rejected"] == 0
    assert off["waiting_max"] >= 20
    # On: most of the excess is shed at once, and what is accepted starts sooner.
    assert on["rejection_rate"] > 0.3
    assert on["accepted"] > 0 and on["errors"] == 0
    assert on["ttft_p99_ms"] < off["ttft_p99_ms"] / 3
    assert on["waiting_max"] < off["waiting_max"]

    table = (out / "overload-results.md").read_text()
    assert "| 3x | off |" in table and "| 3x | on |" in table
    assert "python -m loadtest.overload --loads 3" in table
