"""``python -m loadtest.slo``: its parts from plain values (the OpenAI SDK's retries, the
search for the capacity at target, a user request's TTFT with its retries, the goals), and
one ``--quick`` run end to end on its own stack (Envoy with an access log, the extproc, two
simulated engines, then a second stack with the classes file).

The quick run's phases are too short to judge the goals fairly; what it must show is the
report's shape (every mode over the same seeded arrivals, a series per second and per
window from real responses, every goal with a verdict, the markdown's numbers from the
results file) and that a verdict can fail: with a target below what an idle worker does,
the target alone misses its goals.
"""

from __future__ import annotations

import asyncio
import importlib.util
import itertools
import json
import math
import random
import re
import subprocess
from pathlib import Path
from typing import Any

import pytest

from extproc.devstack import PYTHON, ROOT
from loadtest.shedbench.arrivals import given_count, poisson
from loadtest.shedbench.capacity import RateProbe, judge_probe, probe_seconds, search_capacity
from loadtest.shedbench.classes import Request
from loadtest.shedbench.client import Outcome
from loadtest.shedbench.phases import held_requests
from loadtest.shedbench.retry import OpenAIRetry
from loadtest.shedbench.ttft_sources import histogram_quantile
from loadtest.shedbench.windows import NOT_LEFT, recovery, slo_good
from loadtest.slo import parse_args

needs_matplotlib = pytest.mark.skipif(
    importlib.util.find_spec("matplotlib") is None,
    reason="matplotlib is not installed: pip install -e '.[loadtest]'",
)

# --- the OpenAI SDK's retries -----------------------------------------------------------------


def _refused(status: int = 529, **headers: Any) -> Outcome:
    return Outcome(arrival=0.0, status=status, **headers)


def test_a_retry_waits_retry_after_ms_first_then_retry_after() -> None:
    policy, rng = OpenAIRetry(), random.Random(1)
    both = _refused(retry_after=2.0, retry_after_ms=350.0)
    assert policy.wait(1, both, rng) == pytest.approx(0.35)
    assert policy.wait(2, _refused(retry_after=3.0), rng) == 3.0


@pytest.mark.parametrize(
    ("attempt", "low", "high"),
    [(1, 0.375, 0.5), (2, 0.75, 1.0), (3, 1.5, 2.0), (6, 6.0, 8.0), (9, 6.0, 8.0)],
)
def test_without_a_usable_server_wait_the_backoff_doubles_from_half_a_second_to_8(
    attempt: int, low: float, high: float
) -> None:
    policy, rng = OpenAIRetry(), random.Random(attempt)
    # None sent, 0, or more than 60 s: the SDK falls back to its backoff with jitter.
    for out in (_refused(), _refused(retry_after=0.0), _refused(retry_after_ms=61_000.0)):
        waits = [policy.wait(attempt, out, rng) for _ in range(200)]
        assert all(low <= w <= high for w in waits), (attempt, min(waits), max(waits))
        assert max(waits) - min(waits) > 0.1 * (high - low)  # jittered


def test_what_is_retried_and_how_often() -> None:
    policy = OpenAIRetry()
    assert policy.max_attempts == 3  # DEFAULT_MAX_RETRIES = 2
    assert all(policy.retries(_refused(s)) for s in (408, 409, 429, 500, 503, 529, 0))
    assert not any(policy.retries(_refused(s)) for s in (200, 400, 404, 422))
    assert not policy.retries(_refused(529, should_retry="false"))
    assert policy.retries(_refused(400, should_retry="true"))


def test_a_user_request_s_ttft_counts_its_retries_and_waits() -> None:
    req = Request(cls="", arrival=10.0)
    req.attempts.append(Outcome(arrival=10.0, status=529, retry_after_ms=80.0))
    req.attempts.append(Outcome(arrival=10.1, status=200, ttft=0.05, e2e=1.0, finished=True))
    assert req.user_ttft == pytest.approx(0.15)
    assert slo_good(req, 10.0, 11.0, 0.2) and not slo_good(req, 10.0, 11.0, 0.1)
    assert not slo_good(req, 11.0, 12.0, 0.2)  # its first token came in another phase
    gave_up = Request(cls="", arrival=0.0, attempts=[_refused(), _refused(), _refused()])
    assert gave_up.user_ttft is None and not slo_good(gave_up, 0.0, 9.0, 10.0)


# --- the capacity at target -------------------------------------------------------------------


