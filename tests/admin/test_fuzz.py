"""Fuzzing ``POST /busy_threshold`` on the real admin app served on 127.0.0.1.

Random content types and bodies (JSON values, objects with random keys and values,
duplicate keys, huge numbers, deep nesting, UTF-16/32 and broken encodings, empty, 1 MB)
are posted one by one. Properties: never a 5xx; every 4xx carries ``{"error": "..."}``
and changes no model's thresholds; every answer is the one the pure validators
(:func:`decode_body`, :func:`parse_threshold_update`) predict, and a 2xx leaves exactly the
values they parsed. Cases are drawn by a derandomized hypothesis run (same cases every run).

Rules pinned here (docs/admin-api.md):
- a body that is not in the ``Content-Encoding`` it claims is a 400 with a JSON error;
  when aiohttp's HTTP parser already fails on it before the app runs (a body that arrives
  whole with its headers), the 400 is aiohttp's own, in text/plain;
- duplicate keys: the last one wins (Python's ``json``), for ``model`` and for thresholds;
- the body's encoding is detected from its first bytes (``json.loads`` on bytes): UTF-8,
  UTF-16 and UTF-32, with or without a BOM, are read alike; a ``charset`` parameter of the
  Content-Type is ignored; bytes that are none of these are a 400;
- a body above the server's limit (aiohttp's 1 MiB) is a 413 with a JSON error.
"""

from __future__ import annotations

import gzip
import json
import zlib
from collections.abc import AsyncIterator
from typing import Any

import aiohttp
import brotli
import pytest
from aiohttp.test_utils import TestServer
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from extproc.admin.app import Readiness, build_app
from extproc.admin.auth import AdminAuth
from extproc.admin.thresholds import (
    ThresholdUpdateError,
    decode_body,
    parse_threshold_update,
)
from extproc.core.busy import DECODE, PREFILL, PREFILL_FRAC, BusyThresholds
from extproc.core.pool import WorkerPool
from extproc.metrics.registry import Metrics

CASES = 300
MODELS = ["m", "n"]  # served; "ghost" is not
KEYS = ["model", DECODE, PREFILL, PREFILL_FRAC, "disable"]
NO_CT = None  # send no Content-Type header at all

numbers = st.one_of(
    st.integers(-5, 5),
    st.sampled_from([2**64 - 1, 2**64, 2**200, -1, 10**400, 0.5, 1.0, 60.0, -0.0, 1e308]),
    st.floats(allow_nan=True, allow_infinity=True),
)
json_scalars = st.one_of(
    st.none(), st.booleans(), numbers, st.text(max_size=12), st.sampled_from([*MODELS, "ghost"])
)
json_values = st.recursive(
    json_scalars,
    lambda inner: st.one_of(
        st.lists(inner, max_size=4),
        st.dictionaries(st.one_of(st.sampled_from(KEYS), st.text(max_size=6)), inner, max_size=4),
    ),
    max_leaves=10,
)
threshold_values = st.one_of(
    st.sampled_from([None, 0.25, 0, 1, 100, 2.5, [PREFILL], []]),
    numbers,
    st.sampled_from([None, True, "0.5", [0.5], {"x": 1}, 0.25, 100, 2.5]),
    st.lists(st.sampled_from([DECODE, PREFILL, PREFILL_FRAC, "busy", 1]), max_size=3),
)
objects = st.tuples(
    st.one_of(st.sampled_from([*MODELS, "ghost"]), json_scalars),
    st.dictionaries(st.one_of(st.sampled_from(KEYS), st.text(max_size=6)), threshold_values),
).map(lambda t: {**t[1], "model": t[0]})

JSON_TYPES = [
    "application/json",
    "APPLICATION/JSON",
    "Application/Json; charset=UTF-8",
    "application/json;charset=utf-16",
    " application/json ; q=1; garbage",
    "application/json; charset",
]
other_types = st.one_of(
    st.sampled_from(
        [
            "application/jsonx",
            "application/json-patch+json",
            "text/plain",
            "multipart/form-data; boundary=x",
            "",
            ";",
            NO_CT,
        ]
    ),
    st.text(st.characters(min_codepoint=0x20, max_codepoint=0x7E), max_size=30),
)
# Four in five say JSON, so most bodies reach the validators.
content_types = st.integers(0, 4).flatmap(
    lambda i: other_types if i == 0 else st.sampled_from(JSON_TYPES)
)


