"""``/busy_threshold`` (docs/admin-api.md): the validator as a table, then the real service."""

from __future__ import annotations

import json
from collections.abc import Iterator
from http.client import HTTPConnection
from pathlib import Path
from typing import Any

import pytest
from hypothesis import given
from hypothesis import strategies as st

from extproc.admin.thresholds import (
    ThresholdUpdate,
    ThresholdUpdateError,
    apply_update,
    decode_body,
    parse_threshold_update,
)
from extproc.core.busy import (
    DECODE,
    ITL_TARGET,
    PREFILL,
    PREFILL_FRAC,
    THRESHOLD_NAMES,
    TTFT_TARGET,
    BusyThresholds,
)
from extproc.core.pool import WorkerPool
from extproc.devstack import Extproc, Publisher, get_json, http, wait_until

MAX = 2**64 - 1
NAN, INF = float("nan"), float("inf")
ALL_NULL = {DECODE: None, PREFILL: None, PREFILL_FRAC: None}

# (body, expected): expected is (values, disable) for a valid body, else (status, text that the
# error message must contain: the field, and the value where there is one).
VALID: list[Any] = [
    pytest.param({"model": "m"}, ({}, set()), id="model-only-is-read"),
    pytest.param({"model": ""}, ({}, set()), id="empty-model-name-is-a-string"),
    pytest.param({"model": "m", DECODE: 0.5}, ({DECODE: 0.5}, set()), id="decode-half"),
    pytest.param({"model": "m", DECODE: 0}, ({DECODE: 0.0}, set()), id="decode-int-0"),
    pytest.param({"model": "m", DECODE: 1}, ({DECODE: 1.0}, set()), id="decode-int-1"),
    pytest.param({"model": "m", DECODE: -0.0}, ({DECODE: 0.0}, set()), id="decode-minus-zero"),
    pytest.param({"model": "m", PREFILL: 0}, ({PREFILL: 0}, set()), id="tokens-0"),
    pytest.param({"model": "m", PREFILL: MAX}, ({PREFILL: MAX}, set()), id="tokens-2^64-1"),
    pytest.param({"model": "m", PREFILL_FRAC: 0}, ({PREFILL_FRAC: 0.0}, set()), id="frac-0"),
    pytest.param({"model": "m", PREFILL_FRAC: 2.5}, ({PREFILL_FRAC: 2.5}, set()), id="frac>1"),
    pytest.param(
        {"model": "m", PREFILL_FRAC: 10**300}, ({PREFILL_FRAC: 1e300}, set()), id="frac-big-int"
    ),
    pytest.param(
        {"model": "m", DECODE: None, PREFILL: None, PREFILL_FRAC: None},
        ({}, set()),
        id="nulls-leave-unchanged",
    ),
    pytest.param(
        {"model": "m", DECODE: 0.25, PREFILL: 100, PREFILL_FRAC: 0.75},
        ({DECODE: 0.25, PREFILL: 100, PREFILL_FRAC: 0.75}, set()),
        id="all-three",
    ),
    pytest.param(
        {"model": "m", PREFILL: 5, "extra": [1, 2], "active_decode_blocks": "x"},
        ({PREFILL: 5}, set()),
        id="unknown-keys-ignored",
    ),
    pytest.param({"model": "m", "disable": []}, ({}, set()), id="disable-empty"),
    pytest.param({"model": "m", "disable": None}, ({}, set()), id="disable-null-is-absent"),
    pytest.param(
        {"model": "m", "disable": [DECODE, PREFILL, PREFILL_FRAC]},
        ({}, {DECODE, PREFILL, PREFILL_FRAC}),
        id="disable-all",
    ),
    pytest.param(
        {"model": "m", "disable": [PREFILL, PREFILL]}, ({}, {PREFILL}), id="disable-repeated"
    ),
    pytest.param(
        {"model": "m", "disable": [DECODE], PREFILL: 9},
        ({PREFILL: 9}, {DECODE}),
        id="disable-and-set-others",
    ),
    pytest.param(
        {"model": "m", "disable": [DECODE], DECODE: None},
        ({}, {DECODE}),
        id="disable-with-null-value",
    ),
]

