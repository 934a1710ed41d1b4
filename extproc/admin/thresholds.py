"""``/busy_threshold``: read and change one model's busy thresholds at runtime (docs/admin-api.md).

Validation is pure (:func:`decode_body`, :func:`parse_threshold_update`) and raises
:class:`ThresholdUpdateError` carrying the HTTP status; the aiohttp handler only reads
the request, calls them and applies the result to the pool.

Checks run in this order, the first failure answers:

1. 415 ``Content-Type`` is not ``application/json`` (parameters such as charset ignored);
2. 400 the body cannot be read (a ``Content-Encoding`` it is not in), is empty or is not
   valid JSON;
3. 422 the body is not an object; ``model`` missing, null or not a string; a threshold of
   the wrong type (string or bool for a number; for the token threshold anything but an
   unsigned 64-bit integer: a float, a negative number, a number above 2^64-1, as in
   Dynamo); ``disable`` not a list of threshold names, or naming a threshold also given
   a value; a latency target that is not a number of milliseconds in (0, 600000];
4. 400 a value out of range (decode outside [0, 1], fraction negative or not finite);
5. 404 a change for a model no worker serves.

``NaN``, ``Infinity`` and ``-Infinity`` tokens (which Python's ``json`` accepts) and numbers
too large for a float (``1e999``) are read as non-finite numbers: out of range (400) for
the two fractional thresholds, a wrong type (422) for the token threshold and the targets.

The latency targets (``ttft_p99_target_ms``, ``itl_p99_target_ms``) are set, turned off and
shown like the thresholds; an entry carries a target key only while it is set.
"""

from __future__ import annotations

import json
import math
from dataclasses import dataclass, replace
from typing import Any

from aiohttp import web

from extproc.admin.routes import BodyUnreadable, add_read_write, json_error, read_body
from extproc.core.busy import (
    DECODE,
    MAX_TARGET_MS,
    MAX_TOKEN_THRESHOLD,
    PREFILL,
    PREFILL_FRAC,
    TARGET_NAMES,
    THRESHOLD_NAMES,
    BusyThresholds,
)
from extproc.core.pool import WorkerPool

PATH = "/busy_threshold"
DISABLE = "disable"
_FIELD_FOR = {
    DECODE: "active_decode_blocks",
    PREFILL: "active_prefill_tokens",
    PREFILL_FRAC: "active_prefill_tokens_frac",
    **{name: name for name in TARGET_NAMES},
}
SETTABLE = THRESHOLD_NAMES + TARGET_NAMES
TARGET_EXPECTED = f"a number of milliseconds in (0, {MAX_TARGET_MS}]"
_SHOWN_CHARS = 80
_ALL_OFF = BusyThresholds()


class ThresholdUpdateError(Exception):
    """A request to ``/busy_threshold`` that is refused; ``status`` is the HTTP status."""

    def __init__(self, status: int, message: str) -> None:
        super().__init__(message)
        self.status = status
        self.message = message


@dataclass(frozen=True, slots=True)
class ThresholdUpdate:
    """A validated POST: thresholds to set and thresholds to turn off, for one model."""

    model: str
    values: dict[str, float | int]
    disable: frozenset[str] = frozenset()

    @property
    def is_read(self) -> bool:
        """Nothing to change: the POST only reads the model's entry."""
        return not self.values and not self.disable

    def apply(self, current: BusyThresholds) -> BusyThresholds:
        changes: dict[str, float | int | None] = {_FIELD_FOR[n]: None for n in self.disable}
        changes.update({_FIELD_FOR[n]: v for n, v in self.values.items()})
        return replace(current, **changes)  # type: ignore[arg-type]


def _shown(value: object) -> str:
    """``value`` as it was written in JSON, shortened for an error message."""
    try:
        text = json.dumps(value)
    except (TypeError, ValueError):
        text = repr(value)
    return text if len(text) <= _SHOWN_CHARS else text[: _SHOWN_CHARS - 3] + "..."


def _json_type(value: object) -> str:
    if value is None:
        return "null"
    if isinstance(value, bool):
        return "boolean"
    if isinstance(value, int):
        return "integer"
    if isinstance(value, float):
        return "number"
    if isinstance(value, str):
        return "string"
    if isinstance(value, list):
        return "array"
    if isinstance(value, dict):
        return "object"
    return type(value).__name__


def _wrong_type(field: str, value: object, expected: str) -> ThresholdUpdateError:
    return ThresholdUpdateError(
        422, f"{field} must be {expected}, got {_shown(value)} ({_json_type(value)})"
    )


def _out_of_range(field: str, value: object, expected: str) -> ThresholdUpdateError:
    return ThresholdUpdateError(400, f"{field} must be {expected}, got {_shown(value)}")


def decode_body(content_type: str | None, raw: bytes) -> object:
    """The JSON value of a POST body; 415 for a non-JSON content type, 400 for bad JSON."""
    mime = (content_type or "").split(";", 1)[0].strip().lower()
    if mime != "application/json":
        got = "no Content-Type header" if content_type is None else repr(content_type)
        raise ThresholdUpdateError(415, f"Content-Type must be application/json, got {got}")
    if not raw.strip():
        raise ThresholdUpdateError(400, "request body is empty; expected a JSON object")
    try:
        return json.loads(raw)
    except (ValueError, RecursionError) as exc:  # JSONDecodeError, bad UTF-8, huge integers
        raise ThresholdUpdateError(400, f"request body is not valid JSON: {exc}") from None


