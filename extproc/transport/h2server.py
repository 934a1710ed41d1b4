"""A small HTTP/2 server for one bidirectional-streaming gRPC method, on the asyncio loop.

ext_proc is one gRPC method (``ExternalProcessor/Process``): one stream per HTTP
request, a few small messages each way. grpcio's asyncio server spends most of its CPU
per request in its own machinery (a poller thread handing each message to the event
loop, per-call objects); this server parses frames in ``data_received`` and answers in
the same callback, one write per read, for several times less CPU per request
(``loadtest/bench.py --grpc-server builtin grpcio`` measures both).

It speaks what a gRPC client needs and nothing else: the connection preface, SETTINGS,
HEADERS/CONTINUATION (HPACK via ``hpack``), DATA with length-prefixed messages, flow
control both ways, PING, RST_STREAM, GOAWAY, server keepalive pings, trailers with
``grpc-status``. No TLS, no compression, no server push. A protocol error closes that
connection with GOAWAY and a log line; other connections and streams carry on.

A stream's messages go to a ``Session`` (made by the ``SessionFactory`` from the
request's metadata) in order. ``Session.receive`` answers at once with the reply bytes
(or ``None`` for no reply), or with a ``Deferred`` pair when the answer must wait (the router
queue): its ``first`` reply is sent now and its ``rest`` awaited, while later messages of
that stream wait their turn.
"""

from __future__ import annotations

import asyncio
import collections
import functools
import logging
import time
from collections.abc import Awaitable, Callable, Mapping
from typing import Protocol

import hpack

log = logging.getLogger("extproc.transport.h2server")

PREFACE = b"PRI * HTTP/2.0\r\n\r\nSM\r\n\r\n"

# Frame types (RFC 9113 §6).
DATA, HEADERS, PRIORITY, RST_STREAM, SETTINGS, PUSH_PROMISE = 0, 1, 2, 3, 4, 5
PING, GOAWAY, WINDOW_UPDATE, CONTINUATION = 6, 7, 8, 9
# Flags.
END_STREAM, ACK, END_HEADERS, PADDED, PRIORITY_FLAG = 0x1, 0x1, 0x4, 0x8, 0x20
# Not on the wire: marks a HEADERS frame whose priority names its own stream.
SELF_DEPENDENT = 0x100
# Error codes (RFC 9113 §7).
NO_ERROR, PROTOCOL_ERROR, INTERNAL_ERROR, FLOW_CONTROL_ERROR = 0, 1, 2, 3
STREAM_CLOSED, FRAME_SIZE_ERROR, REFUSED_STREAM, CANCEL, COMPRESSION_ERROR = 5, 6, 7, 8, 9
# Settings identifiers.
S_HEADER_TABLE_SIZE, S_ENABLE_PUSH, S_MAX_CONCURRENT_STREAMS = 1, 2, 3
S_INITIAL_WINDOW_SIZE, S_MAX_FRAME_SIZE, S_MAX_HEADER_LIST_SIZE = 4, 5, 6
# gRPC status codes.
GRPC_OK, GRPC_INTERNAL, GRPC_UNIMPLEMENTED, GRPC_RESOURCE_EXHAUSTED = 0, 13, 12, 8

MAX_WINDOW = 2**31 - 1
DEFAULT_WINDOW = 65_535
DEFAULT_FRAME = 16_384
# What we accept: frames up to 1 MiB, 4 MiB of unread data per stream, 64 MiB messages.
OUR_MAX_FRAME = 1 << 20
OUR_STREAM_WINDOW = 4 << 20
MAX_MESSAGE = 64 << 20
MAX_HEADER_LIST = 64 << 10
# Streams at once on one connection (SETTINGS_MAX_CONCURRENT_STREAMS); more are refused.
# High, because a refused ext_proc stream fails (Envoy may open streams before it has read
# this setting): the limit that keeps a connection below Envoy's control-frame flood limit
# is the ext_proc cluster's max_concurrent_streams (100) in envoy/*.yaml.
MAX_STREAMS = 10_000
# Decoded header blocks kept per connection (see ``H2Connection._metadata``).
HEADER_CACHE = 64
# Closed streams remembered per connection, to answer late frames on them (RFC 9113 §5.1).
RECENT_CLOSED = 1024
# How a remembered stream closed: we reset it or ended it while the peer was still sending
# (its late frames are ignored), the peer ended it, or the peer reset it.
CLOSED_BY_US, REMOTE_ENDED, REMOTE_RESET = 0, 1, 2
# Request header fields HTTP/2 forbids (RFC 9113 §8.2.2) and the pseudo-headers it defines.
CONNECTION_HEADERS = frozenset(
    ("connection", "keep-alive", "proxy-connection", "transfer-encoding", "upgrade")
)
REQUEST_PSEUDO = frozenset((":method", ":scheme", ":path", ":authority"))


