"""Fuzzing the event plane: random and mutated frames into the real subscriber and pool.

Properties (docs/events.md): nothing a publisher sends raises out of ``on_message``; a
dropped message changes no state; every message is counted exactly once, as received
(``extproc_events_total{topic}``) or dropped (``extproc_events_dropped_total{reason}``)
with a documented reason. Seeded (``derandomize``) and bounded by ``max_examples``.
"""

from __future__ import annotations

import asyncio
import json
import logging
import math
from typing import Any

import msgspec
import zmq
import zmq.asyncio
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from extproc.core.allowlist import WorkerAllowList
from extproc.core.busy import BusyThresholds
from extproc.core.pool import WorkerPool
from extproc.devstack import free_port
from extproc.events.schema import DROP_REASONS
from extproc.events.subscriber import EventSubscriber
from extproc.metrics.registry import Metrics

EXAMPLES = 300
STREAM_MESSAGES = 400
# Cases run, printed and checked at the end of the module (pytest -s shows them).
RUN = {"examples": 0, "messages": 0, "received": 0, "dropped": 0}
REASONS_SEEN: set[str] = set()

WORKER_IDS = ["a", "b", "c", ""]
ENDPOINTS = ["127.0.0.1:8000", "127.0.0.1:8001", "127.0.0.2:9", "10.0.0.1:80", "h:0", "[::1]:9"]
HUGE = [2**64 - 1, 2**64, 2**200, -1, -(2**63) - 1, 0, 1, 4095, 4096, 4097]


class Clock:
    """A clock the test moves, so ``last_seen`` only changes when the pool writes it."""

    t = 1000.0

    def __call__(self) -> float:
        return self.t


# ----- values and messages -----------------------------------------------------------

scalars = st.one_of(
    st.sampled_from(HUGE),
    st.integers(),
    st.floats(allow_nan=True, allow_infinity=True),
    st.sampled_from([60.0, math.nan, math.inf, -math.inf, True, False, None]),
    st.text(max_size=20),
    st.just("x" * 100_000),
    st.binary(max_size=20),
)
values = st.recursive(
    scalars,
    lambda inner: st.one_of(
        st.lists(inner, max_size=4), st.dictionaries(st.text(max_size=8), inner, max_size=4)
    ),
    max_leaves=8,
)

config_msg = st.fixed_dictionaries(
    {"v": st.just(1), "worker_id": st.sampled_from(WORKER_IDS[:3]), "model": st.sampled_from("mn")},
    optional={
        "endpoint": st.sampled_from(ENDPOINTS),
        "kv_total_blocks": st.sampled_from([None, 0, 100, 1000, 2**64 - 1]),
        "block_size": st.sampled_from([1, 16, 2**32]),
        "max_num_batched_tokens": st.sampled_from([1, 2048, 2**63]),
        "dp_size": st.integers(1, 4),
        "worker_type": st.sampled_from(["decode", "prefill"]),
    },
)
load_msg = st.fixed_dictionaries(
    {"v": st.just(1), "worker_id": st.sampled_from(WORKER_IDS[:3])},
    optional={
        "dp_rank": st.integers(0, 5),
        "active_decode_blocks": st.integers(0, 2000),
        "active_prefill_tokens": st.integers(0, 10_000),
        "kv_total_blocks": st.integers(0, 2000),
        "seq": st.integers(-5, 50),
        "num_requests_waiting": st.integers(0, 100),
        "request_active_slots": st.integers(0, 256),
        "request_total_slots": st.integers(0, 256),
    },
)
bye_msg = st.fixed_dictionaries({"v": st.just(1), "worker_id": st.sampled_from(WORKER_IDS[:3])})
valid = st.one_of(
    st.tuples(st.just(b"config"), config_msg),
    st.tuples(st.just(b"load"), load_msg),
    st.tuples(st.just(b"bye"), bye_msg),
)
topics = st.one_of(
    st.sampled_from([b"config", b"load", b"bye", b"", b"CONFIG", b"load\x00", b"\xff\xfe"]),
    st.binary(max_size=12),
)

