"""Every Envoy config in the repo, and every wiring the tests derive from one, loads in the
real Envoy (envoy --mode validate)."""

from __future__ import annotations

import json
import subprocess
from pathlib import Path

import pytest

from extproc.devstack import ROOT, envoy_binary
from tests.support.envoy_wirings import (
    full_duplex,
    gateway_subset_hint,
    http_filters,
    stream_response_body,
)

CONFIGS = sorted(p for p in (ROOT / "envoy").glob("*.y*ml"))


def test_there_are_configs() -> None:
    assert CONFIGS


def _validate(config: Path) -> None:
    proc = subprocess.run(
        [
            envoy_binary(),
            "--mode",
            "validate",
            "-c",
            str(config),
            "--disable-hot-restart",
            "-l",
            "error",
        ],
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert "OK" in proc.stdout


@pytest.mark.parametrize("config", CONFIGS, ids=lambda p: p.name)
def test_config_validates(config: Path) -> None:
    _validate(config)


def test_the_routing_filter_streaming_the_response_body_validates(tmp_path: Path) -> None:
    """The one-filter way to count generated tokens (the integration tests run it)."""
    import yaml

    cfg = yaml.safe_load((ROOT / "envoy" / "envoy.yaml").read_text())
    stream_response_body(cfg)
    main = next(f for f in http_filters(cfg) if f["name"] == "envoy.filters.http.ext_proc")
    assert main["typed_config"]["processing_mode"]["response_body_mode"] == "STREAMED"
    assert main["typed_config"]["allow_mode_override"] is True
    config = tmp_path / "envoy-streamed-body.json"
    config.write_text(json.dumps(cfg))
    _validate(config)


def _strip_observer(node: object) -> object:
    """The config without the extproc.observe filter and its per-route entries."""
    if isinstance(node, dict):
        return {
            k: _strip_observer(v)
            for k, v in node.items()
            if k != "extproc.observe"
            and not (k == "typed_per_filter_config" and set(v) == {"extproc.observe"})
        }
    if isinstance(node, list):
        return [
            _strip_observer(v)
            for v in node
            if not (isinstance(v, dict) and v.get("name") == "extproc.observe")
        ]
    return node


def test_track_output_config_is_envoy_yaml_plus_the_observer() -> None:
    import yaml

    base = yaml.safe_load((ROOT / "envoy" / "envoy.yaml").read_text())
    track = yaml.safe_load((ROOT / "envoy" / "envoy-track-output.yaml").read_text())
    filters = track["static_resources"]["listeners"][0]["filter_chains"][0]["filters"][0][
        "typed_config"
    ]["http_filters"]
    observer = next(f for f in filters if f["name"] == "extproc.observe")
    assert observer["typed_config"]["observability_mode"] is True
    assert observer["typed_config"]["processing_mode"]["response_body_mode"] == "STREAMED"
    assert _strip_observer(track) == base


def test_the_gateway_wirings_validate(tmp_path: Path) -> None:
    """envoy-epp.yaml as the integration tests run it: the subset-hint writer and access log
    in front, and the full-duplex body modes."""
    import yaml

    cfg = yaml.safe_load((ROOT / "envoy" / "envoy-epp.yaml").read_text())
    gateway_subset_hint(str(tmp_path / "access.log"))(cfg)
    full_duplex(cfg)
    main = next(f for f in http_filters(cfg) if f["name"] == "envoy.filters.http.ext_proc")
    assert main["typed_config"]["processing_mode"]["request_body_mode"] == "FULL_DUPLEX_STREAMED"
    assert http_filters(cfg)[0]["name"] == "envoy.filters.http.lua"
    config = tmp_path / "envoy-epp-duplex.json"
    config.write_text(json.dumps(cfg))
    _validate(config)


def test_envoy_epp_is_wired_as_a_gateway_wires_an_endpoint_picker() -> None:
    import yaml

    cfg = yaml.safe_load((ROOT / "envoy" / "envoy-epp.yaml").read_text())
    main = next(f for f in http_filters(cfg) if f["name"] == "envoy.filters.http.ext_proc")
    ext = main["typed_config"]
    assert ext["failure_mode_allow"] is False
    assert ext["allow_mode_override"] is False
    assert ext["metadata_options"]["forwarding_namespaces"]["untyped"] == ["envoy.lb.subset_hint"]
    (pool,) = [c for c in cfg["static_resources"]["clusters"] if c["name"] == "inference_pool"]
    assert pool["type"] == "ORIGINAL_DST" and pool["lb_policy"] == "CLUSTER_PROVIDED"
    assert pool["original_dst_lb_config"] == {
        "use_http_header": True,
        "http_header_name": "x-gateway-destination-endpoint",
    }
