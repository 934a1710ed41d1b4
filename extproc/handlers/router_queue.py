"""Hold requests in the router while every free worker has too much prefill in flight.

``--router-queue-threshold T``: a worker can take another request only while its
router-tracked prefill tokens (prompts dispatched and not yet at their first token)
are at most ``floor(T x max_num_batched_tokens)`` on some rank. When no free worker
can, requests wait here, FIFO per model, and go out as soon as one can; a wait longer
than ``--router-queue-timeout`` ends in the overload reply.

Only the head of a model's queue tries to dispatch; it is woken when capacity may
have appeared (a request finished or reached its first token, a worker joined) and
re-checks every 50 ms regardless, so a missed wake-up costs at most that.
"""

from __future__ import annotations

import asyncio
import contextlib
from collections import deque
from collections.abc import Callable
from typing import TypeVar

T = TypeVar("T")
RECHECK_SECONDS = 0.05


class RouterQueue:
    """Per-model FIFO of waiting requests."""

    def __init__(self, timeout: float) -> None:
        self.timeout = timeout
        self._queues: dict[str, deque[asyncio.Event]] = {}

    def depth(self) -> dict[str, int]:
        return {model: len(q) for model, q in self._queues.items()}

    def waiting(self, model: str) -> bool:
        return model in self._queues

    def notify(self, model: str) -> None:
        """Capacity for ``model`` may have appeared: wake the head of its queue."""
        q = self._queues.get(model)
        if q:
            q[0].set()

    async def wait(self, model: str, attempt: Callable[[], T | None]) -> T | None:
        """Join the queue; at its head, call ``attempt`` until it returns a result.

        Returns that result, or None when the timeout passes first. A cancelled
        waiter (client gone) leaves the queue.
        """
        loop = asyncio.get_running_loop()
        deadline = loop.time() + self.timeout
        q = self._queues.setdefault(model, deque())
        me = asyncio.Event()
        q.append(me)
        try:
            while True:
                if q[0] is me:
                    result = attempt()
                    if result is not None:
                        return result
                remaining = deadline - loop.time()
                if remaining <= 0:
                    return None
                me.clear()
                with contextlib.suppress(TimeoutError):
                    await asyncio.wait_for(me.wait(), min(remaining, RECHECK_SECONDS))
        finally:
            q.remove(me)
            if q:
                q[0].set()
            else:
                del self._queues[model]
