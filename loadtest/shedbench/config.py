"""What shapes a benchmark run: the workers, the requests, the phases."""

from __future__ import annotations

from dataclasses import dataclass

MODEL = "overload-model"
SIM = "sim"
LLAMACPP = "llamacpp"
ENGINES = (SIM, LLAMACPP)


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
    engine: str = SIM  # SIM: the simulated engine; LLAMACPP: llama.cpp's llama-server
    prefill_threshold: int | None = None  # active_prefill_tokens_threshold "on", in tokens
    ignore_eos: bool = False  # ask the engine for exactly max_tokens (a real model may stop)
    unloaded_probes: int = 201  # requests one at a time for the unloaded reference

    @property
    def name(self) -> str:
        """Prefix of the files a run writes: ``overload`` or ``overload-<engine>``."""
        return "overload" if self.engine == SIM else f"overload-{self.engine}"
