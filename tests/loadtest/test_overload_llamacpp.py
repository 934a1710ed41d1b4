"""``python -m loadtest.overload --engine llamacpp`` end to end, on a tiny configuration.

The script starts its own stack (Envoy, the extproc, two llama.cpp ``llama-server`` serving
SmolLM2-135M, each with its agent) and writes its files under names of their own. At 3x a
capacity the two engines cannot serve, the run must show the collapse with thresholds off
(nothing shed, requests wait for a slot) and the shedding with them on (a share gets 529,
the accepted ones start sooner). The goals themselves (TTFT p99 against the unloaded one,
SLO goodput against capacity) are the full run's business: a 6 s cell on a shared CI
machine is too short for them. Without the engine installed the module fails under CI and
skips elsewhere, saying why.
"""

from __future__ import annotations

import importlib.util
import json
import subprocess
import time
from typing import Any

import pytest

from extproc.devstack import PYTHON, ROOT
from tests.support.engine import require_engine

require_engine(
    None
    if importlib.util.find_spec("matplotlib") is not None
    else "matplotlib is not installed: pip install -e '.[loadtest]'"
)

NAME = "overload-llamacpp"


@pytest.fixture(scope="module")
def run(tmp_path_factory: pytest.TempPathFactory) -> tuple[dict[str, Any], str, float]:
    """One tiny run: its JSON, its markdown and its wall time."""
    out = tmp_path_factory.mktemp("overload-llamacpp") / "out"
    # 2 req/s is about what the two engines serve here; 3x that is an overload on any
    # 2-core machine.
    cmd = [
        PYTHON, "-m", "loadtest.overload", "--engine", "llamacpp",
        "--loads", "3", "--capacity", "2", "--unloaded-probes", "3",
        "--cell-seconds", "6", "--warmup", "1", "--grace", "2", "--recovery-loads", "",
        "--out", str(out),
    ]  # fmt: skip
    started = time.monotonic()
    done = subprocess.run(cmd, capture_output=True, text=True, timeout=240, cwd=ROOT)
    wall = time.monotonic() - started
    assert done.returncode == 0, done.stderr[-3000:]
    for suffix in ("results.md", "results.json", "goodput.png", "latency.png"):
        assert (out / f"{NAME}-{suffix}").stat().st_size > 0, suffix
    assert not list(out.glob("overload-results.*")), "the simulated run's files were written"
    res = json.loads((out / f"{NAME}-results.json").read_text())
    return res, (out / f"{NAME}-results.md").read_text(), wall


def test_llamacpp_overload_collapses_off_and_sheds_on(
    run: tuple[dict[str, Any], str, float],
) -> None:
    res, table, wall = run
    assert res["config"]["engine"] == "llamacpp"
    assert res["unloaded_ttft_p99_ms"] > 0
    cells = {c["thresholds"]: c for c in res["cells"]}
    off, on = cells[False], cells[True]
    assert off["sent"] == on["sent"] > 10  # the same seeded arrivals both times

    # Off: nothing shed; more requests than the 4 slots, so they wait for one, and some
    # have no answer yet (not even headers) when the cell is cut.
    assert off["rejected"] == 0
    assert off["waiting_max"] >= 3
    # On: a share is shed at once, nothing fails, and the accepted ones start sooner.
    assert on["rejected"] > 0 and on["errors"] == 0
    assert on["accepted"] > 0
    assert on["ttft_p99_ms"] < off["ttft_p99_ms"]
    assert on["waiting_max"] < off["waiting_max"]

    assert "| 3x | off |" in table and "| 3x | on |" in table
    assert "llama-server" in table and "`active_prefill_tokens_threshold` 16" in table
    assert "Targets at 3x with thresholds on" in table
    assert f"({NAME}-goodput.png)" in table
    print(f"tiny llama.cpp overload run: {wall:.0f} s")