# A reply that waits, ``(first, rest)``: ``first`` goes out now, the awaited ``rest`` after
# it. A plain tuple, so that a session needs nothing from this module to answer with one.
Deferred = tuple[bytes, Awaitable[bytes]]


class Session(Protocol):
    """One gRPC stream's handler: messages in, replies out, ``close`` exactly once."""

    def receive(self, message: bytes) -> bytes | Deferred | None: ...

    def close(self) -> None: ...


SessionFactory = Callable[[Mapping[str, str]], Session]


class ProtocolError(Exception):
    """The peer broke HTTP/2: the connection ends with GOAWAY and this error code."""

    def __init__(self, code: int, message: str) -> None:
        super().__init__(message)
        self.code = code


def frame(kind: int, flags: int, stream_id: int, payload: bytes = b"") -> bytes:
    n = len(payload)
    head = bytes((n >> 16, (n >> 8) & 0xFF, n & 0xFF, kind, flags))
    return head + stream_id.to_bytes(4, "big") + payload


def _hpack_int(value: int, prefix_bits: int, first: int = 0) -> bytes:
    limit = (1 << prefix_bits) - 1
    if value < limit:
        return bytes((first | value,))
    out = bytearray((first | limit,))
    value -= limit
    while value >= 128:
        out.append((value & 0x7F) | 0x80)
        value >>= 7
    out.append(value)
    return bytes(out)


def _literal(name: str, value: str) -> bytes:
    """A header as an HPACK literal without indexing: no state shared with the peer."""
    n, v = name.encode(), value.encode()
    return b"\x00" + _hpack_int(len(n), 7) + n + _hpack_int(len(v), 7) + v


_STATUS_200 = b"\x88"  # static table index 8
_CONTENT_TYPE = b"\x0f\x10" + _hpack_int(16, 7) + b"application/grpc"  # name index 31
RESPONSE_HEADERS = _STATUS_200 + _CONTENT_TYPE


def grpc_trailers(status: int, message: str = "") -> bytes:
    block = _literal("grpc-status", str(status))
    if message:
        safe = "".join(c if " " <= c <= "~" and c != "%" else f"%{ord(c):02X}" for c in message)
        block += _literal("grpc-message", safe)
    return block


_OK_TRAILERS = grpc_trailers(GRPC_OK)


def grpc_message(payload: bytes) -> bytes:
    return b"\x00" + len(payload).to_bytes(4, "big") + payload


def request_problem(headers: list[tuple[str, str]]) -> str | None:
    """What makes these request headers malformed (RFC 9113 §8.2, §8.3.1), or None."""
    seen: set[str] = set()
    regular = False
    for name, value in headers:
        if name.startswith(":"):
            if regular:
                return f"pseudo-header {name} after a regular header"
            if name not in REQUEST_PSEUDO:
                return f"pseudo-header {name} in a request"
            if name in seen:
                return f"pseudo-header {name} twice"
            if name == ":path" and not value:
                return "empty :path"
            seen.add(name)
            continue
        regular = True
        if name != name.lower():
            return f"header name {name!r} not in lower case"
        if name in CONNECTION_HEADERS:
            return f"connection-specific header {name}"
        if name == "te" and value != "trailers":
            return f"te: {value!r} (only 'trailers' is allowed)"
    missing = [n for n in (":method", ":scheme", ":path") if n not in seen]
    if missing:
        return f"no {', '.join(missing)}"
    return None


class _Stream:
    __slots__ = (
        "expected",
        "finish",
        "headers_sent",
        "id",
        "inbox",
        "outbox",
        "pending",
        "recv_unacked",
        "reject",
        "remote_done",
        "session",
        "task",
        "window",
    )

    def __init__(self, stream_id: int, session: Session | None, window: int) -> None:
        self.id = stream_id
        self.session = session
        self.window = window  # how much DATA we may still send on it
        self.inbox = bytearray()  # received bytes not yet a whole message
        self.outbox: collections.deque[bytes] = collections.deque()  # DATA blocked on windows
        self.pending: collections.deque[bytes] = collections.deque()  # behind a deferred reply
        self.task: asyncio.Task[bytes] | None = None
        self.headers_sent = False
        self.remote_done = False
        self.finish: bytes | None = None  # trailers waiting behind the outbox
        self.recv_unacked = 0
        # Not a gRPC call: these trailers answer it once the request ends.
        self.reject: bytes | None = None
        self.expected: int | None = None  # DATA bytes still due by content-length