# Hand-written payloads the encoders cannot produce: non-UTF-8 strings, bin for str, a
# msgpack uint64 read as an int field, nested maps where ints belong, truncated headers.
RAW = [
    b"\x82\xa9worker_id\xa2\xff\xfe\xa1v\x01",  # msgpack str holding invalid UTF-8
    b"\x82\xa9worker_id\xc4\x01a\xa1v\x01",  # bin where a str is expected
    b'{"worker_id": "\xff\xfe", "v": 1}',  # JSON with invalid UTF-8
    b'{"worker_id": "a", "model": "m", "endpoint": "127.0.0.1:8000", "v": 1.0}',
    b'{"worker_id": "a", "active_decode_blocks": NaN}',
    b'{"worker_id": "a", "active_decode_blocks": Infinity}',
    b'{"worker_id": "a", "active_decode_blocks": 1e999}',
    b'{"worker_id": "a", "active_decode_blocks": 340282366920938463463374607431768211456}',
    b'{"worker_id": "a", "worker_id": "b", "v": 1}',  # duplicate key
    b"\x83\xa9worker_id\xa1a\xa1v\x01\xb4active_decode_blocks\xcf\xff\xff\xff\xff\xff\xff\xff\xff",
    b"\x82\xa9worker_id\xa1a\xa4seq\xd3\x80\x00\x00\x00\x00\x00\x00\x00",  # int64 min
    b"\xcf\xff\xff\xff\xff\xff\xff\xff",  # a bare uint64
    b"\xdf\xff\xff\xff\xff",  # map32 claiming 4 billion entries
    b"\xdb\xff\xff\xff\xff",  # str32 claiming 4 GB
    b"{",
    b"[",
    b"null",
    b"",
]


def _encode(obj: Any, as_json: bool) -> bytes:
    if as_json:
        return json.dumps(obj, default=lambda b: b.decode("latin-1")).encode("utf-8", "replace")
    try:
        return msgspec.msgpack.encode(obj)
    except (OverflowError, TypeError, ValueError):  # an int beyond 64 bits: send JSON
        return _encode(obj, True)


@st.composite
def frames(draw: st.DrawFn) -> list[bytes]:
    kind = draw(st.sampled_from(["valid", "mutated", "truncated", "raw", "parts", "topic"]))
    topic, body = draw(valid)
    as_json = draw(st.booleans())
    if kind == "mutated":
        body = dict(body)
        key = draw(
            st.sampled_from(
                [
                    *body,
                    *("v", "endpoint", "dp_size", "dp_rank", "seq", "kv_total_blocks", "x"),
                    *("num_requests_waiting", "request_active_slots", "request_total_slots"),
                ]
            )
        )
        if draw(st.booleans()) and key in body:
            del body[key]
        else:
            body[key] = draw(values)
    payload = _encode(body, as_json)
    if kind == "truncated":
        payload = payload[: draw(st.integers(0, max(0, len(payload) - 1)))]
    elif kind == "raw":
        payload = draw(st.one_of(st.sampled_from(RAW), st.binary(max_size=64)))
    elif kind == "topic":
        topic = draw(topics)
    if kind == "parts":
        return draw(st.lists(st.binary(max_size=40), min_size=1, max_size=4))
    return [topic, payload]


# ----- state and counts ----------------------------------------------------------------


def snapshot(pool: WorkerPool) -> Any:
    """Everything an event can change, as plain values."""
    workers = {
        wid: (
            w.model,
            w.endpoint,
            w.kv_total_blocks,
            w.block_size,
            w.max_num_batched_tokens,
            w.dp_size,
            w.worker_type,
            w.configured,
            w.last_seen,
            w.last_load_at,
            w.last_seq,
            w.busy,
            w.overloaded_until,
            w.queue_limit,
            [
                (
                    r.index,
                    r.reported_blocks,
                    r.reported_prefill,
                    r.reported_kv_total,
                    r.reported_at,
                    r.est_blocks,
                    r.est_prefill,
                    r.inflight,
                    r.limits,
                    r.busy_reason,
                )
                for r in w.ranks
            ],
        )
        for wid, w in pool.workers.items()
    }
    return (
        workers,
        dict(pool.thresholds),
        {m: [w.worker_id for w in ws] for m, ws in pool.by_model.items()},
        {e: w.worker_id for e, w in pool.by_endpoint.items()},
        pool.events_lost,
    )


