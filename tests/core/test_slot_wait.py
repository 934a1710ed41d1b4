"""The wait for the first slot to free, from the running requests' ages: checked against a
seeded Monte Carlo draw of the same model (each slot time one of the samples plus normal
jitter of the kernel's bandwidth, conditioned on having lasted the request's age)."""

from __future__ import annotations

import math
import random
import statistics

import pytest
from hypothesis import given
from hypothesis import strategies as st

from extproc.core.slot_wait import BANDWIDTH_MIN, Survival, first_free, nth_free


def monte_carlo(
    samples: list[float], width: float, ages: list[float], draws: int = 20000, n: int = 1
) -> tuple[float, float, float]:
    """Median, 10th and 90th percentile of the ``n``-th end among requests of ``ages``."""
    rng = random.Random(7)
    firsts = []
    for _ in range(draws):
        ends = []
        for age in ages:
            while True:  # a slot time longer than the age, by rejection
                x = rng.choice(samples) + rng.gauss(0.0, width)
                if x > age:
                    break
            ends.append(x - age)
        firsts.append(sorted(ends)[n - 1])
    firsts.sort()
    return firsts[draws // 2], firsts[draws // 10], firsts[9 * draws // 10]


def test_alike_slot_times_the_oldest_request_frees_the_first_slot() -> None:
    """Slot times of 3 s: of 17 requests started 0.15 s apart, the oldest (2.9 s) frees the
    first slot about 0.1 s from now, not at the 3 / 17 s mean a memoryless rate gives with
    its 90th percentile at 2.3 x that."""
    samples = [3.0] * 32
    ages = [2.9 - 0.15 * i for i in range(17)]
    s = Survival(samples)
    got = first_free([(a, s) for a in ages])
    assert got is not None
    median, low, high = monte_carlo(samples, BANDWIDTH_MIN * 3.0, ages, 4000)
    assert got.median == pytest.approx(median, abs=0.01)
    assert got.low == pytest.approx(low, abs=0.01)
    assert got.high == pytest.approx(high, abs=0.015)
    assert got.high < 0.3 < math.log(10) * 3.0 / 17  # the memoryless 90th percentile: 0.41 s


def test_spread_slot_times_match_the_monte_carlo() -> None:
    rng = random.Random(3)
    samples = [rng.uniform(0.5, 4.0) for _ in range(32)]
    s = Survival(samples)
    width = max(
        BANDWIDTH_MIN * statistics.median(samples), 1.06 * statistics.pstdev(samples) * 32**-0.2
    )
    ages = [0.1, 0.8, 1.7, 2.5, 3.3]
    got = first_free([(a, s) for a in ages])
    assert got is not None
    median, low, high = monte_carlo(samples, width, ages)
    assert got.median == pytest.approx(median, rel=0.03)
    assert got.low == pytest.approx(low, abs=0.01)
    assert got.high == pytest.approx(high, rel=0.03)


@pytest.mark.parametrize("n", [2, 4])
def test_the_nth_end_matches_the_monte_carlo(n: int) -> None:
    """A request with ``n - 1`` others ahead of it in line gets the slot of the ``n``-th
    end; a later one, a later slot; more than run, no prediction."""
    rng = random.Random(5)
    samples = [rng.uniform(1.0, 3.0) for _ in range(32)]
    s = Survival(samples)
    width = max(
        BANDWIDTH_MIN * statistics.median(samples), 1.06 * statistics.pstdev(samples) * 32**-0.2
    )
    ages = [0.2, 0.9, 1.4, 2.0, 2.6, 2.9]
    got = nth_free([(a, s) for a in ages], n)
    assert got is not None
    median, low, high = monte_carlo(samples, width, ages, 8000, n)
    assert got.median == pytest.approx(median, rel=0.03)
    assert got.low == pytest.approx(low, rel=0.05, abs=0.01)
    assert got.high == pytest.approx(high, rel=0.03)
    later = nth_free([(a, s) for a in ages], n + 1)
    assert later is not None and later.low >= got.low and later.high >= got.high
    assert nth_free([(a, s) for a in ages], len(ages) + 1) is None  # more than run


def test_a_request_past_every_slot_time_ends_after_an_exponential_wait_of_its_age() -> None:
    s = Survival([3.0])
    got = first_free([(10.0, s)])
    assert got is not None
    assert got.median == pytest.approx(10.0 * math.log(2.0), rel=1e-3)
    assert got.low == pytest.approx(-10.0 * math.log(0.9), rel=1e-3)
    assert got.high == pytest.approx(10.0 * math.log(10.0), rel=1e-3)
    two = first_free([(10.0, s), (10.0, s)])  # two such: twice the rate
    assert two is not None and two.median == pytest.approx(5.0 * math.log(2.0), rel=1e-3)


def test_nothing_running_has_no_wait_to_predict() -> None:
    assert first_free([]) is None


def test_no_samples_is_named() -> None:
    with pytest.raises(ValueError, match="samples: empty"):
        Survival([])


@given(st.lists(st.floats(0.01, 30.0), min_size=1, max_size=32), st.floats(0.0, 40.0))
def test_survival_falls_from_1_to_0(samples: list[float], x: float) -> None:
    s = Survival(samples)
    assert s(0.0) == 1.0
    assert s(1e-9) == pytest.approx(1.0, abs=1e-6)  # no mass below 0
    assert s(s.hi) == s(s.hi + x) == 0.0
    assert 0.0 <= s(x + 0.1) <= s(x) <= 1.0


@given(
    st.lists(st.floats(0.05, 10.0), min_size=1, max_size=32),
    st.lists(st.floats(0.0, 12.0), min_size=1, max_size=20),
)
def test_more_running_requests_never_make_the_first_free_slot_later(
    samples: list[float], ages: list[float]
) -> None:
    """Adding a running request can only bring the first end closer (to within the
    search's resolution, well under 1 ms here)."""
    s = Survival(samples)
    few = first_free([(a, s) for a in ages[:1]])
    many = first_free([(a, s) for a in ages])
    assert few is not None and many is not None
    assert many.high <= few.high + 1e-3
    assert 0.0 <= many.low <= many.median <= many.high
