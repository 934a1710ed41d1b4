"""Deadline admission in the handler: plain ext_proc messages, a fake clock, one or two
workers with one slot each whose measured service time is about 1 s."""

from __future__ import annotations

import asyncio
import logging
import math
from typing import Any

import pytest
from envoy.service.ext_proc.v3 import external_processor_pb2 as ep

from extproc.core.busy import BusyThresholds
from extproc.core.latency import GATEWAY_ONLY, DeadlineAdmission
from extproc.core.pool import WorkerPool
from extproc.core.scheduling import Scheduler
from extproc.handlers.processor import ExtProcHandler, RequestSession
from extproc.metrics.registry import Metrics
from tests.handlers.test_processor import CHAT, Clock, counter, headers, local, response_headers
from tests.handlers.test_processor_output import SSE, chunk

PROMPT_BYTES = 400  # 100 prompt tokens, from the content-length


def make(
    target_ms: float | None = 2000.0,
    workers: tuple[str, ...] = ("a",),
    slots: int | None = 1,
    decode: float | None = None,
) -> tuple[ExtProcHandler, Clock]:
    clock = Clock()
    clock.t = 100.0
    pool = WorkerPool(BusyThresholds(decode, ttft_p99_target_ms=target_ms), clock=clock)
    admission = DeadlineAdmission(pool)
    metrics = Metrics()
    metrics.watch_admission(admission)
    handler = ExtProcHandler(pool, Scheduler(pool), metrics, admission=admission)
    pool.on_capacity = handler.capacity_changed
    pool.on_load = handler.load_reported
    for i, wid in enumerate(workers):
        pool.announce(wid, model="m", endpoint=f"127.0.0.1:{i + 1}", kv_total_blocks=100)
        if slots is not None:
            pool.report_load(
                wid, num_requests_waiting=0, request_active_slots=0, request_total_slots=slots
            )
    return handler, clock


def learn(
    handler: ExtProcHandler,
    clock: Clock,
    wid: str,
    n: int = 8,
    scale: float = 1.0,
    prefill_s: float | None = None,
    tokens: int = 0,
) -> None:
    """``n`` requests on ``wid`` alone, each 0.1 s to its first byte and 1 s in all (times
    ``scale``; ``prefill_s``: that to its first byte instead); ``tokens``: each streams that
    many more tokens evenly over the rest, one a chunk."""
    admission = handler.admission
    assert admission is not None
    worker = handler.pool.workers[wid]
    for i in range(n):
        key = ("warm", wid, i)
        admission.dispatched(key, worker, 100, clock.t, clock.t)
        prefill = 0.1 * scale if prefill_s is None else prefill_s
        clock.t += prefill
        admission.first_byte(key, worker, clock.t)
        end = clock.t + scale - prefill
        for _ in range(tokens):
            clock.t += (scale - prefill) / tokens
            admission.tokens(key, worker, clock.t, 1)
        clock.t = end
        admission.ended(key, worker, clock.t, 10)


def send(
    handler: ExtProcHandler, request_id: str = "r", retry_count: int | None = None
) -> tuple[RequestSession, Any]:
    """A streamed chat request decided on its headers: its session and raw reply;
    ``retry_count``: the OpenAI SDKs' ``x-stainless-retry-count``."""
    session = handler.open_session({})
    assert isinstance(session, RequestSession)
    extra = {"content-length": str(PROMPT_BYTES), "x-request-id": request_id}
    if retry_count is not None:
        extra["x-stainless-retry-count"] = str(retry_count)
    return session, session.receive(headers(CHAT, read="m", extra=extra))


def parsed(raw: Any) -> ep.ProcessingResponse:
    assert isinstance(raw, bytes), raw
    return ep.ProcessingResponse.FromString(raw)


def destination(resp: ep.ProcessingResponse) -> str:
    hdrs = {h.header.key: h.header.raw_value.decode() for h in _set_headers(resp)}
    return hdrs["x-gateway-destination-endpoint"]


def _set_headers(resp: ep.ProcessingResponse) -> Any:
    return resp.request_headers.response.header_mutation.set_headers


def finish(session: RequestSession) -> None:
    """The response streams a first token, then ends."""
    session.receive(response_headers(200, extra=SSE))
    session.receive(chunk(1))
    session.receive(chunk(1, end=True))
    session.close()