def _dump(value: Any) -> str:
    return json.dumps(value, allow_nan=True)


def _duplicates(pairs: list[tuple[str, Any]]) -> str:
    return "{" + ", ".join(f"{json.dumps(k)}: {_dump(v)}" for k, v in pairs) + "}"


def _nested(depth: int, inner: str = "0") -> str:
    return "[" * depth + inner + "]" * depth


texts = st.one_of(
    json_values.map(_dump),
    objects.map(_dump),
    objects.map(_dump),
    st.lists(st.tuples(st.sampled_from(KEYS[:4]), threshold_values), min_size=2, max_size=6).map(
        _duplicates
    ),
    st.sampled_from([10, 900, 5000, 100_000]).map(_nested),
    st.sampled_from([10, 900, 5000]).map(lambda d: '{"model": ' + _nested(d) + "}"),
    st.sampled_from([10, 900, 5000]).map(lambda d: '{"model": "m", "disable": ' + _nested(d) + "}"),
    st.just('{"model": "m", "' + PREFILL + '": 1' + "0" * 5000 + "}"),
    st.just('{"model": "m", "' + DECODE + '": 0.' + "5" * 5000 + "}"),
    st.sampled_from(["", " ", "\n\t", "{", "[", "nul", '{"model": "m",}', "{'model': 'm'}"]),
)
encodings = st.sampled_from(
    ["utf-8", "utf-8-sig", "utf-16", "utf-16-le", "utf-16-be", "utf-32", "latin-1"]
)


@st.composite
def bodies(draw: st.DrawFn) -> bytes:
    kind = draw(st.sampled_from(["text", "text", "text", "bytes", "broken"]))
    if kind == "bytes":
        return draw(st.binary(max_size=64))
    raw = draw(texts).encode(draw(encodings), "replace")
    if kind == "broken" and raw:
        at = draw(st.integers(0, len(raw)))
        raw = (
            raw[:at]
            + draw(st.sampled_from([b"\xff", b"\xc3", b"\x00", b"\xed\xa0\x80"]))
            + raw[at:]
        )
    return raw


# Content-Encoding: None (none sent), or (name, compress?): a body the server can decompress,
# or one that is not in the encoding it claims (a 400 with a JSON error).
content_encodings = st.one_of(
    st.none(),
    st.none(),
    st.none(),
    st.sampled_from(["gzip", "deflate", "br"]).flatmap(
        lambda name: st.tuples(st.just(name), st.booleans())
    ),
)


def _compress(name: str, raw: bytes) -> bytes:
    if name == "gzip":
        return gzip.compress(raw)
    if name == "deflate":
        return zlib.compress(raw)
    return brotli.compress(raw)


Case = tuple[str | None, bytes, "tuple[str, bool] | None"]


def _seeded_cases(n: int) -> list[Case]:
    out: list[Case] = []

    @settings(
        max_examples=n,
        derandomize=True,
        deadline=None,
        database=None,
        suppress_health_check=list(HealthCheck),
    )
    @given(ct=content_types, body=bodies(), ce=content_encodings)
    def collect(ct: str | None, body: bytes, ce: tuple[str, bool] | None) -> None:
        out.append((ct, body, ce))

    collect()
    assert len(out) >= n // 2, len(out)
    return out


# Cases that must be in every run, whatever hypothesis draws.
FIXED: list[Case] = [
    ("application/json", b'{"model": "m", "pad": "' + b"x" * 1_000_000 + b'"}', None),  # 1 MB, 200
    ("application/json", b'{"model": "m", "pad": "' + b"x" * 2_000_000 + b'"}', None),  # 413
    ("application/json", json.dumps({"model": "m", DECODE: 0.25}).encode("utf-16"), None),
    ("application/json", json.dumps({"model": "n", PREFILL: 7}).encode("utf-32-be"), None),
    ("application/json", _nested(100_000).encode(), None),
    ("application/json", ('{"model": ' + _nested(5000) + "}").encode(), None),
    ("application/json", f'{{"model": "m", "{PREFILL}": {2**64}}}'.encode(), None),
    ("application/json", f'{{"model": "m", "{PREFILL_FRAC}": 1e999}}'.encode(), None),
    ("application/json", f'{{"model": "m", "{DECODE}": NaN}}'.encode(), None),
    ("application/json", b"", None),
    (NO_CT, b'{"model": "m"}', None),
    ("application/json", f'{{"model": "ghost", "{DECODE}": 0.5}}'.encode(), None),  # 404
    ("application/json", b'{"model": "\xff"}', None),
]


