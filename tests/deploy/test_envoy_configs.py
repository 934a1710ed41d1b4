"""Every Envoy config in the repo loads in the real Envoy (envoy --mode validate)."""

from __future__ import annotations

import subprocess
from pathlib import Path

import pytest

from extproc.devstack import ROOT, envoy_binary

CONFIGS = sorted(p for p in (ROOT / "envoy").glob("*.y*ml"))


def test_there_are_configs() -> None:
    assert CONFIGS


@pytest.mark.parametrize("config", CONFIGS, ids=lambda p: p.name)
def test_config_validates(config: Path) -> None:
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