def _plant(capacity: float, calls: list[float]) -> Any:
    """A probe whose TTFT p99 stays at 50 ms up to ``capacity`` req/s, then is 10 s."""

    async def probe(rate: float) -> RateProbe:
        calls.append(rate)
        within = rate <= capacity
        return RateProbe(rate, 100, 50.0 if within else 10_000.0, 0, 0, within)

    return probe


@pytest.mark.parametrize(("capacity", "start"), [(11.3, 4.0), (2.2, 4.0), (4.0, 4.0)])
def test_the_search_finds_the_highest_rate_that_holds_within_10_percent(
    capacity: float, start: float
) -> None:
    calls: list[float] = []
    found, probes = asyncio.run(search_capacity(_plant(capacity, calls), start, 10))
    assert capacity / 1.1 <= found <= capacity
    assert [p.rate for p in probes] == calls and len(calls) <= 10


def test_the_rate_found_must_hold_twice_and_one_that_fails_again_bounds_the_search() -> None:
    calls: list[float] = []
    seen: dict[float, int] = {}

    async def knee(rate: float) -> RateProbe:
        """Holds up to 8 req/s; 9 holds at its first probe only (a lucky draw at the knee)."""
        calls.append(rate)
        seen[rate] = seen.get(rate, 0) + 1
        within = rate <= 8.0 or (rate <= 9.0 and seen[rate] == 1)
        return RateProbe(rate, 100, 50.0 if within else 400.0, 0, 0, within)

    found, probes = asyncio.run(search_capacity(knee, 4.0, 12))
    assert calls[:8] == [4.0, 8.0, 16.0, 12.0, 10.0, 9.0, 9.5, 9.0]  # 9 again: it fails
    assert 8.0 <= found < 9.0 and calls.count(found) >= 2  # below 9, and held twice
    assert all(p.within for p in probes if p.rate == found)
    calls.clear()
    seen.clear()
    found, _ = asyncio.run(search_capacity(knee, 4.0, 6))  # no probe left to confirm 9
    assert found == 9.0 and calls == [4.0, 8.0, 16.0, 12.0, 10.0, 9.0]


def test_the_search_is_bounded_and_says_0_when_no_rate_holds() -> None:
    calls: list[float] = []
    found, _ = asyncio.run(search_capacity(_plant(0.0, calls), 4.0, 20))
    assert found == 0.0 and min(calls) >= 4.0 / 8 and len(calls) <= 4
    calls.clear()
    found, _ = asyncio.run(search_capacity(_plant(1e9, calls), 4.0, 5))
    assert len(calls) == 5 and found == 64.0  # still doubling when the probes ran out


def test_a_probe_at_a_low_rate_runs_long_enough_to_judge_20_requests_within_bounds() -> None:
    assert probe_seconds(10.0, 16.0, 4.0) == 16.0  # 120 judged at the default length
    assert probe_seconds(0.5, 40.0, 8.0) == 78.0  # 8 s of warm-up + 35 requests at 0.5/s
    # vLLM at 0.125 req/s: 280 s for 35 requests (160 s, 4 x, judged 19: too few to hold)
    assert probe_seconds(0.125, 40.0, 8.0) == 288.0
    assert probe_seconds(0.05, 40.0, 8.0) == 400.0  # at most 10 x the default


def test_a_probe_has_the_count_its_rate_names_before_and_after_the_warm_up() -> None:
    # Drawn Poisson counts put a "9 req/s" probe's 12 judged seconds anywhere from about
    # 7 to 11 req/s; the simulated workers' knee lies between 8.5 and 8.9.
    for seed in range(50):
        times = given_count(9.0, 16.0, 4.0, random.Random(seed))
        assert times == sorted(times) and all(0.0 <= t < 16.0 for t in times)
        assert sum(1 for t in times if t < 4.0) == 36
        assert sum(1 for t in times if t >= 4.0) == 108
    gaps = [b - a for a, b in itertools.pairwise(times)]
    mean = sum(gaps) / len(gaps)
    cv = math.sqrt(sum((g - mean) ** 2 for g in gaps) / len(gaps)) / mean
    assert 0.7 < cv < 1.3  # as irregular as Poisson gaps (1), not a metronome (0)
    with pytest.raises(ValueError, match=re.escape("rate 0.0, window 16.0, warmup 4.0")):
        given_count(0.0, 16.0, 4.0, random.Random(1))
    with pytest.raises(ValueError, match=re.escape("warmup 20.0")):
        given_count(9.0, 16.0, 20.0, random.Random(1))


