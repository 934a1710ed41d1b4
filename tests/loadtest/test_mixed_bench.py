"""``python -m loadtest.mixed`` end to end, shortened: mixed classes at 3x capacity.

The script starts its own stack (Envoy, the extproc with a classes file, two simulated
engines) and writes the table, the JSON and the plots. At 3x capacity the run must show
what classes are for: critical requests are admitted while sheddable ones take the
rejections, which they do not when every class has the full share ("flat", the same
arrivals). The targets themselves (95 %, the TTFT bar, goodput at 10x) are the full
benchmark's business: a 5 s cell is too short and CI too noisy for them.
"""

from __future__ import annotations

import importlib.util
import json
import random
import subprocess
from pathlib import Path

import pytest

from extproc.devstack import PYTHON, ROOT
from loadtest.shedbench.classes import Retry


def test_a_retry_waits_retry_after_plus_a_jittered_exponential_backoff() -> None:
    retry = Retry(max_attempts=6, base=0.25, cap=4.0)
    rng = random.Random(7)
    for attempt, most in ((1, 0.25), (2, 0.5), (3, 1.0), (5, 4.0), (9, 4.0)):
        delays = [retry.delay(attempt, 2.0, rng) for _ in range(200)]
        assert all(2.0 <= d <= 2.0 + most for d in delays), attempt
        assert max(delays) - min(delays) > most / 2  # jittered, not fixed
    assert 0.0 <= retry.delay(1, None, rng) <= 0.25  # no Retry-After: the backoff alone


@pytest.mark.skipif(
    importlib.util.find_spec("matplotlib") is None,
    reason="matplotlib is not installed: pip install -e '.[loadtest]'",
)
def test_mixed_benchmark_sheds_the_sheddable_first(tmp_path: Path) -> None:
    out = tmp_path / "out"
    cmd = [
        PYTHON, "-m", "loadtest.mixed",
        "--loads", "3", "--capacity", "19.5", "--flat-loads", "3",
        "--cell-seconds", "6", "--warmup", "1", "--grace", "3",
        "--out", str(out),
    ]  # fmt: skip
    run = subprocess.run(cmd, capture_output=True, text=True, timeout=300, cwd=ROOT)
    assert run.returncode == 0, run.stderr[-3000:]
    for name in ("classes-results.md", "classes-results.json",
                 "classes-admitted.png", "classes-ttft.png"):  # fmt: skip
        assert (out / name).stat().st_size > 0, name
    res = json.loads((out / "classes-results.json").read_text())
    cells = {c["mode"]: {k["cls"]: k for k in c["classes"]} for c in res["cells"]}
    assert set(cells) == {"no retry", "retry", "no retry, flat", "critical alone"}

    classed, flat = cells["no retry"], cells["no retry, flat"]
    assert classed["critical"]["requests"] > 30
    # The same seeded arrivals with and without classes.
    assert {k: v["requests"] for k, v in classed.items()} == {
        k: v["requests"] for k, v in flat.items()
    }
    # With classes: sheddable takes the rejections first, critical is admitted.
    rejected = [classed[n]["attempt_rejection_rate"] for n in ("critical", "standard", "sheddable")]
    assert rejected == sorted(rejected) and rejected[2] > 0.8
    assert classed["critical"]["admitted_ratio"] > 0.8
    # Without (every share 1): critical is shed like the rest.
    assert flat["critical"]["admitted_ratio"] < classed["critical"]["admitted_ratio"] - 0.3
    # Retrying clients: critical requests get in, sheddable ones try again and again.
    retry = cells["retry"]
    assert retry["critical"]["admitted_ratio"] > 0.8
    assert retry["sheddable"]["attempts"] > retry["sheddable"]["requests"]
    # Only critical requests ran in the reference cell.
    assert set(cells["critical alone"]) == {"critical"}

    table = (out / "classes-results.md").read_text()
    assert "| 3x | no retry | critical |" in table
    assert "python -m loadtest.mixed --loads 3" in table
