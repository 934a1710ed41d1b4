"""The gRPC Health Checking Protocol's ``Check`` method, on either server.

Kubernetes probes (``grpc:`` probes) and gateways ask ``grpc.health.v1.Health/Check`` with
a service name; what each name means is the caller's ``status_of``: True = SERVING,
False = NOT_SERVING, None = not a service of ours (gRPC status NOT_FOUND, as the
protocol says). ``Watch`` is not offered (UNIMPLEMENTED).
"""

from __future__ import annotations

from collections.abc import Callable, Mapping

from grpc_health.v1 import health_pb2

from extproc.transport.session import StatusError

HEALTH_CHECK_PATH = "/grpc.health.v1.Health/Check"
GRPC_NOT_FOUND = 5
StatusOf = Callable[[str], bool | None]
_SERVING = health_pb2.HealthCheckResponse(
    status=health_pb2.HealthCheckResponse.SERVING
).SerializeToString()
_NOT_SERVING = health_pb2.HealthCheckResponse(
    status=health_pb2.HealthCheckResponse.NOT_SERVING
).SerializeToString()


def check(message: bytes, status_of: StatusOf) -> bytes:
    """The serialized HealthCheckResponse to a serialized HealthCheckRequest; raises
    :class:`StatusError` (NOT_FOUND) for a service ``status_of`` does not know."""
    service = health_pb2.HealthCheckRequest.FromString(message).service
    serving = status_of(service)
    if serving is None:
        raise StatusError(GRPC_NOT_FOUND, f"unknown service {service!r}")
    return _SERVING if serving else _NOT_SERVING


class HealthCheckSession:
    """One ``Check`` call on the builtin server: one request message, one reply."""

    __slots__ = ("status_of",)

    def __init__(self, status_of: StatusOf) -> None:
        self.status_of = status_of

    def receive(self, message: bytes) -> bytes:
        return check(message, self.status_of)

    def close(self) -> None:
        pass


def health_methods(
    status_of: StatusOf,
) -> dict[str, Callable[[Mapping[str, str]], HealthCheckSession]]:
    """The builtin server's extra methods that answer health checks."""
    return {HEALTH_CHECK_PATH: lambda _metadata: HealthCheckSession(status_of)}