def test_a_request_that_fits_goes_to_the_worker_with_the_smallest_prediction() -> None:
    handler, clock = make(workers=("a", "b"))
    learn(handler, clock, "a")
    learn(handler, clock, "b")
    _first, raw = send(handler, "r1")
    assert destination(parsed(raw)) in ("127.0.0.1:1", "127.0.0.1:2")
    picked = destination(parsed(raw))
    _, raw2 = send(handler, "r2")  # the other worker's slot is free: no wait there
    assert destination(parsed(raw2)) != picked
    assert counter(handler, "extproc_decisions_total", outcome="routed") == 2
    assert counter(handler, "extproc_predicted_ttft_seconds_count", model="m") == 2


def test_an_sdk_retry_yields_the_free_slot_while_first_attempts_are_refused() -> None:
    """Numbered 1 by the OpenAI SDK's header, a retry that finds a slot free is refused
    within a second of a first attempt's refusal; numbered 0, or a second later, it is
    routed."""
    handler, clock = make(target_ms=500.0)
    learn(handler, clock, "a")
    first, _ = send(handler, "r1")  # takes the only slot
    _, raw = send(handler, "r2")  # a first attempt that would wait: refused
    assert local(parsed(raw))[0] == 529
    finish(first)  # the slot frees
    clock.t += 0.2
    _, raw = send(handler, "r2-retry", retry_count=1)
    status, hdrs, _ = local(parsed(raw))
    assert status == 529 and hdrs["x-shed-reason"] == "deadline"
    assert 800 <= int(hdrs["retry-after-ms"]) <= 1000  # what is left of the second, at least
    _, raw = send(handler, "r3", retry_count=0)  # a first attempt takes the free slot
    assert destination(parsed(raw)) == "127.0.0.1:1"


def test_an_sdk_retry_due_after_a_deadline_reply_keeps_its_users_deadline() -> None:
    """A first attempt refused with ``retry-after-ms`` W: the retry that arrives W later,
    when the slot is free, is refused, its user's target (500 ms from the first attempt)
    being past; another retry at the same moment, which no reply asked for, is routed."""
    handler, clock = make(target_ms=500.0)
    learn(handler, clock, "a", scale=2.0)  # 2 s a request: the wait is above a second
    first, _ = send(handler, "r1")  # takes the only slot
    _, raw = send(handler, "r2")
    status, hdrs, _ = local(parsed(raw))
    wait_ms = int(hdrs["retry-after-ms"])
    assert status == 529 and wait_ms > 1000  # past the second in which retries yield
    clock.t += wait_ms / 1000 - 0.5
    finish(first)  # the slot frees before the retry is due
    clock.t += 0.5 + 0.02  # the retry, 20 ms after it was due
    _, raw = send(handler, "r2-retry", retry_count=1)
    status, hdrs, _ = local(parsed(raw))
    assert status == 529 and hdrs["x-shed-reason"] == "deadline"
    _, raw = send(handler, "r9-retry", retry_count=1)  # a retry no deadline reply asked for
    assert destination(parsed(raw)) == "127.0.0.1:1"


def test_a_refused_first_attempt_is_told_to_come_back_after_the_second_retries_yield() -> None:
    """Slot times of 0.3 s and of 2 s: a request that finds the slot taken is predicted to
    wait about 0.6 s, perhaps 1.9 s, and is refused against a 1.5-s target. Its retry would
    yield for a second (a first attempt was refused: its own), so a client that numbers its
    attempts is told to come back after that second, not after the predicted wait; one that
    numbers none, whose retries do not yield, after the predicted wait. The retry that comes
    when told, the slot free again, is routed (its user's target has 0.5 s left)."""
    handler, clock = make(target_ms=1500.0)
    learn(handler, clock, "a", n=6, scale=0.3, prefill_s=0.1)
    learn(handler, clock, "a", n=2, scale=2.0, prefill_s=0.1)
    first, _ = send(handler, "r1")  # takes the only slot
    clock.t += 0.05
    _, raw = send(handler, "plain")
    status, hdrs, _ = local(parsed(raw))
    assert status == 529 and int(hdrs["retry-after-ms"]) < 1000  # the predicted wait
    _, raw = send(handler, "sdk", retry_count=0)
    status, hdrs, _ = local(parsed(raw))
    assert status == 529 and int(hdrs["retry-after-ms"]) == 1000
    assert "x-should-retry" not in hdrs
    finish(first)
    clock.t += 1.0
    _, raw = send(handler, "sdk-retry", retry_count=1)
    assert destination(parsed(raw)) == "127.0.0.1:1"


