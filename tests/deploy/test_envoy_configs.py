"""Every Envoy config in the repo, and every wiring the tests derive from one, loads in the
real Envoy (envoy --mode validate)."""

from __future__ import annotations

import json
import subprocess
from pathlib import Path

import pytest

from extproc.devstack import ROOT, envoy_binary
from tests.support.envoy_wirings import http_filters, stream_response_body

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
