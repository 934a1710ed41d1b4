"""Read an engine's Prometheus ``/metrics`` text into a typed :class:`EngineSnapshot`.

Two steps, both free of I/O so they are tested with plain strings:

- :func:`parse_text` reads the Prometheus text exposition format with
  prometheus_client's parser and returns the samples by metric name. Text the
  parser rejects raises :class:`MetricsParseError` naming the line number, the
  line and the parser's reason.
- :func:`parse_vllm` / :func:`parse_sglang` (or :func:`parse_engine_metrics`)
  pick the series the sidecar agent needs and group them per data-parallel
  rank: vLLM labels ranks ``engine="0"``, ``"1"``, ...; SGLang with DP attention
  labels them ``dp_rank``. A series without a rank label belongs to rank 0.
  Several series of one rank (SGLang prints one per TP/PP rank) are combined
  by taking the largest value. Counts that are negative, a KV usage outside
  0-1, or text without the engine's core gauges also raise
  :class:`MetricsParseError`. ``NaN`` reads as "not reported".

Which series feed which event field is listed in docs/worker.md (the mapping tables).
"""

from __future__ import annotations

import math
from collections.abc import Iterable, Iterator, Mapping
from dataclasses import dataclass, field
from typing import Literal

from prometheus_client.parser import text_fd_to_metric_families

Engine = Literal["vllm", "sglang", "llamacpp"]
ENGINES: tuple[Engine, ...] = ("vllm", "sglang", "llamacpp")


class MetricsParseError(ValueError):
    """The metrics text is malformed or lacks what the engine should print."""


@dataclass(frozen=True, slots=True)
class Sample:
    """One sample line: metric name, labels and value."""

    name: str
    labels: Mapping[str, str]
    value: float


@dataclass(frozen=True, slots=True)
class RankStats:
    """What one data-parallel rank of the engine reports; None = not reported."""

    rank: int  # as the engine labels it (vLLM ``engine``, SGLang ``dp_rank``)
    num_running: int | None = None
    num_waiting: int | None = None
    kv_usage: float | None = None  # fraction of KV cache in use, 0-1
    kv_used_tokens: int | None = None  # SGLang ``num_used_tokens``
    kv_total_blocks: int | None = None  # vLLM ``cache_config_info{num_gpu_blocks}``
    kv_total_tokens: int | None = None  # SGLang ``max_total_num_tokens``
    block_size: int | None = None  # tokens per KV block (page) as the engine reports it
    prefill_tokens: int | None = None  # a direct "tokens waiting for prefill" gauge
    avg_prompt_tokens: float | None = None  # mean prompt length of finished requests
    num_preemptions: int | None = None  # cumulative preemptions / retractions
    # The engine's queue and sequence slots, as the load event carries them: requests queued
    # at the engine and not running yet; sequences running; the most sequences the rank runs
    # at once (vLLM ``max_num_seqs``, SGLang ``max_running_requests``, llama.cpp slots).
    requests_waiting: int | None = None
    slots_active: int | None = None
    slots_total: int | None = None
    # The engine's TTFT histogram, cumulative: (upper bound s, requests at or below it);
    # +Inf last. Empty: not reported. A counter, not part of the rank's state (no compare).
    ttft_buckets: tuple[tuple[float, float], ...] = field(default=(), compare=False)


@dataclass(frozen=True, slots=True)
class EngineSnapshot:
    """One scrape of one engine, per rank in ascending rank order."""

    engine: Engine
    ranks: tuple[RankStats, ...]
    max_num_batched_tokens: int | None = None


# ---------------------------------------------------------------------------
# Prometheus text exposition format (prometheus_client's parser)


class _Lines:
    """The lines of a text up to ``# EOF``, remembering which one was read last."""

    def __init__(self, text: str) -> None:
        self._lines = text.split("\n")
        self.number = 0

    def __iter__(self) -> Iterator[str]:
        for number, line in enumerate(self._lines, start=1):
            self.number = number
            if line.strip() == "# EOF":  # OpenMetrics end marker
                return
            yield line + "\n"

    @property
    def current(self) -> str:
        return self._lines[self.number - 1].strip() if self.number else ""


