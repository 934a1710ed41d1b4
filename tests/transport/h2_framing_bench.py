"""CPU per ext_proc round trip: the builtin framing vs python-hyper's ``h2``, side by side.

One byte stream stands for Envoy's side of a connection: per ext_proc stream a HEADERS
block (HPACK with a dynamic table, as Envoy encodes it), two gRPC messages (request
headers, request body) and an empty DATA with END_STREAM. Both servers read it in
64 KiB chunks, answer every message with a 100-byte message and end every stream with
trailers, writing once per chunk. ``h2`` is not a dependency: install it to compare
(``pip install h2``); without it only the builtin server is measured.

    python -m tests.transport.h2_framing_bench [--streams 20000] [--rounds 5]
"""

from __future__ import annotations

import argparse
import asyncio
import statistics
import time
from typing import Any

import hpack

from extproc.transport.h2 import frames
from extproc.transport.h2.connection import MAX_STREAMS, OUR_STREAM_WINDOW, H2Connection
from extproc.transport.h2.grpc_wire import grpc_message
from extproc.transport.h2server import GrpcServer

PATH = "/envoy.service.ext_proc.v3.ExternalProcessor/Process"
MESSAGES = (b"h" * 300, b"b" * 200)
REPLY = b"r" * 100
CHUNK = 64 << 10


def envoy_bytes(streams: int) -> bytes:
    """What Envoy sends on one connection for ``streams`` ext_proc streams."""
    enc = hpack.Encoder()
    out = [frames.PREFACE, frames.frame(frames.SETTINGS, 0, 0)]
    out.append(frames.frame(frames.WINDOW_UPDATE, 0, 0, (2**30).to_bytes(4, "big")))
    for i in range(streams):
        sid = 2 * i + 1
        block = enc.encode(
            [(":method", "POST"), (":scheme", "http"), (":path", PATH),
             (":authority", "extproc"), ("content-type", "application/grpc"),
             ("te", "trailers"), ("x-envoy-expected-rq-timeout-ms", "5000"),
             ("grpc-timeout", "5000m")]
        )  # fmt: skip
        out.append(frames.frame(frames.HEADERS, frames.END_HEADERS, sid, block))
        for m in MESSAGES:
            out.append(frames.frame(frames.DATA, 0, sid, grpc_message(m)))
        out.append(frames.frame(frames.DATA, frames.END_STREAM, sid))
        if i % 100 == 99:  # Envoy's window updates for our replies
            out.append(frames.frame(frames.WINDOW_UPDATE, 0, 0, (1 << 20).to_bytes(4, "big")))
    return b"".join(out)


class _Sink:
    """A transport that keeps what is written."""

    def __init__(self) -> None:
        self.written = 0

    def write(self, data: bytes) -> None:
        self.written += len(data)

    def get_extra_info(self, name: str, default: Any = None) -> Any:
        return default

    def close(self) -> None:
        pass

    def pause_reading(self) -> None:
        pass

    def resume_reading(self) -> None:
        pass


class _Session:
    def receive(self, message: bytes) -> bytes:
        return REPLY

    def close(self) -> None:
        pass


async def builtin(data: bytes) -> tuple[float, int]:
    server = GrpcServer(PATH, lambda md: _Session())
    conn = H2Connection(server)
    sink = _Sink()
    conn.connection_made(sink)  # type: ignore[arg-type]
    start = time.process_time()
    for i in range(0, len(data), CHUNK):
        conn.data_received(data[i : i + CHUNK])
    cpu = time.process_time() - start
    if conn.keepalive is not None:
        conn.keepalive.cancel()
    return cpu, sink.written


def hyper(data: bytes) -> tuple[float, int]:
    import h2.config
    import h2.connection
    import h2.events
    import h2.settings

    conn = h2.connection.H2Connection(h2.config.H2Configuration(client_side=False))
    # The builtin server's settings and windows (h2's defaults: 100 streams, 64 KiB).
    codes = h2.settings.SettingCodes
    conn.local_settings = h2.settings.Settings(
        client=False,
        initial_values={
            codes.MAX_CONCURRENT_STREAMS: MAX_STREAMS,
            codes.INITIAL_WINDOW_SIZE: OUR_STREAM_WINDOW,
        },
    )
    conn.initiate_connection()
    conn.increment_flow_control_window(frames.MAX_WINDOW - frames.DEFAULT_WINDOW)
    conn.data_to_send()
    inbox: dict[int, bytearray] = {}
    started: set[int] = set()
    written = 0
    response = [(":status", "200"), ("content-type", "application/grpc")]
    trailers = [("grpc-status", "0")]
    start = time.process_time()
    for i in range(0, len(data), CHUNK):
        for ev in conn.receive_data(data[i : i + CHUNK]):
            if isinstance(ev, h2.events.RequestReceived):
                inbox[ev.stream_id] = bytearray()
            elif isinstance(ev, h2.events.DataReceived):
                sid = ev.stream_id
                conn.acknowledge_received_data(ev.flow_controlled_length, sid)
                buf = inbox[sid]
                buf += ev.data
                while len(buf) >= 5 and len(buf) >= 5 + int.from_bytes(buf[1:5], "big"):
                    size = int.from_bytes(buf[1:5], "big")
                    del buf[: 5 + size]
                    if sid not in started:
                        started.add(sid)
                        conn.send_headers(sid, response)
                    conn.send_data(sid, grpc_message(REPLY))
            elif isinstance(ev, h2.events.StreamEnded):
                conn.send_headers(ev.stream_id, trailers, end_stream=True)
                inbox.pop(ev.stream_id, None)
                started.discard(ev.stream_id)
        written += len(conn.data_to_send())
    return time.process_time() - start, written


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--streams", type=int, default=20_000)
    parser.add_argument("--rounds", type=int, default=5)
    args = parser.parse_args()
    data = envoy_bytes(args.streams)
    try:
        import h2  # noqa: F401

        kinds = ["builtin", "h2"]
    except ImportError:
        print("h2 not installed: measuring the builtin server only (pip install h2)")
        kinds = ["builtin"]
    results: dict[str, list[float]] = {k: [] for k in kinds}
    sizes: dict[str, int] = {}
    for _ in range(args.rounds):
        for kind in kinds:
            cpu, written = asyncio.run(builtin(data)) if kind == "builtin" else hyper(data)
            results[kind].append(cpu / args.streams * 1e6)
            sizes[kind] = written
    print(f"{args.streams} ext_proc streams (2 messages each), {args.rounds} rounds, medians\n")
    print("| framing | CPU µs per stream | vs builtin | bytes written per stream |")
    print("|---|---|---|---|")
    base = statistics.median(results["builtin"])
    for kind in kinds:
        med = statistics.median(results[kind])
        print(f"| {kind} | {med:.1f} | {med / base:.2f}x | {sizes[kind] / args.streams:.0f} |")


if __name__ == "__main__":
    main()
