"""One HTTP/2 connection of the builtin gRPC server: settings, flow control, streams.

Frames are read in ``data_received`` and handled in the same callback; each gRPC message
goes to its stream's session (:mod:`extproc.transport.session`) and every reply of one
read leaves in one write. Flow control runs both ways: we grant the peer windows as we
read, and DATA that our peer's windows do not allow yet waits in its stream's outbox.
A stream lives from its request HEADERS to our trailers or a reset by either side; the
last closed streams are remembered to answer frames that arrive on them late.

A protocol error closes this connection with GOAWAY and a log line; other connections
and streams carry on. A stream error resets that stream only.
"""

from __future__ import annotations

import asyncio
import collections
import functools
import logging
import time
from typing import TYPE_CHECKING

from extproc.transport.h2.frames import (
    ACK,
    CONTINUATION,
    DATA,
    DEFAULT_FRAME,
    DEFAULT_WINDOW,
    END_HEADERS,
    END_STREAM,
    FLOW_CONTROL_ERROR,
    FRAME_SIZE_ERROR,
    GOAWAY,
    HEADERS,
    MAX_WINDOW,
    NO_ERROR,
    PADDED,
    PING,
    PREFACE,
    PRIORITY,
    PRIORITY_FLAG,
    PROTOCOL_ERROR,
    PUSH_PROMISE,
    REFUSED_STREAM,
    RST_STREAM,
    S_ENABLE_PUSH,
    S_INITIAL_WINDOW_SIZE,
    S_MAX_CONCURRENT_STREAMS,
    S_MAX_FRAME_SIZE,
    S_MAX_HEADER_LIST_SIZE,
    SETTINGS,
    STREAM_CLOSED,
    WINDOW_UPDATE,
    ProtocolError,
    frame,
    unpad,
)
from extproc.transport.h2.grpc_wire import (
    GRPC_INTERNAL,
    GRPC_RESOURCE_EXHAUSTED,
    GRPC_UNIMPLEMENTED,
    MAX_MESSAGE,
    OK_TRAILERS,
    RESPONSE_HEADERS,
    grpc_message,
    grpc_trailers,
)
from extproc.transport.h2.headers import MAX_HEADER_LIST, HeaderBlocks
from extproc.transport.session import Session, StatusError

if TYPE_CHECKING:
    from extproc.transport.h2server import GrpcServer

# One logger for the builtin server, whichever part of it logs.
log = logging.getLogger("extproc.transport.h2server")