def test_a_refusal_no_retry_can_turn_into_a_first_token_in_time_says_not_to_retry() -> None:
    """The OpenAI SDK numbers its attempts (``x-stainless-retry-count``), so its retry will
    count from this first attempt. Refused with a wait of about 1 s against a 500 ms target,
    no retry can meet it: ``x-should-retry: false``. Refused with a wait that may be long
    against a target with room after its mean, the retry due then still can: no such
    header; nor for a client that numbers no attempt."""
    handler, clock = make(target_ms=500.0)
    learn(handler, clock, "a")
    send(handler, "r1")  # takes the only slot
    _, raw = send(handler, "sdk", retry_count=0)
    status, hdrs, _ = local(parsed(raw))
    assert status == 529 and hdrs["x-should-retry"] == "false"
    admission = handler.admission
    assert admission is not None and not admission.due  # no retry of it will come
    _, raw = send(handler, "plain")
    status, hdrs, _ = local(parsed(raw))
    assert status == 529 and "x-should-retry" not in hdrs
    assert len(admission.due["m"]) == 1  # its client may retry: the retry is due

    # Slot times of 1 s and of 3 s (prefills of 0.1 s): the slot frees in about 2 s,
    # perhaps 3 s, so against 2.5 s the request is refused, but the retry due after the
    # mean wait still can be served in time.
    handler, clock = make(target_ms=2500.0)
    learn(handler, clock, "a", n=4)
    learn(handler, clock, "a", n=4, scale=3.0, prefill_s=0.1)
    send(handler, "r1")
    _, raw = send(handler, "sdk", retry_count=0)
    status, hdrs, _ = local(parsed(raw))
    assert status == 529 and "x-should-retry" not in hdrs
    assert int(hdrs["retry-after-ms"]) < 2500 - 300  # its retry still has room for a prefill


def test_a_request_that_would_wait_past_the_target_is_rejected_at_once() -> None:
    handler, clock = make(target_ms=500.0)
    learn(handler, clock, "a")
    send(handler, "r1")  # takes the only slot
    _, raw = send(handler, "r2")  # waits about 1 s for it: past 0.5 s
    status, hdrs, body = local(parsed(raw))
    assert status == 529 and body["code"] == 529
    assert hdrs["x-shed-reason"] == "deadline"
    assert hdrs["retry-after"] == "1"
    assert 500 <= int(hdrs["retry-after-ms"]) <= 2000
    assert counter(handler, "extproc_decisions_total", outcome="deadline") == 1
    assert counter(handler, "extproc_deadline_rejections_total", model="m") == 1
    assert counter(handler, "extproc_ttft_target_seconds", model="m") == 0.5
    labels = {"model": "m", "endpoint": "chat_completions"}
    assert counter(handler, "dynamo_frontend_model_rejection_total", **labels) == 1


def test_without_a_target_a_full_worker_still_takes_the_request() -> None:
    handler, clock = make(target_ms=None)
    learn(handler, clock, "a")
    send(handler, "r1")
    _, raw = send(handler, "r2")  # no thresholds, no target: nothing is ever rejected
    assert destination(parsed(raw)) == "127.0.0.1:1"
    assert counter(handler, "extproc_decisions_total", outcome="deadline") == 0


async def test_a_request_that_fits_after_a_wait_is_held_and_sent_when_the_slot_frees() -> None:
    handler, clock = make(target_ms=5000.0)
    learn(handler, clock, "a")
    first, _ = send(handler, "r1")
    _, raw = send(handler, "r2")
    assert isinstance(raw, tuple), raw  # (Envoy's timer extended, the reply later)
    extension, later = raw
    timeout = ep.ProcessingResponse.FromString(extension).override_message_timeout
    assert 2 <= timeout.seconds <= 30
    task = asyncio.ensure_future(later)
    await asyncio.sleep(0)
    assert not task.done()
    assert handler.admission is not None and len(handler.admission.held["m"]) == 1
    registry = handler.metrics.registry
    assert registry.get_sample_value("extproc_held_requests", {"model": "m"}) == 1
    clock.t += 0.8
    finish(first)  # the slot frees: the held request goes at once
    resp = parsed(await asyncio.wait_for(task, 1))
    assert destination(resp) == "127.0.0.1:1"
    assert not handler.admission.held.get("m")
    assert counter(handler, "extproc_held_wait_seconds_count") == 1
    assert counter(handler, "extproc_held_wait_seconds_sum") == pytest.approx(0.8)
    assert registry.get_sample_value("extproc_held_requests", {"model": "m"}) == 0


