"""A simulated continuous-batching LLM engine (vLLM-like), for tests and local runs.

Three layers, from the inside out:

- :class:`EngineCore` is the I/O-free scheduler of one data-parallel rank: a KV
  cache of ``kv_total_blocks`` blocks of ``block_size`` tokens, at most
  ``max_num_seqs`` running sequences, chunked prefill limited to
  ``max_num_batched_tokens`` per step, FIFO waiting, and recompute-style
  preemption of the youngest running sequence when decode runs out of blocks.
  ``schedule()`` plans a step and ``complete(plan)`` applies it; tests drive it
  with plain values.
- :class:`EngineLoop` runs one core on the event loop, sleeping each step's
  modelled duration (base + per prefill token + per decoding sequence, all
  divided by ``speedup``, times the runtime ``slowdown``) and handing tokens to
  :class:`RequestStream` readers.
- :class:`SimEngine` puts ``dp_size`` loops behind one endpoint and sends each
  new request to the least-loaded rank.

A running sequence holds ``ceil((prompt + generated) / block_size)`` blocks. The
step that finishes a prompt's prefill also samples its first token. ``reserved_blocks``
of the cache hold no tokens (vLLM keeps one block aside, its null block): the usage a rank
reports is of the other blocks, as vLLM's ``kv_cache_usage_perc`` is.
"""

from __future__ import annotations

import asyncio
import contextlib
import math
from collections import deque
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass, field
from enum import Enum


class RequestTooLong(ValueError):
    """Prompt plus output does not fit the KV cache of one rank (vLLM's max_model_len)."""


class EngineStopped(RuntimeError):
    """The engine stopped before the request finished."""


