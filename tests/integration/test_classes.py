"""Request classes through the real Envoy (docs/classes.md): sheddable traffic takes the
rejections first, critical traffic is admitted while any worker is below its own limit,
and every rejection says why."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from extproc.devstack import http, wait_until
from tests.conftest import Stack

CHAT = "/v1/chat/completions"
CLASSES = """
default: standard
classes:
  critical: {priority: 0, share: 1.0}
  standard: {priority: 1, share: 0.9}
  sheddable: {priority: 2, share: 0.7, status: 429, retry_after: 9}
"""


def post(stack: Stack, cls: str | None) -> tuple[int, dict[str, str], Any]:
    headers = {"x-request-class": cls} if cls else {}
    body = {"model": "m-cls", "messages": [{"role": "user", "content": "hi"}]}
    status, hdrs, raw = http("POST", stack.envoy.url + CHAT, body, headers)
    return status, hdrs, json.loads(raw)


def test_classes_shed_in_order_and_say_why(tmp_path: Path, make_stack: Any) -> None:
    path = tmp_path / "classes.yaml"
    path.write_text(CLASSES)
    stack = make_stack(["--classes-file", str(path), "--active-decode-blocks-threshold", "0.5"])
    stack.pub.announce(stack.ext, "cls-w", "m-cls", stack.endpoint("a"), kv_total_blocks=100)

    def load(blocks: int) -> None:
        stack.pub.load("cls-w", active_decode_blocks=blocks)
        wait_until(
            lambda: (
                stack.ext.workers()["cls-w"]["ranks"][0]["reported"]["active_decode_blocks"]
                == blocks
            ),
            5,
            f"load {blocks}",
        )

    load(40)  # 40 %: above sheddable's 35, below standard's 45 and critical's 50
    status, hdrs, body = post(stack, "sheddable")
    assert (status, hdrs["retry-after"], body["type"]) == (429, "9", "Too Many Requests")
    assert hdrs["x-shed-reason"] == "active_decode_blocks_threshold"
    assert hdrs["x-shed-class"] == "sheddable"
    assert post(stack, "standard")[0] == 200
    assert post(stack, None)[0] == 200  # no header: the default class (standard)
    load(48)  # above standard's 45: only critical is admitted
    status, hdrs, _ = post(stack, None)
    assert (status, hdrs["x-shed-class"]) == (529, "standard")
    assert post(stack, "critical")[0] == 200
    load(51)  # above every class's limit
    assert post(stack, "critical")[0] == 529
    # A class changed at runtime applies to the very next request.
    status, _, raw = http("POST", stack.ext.admin + "/classes", {"name": "critical", "share": 1.2})
    assert status == 200, raw
    assert post(stack, "critical")[0] == 200
    view = json.loads(http("GET", stack.ext.admin + "/debug/workers")[2])
    worker = next(w for w in view["workers"] if w["worker_id"] == "cls-w")
    assert worker["classes"]["critical"]["busy"] is False
    assert worker["classes"]["sheddable"] == {
        "busy": True,
        "fired": "active_decode_blocks_threshold",
    }
