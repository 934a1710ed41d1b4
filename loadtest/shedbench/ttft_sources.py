"""How far each source of TTFT is from the TTFT the clients observe.

The clients' TTFT (from sending an attempt to its first ``data:`` chunk) is the truth.
The inputs of deadline admission's prediction, and the prediction itself, are compared
with it on the same run; the rows marked "per request" pair one request with the client's
TTFT of that same request, the others compare a statistic per worker over an interval:

- the prediction (per request): the TTFT deadline admission predicted for the request when
  it admitted it (on the worker it sent it to at once, or, for a request held for a slot,
  the prediction it was held on, its wait included), which the extproc puts in the upstream
  request's ``x-ttft-predicted-ms``
  header and Envoy's access log records (``%REQ(X-TTFT-PREDICTED-MS)%``; ``-`` on a request
  the thresholds decided, with no target), against the client's TTFT of that attempt. A
  request Envoy retried on a fallback worker keeps the first worker's prediction;
- the engine as the extproc sees it through the workers' load events: ``/debug/workers``
  shows per worker (its ``deadline`` block) ``engine_ttft_ms``, a running mean
  (exponentially weighted, about the last :data:`ENGINE_EWMA_SAMPLES` requests; the plain
  mean before that many) of the engine's TTFT histogram, each request counted at its
  bucket's upper bound. It is a mean over a number of requests, not over a time window, so
  each distinct value is compared with the same running mean of the clients' TTFTs of that
  worker's attempts, in the order of their first tokens, up to the read. The modes of a
  benchmark run one after another on the same extproc, whose running mean starts each run
  with the previous run's values (and the capacity probes'), which the clients' mean of
  this run does not have: a read is compared only once the worker has had
  :data:`ENGINE_SETTLE` first tokens in the run, when what is left of the values from before
  weighs at most :data:`ENGINE_CARRY_OVER` of the mean. (A mean over the last 10 s would not
  be honest: the extproc's is not one.) Bucket upper bounds make it read high by up to a
  bucket's width (vLLM's buckets: 100-250 ms counts as 250 ms, 1-2.5 s as 2.5 s), and a load
  report's lag makes it trail the clients by up to one report period: both are part of the
  error shown, as the prediction sees them;
- the engine: each worker's ``vllm:time_to_first_token_seconds`` histogram, its increase
  between two reads turned into p50 and p99 the way Prometheus' ``histogram_quantile``
  does, against the clients' p50 and p99 of that worker's first tokens in the same interval;
- Envoy (per request): its access log, the time from the request's first byte to the first
  byte of the upstream's response body (``%COMMON_DURATION(DS_RX_BEG:US_RX_BODY_BEG:ms)%``),
  and to its response headers (``%RESPONSE_DURATION%``), matched by ``x-bench-id``: the
  router's own accounting of dispatch and first body byte, seen from Envoy.
"""

from __future__ import annotations

import itertools
import math
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from extproc.core.deadline import EWMA_SAMPLES
from loadtest.shedbench.classes import Request
from loadtest.shedbench.client import SERVED_BY, Outcome
from loadtest.shedbench.phases import BENCH_ID_HEADER, PhasedRun
from loadtest.shedbench.retry import RETRY_COUNT_HEADER
from loadtest.shedbench.stats import percentile
from loadtest.shedbench.workers import Buckets

MIN_SAMPLES = 20  # fewer client TTFTs in an interval: its percentiles are not compared
# The extproc's running mean of the engine's TTFT spans about this many requests
# (extproc.core.deadline.EWMA_SAMPLES); the clients' TTFTs are averaged the same way.
ENGINE_EWMA_SAMPLES = EWMA_SAMPLES
# A read is compared once the values from before the run weigh at most this much of it:
# after ENGINE_SETTLE values (73 for 32).
ENGINE_CARRY_OVER = 0.1
ENGINE_SETTLE = math.ceil(math.log(ENGINE_CARRY_OVER) / math.log(1 - 1 / ENGINE_EWMA_SAMPLES))
PREDICTED_HEADER = "x-ttft-predicted-ms"

ACCESS_LOG_FORMAT = (
    f"%REQ({BENCH_ID_HEADER.upper()})% %REQ({RETRY_COUNT_HEADER.upper()})% "
    "%RESPONSE_CODE% %RESPONSE_DURATION% "
    "%COMMON_DURATION(DS_RX_BEG:US_RX_BODY_BEG:us)% %COMMON_DURATION(DS_RX_BEG:US_TX_BEG:us)% "
    f"%REQ({PREDICTED_HEADER.upper()})%\n"
)


def access_log_tweak(path: str) -> Any:
    """An Envoy config tweak: the listener's access log in :data:`ACCESS_LOG_FORMAT`, and
    every answer saying which upstream served it (``x-served-by``: an engine such as
    llama-server does not name itself)."""

    def tweak(cfg: dict[str, Any]) -> None:
        listener = cfg["static_resources"]["listeners"][0]
        hcm = listener["filter_chains"][0]["filters"][0]["typed_config"]
        for vhost in hcm["route_config"]["virtual_hosts"]:
            vhost.setdefault("response_headers_to_add", []).append(
                {"header": {"key": SERVED_BY, "value": "%UPSTREAM_HOST%"}}
            )
        hcm["access_log"] = [
            {
                "name": "envoy.access_loggers.file",
                "typed_config": {
                    "@type": "type.googleapis.com/"
                    "envoy.extensions.access_loggers.file.v3.FileAccessLog",
                    "path": path,
                    "log_format": {"text_format_source": {"inline_string": ACCESS_LOG_FORMAT}},
                },
            }
        ]

    return tweak