INVALID: list[Any] = [
    pytest.param([], (422, "request body must be a JSON object"), id="body-array"),
    pytest.param("m", (422, "request body"), id="body-string"),
    pytest.param(None, (422, "got null"), id="body-null"),
    pytest.param(7, (422, "request body"), id="body-number"),
    pytest.param({}, (422, "model"), id="model-missing"),
    pytest.param({"model": None}, (422, "model must be"), id="model-null"),
    pytest.param({"model": 3}, (422, "got 3"), id="model-number"),
    pytest.param({"model": ["m"]}, (422, "model"), id="model-list"),
    pytest.param({"model": "m", DECODE: "0.5"}, (422, f'{DECODE} must be a number, got "0.5"'),
                 id="decode-string"),
    pytest.param({"model": "m", DECODE: True}, (422, "got true (boolean)"), id="decode-bool"),
    pytest.param({"model": "m", DECODE: [0.5]}, (422, DECODE), id="decode-list"),
    pytest.param({"model": "m", DECODE: 1.01}, (400, f"{DECODE} must be a number in [0, 1]"),
                 id="decode-above-1"),
    pytest.param({"model": "m", DECODE: -0.1}, (400, "got -0.1"), id="decode-negative"),
    pytest.param({"model": "m", DECODE: 2}, (400, DECODE), id="decode-int-2"),
    pytest.param({"model": "m", DECODE: 10**400}, (400, DECODE), id="decode-huge-int"),
    pytest.param({"model": "m", DECODE: NAN}, (400, "got NaN"), id="decode-nan"),
    pytest.param({"model": "m", DECODE: INF}, (400, "got Infinity"), id="decode-inf"),
    pytest.param({"model": "m", PREFILL: 5.0}, (422, "got 5.0 (number)"), id="tokens-float-5.0"),
    pytest.param({"model": "m", PREFILL: 5.5}, (422, PREFILL), id="tokens-float-5.5"),
    pytest.param({"model": "m", PREFILL: -1}, (422, "got -1"), id="tokens-negative"),
    pytest.param({"model": "m", PREFILL: -(2**70)}, (422, PREFILL), id="tokens-big-negative"),
    pytest.param({"model": "m", PREFILL: "100"}, (422, '"100" (string)'), id="tokens-string"),
    pytest.param({"model": "m", PREFILL: False}, (422, "false (boolean)"), id="tokens-bool"),
    pytest.param({"model": "m", PREFILL: NAN}, (422, PREFILL), id="tokens-nan"),
    pytest.param({"model": "m", PREFILL: INF}, (422, PREFILL), id="tokens-inf"),
    pytest.param({"model": "m", PREFILL: MAX + 1}, (422, f"got {MAX + 1}"), id="tokens-2^64"),
    pytest.param({"model": "m", PREFILL: 10**100}, (422, PREFILL), id="tokens-10^100"),
    pytest.param({"model": "m", PREFILL_FRAC: -0.5}, (400, PREFILL_FRAC), id="frac-negative"),
    pytest.param({"model": "m", PREFILL_FRAC: INF}, (400, "got Infinity"), id="frac-inf"),
    pytest.param({"model": "m", PREFILL_FRAC: -INF}, (400, PREFILL_FRAC), id="frac-minus-inf"),
    pytest.param({"model": "m", PREFILL_FRAC: NAN}, (400, "got NaN"), id="frac-nan"),
    pytest.param({"model": "m", PREFILL_FRAC: 10**400}, (400, PREFILL_FRAC), id="frac-huge-int"),
    pytest.param({"model": "m", PREFILL_FRAC: "1"}, (422, PREFILL_FRAC), id="frac-string"),
    pytest.param({"model": "m", "disable": DECODE}, (422, "disable must be a list"),
                 id="disable-string"),
    pytest.param({"model": "m", "disable": {DECODE: 1}}, (422, "disable"), id="disable-object"),
    pytest.param({"model": "m", "disable": [1]}, (422, "disable"), id="disable-number-item"),
    pytest.param({"model": "m", "disable": ["busy"]}, (422, 'unknown threshold "busy"'),
                 id="disable-unknown-name"),
    pytest.param({"model": "m", "disable": [PREFILL], PREFILL: 5},
                 (422, f"{PREFILL} is both in disable and given the value 5"),
                 id="disable-conflict"),
    pytest.param({"model": None, DECODE: 7}, (422, "model"), id="type-before-range:model"),
    pytest.param({"model": "m", DECODE: 7, PREFILL: 1.5}, (422, PREFILL),
                 id="type-before-range:fields"),
    pytest.param({"model": "m", DECODE: 7, "disable": ["x"]}, (422, "disable"),
                 id="type-before-range:disable"),
]  # fmt: skip


