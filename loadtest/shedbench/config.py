"""What shapes a benchmark run: the workers, the requests, the phases."""

from __future__ import annotations

from dataclasses import dataclass

MODEL = "overload-model"


@dataclass(frozen=True)
class Config:
    """Everything that shapes a run; printed with the results."""

    kv_total_blocks: int
    block_size: int
    max_num_seqs: int
    max_num_batched_tokens: int
    speedup: float
    prompt_tokens: int
    max_tokens: int
    decode_threshold: float | None
    prefill_frac_threshold: float | None
    loads: tuple[float, ...]
    cell_seconds: float
    warmup: float
    grace: float
    sweep_seconds: float
    seed: int
    capacity: float | None = None
    track_output_blocks: bool = False