@dataclass(frozen=True)
class AccessLine:
    status: int
    headers_ms: float | None  # %RESPONSE_DURATION%
    body_ms: float | None  # first upstream body byte
    upstream_ms: float | None = None  # the request's first byte sent upstream
    predicted_ms: float | None = None  # x-ttft-predicted-ms; None: not set (no target)


# The access log's lines by (request number, attempt).
AccessLines = dict[tuple[int, int], AccessLine]


def parse_access_log(text: str, tag: str) -> AccessLines:
    """Lines of requests tagged ``tag``, by (request number, attempt): each attempt of a
    request is a request of its own to Envoy, numbered by ``x-stainless-retry-count`` (a
    line without it counts as the first attempt). An attempt a client gave up on may be
    logged after its retry, so only its own number says which attempt a line is."""
    out: AccessLines = {}
    for line in text.splitlines():
        parts = line.split()
        if len(parts) not in (6, 7) or not parts[0].startswith(tag):
            continue
        try:
            number = int(parts[0][len(tag) :])
            attempt = 0 if parts[1] == "-" else int(parts[1])
            status = int(parts[2])
        except ValueError:
            continue
        predicted = _ms(parts[6], 1.0) if len(parts) == 7 else None
        out_line = AccessLine(
            status, _ms(parts[3], 1.0), _ms(parts[4], 1e-3), _ms(parts[5], 1e-3), predicted
        )
        key = (number, attempt)
        if status == 200 or key not in out:
            out[key] = out_line
    return out


def last_line(lines: AccessLines, number: int, req: Request) -> AccessLine | None:
    """The access log's line of request ``number``'s last attempt (None: not logged)."""
    return lines.get((number, len(req.attempts) - 1)) if req.attempts else None


def _ms(text: str, scale: float) -> float | None:
    try:
        return float(text) * scale
    except ValueError:
        return None  # "-": the point was never reached


def histogram_quantile(q: float, buckets: Buckets) -> float:
    """Prometheus' ``histogram_quantile`` over cumulative (upper bound, count) pairs."""
    if not buckets or buckets[-1][1] <= 0:
        return math.nan
    rank = q * buckets[-1][1]
    lower, below = 0.0, 0.0
    for upper, count in buckets:
        if count >= rank:
            if math.isinf(upper):
                return lower
            if count == below:
                return upper
            return lower + (upper - lower) * (rank - below) / (count - below)
        lower, below = upper, count
    return lower


@dataclass
class SourceError:
    """One source against the clients: signed errors (source minus clients) in ms."""

    source: str
    compared: str
    errors_ms: list[float]

    @property
    def n(self) -> int:
        return len(self.errors_ms)

    def abs_p(self, q: float) -> float:
        return percentile([abs(e) for e in self.errors_ms], q)

    @property
    def bias_ms(self) -> float:
        return sum(self.errors_ms) / len(self.errors_ms) if self.errors_ms else math.nan

    def row(self) -> dict[str, Any]:
        return {
            "source": self.source,
            "compared": self.compared,
            "n": self.n,
            "abs_error_p50_ms": self.abs_p(50),
            "abs_error_p99_ms": self.abs_p(99),
            "bias_ms": self.bias_ms,
        }


def _served(run: PhasedRun) -> list[Outcome]:
    return [a for r in run.requests for a in r.attempts if a.status == 200 and a.ttft is not None]


def _first_token(a: Outcome) -> float:
    return a.arrival + (a.ttft or 0.0)


def prediction_errors(run: PhasedRun, lines: AccessLines) -> list[float]:
    """Per request dispatched by deadline admission and served: its predicted TTFT (the
    access log's ``x-ttft-predicted-ms``) minus the client's TTFT of that attempt."""
    errors: list[float] = []
    for number, req in enumerate(run.requests):
        line = last_line(lines, number, req)
        if line is None or line.status != 200 or line.predicted_ms is None:
            continue
        if not req.admitted or req.last.ttft is None:
            continue
        errors.append(line.predicted_ms - req.last.ttft * 1e3)
    return errors