class H2Connection(asyncio.Protocol):
    """One client connection (Envoy keeps one or a few, each carrying every request)."""

    def __init__(self, server: GrpcServer) -> None:
        self.server = server
        self.transport: asyncio.Transport | None = None
        self.buf = bytearray()
        self.preface_seen = False
        self.decoder = hpack.Decoder(max_header_list_size=MAX_HEADER_LIST)
        self.header_cache: dict[bytes, tuple[dict[str, str], str | None]] = {}
        self.streams: dict[int, _Stream] = {}
        # Closed stream id -> how it closed (CLOSED_BY_US, ...), oldest first.
        self.recent: collections.OrderedDict[int, int] = collections.OrderedDict()
        self.last_stream = 0
        self.send_window = DEFAULT_WINDOW
        self.peer_stream_window = DEFAULT_WINDOW
        self.peer_max_frame = DEFAULT_FRAME
        self.recv_unacked = 0
        self.out: list[bytes] = []
        self.blocked: set[int] = set()
        # A header block split over CONTINUATION frames: (stream id, flags, fragments).
        self.continuing: tuple[int, int, list[bytes]] | None = None
        self.going_away = False
        self.closed = False
        self.last_read = time.monotonic()
        self.ping_due: float | None = None
        self.keepalive: asyncio.TimerHandle | None = None

    # ----- asyncio.Protocol ------------------------------------------------------------

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        self.transport = transport  # type: ignore[assignment]  # uvloop's is no subclass
        self.server.connections.add(self)
        settings = (
            (S_MAX_CONCURRENT_STREAMS, MAX_STREAMS),
            (S_INITIAL_WINDOW_SIZE, OUR_STREAM_WINDOW),
            (S_MAX_FRAME_SIZE, OUR_MAX_FRAME),
            (S_MAX_HEADER_LIST_SIZE, MAX_HEADER_LIST),
            (S_ENABLE_PUSH, 0),
        )
        payload = b"".join(k.to_bytes(2, "big") + v.to_bytes(4, "big") for k, v in settings)
        grow = (MAX_WINDOW - DEFAULT_WINDOW).to_bytes(4, "big")
        self.out.append(frame(SETTINGS, 0, 0, payload) + frame(WINDOW_UPDATE, 0, 0, grow))
        self._flush()
        self._arm_keepalive()

    def data_received(self, data: bytes) -> None:
        self.last_read = time.monotonic()
        buf = self.buf
        buf += data
        try:
            if not self.preface_seen:
                if len(buf) < len(PREFACE):
                    if not PREFACE.startswith(bytes(buf)):
                        raise ProtocolError(PROTOCOL_ERROR, "not an HTTP/2 connection preface")
                    return
                if buf[: len(PREFACE)] != PREFACE:
                    raise ProtocolError(PROTOCOL_ERROR, "not an HTTP/2 connection preface")
                del buf[: len(PREFACE)]
                self.preface_seen = True
            pos, end = 0, len(buf)
            view = memoryview(buf)
            try:
                while end - pos >= 9:
                    length = (buf[pos] << 16) | (buf[pos + 1] << 8) | buf[pos + 2]
                    if length > OUR_MAX_FRAME:
                        raise ProtocolError(FRAME_SIZE_ERROR, f"frame of {length} bytes")
                    if end - pos < 9 + length:
                        break
                    kind, flags = buf[pos + 3], buf[pos + 4]
                    sid = int.from_bytes(view[pos + 5 : pos + 9], "big") & 0x7FFFFFFF
                    payload = bytes(view[pos + 9 : pos + 9 + length])
                    pos += 9 + length
                    self._on_frame(kind, flags, sid, payload)
                    if self.closed:
                        return
            finally:
                view.release()
            del buf[:pos]
        except ProtocolError as exc:
            self._fail(exc.code, str(exc))
            return
        self._flush()

    def connection_lost(self, exc: Exception | None) -> None:
        self.closed = True
        self.server.connections.discard(self)
        if self.keepalive is not None:
            self.keepalive.cancel()
        for st in list(self.streams.values()):
            self._end_session(st)
        self.streams.clear()
        self.server._connection_closed()

    def pause_writing(self) -> None:
        # The peer is not reading what we send: stop reading what it sends.
        if self.transport is not None and not self.closed:
            self.transport.pause_reading()

    def resume_writing(self) -> None:
        if self.transport is not None and not self.closed:
            self.transport.resume_reading()

    # ----- frames in -------------------------------------------------------------------

    def _on_frame(self, kind: int, flags: int, sid: int, payload: bytes) -> None:
        if self.continuing is not None and kind != CONTINUATION:
            raise ProtocolError(PROTOCOL_ERROR, "header block interrupted")
        if kind == DATA:
            self._on_data(flags, sid, payload)
        elif kind == HEADERS:
            if sid == 0:
                raise ProtocolError(PROTOCOL_ERROR, "HEADERS on stream 0")
            if flags & PADDED:
                payload = _unpad(payload)
            if flags & PRIORITY_FLAG:
                if len(payload) < 5:
                    raise ProtocolError(FRAME_SIZE_ERROR, "HEADERS priority cut short")
                if int.from_bytes(payload[:4], "big") & 0x7FFFFFFF == sid:
                    flags |= SELF_DEPENDENT  # a stream error once the block is decoded
                payload = payload[5:]
            if flags & END_HEADERS:
                self._on_headers(sid, flags, payload)
            else:
                self.continuing = (sid, flags, [payload])
        elif kind == CONTINUATION:
            if self.continuing is None or self.continuing[0] != sid:
                raise ProtocolError(PROTOCOL_ERROR, "unexpected CONTINUATION")
            self.continuing[2].append(payload)
            if sum(map(len, self.continuing[2])) > MAX_HEADER_LIST * 2:
                raise ProtocolError(PROTOCOL_ERROR, "header block too large")
            if flags & END_HEADERS:
                first_sid, first_flags, parts = self.continuing
                self.continuing = None
                self._on_headers(first_sid, first_flags, b"".join(parts))
        elif kind == SETTINGS:
            if sid != 0:
                raise ProtocolError(PROTOCOL_ERROR, "SETTINGS on a stream")
            if not flags & ACK:
                self._on_settings(payload)
                self.out.append(frame(SETTINGS, ACK, 0))
            elif payload:
                raise ProtocolError(FRAME_SIZE_ERROR, "SETTINGS ack with a payload")
        elif kind == WINDOW_UPDATE:
            self._on_window_update(sid, payload)
        elif kind == PING:
            if sid != 0:
                raise ProtocolError(PROTOCOL_ERROR, "PING on a stream")
            if len(payload) != 8:
                raise ProtocolError(FRAME_SIZE_ERROR, "PING not 8 bytes")
            if flags & ACK:
                self.ping_due = None
            else:
                self.out.append(frame(PING, ACK, 0, payload))
        elif kind == RST_STREAM:
            if sid == 0:
                raise ProtocolError(PROTOCOL_ERROR, "RST_STREAM on stream 0")
            if len(payload) != 4:
                raise ProtocolError(FRAME_SIZE_ERROR, "RST_STREAM not 4 bytes")
            st = self.streams.pop(sid, None)
            if st is not None:
                self.blocked.discard(sid)
                self._end_session(st)
                self._remember(sid, REMOTE_RESET)
            elif sid > self.last_stream:
                raise ProtocolError(PROTOCOL_ERROR, f"RST_STREAM on idle stream {sid}")
        elif kind == PRIORITY:
            # Priorities are ignored (RFC 9113 §5.3.2), but a malformed one is an error.
            if sid == 0:
                raise ProtocolError(PROTOCOL_ERROR, "PRIORITY on stream 0")
            if len(payload) != 5:
                self._stream_error(sid, FRAME_SIZE_ERROR)
            elif int.from_bytes(payload[:4], "big") & 0x7FFFFFFF == sid:
                self._stream_error(sid, PROTOCOL_ERROR)
        elif kind == GOAWAY:
            if sid != 0:
                raise ProtocolError(PROTOCOL_ERROR, "GOAWAY on a stream")
            self.going_away = True
            if not self.streams:
                self._close()
        elif kind == PUSH_PROMISE:
            raise ProtocolError(PROTOCOL_ERROR, "PUSH_PROMISE from a client")
        # Unknown frame types are ignored (RFC 9113 §5.5).

    def _on_settings(self, payload: bytes) -> None:
        if len(payload) % 6:
            raise ProtocolError(FRAME_SIZE_ERROR, "SETTINGS length not a multiple of 6")
        for i in range(0, len(payload), 6):
            key = int.from_bytes(payload[i : i + 2], "big")
            value = int.from_bytes(payload[i + 2 : i + 6], "big")
            if key == S_ENABLE_PUSH and value > 1:
                raise ProtocolError(PROTOCOL_ERROR, f"SETTINGS_ENABLE_PUSH {value}")
            if key == S_INITIAL_WINDOW_SIZE:
                if value > MAX_WINDOW:
                    raise ProtocolError(FLOW_CONTROL_ERROR, "initial window too large")
                delta = value - self.peer_stream_window
                self.peer_stream_window = value
                for st in self.streams.values():
                    st.window += delta
                if delta > 0:
                    self._drain_blocked()
            elif key == S_MAX_FRAME_SIZE:
                if not DEFAULT_FRAME <= value <= 2**24 - 1:
                    raise ProtocolError(PROTOCOL_ERROR, f"max frame size {value}")
                self.peer_max_frame = value
            # Header table size: we never index, so any size the peer picks is fine.

    def _on_window_update(self, sid: int, payload: bytes) -> None:
        if len(payload) != 4:
            raise ProtocolError(FRAME_SIZE_ERROR, "malformed WINDOW_UPDATE")
        inc = int.from_bytes(payload, "big") & 0x7FFFFFFF
        if sid == 0:
            if inc == 0:
                raise ProtocolError(PROTOCOL_ERROR, "WINDOW_UPDATE of 0")
            self.send_window += inc
            if self.send_window > MAX_WINDOW:
                raise ProtocolError(FLOW_CONTROL_ERROR, "connection window overflow")
        else:
            st = self.streams.get(sid)
            if st is None:
                if sid > self.last_stream:
                    raise ProtocolError(PROTOCOL_ERROR, f"WINDOW_UPDATE on idle stream {sid}")
                return
            st.window += inc
            if inc == 0 or st.window > MAX_WINDOW:
                self._reset(st, PROTOCOL_ERROR if inc == 0 else FLOW_CONTROL_ERROR)
                return
        self._drain_blocked()

    def _metadata(self, block: bytes) -> tuple[dict[str, str], str | None]:
        """Decode a header block; a repeated one that leaves the table alone is looked up.

        Envoy sends the same block for every ext_proc stream of a connection (its
        dynamic table entries plus a Huffman-coded ``:path`` literal), and decoding
        that in pure Python is a quarter of the per-request CPU. The second value says
        what is malformed in it as request headers (checked once per distinct block).
        """
        cache = self.header_cache
        cached = cache.get(block)
        if cached is not None:
            return cached
        try:
            headers = [(str(k), str(v)) for k, v in self.decoder.decode(block)]
        except hpack.HPACKError as exc:
            raise ProtocolError(COMPRESSION_ERROR, f"bad header block: {exc}") from None
        decoded = dict(headers), request_problem(headers)
        if changes_table(block):
            cache.clear()  # cached blocks may refer to entries that have moved
        else:
            if len(cache) >= HEADER_CACHE:
                cache.clear()
            cache[block] = decoded
        return decoded

    def _on_headers(self, sid: int, flags: int, block: bytes) -> None:
        metadata, problem = self._metadata(block)
        st = self.streams.get(sid)
        if st is not None:  # trailers
            if st.remote_done:
                raise ProtocolError(STREAM_CLOSED, f"HEADERS on half-closed stream {sid}")
            if not flags & END_STREAM:
                raise ProtocolError(PROTOCOL_ERROR, "second HEADERS without END_STREAM")
            self._on_remote_end(st)
            return
        if sid % 2 == 0:
            raise ProtocolError(PROTOCOL_ERROR, f"HEADERS on even stream {sid}")
        if sid <= self.last_stream:
            self._on_closed_stream(sid, "HEADERS")
            return
        self.last_stream = sid
        if problem is not None or flags & SELF_DEPENDENT:
            log.warning("malformed request on an ext_proc connection: %s",
                        problem or "stream depends on itself")  # fmt: skip
            self._stream_error(sid, PROTOCOL_ERROR)
            return
        if self.going_away or len(self.streams) >= MAX_STREAMS:
            self.out.append(frame(RST_STREAM, 0, sid, REFUSED_STREAM.to_bytes(4, "big")))
            return
        st = _Stream(sid, None, self.peer_stream_window)
        self.streams[sid] = st
        length = metadata.get("content-length")
        if length is not None:
            if not length.isdigit():
                self._reset(st, PROTOCOL_ERROR)
                return
            st.expected = int(length)
        if metadata.get(":path") != self.server.path or metadata.get(":method") != "POST":
            unknown = grpc_trailers(GRPC_UNIMPLEMENTED, f"unknown method {metadata.get(':path')}")
            if metadata.get("content-type", "").startswith("application/grpc"):
                self._finish(st, unknown)  # a gRPC client hears at once, as from any server
            else:  # anything else is answered once its request has ended
                st.reject = unknown
                if flags & END_STREAM:
                    self._on_remote_end(st)
            return
        try:
            st.session = self.server.factory(metadata)
        except Exception:
            log.exception("cannot open an ext_proc stream")
            self._finish(st, grpc_trailers(GRPC_INTERNAL, "extproc error"))
            return
        if flags & END_STREAM:
            self._on_remote_end(st)

    def _on_data(self, flags: int, sid: int, payload: bytes) -> None:
        if sid == 0:
            raise ProtocolError(PROTOCOL_ERROR, "DATA on stream 0")
        length = len(payload)
        if flags & PADDED:
            payload = _unpad(payload)
        self.recv_unacked += length
        if self.recv_unacked > MAX_WINDOW // 2:
            self.out.append(frame(WINDOW_UPDATE, 0, 0, self.recv_unacked.to_bytes(4, "big")))
            self.recv_unacked = 0
        st = self.streams.get(sid)
        if st is None:
            if sid > self.last_stream:
                raise ProtocolError(PROTOCOL_ERROR, f"DATA on idle stream {sid}")
            self._on_closed_stream(sid, "DATA")  # the bytes are counted and dropped
            return
        if st.remote_done:
            self._reset(st, STREAM_CLOSED)
            return
        st.recv_unacked += length
        if st.recv_unacked > OUR_STREAM_WINDOW // 2 and not flags & END_STREAM:
            self.out.append(frame(WINDOW_UPDATE, 0, sid, st.recv_unacked.to_bytes(4, "big")))
            st.recv_unacked = 0
        if st.expected is not None:
            st.expected -= len(payload)
            if st.expected < 0 or (flags & END_STREAM and st.expected):
                self._reset(st, PROTOCOL_ERROR)  # not the content-length it announced
                return
        if st.session is None:  # not a gRPC call, or already answered: dropped
            if flags & END_STREAM:
                self._on_remote_end(st)
            return
        inbox = st.inbox
        inbox += payload
        while len(inbox) >= 5 and st.finish is None:
            size = int.from_bytes(inbox[1:5], "big")
            if inbox[0] != 0:
                self._finish(st, grpc_trailers(GRPC_UNIMPLEMENTED, "compressed messages"))
                return
            if size > MAX_MESSAGE:
                self._finish(st, grpc_trailers(GRPC_RESOURCE_EXHAUSTED, "message too large"))
                return
            if len(inbox) < 5 + size:
                break
            message = bytes(inbox[5 : 5 + size])
            del inbox[: 5 + size]
            if st.task is not None:
                st.pending.append(message)
            else:
                self._deliver(st, message)
            if st.id not in self.streams:
                return
        if flags & END_STREAM:
            self._on_remote_end(st)

    # ----- sessions --------------------------------------------------------------------

    def _deliver(self, st: _Stream, message: bytes) -> None:
        session = st.session
        if session is None:
            return
        try:
            reply = session.receive(message)
        except Exception:
            log.exception("error handling an ext_proc message")
            self._finish(st, grpc_trailers(GRPC_INTERNAL, "extproc error"))
            return
        if reply is None:
            return
        if isinstance(reply, tuple):
            first, rest = reply
            self._send_message(st, first)
            task = st.task = asyncio.ensure_future(rest)
            task.add_done_callback(functools.partial(self._later_done, st))
            return
        self._send_message(st, reply)

    def _later_done(self, st: _Stream, task: asyncio.Task[bytes]) -> None:
        st.task = None
        if task.cancelled() or self.closed or self.streams.get(st.id) is not st:
            return
        exc = task.exception()
        if exc is not None:
            log.error("error handling an ext_proc message", exc_info=exc)
            self._finish(st, grpc_trailers(GRPC_INTERNAL, "extproc error"))
        else:
            self._send_message(st, task.result())
            while st.pending and st.task is None and self.streams.get(st.id) is st:
                self._deliver(st, st.pending.popleft())
            if st.remote_done and st.task is None and self.streams.get(st.id) is st:
                self._finish(st, _OK_TRAILERS)
        self._flush()

    def _on_remote_end(self, st: _Stream) -> None:
        st.remote_done = True
        if st.expected:
            self._reset(st, PROTOCOL_ERROR)  # ended short of its content-length
        elif st.task is None:
            self._finish(st, st.reject or _OK_TRAILERS)

    def _on_closed_stream(self, sid: int, kind: str) -> None:
        """DATA or HEADERS on a stream that has closed (RFC 9113 §5.1)."""
        how = self.recent.get(sid)
        if how == REMOTE_ENDED:
            raise ProtocolError(STREAM_CLOSED, f"{kind} on closed stream {sid}")
        if how == REMOTE_RESET:
            self.out.append(frame(RST_STREAM, 0, sid, STREAM_CLOSED.to_bytes(4, "big")))
        elif how is None and kind == "HEADERS":
            raise ProtocolError(PROTOCOL_ERROR, f"HEADERS on stream {sid} after {self.last_stream}")
        # CLOSED_BY_US: frames the peer sent before it saw our end are ignored.

    def _remember(self, sid: int, how: int) -> None:
        recent = self.recent
        if len(recent) >= RECENT_CLOSED:
            recent.popitem(last=False)
        recent[sid] = how

    def _stream_error(self, sid: int, code: int) -> None:
        st = self.streams.get(sid)
        if st is not None:
            self._reset(st, code)
        else:
            self.out.append(frame(RST_STREAM, 0, sid, code.to_bytes(4, "big")))
            self._remember(sid, CLOSED_BY_US)

    def _end_session(self, st: _Stream) -> None:
        if st.task is not None:
            st.task.cancel()
            st.task = None
        session, st.session = st.session, None
        if session is not None:
            try:
                session.close()
            except Exception:
                log.exception("error closing an ext_proc stream")

    # ----- frames out ------------------------------------------------------------------

    def _send_message(self, st: _Stream, payload: bytes) -> None:
        if not st.headers_sent:
            st.headers_sent = True
            self.out.append(frame(HEADERS, END_HEADERS, st.id, RESPONSE_HEADERS))
        data = grpc_message(payload)
        if st.outbox:
            st.outbox.append(data)
            return
        self._send_data(st, data)

    def _send_data(self, st: _Stream, data: bytes) -> bool:
        """Send what the windows allow; park the rest. True when all of it went out."""
        while data:
            n = min(len(data), self.peer_max_frame, self.send_window, st.window)
            if n <= 0:
                st.outbox.appendleft(data)
                self.blocked.add(st.id)
                return False
            self.out.append(frame(DATA, 0, st.id, data[:n]))
            self.send_window -= n
            st.window -= n
            data = data[n:]
        return True

    def _drain_blocked(self) -> None:
        for sid in list(self.blocked):
            st = self.streams.get(sid)
            if st is None:
                self.blocked.discard(sid)
                continue
            while st.outbox:
                if not self._send_data(st, st.outbox.popleft()):
                    break
            if not st.outbox:
                self.blocked.discard(sid)
                if st.finish is not None:
                    self._write_trailers(st, st.finish)

    def _finish(self, st: _Stream, trailers: bytes) -> None:
        """End our side of the stream with these trailers (after any parked DATA)."""
        if st.finish is not None:
            return
        st.finish = trailers
        self._end_session(st)
        if not st.outbox:
            self._write_trailers(st, trailers)

    def _write_trailers(self, st: _Stream, trailers: bytes) -> None:
        if st.headers_sent:
            self.out.append(frame(HEADERS, END_HEADERS | END_STREAM, st.id, trailers))
        else:  # trailers-only response
            block = RESPONSE_HEADERS + trailers
            self.out.append(frame(HEADERS, END_HEADERS | END_STREAM, st.id, block))
        self.streams.pop(st.id, None)
        self.blocked.discard(st.id)
        if st.remote_done:
            self._remember(st.id, REMOTE_ENDED)
        else:
            # The client may still be sending: tell it to stop (RFC 9113 §8.1).
            self.out.append(frame(RST_STREAM, 0, st.id, NO_ERROR.to_bytes(4, "big")))
            self._remember(st.id, CLOSED_BY_US)
        if self.going_away and not self.streams:
            self._flush()
            self._close()

    def _reset(self, st: _Stream, code: int) -> None:
        self.streams.pop(st.id, None)
        self.blocked.discard(st.id)
        self._end_session(st)
        self.out.append(frame(RST_STREAM, 0, st.id, code.to_bytes(4, "big")))
        self._remember(st.id, CLOSED_BY_US)

    def _flush(self) -> None:
        if self.out and self.transport is not None and not self.closed:
            self.transport.write(b"".join(self.out))
        self.out.clear()

    def _fail(self, code: int, message: str) -> None:
        log.warning("closing an ext_proc connection: %s", message)
        self.server.closed_for["protocol_error"] += 1
        goaway = self.last_stream.to_bytes(4, "big") + code.to_bytes(4, "big") + message.encode()
        self.out.append(frame(GOAWAY, 0, 0, goaway))
        self._flush()
        self._close()

    def _close(self) -> None:
        if not self.closed and self.transport is not None:
            self.closed = True
            self.transport.close()

    def go_away(self) -> None:
        """Refuse new streams; close once the open ones end."""
        if self.closed or self.going_away:
            return
        self.going_away = True
        goaway = self.last_stream.to_bytes(4, "big") + NO_ERROR.to_bytes(4, "big")
        self.out.append(frame(GOAWAY, 0, 0, goaway))
        self._flush()
        if not self.streams:
            self._close()

    # ----- keepalive -------------------------------------------------------------------

    def _arm_keepalive(self) -> None:
        loop = asyncio.get_running_loop()
        self.keepalive = loop.call_later(self.server.keepalive_check, self._keepalive_tick)

    def _keepalive_tick(self) -> None:
        if self.closed:
            return
        now = time.monotonic()
        if self.ping_due is not None and now >= self.ping_due:
            log.warning("closing an ext_proc connection: no PING ack within %.0fs",
                        self.server.keepalive_timeout)  # fmt: skip
            self.server.closed_for["keepalive_timeout"] += 1
            self._close()
            return
        if self.ping_due is None and now - self.last_read >= self.server.keepalive_time:
            self.ping_due = now + self.server.keepalive_timeout
            self.out.append(frame(PING, 0, 0, b"extproc!"))
            self._flush()
        self._arm_keepalive()


