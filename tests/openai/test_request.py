"""Reading model, stream and the prompt-size estimate from OpenAI bodies (docs/routing.md)."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest

from extproc.openai.request import BadRequest, PromptTokenizer, estimate_tokens, parse_body


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


def _word_tokenizer(path: Path) -> Path:
    from tokenizers import Tokenizer, models, pre_tokenizers

    vocab = {"[UNK]": 0, "hello": 1, "world": 2, "!": 3}
    tok = Tokenizer(models.WordLevel(vocab, unk_token="[UNK]"))
    tok.pre_tokenizer = pre_tokenizers.Whitespace()
    out = path / "tokenizer.json"
    tok.save(str(out))
    return out


def test_local_tokenizer_counts_exactly(tmp_path: Path) -> None:
    counter = PromptTokenizer(str(_word_tokenizer(tmp_path)))
    body = {"model": "m", "messages": [{"content": "hello world !"}, {"content": " hello"}]}
    assert parse_body(json.dumps(body).encode(), counter).prompt_tokens == 4
    assert parse_body(json.dumps(body).encode()).prompt_tokens == 5  # ceil(19 bytes / 4)
    assert parse_body(b'{"model":"m","prompt":[5,6,7]}', counter).prompt_tokens == 3


def test_bad_tokenizer_file_is_a_clear_error(tmp_path: Path) -> None:
    bad = tmp_path / "tokenizer.json"
    bad.write_text("{not a tokenizer")
    with pytest.raises(ValueError, match="cannot load tokenizer file"):
        PromptTokenizer(str(bad))


def test_tokenizer_through_envoy_sets_the_router_estimate(tmp_path: Path, make_stack: Any) -> None:
    from extproc.devstack import wait_until

    path = _word_tokenizer(tmp_path)
    s = make_stack(["--tokenizer", str(path)])
    s.pub.announce(s.ext, "tok-1", "m", s.endpoint("a"))
    import threading

    from extproc.devstack import http

    body = {"model": "m", "prompt": "hello world hello world hello world !"}  # 7 tokens
    t = threading.Thread(
        target=http,
        args=("POST", s.envoy.url + "/v1/completions", body, {"x-test-delay-ms": "800"}),
    )
    t.start()
    wait_until(
        lambda: (
            s.ext.workers()["tok-1"]["ranks"][0]["router_estimate"]["active_prefill_tokens"] == 7
        ),
        5,
        "exact count in the estimate",
    )
    t.join()
