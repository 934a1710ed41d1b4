"""What a run prints while it runs, and the files it leaves under ``--out``."""

from __future__ import annotations

import json
import math
import sys
import time
from collections.abc import Callable
from dataclasses import asdict
from pathlib import Path
from typing import Any


def log(msg: str) -> None:
    """A progress line on stderr, with the time."""
    print(f"[{time.strftime('%H:%M:%S')}] {msg}", file=sys.stderr, flush=True)


def write_results(
    out: Path, name: str, results: Any, report: str, plot: Callable[[Any, Path], object]
) -> None:
    """``<name>-results.json`` and ``.md`` and the plots under ``out``; the report printed."""
    out.mkdir(parents=True, exist_ok=True)
    (out / f"{name}-results.json").write_text(
        json.dumps(asdict(results), indent=2, default=str) + "\n"
    )
    (out / f"{name}-results.md").write_text(report)
    plot(results, out)
    print(report)


def fmt_ms(value: float, censored: bool = False) -> str:
    """Milliseconds with thousands separators; ``>=`` for a lower bound, a dash for none."""
    if math.isnan(value):
        return "—"
    return (">= " if censored else "") + f"{value:,.0f}"


def fmt_pct(value: float) -> str:
    return "—" if math.isnan(value) else f"{value:.1%}"
