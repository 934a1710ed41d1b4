"""The results files of the request-path benchmarks (``make bench``, ``make bench-events``,
``make bench-storm``, ``loadtest.stream_bench``, ``make bench-replicas``).

Each run writes ``<out>/<name>-results.json``, every measurement of the run with how it was
made (the command, when, ``/proc/loadavg`` before and after, the machine), and
``<out>/<name>-results.md``, generated from that JSON alone (``write`` renders the JSON as
read back, so the Markdown holds nothing the JSON does not). The docs quote the Markdown's
lines, and ``tests/deploy/test_docs.py`` holds the quotes to the file.
"""

from __future__ import annotations

import json
import math
import os
import platform
import re
import shlex
import subprocess
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from extproc.devstack import ROOT, envoy_binary

DOCS = ROOT / "docs"


def proc_loadavg() -> str:
    """``/proc/loadavg`` as the kernel gives it (1, 5 and 15 minutes, tasks, last pid)."""
    return Path("/proc/loadavg").read_text().strip()


def cpu_model() -> str:
    for line in Path("/proc/cpuinfo").read_text().splitlines():
        key, sep, value = line.partition(":")
        if sep and key.strip() == "model name":
            return value.strip()
    return platform.machine() or "unknown"


def envoy_version() -> str:
    """Envoy's release (``1.40.0``) from ``envoy --version``; ``unknown`` if it says none."""
    try:
        out = subprocess.run(
            [envoy_binary(), "--version"], capture_output=True, text=True, timeout=20
        ).stdout
    except (OSError, subprocess.SubprocessError):
        return "unknown"
    m = re.search(r"/(\d+\.\d+\.\d+)/", out)
    return m.group(1) if m else "unknown"


def code_version() -> str:
    """The commit the product code was at (``git rev-parse --short HEAD``), with
    ``+ uncommitted changes`` when extproc/, llmworker/, loadtest/ or envoy/ differ from it;
    ``unknown`` outside a git checkout."""
    try:
        head = subprocess.run(
            ["git", "rev-parse", "--short", "HEAD"],
            capture_output=True,
            text=True,
            timeout=20,
            cwd=ROOT,
            check=True,
        ).stdout.strip()
        dirty = subprocess.run(
            ["git", "status", "--porcelain", "--", "extproc", "llmworker", "loadtest", "envoy"],
            capture_output=True,
            text=True,
            timeout=20,
            cwd=ROOT,
            check=True,
        ).stdout.strip()
    except (OSError, subprocess.SubprocessError):
        return "unknown"
    return f"{head} + uncommitted changes" if dirty else head


def machine() -> dict[str, Any]:
    return {
        "cpus": os.cpu_count(),
        "cpu_model": cpu_model(),
        "kernel": platform.release(),
        "python": platform.python_version(),
        "envoy": envoy_version(),
    }


def command_line(module: str, argv: Sequence[str]) -> str:
    return shlex.join(["python", "-m", module, *argv])


def _utc(seconds: float) -> str:
    return time.strftime("%Y-%m-%d %H:%M:%S", time.gmtime(seconds))


@dataclass
class Run:
    """A run's circumstances: ``Run(command)`` when it starts, ``finish()`` when it ends."""

    command: str
    started: float = field(default_factory=time.time)
    loadavg_before: str = field(default_factory=proc_loadavg)
    code: str = field(default_factory=code_version)

    def finish(self) -> dict[str, Any]:
        ended = time.time()
        return {
            "command": self.command,
            "code": self.code,
            "started_utc": _utc(self.started),
            "finished_utc": _utc(ended),
            "seconds": round(ended - self.started, 1),
            "loadavg_before": self.loadavg_before,
            "loadavg_after": proc_loadavg(),
            "machine": machine(),
        }


def header(title: str, run: dict[str, Any]) -> str:
    """The report's opening: the title, the command, when, the machine and its load."""
    m = run["machine"]
    return (
        f"## {title}\n\n"
        f"Command (took {run['seconds']:.0f} s):\n\n"
        f"```sh\n{run['command']}\n```\n\n"
        + (f"Code at commit `{run['code']}`. " if run.get("code") else "")
        + f"Run from {run['started_utc']} to {run['finished_utc']} UTC on {m['cpus']} CPUs "
        f"({m['cpu_model']}), Linux {m['kernel']}, Python {m['python']}, Envoy {m['envoy']}. "
        f"`/proc/loadavg` before: `{run['loadavg_before']}`; after: "
        f"`{run['loadavg_after']}`. The machine is shared with other work; compare the paths "
        "within this run, not with another run.\n"
    )


def plain(data: Any) -> Any:
    """``data`` as JSON gives it back: NaN and infinities become None (JSON has neither)."""
    if isinstance(data, float) and not math.isfinite(data):
        return None
    if isinstance(data, dict):
        return {str(k): plain(v) for k, v in data.items()}
    if isinstance(data, list | tuple):
        return [plain(v) for v in data]
    return data


def write(out: Path, name: str, data: dict[str, Any], render: Callable[[Any], str]) -> str:
    """``<name>-results.json`` with ``data`` and ``<name>-results.md`` rendered from that JSON
    read back; returns the Markdown."""
    out.mkdir(parents=True, exist_ok=True)
    text = json.dumps(plain(data), indent=2, allow_nan=False) + "\n"
    (out / f"{name}-results.json").write_text(text)
    report = render(json.loads(text))
    (out / f"{name}-results.md").write_text(report)
    return report


def verdict(ok: bool) -> str:
    return "met" if ok else "**missed**"


def median(values: Sequence[float]) -> float:
    ordered = sorted(values)
    if not ordered:
        raise ValueError("median of no values")
    mid = len(ordered) // 2
    return ordered[mid] if len(ordered) % 2 else (ordered[mid - 1] + ordered[mid]) / 2
