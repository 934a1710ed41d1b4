"""The builtin gRPC server: one bidirectional-streaming method over HTTP/2, on the asyncio loop.

ext_proc is one gRPC method (``ExternalProcessor/Process``): one stream per HTTP
request, a few small messages each way. grpcio's asyncio server spends most of its CPU
per request in its own machinery (a poller thread handing each message to the event
loop, per-call objects); this server parses frames in ``data_received`` and answers in
the same callback, one write per read, for several times less CPU per request
(``loadtest/bench.py --grpc-server builtin grpcio`` measures both).

It speaks what a gRPC client needs and nothing else: the connection preface, SETTINGS,
HEADERS/CONTINUATION (HPACK via ``hpack``), DATA with length-prefixed messages, flow
control both ways, PING, RST_STREAM, GOAWAY, server keepalive pings, trailers with
``grpc-status``. No TLS, no compression, no server push. Its parts, one concept each,
are in :mod:`extproc.transport.h2`; this module listens, keeps the connections and stops
them gracefully. A stream's messages go to a session (:mod:`extproc.transport.session`).
"""

from __future__ import annotations

import asyncio
import collections
from collections.abc import Mapping

from extproc.background import H2_KEEPALIVE, Guard
from extproc.transport.h2.connection import H2Connection
from extproc.transport.session import SessionFactory


class GrpcServer:
    """Serves one bidirectional-streaming gRPC method on a TCP port."""

    def __init__(
        self,
        path: str,
        factory: SessionFactory,
        *,
        keepalive_time: float = 30.0,
        keepalive_timeout: float = 10.0,
        methods: Mapping[str, SessionFactory] | None = None,
        keepalive_guard: Guard | None = None,
    ) -> None:
        self.path = path
        self.factory = factory
        # Every method served, by path: ``path`` and the ``methods`` given besides it (each
        # call of one is a stream whose messages go to a session, like the main one's).
        self.methods: dict[str, SessionFactory] = {**(methods or {}), path: factory}
        self.keepalive_time = keepalive_time
        self.keepalive_timeout = keepalive_timeout
        self.keepalive_check = min(keepalive_time, keepalive_timeout) / 2
        # Every connection's keepalive check runs through it: one that raises is counted and
        # the connection's next check is armed all the same.
        self.keepalive_guard = keepalive_guard or Guard(H2_KEEPALIVE)
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

    def connection_closed(self) -> None:
        """Called by a connection that has gone (after it left ``connections``)."""
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
                    conn.close()
        if self._server is not None:
            await self._server.wait_closed()
