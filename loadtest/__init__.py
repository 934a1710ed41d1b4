"""Benchmarks and load tests: ``python -m loadtest.bench`` and its siblings, from a checkout."""

from __future__ import annotations

import signal
import sys
from collections.abc import Callable
from types import FrameType


def run_stoppable(main: Callable[[], int]) -> int:
    """Run a benchmark's ``main`` so that SIGTERM stops it as Ctrl-C does: its ``finally``
    blocks stop the workers, the extproc and Envoy it started (SIGTERM's default action
    would end it at once and leave them running). Exit code 130 when stopped."""

    def stop(signum: int, frame: FrameType | None) -> None:
        raise KeyboardInterrupt

    signal.signal(signal.SIGTERM, stop)
    try:
        return main()
    except KeyboardInterrupt:
        print("stopped: the processes it started were stopped", file=sys.stderr)
        return 130