def parse_text(text: str) -> dict[str, list[Sample]]:
    """Samples by metric name; MetricsParseError names the first bad line.

    prometheus_client's parser reads the text; it is lax in places (a third field on a
    sample line is read as the timestamp) and its errors do not say where, so the line
    number and the line are added here."""
    lines = _Lines(text)
    samples: dict[str, list[Sample]] = {}
    try:
        for family in text_fd_to_metric_families(lines):  # type: ignore[arg-type]
            for s in family.samples:
                samples.setdefault(s.name, []).append(
                    Sample(s.name, dict(s.labels), float(s.value))
                )
    except ValueError as exc:
        shown = lines.current if len(lines.current) <= 200 else lines.current[:200] + "..."
        detail = str(exc) or "malformed line"
        raise MetricsParseError(
            f"line {lines.number}: not valid Prometheus text ({detail}): {shown!r}"
        ) from None
    return samples


# ---------------------------------------------------------------------------
# Engine-specific views


def _rank_of(sample: Sample, label: str) -> int:
    raw = sample.labels.get(label)
    if raw is None:
        return 0
    if not raw.isdigit():
        raise MetricsParseError(f"{sample.name}: rank label {label}={raw!r} is not an integer")
    return int(raw)


def _per_rank(samples: Iterable[Sample], label: str) -> dict[int, float]:
    """Largest non-NaN value per rank."""
    out: dict[int, float] = {}
    for s in samples:
        if math.isnan(s.value):
            continue
        rank = _rank_of(s, label)
        out[rank] = max(out.get(rank, s.value), s.value)
    return out


def _count(name: str, value: float | None) -> int | None:
    if value is None:
        return None
    if value < 0 or math.isinf(value):
        raise MetricsParseError(f"{name} = {value!r}: expected a finite count >= 0")
    return round(value)


def _fraction(name: str, value: float | None) -> float | None:
    if value is None:
        return None
    if not 0.0 <= value <= 1.0:
        raise MetricsParseError(f"{name} = {value!r}: expected a fraction in 0-1")
    return value


def _label_int(sample: Sample, label: str) -> int | None:
    """An integer label value; None when absent or ``None`` (engine not initialised)."""
    raw = sample.labels.get(label)
    if raw is None or raw in ("None", ""):
        return None
    if not raw.isdigit():
        raise MetricsParseError(f"{sample.name}: label {label}={raw!r} is not an integer >= 0")
    return int(raw)


def _total(samples: Mapping[str, list[Sample]], name: str) -> float | None:
    """Sum of a metric's non-NaN samples over all labels, None if absent."""
    values = [s.value for s in samples.get(name, ()) if not math.isnan(s.value)]
    return sum(values) if values else None


def _per_rank_sum(samples: Iterable[Sample], label: str) -> dict[int, float]:
    out: dict[int, float] = {}
    for s in samples:
        if not math.isnan(s.value):
            rank = _rank_of(s, label)
            out[rank] = out.get(rank, 0.0) + s.value
    return out


def _histogram(samples: Iterable[Sample], label: str) -> dict[int, tuple[tuple[float, float], ...]]:
    """A histogram's cumulative buckets per rank, by ascending bound (summed over any
    other labels, such as the model name)."""
    by_rank: dict[int, dict[float, float]] = {}
    for s in samples:
        le = s.labels.get("le")
        if le is None or math.isnan(s.value):
            continue
        try:
            bound = float(le)
        except ValueError:
            raise MetricsParseError(f"{s.name}: le={le!r} is not a number") from None
        rank = by_rank.setdefault(_rank_of(s, label), {})
        rank[bound] = rank.get(bound, 0.0) + s.value
    return {r: tuple(sorted(b.items())) for r, b in by_rank.items()}


