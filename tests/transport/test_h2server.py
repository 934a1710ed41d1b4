"""The builtin HTTP/2 gRPC server against grpcio's client and against a raw socket peer."""

from __future__ import annotations

import asyncio
import contextlib
import random
from collections.abc import AsyncIterator, Awaitable, Callable, Mapping
from typing import cast

import grpc
import hpack
import pytest

from extproc.transport.h2 import frames
from extproc.transport.h2.connection import MAX_STREAMS, OUR_MAX_FRAME
from extproc.transport.h2.grpc_wire import grpc_message
from extproc.transport.h2.headers import changes_table
from extproc.transport.h2server import GrpcServer
from extproc.transport.session import Deferred, Session

PATH = "/test.Echo/Chat"


class Recorder:
    """Sessions that echo with a prefix; ``raise`` raises, ``wait:x`` answers after a gate."""

    def __init__(self) -> None:
        self.metadata: list[Mapping[str, str]] = []
        self.closed: list[int] = []
        self.opened = 0
        self.gate = asyncio.Event()

    def factory(self, metadata: Mapping[str, str]) -> Session:
        self.metadata.append(metadata)
        self.opened += 1
        return _EchoSession(self, self.opened, metadata.get("x-prefix", ""))


class _EchoSession:
    def __init__(self, rec: Recorder, n: int, prefix: str) -> None:
        self.rec, self.n, self.prefix = rec, n, prefix.encode()

    def receive(self, message: bytes) -> bytes | Deferred | None:
        if message == b"raise":
            raise RuntimeError("boom")
        if message == b"silent":
            return None
        if message.startswith(b"wait:"):

            async def rest() -> bytes:
                await self.rec.gate.wait()
                return b"after:" + message[5:]

            return (b"first:" + message[5:], rest())
        return self.prefix + message

    def close(self) -> None:
        self.rec.closed.append(self.n)


async def _until(cond: Callable[[], bool], what: str, timeout: float = 5.0) -> None:
    loop = asyncio.get_running_loop()
    deadline = loop.time() + timeout
    while not cond():
        if loop.time() > deadline:
            raise AssertionError(f"timed out waiting for {what}")
        await asyncio.sleep(0.01)


@pytest.fixture
async def loop_errors() -> AsyncIterator[list[dict[str, object]]]:
    """Errors that reach the event loop's exception handler; a test asserts there are none."""
    loop = asyncio.get_running_loop()
    errors: list[dict[str, object]] = []
    previous = loop.get_exception_handler()
    loop.set_exception_handler(lambda _loop, ctx: errors.append(ctx))
    yield errors
    loop.set_exception_handler(previous)


@pytest.fixture
async def served(
    loop_errors: list[dict[str, object]],
) -> AsyncIterator[tuple[GrpcServer, Recorder]]:
    rec = Recorder()
    server = GrpcServer(PATH, rec.factory)
    await server.start("127.0.0.1", 0)
    yield server, rec
    await server.stop(1.0)
    assert loop_errors == []


def _channel(server: GrpcServer) -> grpc.aio.Channel:
    options = [("grpc.max_receive_message_length", -1), ("grpc.max_send_message_length", -1)]
    return grpc.aio.insecure_channel(f"127.0.0.1:{server.ports[0]}", options=options)


def _call(channel: grpc.aio.Channel, path: str = PATH) -> Callable[..., grpc.aio.StreamStreamCall]:
    return channel.stream_stream(path, request_serializer=None, response_deserializer=None)


# ----- through grpcio's client --------------------------------------------------------


async def _waiting(ch: grpc.aio.Channel, tag: str) -> grpc.aio.StreamStreamCall:
    """A stream whose session answered ``first:<tag>`` and holds the rest until the gate."""
    call = _call(ch)()
    await call.write(f"wait:{tag}".encode())
    assert await call.read() == f"first:{tag}".encode()
    return call


