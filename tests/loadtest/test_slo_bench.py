"""``python -m loadtest.slo`` end to end, shortened: four short phases, one worker slowed
down in the second, thresholds off, the shipped thresholds and the target mode.

The script starts its own stack (Envoy with an access log, the extproc, two simulated
engines). The run must have what the benchmark is for: every phase in every mode from the
same seeded arrivals, the slowdown at its time and visible in the slowed worker's answers,
a series per 5-s window counted from real responses (Envoy's access log, an independent
witness, agrees with the clients' TTFT), the limit read from the extproc only where a
target is set. Whether the goals are met is the full benchmark's business: phases of a few
seconds are too short and CI too noisy for it.
"""

from __future__ import annotations

import importlib.util
import json
import math
import subprocess
from typing import Any

import pytest

from extproc.devstack import PYTHON, ROOT
from loadtest.shedbench.client import Outcome
from loadtest.shedbench.ttft_sources import histogram_quantile
from loadtest.shedbench.windows import NOT_LEFT, recovery

needs_matplotlib = pytest.mark.skipif(
    importlib.util.find_spec("matplotlib") is None,
    reason="matplotlib is not installed: pip install -e '.[loadtest]'",
)

PHASES = [(1.0, 5.0), (3.0, 10.0), (10.0, 5.0), (1.0, 5.0)]
# Three modes of 25 s each, their drains, the unloaded probes: about 2-3 minutes.
long_run = pytest.mark.timeout(420)


@pytest.fixture(scope="module")
def run(tmp_path_factory: pytest.TempPathFactory) -> tuple[dict[str, Any], str]:
    """One shortened run: its JSON and its markdown."""
    out = tmp_path_factory.mktemp("slo") / "out"
    cmd = [
        PYTHON, "-m", "loadtest.slo",
        "--phases", ",".join(f"{load:g}:{s:g}" for load, s in PHASES),
        "--slow-at", "2", "--slow-for", "6", "--slow-factor", "3",
        "--capacity", "10", "--sweep", "", "--grace", "2",
        "--out", str(out),
    ]  # fmt: skip
    done = subprocess.run(cmd, capture_output=True, text=True, timeout=400, cwd=ROOT)
    assert done.returncode == 0, done.stderr[-3000:]
    for name in ("slo-results.md", "slo-results.json",
                 "slo-off.png", "slo-shipped.png", "slo-target.png",
                 "slo-target-alone.png"):  # fmt: skip
        assert (out / name).stat().st_size > 0, name
    return json.loads((out / "slo-results.json").read_text()), (out / "slo-results.md").read_text()


@needs_matplotlib
@long_run
def test_every_mode_runs_every_phase_from_the_same_arrivals(
    run: tuple[dict[str, Any], str],
) -> None:
    res, md = run
    modes = {m["mode"]["name"]: m for m in res["modes"]}
    assert list(modes) == ["off", "shipped", "target", "target alone"]
    assert modes["target"]["mode"]["target_ms"] == res["target_ms"] > 0
    # The target beside the shipped thresholds (its ceiling), and the target alone.
    target, alone = modes["target"]["mode"], modes["target alone"]["mode"]
    assert (target["decode"], target["prefill_frac"]) == (0.9, 0.4)
    assert (alone["decode"], alone["prefill_frac"]) == (None, None)
    assert alone["target_ms"] == res["target_ms"]
    assert (modes["shipped"]["mode"]["decode"], modes["shipped"]["mode"]["prefill_frac"]) == (
        0.9,
        0.4,
    )
    assert res["best_fixed"] == "shipped"  # the only fixed thresholds of this run
    counts = {name: [p["requests"] for p in m["phases"]] for name, m in modes.items()}
    assert counts["off"] == counts["shipped"] == counts["target"] == counts["target alone"]
    for (load, seconds), requests in zip(PHASES, counts["off"], strict=True):
        # Poisson at load x 10 req/s: well within 50 % of the mean, seeded.
        assert 0.5 * load * 10 * seconds < requests < 1.5 * load * 10 * seconds
    for m in modes.values():
        assert [p["load"] for p in m["phases"]] == [load for load, _ in PHASES]
        assert m["errors"] == 0
    off, shipped = modes["off"]["phases"], modes["shipped"]["phases"]
    assert all(p["rejected_attempts"] == 0 for p in off)  # nothing shed without thresholds
    assert shipped[2]["rejected_attempts"] > shipped[2]["requests"]  # 10x: shed and retried
    assert "phase 3 (10x): SLO goodput" in md and "## Holding a latency target" in md


