"""Every Envoy config in the repo loads in the real Envoy (envoy --mode validate)."""

from __future__ import annotations

import subprocess
from pathlib import Path

import pytest

from tests.support.stack import ROOT, envoy_binary

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
