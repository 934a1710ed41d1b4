"""The overload status code and the flat JSON error bodies of local replies.

``DYN_HTTP_OVERLOAD_STATUS_CODE`` is read once at startup: default 529;
surrounding spaces ignored; empty means unset; anything that is not an integer
in 200-999 falls back to 529 with a warning. The frontend (extproc) and the
worker-side admission both use it.
"""

from __future__ import annotations

import json
import os
from collections.abc import Mapping

DEFAULT_OVERLOAD_STATUS = 529
OVERLOAD_STATUS_ENV = "DYN_HTTP_OVERLOAD_STATUS_CODE"

_REASONS = {
    400: "Bad Request",
    401: "Unauthorized",
    403: "Forbidden",
    404: "Not Found",
    408: "Request Timeout",
    409: "Conflict",
    413: "Payload Too Large",
    429: "Too Many Requests",
    500: "Internal Server Error",
    502: "Bad Gateway",
    503: "Service Unavailable",
    504: "Gateway Timeout",
}


def reason_phrase(status: int) -> str:
    """Standard reason phrase of a status; ``Overloaded`` for 529 and unknown codes."""
    return _REASONS.get(status, "Overloaded")


def overload_status_from_env(
    environ: Mapping[str, str] | None = None,
) -> tuple[int, str | None]:
    """(status, warning or None) from DYN_HTTP_OVERLOAD_STATUS_CODE."""
    env = os.environ if environ is None else environ
    raw = env.get(OVERLOAD_STATUS_ENV)
    if raw is None or not raw.strip():
        return DEFAULT_OVERLOAD_STATUS, None
    text = raw.strip()
    try:
        value = int(text, 10)
    except ValueError:
        value = -1
    if 200 <= value <= 999 and text.isascii() and text.lstrip("+").isdigit():
        return value, None
    return DEFAULT_OVERLOAD_STATUS, (
        f"{OVERLOAD_STATUS_ENV}={raw!r} is not an integer in 200-999; "
        f"using {DEFAULT_OVERLOAD_STATUS}"
    )


def error_body(message: str, status: int, type_: str | None = None) -> bytes:
    """``{"message":..., "type":..., "code":...}`` as compact JSON bytes."""
    return json.dumps(
        {"message": message, "type": type_ or reason_phrase(status), "code": status},
        separators=(",", ":"),
    ).encode()
