"""gRPC health checks (grpc.health.v1.Health/Check) on both servers, asked by grpcio's client."""

from __future__ import annotations

from collections.abc import AsyncIterator, Mapping

import grpc
import pytest
from grpc_health.v1 import health_pb2

from extproc.devstack import free_port
from extproc.transport.grpcio import GrpcioServer
from extproc.transport.h2server import GrpcServer
from extproc.transport.health import HEALTH_CHECK_PATH, health_methods
from extproc.transport.session import Session

PATH = "/test.Echo/Chat"
SERVING = health_pb2.HealthCheckResponse.SERVING
NOT_SERVING = health_pb2.HealthCheckResponse.NOT_SERVING


class _Echo:
    def receive(self, message: bytes) -> bytes:
        return message

    def close(self) -> None:
        pass


def _echo(_: Mapping[str, str]) -> Session:
    return _Echo()


class State:
    ready = False

    def status_of(self, service: str) -> bool | None:
        if service == "liveness":
            return True
        if service in ("readiness", ""):
            return self.ready
        return None


@pytest.fixture(params=["builtin", "grpcio"])
async def served(request: pytest.FixtureRequest) -> AsyncIterator[tuple[State, int]]:
    state = State()
    server: GrpcServer | GrpcioServer
    if request.param == "builtin":
        server = GrpcServer(PATH, _echo, methods=health_methods(state.status_of))
    else:
        server = GrpcioServer(PATH, _echo, health=state.status_of)
    port = free_port()
    await server.start("127.0.0.1", port)
    yield state, port
    await server.stop(1.0)


async def _check(port: int, service: str) -> int:
    async with grpc.aio.insecure_channel(f"127.0.0.1:{port}") as channel:
        check = channel.unary_unary(
            HEALTH_CHECK_PATH,
            request_serializer=health_pb2.HealthCheckRequest.SerializeToString,
            response_deserializer=health_pb2.HealthCheckResponse.FromString,
        )
        reply = await check(health_pb2.HealthCheckRequest(service=service), timeout=5)
        return int(reply.status)


async def test_liveness_serves_and_readiness_follows_the_state(
    served: tuple[State, int],
) -> None:
    state, port = served
    assert await _check(port, "liveness") == SERVING
    assert await _check(port, "readiness") == NOT_SERVING
    assert await _check(port, "") == NOT_SERVING
    state.ready = True
    assert await _check(port, "readiness") == SERVING
    assert await _check(port, "") == SERVING


async def test_an_unknown_service_is_not_found(served: tuple[State, int]) -> None:
    _, port = served
    with pytest.raises(grpc.aio.AioRpcError) as exc:
        await _check(port, "nope")
    assert exc.value.code() == grpc.StatusCode.NOT_FOUND
    assert "nope" in (exc.value.details() or "")


async def test_the_main_method_still_answers(served: tuple[State, int]) -> None:
    _, port = served
    async with grpc.aio.insecure_channel(f"127.0.0.1:{port}") as channel:
        call = channel.stream_stream(PATH, request_serializer=None, response_deserializer=None)
        stream = call()
        await stream.write(b"hello")
        assert await stream.read() == b"hello"
        await stream.done_writing()
