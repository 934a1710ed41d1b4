"""Helpers for the worker tests: deadline polling, a real SUB socket, sim and agent processes."""

from __future__ import annotations

import asyncio
import os
import signal
import subprocess
import sys
import time
from collections.abc import Awaitable, Callable, Sequence
from pathlib import Path
from typing import Any

import zmq
import zmq.asyncio

from extproc.events.schema import Event, decode
from llmworker.sim import SimWorker
from tests.support.stack import free_port as free_port  # for the worker tests

REPO = Path(__file__).resolve().parents[2]

StartSim = Callable[..., Awaitable[SimWorker]]
"""The ``start_sim`` fixture: ``await start_sim(*flags, env={...})`` -> a started worker."""


async def wait_until(
    condition: Callable[[], bool | Awaitable[bool]], timeout: float = 5.0, what: str = ""
) -> None:
    """Poll ``condition`` until it holds; fail after ``timeout`` seconds."""
    deadline = time.monotonic() + timeout
    while True:
        result = condition()
        if not isinstance(result, bool):
            result = await result
        if result:
            return
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out after {timeout} s waiting for {what or condition}")
        await asyncio.sleep(0.005)


class Subscriber:
    """A real pyzmq SUB socket bound on a random port, as the extproc binds it."""

    def __init__(self, endpoint: str = "tcp://127.0.0.1:*", **sockopts: int) -> None:
        self.ctx = zmq.asyncio.Context()
        self.sock = self.ctx.socket(zmq.SUB)
        self.sock.setsockopt(zmq.LINGER, 0)
        for name, value in sockopts.items():
            self.sock.setsockopt(getattr(zmq, name), value)
        self.sock.setsockopt(zmq.SUBSCRIBE, b"")
        self.sock.bind(endpoint)
        self.endpoint: str = self.sock.getsockopt_string(zmq.LAST_ENDPOINT)
        self.received: list[tuple[float, Event]] = []

    async def next(self, timeout: float = 5.0) -> Event:
        """The next decoded message (each must be valid for the extproc)."""
        frames = await asyncio.wait_for(self.sock.recv_multipart(), timeout)
        assert len(frames) == 2, frames
        event = decode(frames[0], frames[1])
        self.received.append((time.monotonic(), event))
        return event

    async def next_of(self, kind: type[Any], timeout: float = 5.0) -> Any:
        """The next message of one event class, skipping others."""
        deadline = time.monotonic() + timeout
        while True:
            event = await self.next(max(0.001, deadline - time.monotonic()))
            if isinstance(event, kind):
                return event

    async def drain(self, seconds: float) -> list[Event]:
        """Everything that arrives within ``seconds``."""
        events: list[Event] = []
        deadline = time.monotonic() + seconds
        while (left := deadline - time.monotonic()) > 0:
            try:
                events.append(await self.next(left))
            except TimeoutError:
                break
        return events

    def close(self) -> None:
        self.sock.close(0)
        self.ctx.term()


SIM_MODULE = "llmworker.sim"
AGENT_MODULE = "llmworker.agent"


def _child_command(module: str, args: Sequence[str]) -> list[str]:
    return [sys.executable, "-m", module, *args]


def _child_env(extra: dict[str, str] | None) -> dict[str, str]:
    """This environment without DYN_* settings, plus ``extra``."""
    env = {k: v for k, v in os.environ.items() if not k.startswith("DYN_")}
    return {**env, "PYTHONPATH": str(REPO), **(extra or {})}


class ModuleProcess:
    """``python -m <module>`` as a child process, stopped by its PID."""

    module: str
    stdout: int = subprocess.PIPE

    def __init__(self, args: Sequence[str], env: dict[str, str] | None = None) -> None:
        self.proc = subprocess.Popen(
            _child_command(self.module, args),
            cwd=REPO,
            env=_child_env(env),
            stdout=self.stdout,
            stderr=subprocess.PIPE,
            text=True,
        )

    def terminate(self, timeout: float = 10.0) -> tuple[int, str]:
        """SIGTERM, wait, and return (exit code, stderr)."""
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
        try:
            _, err = self.proc.communicate(timeout=timeout)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            _, err = self.proc.communicate()
        return self.proc.returncode, err


class SimProcess(ModuleProcess):
    """``python -m llmworker.sim`` as a child process."""

    module = SIM_MODULE


class AgentProcess(ModuleProcess):
    """``python -m llmworker.agent`` as a child process; its stdout is discarded."""

    module = AGENT_MODULE
    stdout = subprocess.DEVNULL


def run_sim(
    args: Sequence[str], env: dict[str, str] | None = None, timeout: float = 20.0
) -> subprocess.CompletedProcess[str]:
    """Run the sim to completion (for startup errors)."""
    return subprocess.run(
        _child_command(SIM_MODULE, args),
        cwd=REPO,
        env=_child_env(env),
        capture_output=True,
        text=True,
        timeout=timeout,
    )
