"""Reading model, stream and the prompt-size estimate from OpenAI bodies (SPEC §4, §5)."""

from __future__ import annotations

import json
from typing import Any

import pytest

from extproc.openai_request import BadRequest, estimate_tokens, parse_body


@pytest.mark.parametrize(
    ("body", "tokens"),
    [
        ({"model": "m", "messages": [{"role": "user", "content": "abcd"}]}, 1),
        ({"model": "m", "messages": [{"role": "user", "content": "abcde"}]}, 2),
        ({"model": "m", "messages": [{"content": "ab"}, {"content": "cd"}]}, 1),  # concatenated
        (
            {
                "model": "m",
                "messages": [
                    {
                        "content": [
                            {"type": "text", "text": "abcdefgh"},
                            {"type": "image_url", "image_url": {}},
                        ]
                    }
                ],
            },
            2,
        ),
        ({"model": "m", "messages": [{"content": "é" * 4}]}, 2),  # 8 UTF-8 bytes
        ({"model": "m", "prompt": "x" * 400}, 100),
        ({"model": "m", "prompt": ["abcd", "abcd"]}, 2),
        ({"model": "m", "prompt": [1, 2, 3]}, 3),  # token ids count their length
        ({"model": "m", "input": "abcdefgh"}, 2),
        ({"model": "m", "input": [[1, 2], [3]]}, 3),
        ({"model": "m"}, 0),
    ],
)
def test_prompt_estimate(body: dict[str, Any], tokens: int) -> None:
    assert parse_body(json.dumps(body).encode()).prompt_tokens == tokens


def test_model_and_stream() -> None:
    r = parse_body(b'{"model":"llama","stream":true}')
    assert (r.model, r.stream) == ("llama", True)
    assert parse_body(b'{"model":"llama","stream":"yes"}').stream is False


@pytest.mark.parametrize(
    "raw", [b"", b"{", b"[]", b"null", b"{}", b'{"model":1}', b'{"model":null}', b'{"model":["a"]}']
)
def test_bad_bodies(raw: bytes) -> None:
    with pytest.raises(BadRequest):
        parse_body(raw)


def test_estimate_ignores_unknown_shapes() -> None:
    assert estimate_tokens({"weird": 1}) == 0
    assert estimate_tokens(None) == 0