def test_given_arrival_times_are_launched_at_those_times_and_no_others() -> None:
    launched: list[float] = []

    async def run() -> None:
        async def nothing() -> None:
            return None

        def launch(at: float, t0: float) -> Any:
            launched.append(at)
            return nothing()

        await poisson(100.0, 0.2, 0.5, random.Random(1), launch, times=[0.01, 0.05, 0.1])

    asyncio.run(run())
    assert launched == [0.01, 0.05, 0.1]


def test_a_probe_holds_only_with_enough_requests_none_refused_and_its_p99_within() -> None:
    def answers(n: int, ttft: float, status: int = 200) -> list[Outcome]:
        return [Outcome(arrival=1.0 + i * 0.1, status=status, ttft=ttft) for i in range(n)]

    assert judge_probe(5.0, answers(40, 0.05), 0.5, 100.0).within
    assert not judge_probe(5.0, answers(40, 0.15), 0.5, 100.0).within
    assert not judge_probe(5.0, answers(10, 0.05), 0.5, 100.0).within  # too few
    refused = answers(39, 0.05) + answers(1, 0.0, 529)
    assert not judge_probe(5.0, refused, 0.5, 100.0).within
    early = [Outcome(arrival=0.1, status=200, ttft=5.0), *answers(40, 0.05)]
    assert judge_probe(5.0, early, 0.5, 100.0).within  # the warm-up is not judged


def test_held_requests_are_read_for_the_benchmark_s_model_only() -> None:
    page = (
        "# TYPE extproc_held_requests gauge\n"
        'extproc_held_requests{model="overload-model"} 3.0\n'
        'extproc_held_requests{model="other"} 7.0\n'
        'extproc_held_requests_total{model="overload-model"} 9.0\n'
    )
    assert held_requests(page) == 3.0
    assert held_requests("# TYPE extproc_held_requests gauge\n") == 0.0  # none held yet
    assert held_requests("extproc_requests_total 1\n") is None


def test_the_default_run_fits_in_about_12_minutes_of_phases_and_probes() -> None:
    cfg, opts, _ = parse_args([])
    modes = 4  # shipped, the sweep's best, the target alone, off
    seconds = modes * (opts.plan.seconds + cfg.grace)
    seconds += (1 + len(opts.sweep)) * (opts.sweep_plan.seconds + cfg.grace)
    seconds += opts.capacity_probes * opts.capacity_seconds + 2 * opts.classes_seconds
    assert seconds <= 11.5 * 60, seconds  # drains and starts take the rest
    assert [p.load for p in opts.plan.phases] == [1, 3, 10, 1]
    assert opts.plan.slow_phase == 1 and opts.plan.slow_factor == 2.0
    assert opts.retry.max_attempts == 3


# --- one quick run end to end -----------------------------------------------------------------

CAPACITY = 8.0
TARGET_MS = 5.0  # below the simulated engine's idle TTFT (about 35 ms): never met


@pytest.fixture(scope="module")
def run(tmp_path_factory: pytest.TempPathFactory) -> tuple[dict[str, Any], str, str]:
    """One quick run: its JSON, its markdown, its stderr."""
    out = tmp_path_factory.mktemp("slo") / "out"
    cmd = [PYTHON, "-m", "loadtest.slo", "--quick", "--capacity", f"{CAPACITY:g}",
           "--target-ms", f"{TARGET_MS:g}", "--out", str(out),
           "--requests-out", str(_attempts_file(tmp_path_factory))]  # fmt: skip
    done = subprocess.run(cmd, capture_output=True, text=True, timeout=240, cwd=ROOT)
    assert done.returncode == 0, done.stderr[-3000:]
    for name in ("slo-results.md", "slo-results.json", "slo-off.png", "slo-shipped.png",
                 "slo-target-alone.png"):  # fmt: skip
        assert (out / name).stat().st_size > 0, name
    res = json.loads((out / "slo-results.json").read_text())
    return res, (out / "slo-results.md").read_text(), done.stderr