async def test_held_requests_go_out_earliest_deadline_first() -> None:
    handler, clock = make(target_ms=5000.0)
    learn(handler, clock, "a")
    first, _ = send(handler, "r1")
    clock.t += 0.01
    _, early = send(handler, "early")  # arrived first: its deadline is earlier
    clock.t += 0.01
    _, late = send(handler, "late")
    assert isinstance(early, tuple) and isinstance(late, tuple)
    early_task = asyncio.ensure_future(early[1])
    late_task = asyncio.ensure_future(late[1])
    finish(first)
    await asyncio.wait_for(early_task, 1)
    await asyncio.sleep(0)
    assert not late_task.done()  # one slot: the later deadline still waits
    late_task.cancel()


async def test_a_held_request_past_its_deadline_gets_the_deadline_reply() -> None:
    handler, clock = make(target_ms=2500.0)
    learn(handler, clock, "a")
    send(handler, "r1")
    _, raw = send(handler, "r2")
    assert isinstance(raw, tuple), raw
    task = asyncio.ensure_future(raw[1])
    clock.t += 3.0  # the slot never freed
    assert handler.held is not None
    handler.held.pump("m")  # what the deadline's timer does
    status, hdrs, _ = local(parsed(await asyncio.wait_for(task, 1)))
    assert (status, hdrs["x-shed-reason"]) == (529, "deadline")
    assert int(hdrs["retry-after-ms"]) >= 1
    assert counter(handler, "extproc_decisions_total", outcome="deadline") == 1


async def test_with_debug_logging_each_deadline_decision_says_why(
    caplog: pytest.LogCaptureFixture,
) -> None:
    """At DEBUG, one line per decision names the request, the target, what was left of it,
    and every candidate's prediction with its parts; a held request's line says how it
    ended. Above DEBUG nothing is logged."""
    handler, clock = make(target_ms=2500.0, workers=("a",))
    learn(handler, clock, "a")
    with caplog.at_level(logging.INFO, logger="extproc.handlers"):
        first, raw = send(handler, "r1")
    assert destination(parsed(raw)) == "127.0.0.1:1"
    assert not caplog.records
    with caplog.at_level(logging.DEBUG, logger="extproc.handlers"):
        _, raw = send(handler, "r2")  # the slot is taken: held for it (~1 s of 2.5 s)
        assert isinstance(raw, tuple), raw
        task = asyncio.ensure_future(raw[1])
        clock.t += 0.8
        finish(first)
        await asyncio.wait_for(task, 1)
        clock.t += 5.0  # the slot again taken by r2, for longer than the target
        _, raw = send(handler, "r3")
    lines = [r.getMessage() for r in caplog.records]
    hold, sent, reject = lines
    assert hold.startswith("deadline hold: request_id=r2 model=m class=- prompt_tokens=100")
    assert " target_ms=2500.0 left_ms=2500.0 worker=a wait_ms=" in hold
    assert " | a: ttft_ms=" in hold and " slot_free=no occupancy=1" in hold
    assert sent.startswith(
        "deadline held, sent: request_id=r2 model=m worker=a held_ms=800.0 prefill_ms=10"
    )
    assert reject.startswith("deadline reject: request_id=r3 model=m")
    assert f" retry_after_ms={local(parsed(raw))[1]['retry-after-ms']}" in reject
    assert " | a: ttft_ms=" in reject


async def test_with_debug_logging_a_held_request_refused_at_its_deadline_says_so(
    caplog: pytest.LogCaptureFixture,
) -> None:
    handler, clock = make(target_ms=2500.0)
    learn(handler, clock, "a")
    send(handler, "r1")
    with caplog.at_level(logging.DEBUG, logger="extproc.handlers"):
        _, raw = send(handler, "r2")
        assert isinstance(raw, tuple), raw
        task = asyncio.ensure_future(raw[1])
        clock.t += 3.0  # the slot never freed
        assert handler.held is not None
        handler.held.pump("m")
        _, hdrs, _ = local(parsed(await asyncio.wait_for(task, 1)))
    hold, refused = (r.getMessage() for r in caplog.records)
    assert hold.startswith("deadline hold: request_id=r2 ")
    assert refused == (
        "deadline held, refused: request_id=r2 model=m held_ms=3000.0 "
        f"retry_after_ms={hdrs['retry-after-ms']}"
    )


async def test_the_deadline_timer_answers_a_held_request_without_any_event() -> None:
    handler, clock = make(target_ms=500.0)
    learn(handler, clock, "a", scale=0.2)  # 0.2 s a request: a wait that fits 0.5 s
    loop = asyncio.get_running_loop()
    clock.t = loop.time()  # the pool's clock is the loop's: the timer fires for real
    handler.pool.clock = loop.time
    send(handler, "r1")
    _, raw = send(handler, "r2")
    assert isinstance(raw, tuple), raw
    status, hdrs, _ = local(parsed(await asyncio.wait_for(raw[1], 3)))
    assert (status, hdrs["x-shed-reason"]) == (529, "deadline")


