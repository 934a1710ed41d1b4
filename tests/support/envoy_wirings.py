"""Envoy wirings the tests run besides the shipped configs, as tweaks of a loaded config."""

from __future__ import annotations

from collections.abc import Callable
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


# The test's stand-in for a gateway that computes an endpoint subset: a Lua filter ahead of
# ext_proc writes envoy.lb.subset_hint from test headers, in the shape x-test-subset-kind
# asks for: "list" (a list of strings, the protocol's shape), "string" (one comma-separated
# string, as a header-to-metadata rule writes it), "number" (malformed).
SUBSET_HINT_LUA = """
function envoy_on_request(handle)
  local hint = handle:headers():get("x-test-subset")
  if hint == nil then return end
  local kind = handle:headers():get("x-test-subset-kind") or "list"
  local value = hint
  if kind == "list" then
    value = {}
    for entry in string.gmatch(hint, "[^,]+") do value[#value + 1] = entry end
  elseif kind == "number" then
    value = 42
  end
  handle:streamInfo():dynamicMetadata():set(
    "envoy.lb.subset_hint", "x-gateway-destination-endpoint-subset", value)
end
"""


FILE_ACCESS_LOG = "type.googleapis.com/envoy.extensions.access_loggers.file.v3.FileAccessLog"


def gateway_subset_hint(access_log: str) -> Callable[[dict[str, Any]], None]:
    """envoy/envoy-epp.yaml with the subset-hint writer ahead of ext_proc, and an access log
    at ``access_log``: one line per request,
    ``<x-test-id header> <status> <envoy.lb metadata> <upstream>``."""

    def tweak(cfg: dict[str, Any]) -> None:
        filters = http_filters(cfg)
        filters.insert(
            0,
            {
                "name": "envoy.filters.http.lua",
                "typed_config": {
                    "@type": "type.googleapis.com/envoy.extensions.filters.http.lua.v3.Lua",
                    "default_source_code": {"inline_string": SUBSET_HINT_LUA},
                },
            },
        )
        listener = cfg["static_resources"]["listeners"][0]
        hcm = listener["filter_chains"][0]["filters"][0]["typed_config"]
        hcm["access_log"] = [
            {
                "name": "envoy.access_loggers.file",
                "typed_config": {
                    "@type": FILE_ACCESS_LOG,
                    "path": access_log,
                    "log_format": {
                        "text_format_source": {
                            "inline_string": "%REQ(X-TEST-ID)% %RESPONSE_CODE% "
                            "%DYNAMIC_METADATA(envoy.lb:x-gateway-destination-endpoint)% "
                            "%UPSTREAM_HOST%\n"
                        }
                    },
                },
            }
        ]

    return tweak


def full_duplex(cfg: dict[str, Any]) -> None:
    """envoy/envoy-epp.yaml with the ext_proc filter's modes as Istio generates them for an
    InferencePool (istio/istio main, pilot/pkg/xds/filters/filters.go,
    BuildInferencePoolExtProcFilter, late 2026): both bodies FULL_DUPLEX_STREAMED, both
    trailers SEND, message_timeout 1000s. Envoy AI Gateway v1.1.0's default ("duplex") sets
    the same modes with a 300 s timeout."""
    main = next(f for f in http_filters(cfg) if f["name"] == MAIN_FILTER)
    config = main["typed_config"]
    config["processing_mode"] = {
        "request_header_mode": "SEND",
        "request_body_mode": "FULL_DUPLEX_STREAMED",
        "request_trailer_mode": "SEND",
        "response_header_mode": "SEND",
        "response_body_mode": "FULL_DUPLEX_STREAMED",
        "response_trailer_mode": "SEND",
    }
    config["message_timeout"] = "1000s"


def override_host_pool(worker_ports: list[int]) -> Callable[[dict[str, Any]], None]:
    """envoy/envoy-epp.yaml with a data plane that takes the picker's list: the pool as a
    static cluster of ``worker_ports`` under Envoy's override_host policy, which reads
    envoy.lb / x-gateway-destination-endpoint and goes down the list on retries of a 529."""
    round_robin = {
        "name": "envoy.load_balancing_policies.round_robin",
        "typed_config": {"@type": ROUND_ROBIN},
    }
    override_host = {
        "name": "envoy.load_balancing_policies.override_host",
        "typed_config": {
            "@type": OVERRIDE_HOST,
            "override_host_sources": [
                {"metadata": {"key": "envoy.lb", "path": [{"key": DESTINATION}]}}
            ],
            "fallback_policy": {"policies": [{"typed_extension_config": round_robin}]},
        },
    }
    members = [
        {"endpoint": {"address": {"socket_address": {"address": "127.0.0.1", "port_value": p}}}}
        for p in worker_ports
    ]

    def tweak(cfg: dict[str, Any]) -> None:
        clusters = cfg["static_resources"]["clusters"]
        (pool,) = [c for c in clusters if c["name"] == "inference_pool"]
        pool.clear()
        pool.update(
            {
                "name": "inference_pool",
                "type": "STATIC",
                "connect_timeout": "2s",
                "load_balancing_policy": {"policies": [{"typed_extension_config": override_host}]},
                "load_assignment": {
                    "cluster_name": "inference_pool",
                    "endpoints": [{"lb_endpoints": members}],
                },
            }
        )
        listener = cfg["static_resources"]["listeners"][0]
        hcm = listener["filter_chains"][0]["filters"][0]["typed_config"]
        route = hcm["route_config"]["virtual_hosts"][0]["routes"][0]["route"]
        route["retry_policy"] = {
            "retry_on": "retriable-status-codes",
            "num_retries": 2,
            "retriable_status_codes": [529],
        }

    return tweak


DESTINATION = "x-gateway-destination-endpoint"
OVERRIDE_HOST = (
    "type.googleapis.com/envoy.extensions.load_balancing_policies.override_host.v3.OverrideHost"
)
ROUND_ROBIN = (
    "type.googleapis.com/envoy.extensions.load_balancing_policies.round_robin.v3.RoundRobin"
)
