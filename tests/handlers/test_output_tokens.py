"""Counting generated tokens in response bytes (docs/routing.md: one per SSE event with text)."""

from __future__ import annotations

import json

from extproc.handlers.output_tokens import sse_tokens, usage_tokens


def event(obj: object, compact: bool = True) -> bytes:
    sep = (",", ":") if compact else (", ", ": ")
    return b"data: " + json.dumps(obj, separators=sep).encode() + b"\n\n"


def delta(content: str | None, role: str | None = None) -> dict[str, object]:
    d: dict[str, object] = {}
    if role:
        d["role"] = role
    if content is not None:
        d["content"] = content
    return {"object": "chat.completion.chunk", "choices": [{"index": 0, "delta": d}]}


def test_chat_stream_vllm_shape() -> None:
    chunk = (
        event(delta("", role="assistant"))  # role only: no token
        + event(delta("Hel"))
        + event(delta("lo"))
        + event(
            {"object": "chat.completion.chunk", "choices": [], "usage": {"completion_tokens": 2}}
        )  # usage only
        + b"data: [DONE]\n\n"
    )
    assert sse_tokens(chunk) == 2


def test_spaced_json_and_completions_text() -> None:
    text_event = {"choices": [{"index": 0, "text": "a"}]}
    empty_text = {"choices": [{"index": 0, "text": ""}]}
    assert sse_tokens(event(text_event, compact=False) * 3 + event(empty_text, False)) == 3
    assert sse_tokens(event(delta("", "assistant"), compact=False)) == 0


def test_no_events() -> None:
    assert sse_tokens(b"") == 0
    assert sse_tokens(b": keep-alive comment\n\n") == 0


def test_usage_of_non_streaming_reply() -> None:
    body = json.dumps({"usage": {"prompt_tokens": 5, "completion_tokens": 17}}).encode()
    assert usage_tokens(body) == 17
    assert usage_tokens(b'{"choices":[]}') is None