def counts(metrics: Metrics) -> tuple[dict[str, float], dict[str, float]]:
    received: dict[str, float] = {}
    dropped: dict[str, float] = {}
    for family in metrics.registry.collect():
        for s in family.samples:
            if s.name == "extproc_events_total":
                received[s.labels["topic"]] = s.value
            elif s.name == "extproc_events_dropped_total":
                dropped[s.labels["reason"]] = s.value
    return received, dropped


def _diff(after: dict[str, float], before: dict[str, float]) -> dict[str, float]:
    return {k: v - before.get(k, 0) for k, v in after.items() if v != before.get(k, 0)}


def fresh() -> tuple[WorkerPool, Metrics, EventSubscriber]:
    pool = WorkerPool(
        BusyThresholds(0.5, 5000, 1.5),
        allow=WorkerAllowList.from_entries(["127.0.0.0/8", "::1"]),
        queue_threshold=0.75,
        clock=Clock(),
    )
    metrics = Metrics()
    sub = EventSubscriber(pool, metrics)
    for frame in (
        [b"config", _encode({"worker_id": "a", "model": "m", "endpoint": ENDPOINTS[0]}, False)],
        [b"config", _encode({"worker_id": "b", "model": "n", "endpoint": ENDPOINTS[1]}, True)],
        [b"load", _encode({"worker_id": "a", "active_decode_blocks": 10, "seq": 1}, False)],
    ):
        sub.on_message(frame)
    sub.flush_counts()
    assert set(pool.workers) == {"a", "b"}
    return pool, metrics, sub


def feed_one(pool: WorkerPool, metrics: Metrics, sub: EventSubscriber, msg: list[bytes]) -> None:
    """Apply one message and check it was counted once and, if dropped, changed nothing."""
    before, (rec0, drop0) = snapshot(pool), counts(metrics)
    sub.on_message(msg)
    sub.flush_counts()
    after, (rec1, drop1) = snapshot(pool), counts(metrics)
    got_rec, got_drop = _diff(rec1, rec0), _diff(drop1, drop0)
    RUN["messages"] += 1
    if got_drop:
        assert got_drop == {next(iter(got_drop)): 1} and not got_rec, (msg, got_rec, got_drop)
        reason = next(iter(got_drop))
        assert reason in DROP_REASONS, reason
        assert after == before, f"dropped ({reason}) but changed state: {msg!r}"
        RUN["dropped"] += 1
        REASONS_SEEN.add(reason)
    else:
        assert got_rec == {msg[0].decode(): 1}, (msg, got_rec)
        assert len(msg) == 2
        RUN["received"] += 1


@settings(
    max_examples=EXAMPLES,
    derandomize=True,
    deadline=None,
    database=None,
    suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large],
)
@given(messages=st.lists(frames(), min_size=1, max_size=6), ticks=st.integers(0, 3))
def _fuzz_frames(messages: list[list[bytes]], ticks: int) -> None:
    pool, metrics, sub = fresh()
    assert isinstance(pool.clock, Clock)
    for msg in messages:
        pool.clock.t += ticks  # a received message may move last_seen; a dropped one not
        feed_one(pool, metrics, sub, msg)
    RUN["examples"] += 1


class _Errors(logging.Handler):
    def __init__(self) -> None:
        super().__init__(logging.ERROR)
        self.messages: list[str] = []

    def emit(self, record: logging.LogRecord) -> None:
        self.messages.append(record.getMessage())


_CFG = {"v": 1, "worker_id": "a", "model": "m", "endpoint": ENDPOINTS[0]}
# One message per drop reason, in every run whatever hypothesis draws.
FIXED: list[list[bytes]] = [
    [b"load"],
    [b"hello", _encode(_CFG, False)],
    [b"load", b"\xc1"],
    [b"load", _encode({"worker_id": "a", "active_decode_blocks": True}, True)],
    [
        b"load",
        _encode({"worker_id": "a", "active_decode_blocks": 5, "num_requests_waiting": -1}, False),
    ],
    [b"load", _encode({"worker_id": "a", "request_total_slots": 60.0}, True)],
    [b"load", _encode({"worker_id": "a", "dp_rank": 3, "active_decode_blocks": 1}, False)],
    [b"config", _encode({**_CFG, "v": 2}, False)],
    [b"config", _encode({**_CFG, "endpoint": "h:0"}, False)],
    [b"config", _encode({**_CFG, "endpoint": "10.0.0.1:80"}, False)],
]


