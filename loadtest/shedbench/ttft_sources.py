"""How far each source of TTFT is from the TTFT the clients observe.

The clients' TTFT (from sending an attempt to its first ``data:`` chunk) is the truth.
Three sources are compared with it on the same run:

- the gateway: the extproc's per-worker TTFT p99 over the last 10 s, read from
  ``/debug/workers`` (only while a latency target is set: nothing is timed otherwise),
  against the clients' p99 of that worker's attempts sent in the same 10 s; the same for
  the engine-reported p99 the extproc shows beside it (from the workers' load events);
- the engine: each worker's ``vllm:time_to_first_token_seconds`` histogram, its increase
  between two reads turned into p50 and p99 the way Prometheus' ``histogram_quantile``
  does, against the clients' p50 and p99 of that worker's first tokens in the same interval;
- Envoy: its access log, per request, the time from the request's first byte to the first
  byte of the upstream's response body (``%COMMON_DURATION(DS_RX_BEG:US_RX_BODY_BEG:ms)%``),
  and to its response headers (``%RESPONSE_DURATION%``), matched by ``x-bench-id``.
"""

from __future__ import annotations

import itertools
import math
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from loadtest.shedbench.client import SERVED_BY, Outcome
from loadtest.shedbench.phases import BENCH_ID_HEADER, PhasedRun
from loadtest.shedbench.stats import percentile
from loadtest.shedbench.workers import Buckets

MIN_SAMPLES = 20  # fewer client TTFTs in an interval: its percentiles are not compared
GATEWAY_WINDOW = 10.0  # seconds: the extproc's window

ACCESS_LOG_FORMAT = (
    f"%REQ({BENCH_ID_HEADER.upper()})% %RESPONSE_CODE% %RESPONSE_DURATION% "
    "%COMMON_DURATION(DS_RX_BEG:US_RX_BODY_BEG:us)% %COMMON_DURATION(DS_RX_BEG:US_TX_BEG:us)%\n"
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


def parse_access_log(text: str, tag: str) -> dict[int, AccessLine]:
    """Lines of requests tagged ``tag``, by request number; a 529 or 200 each."""
    out: dict[int, AccessLine] = {}
    for line in text.splitlines():
        parts = line.split()
        if len(parts) != 5 or not parts[0].startswith(tag):
            continue
        try:
            number = int(parts[0][len(tag) :])
            status = int(parts[1])
        except ValueError:
            continue
        out_line = AccessLine(status, _ms(parts[2], 1.0), _ms(parts[3], 1e-3), _ms(parts[4], 1e-3))
        if status == 200 or number not in out:
            out[number] = out_line
    return out


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


def gateway_errors(run: PhasedRun, engine: bool = False) -> list[float]:
    """Each distinct ``/debug/workers`` p99 per worker (the controller's, or with
    ``engine`` the engine-reported one) minus the clients' p99 of that worker's attempts
    sent in the 10 s before it and answered by then."""
    served = _served(run)
    errors: list[float] = []
    last: dict[str, float | None] = {}
    for s in run.samples:
        p99 = s.engine_ttft_p99_ms if engine else s.ttft_p99_ms
        if p99 is None or last.get(s.worker) == p99:
            continue
        last[s.worker] = p99
        mine = [
            a.ttft or 0.0
            for a in served
            if a.worker == s.worker
            and s.at - GATEWAY_WINDOW <= a.arrival
            and _first_token(a) <= s.at
        ]
        if len(mine) >= MIN_SAMPLES:
            errors.append(p99 - percentile(mine, 99) * 1e3)
    return errors


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


def envoy_errors(run: PhasedRun, lines: dict[int, AccessLine], body: bool) -> list[float]:
    """Per admitted request: Envoy's time (to the first body byte, or to the headers) minus
    the client's TTFT."""
    errors: list[float] = []
    for number, req in enumerate(run.requests):
        line = lines.get(number)
        if line is None or line.status != 200 or not req.admitted or req.last.ttft is None:
            continue
        value = line.body_ms if body else line.headers_ms
        if value is not None:
            errors.append(value - req.last.ttft * 1e3)
    return errors


def compare(
    runs: Sequence[tuple[PhasedRun, dict[int, AccessLine]]],
) -> list[SourceError]:
    """The table over every run given: one row per source and statistic."""
    rows = [
        SourceError("gateway (extproc, /debug/workers)", "p99 per worker, last 10 s", []),
        SourceError("engine, via load events (/debug/workers)", "p99 per worker, last 10 s", []),
        SourceError("engine (vllm:time_to_first_token_seconds)", "p50 per worker, 5 s", []),
        SourceError("engine (vllm:time_to_first_token_seconds)", "p99 per worker, 5 s", []),
        SourceError("Envoy access log, first upstream body byte", "per request", []),
        SourceError("Envoy access log, %RESPONSE_DURATION% (headers)", "per request", []),
    ]
    for run, lines in runs:
        rows[0].errors_ms += gateway_errors(run)
        rows[1].errors_ms += gateway_errors(run, engine=True)
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


def split(run: PhasedRun, lines: dict[int, AccessLine], target_ms: float) -> list[Split]:
    """:class:`Split` of every admitted request, and of those over ``target_ms``."""
    parts: list[tuple[float, float, float, float]] = []
    for number, req in enumerate(run.requests):
        line = lines.get(number)
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