@needs_matplotlib
@long_run
def test_the_slowdown_happens_in_the_second_phase_and_slows_that_worker(
    run: tuple[dict[str, Any], str],
) -> None:
    res, _ = run
    start = PHASES[0][1] + 2  # 2 s into the second phase
    for m in res["modes"]:
        began, ended = m["slowed"]
        assert start - 0.1 <= began < start + 1.0
        assert 6 - 0.1 <= ended - began < 6 + 1.0
    # The shipped thresholds keep the queue short, so the engine's pace shows: the slowed
    # worker answers its first token later than before (at 1x, 3x the step time).
    shipped = next(m for m in res["modes"] if m["mode"]["name"] == "shipped")
    before, during = shipped["slow_worker_ttft_p50_ms"]
    assert during > 1.5 * before, (before, during)


@needs_matplotlib
@long_run
def test_the_series_per_window_comes_from_real_responses(
    run: tuple[dict[str, Any], str],
) -> None:
    res, md = run
    for m in res["modes"]:
        windows = m["windows"]
        assert [w["start"] for w in windows] == [0, 5, 10, 15, 20, 25][: len(windows)]
        assert len(windows) == 5  # the phases' 25 s in 5-s windows
        assert [w["phase"] for w in windows] == [0, 1, 1, 2, 3]
        assert not any(w["judged"] for w in windows)  # no phase outlasts its 10 s to settle
        assert all(w["admitted_rps"] > 0 for w in windows)
        assert all(not math.isnan(w["ttft_p99_ms"]) for w in windows)
        target = m["mode"]["target_ms"] is not None
        # The limit is read from /debug/workers only where a target is set.
        assert all(bool(w["limit"]) == target for w in windows)
        if target:
            assert set(windows[0]["limit"]) == {"sim-1", "sim-2"}
            assert all(0.1 <= v <= 1.0 for w in windows for v in w["limit"].values())
    shipped = next(m for m in res["modes"] if m["mode"]["name"] == "shipped")
    assert any(w["rejected_rps"] > 0 for w in shipped["windows"][1:4])
    # Envoy's access log, matched by request, times the same streams the clients did.
    sources = {s["source"]: s for s in res["sources"]}
    envoy = sources["Envoy access log, first upstream body byte"]
    admitted = sum(p["admitted"] for m in res["modes"][1:] for p in m["phases"])
    assert envoy["n"] >= 0.9 * admitted > 0
    assert envoy["abs_error_p50_ms"] < 25
    assert sources["gateway (extproc, /debug/workers)"]["n"] > 0
    assert "| t s | phase | TTFT p99 ms |" in md


@pytest.mark.parametrize(
    ("buckets", "q", "expected"),
    [
        ([(0.1, 0.0), (0.2, 10.0), (math.inf, 10.0)], 0.5, 0.15),
        ([(0.1, 10.0), (math.inf, 10.0)], 0.99, 0.099),
        ([(0.1, 0.0), (math.inf, 4.0)], 0.5, 0.1),  # all above the last bound
        ([(0.1, 0.0), (math.inf, 0.0)], 0.5, math.nan),
    ],
)
def test_histogram_quantile_interpolates_like_prometheus(
    buckets: list[tuple[float, float]], q: float, expected: float
) -> None:
    got = histogram_quantile(q, buckets)
    assert (math.isnan(got) and math.isnan(expected)) or got == pytest.approx(expected)


def _answers(ttft_ms: list[float], every: float = 0.5) -> list[Outcome]:
    """One admitted attempt every ``every`` seconds from 0, with these TTFTs."""
    return [
        Outcome(arrival=i * every, status=200, ttft=t / 1e3, finished=True)
        for i, t in enumerate(ttft_ms)
    ]


@pytest.mark.parametrize(
    ("ttft_ms", "expected"),
    [
        ([50] * 40, NOT_LEFT),  # never above the target: no recovery time
        ([300] * 6 + [50] * 34, 3.0),  # the first window without a miss starts at 3 s
        ([50] * 20 + [300] + [50] * 19, 10.5),  # a late miss: within again after it
        ([300] * 40, None),  # never within
        ([50] * 35 + [300] * 5, None),  # not within at the end of the slowdown
    ],
)
def test_recovery_is_the_start_of_the_first_window_that_stays_within_target(
    ttft_ms: list[float], expected: object
) -> None:
    # The slowdown from 0 to 20 s; windows of 5 s every 0.5 s: the last starts at 15 s.
    assert recovery(_answers(ttft_ms), (0.0, 20.0), 100.0) == expected
