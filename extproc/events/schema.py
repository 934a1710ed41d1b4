"""Wire format of worker load events, in one place.

Each ZeroMQ message is two frames, ``[topic, payload]``. The payload is a
msgpack map, or JSON when its first byte is ``{``. Maps carry ``"v": 1``; a
missing ``v`` reads as 1. Unknown keys are ignored; a missing optional key
means "not reported". Integers must be integers: ``true`` or ``60.0`` is a
wrong type, and the whole message is dropped.

Publishers encode with :func:`encode`; the subscriber decodes with
:func:`decode`, which either returns a typed event or raises
:class:`EventRejected` carrying a drop reason for metrics.
"""

from __future__ import annotations

import itertools
import math
from typing import Annotated, Any, Literal

import msgspec

from extproc.core.busy import MAX_TARGET_MS, MAX_TOKEN_THRESHOLD
from extproc.core.endpoint import parse_endpoint

WIRE_VERSION = 1

NonNegInt = Annotated[int, msgspec.Meta(ge=0)]
TargetMs = Annotated[float, msgspec.Meta(gt=0, le=MAX_TARGET_MS)]
# The engine's own TTFT of the requests whose first token came since its previous report:
# [upper bound in seconds, requests] per histogram bucket, bounds increasing.
TTFT_BUCKETS_MAX = 64
TTFT_COUNT_MAX = 10**6
# The bounds a publisher counts TTFT in: vLLM's ``vllm:time_to_first_token_seconds``
# buckets, so the agent passes vLLM's counts on as they are.
TTFT_BOUNDS = (0.001, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1.0, 2.5,
               5.0, 7.5, 10.0, 20.0, 40.0, 80.0, 160.0, 640.0, 2560.0)  # fmt: skip
TtftBucket = tuple[
    Annotated[float, msgspec.Meta(gt=0, le=86_400)],
    Annotated[int, msgspec.Meta(ge=0, le=TTFT_COUNT_MAX)],
]
PosInt = Annotated[int, msgspec.Meta(gt=0)]
WorkerId = Annotated[str, msgspec.Meta(min_length=1, max_length=256)]

TOPIC_CONFIG = b"config"
TOPIC_LOAD = b"load"
TOPIC_BYE = b"bye"
# Between extproc replicas (docs/replicas.md).
TOPIC_ESTIMATE = b"estimate"
TOPIC_THRESHOLDS = b"thresholds"
TOPIC_REPLICA_BYE = b"replica_bye"
TOPIC_CLASSES = b"classes"


class ConfigEvent(msgspec.Struct, kw_only=True, frozen=True):
    """Registration, runtime config and heartbeat of one worker."""

    worker_id: WorkerId
    model: Annotated[str, msgspec.Meta(min_length=1, max_length=512)]
    endpoint: Annotated[str, msgspec.Meta(min_length=3, max_length=300)]
    kv_total_blocks: NonNegInt | None = None
    block_size: PosInt | None = None
    max_num_batched_tokens: PosInt | None = None
    dp_size: Annotated[int, msgspec.Meta(ge=1, le=4096)] | None = None
    worker_type: Literal["decode", "prefill"] | None = None
    v: int = WIRE_VERSION


class LoadEvent(msgspec.Struct, kw_only=True, frozen=True):
    """ActiveLoad of one data-parallel rank of one worker."""

    worker_id: WorkerId
    dp_rank: Annotated[int, msgspec.Meta(ge=0, le=4095)] | None = None
    active_decode_blocks: NonNegInt | None = None
    active_prefill_tokens: NonNegInt | None = None
    kv_total_blocks: NonNegInt | None = None
    seq: int | None = None
    # The engine's queue and sequence slots on this rank (Dynamo's WorkerStats names): requests
    # queued at the engine, not yet running; sequences running; the most sequences the rank runs
    # at once (0 = unknown). For deadline admission and diagnostics, never for the busy rules.
    num_requests_waiting: NonNegInt | None = None
    request_active_slots: NonNegInt | None = None
    request_total_slots: NonNegInt | None = None
    ttft_seconds: Annotated[list[TtftBucket], msgspec.Meta(max_length=TTFT_BUCKETS_MAX)] | None = (
        None
    )
    v: int = WIRE_VERSION


class ByeEvent(msgspec.Struct, kw_only=True, frozen=True):
    """The worker leaves now (graceful shutdown)."""

    worker_id: WorkerId
    v: int = WIRE_VERSION


ReplicaId = Annotated[str, msgspec.Meta(min_length=1, max_length=128)]
RankIndex = Annotated[int, msgspec.Meta(ge=0, le=4095)]


class EstimateEvent(msgspec.Struct, kw_only=True, frozen=True):
    """One extproc replica's whole router estimate: per rank with requests in flight,
    ``[worker_id, dp_rank, in_flight, blocks, prefill_tokens]``. Replaces its previous one."""

    replica_id: ReplicaId
    ranks: list[tuple[WorkerId, RankIndex, NonNegInt, NonNegInt, NonNegInt]] = []
    v: int = WIRE_VERSION


