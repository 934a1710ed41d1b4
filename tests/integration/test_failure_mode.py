"""What Envoy does when the extproc is down or cannot answer in time: the operator's choice.

Fail open (the repo's configs, ``failure_mode_allow: true``): the request goes to a worker
unchecked (round robin). Fail closed (``failure_mode_allow: false`` with
``status_on_error``): Envoy answers that status itself and nothing reaches a worker.
Both through the real Envoy, with the extproc stopped (its port refuses connections, as
during a restart's startup grace) and with the extproc hung (SIGSTOP: the connection is
open, nothing answers, ``message_timeout`` decides). docs/transport.md has the numbers.
"""

from __future__ import annotations

import json
import os
import signal
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest

from extproc.devstack import Envoy, Extproc, Publisher, http, wait_until

MODEL = "fm-model"
BODY = {"model": MODEL, "messages": [{"role": "user", "content": "hi"}], "max_tokens": 1}
EXT_PROC = "envoy.filters.http.ext_proc"


def _filter(cfg: dict[str, Any]) -> dict[str, Any]:
    hcm = cfg["static_resources"]["listeners"][0]["filter_chains"][0]["filters"][0]
    for f in hcm["typed_config"]["http_filters"]:
        if f["name"] == EXT_PROC:
            typed: dict[str, Any] = f["typed_config"]
            return typed
    raise AssertionError("no ext_proc filter in envoy/envoy.yaml")


def fail_closed(status: int, timeout: str = "1s") -> Callable[[dict[str, Any]], None]:
    def tweak(cfg: dict[str, Any]) -> None:
        ext = _filter(cfg)
        ext["failure_mode_allow"] = False
        ext["status_on_error"] = {"code": status}
        ext["message_timeout"] = timeout

    return tweak


def message_timeout(timeout: str) -> Callable[[dict[str, Any]], None]:
    def tweak(cfg: dict[str, Any]) -> None:
        _filter(cfg)["message_timeout"] = timeout

    return tweak


class Stack:
    def __init__(
        self, log_dir: Path, workers: dict[str, int], tweak: Callable[[dict[str, Any]], None]
    ) -> None:
        self.ext = Extproc(log_dir, ["--startup-grace", "0", "--worker-ttl", "86400"])
        self.envoy = Envoy(log_dir, self.ext, list(workers.values()), tweak=tweak)
        self.pub = Publisher(self.ext.event_endpoint)
        name, port = next(iter(workers.items()))
        self.pub.announce(self.ext, f"fm-{name}", MODEL, f"127.0.0.1:{port}")

    def post(self) -> tuple[int, dict[str, str], bytes, float]:
        start = time.monotonic()
        status, headers, body = http("POST", self.envoy.url + "/v1/chat/completions", BODY)
        return status, headers, body, time.monotonic() - start

    def stats(self, name: str) -> int:
        _, _, body = http("GET", f"http://127.0.0.1:{self.envoy.admin_port}/stats?filter={name}")
        for line in body.decode().splitlines():
            key, _, value = line.partition(": ")
            if key == name:
                return int(value)
        return 0

    def close(self) -> None:
        self.pub.close()
        self.envoy.stop()
        if self.ext.proc.alive():
            os.kill(self.ext.proc.pid, signal.SIGCONT)
        self.ext.stop()


@pytest.fixture
def stack_for(log_dir: Path, echo_workers: dict[str, int]) -> Any:
    made: list[Stack] = []

    def make(tweak: Callable[[dict[str, Any]], None]) -> Stack:
        stack = Stack(log_dir, echo_workers, tweak)
        made.append(stack)
        return stack

    yield make
    for stack in made:
        stack.close()


def _routed_ok(stack: Stack) -> None:
    status, headers, body, _ = stack.post()
    assert status == 200, body
    assert headers.get("x-gateway-destination-endpoint") is None  # header stays upstream
    assert json.loads(body)["destination"] is not None  # the extproc picked the worker


def test_fail_open_extproc_stopped_routes_to_a_worker(stack_for: Any) -> None:
    stack = stack_for(message_timeout("1s"))
    _routed_ok(stack)
    stack.ext.stop()
    status, headers, body, _ = stack.post()
    assert status == 200, body
    assert "x-worker-id" in headers
    # Unchecked: the extproc did not pick it (round robin, no destination header).
    assert json.loads(body)["destination"] is None
    assert stack.stats("http.inference.ext_proc.failure_mode_allowed") >= 1


def test_fail_closed_extproc_stopped_answers_the_status(stack_for: Any) -> None:
    stack = stack_for(fail_closed(503))
    _routed_ok(stack)
    stack.ext.stop()
    before = stack.stats("cluster.workers.upstream_rq_total")
    status, headers, body, elapsed = stack.post()
    assert status == 503, body
    assert "x-worker-id" not in headers
    assert stack.stats("cluster.workers.upstream_rq_total") == before
    assert stack.stats("http.inference.ext_proc.failure_mode_allowed") == 0
    assert elapsed < 1.0, elapsed


def test_hung_extproc_fail_open_after_the_message_timeout(stack_for: Any) -> None:
    stack = stack_for(message_timeout("0.3s"))
    _routed_ok(stack)
    os.kill(stack.ext.proc.pid, signal.SIGSTOP)
    status, headers, body, elapsed = stack.post()
    os.kill(stack.ext.proc.pid, signal.SIGCONT)
    assert status == 200, body
    assert "x-worker-id" in headers
    assert json.loads(body)["destination"] is None
    assert 0.25 <= elapsed < 1.5, elapsed  # Envoy's timer may fire a little early
    assert stack.stats("http.inference.ext_proc.message_timeouts") >= 1


def test_hung_extproc_fail_closed_after_the_message_timeout(stack_for: Any) -> None:
    stack = stack_for(fail_closed(503, "0.3s"))
    _routed_ok(stack)
    before = stack.stats("cluster.workers.upstream_rq_total")
    os.kill(stack.ext.proc.pid, signal.SIGSTOP)
    status, headers, body, elapsed = stack.post()
    os.kill(stack.ext.proc.pid, signal.SIGCONT)
    # A message timeout is Envoy's 504, whatever status_on_error says.
    assert status == 504, body
    assert "x-worker-id" not in headers
    assert 0.25 <= elapsed < 1.5, elapsed  # Envoy's timer may fire a little early
    assert stack.stats("cluster.workers.upstream_rq_total") == before
    assert stack.stats("http.inference.ext_proc.message_timeouts") >= 1
    # The extproc serves again once it runs: the next request is routed.
    wait_until(lambda: stack.post()[0] == 200, 10, "the extproc to answer again")
