"""loadtest.bench: prompt sizes are parsed strictly and bodies have the size asked for."""

from __future__ import annotations

import argparse
import json

import pytest

from loadtest import bench


@pytest.mark.parametrize(
    ("text", "size"), [("short", None), ("1k", 1024), ("64K", 65536), ("2m", 2 << 20), ("700", 700)]
)
def test_prompt_size_parses(text: str, size: int | None) -> None:
    assert bench.prompt_size(text) == size


@pytest.mark.parametrize("text", ["0", "1g", "-1k", "k", "big"])
def test_prompt_size_rejects_with_the_value_and_what_was_expected(text: str) -> None:
    with pytest.raises(argparse.ArgumentTypeError, match=f"'{text}'.*1k, 64k, 512k"):
        bench.prompt_size(text)


@pytest.mark.parametrize("size", [1024, 65536, 524288])
def test_chat_body_has_the_size_asked_for_and_model_first(size: int) -> None:
    text = json.dumps(bench.chat_body("m", size))
    assert len(text) == size
    assert text.startswith('{"model": "m"')
    assert bench.size_label(size) == f"{size // 1024}k"


def test_short_body_is_the_fixed_prompt() -> None:
    assert bench.chat_body("busy", None) == {**bench.BODY, "model": "busy"}