@pytest.fixture
async def admin() -> AsyncIterator[tuple[WorkerPool, aiohttp.ClientSession, str]]:
    pool = WorkerPool(BusyThresholds(0.5, 1000, 1.5))
    pool.announce("a", model="m", endpoint="127.0.0.1:8000", kv_total_blocks=100)
    pool.announce("b", model="n", endpoint="127.0.0.1:8001", max_num_batched_tokens=2048)
    pool.set_thresholds("n", BusyThresholds(None, 5, None))
    server = TestServer(build_app(pool, Metrics(), Readiness(), AdminAuth()), host="127.0.0.1")
    await server.start_server()
    timeout = aiohttp.ClientTimeout(total=10)
    async with aiohttp.ClientSession(timeout=timeout) as client:
        yield pool, client, str(server.make_url("/busy_threshold"))
    await server.close()


def _state(pool: WorkerPool) -> dict[str, BusyThresholds]:
    return {m: pool.thresholds_for(m) for m in [*MODELS, "ghost"]} | dict(pool.thresholds)


def _predict(pool: WorkerPool, ct: str | None, raw: bytes) -> tuple[int, Any]:
    """(status, update) from the pure validators; the update only for a 200."""
    try:
        update = parse_threshold_update(decode_body(ct, raw))
    except ThresholdUpdateError as exc:
        return exc.status, None
    if not update.is_read and update.model not in pool.by_model:
        return 404, None
    return 200, update


async def _post(
    client: aiohttp.ClientSession,
    url: str,
    ct: str | None,
    raw: bytes,
    encoding: str | None = None,
    *,
    plain_400: bool = False,
) -> tuple[int, Any]:
    headers = {} if ct is None else {"Content-Type": ct}
    if encoding is not None:
        headers["Content-Encoding"] = encoding
    skip = ["Content-Type"] if ct is None else []
    async with client.post(url, data=raw, headers=headers, skip_auto_headers=skip) as resp:
        if plain_400 and resp.status == 400 and resp.content_type == "text/plain":
            return 400, {"error": "cannot be read (aiohttp: " + (await resp.text()) + ")"}
        assert resp.content_type == "application/json", (resp.status, await resp.read())
        return resp.status, json.loads(await resp.read())


def _decodes(encoding: str, raw: bytes) -> bool:
    """Whether ``raw`` happens to be valid ``encoding`` data (as aiohttp would read it)."""
    attempts = {
        "gzip": [lambda: gzip.decompress(raw)],
        "deflate": [lambda: zlib.decompress(raw), lambda: zlib.decompress(raw, -15)],
        "br": [lambda: brotli.decompress(raw)],
    }[encoding]
    for attempt in attempts:
        try:
            attempt()
            return True
        except Exception:
            continue
    return False


