"""``loadtest.engine_vs_sim``'s files: a run of one engine replaces that engine's rows and
keeps the other's, and the notes written by hand below the tables survive every run."""

from __future__ import annotations

import argparse
import json
from pathlib import Path
from typing import Any

import pytest

from loadtest.engine_vs_sim import NOTES, _engines, write


def _row(engine: str | None, worker: str, concurrency: int, **extra: Any) -> dict[str, Any]:
    row: dict[str, Any] = {
        "worker": worker, "concurrency": concurrency, "requests": 3, "errors": 0,
        "ttft_p50_ms": 100.0, "ttft_p90_ms": 120.0, "itl_p50_ms": 60.0, "itl_p90_ms": 70.0,
        "peak_kv_blocks": 3, "kv_total_blocks": 9, "peak_prefill_tokens": 0,
        "busy_share": 0.25, **extra,
    }  # fmt: skip
    if engine is not None:
        row["engine"] = engine
    return row


ARGS = argparse.Namespace(
    levels=[1], rounds=1, decode_threshold=0.5, prefill_threshold=200, out=None, log_dir=None
)


def test_a_vllm_run_keeps_the_llamacpp_rows_and_the_notes(tmp_path: Path) -> None:
    # What a run before vLLM was added left: rows without an engine, and its arguments.
    old_args = {"levels": [1, 2, 4], "rounds": 3, "decode_threshold": 0.5, "prefill_threshold": 200}
    old_rows = [_row(None, "llama.cpp", 1), _row(None, "sim", 1)]
    (tmp_path / "engine-vs-sim.json").write_text(json.dumps({"rows": old_rows, "args": old_args}))
    (tmp_path / "engine-vs-sim.md").write_text(f"old tables\n\n{NOTES}\n\nWhat vLLM does.\n")
    runs = {"vllm": {"levels": [1], "rounds": 1, "seconds": 12.0, "loadavg": ["1.0", "2.0"]}}
    rows = [_row("vllm", "vLLM", 1, preemptions=6, peak_waiting=2, prompt_tokens=163)]
    write(tmp_path, rows, runs, ARGS)

    saved = json.loads((tmp_path / "engine-vs-sim.json").read_text())
    assert [(r.get("engine", "llamacpp"), r["worker"]) for r in saved["rows"]] == [
        ("llamacpp", "llama.cpp"), ("llamacpp", "sim"), ("vllm", "vLLM"),
    ]  # fmt: skip
    assert saved["runs"]["llamacpp"]["levels"] == [1, 2, 4]
    assert saved["runs"]["vllm"]["seconds"] == 12.0
    text = (tmp_path / "engine-vs-sim.md").read_text()
    assert "## llama.cpp" in text and "## vLLM" in text
    assert "| vLLM | 1 | 100.0 / 120.0 | 60.0 / 70.0 | 3 / 9 | 0 | 25% | 2 | 6 | 163 |" in text
    assert "| llama.cpp | 1 | 100.0 / 120.0 | 60.0 / 70.0 | 3 / 9 | 0 | 25% | — | — | — |" in text
    assert "`/proc/loadavg` before `1.0`, after `2.0`" in text
    assert "old tables" not in text
    assert text.endswith(f"{NOTES}\n\nWhat vLLM does.\n")

    # A second vLLM run replaces the vLLM rows, and still keeps the rest.
    write(tmp_path, [_row("vllm", "vLLM", 2)], runs, ARGS)
    saved = json.loads((tmp_path / "engine-vs-sim.json").read_text())
    assert [(r["worker"], r["concurrency"]) for r in saved["rows"]] == [
        ("llama.cpp", 1), ("sim", 1), ("vLLM", 2),
    ]  # fmt: skip
    assert (tmp_path / "engine-vs-sim.md").read_text().endswith("What vLLM does.\n")


def test_engines_are_named_from_a_list() -> None:
    assert _engines("vllm") == ["vllm"]
    assert _engines("llamacpp, vllm,vllm") == ["llamacpp", "vllm"]
    with pytest.raises(argparse.ArgumentTypeError, match="'sglang' is not an engine"):
        _engines("sglang")
    with pytest.raises(argparse.ArgumentTypeError, match="no engine named"):
        _engines(" , ")