@needs_matplotlib
@pytest.mark.timeout(300)
def test_every_mode_runs_every_phase_from_the_same_arrivals(
    run: tuple[dict[str, Any], str, str],
) -> None:
    res, _, _ = run
    modes = {m["mode"]["name"]: m for m in res["modes"]}
    assert list(modes) == ["shipped", "target alone", "off"]
    alone = modes["target alone"]["mode"]
    assert (alone["decode"], alone["prefill_frac"], alone["target_ms"]) == (None, None, TARGET_MS)
    assert res["best_fixed"] == "shipped" and res["sweep"] == []
    assert res["capacity_rps"] == CAPACITY and res["capacity_probes"] == []
    counts = {name: [p["requests"] for p in m["phases"]] for name, m in modes.items()}
    assert counts["off"] == counts["shipped"] == counts["target alone"]
    phases = [(p["load"], p["seconds"]) for p in res["plan"]["phases"]]
    assert phases == [(1, 2), (3, 6), (10, 2), (1, 2)]
    # Each phase offers the count its rate names, not a Poisson draw of it.
    assert counts["off"] == [round(load * CAPACITY * s) for load, s in phases]
    for m in modes.values():
        assert m["errors"] == 0
        # One point per second of the phases, counted from the attempts' answers.
        assert [s["t"] for s in m["seconds"]] == list(range(12))
        per_second = sum(s["admitted"] + s["rejected"] for s in m["seconds"])
        attempts = sum(p["attempts"] for p in m["phases"])
        assert per_second <= attempts
        # Who served what, and what /debug/workers showed for each worker.
        assert {"sim-1", "sim-2"} <= set(m["workers"])
        served = sum(w["admitted"] for w in m["workers"].values())
        # The series covers the phases; a few retries are answered in the grace after them.
        assert sum(s["admitted"] for s in m["seconds"]) <= served <= attempts
        # The simulated engines count their preemptions (vllm:num_preemptions_total).
        assert all(w["preempted"] >= 0 for w in m["workers"].values())
    off, shipped = modes["off"]["phases"], modes["shipped"]["phases"]
    assert all(p["rejected_attempts"] == 0 and p["admitted_first"] == p["requests"] for p in off)
    # 10x against thresholds: refused, and retried like the OpenAI SDK (at most 3 attempts).
    assert shipped[2]["requests"] < shipped[2]["attempts"] <= 3 * shipped[2]["requests"]
    assert res["load_average"]["before"] and res["load_average"]["after"]


def _attempts_file(factory: pytest.TempPathFactory) -> Path:
    return factory.getbasetemp() / "slo-attempts.jsonl"


@needs_matplotlib
@pytest.mark.timeout(300)
def test_every_attempt_is_written_with_its_answer_for_a_look_request_by_request(
    run: tuple[dict[str, Any], str, str], tmp_path_factory: pytest.TempPathFactory
) -> None:
    """``--requests-out``: a JSON line per attempt of every mode, as many as the results
    count, each with its answer; the refusals name their check, and each attempt carries
    what Envoy's access log says of that attempt."""
    res, _, _ = run
    rows = [json.loads(x) for x in _attempts_file(tmp_path_factory).read_text().splitlines()]
    for m in res["modes"]:
        name = m["mode"]["name"]
        mine = [r for r in rows if r["mode"] == name]
        assert len(mine) == sum(p["attempts"] for p in m["phases"]), name
        assert len({r["request"] for r in mine}) == sum(p["requests"] for p in m["phases"])
        assert {r["attempt"] for r in mine} <= {0, 1, 2}
        refused = [r for r in mine if r["status"] == 529]
        assert len(refused) == sum(p["rejected_attempts"] for p in m["phases"]), name
        for r in refused:
            assert r["ttft_ms"] is None and r["shed_reason"], r
        served = [r for r in mine if r["status"] == 200]
        assert all(r["ttft_ms"] > 0 and r["worker"] for r in served), name
        # The access log's figures are on each attempt's own row (the log numbers the
        # attempts), and the worker's first byte came before the client's first token of
        # that attempt, also for an attempt retried after another one a client gave up on
        # (with thresholds off attempts time out, and Envoy may log one after its retry).
        # A stream cut off at the run's end counts the time it had waited as its TTFT, and
        # its first byte may come after that (Envoy logs it all the same): not compared.
        logged = [r for r in served if r.get("worker_ms") is not None and not r["cut_off"]]
        assert all(r["worker_ms"] <= r["ttft_ms"] + 20 for r in logged), name
        if name != "target alone":  # its target is unreachable: it serves next to nothing
            assert served and logged, name
        # Every answered attempt has its own line, a retry's as well as a first attempt's.
        answered = [r for r in mine if r["status"]]
        assert all("worker_ms" in r for r in answered), name
        if name == "shipped":  # refused at 10x and retried (the target alone's say not to)
            assert any(r["attempt"] > 0 for r in answered), name
    # The classes runs' attempts too, each with its request's class (flat: the default).
    for label, cell in (("classes: flat", "flat"), ("classes: mixed", "classed")):
        mine = [r for r in rows if r["mode"] == label]
        assert len({r["request"] for r in mine}) == res["classes"][cell][0]["requests"], label
        assert all("worker_ms" in r for r in mine if r["status"]), label
    assert {r["class"] for r in rows if r["mode"] == "classes: flat"} == {""}
    mixed = {r["class"] for r in rows if r["mode"] == "classes: mixed"}
    assert mixed and mixed <= {"critical", "standard", "sheddable"}
    alone = [r for r in rows if r["mode"] == "target alone" and r["status"] == 529]
    assert alone and {r["shed_reason"] for r in alone} == {"deadline"}
    shipped = [r for r in rows if r["mode"] == "shipped" and r["status"] == 529]
    assert shipped and "deadline" not in {r["shed_reason"] for r in shipped}