def engine_event_errors(run: PhasedRun) -> list[float]:
    """Each distinct ``engine_ttft_ms`` of ``/debug/workers`` per worker minus the same
    running mean (:data:`ENGINE_EWMA_SAMPLES`) of the clients' TTFTs of that worker's
    attempts whose first token came before the read, once there are :data:`ENGINE_SETTLE`
    (the extproc's mean then owes at most :data:`ENGINE_CARRY_OVER` to earlier runs)."""
    by_worker: dict[str, list[Outcome]] = {}
    for a in _served(run):
        if a.worker:
            by_worker.setdefault(a.worker, []).append(a)
    for attempts in by_worker.values():
        attempts.sort(key=_first_token)
    errors: list[float] = []
    last: dict[str, float] = {}
    for s in sorted(run.samples, key=lambda s: s.at):
        value = s.engine_ttft_ms
        if value is None or last.get(s.worker) == value:
            continue
        last[s.worker] = value
        mine = [a.ttft or 0.0 for a in by_worker.get(s.worker, []) if _first_token(a) <= s.at]
        if len(mine) >= ENGINE_SETTLE:
            errors.append(value - running_mean(mine, ENGINE_EWMA_SAMPLES) * 1e3)
    return errors


def running_mean(values: Sequence[float], samples: int) -> float:
    """The extproc's running mean of ``values`` in order: the plain mean of the first
    ``samples``, then each value weighted 1/``samples``."""
    mean = 0.0
    for count, x in enumerate(values, 1):
        mean += (x - mean) / min(count, samples)
    return mean


def engine_errors(run: PhasedRun, q: float) -> list[float]:
    """Per worker and interval between two histogram reads: the engine's quantile ``q``
    minus the clients' quantile of first tokens in that interval."""
    served = _served(run)
    errors: list[float] = []
    reads = run.histograms
    for before, after in itertools.pairwise(reads):
        for worker, upper in after.buckets.items():
            lower = dict(before.buckets.get(worker, []))
            delta = [(le, c - lower.get(le, 0.0)) for le, c in upper]
            mine = [
                a.ttft or 0.0
                for a in served
                if a.worker == worker and before.at <= _first_token(a) < after.at
            ]
            if len(mine) < MIN_SAMPLES:
                continue
            engine = histogram_quantile(q, delta)
            if not math.isnan(engine):
                errors.append((engine - percentile(mine, q * 100)) * 1e3)
    return errors


def envoy_errors(run: PhasedRun, lines: AccessLines, body: bool) -> list[float]:
    """Per admitted request: Envoy's time (to the first body byte, or to the headers) minus
    the client's TTFT."""
    errors: list[float] = []
    for number, req in enumerate(run.requests):
        line = last_line(lines, number, req)
        if line is None or line.status != 200 or not req.admitted or req.last.ttft is None:
            continue
        value = line.body_ms if body else line.headers_ms
        if value is not None:
            errors.append(value - req.last.ttft * 1e3)
    return errors


def compare(
    runs: Sequence[tuple[PhasedRun, AccessLines]],
) -> list[SourceError]:
    """The table over every run given: one row per source and statistic."""
    rows = [
        SourceError("the prediction (extproc, at dispatch)", "per request", []),
        SourceError(
            "engine, via load events (/debug/workers engine_ttft_ms)",
            f"running mean per worker (~{ENGINE_EWMA_SAMPLES} requests), "
            f"after {ENGINE_SETTLE} in the run",
            [],
        ),
        SourceError("engine (vllm:time_to_first_token_seconds)", "p50 per worker, 5 s", []),
        SourceError("engine (vllm:time_to_first_token_seconds)", "p99 per worker, 5 s", []),
        SourceError("Envoy access log, first upstream body byte", "per request", []),
        SourceError("Envoy access log, %RESPONSE_DURATION% (headers)", "per request", []),
    ]
    for run, lines in runs:
        rows[0].errors_ms += prediction_errors(run, lines)
        rows[1].errors_ms += engine_event_errors(run)
        rows[2].errors_ms += engine_errors(run, 0.5)
        rows[3].errors_ms += engine_errors(run, 0.99)
        rows[4].errors_ms += envoy_errors(run, lines, body=True)
        rows[5].errors_ms += envoy_errors(run, lines, body=False)
    return rows


@dataclass
class Split:
    """Where the TTFT of admitted requests went, by Envoy's clock, medians in ms: until
    Envoy sent the request upstream (the routing decision, and queueing before it), from
    there to the upstream's first body byte (the worker), and from there to the client's
    first token (the response path: the extproc's body processing, Envoy, the client)."""

    requests: str  # "all" or "over target"
    n: int
    before_upstream_ms: float
    worker_ms: float
    after_worker_ms: float
    client_ttft_ms: float


def split(run: PhasedRun, lines: AccessLines, target_ms: float) -> list[Split]:
    """:class:`Split` of every admitted request, and of those over ``target_ms``."""
    parts: list[tuple[float, float, float, float]] = []
    for number, req in enumerate(run.requests):
        line = last_line(lines, number, req)
        if line is None or line.status != 200 or not req.admitted or req.last.ttft is None:
            continue
        if line.upstream_ms is None or line.body_ms is None:
            continue
        ttft = req.last.ttft * 1e3
        parts.append((line.upstream_ms, line.body_ms - line.upstream_ms, ttft - line.body_ms, ttft))
    out: list[Split] = []
    for name, rows in (("all", parts), ("over target", [p for p in parts if p[3] > target_ms])):
        out.append(
            Split(
                name,
                len(rows),
                *(percentile([r[i] for r in rows], 50) for i in range(4)),
            )
        )
    return out