async def test_fuzzed_posts_never_5xx_and_4xx_change_nothing(
    admin: tuple[WorkerPool, aiohttp.ClientSession, str],
) -> None:
    pool, client, url = admin
    cases = FIXED + _seeded_cases(CASES)
    seen: dict[int, int] = {}
    for ct, raw, ce in cases:
        before = _state(pool)
        wire = raw if ce is None or not ce[1] else _compress(ce[0], raw)
        # Not compressed, yet claiming an encoding; a few short bodies are valid streams of
        # it by chance (brotli especially), and those the server reads.
        bad_encoding = ce is not None and not ce[1] and bool(raw) and not _decodes(ce[0], raw)
        status, payload = await _post(client, url, ct, wire, ce and ce[0], plain_400=bad_encoding)
        seen[status] = seen.get(status, 0) + 1
        assert 200 <= status < 500, (status, payload, ct, raw[:200])
        if bad_encoding:  # not in the encoding it claims
            # Usually a 400 "cannot be read"; a streaming decoder may instead hand over what
            # it made of the bytes (aiohttp with brotli), which the validators then refuse.
            assert 400 <= status < 500 and payload.get("error"), payload
            assert _state(pool) == before
            continue
        if len(raw) > 1024**2:
            assert status == 413 and "too large" in payload["error"]
            assert _state(pool) == before
            continue
        want_status, update = _predict(pool, ct, raw)
        assert status == want_status, (status, payload, ct, raw[:200])
        if status >= 400:
            assert set(payload) == {"error"} and isinstance(payload["error"], str), payload
            assert payload["error"], payload
            assert _state(pool) == before, (status, ct, raw[:200])
            continue
        after = _state(pool)
        if update.is_read:
            assert after == before
            continue
        want = {**before, update.model: update.apply(before[update.model])}
        assert after == want, (ct, raw[:200])
        for name, value in update.values.items():
            assert payload[name] == value and type(payload[name]) is type(value), payload
        for name in update.disable:
            assert payload[name] is None
    print(f"\nadmin fuzz: {len(cases)} POSTs, by status {dict(sorted(seen.items()))}")
    assert len(cases) >= CASES // 2 + len(FIXED)
    assert seen.get(200, 0) >= 5 and seen.get(400, 0) >= 5 and seen.get(422, 0) >= 5
    assert seen.get(415, 0) > 10 and seen.get(413) == 1 and seen.get(404, 0) >= 1


async def test_duplicate_keys_the_last_one_wins(
    admin: tuple[WorkerPool, aiohttp.ClientSession, str],
) -> None:
    pool, client, url = admin
    raw = f'{{"model": "ghost", "model": "m", "{DECODE}": 0.9, "{DECODE}": 0.125}}'.encode()
    status, payload = await _post(client, url, "application/json", raw)
    assert status == 200 and payload["model"] == "m" and payload[DECODE] == 0.125
    assert pool.thresholds["m"].active_decode_blocks == 0.125
    # A bad value before a good one is overwritten; a good one before a bad one is not kept.
    raw = f'{{"model": "m", "{PREFILL}": 2.5, "{PREFILL}": 42}}'.encode()
    assert (await _post(client, url, "application/json", raw))[0] == 200
    assert pool.thresholds["m"].active_prefill_tokens == 42
    raw = f'{{"model": "m", "{PREFILL}": 43, "{PREFILL}": "x"}}'.encode()
    status, payload = await _post(client, url, "application/json", raw)
    assert status == 422 and PREFILL in payload["error"]
    assert pool.thresholds["m"].active_prefill_tokens == 42


@pytest.mark.parametrize("encoding", ["gzip", "deflate", "br"])
async def test_a_body_not_in_its_content_encoding_is_400_with_a_json_error(
    admin: tuple[WorkerPool, aiohttp.ClientSession, str], encoding: str
) -> None:
    """Found by fuzzing: aiohttp's decompression error escaped the handler as a 500."""
    pool, client, url = admin
    before = _state(pool)
    body = json.dumps({"model": "m", DECODE: 0.125}).encode()
    status, payload = await _post(client, url, "application/json", body, encoding)
    assert status == 400 and payload == {
        "error": f"request body cannot be read: Can not decode content-encoding: {encoding}"
    }
    assert _state(pool) == before
    # The same body compressed as it claims is read, and the server kept serving.
    status, payload = await _post(
        client, url, "application/json", _compress(encoding, body), encoding
    )
    assert (status, payload[DECODE]) == (200, 0.125)


@pytest.mark.parametrize("encoding", ["utf-8", "utf-8-sig", "utf-16", "utf-16-le", "utf-32"])
async def test_utf16_and_utf32_bodies_are_read_like_utf8(
    admin: tuple[WorkerPool, aiohttp.ClientSession, str], encoding: str
) -> None:
    pool, client, url = admin
    raw = json.dumps({"model": "m", DECODE: 0.75}).encode(encoding)
    status, payload = await _post(client, url, "application/json; charset=latin-1", raw)
    assert (status, payload[DECODE]) == (200, 0.75)
    assert pool.thresholds["m"].active_decode_blocks == 0.75