def _values_equal(got: dict[str, float | int], want: dict[str, float | int]) -> bool:
    return got == want and all(type(got[k]) is type(want[k]) for k in want)


@pytest.mark.parametrize(("body", "expected"), VALID)
def test_valid_bodies(body: object, expected: tuple[dict[str, Any], set[str]]) -> None:
    update = parse_threshold_update(body)
    values, disable = expected
    assert update.model == body["model"]  # type: ignore[index]
    assert _values_equal(update.values, values)
    assert update.disable == disable


@pytest.mark.parametrize(("body", "expected"), INVALID)
def test_invalid_bodies(body: object, expected: tuple[int, str]) -> None:
    status, needle = expected
    with pytest.raises(ThresholdUpdateError) as err:
        parse_threshold_update(body)
    assert err.value.status == status
    assert needle in err.value.message


@pytest.mark.parametrize(
    ("content_type", "raw", "expected"),
    [
        ("application/json", b'{"model": "m"}', {"model": "m"}),
        ("application/json; charset=utf-8", b'{"model": "m"}', {"model": "m"}),
        ("Application/JSON", b"[]", []),
        ("application/json", b'{"x": NaN}', {"x": NAN}),
        (None, b'{"model": "m"}', 415),
        ("text/plain", b'{"model": "m"}', 415),
        ("application/x-www-form-urlencoded", b"model=m", 415),
        ("application/jsonx", b"{}", 415),
        ("application/json", b"", 400),
        ("application/json", b"  \n", 400),
        ("application/json", b'{"model": ', 400),
        ("application/json", b"\xff\xfe{", 400),
        ("application/json", b"1" * 5000, 400),  # beyond Python's int-from-string limit
        ("text/plain", b"", 415),  # the content type is checked before the body
    ],
)
def test_decode_body(content_type: str | None, raw: bytes, expected: object) -> None:
    if isinstance(expected, int):
        with pytest.raises(ThresholdUpdateError) as err:
            decode_body(content_type, raw)
        assert err.value.status == expected
        assert ("Content-Type" if expected == 415 else "body") in err.value.message
    else:
        got = decode_body(content_type, raw)
        assert json.dumps(got) == json.dumps(expected)


@given(st.integers(min_value=0, max_value=MAX))
def test_every_token_count_in_range_is_kept_exactly(n: int) -> None:
    assert parse_threshold_update({"model": "m", PREFILL: n}).values == {PREFILL: n}


@given(st.floats(min_value=0, max_value=1))
def test_every_decode_fraction_in_range_is_accepted(x: float) -> None:
    assert parse_threshold_update({"model": "m", DECODE: x}).values == {DECODE: x}


def test_apply_sets_and_disables_and_keeps_the_rest() -> None:
    current = BusyThresholds(0.5, 10, 1.5)
    update = ThresholdUpdate("m", {PREFILL: 20}, frozenset({PREFILL_FRAC}))
    assert update.apply(current) == BusyThresholds(0.5, 20, None)


def _pool() -> WorkerPool:
    pool = WorkerPool(BusyThresholds(None, 7, None))
    pool.announce("w1", model="served", endpoint="127.0.0.1:1")
    return pool


def test_apply_update_404_only_for_changes_to_unserved_models() -> None:
    pool = _pool()
    read = parse_threshold_update({"model": "nobody", "disable": []})
    assert apply_update(pool, read) == BusyThresholds()
    for body in ({"model": "nobody", PREFILL: 1}, {"model": "nobody", "disable": [DECODE]}):
        with pytest.raises(ThresholdUpdateError) as err:
            apply_update(pool, parse_threshold_update(body))
        assert err.value.status == 404
        assert err.value.message == (
            "Model 'nobody' not found. Thresholds can only be set for discovered models."
        )
    assert "nobody" not in pool.thresholds


