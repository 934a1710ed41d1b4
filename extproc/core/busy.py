"""The busy rule (docs/routing.md): is a rank, a worker, busy under a model's thresholds?

Pure functions on plain values; no I/O, no clock. Every comparison is strict
(``>``). Products of a threshold and a capacity are computed exactly from the
threshold's decimal value (0.29 x 100 is 29, not 28.999...), then floored:
for whole-number loads ``load > x`` is the same as ``load > floor(x)``.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from fractions import Fraction

DECODE = "active_decode_blocks_threshold"
PREFILL = "active_prefill_tokens_threshold"
PREFILL_FRAC = "active_prefill_tokens_threshold_frac"
THRESHOLD_NAMES = (DECODE, PREFILL, PREFILL_FRAC)
# Latency targets (docs/latency-target.md): with a TTFT target set, requests are admitted by
# their deadline and the thresholds, where configured, stay ceilings.
TTFT_TARGET = "ttft_p99_target_ms"
ITL_TARGET = "itl_p99_target_ms"
TARGET_NAMES = (TTFT_TARGET, ITL_TARGET)
MAX_TARGET_MS = 600_000
# The token threshold is an unsigned 64-bit integer, as in Dynamo.
MAX_TOKEN_THRESHOLD = 2**64 - 1


@dataclass(frozen=True, slots=True)
class BusyThresholds:
    """One model's thresholds; ``None`` = that check is off. The latency targets (ms,
    ``None`` = none) ride along: they are set, shared and saved with the thresholds."""

    active_decode_blocks: float | None = None
    active_prefill_tokens: int | None = None
    active_prefill_tokens_frac: float | None = None
    ttft_p99_target_ms: float | None = None
    itl_p99_target_ms: float | None = None

    def as_dict(self) -> dict[str, float | int | None]:
        """The three thresholds (nulls included), then each latency target only while set."""
        out: dict[str, float | int | None] = {
            DECODE: self.active_decode_blocks,
            PREFILL: self.active_prefill_tokens,
            PREFILL_FRAC: self.active_prefill_tokens_frac,
        }
        if self.ttft_p99_target_ms is not None:
            out[TTFT_TARGET] = self.ttft_p99_target_ms
        if self.itl_p99_target_ms is not None:
            out[ITL_TARGET] = self.itl_p99_target_ms
        return out


@dataclass(frozen=True, slots=True)
class Share:
    """How much of each threshold a request class may use; 1 = the configured limit.

    A share below 1 makes a rank busy earlier for that class (sheddable traffic), above 1
    later. Limits are ``floor(threshold x share x capacity)``, exact in decimal."""

    active_decode_blocks: float = 1.0
    active_prefill_tokens: float = 1.0
    active_prefill_tokens_frac: float = 1.0


FULL_SHARE = Share()


def scaled_limit(threshold: float, capacity: int, share: float = 1.0) -> int:
    """``floor(threshold x capacity x share)``, exact for the shortest decimal forms."""
    exact = Fraction(repr(threshold)) * capacity
    if share != 1.0:
        exact *= Fraction(repr(share))
    return math.floor(exact)


@dataclass(frozen=True, slots=True)
class RankLimits:
    """A rank's thresholds turned into whole-number limits; ``None`` = cannot fire."""

    decode_blocks: int | None
    prefill_tokens: int | None
    prefill_tokens_frac: int | None


def rank_limits(
    th: BusyThresholds,
    *,
    kv_mode: bool,
    kv_total_blocks: int | None,
    max_num_batched_tokens: int | None,
    share: Share = FULL_SHARE,
) -> RankLimits:
    """Precompute the limits for one rank and request class; recomputed only when an input
    changes. With the full share these are the configured limits."""
    decode = None
    if kv_mode and th.active_decode_blocks is not None and kv_total_blocks:
        decode = scaled_limit(th.active_decode_blocks, kv_total_blocks, share.active_decode_blocks)
    prefill = th.active_prefill_tokens
    if prefill is not None and share.active_prefill_tokens != 1.0:
        prefill = scaled_limit(share.active_prefill_tokens, prefill)
    frac = None
    if th.active_prefill_tokens_frac is not None and max_num_batched_tokens:
        frac = scaled_limit(
            th.active_prefill_tokens_frac, max_num_batched_tokens, share.active_prefill_tokens_frac
        )
    return RankLimits(decode, prefill, frac)


def class_limits(
    th: BusyThresholds,
    shares: list[Share],
    *,
    kv_mode: bool,
    kv_total_blocks: int | None,
    max_num_batched_tokens: int | None,
) -> list[RankLimits]:
    """One rank's limits for each request class's share, the default class first."""
    return [
        rank_limits(
            th,
            kv_mode=kv_mode,
            kv_total_blocks=kv_total_blocks,
            max_num_batched_tokens=max_num_batched_tokens,
            share=share,
        )
        for share in shares
    ]


def rank_busy_reason(
    limits: RankLimits, decode_blocks: int | None, prefill_tokens: int | None
) -> str | None:
    """The first check that fires for this rank's effective load, or None (free)."""
    if (
        limits.decode_blocks is not None
        and decode_blocks is not None
        and decode_blocks > limits.decode_blocks
    ):
        return DECODE
    if prefill_tokens is not None:
        if limits.prefill_tokens is not None and prefill_tokens > limits.prefill_tokens:
            return PREFILL
        if limits.prefill_tokens_frac is not None and prefill_tokens > limits.prefill_tokens_frac:
            return PREFILL_FRAC
    return None


def worker_busy(rank_reasons: list[str | None]) -> bool:
    """Busy only if every rank that has load data is busy; no data at all = free."""
    return bool(rank_reasons) and None not in rank_reasons
