"""Where the CPU goes while a cell runs: core-seconds per part of the stack, and the rest of
the machine (other work sharing its cores), read from ``/proc``."""

from __future__ import annotations

import os
from collections.abc import Mapping, Sequence
from pathlib import Path

_TICK = os.sysconf("SC_CLK_TCK")
OTHER = "other"  # the machine's busy time not spent by any process of the stack


def process_seconds(pid: int) -> float:
    """User + system CPU seconds of a process (all its threads); 0 once it is gone."""
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return 0.0
    fields = stat.rsplit(")", 1)[1].split()  # after the command name: field 3 onwards
    return (int(fields[11]) + int(fields[12])) / _TICK  # utime, stime (fields 14, 15)


def machine_busy_seconds() -> float:
    """CPU seconds the machine spent not idle, summed over its cores, since boot."""
    with open("/proc/stat") as f:
        values = [int(v) for v in f.readline().split()[1:]]
    idle = values[3] + (values[4] if len(values) > 4 else 0)  # idle + iowait
    total = sum(values[:8])  # user .. steal; guest time is already inside user
    return (total - idle) / _TICK


class CpuMeter:
    """Core-seconds per named group of processes between :meth:`start` and :meth:`stop`."""

    def __init__(self, groups: Mapping[str, Sequence[int]]) -> None:
        self.groups = {name: list(pids) for name, pids in groups.items()}
        self._start: dict[str, float] = {}

    def _read(self) -> dict[str, float]:
        now = {name: sum(process_seconds(p) for p in pids) for name, pids in self.groups.items()}
        now[OTHER] = machine_busy_seconds()
        return now

    def start(self) -> None:
        self._start = self._read()

    def stop(self) -> dict[str, float]:
        """Seconds per group since :meth:`start`; ``other``: the machine's rest."""
        end = self._read()
        used = {name: round(end[name] - self._start[name], 2) for name in end}
        used[OTHER] = round(
            max(0.0, used[OTHER] - sum(v for k, v in used.items() if k != OTHER)), 2
        )
        return used