class ThresholdsEvent(msgspec.Struct, kw_only=True, frozen=True):
    """A model's thresholds as changed on ``writer`` at ``version`` (null = off); the newest
    (version, writer) wins on every replica."""

    replica_id: ReplicaId
    model: Annotated[str, msgspec.Meta(min_length=1, max_length=512)]
    version: Annotated[int, msgspec.Meta(ge=1)]
    writer: Annotated[str, msgspec.Meta(max_length=128)]
    active_decode_blocks_threshold: Annotated[float, msgspec.Meta(ge=0, le=1)] | None = None
    active_prefill_tokens_threshold: NonNegInt | None = None
    active_prefill_tokens_threshold_frac: Annotated[float, msgspec.Meta(ge=0)] | None = None
    # Latency targets in ms; absent (a replica that predates them) = none set.
    ttft_p99_target_ms: TargetMs | None = None
    itl_p99_target_ms: TargetMs | None = None
    v: int = WIRE_VERSION


class ClassEvent(msgspec.Struct, kw_only=True, frozen=True):
    """A request class as changed on ``writer`` at ``version``: its whole settings, in the
    shape of ``GET /classes``; validated like the classes file before it applies."""

    replica_id: ReplicaId
    name: Annotated[str, msgspec.Meta(min_length=1, max_length=64)]
    version: Annotated[int, msgspec.Meta(ge=1)]
    writer: Annotated[str, msgspec.Meta(max_length=128)]
    settings: dict[str, Any]
    v: int = WIRE_VERSION


class ReplicaByeEvent(msgspec.Struct, kw_only=True, frozen=True):
    """The extproc replica stops now: drop its estimate."""

    replica_id: ReplicaId
    v: int = WIRE_VERSION


Event = (
    ConfigEvent
    | LoadEvent
    | ByeEvent
    | EstimateEvent
    | ThresholdsEvent
    | ClassEvent
    | ReplicaByeEvent
)


class EventRejected(Exception):
    """A message that is dropped whole; ``reason`` labels the drop metric."""

    def __init__(self, reason: str, detail: str) -> None:
        super().__init__(f"{reason}: {detail}")
        self.reason = reason
        self.detail = detail


# Drop reasons (values of extproc_events_dropped_total{reason}).
DROP_FRAMES = "bad_frames"
DROP_UNKNOWN_TOPIC = "unknown_topic"
DROP_ENCODING = "bad_encoding"
DROP_SCHEMA = "bad_schema"
DROP_VERSION = "bad_version"
DROP_ENDPOINT = "bad_endpoint"
DROP_NOT_ALLOWED = "endpoint_not_allowed"
DROP_REASONS = (
    DROP_FRAMES,
    DROP_UNKNOWN_TOPIC,
    DROP_ENCODING,
    DROP_SCHEMA,
    DROP_VERSION,
    DROP_ENDPOINT,
    DROP_NOT_ALLOWED,
)

_TYPES: dict[bytes, type[Event]] = {
    TOPIC_CONFIG: ConfigEvent,
    TOPIC_LOAD: LoadEvent,
    TOPIC_BYE: ByeEvent,
    TOPIC_ESTIMATE: EstimateEvent,
    TOPIC_THRESHOLDS: ThresholdsEvent,
    TOPIC_REPLICA_BYE: ReplicaByeEvent,
    TOPIC_CLASSES: ClassEvent,
}
_TOPICS = {cls: topic for topic, cls in _TYPES.items()}
_MSGPACK = {t: msgspec.msgpack.Decoder(cls) for t, cls in _TYPES.items()}
_JSON = {t: msgspec.json.Decoder(cls) for t, cls in _TYPES.items()}
_msgpack_encoder = msgspec.msgpack.Encoder()


def decode(topic: bytes, payload: bytes) -> Event:
    """Decode and validate one message; raise EventRejected to drop it."""
    decoders = _JSON if payload[:1] == b"{" else _MSGPACK
    decoder = decoders.get(topic)
    if decoder is None:
        raise EventRejected(DROP_UNKNOWN_TOPIC, f"topic {topic[:64]!r}")
    try:
        event = decoder.decode(payload)
    except msgspec.ValidationError as exc:
        raise EventRejected(DROP_SCHEMA, str(exc)) from None
    except msgspec.DecodeError as exc:
        raise EventRejected(DROP_ENCODING, str(exc)) from None
    if event.v != WIRE_VERSION:
        raise EventRejected(DROP_VERSION, f"v={event.v!r}, expected {WIRE_VERSION}")
    if type(event) is ConfigEvent:
        try:
            parse_endpoint(event.endpoint)
        except ValueError as exc:
            raise EventRejected(DROP_ENDPOINT, str(exc)) from None
    elif type(event) is LoadEvent:
        buckets = event.ttft_seconds
        if buckets and any(a[0] >= b[0] for a, b in itertools.pairwise(buckets)):
            raise EventRejected(DROP_SCHEMA, "ttft_seconds: bucket bounds must increase")
    elif type(event) is ThresholdsEvent:
        frac = event.active_prefill_tokens_threshold_frac
        if frac is not None and not math.isfinite(frac):
            raise EventRejected(DROP_SCHEMA, f"active_prefill_tokens_threshold_frac={frac}")
        tokens = event.active_prefill_tokens_threshold
        if tokens is not None and tokens > MAX_TOKEN_THRESHOLD:
            raise EventRejected(DROP_SCHEMA, f"active_prefill_tokens_threshold={tokens}")
    return event


def encode(event: Event) -> list[bytes]:
    """The two frames ``[topic, msgpack payload]`` of an event, unset keys omitted."""
    topic = _TOPICS[type(event)]
    fields = {
        k: getattr(event, k) for k in event.__struct_fields__ if getattr(event, k) is not None
    }
    return [topic, _msgpack_encoder.encode(fields)]