def ttft_delta(
    before: tuple[tuple[float, float], ...], after: tuple[tuple[float, float], ...]
) -> list[tuple[float, int]]:
    """Requests per TTFT bucket between two scrapes of a cumulative histogram, as
    (upper bound, requests); the +Inf bucket counts at the largest finite bound. Empty
    when the bounds differ or a count went down (the engine restarted)."""
    if len(before) != len(after) or any(a[0] != b[0] for a, b in zip(before, after, strict=True)):
        return []
    out: list[tuple[float, int]] = []
    below_before = below_after = 0.0
    for (bound, cum_before), (_, cum_after) in zip(before, after, strict=True):
        n = (cum_after - below_after) - (cum_before - below_before)
        if n < 0:
            return []
        below_before, below_after = cum_before, cum_after
        if math.isinf(bound):
            if n and out:
                out[-1] = (out[-1][0], out[-1][1] + int(n))
            continue
        if n:
            out.append((bound, int(n)))
    return out


def _mean(total: float | None, count: float | None) -> float | None:
    if total is None or count is None or count <= 0:
        return None
    return total / count


def parse_vllm(text: str) -> EngineSnapshot:
    """Snapshot of a vLLM server's ``/metrics`` (V1 engine; V0 names accepted)."""
    samples = parse_text(text)
    label = "engine"
    usage_name = "vllm:kv_cache_usage_perc"
    if usage_name not in samples:
        usage_name = "vllm:gpu_cache_usage_perc"  # vLLM < 0.9, deprecated later
    if usage_name not in samples:
        raise MetricsParseError(
            "no vllm:kv_cache_usage_perc (or vllm:gpu_cache_usage_perc) series: "
            "is this a vLLM /metrics page (--engine vllm), and was vLLM started without "
            "--disable-log-stats (which leaves /metrics without any vllm: series)?"
        )
    usage = _per_rank(samples[usage_name], label)
    running = _per_rank(samples.get("vllm:num_requests_running", ()), label)
    waiting = _per_rank(samples.get("vllm:num_requests_waiting", ()), label)
    preempted = _per_rank(samples.get("vllm:num_preemptions_total", ()), label)
    blocks: dict[int, int] = {}
    block_size: dict[int, int] = {}
    max_seqs: dict[int, int] = {}
    for s in samples.get("vllm:cache_config_info", ()):
        rank = _rank_of(s, label)
        if (n := _label_int(s, "num_gpu_blocks")) is not None:
            blocks[rank] = n
        if (b := _label_int(s, "block_size")) is not None and b > 0:
            block_size[rank] = b
        if m := _label_int(s, "max_num_seqs"):
            max_seqs[rank] = m
    # Mean prompt length: the per-request histogram, else prompt tokens per finished request.
    hist_sum = _per_rank_sum(samples.get("vllm:request_prompt_tokens_sum", ()), label)
    hist_count = _per_rank_sum(samples.get("vllm:request_prompt_tokens_count", ()), label)
    prompt_total = _per_rank_sum(samples.get("vllm:prompt_tokens_total", ()), label)
    finished = _per_rank_sum(samples.get("vllm:request_success_total", ()), label)
    ttft = _histogram(samples.get("vllm:time_to_first_token_seconds_bucket", ()), label)
    max_batched: int | None = None
    any_max_seqs: int | None = None  # the scheduler's, for every rank
    for s in samples.get("vllm:vllm_config_info", ()):
        max_batched = _label_int(s, "scheduler_config_max_num_batched_tokens") or max_batched
        any_max_seqs = _label_int(s, "scheduler_config_max_num_seqs") or any_max_seqs
    ranks = sorted(set(usage) | set(running) | set(waiting) | set(blocks))
    return EngineSnapshot(
        engine="vllm",
        ranks=tuple(
            RankStats(
                rank=r,
                num_running=_count("vllm:num_requests_running", running.get(r)),
                num_waiting=_count("vllm:num_requests_waiting", waiting.get(r)),
                kv_usage=_fraction(usage_name, usage.get(r)),
                kv_total_blocks=blocks.get(r),
                block_size=block_size.get(r),
                avg_prompt_tokens=_mean(hist_sum.get(r), hist_count.get(r))
                or _mean(prompt_total.get(r), finished.get(r)),
                num_preemptions=_count("vllm:num_preemptions_total", preempted.get(r)),
                requests_waiting=_count("vllm:num_requests_waiting", waiting.get(r)),
                slots_active=_count("vllm:num_requests_running", running.get(r)),
                slots_total=max_seqs.get(r, any_max_seqs),
                ttft_buckets=ttft.get(r, ()),
            )
            for r in ranks
        ),
        max_num_batched_tokens=max_batched,
    )