def _hpack_int_at(block: bytes, i: int, prefix_bits: int) -> tuple[int, int]:
    """The HPACK integer at ``block[i]`` and the index after it (RFC 7541 §5.1)."""
    limit = (1 << prefix_bits) - 1
    value = block[i] & limit
    i += 1
    if value < limit:
        return value, i
    shift = 0
    while True:
        b = block[i]
        i += 1
        value += (b & 0x7F) << shift
        shift += 7
        if not b & 0x80:
            return value, i


def changes_table(block: bytes) -> bool:
    """Whether decoding this HPACK block adds to or resizes the dynamic table (RFC 7541 §6).

    A block that does not is a pure function of its bytes and the table as it stands.
    A malformed block counts as changing it (it is never cached; the decoder reports it).
    """
    i, n = 0, len(block)
    try:
        while i < n:
            b = block[i]
            if b & 0x80:  # indexed field
                _, i = _hpack_int_at(block, i, 7)
                continue
            if b & 0x60:  # literal with incremental indexing, or a table size update
                return True
            # Literal without indexing or never indexed: 4-bit name index, then strings.
            name_index, i = _hpack_int_at(block, i, 4)
            for _ in range(2 if name_index == 0 else 1):
                length, i = _hpack_int_at(block, i, 7)
                i += length
    except IndexError:
        return True
    return i != n