def test_fuzzed_frames_never_raise_are_counted_once_and_drops_change_nothing() -> None:
    RUN.update(dict.fromkeys(RUN, 0))
    REASONS_SEEN.clear()
    errors, log = _Errors(), logging.getLogger("extproc.events")
    log.addHandler(errors)
    try:
        pool, metrics, sub = fresh()
        for msg in FIXED:
            feed_one(pool, metrics, sub, msg)
        assert set(DROP_REASONS) == REASONS_SEEN
        _fuzz_frames()
    finally:
        log.removeHandler(errors)
    # The subscriber's catch-all ("unexpected error applying an event") never fired.
    assert errors.messages == []
    print(f"\nevent fuzz: {RUN}, drop reasons seen: {sorted(REASONS_SEEN)}")
    assert RUN["examples"] == EXAMPLES
    assert RUN["received"] > 50 and RUN["dropped"] > 200
    assert set(DROP_REASONS) == REASONS_SEEN


# ----- through a real PUB socket into the subscriber's bound SUB socket -----------------


async def _until(cond: Any, what: str, timeout: float = 5.0) -> None:
    loop = asyncio.get_running_loop()
    deadline = loop.time() + timeout
    while not cond():
        assert loop.time() < deadline, f"timed out waiting for {what}"
        await asyncio.sleep(0.005)


async def test_fuzzed_stream_through_zmq_then_a_valid_config_still_applies() -> None:
    pool = WorkerPool(BusyThresholds(0.5), clock=Clock())
    metrics = Metrics()
    sub = EventSubscriber(pool, metrics)
    endpoint = f"tcp://127.0.0.1:{free_port()}"
    await sub.start([endpoint], [])
    pub = zmq.asyncio.Context.instance().socket(zmq.PUB)
    pub.setsockopt(zmq.LINGER, 0)
    pub.setsockopt(zmq.SNDHWM, 0)
    pub.connect(endpoint)
    try:

        async def join() -> None:  # PUB/SUB joins late: send until one lands
            while "join" not in pool.workers:
                await pub.send_multipart(
                    [
                        b"config",
                        _encode({"worker_id": "join", "model": "m", "endpoint": "h:1"}, False),
                    ]
                )
                await asyncio.sleep(0.01)

        await asyncio.wait_for(join(), 5)
        received, dropped = counts(metrics)
        base = sum(received.values()) + sum(dropped.values())
        sent = _seeded_stream(STREAM_MESSAGES)
        for msg in sent:
            await pub.send_multipart(msg)
        total = base + len(sent)

        def all_counted() -> bool:
            rec, drop = counts(metrics)
            return sum(rec.values()) + sum(drop.values()) >= total

        await _until(all_counted, f"{len(sent)} fuzzed messages counted")
        rec, drop = counts(metrics)
        assert sum(rec.values()) + sum(drop.values()) == total
        assert set(drop) <= set(DROP_REASONS)
        good = {"v": 1, "worker_id": "after", "model": "m2", "endpoint": "127.0.0.1:7000"}
        await pub.send_multipart([b"config", _encode(good, False)])
        await _until(lambda: "after" in pool.workers, "the valid config after the fuzz")
        worker = pool.workers["after"]
        assert (worker.model, worker.endpoint, worker.configured) == ("m2", "127.0.0.1:7000", True)
        assert pool.by_endpoint[("127.0.0.1:7000", "m2")] is worker
        print(f"\nevent fuzz through ZMQ: {len(sent)} messages, dropped {dict(drop)}")
    finally:
        pub.close(0)
        sub.close()


def _seeded_stream(n: int) -> list[list[bytes]]:
    """``n`` fuzzed messages drawn reproducibly (a derandomized hypothesis run collects them)."""
    out: list[list[bytes]] = []

    @settings(
        max_examples=n,
        derandomize=True,
        deadline=None,
        database=None,
        suppress_health_check=list(HealthCheck),
    )
    @given(msg=frames())
    def collect(msg: list[bytes]) -> None:
        if len(out) < n:
            out.append(msg)

    collect()
    assert len(out) >= n // 2, len(out)
    return out
