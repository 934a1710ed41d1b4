"""The process-wide budget for full-duplex request bodies gathered before the decision: the
accounting alone, then through the handler with plain protobuf messages, then the setting."""

from __future__ import annotations

import asyncio
import json
import logging
import random

import pytest
from envoy.config.core.v3 import base_pb2
from envoy.extensions.filters.http.ext_proc.v3 import processing_mode_pb2
from envoy.service.ext_proc.v3 import external_processor_pb2 as ep

from extproc.core.busy import BusyThresholds
from extproc.core.pool import WorkerPool
from extproc.core.scheduling import Scheduler
from extproc.handlers.body_budget import DEFAULT_BUDGET_MIB, MIB, SMALL_BODY, BodyBudget
from extproc.handlers.processor import BODY_BUDGET_REASON, ExtProcHandler, RequestSession
from extproc.handlers.replies import SHED_REASON_HEADER
from extproc.handlers.router_queue import RouterQueue
from extproc.metrics.registry import Metrics
from extproc.settings import SettingsError, build_parser, load_settings

CHAT = "/v1/chat/completions"
DUPLEX = processing_mode_pb2.ProcessingMode.FULL_DUPLEX_STREAMED
KIB = 1024

# ----- the accounting --------------------------------------------------------------------


def test_streams_take_within_the_budget_and_release_all_they_hold() -> None:
    budget = BodyBudget(64 * KIB)  # reserve 8 KiB; small bodies: up to 8 KiB
    a, b = object(), object()
    assert budget.take(a, 20 * KIB) and budget.take(a, 10 * KIB)
    assert budget.take(b, 20 * KIB)
    assert (budget.used, budget.held(a), budget.held(b), budget.streams) == (
        50 * KIB, 30 * KIB, 20 * KIB, 2)  # fmt: skip
    # A large body stops at limit - reserve (56 KiB): 7 KiB more is 57.
    assert not budget.take(b, 7 * KIB)
    assert budget.used == 50 * KIB and budget.held(b) == 20 * KIB  # nothing taken
    assert budget.take(b, 6 * KIB)
    assert budget.release(a) == 30 * KIB
    assert budget.release(a) == 0  # twice is harmless
    assert (budget.used, budget.streams) == (26 * KIB, 1)
    assert budget.release(b) == 26 * KIB and budget.used == 0


def test_the_reserve_is_kept_for_small_bodies() -> None:
    budget = BodyBudget(64 * KIB)
    assert (budget.reserve, budget.small, budget.largest) == (8 * KIB, 8 * KIB, 56 * KIB)
    big = object()
    assert budget.take(big, 56 * KIB)
    assert not budget.take(object(), 8 * KIB + 1)  # one byte over small: large, no room
    smalls = [object() for _ in range(4)]
    for s in smalls:
        assert budget.take(s, 2 * KIB)  # the reserve, 2 KiB each
    assert budget.used == 64 * KIB
    assert not budget.take(object(), 1)  # the whole budget is in use
    # A small body that grows past small leaves the reserve's rule: no room for it.
    budget.release(smalls[0])
    assert not budget.take(smalls[1], 7 * KIB)
    assert budget.held(smalls[1]) == 2 * KIB


def test_the_small_limit_and_the_default() -> None:
    budget = BodyBudget(DEFAULT_BUDGET_MIB * MIB)
    assert budget.small == SMALL_BODY
    assert budget.largest == DEFAULT_BUDGET_MIB * MIB * 7 // 8
    assert budget.take(object(), 0) and budget.streams == 0
    with pytest.raises(ValueError, match="at least 1 byte"):
        BodyBudget(0)


def test_refusals_are_logged_once_a_minute_with_how_many_there_were() -> None:
    budget = BodyBudget(64 * KIB)
    assert budget.refused(100.0) == 1  # the first: a line at once
    assert budget.refused(110.0) is None
    assert budget.refused(159.9) is None
    assert budget.refused(160.0) == 3  # the next line says how many since the last
    assert budget.refused(161.0) is None


# ----- through the handler ----------------------------------------------------------------


