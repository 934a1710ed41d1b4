"""Count generated tokens in response bytes without parsing JSON.

Streaming responses are Server-Sent Events: one generated token per event that
carries generated text (``data: {...}``), not counting ``data: [DONE]``, role-only
or empty-delta events and usage-only events. Non-streaming responses report
``usage.completion_tokens``. Both are byte searches, a few per chunk.
"""

from __future__ import annotations

import re

_COMPLETION_TOKENS = re.compile(rb'"completion_tokens"\s*:\s*(\d+)')
_EMPTY = (
    b'"content":""',
    b'"content": ""',
    b'"text":""',
    b'"text": ""',
    b'"choices":[]',
    b'"choices": []',
)


def sse_tokens(chunk: bytes) -> int:
    """Generated tokens in a chunk of an SSE stream (events may span chunks)."""
    events = chunk.count(b"data:")
    if not events:
        return 0
    empty = chunk.count(b"[DONE]")
    for marker in _EMPTY:
        if marker in chunk:
            empty += chunk.count(marker)
    return max(0, events - empty)


def usage_tokens(body: bytes) -> int | None:
    """``usage.completion_tokens`` of a non-streaming response, if present."""
    m = _COMPLETION_TOKENS.search(body)
    return int(m.group(1)) if m else None
