"""llama.cpp's ``llama-server`` as an engine: ``/metrics`` and ``/slots`` into one snapshot.

llama-server prints no KV-cache gauge (``llamacpp:kv_cache_usage_ratio`` and
``llamacpp:kv_cache_tokens`` were removed upstream), so the load comes from two pages
read together, both free of I/O here so they are tested with recorded text:

- ``/metrics`` (only with ``--metrics``): ``llamacpp:requests_processing`` (slots
  busy) and ``llamacpp:requests_deferred`` (requests waiting for a free slot).
- ``/slots`` (on unless ``--no-slots``): per slot its context size ``n_ctx``,
  ``is_processing``, ``n_prompt_tokens`` (the tokens in the slot's context: from the
  moment a request takes the slot its whole prompt, then plus each token generated),
  ``n_prompt_tokens_processed`` and ``n_prompt_tokens_cache`` (the prompt evaluated for
  this request, set when its prefill ends, and the prompt reused from the slot's cache)
  and ``next_token[0].n_decoded`` (tokens generated). Checked on the real server: during
  a 4 s prefill of a 328-token prompt ``/slots`` answered in 1-2 ms with
  ``n_prompt_tokens`` 328 and the other three at 0.

One llama-server is one data-parallel rank. What each field of the
:class:`~llmworker.engine_metrics.RankStats` means for it:

- ``kv_total_tokens``: the sum of the slots' ``n_ctx`` (the whole ``-c`` context).
- ``kv_used_tokens``: the sum of ``n_prompt_tokens`` over the slots that are
  processing a request. An idle slot keeps its last context as a prompt cache that the
  next request may reuse or overwrite, so it holds nothing a request waits for.
- ``prefill_tokens``: prompt tokens not processed yet. Exact for a processing slot
  that has generated nothing yet: ``n_prompt_tokens - n_prompt_tokens_processed -
  n_prompt_tokens_cache``. Estimated for each deferred request, whose prompt
  llama-server has not tokenized yet: ``mean_prompt``, the mean prompt length of the
  processing slots (``n_prompt_tokens_processed + n_prompt_tokens_cache`` once decoding,
  ``n_prompt_tokens`` before). 0 when nothing waits or prefills; None (not reported)
  while requests are deferred and no slot is processing.
- ``num_running``: ``requests_processing``; ``num_waiting``: ``requests_deferred`` plus
  the processing slots that have generated nothing yet (requests before their first token).
- The queue and slots of the load event: ``requests_waiting`` is ``requests_deferred``
  (requests queued for a slot), ``slots_active`` the processing slots of ``/slots`` (a
  request in a slot runs, even before its first token), ``slots_total`` the number of slots
  (``--parallel``).
"""

from __future__ import annotations

import json
import math
import re
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from llmworker.engine_metrics import EngineSnapshot, MetricsParseError, RankStats, parse_text

SLOTS_PATH = "/slots"
# llama-server answers HTTP 501 for a page it was started without, e.g. "This server does
# not support metrics endpoint. Start it with `--metrics`".
_START_WITH = re.compile(r"Start it with `(--[a-z0-9-]+)`")
_FLAG_OF_PATH = {"/metrics": "--metrics", SLOTS_PATH: "--slots"}


def missing_flag(body: str, path: str) -> str:
    """The llama-server flag a 501 answer on ``path`` asks for."""
    found = _START_WITH.search(body)
    return found.group(1) if found else _FLAG_OF_PATH.get(path, "the flag that serves " + path)


@dataclass(frozen=True, slots=True)
class Slot:
    """One slot of ``/slots``, in the fields the load needs."""

    id: int
    n_ctx: int
    is_processing: bool
    n_tokens: int = 0  # ``n_prompt_tokens``: tokens in the slot's context
    n_prompt_done: int = 0  # ``n_prompt_tokens_processed + n_prompt_tokens_cache``
    n_decoded: int = 0  # ``next_token[0].n_decoded``

    @property
    def prefilling(self) -> bool:
        """Processing a request that has not produced a token yet."""
        return self.is_processing and self.n_decoded == 0

    @property
    def prompt_tokens(self) -> int:
        """The prompt length of the request in the slot."""
        return self.n_tokens if self.n_decoded == 0 else self.n_prompt_done

    @property
    def prefill_left(self) -> int:
        """Prompt tokens still to evaluate (0 once the request generates)."""
        return max(0, self.n_tokens - self.n_prompt_done) if self.prefilling else 0