def test_apply_update_kept_after_the_model_leaves() -> None:
    pool = _pool()
    apply_update(pool, parse_threshold_update({"model": "served", DECODE: 0.3}))
    pool.leave("w1")
    assert apply_update(pool, parse_threshold_update({"model": "served"})) == BusyThresholds(
        0.3, 7, None
    )
    with pytest.raises(ThresholdUpdateError):
        apply_update(pool, parse_threshold_update({"model": "served", DECODE: 0.4}))


# ----- the real service ---------------------------------------------------------------------


class Admin:
    """The extproc subprocess with two discovered models, ``A`` and ``B``."""

    def __init__(self, log_dir: Path) -> None:
        own_dir = log_dir / "admin-thresholds"  # Extproc writes <dir>/extproc.log
        own_dir.mkdir(exist_ok=True)
        self.ext = Extproc(
            own_dir, ["--active-prefill-tokens-threshold", "7", "--worker-ttl", "120"]
        )
        self.pub = Publisher(self.ext.event_endpoint)
        self.url = self.ext.admin + "/busy_threshold"
        self.ports: dict[str, int] = {}
        self.announce("wa", "A")
        self.announce("wb", "B")

    def announce(self, worker_id: str, model: str, **extra: Any) -> None:
        port = self.ports.setdefault(worker_id, 1000 + len(self.ports))
        self.pub.announce(self.ext, worker_id, model, f"127.0.0.1:{port}", **extra)

    def post(
        self, body: bytes | dict[str, Any] | list[Any], headers: dict[str, str] | None = None
    ) -> tuple[int, dict[str, str], Any]:
        status, hdrs, raw = http("POST", self.url, body, headers)
        return status, hdrs, json.loads(raw)

    def listed(self) -> dict[str, dict[str, Any]]:
        return {e["model"]: e for e in get_json(self.url)["thresholds"]}

    def close(self) -> None:
        self.pub.close()
        self.ext.stop()


@pytest.fixture(scope="module")
def admin(log_dir: Path) -> Iterator[Admin]:
    made = Admin(log_dir)
    yield made
    made.close()


def entry(model: str, **values: Any) -> dict[str, Any]:
    return {"model": model, DECODE: None, PREFILL: 7, PREFILL_FRAC: None, **values}


@pytest.mark.parametrize(
    ("body", "headers", "status", "needle"),
    [
        (b'{"model": "A"}', {"content-type": "text/plain"}, 415, "text/plain"),
        (b'{"model": "A", "active_decode_blocks_threshold": 0.5}', {"content-type": ""}, 415,
         "Content-Type"),
        (b"", None, 400, "empty"),
        (b'{"model": "A",}', None, 400, "not valid JSON"),
        (b"[1]", None, 422, "request body must be a JSON object"),
        ({"model": "A", PREFILL: 5.0}, None, 422, f"{PREFILL} must be a whole number"),
        ({"model": "A", DECODE: True}, None, 422, DECODE),
        (b'{"model": "A", "active_prefill_tokens_threshold": 18446744073709551616}', None, 422,
         "18446744073709551616"),
        (b'{"model": "A", "active_prefill_tokens_threshold_frac": Infinity}', None, 400,
         PREFILL_FRAC),
        ({"model": "A", DECODE: 1.5}, None, 400, "[0, 1]"),
        ({"model": "A", "disable": ["nope"]}, None, 422, '"nope"'),
        ({"model": "nobody", PREFILL: 3}, None, 404,
         "Model 'nobody' not found. Thresholds can only be set for discovered models."),
    ],
)  # fmt: skip
def test_post_errors(
    admin: Admin, body: Any, headers: dict[str, str] | None, status: int, needle: str
) -> None:
    got, hdrs, payload = admin.post(body, headers)
    assert (got, hdrs["content-type"].split(";")[0]) == (status, "application/json")
    assert set(payload) == {"error"} and needle in payload["error"], payload
    assert admin.listed()["A"] == entry("A")


def test_the_missing_content_type_is_415(admin: Admin) -> None:
    conn = HTTPConnection("127.0.0.1", admin.ext.admin_port, timeout=5)
    try:
        conn.request("POST", "/busy_threshold", body=b'{"model": "A"}')
        resp = conn.getresponse()
        assert resp.status == 415
        assert "no Content-Type header" in json.loads(resp.read())["error"]
    finally:
        conn.close()


