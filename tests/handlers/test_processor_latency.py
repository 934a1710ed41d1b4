"""The handler times responses for the latency controller: plain messages, a fake clock."""

from __future__ import annotations

import pytest

from extproc.core.busy import BusyThresholds
from extproc.core.latency import AT_BODY, AT_HEADERS, MODEL, LatencyControl
from extproc.core.pool import WorkerPool
from extproc.core.scheduling import Scheduler
from extproc.handlers.processor import ExtProcHandler
from extproc.metrics.registry import Metrics
from tests.handlers.test_processor import Clock, reply, response_headers
from tests.handlers.test_processor_output import SSE, chunk, deliver, observer, routed


def make(target: float | None = 300.0) -> tuple[ExtProcHandler, LatencyControl, Clock]:
    clock = Clock()
    clock.t = 100.0
    pool = WorkerPool(BusyThresholds(0.5, ttft_p99_target_ms=target), clock=clock)
    pool.announce("a", model="m", endpoint="127.0.0.1:1", kv_total_blocks=100, block_size=16)
    control = LatencyControl(pool, clock)
    handler = ExtProcHandler(pool, Scheduler(pool), Metrics(), latency=control)
    return handler, control, clock


def test_ttft_is_taken_at_the_first_generated_tokens_and_itl_at_the_end() -> None:
    handler, control, clock = make()
    session = routed(handler)
    obs = observer(handler)
    clock.t = 100.1
    reply(session, response_headers(200, extra=SSE))  # headers are not the first token
    clock.t = 100.25
    deliver(obs, chunk(1))
    clock.t = 100.45
    deliver(obs, chunk(2, end=True))
    session.close()
    c = control.workers["a"][MODEL]
    assert [s for _, s in c.ttft.samples] == [pytest.approx(0.25)]
    assert c.measured_at == AT_BODY
    assert [s for _, s in c.itl.samples] == [pytest.approx(0.1)]  # 0.2 s over 2 tokens


def test_without_a_body_the_ttft_is_taken_at_the_headers_and_says_so() -> None:
    handler, control, clock = make()
    session = routed(handler)
    clock.t = 100.05
    reply(session, response_headers(200, extra=SSE))
    c = control.workers["a"][MODEL]
    assert [s for _, s in c.ttft.samples] == [pytest.approx(0.05)]
    assert c.measured_at == AT_HEADERS
    view = control.view(handler.pool.workers["a"])
    assert view is not None and str(view["ttft_measured_at"]).startswith("response headers")


def test_non_streamed_responses_and_models_without_a_target_are_not_timed() -> None:
    handler, control, clock = make()
    session = routed(handler)
    clock.t = 100.3
    reply(session, response_headers(200, extra={"content-type": "application/json"}))
    assert control.workers == {}

    handler, control, clock = make(target=None)
    session = routed(handler)
    obs = observer(handler)
    reply(session, response_headers(200, extra=SSE))
    deliver(obs, chunk(1, end=True))
    assert control.workers == {}
