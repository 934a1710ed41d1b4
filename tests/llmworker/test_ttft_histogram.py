"""The engine's TTFT histogram: read from vLLM's and SGLang's metrics, differenced per scrape."""

from __future__ import annotations

from pathlib import Path

from llmworker.engine_metrics import parse_sglang, parse_vllm, ttft_delta

FIXTURES = Path(__file__).parent / "fixtures"


def test_vllm_ttft_buckets_are_read_per_rank() -> None:
    snap = parse_vllm((FIXTURES / "vllm_metrics.txt").read_text())
    for rank in snap.ranks:
        bounds = [b for b, _ in rank.ttft_buckets]
        assert bounds == sorted(bounds) and bounds[0] == 0.001 and bounds[-1] == float("inf")
        counts = [c for _, c in rank.ttft_buckets]
        assert counts == sorted(counts)  # cumulative
    assert snap.ranks[0].ttft_buckets[-1][1] == 87.0


def test_sglang_ttft_buckets_are_read() -> None:
    snap = parse_sglang((FIXTURES / "sglang_metrics.txt").read_text())
    assert snap.ranks[0].ttft_buckets[-1] == (float("inf"), 1200.0)


def test_delta_counts_each_bucket_once() -> None:
    before = ((0.1, 2.0), (0.5, 5.0), (1.0, 5.0), (float("inf"), 6.0))
    after = ((0.1, 3.0), (0.5, 9.0), (1.0, 10.0), (float("inf"), 13.0))
    # +1 at 0.1, +3 in (0.1, 0.5], +1 in (0.5, 1], +2 above 1 (counted at 1.0).
    assert ttft_delta(before, after) == [(0.1, 1), (0.5, 3), (1.0, 3)]
    assert ttft_delta(after, after) == []


def test_a_restart_or_other_bounds_give_no_delta() -> None:
    before = ((0.1, 5.0), (float("inf"), 9.0))
    assert ttft_delta(before, ((0.1, 1.0), (float("inf"), 2.0))) == []  # counts went down
    assert ttft_delta(before, ((0.2, 6.0), (float("inf"), 9.0))) == []
