"""The simulated engine: KV accounting, chunked prefill, waiting, preemption, DP ranks."""

from __future__ import annotations

import asyncio
import contextlib
import math

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from extproc.devstack import async_wait_until as wait_until
from llmworker.engine import (
    EngineConfig,
    EngineCore,
    EngineStopped,
    RankLoad,
    RequestTooLong,
    SeqState,
    Sequence,
    SimEngine,
)


def run_to_completion(core: EngineCore, max_steps: int = 10_000) -> int:
    steps = 0
    while core.has_work:
        core.complete(core.schedule())
        steps += 1
        assert steps < max_steps, "engine did not drain"
    return steps


def blocks(tokens: int, block_size: int) -> int:
    return math.ceil(tokens / block_size)


def test_running_sequence_holds_blocks_for_prompt_plus_generated() -> None:
    core = EngineCore(EngineConfig(kv_total_blocks=100, block_size=16))
    seq = core.add(prompt_tokens=20, max_tokens=5)
    assert core.load().active_prefill_tokens == 20
    assert core.used_blocks == 0
    generated = []
    while seq.state is not SeqState.FINISHED:
        core.complete(core.schedule())
        generated.append(seq.num_output)
        if seq.state is SeqState.RUNNING:
            assert seq.blocks == blocks(20 + seq.num_output, 16)
            assert core.used_blocks == seq.blocks
            assert core.load().active_prefill_tokens == 0  # first token out: prefill done
    assert generated == [1, 2, 3, 4, 5]  # the prefill step samples the first token
    assert core.used_blocks == 0
    assert core.load() == RankLoad(0, 0, 100, 0, 0)
    assert core.num_generated_tokens == 5


def test_chunked_prefill_respects_the_token_budget() -> None:
    core = EngineCore(EngineConfig(kv_total_blocks=100, block_size=16, max_num_batched_tokens=64))
    seq = core.add(prompt_tokens=150, max_tokens=2)
    chunks = []
    while seq.num_output == 0:
        plan = core.schedule()
        chunks.append(plan.prefill_tokens)
        assert core.load().active_prefill_tokens == 150  # counted until the first token
        core.complete(plan)
    assert chunks == [64, 64, 22]
    assert seq.blocks == blocks(151, 16)
    assert core.load().active_prefill_tokens == 0


def test_decodes_and_a_prefill_chunk_share_one_step_budget() -> None:
    core = EngineCore(EngineConfig(kv_total_blocks=100, block_size=16, max_num_batched_tokens=32))
    first = core.add(prompt_tokens=10, max_tokens=10)
    core.complete(core.schedule())  # first is now decoding
    second = core.add(prompt_tokens=100, max_tokens=1)
    plan = core.schedule()
    assert plan.decode_seqs == 1
    assert plan.prefill_tokens == 31  # 32 - 1 decode token
    assert [item.seq for item in plan.items] == [first, second]


def test_step_time_model_scales_with_work_and_speedup() -> None:
    cfg = EngineConfig(
        step_base_s=0.01, step_prefill_token_s=0.001, step_decode_seq_s=0.002, speedup=4
    )
    assert cfg.step_seconds(prefill_tokens=10, decode_seqs=3) == pytest.approx(
        (0.01 + 0.010 + 0.006) / 4
    )
    default = EngineConfig()
    assert 0.01 <= default.step_seconds(0, 1) <= 0.1  # tens of ms per decode step


def test_requests_wait_fifo_when_kv_blocks_run_out() -> None:
    core = EngineCore(EngineConfig(kv_total_blocks=4, block_size=16))
    a = core.add(prompt_tokens=40, max_tokens=2)  # 3 blocks with its first token
    b = core.add(prompt_tokens=40, max_tokens=2)
    c = core.add(prompt_tokens=1, max_tokens=1)  # would fit, but FIFO keeps it behind b
    core.complete(core.schedule())
    assert a.state is SeqState.RUNNING and a.blocks == 3
    assert [s.state for s in (b, c)] == [SeqState.WAITING, SeqState.WAITING]
    load = core.load()
    assert (load.num_running, load.num_waiting) == (1, 2)
    assert load.active_prefill_tokens == 41
    assert load.active_decode_blocks == 3
    run_to_completion(core)
    assert all(s.state is SeqState.FINISHED for s in (a, b, c))
    assert core.used_blocks == 0 and core.num_preemptions == 0


