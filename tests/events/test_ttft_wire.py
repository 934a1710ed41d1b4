"""The optional ``ttft_seconds`` of a load event: validated at the edge, sent once."""

from __future__ import annotations

import json

import pytest

from extproc.events.schema import TOPIC_LOAD, EventRejected, LoadEvent, decode, encode


def _load(**extra: object) -> bytes:
    return json.dumps({"worker_id": "w", "active_prefill_tokens": 1, **extra}).encode()


def test_buckets_round_trip_and_absent_means_not_reported() -> None:
    event = decode(TOPIC_LOAD, _load(ttft_seconds=[[0.1, 3], [0.25, 1]]))
    assert isinstance(event, LoadEvent) and event.ttft_seconds == [(0.1, 3), (0.25, 1)]
    assert decode(*encode(event)) == event
    plain = decode(TOPIC_LOAD, _load())
    assert isinstance(plain, LoadEvent) and plain.ttft_seconds is None


@pytest.mark.parametrize(
    ("buckets", "needle"),
    [
        ([[0.25, 1], [0.1, 3]], "bounds must increase"),
        ([[0.1, 1], [0.1, 3]], "bounds must increase"),
        ([[0, 1]], "ttft_seconds"),
        ([[-1.0, 1]], "ttft_seconds"),
        ([[0.1, -1]], "ttft_seconds"),
        ([[0.1, 1.5]], "ttft_seconds"),
        ([[0.1]], "ttft_seconds"),
        ("fast", "ttft_seconds"),
        ([[0.001 * (i + 1), 1] for i in range(65)], "ttft_seconds"),
    ],
)
def test_bad_buckets_drop_the_whole_message(buckets: object, needle: str) -> None:
    with pytest.raises(EventRejected) as err:
        decode(TOPIC_LOAD, _load(ttft_seconds=buckets))
    assert err.value.reason == "bad_schema" and needle in str(err.value.detail)
