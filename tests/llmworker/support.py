"""Helpers for the worker tests: a real SUB socket; the processes come from extproc.devstack."""

from __future__ import annotations

import asyncio
import time
from collections.abc import Awaitable, Callable
from typing import Any

import zmq
import zmq.asyncio

from extproc.events.schema import Event, decode
from llmworker.sim import SimWorker

StartSim = Callable[..., Awaitable[SimWorker]]
"""The ``start_sim`` fixture: ``await start_sim(*flags, env={...})`` -> a started worker."""


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