async def test_a_held_request_is_answered_once_the_running_one_outlives_every_recent_one() -> None:
    """Held behind a request that runs past every recent slot time (1 s), a request is
    decided again on each pump: it stays held while the 10th percentile of its predicted
    wait (about a tenth of the running one's age) fits what is left of its 5-s target, and
    gets the deadline reply once it does not, before its deadline."""
    handler, clock = make(target_ms=5000.0)
    learn(handler, clock, "a")
    send(handler, "r1")  # takes the only slot and never ends
    _, raw = send(handler, "r2")
    assert isinstance(raw, tuple), raw
    task = asyncio.ensure_future(raw[1])
    assert handler.held is not None and handler.admission is not None
    [held] = list(handler.admission.held["m"])
    for step in (0.5, 3.0):  # ages 0.5 s and 3.5 s: it may still be served in time
        clock.t += step
        handler.held.pump("m")  # what a load report or the periodic re-decision does
        await asyncio.sleep(0)
        assert not task.done(), clock.t
    clock.t += 1.0  # age 4.5 s: 0.5 s left, a slot within it 1 time in 10 at best
    assert clock.t < held.deadline
    handler.held.pump("m")
    status, hdrs, _ = local(parsed(await asyncio.wait_for(task, 1)))
    assert (status, hdrs["x-shed-reason"]) == (529, "deadline")
    # The wait now predicted: the median of an exponential wait of mean its age, 0.69 x 4.5 s.
    assert int(hdrs["retry-after-ms"]) == pytest.approx(4500 * math.log(2), rel=0.02)
    assert not handler.admission.held.get("m")


async def test_a_held_request_is_not_sent_to_a_worker_that_slowed_down_since() -> None:
    """Held for worker a (a 2.5-s target, its one slot free in about 0.5 s, 0.5 s of
    prefill); while it is held, the running stream's tokens come 80 times as far apart as
    when a's fit learnt: a's prefill is now predicted at about 11 times the fit, past what is
    left of the deadline. When the slot frees the request is not sent there (it was held for
    a, and before this rule it went): it gets the deadline reply."""
    handler, clock = make(target_ms=2500.0)
    learn(handler, clock, "a", prefill_s=0.5, tokens=500)  # a token every 1 ms
    admission = handler.admission
    assert admission is not None and admission.estimate("a").step_pace() == 1.0
    first, _ = send(handler, "r1")
    _, raw = send(handler, "r2")
    assert isinstance(raw, tuple), raw  # held: a's slot frees in time for it
    [held] = list(admission.held["m"])
    assert held.fits("a")
    task = asyncio.ensure_future(raw[1])
    first.receive(response_headers(200, extra=SSE))
    clock.t += 0.5
    first.receive(chunk(1))  # r1's first token
    for _ in range(4):
        clock.t += 0.08
        first.receive(chunk(1))
    assert admission.estimate("a").step_pace() > 10
    first.receive(chunk(1, end=True))
    first.close()
    resp = parsed(await asyncio.wait_for(task, 1))
    assert resp.HasField("immediate_response"), f"sent to {destination(resp)}"
    status, hdrs, _ = local(resp)
    assert (status, hdrs["x-shed-reason"]) == (529, "deadline")


def learn_serial(handler: ExtProcHandler, clock: Clock, wid: str, n: int = 30) -> None:
    """``n`` pairs of requests on ``wid``: the second sent 0.1 s into the first's prefill of
    0.5 s, whose rest it waits for before its own (an engine that prefills one request at a
    time); each 1 s in all after its first byte."""
    admission = handler.admission
    assert admission is not None
    worker = handler.pool.workers[wid]
    for i in range(n):
        x, y = ("x", wid, i), ("y", wid, i)
        t = clock.t
        admission.dispatched(x, worker, 100, t, t)
        admission.dispatched(y, worker, 100, t + 0.1, t + 0.1)
        admission.first_byte(x, worker, t + 0.5)
        admission.first_byte(y, worker, t + 1.0)
        admission.ended(x, worker, t + 3.0, 10)
        admission.ended(y, worker, t + 3.5, 10)
        clock.t = t + 3.6