async def test_replies_in_order_and_stream_ends_ok(served: tuple[GrpcServer, Recorder]) -> None:
    server, rec = served
    async with _channel(server) as ch:
        call = _call(ch)(metadata=(("x-prefix", "p-"),))
        got = []
        for i in range(20):
            await call.write(f"m{i}".encode())
            got.append(await call.read())
        await call.done_writing()
        assert await call.read() is grpc.aio.EOF
        assert await call.code() == grpc.StatusCode.OK
    assert got == [f"p-m{i}".encode() for i in range(20)]
    assert rec.metadata[0][":path"] == PATH
    assert rec.metadata[0]["x-prefix"] == "p-"
    await _until(lambda: rec.closed == [1], "close() once")


async def test_many_concurrent_streams_on_one_connection(
    served: tuple[GrpcServer, Recorder],
) -> None:
    server, rec = served

    async def one(ch: grpc.aio.Channel, i: int) -> list[bytes]:
        call = _call(ch)(metadata=(("x-prefix", f"{i}:"),))
        out = []
        for j in range(3):
            await call.write(b"x" * j)
            out.append(await call.read())
        await call.done_writing()
        assert await call.code() == grpc.StatusCode.OK
        return out

    async with _channel(server) as ch:
        results = await asyncio.gather(*(one(ch, i) for i in range(200)))
    for i, out in enumerate(results):
        assert out == [f"{i}:".encode() + b"x" * j for j in range(3)]
    await _until(lambda: len(rec.closed) == 200, "every session closed")
    assert sorted(rec.closed) == list(range(1, 201))
    assert len(server.connections) <= 1


@pytest.mark.parametrize("size", [17 << 10, (1 << 20) + 3, 5 << 20])
async def test_large_messages_cross_frames_and_windows(
    served: tuple[GrpcServer, Recorder], size: int
) -> None:
    server, _ = served
    body = random.Random(size).randbytes(size)
    async with _channel(server) as ch:
        call = _call(ch)()
        for _ in range(2):
            await call.write(body)
            assert await call.read() == body
        await call.done_writing()
        assert await call.code() == grpc.StatusCode.OK


async def test_unknown_method_is_unimplemented(served: tuple[GrpcServer, Recorder]) -> None:
    server, rec = served
    async with _channel(server) as ch:
        call = _call(ch, "/test.Echo/Other")()
        await call.done_writing()
        assert await call.code() == grpc.StatusCode.UNIMPLEMENTED
        assert "/test.Echo/Other" in await call.details()
    assert rec.opened == 0


async def test_session_error_is_internal_and_other_streams_carry_on(
    served: tuple[GrpcServer, Recorder],
) -> None:
    server, rec = served
    async with _channel(server) as ch:
        good = _call(ch)()
        await good.write(b"a")
        assert await good.read() == b"a"
        bad = _call(ch)()
        await bad.write(b"raise")
        assert await bad.code() == grpc.StatusCode.INTERNAL
        assert await bad.details() == "extproc error"
        await good.write(b"b")
        assert await good.read() == b"b"
        await good.done_writing()
        assert await good.code() == grpc.StatusCode.OK
    await _until(lambda: sorted(rec.closed) == [1, 2], "both sessions closed once")


async def test_later_reply_keeps_the_stream_in_order(served: tuple[GrpcServer, Recorder]) -> None:
    server, rec = served
    async with _channel(server) as ch:
        call = await _waiting(ch, "q")
        # Sent while the deferred reply is pending: its reply must come after the rest.
        await call.write(b"next")
        await call.write(b"silent")
        await call.done_writing()
        read = asyncio.ensure_future(call.read())
        await asyncio.sleep(0.05)
        assert not read.done()
        rec.gate.set()
        assert await read == b"after:q"
        assert await call.read() == b"next"
        assert await call.read() is grpc.aio.EOF
        assert await call.code() == grpc.StatusCode.OK
    await _until(lambda: rec.closed == [1], "close() once")


