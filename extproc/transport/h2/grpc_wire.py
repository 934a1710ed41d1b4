"""gRPC on HTTP/2: length-prefixed messages, the response headers, trailers with grpc-status.

Everything here is built from HPACK literals and the static table, so a reply needs no
encoder state; what every stream sends the same is built once.
"""

from __future__ import annotations

from extproc.transport.h2.headers import hpack_int, literal

# gRPC status codes.
GRPC_OK, GRPC_INTERNAL, GRPC_UNIMPLEMENTED, GRPC_RESOURCE_EXHAUSTED = 0, 13, 12, 8
# The largest message accepted.
MAX_MESSAGE = 64 << 20

_STATUS_200 = b"\x88"  # static table index 8
_CONTENT_TYPE = b"\x0f\x10" + hpack_int(16, 7) + b"application/grpc"  # name index 31
RESPONSE_HEADERS = _STATUS_200 + _CONTENT_TYPE


def grpc_trailers(status: int, message: str = "") -> bytes:
    """The trailers block ending a call: ``grpc-status`` and a percent-encoded message."""
    block = literal("grpc-status", str(status))
    if message:
        safe = "".join(c if " " <= c <= "~" and c != "%" else f"%{ord(c):02X}" for c in message)
        block += literal("grpc-message", safe)
    return block


OK_TRAILERS = grpc_trailers(GRPC_OK)


def grpc_message(payload: bytes) -> bytes:
    """One uncompressed length-prefixed message."""
    return b"\x00" + len(payload).to_bytes(4, "big") + payload
