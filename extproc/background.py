"""The guard of the service's background tasks: a failing step never stops its task.

Each background task (a periodic step, a timer callback, a loop over a socket) runs its
steps through a :class:`Guard`. A step that raises is counted in
``extproc_background_errors_total{task}``, the task's first failure is logged with its
traceback (later ones are only counted, so a step failing on every run does not flood the
log), and the task goes on: the next step runs when it is due.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Callable
from typing import Any

from prometheus_client import Counter

log = logging.getLogger("extproc.background")

# The background tasks, by the ``task`` label of their failures.
SWEEPER = "sweeper"  # removes the workers and replicas silent past their TTL
REPLICA_PUBLISHER = "replica_publisher"  # sends this replica's estimate to the others
CURVE_REFUSALS = "curve_refusals"  # counts the event publishers CURVE refused
STATUS_HISTORY = "status_history"  # samples the status page's decision history
H2_KEEPALIVE = "h2_keepalive"  # pings idle ext_proc connections, closes dead ones
HELD_TIMER = "held_timer"  # answers the requests held for a slot at their deadline
TASKS = (SWEEPER, REPLICA_PUBLISHER, CURVE_REFUSALS, STATUS_HISTORY, H2_KEEPALIVE, HELD_TIMER)


class Guard:
    """One background task's failures: count each, log the first with its traceback.

    ``failures`` is the counter labelled by ``task`` (the service's
    ``extproc_background_errors``); its series for ``task`` exists, at 0, from the guard's
    creation. Without it the failures are still logged once and counted in ``failed``.
    """

    def __init__(self, task: str, failures: Counter | None = None) -> None:
        if task not in TASKS:
            raise ValueError(f"background task {task!r} is not one of {', '.join(TASKS)}")
        self.task = task
        self.failed = 0
        self._series = failures.labels(task) if failures is not None else None

    def call(self, step: Callable[..., Any], *args: Any) -> bool:
        """Run ``step(*args)``; False if it raised (counted, and logged if the first)."""
        try:
            step(*args)
        except Exception:
            self.failure()
            return False
        return True

    def failure(self) -> None:
        """Record the exception being handled as one failure of the task."""
        self.failed += 1
        if self._series is not None:
            self._series.inc()
        if self.failed == 1:
            log.exception(
                "background task %s failed; it keeps running (later failures are counted "
                "in extproc_background_errors_total, not logged)",
                self.task,
            )

    async def every(self, interval: float, step: Callable[[], None]) -> None:
        """Run ``step`` every ``interval`` seconds until cancelled, through :meth:`call`."""
        while True:
            await asyncio.sleep(interval)
            self.call(step)


async def run_every(
    task: str, interval: float, step: Callable[[], None], failures: Counter | None = None
) -> None:
    """Run ``step`` every ``interval`` seconds until cancelled, guarded as ``task``."""
    await Guard(task, failures).every(interval, step)