async def test_cancel_closes_the_session_once(served: tuple[GrpcServer, Recorder]) -> None:
    server, rec = served
    async with _channel(server) as ch:
        call = await _waiting(ch, "c")
        call.cancel()
        await _until(lambda: rec.closed == [1], "close() after the client's RST_STREAM")
        # The stream is gone; the connection still serves.
        again = _call(ch)()
        await again.write(b"z")
        assert await again.read() == b"z"
        await again.done_writing()
        assert await again.code() == grpc.StatusCode.OK
    rec.gate.set()
    await _until(lambda: sorted(rec.closed) == [1, 2], "each session closed once")


async def test_stop_lets_open_streams_finish_within_grace(loop_errors: list[object]) -> None:
    rec = Recorder()
    server = GrpcServer(PATH, rec.factory)
    await server.start("127.0.0.1", 0)
    port = server.ports[0]
    async with _channel(server) as ch:
        call = await _waiting(ch, "s")
        stopping = asyncio.ensure_future(server.stop(5.0))
        await _until(lambda: server._server is not None and not server._server.is_serving(), "stop")
        with pytest.raises(OSError):
            await asyncio.open_connection("127.0.0.1", port)
        rec.gate.set()
        assert await call.read() == b"after:s"
        await call.done_writing()
        assert await call.code() == grpc.StatusCode.OK
        await asyncio.wait_for(stopping, 5.0)
    assert loop_errors == []


async def test_stop_closes_streams_still_open_after_grace() -> None:
    rec = Recorder()
    server = GrpcServer(PATH, rec.factory)
    await server.start("127.0.0.1", 0)
    async with _channel(server) as ch:
        call = await _waiting(ch, "h")
        t0 = asyncio.get_running_loop().time()
        await asyncio.wait_for(server.stop(0.3), 5.0)
        assert asyncio.get_running_loop().time() - t0 >= 0.25
        assert await call.code() == grpc.StatusCode.UNAVAILABLE
    assert rec.closed == [1]


# ----- a raw socket peer --------------------------------------------------------------