@dataclass(frozen=True, slots=True)
class EngineConfig:
    """Size and speed of one simulated rank; times are seconds at ``speedup`` 1."""

    kv_total_blocks: int = 2048
    block_size: int = 16
    max_num_seqs: int = 256
    max_num_batched_tokens: int = 2048
    step_base_s: float = 0.020
    step_prefill_token_s: float = 0.00002
    step_decode_seq_s: float = 0.0002
    speedup: float = 1.0
    preemption: bool = True
    reserved_blocks: int = 0  # blocks that hold no tokens (vLLM: 1, its null block)
    # Tokens the served model's chat template adds to a chat request's prompt (its system
    # prompt and role markers), which the router's estimate does not count: 0 counts a
    # prompt exactly as the router estimates it.
    chat_template_tokens: int = 0

    def __post_init__(self) -> None:
        for name in ("kv_total_blocks", "block_size", "max_num_seqs", "max_num_batched_tokens"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise ValueError(f"{name} must be an integer >= 1, got {value!r}")
        for name in ("step_base_s", "step_prefill_token_s", "step_decode_seq_s"):
            value = getattr(self, name)
            if not math.isfinite(value) or value < 0:
                raise ValueError(f"{name} must be a finite number >= 0, got {value!r}")
        if not math.isfinite(self.speedup) or self.speedup <= 0:
            raise ValueError(f"speedup must be a finite number > 0, got {self.speedup!r}")
        template = self.chat_template_tokens
        if isinstance(template, bool) or not isinstance(template, int) or template < 0:
            raise ValueError(f"chat_template_tokens must be an integer >= 0, got {template!r}")
        reserved = self.reserved_blocks
        if isinstance(reserved, bool) or not isinstance(reserved, int) or reserved < 0:
            raise ValueError(f"reserved_blocks must be an integer >= 0, got {reserved!r}")
        if reserved >= self.kv_total_blocks:
            raise ValueError(
                f"reserved_blocks {reserved} leaves none of kv_total_blocks "
                f"{self.kv_total_blocks} for tokens; expected fewer than kv_total_blocks"
            )

    @property
    def usable_blocks(self) -> int:
        """Blocks that hold tokens: the cache less the reserved ones."""
        return self.kv_total_blocks - self.reserved_blocks

    @property
    def max_model_len(self) -> int:
        """Most tokens (prompt + output) one sequence can hold."""
        return self.usable_blocks * self.block_size

    def step_seconds(self, prefill_tokens: int, decode_seqs: int) -> float:
        """Modelled wall time of one step."""
        cost = (
            self.step_base_s
            + prefill_tokens * self.step_prefill_token_s
            + decode_seqs * self.step_decode_seq_s
        )
        return cost / self.speedup


class SeqState(Enum):
    WAITING = "waiting"
    RUNNING = "running"
    FINISHED = "finished"
    ABORTED = "aborted"


@dataclass(eq=False, slots=True)
class Sequence:
    """One request inside a core. ``num_computed`` tokens have their KV in cache."""

    seq_id: int
    prompt_tokens: int
    max_tokens: int
    prefill_only: bool
    state: SeqState = SeqState.WAITING
    num_computed: int = 0
    num_output: int = 0
    blocks: int = 0
    counted_prefill: int = 0  # what this sequence adds to the core's prefill total

    @property
    def prefill_target(self) -> int:
        """Tokens to (re)compute before the next token: prompt plus any earlier output."""
        return self.prompt_tokens + self.num_output

    @property
    def in_prefill(self) -> bool:
        return self.num_computed < self.prefill_target

    @property
    def alive(self) -> bool:
        return self.state is SeqState.WAITING or self.state is SeqState.RUNNING


@dataclass(slots=True)
class ScheduledSeq:
    seq: Sequence
    num_tokens: int  # tokens computed this step (a prefill chunk, or 1 to decode)
    samples: bool  # this step yields a new output token
    tokens_after: int  # tokens in KV once the step is done


@dataclass(slots=True)
class StepPlan:
    items: list[ScheduledSeq] = field(default_factory=list)
    prefill_tokens: int = 0
    decode_seqs: int = 0
    preempted: int = 0
    duration_s: float = 0.0


@dataclass(frozen=True, slots=True)
class StepOutput:
    seq: Sequence
    new_token: bool
    finished: bool


@dataclass(frozen=True, slots=True)
class RankLoad:
    """What a rank reports: the ``load`` event values plus queue sizes."""

    active_decode_blocks: int
    active_prefill_tokens: int
    kv_total_blocks: int
    num_running: int
    num_waiting: int
    reserved_blocks: int = 0

    @property
    def kv_usage(self) -> float:
        """Fraction 0-1 of the blocks that hold tokens in use (vLLM's
        ``kv_cache_usage_perc``: of ``num_gpu_blocks - 1``)."""
        return self.active_decode_blocks / (self.kv_total_blocks - self.reserved_blocks)


class EngineCore:
    """Scheduler and KV accounting of one rank, with no I/O and no clock."""

    def __init__(self, config: EngineConfig) -> None:
        self.config = config
        self.running: list[Sequence] = []  # admission order: the last is the youngest
        self.waiting: deque[Sequence] = deque()
        self.used_blocks = 0
        self.prefill_tokens = 0
        self.num_preemptions = 0
        self.num_prompt_tokens = 0  # prompt tokens of every request added
        self.num_generated_tokens = 0
        self._next_id = 0

    @property
    def free_blocks(self) -> int:
        return self.config.usable_blocks - self.used_blocks

    @property
    def has_work(self) -> bool:
        return bool(self.running or self.waiting)

    def load(self) -> RankLoad:
        return RankLoad(
            active_decode_blocks=self.used_blocks,
            active_prefill_tokens=self.prefill_tokens,
            kv_total_blocks=self.config.kv_total_blocks,
            num_running=len(self.running),
            num_waiting=len(self.waiting),
            reserved_blocks=self.config.reserved_blocks,
        )

    def check(self, prompt_tokens: int, max_tokens: int, prefill_only: bool = False) -> None:
        """Raise ValueError / RequestTooLong if such a request can never run."""
        if prompt_tokens < 0 or max_tokens < 0:
            raise ValueError("token counts must be >= 0")
        if prefill_only and prompt_tokens < 1:
            raise ValueError("a prefill-only request needs at least one prompt token")
        if not prefill_only and max_tokens < 1:
            raise ValueError("max_tokens must be >= 1")
        total = prompt_tokens + (0 if prefill_only else max_tokens)
        if total > self.config.max_model_len:
            raise RequestTooLong(
                f"this model's maximum context length is {self.config.max_model_len} tokens; "
                f"the request needs {prompt_tokens} prompt tokens"
                + ("" if prefill_only else f" + {max_tokens} output tokens")
            )

    def add(self, prompt_tokens: int, max_tokens: int, prefill_only: bool = False) -> Sequence:
        """Queue a request at the back of the waiting line."""
        self.check(prompt_tokens, max_tokens, prefill_only)
        self._next_id += 1
        seq = Sequence(
            seq_id=self._next_id,
            prompt_tokens=prompt_tokens,
            max_tokens=0 if prefill_only else max_tokens,
            prefill_only=prefill_only,
        )
        self.waiting.append(seq)
        self.num_prompt_tokens += prompt_tokens
        self._recount(seq)
        return seq

    def abort(self, seq: Sequence) -> bool:
        """Drop a request wherever it is, freeing its blocks; False if already done."""
        if seq.state is SeqState.RUNNING:
            self.running.remove(seq)
        elif seq.state is SeqState.WAITING:
            self.waiting.remove(seq)
        else:
            return False
        self._free(seq)
        seq.state = SeqState.ABORTED
        self._recount(seq)
        return True

    def schedule(self) -> StepPlan:
        """Plan one step: running sequences first (oldest first), then waiting, FIFO."""
        cfg = self.config
        plan = StepPlan()
        budget = cfg.max_num_batched_tokens
        i = 0
        while i < len(self.running) and budget > 0:
            seq = self.running[i]
            num_tokens, samples, after = self._next_chunk(seq, budget)
            needed = self._blocks_for(after) - seq.blocks
            while needed > self.free_blocks and cfg.preemption:
                victim = self.running[-1]
                self._preempt(victim)
                plan.preempted += 1
                if victim is seq:
                    break
            if seq.state is not SeqState.RUNNING:
                break  # it preempted itself: everything younger is gone too
            if needed > self.free_blocks:
                i += 1  # without preemption (unreachable with reservations): stall
                continue
            self._allocate(seq, needed)
            self._plan(plan, ScheduledSeq(seq, num_tokens, samples, after))
            budget -= num_tokens
            i += 1
        # Like vLLM, nothing new is admitted in a step that had to preempt.
        while self.waiting and budget > 0 and not plan.preempted:
            if len(self.running) >= cfg.max_num_seqs:
                break
            seq = self.waiting[0]
            num_tokens, samples, after = self._next_chunk(seq, budget)
            needed = self._blocks_for(after)
            if not cfg.preemption:
                reserve = self._reserved_growth()
                if self._blocks_for(seq.prompt_tokens + seq.max_tokens) > (
                    self.free_blocks - reserve
                ):
                    break
            if needed > self.free_blocks:
                break  # FIFO: the head waits, and so does everyone behind it
            self.waiting.popleft()
            seq.state = SeqState.RUNNING
            self.running.append(seq)
            self._allocate(seq, needed)
            self._plan(plan, ScheduledSeq(seq, num_tokens, samples, after))
            budget -= num_tokens
        plan.duration_s = cfg.step_seconds(plan.prefill_tokens, plan.decode_seqs)
        return plan

    def complete(self, plan: StepPlan) -> list[StepOutput]:
        """Apply a planned step; sequences aborted meanwhile are skipped."""
        outputs: list[StepOutput] = []
        for item in plan.items:
            seq = item.seq
            if seq.state is not SeqState.RUNNING:
                continue
            seq.num_computed = item.tokens_after
            if item.samples:
                seq.num_output += 1
                self.num_generated_tokens += 1
            finished = not seq.in_prefill if seq.prefill_only else seq.num_output >= seq.max_tokens
            if finished:
                self.running.remove(seq)
                self._free(seq)
                seq.state = SeqState.FINISHED
            self._recount(seq)
            if item.samples or finished:
                outputs.append(StepOutput(seq, item.samples, finished))
        return outputs

    def _next_chunk(self, seq: Sequence, budget: int) -> tuple[int, bool, int]:
        """(tokens to compute, samples a token, tokens in KV afterwards)."""
        if seq.in_prefill:
            chunk = min(seq.prefill_target - seq.num_computed, budget)
            completes = seq.num_computed + chunk == seq.prefill_target
            samples = completes and not seq.prefill_only
            return chunk, samples, seq.num_computed + chunk + (1 if samples else 0)
        return 1, True, seq.num_computed + 1

    def _plan(self, plan: StepPlan, item: ScheduledSeq) -> None:
        plan.items.append(item)
        if item.seq.in_prefill:
            plan.prefill_tokens += item.num_tokens
        else:
            plan.decode_seqs += 1

    def _blocks_for(self, tokens: int) -> int:
        return -(-tokens // self.config.block_size)

    def _reserved_growth(self) -> int:
        """Blocks running sequences will still need to finish (no-preemption mode)."""
        return sum(
            self._blocks_for(s.prompt_tokens + s.max_tokens) - s.blocks for s in self.running
        )

    def _allocate(self, seq: Sequence, blocks: int) -> None:
        if blocks > 0:
            seq.blocks += blocks
            self.used_blocks += blocks

    def _free(self, seq: Sequence) -> None:
        self.used_blocks -= seq.blocks
        seq.blocks = 0

    def _preempt(self, seq: Sequence) -> None:
        """Recompute-style: drop its KV and put it at the head of the waiting line."""
        self.running.remove(seq)
        self._free(seq)
        seq.num_computed = 0
        seq.state = SeqState.WAITING
        self.waiting.appendleft(seq)
        self.num_preemptions += 1
        self._recount(seq)

    def _recount(self, seq: Sequence) -> None:
        counted = seq.prefill_target if seq.alive and seq.in_prefill else 0
        self.prefill_tokens += counted - seq.counted_prefill
        seq.counted_prefill = counted


class RequestStream:
    """The output of one request: ``async for`` yields each new token's index."""

    __slots__ = ("_engine", "_error", "_finished", "_seen", "_waiter", "rank", "seq")

    def __init__(self, engine: EngineLoop, seq: Sequence, rank: int) -> None:
        self._engine = engine
        self.seq = seq
        self.rank = rank
        self._seen = 0
        self._finished = False
        self._error: BaseException | None = None
        self._waiter: asyncio.Future[None] | None = None

    @property
    def prompt_tokens(self) -> int:
        return self.seq.prompt_tokens

    @property
    def num_output(self) -> int:
        """Tokens generated so far."""
        return self.seq.num_output

    @property
    def finished(self) -> bool:
        return self._finished

    def abort(self) -> None:
        """Stop generating and free the KV blocks and slot (idempotent)."""
        if not self._finished:
            self._engine.abort(self)

    async def wait(self) -> None:
        """Wait until the request has finished."""
        async for _ in self:
            pass

    async def __aiter__(self) -> AsyncIterator[int]:
        while True:
            while self._seen < self.seq.num_output:
                self._seen += 1
                yield self._seen - 1
            if self._finished:
                return
            if self._error is not None:
                raise self._error
            self._waiter = asyncio.get_running_loop().create_future()
            try:
                await self._waiter
            finally:
                self._waiter = None

    def _wake(self, *, finished: bool = False, error: BaseException | None = None) -> None:
        self._finished = self._finished or finished
        if error is not None:
            self._error = error
        if self._waiter is not None and not self._waiter.done():
            self._waiter.set_result(None)


LoadCallback = Callable[[int, RankLoad], None]


class EngineLoop:
    """Runs one :class:`EngineCore` on the event loop, one modelled step at a time."""

    # Behind schedule by more than this (a busy CPU), the modelled clock resets.
    MAX_LAG_S = 0.05

    def __init__(
        self, config: EngineConfig, rank: int = 0, on_load: LoadCallback | None = None
    ) -> None:
        self.core = EngineCore(config)
        self.rank = rank
        self._on_load = on_load
        self._streams: dict[int, RequestStream] = {}
        self._wake = asyncio.Event()
        self._task: asyncio.Task[None] | None = None
        self._last_load: RankLoad | None = None
        self.slowdown = 1.0  # every step takes this many times its modelled duration

    @property
    def config(self) -> EngineConfig:
        return self.core.config

    def load(self) -> RankLoad:
        return self.core.load()

    def start(self) -> None:
        if self._task is None:
            self._task = asyncio.get_running_loop().create_task(
                self._run(), name=f"engine-rank-{self.rank}"
            )
            self._report()

    async def stop(self) -> None:
        """Stop stepping; unfinished requests fail with EngineStopped."""
        task, self._task = self._task, None
        if task is not None:
            task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await task
        for stream in list(self._streams.values()):
            self.core.abort(stream.seq)
            stream._wake(error=EngineStopped("engine stopped"))
        self._streams.clear()

    def submit(
        self, prompt_tokens: int, max_tokens: int, prefill_only: bool = False
    ) -> RequestStream:
        seq = self.core.add(prompt_tokens, max_tokens, prefill_only)
        stream = RequestStream(self, seq, self.rank)
        self._streams[seq.seq_id] = stream
        self._wake.set()
        self._report()
        return stream

    def abort(self, stream: RequestStream) -> None:
        if self.core.abort(stream.seq):
            self._streams.pop(stream.seq.seq_id, None)
            stream._wake(finished=True)
            self._wake.set()  # freed blocks may let a waiting request run
            self._report()

    def _report(self) -> None:
        if self._on_load is None:
            return
        load = self.core.load()
        if load != self._last_load:
            self._last_load = load
            self._on_load(self.rank, load)

    async def _run(self) -> None:
        loop = asyncio.get_running_loop()
        clock = loop.time()
        core = self.core
        while True:
            if not core.has_work:
                self._wake.clear()
                await self._wake.wait()
                clock = loop.time()
                continue
            plan = core.schedule()
            self._report()
            if not plan.items:  # nothing can run now; wait for an abort or a new request
                self._wake.clear()
                await self._wake.wait()
                continue
            now = loop.time()
            clock = max(clock, now - self.MAX_LAG_S) + plan.duration_s * self.slowdown
            await asyncio.sleep(max(0.0, clock - now))
            for out in core.complete(plan):
                stream = self._streams.get(out.seq.seq_id)
                if stream is None:
                    continue
                if out.finished:
                    del self._streams[out.seq.seq_id]
                stream._wake(finished=out.finished)
            self._report()


class SimEngine:
    """``dp_size`` ranks behind one endpoint; each new request goes to the least loaded."""

    def __init__(
        self, config: EngineConfig, dp_size: int = 1, on_load: LoadCallback | None = None
    ) -> None:
        if isinstance(dp_size, bool) or not isinstance(dp_size, int) or dp_size < 1:
            raise ValueError(f"dp_size must be an integer >= 1, got {dp_size!r}")
        self.config = config
        self.ranks = [EngineLoop(config, rank, on_load) for rank in range(dp_size)]

    @property
    def dp_size(self) -> int:
        return len(self.ranks)

    def start(self) -> None:
        for rank in self.ranks:
            rank.start()

    async def stop(self) -> None:
        for rank in self.ranks:
            await rank.stop()

    def loads(self) -> list[RankLoad]:
        return [rank.load() for rank in self.ranks]

    @property
    def slowdown(self) -> float:
        """How many times its modelled duration each step takes (1: as configured)."""
        return self.ranks[0].slowdown

    @slowdown.setter
    def slowdown(self, factor: float) -> None:
        for rank in self.ranks:
            rank.slowdown = factor

    def pick_rank(self) -> EngineLoop:
        """Least KV utilisation, then fewest active prefill tokens, then fewest requests."""

        def key(rank: EngineLoop) -> tuple[float, int, int, int]:
            load = rank.load()
            return (
                load.kv_usage,
                load.active_prefill_tokens,
                load.num_running + load.num_waiting,
                rank.rank,
            )

        return min(self.ranks, key=key)

    def check(self, prompt_tokens: int, max_tokens: int, prefill_only: bool = False) -> None:
        """Raise RequestTooLong / ValueError if the request can never run."""
        self.ranks[0].core.check(prompt_tokens, max_tokens, prefill_only)

    def submit(
        self, prompt_tokens: int, max_tokens: int, prefill_only: bool = False
    ) -> RequestStream:
        """Queue a request on the least-loaded rank; read its tokens from the stream."""
        return self.pick_rank().submit(prompt_tokens, max_tokens, prefill_only)
