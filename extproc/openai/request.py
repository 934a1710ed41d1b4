"""What the router reads from an OpenAI request body: model, stream, prompt size.

Prompt tokens are estimated, unless a local ``tokenizer.json`` is configured
(``--tokenizer``, counted exactly with the ``tokenizers`` library), as
``ceil(n / 4)`` where ``n`` is the UTF-8 byte length of the prompt text: the
concatenated ``content`` strings (and text parts) of ``messages`` for chat,
``prompt`` for completions, ``input`` for embeddings and responses. A list of
token ids counts its length. The simulated worker counts the same way, so router
estimates and worker reports agree.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import msgspec

# Path -> metric label of dynamo_frontend_model_rejection_total{endpoint}.
INFERENCE_PATHS: dict[str, str] = {
    "/v1/chat/completions": "chat_completions",
    "/v1/completions": "completions",
    "/v1/embeddings": "embeddings",
    "/v1/responses": "responses",
}


class BadRequest(ValueError):
    """The body cannot be routed; the message is sent to the client in a 400."""


class _Body(msgspec.Struct):
    model: Any = msgspec.UNSET
    stream: Any = None
    messages: Any = None
    prompt: Any = None
    input: Any = None


_decoder = msgspec.json.Decoder(_Body)


@dataclass(slots=True)
class InferenceRequest:
    model: str
    stream: bool
    prompt_tokens: int


def _utf8_len(text: str) -> int:
    return len(text) if text.isascii() else len(text.encode("utf-8", "surrogatepass"))


def _prompt_size(value: Any) -> tuple[int, int]:
    """(UTF-8 bytes of text, count of token ids) found in a prompt-like value."""
    if isinstance(value, str):
        return _utf8_len(value), 0
    if isinstance(value, list):
        nbytes = ids = 0
        for item in value:
            if isinstance(item, int) and not isinstance(item, bool):
                ids += 1
            else:
                b, i = _prompt_size(item)
                nbytes += b
                ids += i
        return nbytes, ids
    if isinstance(value, dict):
        # A chat message ({"content": ...}) or a content part ({"type": "text", "text": ...}).
        content = value.get("content")
        if content is not None:
            return _prompt_size(content)
        text = value.get("text")
        if isinstance(text, str):
            return _utf8_len(text), 0
    return 0, 0


def estimate_tokens(value: Any) -> int:
    """Estimated prompt tokens of a ``messages`` / ``prompt`` / ``input`` value."""
    nbytes, ids = _prompt_size(value)
    return -(-nbytes // 4) + ids


def _prompt_texts(value: Any, texts: list[str]) -> int:
    """Collect the prompt text pieces (same walk as the estimate); return token-id count."""
    if isinstance(value, str):
        texts.append(value)
        return 0
    if isinstance(value, list):
        ids = 0
        for item in value:
            if isinstance(item, int) and not isinstance(item, bool):
                ids += 1
            else:
                ids += _prompt_texts(item, texts)
        return ids
    if isinstance(value, dict):
        content = value.get("content")
        if content is not None:
            return _prompt_texts(content, texts)
        text = value.get("text")
        if isinstance(text, str):
            texts.append(text)
    return 0


class PromptTokenizer:
    """Exact prompt counts from a local ``tokenizer.json`` (never fetched from a hub)."""

    def __init__(self, path: str) -> None:
        try:
            from tokenizers import Tokenizer
        except ImportError:
            raise ValueError(
                "--tokenizer needs the 'tokenizers' package: "
                "pip install 'envoy-llm-shedder[tokenizer]'"
            ) from None
        try:
            self._tokenizer = Tokenizer.from_file(path)
        except Exception as exc:
            raise ValueError(f"cannot load tokenizer file {path!r}: {exc}") from None
        self.path = path

    def count(self, value: Any) -> int:
        texts: list[str] = []
        ids = _prompt_texts(value, texts)
        if not texts:
            return ids
        text = "".join(texts)
        return ids + len(self._tokenizer.encode(text, add_special_tokens=False).ids)


def parse_body(body: bytes, tokenizer: PromptTokenizer | None = None) -> InferenceRequest:
    """Read an inference request body; raise BadRequest naming what is wrong."""
    try:
        parsed = _decoder.decode(body)
    except msgspec.ValidationError:
        raise BadRequest("Request body must be a JSON object") from None
    except msgspec.DecodeError as exc:
        raise BadRequest(f"Request body is not valid JSON: {exc}") from None
    model = parsed.model
    if model is msgspec.UNSET or model is None:
        raise BadRequest("Request body has no 'model' field")
    if not isinstance(model, str):
        raise BadRequest(f"'model' must be a string, got {type(model).__name__}")
    if parsed.messages is not None:
        prompt = parsed.messages
    elif parsed.prompt is not None:
        prompt = parsed.prompt
    else:
        prompt = parsed.input
    tokens = estimate_tokens(prompt) if tokenizer is None else tokenizer.count(prompt)
    return InferenceRequest(model=model, stream=parsed.stream is True, prompt_tokens=tokens)