async def test_a_held_request_is_not_sent_to_a_slot_behind_a_prefill_that_makes_it_late() -> None:
    """One worker of 2 slots that prefills one request at a time (0.5 s each); both slots
    stream, and two requests are held. Both streams end at once: the first held request takes
    a slot, and the second, sent to the other slot now, would wait for the first one's
    prefill before its own: 1 s, past what is left of its target, although its own prefill
    (0.5 s, what was judged before this rule) fits. It is not sent there."""
    handler, clock = make(target_ms=2500.0, slots=2)
    learn_serial(handler, clock, "a")
    admission = handler.admission
    assert admission is not None and handler.held is not None
    est = admission.estimate("a")
    assert est.fit.serial > 0.5  # learnt: a request waits for the prefill still ahead of it
    r1, _ = send(handler, "r1")
    r2, _ = send(handler, "r2")
    for s in (r1, r2):
        s.receive(response_headers(200, extra=SSE))
    clock.t += 0.5
    r1.receive(chunk(1))
    clock.t += 0.5
    r2.receive(chunk(1))
    _, raw3 = send(handler, "r3")
    _, raw4 = send(handler, "r4")
    assert isinstance(raw3, tuple) and isinstance(raw4, tuple)
    t3, t4 = asyncio.ensure_future(raw3[1]), asyncio.ensure_future(raw4[1])
    clock.t += 1.5
    r1.receive(chunk(1, end=True))
    r1.close()
    assert destination(parsed(await asyncio.wait_for(t3, 1))) == "127.0.0.1:1"
    left = 2.5 - 1.5  # of r4's target
    assert admission.estimate("a").idle_ttft(100) < left  # what the rule judged before
    r2.receive(chunk(1, end=True))
    r2.close()
    await asyncio.sleep(0)
    assert not t4.done()
    clock.t += left  # r4's target is past: it gets the deadline reply, never a late slot
    handler.held.pump("m")
    status, hdrs, _ = local(parsed(await asyncio.wait_for(t4, 1)))
    assert (status, hdrs["x-shed-reason"]) == (529, "deadline")


async def test_a_client_that_goes_away_while_held_releases_everything() -> None:
    handler, clock = make(target_ms=5000.0)
    learn(handler, clock, "a")
    first, _ = send(handler, "r1")
    gone, raw = send(handler, "r2")
    assert isinstance(raw, tuple)
    task = asyncio.ensure_future(raw[1])
    gone.close()  # the stream ends: the transport cancels its waiting reply too
    task.cancel()
    assert handler.admission is not None and not handler.admission.held.get("m")
    finish(first)  # the slot frees: nobody is sent into it
    rank = handler.pool.workers["a"].ranks[0]
    assert rank.inflight == 0
    assert not handler.admission.estimates["a"].flights
    with pytest.raises(asyncio.CancelledError):
        await task


async def test_removing_the_target_decides_held_requests_by_the_plain_rule_at_once() -> None:
    handler, clock = make(target_ms=5000.0)
    learn(handler, clock, "a")
    send(handler, "r1")
    _, raw = send(handler, "r2")
    assert isinstance(raw, tuple)
    task = asyncio.ensure_future(raw[1])
    handler.pool.set_thresholds("m", BusyThresholds())  # POST disable: no target now
    resp = parsed(await asyncio.wait_for(task, 1))
    assert destination(resp) == "127.0.0.1:1"  # no threshold fires: the plain rule routes
    _, raw3 = send(handler, "r3")  # and so does every later request, at once
    assert destination(parsed(raw3)) == "127.0.0.1:1"


def test_thresholds_stay_ceilings_and_every_busy_worker_is_todays_reply() -> None:
    handler, _clock = make(target_ms=60_000.0, decode=0.5)
    handler.pool.report_load("a", active_decode_blocks=90, request_total_slots=1)
    _, raw = send(handler, "r1")
    status, hdrs, _ = local(parsed(raw))
    assert status == 529 and hdrs["x-shed-reason"] == "active_decode_blocks_threshold"
    assert "retry-after-ms" not in hdrs


def test_a_first_token_within_the_target_counts_as_met() -> None:
    handler, clock = make(target_ms=2000.0)
    session, _ = send(handler, "r1")
    clock.t += 0.3
    finish(session)
    assert counter(handler, "extproc_ttft_target_met_total", model="m", met="true") == 1
    session, _ = send(handler, "r2")
    clock.t += 2.5
    finish(session)
    assert counter(handler, "extproc_ttft_target_met_total", model="m", met="false") == 1
    assert handler.admission is not None
    assert handler.admission.met["m"].share == 0.5


