"""The demo's workers: what one worker of an engine kind runs, and its slot in the stack.

A :class:`WorkerKind` knows how to start one worker (its processes: an engine, and for a
real engine the sidecar agent beside it) and how to tell that it serves. A
:class:`WorkerSlot` is one worker of the demo (id and port, fixed for its lifetime): it
starts the kind's processes, notices when one of them exits and starts them again on
request. Three kinds: the simulated engine (:class:`SimWorkers`), llama.cpp's
``llama-server`` with its sidecar agent (:class:`LlamaCppWorkers`), and vLLM with its
sidecar agent (:class:`VllmWorkers`).
"""

from __future__ import annotations

import signal
from dataclasses import dataclass, field
from pathlib import Path
from typing import Protocol

from extproc.devstack.llamacpp import LlamaServer
from extproc.devstack.procs import (
    AgentProcess,
    Proc,
    SimProcess,
    answers,
    cli_flags,
    free_port,
    wait_until,
)
from extproc.devstack.vllm import BLOCK_SIZE as VLLM_BLOCK_SIZE
from extproc.devstack.vllm import VllmServer

START_TIMEOUT = 20.0
"""Seconds a worker has to serve after its start (the simulated engine needs about one)."""
ENGINE_LOAD_TIMEOUT = 60.0
"""Seconds llama-server has to load SmolLM2 (1-3 s here; more with both cores busy)."""
VLLM_START_TIMEOUT = 300.0
"""Seconds a vLLM worker has to serve (30-60 s here with two starting at once)."""


class WorkerKind(Protocol):
    """How the demo runs one worker of some engine."""

    def start(self, worker_id: str, port: int, log_dir: Path, *, append_log: bool) -> list[Proc]:
        """Start the worker's processes (in their own sessions), logging to ``log_dir``."""
        ...

    def serving(self, port: int) -> bool:
        """True once the worker answers on ``port``."""
        ...

    @property
    def start_timeout(self) -> float:
        """Seconds a worker of this kind has to serve after its start."""
        ...


@dataclass(frozen=True)
class SimWorkers:
    """The simulated engine (``python -m llmworker.sim``), publishing its load to ``publish``."""

    model: str
    speedup: str
    publish: str

    def args(self, worker_id: str, port: int) -> list[str]:
        return cli_flags(
            host="127.0.0.1",
            port=port,
            model=self.model,
            worker_id=worker_id,
            publish=self.publish,
            kv_total_blocks=1024,
            block_size=16,
            max_num_seqs=64,
            max_num_batched_tokens=2048,
            dp_size=1,
            speedup=self.speedup,
        )

    def start(self, worker_id: str, port: int, log_dir: Path, *, append_log: bool) -> list[Proc]:
        sim = SimProcess(
            self.args(worker_id, port),
            log_dir=log_dir,
            name=worker_id,
            keep_dyn_env=True,
            new_session=True,
            append_log=append_log,
        )
        return [sim]

    def serving(self, port: int) -> bool:
        return answers(f"http://127.0.0.1:{port}/health")

    @property
    def start_timeout(self) -> float:
        return START_TIMEOUT


@dataclass(frozen=True)
class LlamaCppWorkers:
    """llama.cpp's ``llama-server`` serving SmolLM2 on the worker's port, and beside it the
    sidecar agent (``python -m llmworker.agent --engine llamacpp``) publishing its load to
    ``publish``. The agent starts once the engine answers ``/health``."""

    model: str
    publish: str
    ctx: int = 1024
    parallel: int = 2
    threads: int = 1
    block_size: int = 16
    interval: float = 0.1

    def agent_args(self, worker_id: str, port: int) -> list[str]:
        engine = f"127.0.0.1:{port}"
        return cli_flags(
            engine="llamacpp",
            engine_url=f"http://{engine}",
            model=self.model,
            endpoint=engine,
            worker_id=worker_id,
            block_size=self.block_size,
            interval=self.interval,
            publish=self.publish,
        )

    def start(self, worker_id: str, port: int, log_dir: Path, *, append_log: bool) -> list[Proc]:
        engine = LlamaServer(
            log_dir,
            name=worker_id,
            port=port,
            ctx=self.ctx,
            parallel=self.parallel,
            threads=self.threads,
            alias=self.model,
            ready_timeout=ENGINE_LOAD_TIMEOUT,
            new_session=True,
            append_log=append_log,
        )
        return _with_agent(engine, self.agent_args(worker_id, port), worker_id, log_dir, append_log)

    def serving(self, port: int) -> bool:
        return answers(f"http://127.0.0.1:{port}/health")

    @property
    def start_timeout(self) -> float:
        return START_TIMEOUT