@needs_matplotlib
@pytest.mark.timeout(300)
def test_the_slowdown_happens_in_the_second_phase(run: tuple[dict[str, Any], str, str]) -> None:
    res, _, _ = run
    for m in res["modes"]:
        # Each time is taken when the engine answered the call that slows it down (or
        # lifts it): on a loaded machine that answer can take a second or two.
        began, ended = m["slowed"]
        assert 3.0 - 0.1 <= began < 8.0  # asked for 1 s into the second phase (2-8 s)
        # Lifted as planned, 4 s after it was asked for: before the 10x phase at 8 s, or
        # within the time the call may take under load.
        assert 7.0 - 0.1 <= ended < 8.0 + 2.0 and ended > began


@needs_matplotlib
@pytest.mark.timeout(300)
def test_every_goal_has_a_verdict_and_an_unreachable_target_misses(
    run: tuple[dict[str, Any], str, str],
) -> None:
    _, md, _ = run
    section = md.split("Goals of the target alone:\n\n", 1)[1].split("\n\n", 1)[0]
    goals = [line.removeprefix("- ") for line in section.splitlines()]
    verdicts = [line.rsplit(": ", 1)[1] for line in goals]
    assert set(verdicts) <= {"met", "**missed**", "not tested"}, goals
    names = " ".join(goals)
    for goal in ("phase 1 (1x): >= 98% of user requests admitted",
                 "phase 1 (1x): TTFT p99 within 5 ms",
                 "phase 2 (3x): SLO goodput >= 95% of the capacity at target",
                 "phase 3 (10x): SLO goodput >= the best fixed thresholds'",
                 "phase 4 (1x): TTFT p99 within 5 ms",
                 "windows after the first 10 s", "back within target in <= 5 s",
                 "total SLO goodput >= 95% of the flat run's",
                 ">= 99% of critical user requests admitted"):  # fmt: skip
        assert goal in names, goal
    # No phase lasts past its 10 s of settling: no window is judged, and none is claimed.
    assert any("windows after" in g and g.endswith("not tested") for g in goals)
    # A 5 ms target on engines that take 35 ms idle: nothing is both admitted and in time.
    capacity_goals = [g for g in goals if "of the capacity at target" in g]
    assert capacity_goals and all(g.endswith("**missed**") for g in capacity_goals)
    assert any(g.startswith("phase 1 (1x)") and g.endswith("**missed**") for g in goals)


@needs_matplotlib
@pytest.mark.timeout(300)
def test_the_markdown_s_numbers_come_from_the_results_file(
    run: tuple[dict[str, Any], str, str],
) -> None:
    res, md, _ = run
    for m in res["modes"]:
        name = m["mode"]["name"] + (" (best fixed)" if m["mode"]["name"] == "shipped" else "")
        for i, p in enumerate(m["phases"]):
            row = f"| {name} | {i + 1}: {p['load']:g}x | {p['requests']} | "
            assert row in md, row
            line = next(x for x in md.splitlines() if x.startswith(row))
            assert f"**{p['slo_goodput_rps']:.2f}**" in line
    classes = res["classes"]
    assert [c["cls"] for c in classes["flat"]] == ["all"]
    assert [c["cls"] for c in classes["classed"]] == ["all", "critical", "standard", "sheddable"]
    assert classes["flat"][0]["requests"] == classes["classed"][0]["requests"] > 0
    assert sum(c["requests"] for c in classes["classed"][1:]) == classes["classed"][0]["requests"]
    assert "ttft_p99_target_ms: 10" in classes["classes_yaml"]  # sheddable: twice the target
    assert re.search(r"Capacity at target: \*\*8\.00 req/s\*\*, given with `--capacity`", md)
    assert "| t s | phase | TTFT p99 ms | within | held (mean) |" in md


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