def _unpad(payload: bytes) -> bytes:
    if not payload or payload[0] >= len(payload):
        raise ProtocolError(PROTOCOL_ERROR, "bad padding")
    return payload[1 : len(payload) - payload[0]]


class GrpcServer:
    """Serves one bidirectional-streaming gRPC method on a TCP port."""

    def __init__(
        self,
        path: str,
        factory: SessionFactory,
        *,
        keepalive_time: float = 30.0,
        keepalive_timeout: float = 10.0,
    ) -> None:
        self.path = path
        self.factory = factory
        self.keepalive_time = keepalive_time
        self.keepalive_timeout = keepalive_timeout
        self.keepalive_check = min(keepalive_time, keepalive_timeout) / 2
        self.connections: set[H2Connection] = set()
        # Connections this server closed on an error: "protocol_error", "keepalive_timeout".
        self.closed_for: collections.Counter[str] = collections.Counter()
        self._server: asyncio.Server | None = None
        self._idle = asyncio.Event()

    async def start(self, host: str, port: int) -> None:
        loop = asyncio.get_running_loop()
        self._server = await loop.create_server(
            lambda: H2Connection(self), host or None, port, reuse_address=True, backlog=1024
        )

    @property
    def ports(self) -> list[int]:
        if self._server is None:
            return []
        return sorted({s.getsockname()[1] for s in self._server.sockets})

    def _connection_closed(self) -> None:
        if not self.connections:
            self._idle.set()

    async def stop(self, grace: float) -> None:
        """Stop listening, let open streams end for up to ``grace`` seconds, then close."""
        if self._server is not None:
            self._server.close()
        for conn in list(self.connections):
            conn.go_away()
        if self.connections:
            self._idle.clear()
            try:
                await asyncio.wait_for(self._idle.wait(), grace)
            except TimeoutError:
                for conn in list(self.connections):
                    conn._close()
        if self._server is not None:
            await self._server.wait_closed()
