"""Envoy wirings the tests run besides the shipped configs, as tweaks of a loaded config."""

from __future__ import annotations

from typing import Any

MAIN_FILTER = "envoy.filters.http.ext_proc"


def http_filters(cfg: dict[str, Any]) -> list[dict[str, Any]]:
    """The HTTP filter chain of the inference listener."""
    listener = cfg["static_resources"]["listeners"][0]
    hcm = listener["filter_chains"][0]["filters"][0]["typed_config"]
    filters: list[dict[str, Any]] = hcm["http_filters"]
    return filters


def stream_response_body(cfg: dict[str, Any]) -> None:
    """envoy/envoy.yaml with the routing ext_proc filter streaming the response body: the
    one-filter way to let the extproc count generated tokens (no observer filter)."""
    main = next(f for f in http_filters(cfg) if f["name"] == MAIN_FILTER)
    main["typed_config"]["processing_mode"]["response_body_mode"] = "STREAMED"