@pytest.mark.parametrize("method", ["PUT", "DELETE", "PATCH", "OPTIONS"])
def test_other_methods_are_405_with_allow(admin: Admin, method: str) -> None:
    status, hdrs, body = http(method, admin.url, {"model": "A"})
    assert status == 405
    assert hdrs["allow"] == "GET, HEAD, POST"
    assert method in json.loads(body)["error"]


def test_get_lists_each_discovered_model_sorted_and_head_matches(admin: Admin) -> None:
    status, hdrs, raw = http("GET", admin.url)
    assert status == 200
    models = [e["model"] for e in json.loads(raw)["thresholds"]]
    assert models == sorted(models) and {"A", "B"} <= set(models)
    assert admin.listed()["B"] == entry("B")
    head_status, head_hdrs, head_body = http("HEAD", admin.url)
    assert (head_status, head_body) == (200, b"")
    assert head_hdrs["content-length"] == hdrs["content-length"]
    assert head_hdrs["content-type"] == hdrs["content-type"]


def test_post_returns_the_full_entry_and_leaves_other_models_alone(admin: Admin) -> None:
    status, _, body = admin.post(
        {"model": "A", DECODE: 0.5}, {"content-type": "application/json; charset=utf-8"}
    )
    assert (status, body) == (200, entry("A", **{DECODE: 0.5}))
    assert admin.listed()["A"] == entry("A", **{DECODE: 0.5})
    assert admin.listed()["B"] == entry("B")

    _, _, body = admin.post({"model": "A", PREFILL_FRAC: 2, "disable": [PREFILL]})
    assert body == entry("A", **{DECODE: 0.5, PREFILL: None, PREFILL_FRAC: 2.0})
    _, _, body = admin.post({"model": "A", PREFILL: None, "ignored": 1, "disable": []})
    assert body == entry("A", **{DECODE: 0.5, PREFILL: None, PREFILL_FRAC: 2.0})

    _, _, body = admin.post({"model": "A", PREFILL: 7, "disable": [DECODE, PREFILL_FRAC]})
    assert body == entry("A")
    assert admin.listed()["B"] == entry("B")


def test_a_change_applies_to_the_very_next_decision(admin: Admin) -> None:
    admin.announce("wl", "L")
    admin.pub.load("wl", active_prefill_tokens=10)
    wait_until(lambda: admin.ext.workers()["wl"]["state"] == "busy", 5, "wl busy at 10 > 7")
    assert admin.post({"model": "L", PREFILL: 10})[0] == 200
    assert admin.ext.workers()["wl"]["state"] == "free"  # no wait: the POST already applied it
    assert admin.post({"model": "L", PREFILL: 9})[0] == 200
    assert admin.ext.workers()["wl"]["state"] == "busy"
    assert admin.post({"model": "L", "disable": [PREFILL]})[0] == 200
    assert admin.ext.workers()["wl"]["state"] == "free"


def test_a_model_discovered_later_starts_from_the_startup_values(admin: Admin) -> None:
    status, _, body = admin.post({"model": "late"})
    assert (status, body) == (200, {"model": "late", **ALL_NULL})  # nothing applies to it yet
    assert "late" not in admin.listed()
    admin.announce("wlate", "late")
    assert admin.listed()["late"] == entry("late")


def test_runtime_values_are_kept_while_the_model_is_away(admin: Admin) -> None:
    admin.announce("wk", "K")
    assert admin.post({"model": "K", PREFILL_FRAC: 1.5})[2] == entry("K", **{PREFILL_FRAC: 1.5})
    admin.pub.bye("wk")
    wait_until(lambda: "K" not in admin.listed(), 5, "K unlisted after bye")
    status, _, body = admin.post({"model": "K", PREFILL: 1})
    assert status == 404 and "Model 'K' not found" in body["error"]
    assert admin.post({"model": "K"})[2] == entry("K", **{PREFILL_FRAC: 1.5})

    admin.announce("wk", "K", max_num_batched_tokens=100)
    assert admin.listed()["K"] == entry("K", **{PREFILL_FRAC: 1.5})
    limits = admin.ext.workers()["wk"]["ranks"][0]["busy_limits"]
    assert limits[PREFILL_FRAC] == 150 and limits[PREFILL] == 7
    assert set(admin.listed()["K"]) == {"model", *THRESHOLD_NAMES}