def _check_type(name: str, value: object) -> None:
    if name in TARGET_NAMES:
        # A target is a positive duration: anything else, out of range too, is a 422.
        if (
            isinstance(value, bool)
            or not isinstance(value, (int, float))
            or not 0 < value <= MAX_TARGET_MS  # NaN fails both comparisons
        ):
            raise _wrong_type(name, value, TARGET_EXPECTED)
    elif name == PREFILL:
        # Not an unsigned 64-bit integer is a type error, as in Dynamo (422), above 2^64-1 too.
        if (
            isinstance(value, bool)
            or not isinstance(value, int)
            or not 0 <= value <= MAX_TOKEN_THRESHOLD
        ):
            raise _wrong_type(
                name, value, f"a whole number of tokens from 0 to {MAX_TOKEN_THRESHOLD}"
            )
    elif isinstance(value, bool) or not isinstance(value, (int, float)):
        raise _wrong_type(name, value, "a number")


def _check_range(name: str, value: float | int) -> float | int:
    """The value as stored (floats for the fractional thresholds and targets), or a 400."""
    if name == PREFILL:
        return value
    if name in TARGET_NAMES:
        return float(value)
    if name == DECODE:
        if not 0 <= value <= 1:  # NaN fails both comparisons
            raise _out_of_range(name, value, "a number in [0, 1]")
    elif value < 0 or (isinstance(value, float) and not math.isfinite(value)):
        raise _out_of_range(name, value, "a finite number >= 0 (may exceed 1)")
    try:
        return float(value) + 0.0  # + 0.0 turns -0.0 into 0.0
    except OverflowError:  # an integer beyond the largest float
        raise _out_of_range(name, value, "a finite number >= 0 (may exceed 1)") from None


def _parse_disable(raw: object) -> frozenset[str]:
    expected = f"a list of threshold or target names ({', '.join(SETTABLE)})"
    if raw is None:
        return frozenset()
    if not isinstance(raw, list):
        raise _wrong_type(DISABLE, raw, expected)
    for item in raw:
        if not isinstance(item, str):
            raise _wrong_type(DISABLE, raw, expected)
        if item not in SETTABLE:
            raise ThresholdUpdateError(
                422, f"{DISABLE} names unknown threshold {_shown(item)}; expected {expected}"
            )
    return frozenset(raw)


def parse_threshold_update(body: object) -> ThresholdUpdate:
    """Validate a decoded POST body; raise ThresholdUpdateError (422 or 400) if it is bad.

    Absent and null thresholds are left unchanged; ``disable: null`` is the same as no
    ``disable``. Keys other than ``model``, the three thresholds, the two latency targets
    and ``disable`` are ignored.
    """
    if not isinstance(body, dict):
        raise _wrong_type("request body", body, "a JSON object")
    model = body.get("model")
    if not isinstance(model, str):
        raise _wrong_type("model", model, "a model name (string)")
    given: dict[str, Any] = {n: body[n] for n in SETTABLE if body.get(n) is not None}
    for name, value in given.items():
        _check_type(name, value)
    disable = _parse_disable(body.get(DISABLE))
    for name in SETTABLE:
        if name in disable and name in given:
            raise ThresholdUpdateError(
                422,
                f"{name} is both in {DISABLE} and given the value {_shown(given[name])}; "
                "send one or the other",
            )
    values = {name: _check_range(name, value) for name, value in given.items()}
    return ThresholdUpdate(model, values, disable)


def entry(model: str, thresholds: BusyThresholds) -> dict[str, Any]:
    """One model's entry as the API shows it: the four keys, nulls included, and each
    latency target while it is set."""
    return {"model": model, **thresholds.as_dict()}


def stored_thresholds(pool: WorkerPool, model: str) -> BusyThresholds:
    """What a read shows: the model's kept values if it was ever seen, else all null."""
    return pool.thresholds.get(model, _ALL_OFF)


def apply_update(pool: WorkerPool, update: ThresholdUpdate) -> BusyThresholds:
    """Apply a validated update (a no-op for a read); 404 for a change to an unserved model."""
    if update.is_read:
        return stored_thresholds(pool, update.model)
    if update.model not in pool.by_model:
        raise ThresholdUpdateError(
            404,
            f"Model '{update.model}' not found. Thresholds can only be set for discovered models.",
        )
    new = update.apply(pool.thresholds_for(update.model))
    pool.set_thresholds(update.model, new)
    return new


def add_routes(app: web.Application, pool: WorkerPool) -> None:
    """Register GET/HEAD/POST ``/busy_threshold``; other methods get 405 with ``Allow``."""

    async def get(_: web.Request) -> web.Response:
        return web.json_response(
            {"thresholds": [entry(m, pool.thresholds_for(m)) for m in pool.models()]}
        )

    async def post(request: web.Request) -> web.Response:
        try:
            raw = await read_body(request)
        except BodyUnreadable as exc:
            return exc.response
        try:
            update = parse_threshold_update(decode_body(request.headers.get("Content-Type"), raw))
            thresholds = apply_update(pool, update)
        except ThresholdUpdateError as exc:
            return json_error(exc.status, exc.message)
        return web.json_response(entry(update.model, thresholds))

    add_read_write(app, PATH, get, post)
