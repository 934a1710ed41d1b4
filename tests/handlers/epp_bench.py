"""CPU per request in the handler, no sockets: the Envoy wiring against the Endpoint Picker
mode, without a subset hint and with one of 8 endpoints that workers announced or that none
did. 16 workers of one model; per request a request-headers and a request-body message,
decided on the body; the best of ``--rounds`` interleaved runs of ``--requests`` each.

    python -m tests.handlers.epp_bench [--requests 20000] [--rounds 5]
"""

from __future__ import annotations

import argparse
import json
import time

from envoy.config.core.v3 import base_pb2
from envoy.service.ext_proc.v3 import external_processor_pb2 as ep

from extproc.core.busy import BusyThresholds
from extproc.core.pool import WorkerPool
from extproc.core.scheduling import Scheduler
from extproc.handlers.processor import ExtProcHandler
from extproc.handlers.subset_hint import SUBSET_KEY, SUBSET_NAMESPACE
from extproc.metrics.registry import Metrics

WORKERS = 16
BODY = ep.ProcessingRequest(
    request_body=ep.HttpBody(
        body=json.dumps({"model": "m", "messages": [{"content": "hi" * 100}]}).encode(),
        end_of_stream=True,
    )
).SerializeToString()


def _handler(protocol: str) -> ExtProcHandler:
    pool = WorkerPool(BusyThresholds(0.9))
    for i in range(WORKERS):
        pool.announce(f"w{i}", model="m", endpoint=f"10.0.0.{i + 1}:8000", kv_total_blocks=1000)
        pool.report_load(f"w{i}", active_decode_blocks=i)
    return ExtProcHandler(pool, Scheduler(pool), Metrics(), protocol=protocol)


def _headers(subset: list[str] | None) -> bytes:
    hm = base_pb2.HeaderMap(
        headers=[
            base_pb2.HeaderValue(key=":path", raw_value=b"/v1/chat/completions"),
            base_pb2.HeaderValue(key=":method", raw_value=b"POST"),
        ]
    )
    req = ep.ProcessingRequest(request_headers=ep.HttpHeaders(headers=hm))
    if subset is not None:
        value = req.metadata_context.filter_metadata[SUBSET_NAMESPACE].fields[SUBSET_KEY]
        value.list_value.SetInParent()
        value.list_value.extend(subset)
    return req.SerializeToString()


def _once(handler: ExtProcHandler, headers: bytes, requests: int) -> float:
    started = time.perf_counter()
    for _ in range(requests):
        session = handler.open_session({})
        session.receive(headers)
        session.receive(BODY)
        session.close()
    return (time.perf_counter() - started) / requests * 1e6


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--requests", type=int, default=20000)
    parser.add_argument("--rounds", type=int, default=5)
    args = parser.parse_args()
    known = [f"10.0.0.{i + 1}:8000" for i in range(0, WORKERS, 2)]
    unknown = [f"10.0.1.{i + 1}:8000" for i in range(8)]
    cases = [
        ("envoy, no subset hint", _handler("envoy"), _headers(None)),
        ("epp, no subset hint", _handler("epp"), _headers(None)),
        ("epp, 8 announced endpoints", _handler("epp"), _headers(known)),
        ("epp, 8 endpoints no worker announced", _handler("epp"), _headers(unknown)),
    ]
    # Rounds interleave the cases, so that a busy moment of the machine hits them all.
    best = [float("inf")] * len(cases)
    for _ in range(args.rounds):
        for i, (_, handler, headers) in enumerate(cases):
            best[i] = min(best[i], _once(handler, headers, args.requests))
    for (name, _, _), us in zip(cases, best, strict=True):
        print(f"{name:40s} {us:6.1f} us/request")


if __name__ == "__main__":
    main()