# ----- latency targets ---------------------------------------------------------------------

TARGET_422 = [
    pytest.param(0, "0", id="zero"),
    pytest.param(-5, "-5", id="negative"),
    pytest.param(600_000.5, "600000.5", id="above-600000"),
    pytest.param(10**400, "1000000000", id="huge-int"),
    pytest.param("300", '"300"', id="string"),
    pytest.param(True, "true", id="bool"),
    pytest.param([300], "[300]", id="list"),
    pytest.param(NAN, "NaN", id="nan"),
    pytest.param(INF, "Infinity", id="infinity"),
]


@pytest.mark.parametrize("name", [TTFT_TARGET, ITL_TARGET])
@pytest.mark.parametrize(("value", "shown"), TARGET_422)
def test_a_bad_target_is_422_naming_field_and_value(name: str, value: object, shown: str) -> None:
    with pytest.raises(ThresholdUpdateError) as err:
        parse_threshold_update({"model": "m", name: value, PREFILL: 3})
    assert err.value.status == 422
    assert name in err.value.message and shown in err.value.message
    assert "milliseconds in (0, 600000]" in err.value.message


@pytest.mark.parametrize("value", [0.001, 1, 250.5, 600_000])
def test_targets_in_range_are_kept_as_floats(value: float) -> None:
    update = parse_threshold_update({"model": "m", TTFT_TARGET: value, ITL_TARGET: None})
    assert update.values == {TTFT_TARGET: float(value)}
    got = update.apply(BusyThresholds(0.5))
    assert got == BusyThresholds(0.5, ttft_p99_target_ms=float(value))


def test_disable_takes_target_names_and_refuses_a_value_too() -> None:
    update = parse_threshold_update({"model": "m", "disable": [TTFT_TARGET, ITL_TARGET]})
    assert update.apply(BusyThresholds(None, 7, None, 300.0, 50.0)) == BusyThresholds(None, 7)
    with pytest.raises(ThresholdUpdateError) as err:
        parse_threshold_update({"model": "m", "disable": [ITL_TARGET], ITL_TARGET: 9})
    assert err.value.status == 422 and ITL_TARGET in err.value.message


def test_the_api_sets_shows_and_removes_a_target(admin: Admin) -> None:
    admin.announce("wt", "T")
    status, _, body = admin.post({"model": "T", TTFT_TARGET: 250})
    assert (status, body) == (200, entry("T", **{TTFT_TARGET: 250.0}))
    assert admin.listed()["T"] == entry("T", **{TTFT_TARGET: 250.0})
    _, _, body = admin.post({"model": "T", ITL_TARGET: 40, TTFT_TARGET: None})
    assert body == entry("T", **{TTFT_TARGET: 250.0, ITL_TARGET: 40.0})
    view = admin.ext.workers()["wt"]
    assert view["deadline"]["ttft_p99_target_ms"] == 250.0
    assert view["deadline"]["target_unreachable"] is False  # nothing measured: no verdict
    models = get_json(admin.ext.admin + "/debug/workers")["models"]
    assert models["T"]["ttft_p99_target_ms"] == 250.0
    for bad in (0, -1, 600_001, "fast"):
        status, _, body = admin.post({"model": "T", TTFT_TARGET: bad, PREFILL: 1})
        assert status == 422 and TTFT_TARGET in body["error"], body
        assert repr(bad) in body["error"] or str(bad) in body["error"], body
    # Nothing changed by the refused calls, the threshold sent beside them included.
    assert admin.listed()["T"] == entry("T", **{TTFT_TARGET: 250.0, ITL_TARGET: 40.0})
    _, _, body = admin.post({"model": "T", "disable": [TTFT_TARGET, ITL_TARGET]})
    assert body == entry("T") and set(body) == {"model", *THRESHOLD_NAMES}
    assert "ttft_p99_target_ms" not in admin.ext.workers()["wt"]["deadline"]
    assert get_json(admin.ext.admin + "/debug/workers")["models"]["T"]["ttft_p99_target_ms"] is None
