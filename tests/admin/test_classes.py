"""``/classes`` on the real service: a refused change names the key path and the value, is
422 (404 for a class that is not configured), and changes nothing; the process refuses a bad
classes file at startup with exit code 2, naming the line."""

from __future__ import annotations

import json
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from extproc.devstack import ROOT, Extproc, http

CLASSES = """\
default: standard
classes:
  critical: {priority: 0, share: 1.0}
  standard: {priority: 1, share: 0.9}
  sheddable:
    priority: 2
    share: 0.7
    status: 429
"""


@pytest.fixture(scope="module")
def ext(log_dir: Path) -> Iterator[Extproc]:
    own = log_dir / "admin-classes"
    own.mkdir(exist_ok=True)
    path = own / "classes.yaml"
    path.write_text(CLASSES)
    made = Extproc(own, ["--classes-file", str(path)])
    yield made
    made.stop()


def _classes(ext: Extproc) -> dict[str, Any]:
    status, _, raw = http("GET", ext.admin + "/classes")
    assert status == 200, raw
    return {c["name"]: c for c in json.loads(raw)["classes"]}


@pytest.mark.parametrize(
    ("body", "status", "error"),
    [
        ({"name": "sheddable", "share": 0}, 422, "classes.sheddable.share: 0 is out of range; "
         "expected a share in (0, 10], 1 = the configured limit"),
        ({"name": "sheddable", "share": "0.5"}, 422, "classes.sheddable.share: '0.5' is not a "
         "number"),
        ({"name": "sheddable", "share": {"active_decode_blocks": 0.5}}, 422,
         "classes.sheddable.share: unknown threshold 'active_decode_blocks'"),
        ({"name": "sheddable", "status": 500}, 422, "classes.sheddable.status: 500 is not one of "
         "the allowed values"),
        ({"name": "sheddable", "retry_after": 1.5}, 422, "classes.sheddable.retry_after: 1.5 is "
         "not an integer"),
        ({"name": "sheddable", "priority": True}, 422, "classes.sheddable.priority: True is not "
         "an integer"),
        ({"name": "sheddable", "colour": "red"}, 422, "classes.sheddable.colour: unknown key"),
        ({"name": "sheddable", "large_prompt": {"share": 0.2}}, 422,
         "classes.sheddable.large_prompt: {'share': 0.2} must have exactly above_tokens and "
         "share"),
        ({"name": "vip", "share": 0.5}, 404, "class 'vip' is not configured"),
    ],
)  # fmt: skip
def test_a_refused_change_names_the_key_and_changes_nothing(
    ext: Extproc, body: dict[str, Any], status: int, error: str
) -> None:
    before = _classes(ext)
    got, _, raw = http("POST", ext.admin + "/classes", body)
    assert got == status, raw
    assert json.loads(raw)["error"].startswith(error), raw
    assert _classes(ext) == before


def test_an_accepted_change_is_the_class_in_force(ext: Extproc) -> None:
    body = {"name": "critical", "share": {"active_decode_blocks_threshold": 1.2}}
    status, _, raw = http("POST", ext.admin + "/classes", body)
    assert status == 200, raw
    share = _classes(ext)["critical"]["share"]
    assert share == {
        "active_decode_blocks_threshold": 1.2,
        "active_prefill_tokens_threshold": 1.0,
        "active_prefill_tokens_threshold_frac": 1.0,
    }


def test_a_bad_file_stops_the_service_naming_the_line(tmp_path: Path) -> None:
    path = tmp_path / "classes.yaml"
    path.write_text(CLASSES.replace("status: 429", "status: 500"))
    result = subprocess.run(
        [sys.executable, "-m", "extproc", "--classes-file", str(path)],
        capture_output=True,
        text=True,
        timeout=60,
        cwd=ROOT,
        env={"PATH": "/usr/bin:/bin"},
    )
    assert result.returncode == 2, result.stderr
    assert f"{path}, line 8: classes.sheddable.status: 500 is not one of" in result.stderr
    assert "Traceback" not in result.stderr