class RawPeer:
    """Just enough of an HTTP/2 client to say what grpcio's client never would."""

    def __init__(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        self.reader, self.writer = reader, writer
        self.encoder = hpack.Encoder()

    @classmethod
    async def connect(cls, server: GrpcServer, preface: bytes = frames.PREFACE) -> RawPeer:
        reader, writer = await asyncio.open_connection("127.0.0.1", server.ports[0])
        peer = cls(reader, writer)
        writer.write(preface)
        return peer

    def send(self, kind: int, flags: int, sid: int, payload: bytes = b"") -> None:
        self.writer.write(frames.frame(kind, flags, sid, payload))

    def open(self, sid: int, path: str = PATH) -> None:
        block = self.encoder.encode(
            [(":method", "POST"), (":scheme", "http"), (":path", path),
             (":authority", "x"), ("content-type", "application/grpc"), ("te", "trailers")]
        )  # fmt: skip
        self.send(frames.HEADERS, frames.END_HEADERS, sid, block)

    async def frame(self, timeout: float = 5.0) -> tuple[int, int, int, bytes] | None:
        """The next frame, or None once the server has closed the connection."""
        try:
            head = await asyncio.wait_for(self.reader.readexactly(9), timeout)
        except asyncio.IncompleteReadError:
            return None
        length = int.from_bytes(head[:3], "big")
        payload = await asyncio.wait_for(self.reader.readexactly(length), timeout)
        return head[3], head[4], int.from_bytes(head[5:9], "big") & 0x7FFFFFFF, payload

    async def until(self, kind: int, timeout: float = 5.0) -> tuple[int, int, int, bytes] | None:
        while (f := await self.frame(timeout)) is not None:
            if f[0] == kind:
                return f
        return None

    def close(self) -> None:
        self.writer.close()


async def _goaway_code(peer: RawPeer) -> int:
    f = await peer.until(frames.GOAWAY)
    assert f is not None, "no GOAWAY before close"
    assert await peer.frame() is None, "connection stays open after GOAWAY"
    return int.from_bytes(f[3][4:8], "big")


async def test_bad_preface_gets_goaway_protocol_error(served: tuple[GrpcServer, Recorder]) -> None:
    server, _ = served
    peer = await RawPeer.connect(server, b"GET / HTTP/1.1\r\nHost: x\r\n\r\n")
    assert await _goaway_code(peer) == frames.PROTOCOL_ERROR
    assert server.closed_for == {"protocol_error": 1}
    peer.close()


async def test_ping_is_acked_with_its_payload(served: tuple[GrpcServer, Recorder]) -> None:
    server, _ = served
    peer = await RawPeer.connect(server)
    peer.send(frames.SETTINGS, 0, 0)
    peer.send(frames.PING, 0, 0, b"12345678")
    f = await peer.until(frames.PING)
    assert f is not None and f[1] == frames.ACK and f[3] == b"12345678"
    peer.close()


async def test_oversize_frame_gets_goaway_frame_size_error(
    served: tuple[GrpcServer, Recorder],
) -> None:
    server, _ = served
    peer = await RawPeer.connect(server)
    n = OUR_MAX_FRAME + 1
    peer.writer.write(bytes((n >> 16, (n >> 8) & 0xFF, n & 0xFF, frames.DATA, 0)) + b"\0\0\0\1")
    assert await _goaway_code(peer) == frames.FRAME_SIZE_ERROR
    peer.close()


async def test_reply_waits_for_the_peer_window(served: tuple[GrpcServer, Recorder]) -> None:
    server, _ = served
    peer = await RawPeer.connect(server)
    window = frames.S_INITIAL_WINDOW_SIZE.to_bytes(2, "big") + (100).to_bytes(4, "big")
    peer.send(frames.SETTINGS, 0, 0, window)
    peer.open(1)
    message = b"y" * 1000
    peer.send(frames.DATA, frames.END_STREAM, 1, grpc_message(message))
    data = await peer.until(frames.DATA)
    assert data is not None and len(data[3]) == 100  # only what the stream window allows
    with pytest.raises(TimeoutError):
        await peer.frame(timeout=0.2)
    peer.send(frames.WINDOW_UPDATE, 0, 1, (5000).to_bytes(4, "big"))
    rest = await peer.until(frames.DATA)
    assert rest is not None and data[3] + rest[3] == grpc_message(message)
    trailers = await peer.until(frames.HEADERS)
    assert trailers is not None and trailers[1] & frames.END_STREAM
    fields = cast(dict[str, str], dict(hpack.Decoder().decode(trailers[3])))
    assert fields["grpc-status"] == "0"
    peer.close()


async def test_garbage_never_breaks_the_server(
    served: tuple[GrpcServer, Recorder], loop_errors: list[object]
) -> None:
    server, rec = served
    rng = random.Random(7)
    for _ in range(40):
        peer = await RawPeer.connect(server)
        peer.open(1)
        for _ in range(rng.randrange(1, 6)):
            kind = rng.randrange(0, 11)
            payload = rng.randbytes(rng.randrange(0, 40))
            peer.send(kind, rng.randrange(0, 256), rng.randrange(0, 4), payload)
        peer.writer.write(rng.randbytes(rng.randrange(0, 64)))
        with contextlib.suppress(ConnectionError):
            await peer.writer.drain()
        peer.close()
    # Every session the garbage opened is closed, and a real client is served.
    await _until(lambda: not server.connections, "garbage connections closed")
    assert sorted(rec.closed) == list(range(1, rec.opened + 1))
    async with _channel(server) as ch:
        call = _call(ch)()
        await call.write(b"ok")
        assert await call.read() == b"ok"
        await call.done_writing()
        assert await call.code() == grpc.StatusCode.OK
    assert loop_errors == []


async def _keepalive_server(
    rec: Recorder, time_s: float, timeout_s: float
) -> tuple[GrpcServer, Callable[[], Awaitable[None]]]:
    server = GrpcServer(PATH, rec.factory, keepalive_time=time_s, keepalive_timeout=timeout_s)
    await server.start("127.0.0.1", 0)
    return server, lambda: server.stop(0.5)


async def test_keepalive_pings_an_idle_peer_and_drops_one_that_never_acks() -> None:
    rec = Recorder()
    server, stop = await _keepalive_server(rec, 0.2, 0.3)
    try:
        peer = await RawPeer.connect(server)
        peer.send(frames.SETTINGS, 0, 0)
        peer.open(1)
        ping = await peer.until(frames.PING, timeout=3)
        assert ping is not None and not ping[1] & frames.ACK
        # No ACK: the server closes the connection and the stream's session.
        assert await peer.until(frames.GOAWAY, timeout=3) is None
        await _until(lambda: rec.closed == [1], "session closed with its connection")
        assert server.closed_for == {"keepalive_timeout": 1}
        peer.close()
    finally:
        await stop()


async def test_keepalive_keeps_a_peer_that_acks() -> None:
    rec = Recorder()
    server, stop = await _keepalive_server(rec, 0.1, 0.2)
    try:
        peer = await RawPeer.connect(server)
        peer.send(frames.SETTINGS, 0, 0)
        for _ in range(4):
            ping = await peer.until(frames.PING, timeout=3)
            assert ping is not None
            peer.send(frames.PING, frames.ACK, 0, ping[3])
        assert len(server.connections) == 1
        assert not server.closed_for
        peer.close()
    finally:
        await stop()


# ----- header blocks: the decode cache must follow the peer's dynamic table -----------


def _string(text: str) -> bytes:
    raw = text.encode()
    return bytes((len(raw),)) + raw  # short strings only, no Huffman


def _path_literal() -> bytes:
    return b"\x04" + _string(PATH)  # literal without indexing, name = static :path


def _indexed_new(name: str, value: str) -> bytes:
    return b"\x40" + _string(name) + _string(value)  # literal with incremental indexing


def test_changes_table_reads_each_representation() -> None:
    enc = hpack.Encoder()
    first = enc.encode([(":method", "POST"), ("x-prefix", "one")])
    again = enc.encode([(":method", "POST"), ("x-prefix", "one")])  # indexed only now
    assert changes_table(first)
    assert not changes_table(again)
    assert not changes_table(b"\x83" + _path_literal())
    never = b"\x10" + _string("x-secret") + _string("s")  # never indexed, new name
    assert not changes_table(never + b"\xbe")
    assert changes_table(b"\x83" + _indexed_new("x-a", "b"))
    assert changes_table(b"\x3f\xe1\x1f")  # dynamic table size update
    assert changes_table(b"\x83\x04\x30abc")  # truncated string: never cached
    assert changes_table(b"\xff")  # truncated integer


async def test_repeated_block_decodes_against_the_current_table(
    served: tuple[GrpcServer, Recorder],
) -> None:
    server, rec = served
    peer = await RawPeer.connect(server)
    peer.send(frames.SETTINGS, 0, 0)
    head = b"\x83\x86" + _path_literal()  # :method POST, :scheme http, :path
    refers = head + b"\xbe"  # dynamic index 62: the newest entry, whatever it is by then
    blocks = [
        head + _indexed_new("x-prefix", "one"),
        refers,  # "one": cached, since it leaves the table alone
        refers,
        head + _indexed_new("x-prefix", "two"),  # now index 62 is "two"
        refers,  # the same bytes as before must decode to "two"
    ]
    for i, block in enumerate(blocks):
        peer.send(frames.HEADERS, frames.END_HEADERS | frames.END_STREAM, 2 * i + 1, block)
    await _until(lambda: len(rec.metadata) == len(blocks), "every stream opened")
    assert [m["x-prefix"] for m in rec.metadata] == ["one", "one", "one", "two", "two"]
    assert all(m[":path"] == PATH for m in rec.metadata)
    peer.close()


# ----- protocol violations (RFC 9113), as h2spec sends them ---------------------------


def _u32(n: int) -> bytes:
    return n.to_bytes(4, "big")


async def _rst_code(peer: RawPeer, sid: int) -> int:
    while (f := await peer.frame()) is not None:
        if f[0] == frames.RST_STREAM and f[2] == sid:
            return int.from_bytes(f[3], "big")
    raise AssertionError(f"no RST_STREAM on stream {sid}")


def _data_after_end(p: RawPeer) -> None:
    p.open(1)
    p.send(frames.DATA, frames.END_STREAM, 1, grpc_message(b"x"))
    p.send(frames.DATA, 0, 1, b"late")


def _lower_stream_id(p: RawPeer) -> None:
    p.open(5)
    p.open(3)


CONNECTION_ERRORS = {
    "RST_STREAM on stream 0": (
        lambda p: p.send(frames.RST_STREAM, 0, 0, _u32(0)), frames.PROTOCOL_ERROR),
    "RST_STREAM on an idle stream": (
        lambda p: p.send(frames.RST_STREAM, 0, 9, _u32(0)), frames.PROTOCOL_ERROR),
    "RST_STREAM not 4 bytes": (lambda p: p.send(frames.RST_STREAM, 0, 1, b"\0" * 3),
                               frames.FRAME_SIZE_ERROR),
    "WINDOW_UPDATE on an idle stream": (
        lambda p: p.send(frames.WINDOW_UPDATE, 0, 9, _u32(1)), frames.PROTOCOL_ERROR),
    "SETTINGS ack with a payload": (
        lambda p: p.send(frames.SETTINGS, frames.ACK, 0, b"\0" * 6), frames.FRAME_SIZE_ERROR),
    "SETTINGS_ENABLE_PUSH 2": (
        lambda p: p.send(frames.SETTINGS, 0, 0, frames.S_ENABLE_PUSH.to_bytes(2, "big") + _u32(2)),
        frames.PROTOCOL_ERROR),
    "PRIORITY on stream 0": (
        lambda p: p.send(frames.PRIORITY, 0, 0, b"\0" * 5), frames.PROTOCOL_ERROR),
    "PING on a stream": (lambda p: p.send(frames.PING, 0, 1, b"\0" * 8), frames.PROTOCOL_ERROR),
    "GOAWAY on a stream": (lambda p: p.send(frames.GOAWAY, 0, 1, b"\0" * 8), frames.PROTOCOL_ERROR),
    "DATA after the peer ended the stream": (_data_after_end, frames.STREAM_CLOSED),
    "HEADERS on a lower stream id": (_lower_stream_id, frames.PROTOCOL_ERROR),
}  # fmt: skip


@pytest.mark.parametrize("case", list(CONNECTION_ERRORS))
async def test_connection_error_gets_goaway_with_its_code(
    served: tuple[GrpcServer, Recorder], case: str
) -> None:
    server, _ = served
    send, code = CONNECTION_ERRORS[case]
    peer = await RawPeer.connect(server)
    peer.send(frames.SETTINGS, 0, 0)
    send(peer)
    assert await _goaway_code(peer) == code
    peer.close()


def _block(peer: RawPeer, headers: list[tuple[str, str]]) -> bytes:
    return peer.encoder.encode(headers)


GRPC_HEADERS = [(":method", "POST"), (":scheme", "http"), (":path", PATH),
                (":authority", "x"), ("content-type", "application/grpc")]  # fmt: skip

MALFORMED = {
    "upper-case name": [*GRPC_HEADERS, ("X-Upper", "1")],
    "unknown pseudo-header": [(":foo", "1"), *GRPC_HEADERS],
    "response pseudo-header": [(":status", "200"), *GRPC_HEADERS],
    "pseudo-header after a regular one": [*GRPC_HEADERS, (":authority", "y")],
    "connection-specific header": [*GRPC_HEADERS, ("connection", "keep-alive")],
    "te other than trailers": [*GRPC_HEADERS, ("te", "gzip")],
    "empty :path": [(n, "" if n == ":path" else v) for n, v in GRPC_HEADERS],
    "no :scheme": [h for h in GRPC_HEADERS if h[0] != ":scheme"],
    "two :method": [(":method", "POST"), *GRPC_HEADERS],
}


@pytest.mark.parametrize("case", list(MALFORMED))
async def test_malformed_request_is_a_stream_error_and_the_connection_carries_on(
    served: tuple[GrpcServer, Recorder], case: str
) -> None:
    server, rec = served
    peer = await RawPeer.connect(server)
    peer.send(frames.SETTINGS, 0, 0)
    peer.send(frames.HEADERS, frames.END_HEADERS, 1, _block(peer, MALFORMED[case]))
    assert await _rst_code(peer, 1) == frames.PROTOCOL_ERROR
    assert rec.opened == 0
    peer.open(3)
    peer.send(frames.DATA, frames.END_STREAM, 3, grpc_message(b"fine"))
    data = await peer.until(frames.DATA)
    assert data is not None and data[2] == 3 and data[3] == grpc_message(b"fine")
    peer.close()


async def test_content_length_that_does_not_match_is_a_stream_error(
    served: tuple[GrpcServer, Recorder],
) -> None:
    server, _ = served
    peer = await RawPeer.connect(server)
    peer.send(frames.SETTINGS, 0, 0)
    block = _block(peer, [*GRPC_HEADERS, ("content-length", "100")])
    peer.send(frames.HEADERS, frames.END_HEADERS, 1, block)
    peer.send(frames.DATA, frames.END_STREAM, 1, grpc_message(b"short"))
    assert await _rst_code(peer, 1) == frames.PROTOCOL_ERROR
    peer.close()


async def test_priority_on_itself_is_a_stream_error(served: tuple[GrpcServer, Recorder]) -> None:
    server, _ = served
    peer = await RawPeer.connect(server)
    peer.send(frames.SETTINGS, 0, 0)
    peer.open(1)
    peer.send(frames.PRIORITY, 0, 1, _u32(1) + b"\x10")
    assert await _rst_code(peer, 1) == frames.PROTOCOL_ERROR
    peer.close()


async def test_frames_after_our_reset_are_ignored(served: tuple[GrpcServer, Recorder]) -> None:
    """We end a stream early (RST_STREAM NO_ERROR); DATA already on its way is dropped."""
    server, _ = served
    peer = await RawPeer.connect(server)
    peer.send(frames.SETTINGS, 0, 0)
    peer.open(1)
    peer.send(frames.DATA, 0, 1, grpc_message(b"raise"))  # the session fails: INTERNAL
    assert await _rst_code(peer, 1) == frames.NO_ERROR
    peer.send(frames.DATA, frames.END_STREAM, 1, grpc_message(b"late"))
    peer.open(3)
    peer.send(frames.DATA, frames.END_STREAM, 3, grpc_message(b"next"))
    data = await peer.until(frames.DATA)
    assert data is not None and data[2] == 3
    assert server.closed_for == {}
    peer.close()


async def test_streams_beyond_the_advertised_limit_are_refused(
    served: tuple[GrpcServer, Recorder],
) -> None:
    server, rec = served
    peer = await RawPeer.connect(server)
    settings = await peer.until(frames.SETTINGS)
    assert settings is not None
    advertised = {
        int.from_bytes(settings[3][i : i + 2], "big"): int.from_bytes(settings[3][i + 2 : i + 6])
        for i in range(0, len(settings[3]), 6)
    }
    assert advertised[frames.S_MAX_CONCURRENT_STREAMS] == MAX_STREAMS
    peer.send(frames.SETTINGS, 0, 0)
    for i in range(MAX_STREAMS + 1):
        peer.open(2 * i + 1)
    last = 2 * MAX_STREAMS + 1
    assert await _rst_code(peer, last) == frames.REFUSED_STREAM
    assert rec.opened == MAX_STREAMS
    peer.close()
