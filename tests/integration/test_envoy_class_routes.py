"""The shipped Envoy config sets the request class (docs/classes.md, "Which class a request
is in"): its header_mutation filter overwrites ``x-request-class`` and sets the trusted
marker on the ``x-api-tier`` routes, and removes a client's marker everywhere else. Run
through the real Envoy (envoy/envoy.yaml as shipped) and the extproc with the shipped
example classes file (deploy/classes.example.yaml)."""

from __future__ import annotations

import json
import math
from fractions import Fraction
from pathlib import Path
from typing import Any

import yaml

from extproc.devstack import ROOT, http, metric_samples, wait_until
from extproc.settings import load_class_table
from tests.conftest import Stack

EXAMPLE = ROOT / "deploy" / "classes.example.yaml"
CHAT = "/v1/chat/completions"
EMBEDDINGS = "/v1/embeddings"
MODEL = "m-tier"
MARKER = "x-request-class-trusted"
DECODE_THRESHOLD = 0.5  # of 100 KV blocks


def _limit(cls: str) -> int:
    """The class's KV-block limit on the test worker: floor(0.5 x share x 100)."""
    share = load_class_table(str(EXAMPLE)).by_name(cls).share.active_decode_blocks
    return math.floor(Fraction(str(DECODE_THRESHOLD)) * Fraction(str(share)) * 100)


assert _limit("sheddable") < _limit("standard") < _limit("critical")
ONLY_SHEDDABLE_BUSY = _limit("sheddable") + 1  # below standard's and critical's limits
STANDARD_BUSY = _limit("standard") + 1  # below critical's limit


def _example() -> dict[str, Any]:
    doc = yaml.safe_load(EXAMPLE.read_text())
    assert isinstance(doc, dict)
    return doc


def _start(make_stack: Any, classes_file: Path) -> Stack:
    stack: Stack = make_stack(
        [
            "--classes-file",
            str(classes_file),
            "--active-decode-blocks-threshold",
            str(DECODE_THRESHOLD),
        ]
    )
    stack.pub.announce(stack.ext, "tier-w", MODEL, stack.endpoint("a"), kv_total_blocks=100)
    return stack


def _load(stack: Stack, blocks: int) -> None:
    stack.pub.load("tier-w", active_decode_blocks=blocks)
    wait_until(
        lambda: (
            stack.ext.workers()["tier-w"]["ranks"][0]["reported"]["active_decode_blocks"] == blocks
        ),
        5,
        f"load {blocks}",
    )


def _post(stack: Stack, headers: dict[str, str], path: str = CHAT) -> tuple[int, str | None]:
    """(status, x-shed-class) of one request through Envoy."""
    if path == EMBEDDINGS:
        body: dict[str, Any] = {"model": MODEL, "input": "hi"}
    else:
        body = {"model": MODEL, "messages": [{"role": "user", "content": "hi"}]}
    status, hdrs, raw = http("POST", stack.envoy.url + path, body, headers)
    assert status in (200, 429, 529), (status, raw)
    return status, hdrs.get("x-shed-class")


def _routed(stack: Stack, cls: str) -> float:
    """Requests of ``cls`` admitted so far, every endpoint."""
    return sum(
        s.value
        for s in metric_samples(stack.ext.metrics())
        if s.name == "extproc_requests_by_class_total"
        and s.labels["class"] == cls
        and s.labels["outcome"] == "routed"
    )


def test_api_tier_routes_set_the_class_with_the_trusted_marker(make_stack: Any) -> None:
    secret = _example()["trusted_marker"]["value"]
    stack = _start(make_stack, EXAMPLE)
    _load(stack, ONLY_SHEDDABLE_BUSY)
    # batch is sheddable (its status, 429), on both inference route kinds; a client's own
    # x-request-class and marker are overwritten, not appended to.
    assert _post(stack, {"x-api-tier": "batch"}) == (429, "sheddable")
    assert _post(stack, {"x-api-tier": "batch"}, EMBEDDINGS) == (429, "sheddable")
    forged = {"x-api-tier": "batch", "x-request-class": "critical", MARKER: secret}
    assert _post(stack, forged) == (429, "sheddable")
    # Without a tier: the default class, standard, still below its limit here.
    assert _post(stack, {}) == (200, None)

    _load(stack, STANDARD_BUSY)
    # premium is critical: admitted while standard and sheddable are shed.
    before = _routed(stack, "critical")
    assert _post(stack, {"x-api-tier": "premium"}) == (200, None)
    assert _post(stack, {"x-api-tier": "premium"}, EMBEDDINGS) == (200, None)
    assert _routed(stack, "critical") == before + 2
    assert _post(stack, {}) == (529, "standard")
    assert _post(stack, {"x-api-tier": "batch"}) == (429, "sheddable")


def test_a_forged_marker_on_the_default_route_is_removed(make_stack: Any) -> None:
    secret = _example()["trusted_marker"]["value"]
    stack = _start(make_stack, EXAMPLE)
    _load(stack, STANDARD_BUSY)
    # The right secret, sent by the client: Envoy removes the marker, so the extproc
    # ignores the class header and the request is the default class, shed here.
    forged = {"x-request-class": "critical", MARKER: secret}
    assert _post(stack, forged) == (529, "standard")
    assert _post(stack, forged, EMBEDDINGS) == (529, "standard")
    assert _post(stack, {"x-request-class": "critical"}) == (529, "standard")
    assert _routed(stack, "critical") == 0
    # The same secret set by Envoy, on a tier route, is trusted; a wrong one sent by the
    # client there is overwritten.
    assert _post(stack, {"x-api-tier": "premium"}) == (200, None)
    assert _post(stack, {"x-api-tier": "batch", MARKER: "wrong"}) == (429, "sheddable")
    assert _routed(stack, "critical") == 1
    # GET /classes says a marker value is set and never shows it.
    status, _, raw = http("GET", stack.ext.admin + "/classes")
    assert status == 200 and secret.encode() not in raw
    assert json.loads(raw)["trusted_marker"] == {"header": MARKER, "value": "(set, not shown)"}


def test_without_a_marker_the_client_class_header_counts(tmp_path: Path, make_stack: Any) -> None:
    doc = _example()
    del doc["trusted_marker"]
    path = tmp_path / "classes.yaml"
    path.write_text(yaml.safe_dump(doc))
    stack = _start(make_stack, path)
    _load(stack, STANDARD_BUSY)
    # The default route leaves a client's x-request-class as it was sent.
    assert _post(stack, {"x-request-class": "critical"}) == (200, None)
    assert _post(stack, {"x-request-class": "critical"}, EMBEDDINGS) == (200, None)
    assert _post(stack, {"x-request-class": "sheddable"}) == (429, "sheddable")
    assert _post(stack, {}) == (529, "standard")
    # The tier routes still decide: premium and batch overwrite the client's class.
    assert _post(stack, {"x-api-tier": "premium", "x-request-class": "sheddable"}) == (200, None)
    assert _post(stack, {"x-api-tier": "batch", "x-request-class": "critical"}) == (
        429,
        "sheddable",
    )
