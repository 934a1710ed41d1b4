"""``--profile llamacpp-cpu``: the simulated engine times requests as llama.cpp did on this CPU.

The engine core is driven with plain values and a modelled clock (the sum of its steps'
durations), so the timings are exact and nothing depends on the machine's load. The ranges
are those measured on the real engine (docs/engine-vs-sim.md, docs/worker.md).
"""

from __future__ import annotations

import itertools
from dataclasses import dataclass, field

import pytest

from llmworker.engine import EngineConfig, EngineCore
from llmworker.profiles import LLAMACPP_CPU, PROFILES, profile_config
from llmworker.sim_settings import parse_args

PROMPT = 155  # tokens of the comparison's prompt with SmolLM2's chat template
OUTPUT = 48


@dataclass
class Timed:
    """Modelled times of one request, in seconds from its arrival."""

    tokens: list[float] = field(default_factory=list)

    @property
    def ttft(self) -> float:
        return self.tokens[0]

    def gaps(self) -> list[float]:
        return [b - a for a, b in itertools.pairwise(self.tokens)]


def run(cfg: EngineConfig, n: int, prompt: int = PROMPT, output: int = OUTPUT) -> list[Timed]:
    """``n`` requests that arrive together, run to the end on one core."""
    core = EngineCore(cfg)
    seqs = [core.add(prompt, output) for _ in range(n)]
    timed = {s.seq_id: Timed() for s in seqs}
    now = 0.0
    for _ in range(10_000):
        if not core.has_work:
            break
        plan = core.schedule()
        assert plan.items, "the core stalled"
        assert plan.preempted == 0
        now += plan.duration_s
        for out in core.complete(plan):
            if out.new_token:
                timed[out.seq.seq_id].tokens.append(now)
    assert not core.has_work
    return [timed[s.seq_id] for s in seqs]


CPU = PROFILES[LLAMACPP_CPU]


def test_one_request_alone_as_on_the_engine() -> None:
    (alone,) = run(CPU, 1)
    assert 1.1 <= alone.ttft <= 1.4  # measured 1.1-1.4 s for this prompt
    assert all(0.013 <= g <= 0.020 for g in alone.gaps())  # measured 13-20 ms
    assert len(alone.tokens) == OUTPUT


def test_two_slots_prefill_in_one_batch_then_decode_at_half_speed() -> None:
    both = run(CPU, 2)
    alone = run(CPU, 1)[0]
    # Both prompts are evaluated in one batch: both wait for both, about twice as long.
    assert both[0].ttft == both[1].ttft == pytest.approx(2 * alone.ttft, rel=0.01)
    assert 2.0 <= both[0].ttft <= 3.0  # measured 2-3 s at 2 concurrent
    assert all(0.027 <= g <= 0.035 for t in both for g in t.gaps())  # measured 27-35 ms


def test_a_third_request_waits_for_a_slot() -> None:
    core = EngineCore(CPU)
    for _ in range(3):
        core.add(PROMPT, OUTPUT)
    plan = core.schedule()
    assert plan.prefill_tokens == 2 * PROMPT  # two slots
    assert (core.load().num_running, core.load().num_waiting) == (2, 1)
    first, _, third = run(CPU, 3)
    # The third starts once the first two have finished, and is then evaluated alone.
    assert third.ttft == pytest.approx(first.tokens[-1] + run(CPU, 1)[0].ttft, rel=1e-6)


def test_the_context_is_the_engines_1024_tokens() -> None:
    assert CPU.max_model_len == 1024 and not CPU.preemption
    with pytest.raises(ValueError, match="maximum context length is 1024"):
        EngineCore(CPU).check(1000, 48)


def test_the_default_simulator_is_left_as_it_was() -> None:
    settings, _ = parse_args([])
    assert settings.engine == EngineConfig()
    (fast,) = run(settings.engine, 1)
    assert fast.ttft < 0.05  # the default's prefill is cheap: the reason for the profile


def test_the_flag_sets_the_profile_and_engine_flags_win() -> None:
    settings, _ = parse_args(["--profile", LLAMACPP_CPU])
    assert settings.engine == CPU
    settings, _ = parse_args(
        ["--profile", LLAMACPP_CPU, "--max-num-seqs", "4", "--step-prefill-token-us", "4000"]
    )
    assert settings.engine == profile_config(
        LLAMACPP_CPU, max_num_seqs=4, step_prefill_token_s=0.004
    )
    assert settings.engine.step_decode_seq_s == CPU.step_decode_seq_s


def test_an_unknown_profile_is_refused_by_name(capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit) as exc:
        parse_args(["--profile", "vllm-h100"])
    assert exc.value.code == 2
    err = capsys.readouterr().err
    assert "--profile" in err and "vllm-h100" in err and LLAMACPP_CPU in err
    with pytest.raises(ValueError, match="'vllm-h100' is not a profile; expected one of"):
        profile_config("vllm-h100")