def parse_sglang(text: str) -> EngineSnapshot:
    """Snapshot of an SGLang server's ``/metrics`` (started with ``--enable-metrics``)."""
    samples = parse_text(text)
    label = "dp_rank"
    if "sglang:num_used_tokens" not in samples and "sglang:token_usage" not in samples:
        raise MetricsParseError(
            "no sglang:num_used_tokens or sglang:token_usage series: is this an SGLang "
            "/metrics page (--engine sglang) and was SGLang started with --enable-metrics?"
        )

    def gauge(name: str) -> dict[int, float]:
        return _per_rank(samples.get(name, ()), label)

    used = gauge("sglang:num_used_tokens")
    usage = gauge("sglang:token_usage")
    total = gauge("sglang:max_total_num_tokens")
    running = gauge("sglang:num_running_reqs")
    queued = gauge("sglang:num_queue_reqs")
    page = gauge("sglang:page_size")
    max_running = gauge("sglang:max_running_requests")
    prefill = gauge("sglang:num_prefill_tokens")
    retracted = _per_rank_sum(samples.get("sglang:num_retracted_requests_total", ()), label)
    ttft = _histogram(samples.get("sglang:time_to_first_token_seconds_bucket", ()), label)
    # Tokenizer-side counters are not per rank: one mean for every rank.
    mean_prompt = _mean(
        _total(samples, "sglang:prompt_tokens_histogram_sum"),
        _total(samples, "sglang:prompt_tokens_histogram_count"),
    ) or _mean(
        _total(samples, "sglang:prompt_tokens_total"),
        _total(samples, "sglang:num_requests_total"),
    )
    ranks = sorted(set(used) | set(usage) | set(running) | set(queued) | set(total))
    return EngineSnapshot(
        engine="sglang",
        ranks=tuple(
            RankStats(
                rank=r,
                num_running=_count("sglang:num_running_reqs", running.get(r)),
                num_waiting=_count("sglang:num_queue_reqs", queued.get(r)),
                kv_usage=_fraction("sglang:token_usage", usage.get(r)),
                kv_used_tokens=_count("sglang:num_used_tokens", used.get(r)),
                kv_total_tokens=_count("sglang:max_total_num_tokens", total.get(r)) or None,
                block_size=_count("sglang:page_size", page.get(r)) or None,
                prefill_tokens=_count("sglang:num_prefill_tokens", prefill.get(r)),
                avg_prompt_tokens=mean_prompt,
                num_preemptions=_count("sglang:num_retracted_requests_total", retracted.get(r)),
                requests_waiting=_count("sglang:num_queue_reqs", queued.get(r)),
                slots_active=_count("sglang:num_running_reqs", running.get(r)),
                slots_total=_count("sglang:max_running_requests", max_running.get(r)) or None,
                ttft_buckets=ttft.get(r, ()),
            )
            for r in ranks
        ),
    )


def parse_engine_metrics(engine: Engine, text: str) -> EngineSnapshot:
    """Snapshot of ``engine``'s metrics text; MetricsParseError if malformed."""
    if engine == "vllm":
        return parse_vllm(text)
    if engine == "sglang":
        return parse_sglang(text)
    if engine == "llamacpp":
        raise ValueError("llama.cpp needs /slots too: use llmworker.llamacpp.parse_llamacpp")
    raise ValueError(f"unknown engine {engine!r}, expected one of {', '.join(ENGINES)}")