def make(budget: int, queue: RouterQueue | None = None) -> ExtProcHandler:
    pool = WorkerPool(BusyThresholds(0.5, 100_000), queue_threshold=1.0 if queue else None)
    pool.announce("a", model="m", endpoint="10.0.0.1:8000", kv_total_blocks=1000,
                  max_num_batched_tokens=100)  # fmt: skip
    pool.report_load("a", active_decode_blocks=0)
    if queue is not None:
        pool.on_capacity = queue.notify
    scheduler = Scheduler(pool, queue_threshold=1.0 if queue else None)
    return ExtProcHandler(
        pool, scheduler, Metrics(), protocol="epp", queue=queue, body_budget=BodyBudget(budget)
    )


def headers(length: int | None = None) -> bytes:
    pairs = {":path": CHAT, ":method": "POST"}
    if length is not None:
        pairs["content-length"] = str(length)
    hm = base_pb2.HeaderMap(
        headers=[base_pb2.HeaderValue(key=k, raw_value=v.encode()) for k, v in pairs.items()]
    )
    req = ep.ProcessingRequest(request_headers=ep.HttpHeaders(headers=hm))
    req.protocol_config.request_body_mode = DUPLEX
    req.protocol_config.response_body_mode = DUPLEX
    return req.SerializeToString()


def chunk(data: bytes, end: bool) -> bytes:
    return ep.ProcessingRequest(
        request_body=ep.HttpBody(body=data, end_of_stream=end)
    ).SerializeToString()


def body(size: int) -> bytes:
    """A chat request body of exactly ``size`` bytes."""
    empty = json.dumps({"model": "m", "messages": [{"role": "user", "content": ""}]})
    return json.dumps(
        {"model": "m", "messages": [{"role": "user", "content": "x" * (size - len(empty))}]}
    ).encode()


def session(handler: ExtProcHandler) -> RequestSession:
    s = handler.open_session({})
    assert isinstance(s, RequestSession)
    return s


def local(reply: object) -> tuple[int, dict[str, str]]:
    assert isinstance(reply, bytes)
    imm = ep.ProcessingResponse.FromString(reply).immediate_response
    hdrs = {h.header.key: h.header.raw_value.decode() for h in imm.headers.set_headers}
    return imm.status.code, hdrs


def routed(reply: object) -> bool:
    return (
        isinstance(reply, list)
        and ep.ProcessingResponse.FromString(reply[0]).WhichOneof("response") == "request_headers"
    )


def buffered(handler: ExtProcHandler) -> float | None:
    return handler.metrics.registry.get_sample_value("extproc_buffered_body_bytes")


def rejected(handler: ExtProcHandler, reason: str) -> float | None:
    return handler.metrics.registry.get_sample_value(
        "extproc_request_body_rejections_total", {"reason": reason}
    )


def test_a_chunk_past_the_budget_is_the_overload_reply_and_the_others_go_on() -> None:
    handler = make(64 * KIB)  # large bodies: 56 KiB in all
    first, second = session(handler), session(handler)
    assert first.receive(headers()) is None and second.receive(headers()) is None
    raw = body(40 * KIB)
    assert first.receive(chunk(raw[: 30 * KIB], False)) is None
    assert second.receive(chunk(raw[: 20 * KIB], False)) is None
    assert buffered(handler) == 50 * KIB
    # 30 + 20 + 10 > 56: the second's chunk is refused, and what it held is given back.
    status, hdrs = local(second.receive(chunk(raw[20 * KIB : 30 * KIB], False)))
    assert status == 529 and hdrs[SHED_REASON_HEADER] == BODY_BUDGET_REASON
    assert hdrs["retry-after"] == "1"
    assert buffered(handler) == 30 * KIB
    assert rejected(handler, "budget") == 1 and rejected(handler, "too_large") == 0
    # Chunks of the refused stream still on their way are not gathered.
    second.receive(chunk(raw[30 * KIB :], True))
    assert buffered(handler) == 30 * KIB
    # The first goes on, is routed, and holds nothing once decided.
    assert routed(first.receive(chunk(raw[30 * KIB :], True)))
    assert buffered(handler) == 0
    second.close()
    first.close()
    assert handler.body_budget.used == 0 and handler.body_budget.streams == 0


