"""The demo's workers: what one worker of an engine kind runs, and its slot in the stack.

A :class:`WorkerKind` knows how to start one worker (its processes: an engine, and for a
real engine the sidecar agent beside it) and how to tell that it serves. A
:class:`WorkerSlot` is one worker of the demo (id and port, fixed for its lifetime): it
starts the kind's processes, notices when one of them exits and starts them again on
request. The simulated engine is the kind the demo runs today; another engine slots in
as another kind with the same two methods.
"""

from __future__ import annotations

import signal
from dataclasses import dataclass, field
from pathlib import Path
from typing import Protocol

from extproc.devstack.procs import Proc, SimProcess, answers, cli_flags, wait_until

START_TIMEOUT = 20.0
"""Seconds a worker has to serve after its start (the simulated engine needs about one)."""


class WorkerKind(Protocol):
    """How the demo runs one worker of some engine."""

    def start(self, worker_id: str, port: int, log_dir: Path, *, append_log: bool) -> list[Proc]:
        """Start the worker's processes (in their own sessions), logging to ``log_dir``."""
        ...

    def serving(self, port: int) -> bool:
        """True once the worker answers on ``port``."""
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

    @property
    def running(self) -> bool:
        return bool(self.procs)

    def start(self, log_dir: Path) -> None:
        """Start the worker and wait until it serves; on failure nothing of it is left
        running and the error (an AssertionError) says why."""
        self.procs = self.kind.start(self.worker_id, self.port, log_dir, append_log=self.starts > 0)
        self.starts += 1

        def up() -> bool:
            for proc in self.procs:
                proc.check_alive()
            return self.kind.serving(self.port)

        try:
            wait_until(up, START_TIMEOUT, f"{self.worker_id} up")
        except BaseException:
            self.stop()
            raise

    def exited(self) -> Proc | None:
        """The first of its processes that has exited (the others are stopped), or None."""
        dead = next((p for p in self.procs if not p.alive()), None)
        if dead is not None:
            self.stop()
        return dead

    def stop(self) -> None:
        for proc in self.procs:
            proc.stop()
        self.procs = []