def _int(where: str, obj: Mapping[str, Any], key: str, default: int | None = None) -> int:
    value = obj.get(key, default)
    if value is None:
        raise MetricsParseError(f"{where}: no {key!r}, expected an integer >= 0")
    if isinstance(value, bool) or not isinstance(value, int) or value < 0:
        raise MetricsParseError(f"{where}: {key} = {value!r}, expected an integer >= 0")
    return value


def parse_slots(text: str) -> tuple[Slot, ...]:
    """The slots of a ``/slots`` JSON page; MetricsParseError names what is wrong."""
    try:
        data = json.loads(text)
    except ValueError as exc:
        raise MetricsParseError(f"/slots: not JSON ({exc})") from None
    if not isinstance(data, list) or not data:
        raise MetricsParseError(
            f"/slots: expected a non-empty JSON array of slots, got {type(data).__name__}"
        )
    slots: list[Slot] = []
    for index, raw in enumerate(data):
        where = f"/slots[{index}]"
        if not isinstance(raw, dict):
            raise MetricsParseError(f"{where}: expected an object, got {type(raw).__name__}")
        processing = raw.get("is_processing")
        if not isinstance(processing, bool):
            raise MetricsParseError(f"{where}: is_processing = {processing!r}, expected a bool")
        next_token = raw.get("next_token") or [{}]
        if not isinstance(next_token, list) or not isinstance(next_token[0], dict):
            raise MetricsParseError(f"{where}: next_token = {next_token!r}, expected [{{...}}]")
        slots.append(
            Slot(
                id=_int(where, raw, "id"),
                n_ctx=_int(where, raw, "n_ctx"),
                is_processing=processing,
                n_tokens=_int(where, raw, "n_prompt_tokens", 0),
                n_prompt_done=_int(where, raw, "n_prompt_tokens_processed", 0)
                + _int(where, raw, "n_prompt_tokens_cache", 0),
                n_decoded=_int(f"{where}.next_token[0]", next_token[0], "n_decoded", 0),
            )
        )
    return tuple(slots)


def _gauge(samples: Mapping[str, list[Any]], name: str) -> int:
    values = samples.get(name)
    if not values or math.isnan(values[0].value):
        raise MetricsParseError(
            f"no {name} series: is this a llama-server /metrics page (--engine llamacpp)?"
        )
    value = values[0].value
    if value < 0 or math.isinf(value):
        raise MetricsParseError(f"{name} = {value!r}: expected a finite count >= 0")
    return round(value)


def mean_prompt(slots: tuple[Slot, ...]) -> float | None:
    """Mean prompt length of the requests in the processing slots; None if none."""
    known = [s.prompt_tokens for s in slots if s.is_processing and s.prompt_tokens > 0]
    return sum(known) / len(known) if known else None


def parse_llamacpp(metrics_text: str, slots_text: str) -> EngineSnapshot:
    """One rank from a llama-server's ``/metrics`` and ``/slots`` (see the module doc)."""
    samples = parse_text(metrics_text)
    processing = _gauge(samples, "llamacpp:requests_processing")
    deferred = _gauge(samples, "llamacpp:requests_deferred")
    slots = parse_slots(slots_text)
    busy = [s for s in slots if s.is_processing]
    mean = mean_prompt(slots)
    prefilling = [s for s in busy if s.prefilling]
    in_slots = sum(s.prefill_left for s in prefilling)
    prefill: int | None = in_slots
    if deferred:
        prefill = None if mean is None else round(in_slots + deferred * mean)
    return EngineSnapshot(
        engine="llamacpp",
        ranks=(
            RankStats(
                rank=0,
                num_running=processing,
                num_waiting=deferred + len(prefilling),
                kv_used_tokens=sum(s.n_tokens for s in busy),
                kv_total_tokens=sum(s.n_ctx for s in slots) or None,
                prefill_tokens=prefill,
                avg_prompt_tokens=mean,
                requests_waiting=deferred,
                slots_active=len(busy),
                slots_total=len(slots),
            ),
        ),
    )