# What we accept: frames up to 1 MiB, 4 MiB of unread data per stream.
OUR_MAX_FRAME = 1 << 20
# A reply message larger than this is written at once (a full-duplex request body sent
# back), so that the replies to one read do not pile up in memory before one write.
FLUSH_LARGE = 256 * 1024
OUR_STREAM_WINDOW = 4 << 20
# Streams at once on one connection (SETTINGS_MAX_CONCURRENT_STREAMS); more are refused.
# High, because a refused ext_proc stream fails (Envoy may open streams before it has read
# this setting): the limit that keeps a connection below Envoy's control-frame flood limit
# is the ext_proc cluster's max_concurrent_streams (100) in envoy/*.yaml.
MAX_STREAMS = 10_000
# Not on the wire: marks a HEADERS frame whose priority names its own stream.
SELF_DEPENDENT = 0x100
# Closed streams remembered per connection, to answer late frames on them (RFC 9113 §5.1).
RECENT_CLOSED = 1024
# How a remembered stream closed: we reset it or ended it while the peer was still sending
# (its late frames are ignored), the peer ended it, or the peer reset it.
CLOSED_BY_US, REMOTE_ENDED, REMOTE_RESET = 0, 1, 2


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
        self.task: asyncio.Task[bytes | list[bytes]] | None = None
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
        self.header_blocks = HeaderBlocks()
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
        self.server.connection_closed()

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
                payload = unpad(payload)
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
                self.close()
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

    def _on_headers(self, sid: int, flags: int, block: bytes) -> None:
        metadata, problem = self.header_blocks.decode(block)
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
        factory = self.server.methods.get(metadata.get(":path", ""))
        if factory is None or metadata.get(":method") != "POST":
            unknown = grpc_trailers(GRPC_UNIMPLEMENTED, f"unknown method {metadata.get(':path')}")
            if metadata.get("content-type", "").startswith("application/grpc"):
                self._finish(st, unknown)  # a gRPC client hears at once, as from any server
            else:  # anything else is answered once its request has ended
                st.reject = unknown
                if flags & END_STREAM:
                    self._on_remote_end(st)
            return
        try:
            st.session = factory(metadata)
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
            payload = unpad(payload)
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
        except StatusError as exc:
            self._finish(st, grpc_trailers(exc.code, exc.message))
            return
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
        self._send_messages(st, reply)

    def _later_done(self, st: _Stream, task: asyncio.Task[bytes | list[bytes]]) -> None:
        st.task = None
        if task.cancelled() or self.closed or self.streams.get(st.id) is not st:
            return
        exc = task.exception()
        if exc is not None:
            log.error("error handling an ext_proc message", exc_info=exc)
            self._finish(st, grpc_trailers(GRPC_INTERNAL, "extproc error"))
        else:
            self._send_messages(st, task.result())
            while st.pending and st.task is None and self.streams.get(st.id) is st:
                self._deliver(st, st.pending.popleft())
            if st.remote_done and st.task is None and self.streams.get(st.id) is st:
                self._finish(st, OK_TRAILERS)
        self._flush()

    def _on_remote_end(self, st: _Stream) -> None:
        st.remote_done = True
        if st.expected:
            self._reset(st, PROTOCOL_ERROR)  # ended short of its content-length
        elif st.task is None:
            self._finish(st, st.reject or OK_TRAILERS)

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

    def _send_messages(self, st: _Stream, payload: bytes | list[bytes]) -> None:
        if isinstance(payload, list):
            for one in payload:
                self._send_message(st, one)
        else:
            self._send_message(st, payload)

    def _send_message(self, st: _Stream, payload: bytes) -> None:
        if not st.headers_sent:
            st.headers_sent = True
            self.out.append(frame(HEADERS, END_HEADERS, st.id, RESPONSE_HEADERS))
        data = grpc_message(payload)
        if st.outbox:
            st.outbox.append(data)
            return
        if self._send_data(st, data) and len(data) > FLUSH_LARGE:
            self._flush()  # written now rather than gathered with the read's other replies

    def _send_data(self, st: _Stream, data: bytes) -> bool:
        """Send what the windows allow; park the rest. True when all of it went out."""
        sent, size = 0, len(data)
        while sent < size:  # each frame's bytes copied once (a large message has thousands)
            n = min(size - sent, self.peer_max_frame, self.send_window, st.window)
            if n <= 0:
                st.outbox.appendleft(data[sent:])
                self.blocked.add(st.id)
                return False
            self.out.append(frame(DATA, 0, st.id, data[sent : sent + n]))
            self.send_window -= n
            st.window -= n
            sent += n
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
            self.close()

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
        self.close()

    def close(self) -> None:
        """Close the socket now; open streams end with it."""
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
            self.close()

    # ----- keepalive -------------------------------------------------------------------

    def _arm_keepalive(self) -> None:
        loop = asyncio.get_running_loop()
        self.keepalive = loop.call_later(self.server.keepalive_check, self._keepalive_due)

    def _keepalive_due(self) -> None:
        """The keepalive timer: a check that raises is counted, and the next one is armed."""
        self.keepalive = None
        self.server.keepalive_guard.call(self._keepalive_tick)
        if not self.closed:
            self._arm_keepalive()

    def _keepalive_tick(self) -> None:
        if self.closed:
            return
        now = time.monotonic()
        if self.ping_due is not None and now >= self.ping_due:
            log.warning("closing an ext_proc connection: no PING ack within %.0fs",
                        self.server.keepalive_timeout)  # fmt: skip
            self.server.closed_for["keepalive_timeout"] += 1
            self.close()
            return
        if self.ping_due is None and now - self.last_read >= self.server.keepalive_time:
            self.ping_due = now + self.server.keepalive_timeout
            self.out.append(frame(PING, 0, 0, b"extproc!"))
            self._flush()
