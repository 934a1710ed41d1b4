"""grpcio's asyncio server for the one bidirectional method (``--grpc-server grpcio``).

The same sessions (:mod:`extproc.transport.session`) as the builtin server behind
grpcio: raw message bytes in and out, a session per stream from the call's metadata.
Knows nothing of ext_proc beyond the method's path.
"""

from __future__ import annotations

from collections.abc import AsyncIterator

import grpc

from extproc.transport.health import HEALTH_CHECK_PATH, StatusOf, check
from extproc.transport.session import SessionFactory, StatusError

# Envoy pings its HTTP/2 upstreams (connection_keepalive); grpc-python's defaults
# answer frequent pings on idle connections with GOAWAY "too_many_pings".
GRPC_SERVER_OPTIONS = [
    ("grpc.keepalive_time_ms", 30_000),
    ("grpc.keepalive_timeout_ms", 10_000),
    ("grpc.keepalive_permit_without_calls", 1),
    ("grpc.http2.min_recv_ping_interval_without_data_ms", 5_000),
    ("grpc.http2.max_ping_strikes", 0),
    ("grpc.max_concurrent_streams", 100_000),
    ("grpc.max_receive_message_length", 64 * 1024 * 1024),
    ("grpc.so_reuseport", 0),
]


# grpcio's status codes by number.
_CODES = {code.value[0]: code for code in grpc.StatusCode}


class GrpcioServer:
    """grpcio's asyncio server behind the builtin server's start/stop shape."""

    def __init__(self, path: str, factory: SessionFactory, health: StatusOf | None = None) -> None:
        """``health``: also answer ``grpc.health.v1.Health/Check`` (:mod:`.health`)."""
        service, _, method = path.strip("/").rpartition("/")
        self.factory = factory
        self.health = health
        self.server = grpc.aio.server(options=GRPC_SERVER_OPTIONS)
        handlers = [
            grpc.method_handlers_generic_handler(
                service,
                {
                    method: grpc.stream_stream_rpc_method_handler(
                        self.process, request_deserializer=None, response_serializer=None
                    )
                },
            )
        ]
        if health is not None:
            health_service, _, check_method = HEALTH_CHECK_PATH.strip("/").rpartition("/")
            handlers.append(
                grpc.method_handlers_generic_handler(
                    health_service,
                    {
                        check_method: grpc.unary_unary_rpc_method_handler(
                            self.check, request_deserializer=None, response_serializer=None
                        )
                    },
                )
            )
        self.server.add_generic_rpc_handlers(tuple(handlers))

    async def start(self, host: str, port: int) -> None:
        self.server.add_insecure_port(f"{host}:{port}")
        await self.server.start()

    async def stop(self, grace: float) -> None:
        await self.server.stop(grace=grace)

    async def check(self, request: bytes, context: grpc.aio.ServicerContext) -> bytes:
        assert self.health is not None
        try:
            return check(request, self.health)
        except StatusError as exc:
            await context.abort(_CODES[exc.code], exc.message)
            raise  # abort raises; never reached

    async def process(
        self, requests: AsyncIterator[bytes], context: grpc.aio.ServicerContext
    ) -> AsyncIterator[bytes]:
        session = self.factory(dict(context.invocation_metadata() or ()))
        try:
            async for message in requests:
                reply = session.receive(message)
                if reply is None:
                    continue
                if isinstance(reply, tuple):
                    first, rest = reply
                    yield first
                    reply = await rest
                if isinstance(reply, list):
                    for one in reply:
                        yield one
                else:
                    yield reply
        finally:
            session.close()
