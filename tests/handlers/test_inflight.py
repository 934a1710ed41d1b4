"""A routed request's own timeline: dispatch, first response body byte, stream end, each on
the pool's clock and kept on its InFlight."""

from __future__ import annotations

from envoy.service.ext_proc.v3 import external_processor_pb2 as ep

from extproc.handlers.processor import RequestSession
from tests.handlers.test_epp import Clock, body, make, request_headers, response_headers


def chunk(data: bytes, end: bool = False) -> bytes:
    return ep.ProcessingRequest(
        response_body=ep.HttpBody(body=data, end_of_stream=end)
    ).SerializeToString()


def test_the_three_times_of_a_request_are_taken_where_they_happen() -> None:
    handler = make(protocol="envoy")
    clock = handler.pool.clock
    assert isinstance(clock, Clock)
    clock.t = 10.0
    session = handler.open_session({})
    assert isinstance(session, RequestSession)
    session.receive(request_headers())
    session.receive(body())
    routed = session.st.routed
    assert routed is not None
    assert (routed.dispatched_at, routed.first_byte_at, routed.ended_at) == (10.0, 0.0, 0.0)
    clock.t = 10.5
    session.receive(response_headers())
    session.receive(chunk(b""))  # an empty chunk is no byte
    assert routed.first_byte_at == 0.0
    clock.t = 10.75
    session.receive(chunk(b'{"usage": {"completion_tokens": 3}}'))
    clock.t = 11.0
    session.receive(chunk(b" ", end=True))
    assert routed.first_byte_at == 10.75 and routed.ended_at == 0.0
    clock.t = 12.0
    session.close()
    assert routed.ended_at == 12.0
    assert routed.ticket.released and routed.ticket.worker.worker_id == "b"
