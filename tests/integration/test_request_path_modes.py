"""How many ext_proc messages a request costs, read from Envoy's own counters.

Default config (prefix mode): a body that starts with "model" is decided on the
request-headers message (the body stays in Envoy); any other body is sent buffered and
decided there (exact mode), so a malformed one is still a 400. A config without the
prefix reader answers on the headers when the reply cannot depend on the body
(docs/request-path.md).
"""

from __future__ import annotations

import json
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from extproc.devstack import Envoy, Extproc, Publisher, http, metric_value, wait_until

CHAT = "/v1/chat/completions"
MODEL_FIRST = json.dumps({"model": "pm", "messages": [{"role": "user", "content": "hi"}]})
MODEL_LATE = json.dumps({"messages": [{"role": "user", "content": "hi"}], "model": "pm"})


def _without_prefix_reader(cfg: dict[str, Any]) -> None:
    hcm = cfg["static_resources"]["listeners"][0]["filter_chains"][0]["filters"][0]
    filters = hcm["typed_config"]["http_filters"]
    hcm["typed_config"]["http_filters"] = [
        f for f in filters if f["name"] != "envoy.filters.http.lua"
    ]
    for vh in hcm["typed_config"]["route_config"]["virtual_hosts"]:
        for route in vh["routes"]:
            route.get("typed_per_filter_config", {}).pop("envoy.filters.http.lua", None)


class _Path:
    def __init__(self, log_dir: Path, worker_port: int, exact_config: bool) -> None:
        self.ext = Extproc(
            log_dir, ["--worker-ttl", "120", "--active-decode-blocks-threshold", "0.9"]
        )
        tweak = _without_prefix_reader if exact_config else None
        self.envoy = Envoy(log_dir, self.ext, [worker_port], tweak=tweak)
        self.pub = Publisher(self.ext.event_endpoint)
        self.pub.announce(self.ext, "pm-1", "pm", f"127.0.0.1:{worker_port}", kv_total_blocks=100)

    def stat(self, name: str) -> int:
        """One of Envoy's counters of the inference listener."""
        url = f"http://127.0.0.1:{self.envoy.admin_port}/stats?filter=^http.inference.{name}$"
        text = http("GET", url)[2].decode()
        got, _, value = text.strip().partition(": ")
        assert got == f"http.inference.{name}", text
        return int(value)

    def sent(self) -> int:
        """ext_proc messages Envoy has sent so far."""
        return self.stat("ext_proc.stream_msgs_sent")

    def messages_for(self, body: bytes | str) -> tuple[int, int]:
        """(status, messages Envoy sent the extproc) for one chat request."""
        before = self.sent()
        raw = body.encode() if isinstance(body, str) else body
        status = http("POST", self.envoy.url + CHAT, raw)[0]
        # Every message of a request is sent before its response reaches the client.
        return status, self.sent() - before

    def set_busy(self, busy: bool) -> None:
        self.pub.load("pm-1", active_decode_blocks=95 if busy else 0)
        state = "busy" if busy else "free"
        wait_until(lambda: self.ext.workers()["pm-1"]["state"] == state, 5, state)

    def close(self) -> None:
        self.pub.close()
        self.envoy.stop()
        self.ext.stop()


@pytest.fixture(scope="module")
def paths(log_dir: Path, echo_workers: dict[str, int]) -> Iterator[dict[str, _Path]]:
    made = {
        "prefix": _Path(log_dir, echo_workers["a"], exact_config=False),
        "exact": _Path(log_dir, echo_workers["a"], exact_config=True),
    }
    yield made
    for p in made.values():
        p.close()


def test_prefix_mode_decides_on_the_headers_and_falls_back_to_the_body(
    paths: dict[str, _Path],
) -> None:
    p = paths["prefix"]
    p.set_busy(False)
    assert p.messages_for(MODEL_FIRST) == (200, 2)  # request headers, response headers
    assert p.messages_for(MODEL_LATE) == (200, 3)  # + the buffered body
    p.set_busy(True)
    assert p.messages_for(MODEL_FIRST) == (529, 1)
    # Every worker busy, but the body is malformed: still the 400, decided on the body.
    assert p.messages_for(b"{") == (400, 2)
    assert p.messages_for(MODEL_LATE) == (529, 2)
    p.set_busy(False)


def test_without_the_prefix_reader_an_all_busy_pool_answers_on_the_headers(
    paths: dict[str, _Path],
) -> None:
    p = paths["exact"]
    p.set_busy(False)
    assert p.messages_for(MODEL_FIRST) == (200, 3)
    p.set_busy(True)
    status, sent = p.messages_for(MODEL_FIRST)
    assert (status, sent) == (529, 1)
    # The body is not read: a malformed one gets the overload reply too (documented).
    assert p.messages_for(b"{") == (529, 1)
    text = p.ext.metrics()
    labels = {"model": "pm", "endpoint": "chat_completions"}
    assert metric_value(text, "dynamo_frontend_model_rejection_total", labels) == 2
    p.set_busy(False)


def test_pass_through_bodies_are_not_read_by_the_prefix_reader(paths: dict[str, _Path]) -> None:
    p = paths["prefix"]
    runs = p.stat("lua.executions")
    before = p.sent()
    assert http("POST", p.envoy.url + "/v1/other", b"x" * 100_000)[0] == 200
    assert p.sent() - before == 1  # the headers; the extproc lets it pass
    assert p.stat("lua.executions") == runs
    http("POST", p.envoy.url + CHAT, MODEL_FIRST.encode())
    assert p.stat("lua.executions") == runs + 1