def test_a_refusal_is_logged_naming_the_setting_then_at_most_once_a_minute(
    caplog: pytest.LogCaptureFixture,
) -> None:
    handler = make(64 * KIB)
    holder = session(handler)
    assert holder.receive(headers(50 * KIB)) is None
    with caplog.at_level(logging.WARNING, logger="extproc.handlers"):
        for _ in range(3):
            assert local(session(handler).receive(headers(10 * KIB)))[0] == 529
    lines = [r.getMessage() for r in caplog.records if "body budget" in r.getMessage()]
    assert lines == [
        "request body budget full: 1 body refused with the overload reply since the last "
        f"line; the full-duplex bodies being gathered (1) hold {50 * KIB} of {64 * KIB} bytes "
        "(--request-body-budget-mib); counted in extproc_request_body_rejections_total"
    ]
    assert rejected(handler, "budget") == 3


def test_a_declared_length_is_taken_at_the_headers() -> None:
    handler = make(64 * KIB)
    first, second = session(handler), session(handler)
    raw = body(40 * KIB)
    assert first.receive(headers(len(raw))) is None
    assert buffered(handler) == len(raw)  # before a byte of the body
    # 40 + 40 > 56: refused on the headers, before the client sends its body.
    status, hdrs = local(second.receive(headers(len(raw))))
    assert status == 529 and hdrs[SHED_REASON_HEADER] == BODY_BUDGET_REASON
    assert buffered(handler) == len(raw)
    assert first.receive(chunk(raw[:1000], False)) is None
    assert buffered(handler) == len(raw)  # already held
    assert routed(first.receive(chunk(raw[1000:], True)))
    assert buffered(handler) == 0


def test_small_requests_are_routed_while_large_bodies_hold_all_they_may() -> None:
    handler = make(64 * KIB)
    big = session(handler)
    assert big.receive(headers(56 * KIB)) is None
    assert local(session(handler).receive(headers(9 * KIB)))[0] == 529  # large: no room
    for _ in range(20):  # small bodies come and go in the reserve
        small = session(handler)
        raw = body(2 * KIB)
        assert small.receive(headers(len(raw))) is None
        assert routed(small.receive(chunk(raw, True)))
        small.close()
    assert buffered(handler) == 56 * KIB
    big.close()
    assert buffered(handler) == 0


def test_a_body_larger_than_any_may_be_is_400_at_once() -> None:
    handler = make(64 * KIB)
    status, _ = local(session(handler).receive(headers(56 * KIB + 1)))
    assert status == 400
    s = session(handler)
    assert s.receive(headers()) is None
    reply = s.receive(chunk(b"x" * (56 * KIB + 1), False))
    assert isinstance(reply, bytes)
    imm = ep.ProcessingResponse.FromString(reply).immediate_response
    assert imm.status.code == 400 and b"larger than 57344 bytes" in imm.body
    assert rejected(handler, "too_large") == 2 and buffered(handler) == 0


def test_a_stream_that_ends_mid_upload_gives_its_bytes_back() -> None:
    """The client went away: Envoy resets the ext_proc stream, the session closes."""
    handler = make(64 * KIB)
    raw = body(40 * KIB)
    declared, chunked = session(handler), session(handler)
    assert declared.receive(headers(len(raw))) is None
    assert chunked.receive(headers()) is None
    assert chunked.receive(chunk(raw[: 10 * KIB], False)) is None
    assert buffered(handler) == len(raw) + 10 * KIB
    declared.close()
    chunked.close()
    assert buffered(handler) == 0 and handler.body_budget.streams == 0
    assert handler.metrics.registry.get_sample_value("extproc_streams") == 0


def test_trailers_end_the_body_and_release_it() -> None:
    handler = make(64 * KIB)
    s = session(handler)
    raw = body(4 * KIB)
    assert s.receive(headers()) is None
    assert s.receive(chunk(raw, False)) is None
    trailers = ep.ProcessingRequest(request_trailers=ep.HttpTrailers()).SerializeToString()
    assert routed(s.receive(trailers))
    assert buffered(handler) == 0


async def test_a_body_waiting_in_the_router_queue_is_held_until_it_goes_on() -> None:
    handler = make(64 * KIB, RouterQueue(timeout=10.0))
    raw = body(600)  # 150 prompt tokens: one request fills the worker's queue limit of 100
    first = session(handler)
    assert first.receive(headers()) is None
    assert routed(first.receive(chunk(raw, True)))
    waiting = session(handler)
    assert waiting.receive(headers()) is None
    reply = waiting.receive(chunk(raw, True))
    assert isinstance(reply, tuple)  # (extend the timeout now, the rest once dispatched)
    _, rest = reply
    task = asyncio.ensure_future(rest)
    await asyncio.sleep(0)
    assert not task.done() and buffered(handler) == len(raw)
    first.close()  # the first request ends: capacity, the queue dispatches
    out = await asyncio.wait_for(task, 5.0)
    assert routed(out)
    assert buffered(handler) == 0


