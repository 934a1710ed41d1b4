"""Named engine profiles for the simulated worker: ``python -m llmworker.sim --profile NAME``.

A profile sets the simulated engine's size and step costs to those of a real engine as
measured; any engine flag given beside it wins over the profile. Without ``--profile`` the
simulator keeps its own defaults (:class:`~llmworker.engine.EngineConfig`).

``llamacpp-cpu``: llama.cpp's ``llama-server`` serving SmolLM2-135M-Instruct (Q4_1) on one
CPU thread of a 2-core machine, 2 slots over 1024 tokens of context, as measured by
``python -m loadtest.engine_vs_sim`` (docs/engine-vs-sim.md). Measured: a prompt of about 155
tokens is evaluated in 1.1-1.4 s (7-9 ms per prompt token, 1.1-1.6 s for 135-223 tokens from
the server's own timings); one slot decoding alone emits a token every 13-20 ms, two slots
decoding together every 27-35 ms, so a step costs little besides its tokens; two prompts that
arrive together are evaluated in one batch (TTFT about twice as long for both); a third
request waits for a slot; a request never loses its slot (no preemption).
"""

from __future__ import annotations

from dataclasses import replace
from typing import Any, Final

from llmworker.engine import EngineConfig

LLAMACPP_CPU: Final = "llamacpp-cpu"

PROFILES: Final[dict[str, EngineConfig]] = {
    LLAMACPP_CPU: EngineConfig(
        kv_total_blocks=64,  # --ctx-size 1024 in blocks of 16 tokens
        block_size=16,
        max_num_seqs=2,  # --parallel 2: two slots
        max_num_batched_tokens=2048,  # llama-server's default --batch-size
        step_base_s=0.001,  # decode alone 16 ms, two slots 31 ms: the rest is per sequence
        step_prefill_token_s=0.008,  # 8 ms per prompt token (7-9 ms measured)
        step_decode_seq_s=0.015,  # 15 ms per decoding slot
        preemption=False,  # a slot keeps its request; admission waits for room instead
    ),
}


def profile_config(name: str, **given: Any) -> EngineConfig:
    """The profile ``name`` with the engine settings ``given`` (EngineConfig fields) on top."""
    try:
        base = PROFILES[name]
    except KeyError:
        raise ValueError(
            f"--profile {name!r} is not a profile; expected one of {', '.join(PROFILES)}"
        ) from None
    return replace(base, **given)