def test_requests_wait_when_sequence_slots_run_out() -> None:
    core = EngineCore(EngineConfig(kv_total_blocks=100, max_num_seqs=2))
    seqs = [core.add(prompt_tokens=8, max_tokens=3) for _ in range(3)]
    core.complete(core.schedule())
    assert [s.state for s in seqs] == [SeqState.RUNNING, SeqState.RUNNING, SeqState.WAITING]
    run_to_completion(core)
    assert all(s.num_output == 3 for s in seqs)


def test_kv_overflow_in_decode_preempts_the_youngest() -> None:
    # 4 blocks of 4 tokens; each sequence grows to ceil((3 + 8) / 4) = 3 blocks.
    core = EngineCore(EngineConfig(kv_total_blocks=4, block_size=4))
    old = core.add(prompt_tokens=3, max_tokens=8)
    young = core.add(prompt_tokens=3, max_tokens=8)
    preempted_first = None
    while core.has_work:
        before = core.num_preemptions
        core.complete(core.schedule())
        assert core.used_blocks <= 4
        if core.num_preemptions > before and preempted_first is None:
            preempted_first = old if old.state is SeqState.WAITING else young
    assert preempted_first is young
    assert core.num_preemptions >= 1
    assert old.num_output == young.num_output == 8
    assert core.used_blocks == 0 and core.load().active_prefill_tokens == 0


def test_without_preemption_kv_is_reserved_at_admission() -> None:
    core = EngineCore(EngineConfig(kv_total_blocks=4, block_size=4, preemption=False))
    a = core.add(prompt_tokens=3, max_tokens=8)
    b = core.add(prompt_tokens=3, max_tokens=8)
    core.complete(core.schedule())
    assert a.state is SeqState.RUNNING and b.state is SeqState.WAITING
    run_to_completion(core)
    assert core.num_preemptions == 0
    assert a.num_output == b.num_output == 8


def test_preempted_request_recomputes_prompt_and_output_as_prefill() -> None:
    core = EngineCore(EngineConfig(kv_total_blocks=4, block_size=4))
    core.add(prompt_tokens=3, max_tokens=8)
    young = core.add(prompt_tokens=3, max_tokens=8)
    while core.num_preemptions == 0:
        core.complete(core.schedule())
    assert young.state is SeqState.WAITING and young.num_output > 0
    assert young.blocks == 0 and young.num_computed == 0
    assert core.load().active_prefill_tokens == young.prompt_tokens + young.num_output


def test_abort_frees_blocks_and_queue_places() -> None:
    core = EngineCore(EngineConfig(kv_total_blocks=4, block_size=16))
    running = core.add(prompt_tokens=40, max_tokens=5)
    waiting = core.add(prompt_tokens=40, max_tokens=5)
    plan = core.schedule()
    assert core.used_blocks == 3
    assert core.abort(waiting) and core.abort(running)
    assert core.complete(plan) == []  # a step in flight skips aborted sequences
    assert core.load() == RankLoad(0, 0, 4, 0, 0)
    assert not core.abort(running)


def test_request_longer_than_the_kv_cache_is_refused() -> None:
    core = EngineCore(EngineConfig(kv_total_blocks=2, block_size=16))
    core.check(prompt_tokens=30, max_tokens=2)
    with pytest.raises(RequestTooLong, match="32 tokens"):
        core.add(prompt_tokens=30, max_tokens=3)
    with pytest.raises(ValueError):
        core.add(prompt_tokens=0, max_tokens=0, prefill_only=True)


def test_prefill_only_request_finishes_after_its_prompt() -> None:
    core = EngineCore(EngineConfig(max_num_batched_tokens=16))
    seq = core.add(prompt_tokens=40, max_tokens=0, prefill_only=True)
    steps = run_to_completion(core)
    assert steps == 3 and seq.num_output == 0 and seq.state is SeqState.FINISHED


@pytest.mark.parametrize("bad", [{"kv_total_blocks": 0}, {"block_size": -1}, {"speedup": 0}])
def test_engine_config_rejects_bad_values(bad: dict[str, float]) -> None:
    with pytest.raises(ValueError, match=next(iter(bad))):
        EngineConfig(**bad)  # type: ignore[arg-type]


def _check_invariants(core: EngineCore, seqs: list[Sequence]) -> None:
    cfg = core.config
    assert 0 <= core.used_blocks <= cfg.kv_total_blocks
    assert core.used_blocks == sum(s.blocks for s in core.running)
    assert len(core.running) <= cfg.max_num_seqs
    assert core.prefill_tokens == sum(s.prefill_target for s in seqs if s.alive and s.in_prefill)
    for s in core.running:
        assert s.blocks == blocks(s.num_computed, cfg.block_size)
    for s in core.waiting:
        assert s.blocks == 0