def test_a_worker_without_queue_fields_is_predicted_from_the_gateways_timings() -> None:
    handler, _clock = make(slots=None)
    handler.pool.report_load("a", active_decode_blocks=1)  # no queue fields
    session, raw = send(handler, "r1")
    assert destination(parsed(raw)) == "127.0.0.1:1"  # no data yet: routable
    assert handler.admission is not None
    view = handler.admission.view(handler.pool.workers["a"])
    assert view is not None and view["from"] == GATEWAY_ONLY
    missing = view["missing"]
    assert isinstance(missing, list) and "num_requests_waiting" in missing
    finish(session)


def test_a_target_below_an_idle_workers_ttft_is_shown_unreachable() -> None:
    handler, clock = make(target_ms=50.0)
    learn(handler, clock, "a")  # 0.1 s to the first byte on an idle worker
    assert handler.admission is not None
    worker = handler.pool.workers["a"]
    view = handler.admission.view(worker)
    assert view is not None and view["target_unreachable"] is True
    idle = view["idle_ttft_ms"]
    assert isinstance(idle, float) and 50 < idle < 150
    assert str(view["target"]) == f"target unreachable: an idle worker takes {idle:.0f} ms"
    # Four requests a second still go to the free worker, to measure it again: it may have
    # been slow only while cold.
    probe, raw = send(handler, "probe")
    assert destination(parsed(raw)) == "127.0.0.1:1"
    finish(probe)
    _, raw = send(handler, "r1")  # the worker idle again, but probed less than 0.25 s ago
    status, hdrs, _ = local(parsed(raw))
    assert (status, hdrs["x-shed-reason"]) == (529, "deadline")
    clock.t += 0.25
    probe, raw = send(handler, "probe2")
    assert destination(parsed(raw)) == "127.0.0.1:1"


# ----- request classes: a class's target is its deadline -----------------------------------

CLASS_TARGETS = {
    "default": "standard",
    "classes": {
        "critical": {"ttft_p99_target_ms": 5000},
        "standard": {},
        "sheddable": {"status": 429, "retry_after": 7, "ttft_p99_target_ms": 600},
    },
}


def classed(table: dict[str, Any] = CLASS_TARGETS) -> tuple[ExtProcHandler, Clock]:
    from extproc.core.classes import ClassRegistry, parse_table

    clock = Clock()
    clock.t = 100.0
    pool = WorkerPool(BusyThresholds(), clock=clock)  # no model target, no thresholds
    registry = ClassRegistry(parse_table(table), pool)
    admission = DeadlineAdmission(pool, registry)
    handler = ExtProcHandler(
        pool, Scheduler(pool), Metrics(), classes=registry, admission=admission
    )
    pool.on_capacity = handler.capacity_changed
    pool.on_load = handler.load_reported
    registry.listeners.append(handler.classes_changed)
    pool.announce("a", model="m", endpoint="127.0.0.1:1", kv_total_blocks=100)
    pool.report_load("a", num_requests_waiting=0, request_active_slots=0, request_total_slots=1)
    return handler, clock


def send_class(handler: ExtProcHandler, cls: str) -> tuple[RequestSession, Any]:
    session = handler.open_session({})
    assert isinstance(session, RequestSession)
    extra = {"content-length": str(PROMPT_BYTES), "x-request-class": cls}
    return session, session.receive(headers(CHAT, read="m", extra=extra))


async def test_each_class_is_judged_by_its_own_target_and_a_class_without_one_is_not() -> None:
    handler, clock = classed()
    learn(handler, clock, "a")
    first, _ = send_class(handler, "standard")  # no target anywhere: plain rule, routed
    _, shed = send_class(handler, "sheddable")  # waits ~1 s for the slot: past its 600 ms
    status, hdrs, body = local(parsed(shed))
    assert (status, body["code"]) == (429, 429)  # the class's status...
    assert hdrs["x-shed-reason"] == "deadline" and hdrs["x-shed-class"] == "sheddable"
    assert hdrs["retry-after"] == "1"  # ...but the retry headers from the predicted wait
    _, held = send_class(handler, "critical")  # ~1 s fits its 5 s: held
    assert isinstance(held, tuple), held
    task = asyncio.ensure_future(held[1])
    other, plain = send_class(handler, "standard")  # no target: routed at once (plain rule)
    assert destination(parsed(plain)) == "127.0.0.1:1"
    finish(first)
    await asyncio.sleep(0)
    assert not task.done()  # the plain request took a slot too: one is still taken
    finish(other)
    resp = parsed(await asyncio.wait_for(task, 1))
    assert destination(resp) == "127.0.0.1:1"


