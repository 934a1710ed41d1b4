"""The TTFT sources' comparison with the clients, from plain values: the access log's
predicted TTFT per request, and the engine's TTFT seen through load events per worker."""

from __future__ import annotations

import pytest

from loadtest.shedbench.classes import Request
from loadtest.shedbench.client import Outcome
from loadtest.shedbench.phases import PhasedRun, Sample
from loadtest.shedbench.ttft_sources import (
    ACCESS_LOG_FORMAT,
    ENGINE_EWMA_SAMPLES,
    ENGINE_SETTLE,
    AccessLine,
    compare,
    engine_event_errors,
    last_line,
    parse_access_log,
    prediction_errors,
    running_mean,
)


def test_the_access_log_records_the_attempt_and_the_predicted_ttft_header() -> None:
    fields = ACCESS_LOG_FORMAT.split()
    assert fields[:2] == ["%REQ(X-BENCH-ID)%", "%REQ(X-STAINLESS-RETRY-COUNT)%"]
    assert fields[-1] == "%REQ(X-TTFT-PREDICTED-MS)%"


def test_an_access_line_is_read_by_request_and_attempt_and_a_dash_is_none() -> None:
    text = "\n".join(
        [
            "t0 0 200 12 30500 1200 41.5",  # dispatched by deadline admission
            "t1 0 200 13 31000 1100 -",  # no target: no header
            "t2 0 529 1 - - -",  # refused, then retried and served
            "t2 1 200 15 33000 1300 57",
            "t3 - 200 16 34000 1400",  # no retry count, a log without the prediction
            # An attempt given up on (timed out) is logged after its retry, served.
            "t4 1 200 20 40000 1500 60",
            "t4 0 200 900 950000 1600 55",
            "u9 0 200 16 34000 1400 20",  # another run's tag
        ]
    )
    lines = parse_access_log(text, "t")
    assert lines[0, 0] == AccessLine(200, 12.0, 30.5, 1.2, 41.5)
    assert lines[1, 0].predicted_ms is None
    assert lines[2, 0].status == 529 and lines[2, 1].predicted_ms == 57.0
    assert lines[3, 0].predicted_ms is None and lines[3, 0].body_ms == 34.0
    assert lines[4, 1].body_ms == 40.0 and lines[4, 0].body_ms == 950.0
    assert set(lines) == {(0, 0), (1, 0), (2, 0), (2, 1), (3, 0), (4, 0), (4, 1)}
    # A request's figures are its last attempt's, whatever order the log has them in.
    req = Request(cls="", arrival=0.0)
    req.attempts += [Outcome(arrival=0.0, status=0), Outcome(arrival=1.0, status=200)]
    assert last_line(lines, 4, req) == lines[4, 1]


def _served(arrival: float, ttft_s: float, worker: str = "w") -> Request:
    req = Request(cls="", arrival=arrival)
    req.attempts.append(Outcome(arrival=arrival, status=200, ttft=ttft_s, worker=worker))
    return req


def test_the_prediction_s_error_is_per_request_predicted_minus_the_client_s_ttft() -> None:
    run = PhasedRun()
    run.requests = [_served(0.0, 0.040), _served(0.1, 0.050), _served(0.2, 0.030)]
    refused = Request(cls="", arrival=0.3)
    refused.attempts.append(Outcome(arrival=0.3, status=529))
    run.requests.append(refused)
    lines = {
        (0, 0): AccessLine(200, 1.0, 39.0, 1.0, 45.0),  # 5 ms high
        (1, 0): AccessLine(200, 1.0, 49.0, 1.0, None),  # no prediction: not compared
        (2, 0): AccessLine(200, 1.0, 29.0, 1.0, 20.0),  # 10 ms low
        (3, 0): AccessLine(529, 1.0, None, None, 25.0),  # not served: not compared
    }
    assert prediction_errors(run, lines) == pytest.approx([5.0, -10.0])
    row = compare([(run, lines)])[0]
    assert row.source.startswith("the prediction") and row.compared == "per request"
    assert row.n == 2 and row.bias_ms == pytest.approx(-2.5)


def test_running_mean_is_the_plain_mean_then_weights_each_value_1_over_samples() -> None:
    assert running_mean([1.0, 2.0, 3.0], 32) == pytest.approx(2.0)
    assert running_mean([0.0, 0.0, 4.0], 2) == pytest.approx(2.0)  # 0, 0, then 0 + 4/2


def test_the_engine_s_running_mean_is_compared_with_the_clients_same_mean() -> None:
    assert ENGINE_SETTLE == 73  # (31/32)^73 < 0.1: what came before the run weighs < 10%
    run = PhasedRun()
    # Worker w: 80 first tokens at 30 ms then 20 at 80 ms, one every 0.1 s.
    ttfts = [0.030] * 80 + [0.080] * 20
    run.requests = [_served(i * 0.1, t) for i, t in enumerate(ttfts)]
    # Worker v: too few first tokens to compare.
    run.requests += [_served(i * 0.1, 0.010, "v") for i in range(ENGINE_SETTLE - 1)]
    clients = running_mean(ttfts, ENGINE_EWMA_SAMPLES) * 1e3
    run.samples = [
        Sample(5.0, "w", engine_ttft_ms=35.0),  # 50 first tokens: the earlier runs weigh on it
        Sample(11.0, "w", engine_ttft_ms=50.0),
        Sample(11.5, "w", engine_ttft_ms=50.0),  # unchanged: counted once
        Sample(11.5, "w", engine_ttft_ms=None),  # not reported
        Sample(11.0, "v", engine_ttft_ms=10.0),
    ]
    errors = engine_event_errors(run)
    assert errors == pytest.approx([50.0 - clients])
    assert 30.0 < clients < 80.0
    row = compare([(run, {})])[1]
    assert row.source.startswith("engine, via load events") and row.n == 1