@settings(max_examples=60, deadline=None)
@given(
    kv_total_blocks=st.integers(2, 12),
    block_size=st.sampled_from([1, 4, 16]),
    max_num_seqs=st.integers(1, 4),
    budget=st.integers(1, 64),
    preemption=st.booleans(),
    ops=st.lists(
        st.tuples(st.sampled_from(["add", "step", "abort"]), st.integers(0, 40), st.integers(1, 9)),
        max_size=40,
    ),
)
def test_accounting_invariants_hold_for_any_workload(
    kv_total_blocks: int,
    block_size: int,
    max_num_seqs: int,
    budget: int,
    preemption: bool,
    ops: list[tuple[str, int, int]],
) -> None:
    core = EngineCore(
        EngineConfig(
            kv_total_blocks=kv_total_blocks,
            block_size=block_size,
            max_num_seqs=max_num_seqs,
            max_num_batched_tokens=budget,
            preemption=preemption,
        )
    )
    seqs: list[Sequence] = []
    for op, a, b in ops:
        if op == "add":
            with contextlib.suppress(RequestTooLong):
                seqs.append(core.add(prompt_tokens=a, max_tokens=b))
        elif op == "abort" and seqs:
            core.abort(seqs[a % len(seqs)])
        else:
            core.complete(core.schedule())
        _check_invariants(core, seqs)
    run_to_completion(core)
    _check_invariants(core, seqs)
    assert core.load() == RankLoad(0, 0, kv_total_blocks, 0, 0)
    for s in seqs:
        assert s.state in (SeqState.FINISHED, SeqState.ABORTED)
        if s.state is SeqState.FINISHED:
            assert s.num_output == s.max_tokens


FAST = EngineConfig(kv_total_blocks=64, block_size=16, speedup=200.0)


async def test_engine_loop_streams_every_token_and_reports_load() -> None:
    reports: list[tuple[int, RankLoad]] = []
    engine = SimEngine(FAST, on_load=lambda rank, load: reports.append((rank, load)))
    engine.start()
    try:
        stream = engine.submit(prompt_tokens=40, max_tokens=6)
        tokens = [i async for i in stream]
        assert tokens == list(range(6))
        assert stream.finished and stream.num_output == 6
        assert any(load.active_prefill_tokens == 40 for _, load in reports)
        assert any(load.active_decode_blocks == 3 for _, load in reports)
        assert reports[-1] == (0, RankLoad(0, 0, 64, 0, 0))
    finally:
        await engine.stop()


async def test_aborted_stream_frees_its_kv() -> None:
    engine = SimEngine(FAST)
    engine.start()
    try:
        stream = engine.submit(prompt_tokens=40, max_tokens=500)
        async for i in stream:
            if i == 2:
                break
        assert engine.loads()[0].active_decode_blocks > 0
        stream.abort()
        assert engine.loads()[0] == RankLoad(0, 0, 64, 0, 0)
    finally:
        await engine.stop()


async def test_stopping_the_engine_fails_open_streams() -> None:
    engine = SimEngine(FAST)
    engine.start()
    stream = engine.submit(prompt_tokens=4, max_tokens=900)
    await engine.stop()
    with pytest.raises(EngineStopped):
        await stream.wait()


async def test_dp_ranks_share_requests_by_least_load() -> None:
    reports: dict[int, RankLoad] = {}
    engine = SimEngine(FAST, dp_size=3, on_load=lambda r, load: reports.__setitem__(r, load))
    engine.start()
    try:
        streams = [engine.submit(prompt_tokens=100, max_tokens=20) for _ in range(6)]
        assert sorted(s.rank for s in streams) == [0, 0, 1, 1, 2, 2]
        assert [load.num_waiting for load in engine.loads()] == [2, 2, 2]
        await wait_until(lambda: set(reports) == {0, 1, 2}, what="a report from every rank")
        await asyncio.gather(*(s.wait() for s in streams))
        await wait_until(
            lambda: all(load == RankLoad(0, 0, 64, 0, 0) for load in reports.values()),
            what="every rank idle",
        )
    finally:
        await engine.stop()


async def test_busy_rank_is_not_picked() -> None:
    engine = SimEngine(FAST, dp_size=2)
    engine.start()
    try:
        long = engine.submit(prompt_tokens=200, max_tokens=800)
        await wait_until(lambda: long.num_output > 0, what="first token")
        assert engine.submit(prompt_tokens=1, max_tokens=1).rank == 1 - long.rank
        long.abort()
    finally:
        await engine.stop()