EQUAL_TARGETS = {
    "default": "standard",
    "classes": {
        "critical": {"priority": 0, "ttft_p99_target_ms": 5000},
        "standard": {"priority": 1, "ttft_p99_target_ms": 5000},
    },
}


async def test_a_held_request_of_the_best_class_goes_before_a_lesser_one_that_came_after() -> None:
    """Critical and standard share a 5-s target. A held critical request is judged on its
    mean, so the deadline it is answered at is later than a standard one's of the same
    arrival by the prefill's spread (0.1 to 0.3 s to the first byte: 0.2 s); it is served by
    the deadline with the spread, so it still takes the first slot that frees before a
    standard request that arrived 0.01 s after it."""
    handler, clock = classed(EQUAL_TARGETS)
    admission = handler.admission
    assert admission is not None
    worker = handler.pool.workers["a"]
    for i in range(12):  # prefills of 0.1 and 0.3 s in turn, 1 s a request in all
        key = ("warm", i)
        admission.dispatched(key, worker, 100, clock.t, clock.t)
        admission.first_byte(key, worker, clock.t + (0.1 if i % 2 else 0.3))
        clock.t += 1.0
        admission.ended(key, worker, clock.t, 10)
    spread = admission.estimate("a").fit.abs_residual.get()
    assert spread is not None and spread > 0.05
    first, _ = send_class(handler, "standard")  # the one slot
    _, critical = send_class(handler, "critical")
    clock.t += 0.01
    _, standard = send_class(handler, "standard")
    assert isinstance(critical, tuple) and isinstance(standard, tuple)  # both held
    critical_task = asyncio.ensure_future(critical[1])
    standard_task = asyncio.ensure_future(standard[1])
    finish(first)
    assert destination(parsed(await asyncio.wait_for(critical_task, 1))) == "127.0.0.1:1"
    await asyncio.sleep(0)
    assert not standard_task.done()  # one slot: the standard request still waits
    standard_task.cancel()


def test_non_streamed_responses_teach_the_completion_rate_and_nothing_else() -> None:
    handler, clock = make(target_ms=5000.0)
    assert handler.admission is not None
    for i in range(3):
        session, raw = send(handler, f"r{i}")
        assert destination(parsed(raw)) == "127.0.0.1:1"
        clock.t += 0.5
        session.receive(response_headers(200, extra={"content-type": "application/json"}))
        session.receive(
            ep.ProcessingRequest(
                response_body=ep.HttpBody(
                    body=b'{"usage":{"completion_tokens":3}}', end_of_stream=True
                )
            ).SerializeToString()
        )
        session.close()
    view = handler.admission.view(handler.pool.workers["a"])
    assert view["service_ms"] == pytest.approx(500.0)  # dispatch to the end of the response
    assert view["completion_rate_per_s"] == pytest.approx(2.0)
    missing = view["missing"]
    assert isinstance(missing, list) and "prefill" in missing  # not a first token
    assert counter(handler, "extproc_ttft_target_met_total", model="m", met="true") == 0
    # A response cut short (the client left before its end) teaches nothing.
    session, _ = send(handler, "cut")
    clock.t += 0.05
    session.close()
    after = handler.admission.view(handler.pool.workers["a"])
    assert after["service_ms"] == pytest.approx(500.0)


@pytest.mark.parametrize(("status", "counted"), [(200, True), (404, False)], ids=["2xx", "not-2xx"])
def test_a_2xx_whose_body_the_filter_never_sends_completes_at_the_streams_end(
    status: int, counted: bool
) -> None:
    """With a filter that sends no response body (envoy/envoy.yaml), a 2xx response's end
    is the end of its ext_proc stream: it counts as completed, its slot time from dispatch
    to then, and the worker's completion rate is measured; a response that was not 2xx
    is not counted."""
    handler, clock = make(target_ms=2000.0)
    assert handler.admission is not None
    est = handler.admission.estimate("a")
    for i in range(3):
        session, raw = send(handler, f"r{i}")
        assert destination(parsed(raw)) == "127.0.0.1:1"
        clock.t += 1.5
        session.receive(response_headers(status, extra={"content-type": "application/json"}))
        session.close()  # Envoy closes the stream after the response: no body, no trailers
    assert est.service.count == (3 if counted else 0)
    assert ("completions" in est.missing) is not counted
    if counted:
        assert est.service.value == pytest.approx(1.5)
        assert est.rate(clock.t) == pytest.approx(1 / 1.5)