def test_whatever_the_streams_do_the_budget_holds_and_ends_empty() -> None:
    """Random streams (declared or not, chunks of any size, trailers, closed at any point)
    never take the total past the budget, and leave nothing held once they end."""
    rng = random.Random(7)
    handler = make(64 * KIB)
    budget = handler.body_budget
    open_: list[tuple[RequestSession, bytes, int]] = []  # session, body, bytes sent
    for _ in range(3000):
        action = rng.random()
        if action < 0.15 or not open_:
            s = session(handler)
            raw = body(rng.choice([200, 2 * KIB, 7 * KIB, 20 * KIB, 40 * KIB, 60 * KIB]))
            s.receive(headers(len(raw) if rng.random() < 0.5 else None))
            open_.append((s, raw, 0))
        elif action < 0.25:
            s, _, _ = open_.pop(rng.randrange(len(open_)))
            s.close()
        else:
            i = rng.randrange(len(open_))
            s, raw, sent = open_[i]
            n = min(len(raw) - sent, rng.choice([100, 1 * KIB, 8 * KIB, 30 * KIB]))
            if sent + n == len(raw) and rng.random() < 0.3:
                s.receive(chunk(raw[sent:], False))
                s.receive(
                    ep.ProcessingRequest(request_trailers=ep.HttpTrailers()).SerializeToString()
                )
            else:
                s.receive(chunk(raw[sent : sent + n], sent + n == len(raw)))
            if sent + n == len(raw):
                open_.pop(i)
                s.close()
            else:
                open_[i] = (s, raw, sent + n)
        assert 0 <= budget.used <= budget.limit
        assert buffered(handler) == budget.used
    assert rejected(handler, "budget")  # the budget was in the way at times
    for s, _, _ in open_:
        s.close()
    assert budget.used == 0 and budget.streams == 0


# ----- the setting ------------------------------------------------------------------------


def test_the_budget_setting_by_flag_and_env_with_its_default() -> None:
    assert load_settings([], {}).request_body_budget_mib == DEFAULT_BUDGET_MIB
    env = {"EXTPROC_REQUEST_BODY_BUDGET_MIB": "512"}
    assert load_settings([], env).request_body_budget_mib == 512
    assert load_settings(["--request-body-budget-mib", "64"], env).request_body_budget_mib == 64


@pytest.mark.parametrize(
    ("argv", "env", "where", "value"),
    [
        (["--request-body-budget-mib", "0"], {}, "--request-body-budget-mib", "'0'"),
        (["--request-body-budget-mib", "1.5"], {}, "--request-body-budget-mib", "'1.5'"),
        (["--request-body-budget-mib", "256MiB"], {}, "--request-body-budget-mib", "'256MiB'"),
        ([], {"EXTPROC_REQUEST_BODY_BUDGET_MIB": "-1"}, "EXTPROC_REQUEST_BODY_BUDGET_MIB", "'-1'"),
        (
            [],
            {"EXTPROC_REQUEST_BODY_BUDGET_MIB": str(2**20 + 1)},
            "EXTPROC_REQUEST_BODY_BUDGET_MIB",
            f"'{2**20 + 1}'",
        ),
    ],
)
def test_a_bad_budget_names_the_flag_the_value_and_what_was_expected(
    argv: list[str], env: dict[str, str], where: str, value: str
) -> None:
    with pytest.raises(SettingsError) as err:
        load_settings(argv, env)
    assert str(err.value) == (
        f"invalid {where} value {value}: expected a whole number of MiB in [1, {2**20}]"
    )


def test_help_lists_the_budget_with_its_unit() -> None:
    text = " ".join(build_parser().format_help().split())
    assert "--request-body-budget-mib MIB MiB:" in text
    assert "[env EXTPROC_REQUEST_BODY_BUDGET_MIB]" in text
    assert f"Default: {DEFAULT_BUDGET_MIB}" in text