@dataclass(frozen=True)
class VllmWorkers:
    """vLLM serving SmolLM2 on the worker's port (:class:`~extproc.devstack.vllm.VllmServer`:
    ``max_num_seqs`` sequences of at most ``max_model_len`` tokens, a KV cache of
    ``num_gpu_blocks`` blocks of 128 tokens), and beside it the sidecar agent (``python -m
    llmworker.agent --engine vllm``) publishing its load to ``publish``. The agent starts at
    once and announces the worker after its first good scrape, once vLLM serves. Each worker
    has its compute threads on a CPU of its own (``cpus``, by the worker's index), when there
    are enough."""

    model: str
    publish: str
    max_model_len: int = 1024
    max_num_seqs: int = 4
    num_gpu_blocks: int | None = 17
    max_num_queued_reqs: int | None = None
    cpus: tuple[str, ...] = ()
    interval: float = 0.2

    def agent_args(self, worker_id: str, port: int, kv_events: str | None = None) -> list[str]:
        engine = f"127.0.0.1:{port}"
        return cli_flags(
            engine="vllm",
            kv_events_bind=kv_events,  # vLLM's own KV events between scrapes
            engine_url=f"http://{engine}",
            model=self.model,
            endpoint=engine,
            worker_id=worker_id,
            max_num_seqs=self.max_num_seqs,  # vLLM does not print it
            interval=self.interval,
            publish=self.publish,
        )

    def start(self, worker_id: str, port: int, log_dir: Path, *, append_log: bool) -> list[Proc]:
        index = int(worker_id.rsplit("-", 1)[-1]) - 1 if worker_id[-1:].isdigit() else 0
        # The agent binds this endpoint; vLLM's publisher connects to it (either may start first).
        kv_events = f"tcp://127.0.0.1:{free_port()}"
        engine = VllmServer(
            log_dir,
            name=worker_id,
            port=port,
            served_model=self.model,
            max_model_len=self.max_model_len,
            max_num_seqs=self.max_num_seqs,
            num_gpu_blocks_override=self.num_gpu_blocks,
            max_num_queued_reqs=self.max_num_queued_reqs,
            kv_events=kv_events,
            cpus=self.cpus[index % len(self.cpus)] if self.cpus else None,
            wait=False,
            append_log=append_log,
        )
        agent_args = self.agent_args(worker_id, port, kv_events)
        return _with_agent(engine, agent_args, worker_id, log_dir, append_log)

    def serving(self, port: int) -> bool:
        return answers(f"http://127.0.0.1:{port}/health")

    @property
    def start_timeout(self) -> float:
        return VLLM_START_TIMEOUT

    @property
    def block_size(self) -> int:
        return VLLM_BLOCK_SIZE


def exit_status(code: int) -> str:
    """``-9`` -> ``killed by SIGKILL``, ``1`` -> ``exit status 1``."""
    if code < 0:
        try:
            return f"killed by {signal.Signals(-code).name}"
        except ValueError:
            return f"killed by signal {-code}"
    return f"exit status {code}"


@dataclass
class WorkerSlot:
    """One worker of the demo: its id, its port and the processes now running for it."""

    worker_id: str
    port: int
    kind: WorkerKind
    procs: list[Proc] = field(default_factory=list)
    starts: int = 0
    publisher_died: bool = False
    """The last exit was the process that publishes the load (the kind's last one): it said
    nothing. Otherwise the publisher was stopped in order and said ``bye``."""

    @property
    def running(self) -> bool:
        return bool(self.procs)

    def start(self, log_dir: Path) -> None:
        """Start the worker and wait until it serves; on failure nothing of it is left
        running and the error (an AssertionError) says why."""
        self.launch(log_dir)
        self.wait_serving()

    def launch(self, log_dir: Path) -> None:
        """Start the worker's processes without waiting for it to serve (several workers
        then start at once; :meth:`wait_serving` waits)."""
        self.procs = self.kind.start(self.worker_id, self.port, log_dir, append_log=self.starts > 0)
        self.starts += 1

    def wait_serving(self) -> None:
        """Wait until the launched worker serves; on failure it is stopped and the error
        (an AssertionError) says why."""

        def up() -> bool:
            for proc in self.procs:
                proc.check_alive()
            return self.kind.serving(self.port)

        try:
            wait_until(up, self.kind.start_timeout, f"{self.worker_id} up")
        except BaseException:
            self.stop()
            raise

    def exited(self) -> Proc | None:
        """The first of its processes that has exited (the others are stopped), or None."""
        dead = next((p for p in self.procs if not p.alive()), None)
        if dead is not None:
            self.publisher_died = dead is self.procs[-1]
            self.stop()
        return dead

    def stop(self) -> None:
        for proc in self.procs:
            proc.stop()
        self.procs = []


def _with_agent(
    engine: Proc, agent_args: list[str], worker_id: str, log_dir: Path, append_log: bool
) -> list[Proc]:
    """The engine and, beside it, its sidecar agent; the engine is stopped if the agent
    cannot start, so a failed start leaves nothing running."""
    try:
        agent = AgentProcess(
            agent_args,
            log_dir=log_dir,
            name=f"{worker_id}-agent",
            new_session=True,
            append_log=append_log,
        )
    except BaseException:
        engine.stop()
        raise
    return [engine, agent]
