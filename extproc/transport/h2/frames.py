"""HTTP/2 frames (RFC 9113 §4, §6): the preface, frame types, flags, codes, serialising.

A frame is a 9-byte head (24-bit length, type, flags, 31-bit stream id) and its payload.
Reading them is the connection's ``data_received`` loop, inline on purpose: the hot path
makes no call per frame beyond the frame's own handling.
"""

from __future__ import annotations

PREFACE = b"PRI * HTTP/2.0\r\n\r\nSM\r\n\r\n"

# Frame types (RFC 9113 §6).
DATA, HEADERS, PRIORITY, RST_STREAM, SETTINGS, PUSH_PROMISE = 0, 1, 2, 3, 4, 5
PING, GOAWAY, WINDOW_UPDATE, CONTINUATION = 6, 7, 8, 9
# Flags.
END_STREAM, ACK, END_HEADERS, PADDED, PRIORITY_FLAG = 0x1, 0x1, 0x4, 0x8, 0x20
# Error codes (RFC 9113 §7).
NO_ERROR, PROTOCOL_ERROR, INTERNAL_ERROR, FLOW_CONTROL_ERROR = 0, 1, 2, 3
STREAM_CLOSED, FRAME_SIZE_ERROR, REFUSED_STREAM, CANCEL, COMPRESSION_ERROR = 5, 6, 7, 8, 9
# Settings identifiers.
S_HEADER_TABLE_SIZE, S_ENABLE_PUSH, S_MAX_CONCURRENT_STREAMS = 1, 2, 3
S_INITIAL_WINDOW_SIZE, S_MAX_FRAME_SIZE, S_MAX_HEADER_LIST_SIZE = 4, 5, 6

# Protocol bounds: the largest flow-control window, the initial window and frame size.
MAX_WINDOW = 2**31 - 1
DEFAULT_WINDOW = 65_535
DEFAULT_FRAME = 16_384


class ProtocolError(Exception):
    """The peer broke HTTP/2: the connection ends with GOAWAY and this error code."""

    def __init__(self, code: int, message: str) -> None:
        super().__init__(message)
        self.code = code


def frame(kind: int, flags: int, stream_id: int, payload: bytes = b"") -> bytes:
    """One frame, serialised."""
    n = len(payload)
    head = bytes((n >> 16, (n >> 8) & 0xFF, n & 0xFF, kind, flags))
    return head + stream_id.to_bytes(4, "big") + payload


def unpad(payload: bytes) -> bytes:
    """A PADDED frame's payload without its pad length and padding."""
    if not payload or payload[0] >= len(payload):
        raise ProtocolError(PROTOCOL_ERROR, "bad padding")
    return payload[1 : len(payload) - payload[0]]
