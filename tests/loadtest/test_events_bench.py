"""``python -m loadtest.events_bench --ingest-only``, shortened: the publisher, the window and the
counts it reports work against the real extproc (the rates are the benchmark's business)."""

from __future__ import annotations

import re
import subprocess

from extproc.devstack import PYTHON, ROOT


def test_ingest_run_applies_every_event_it_sent() -> None:
    cmd = [PYTHON, "-m", "loadtest.events_bench", "--ingest-only",
           "--ingest-seconds", "1", "--workers", "8"]  # fmt: skip
    run = subprocess.run(cmd, capture_output=True, text=True, timeout=120, cwd=ROOT)
    assert run.returncode == 0, run.stdout[-2000:] + run.stderr[-3000:]
    row = run.stdout.strip().splitlines()[-1]
    cells = [c.strip().strip("*") for c in row.strip("|").split("|")]
    sent_rate, ingested, received_sent, gaps = cells[0], cells[1], cells[5], cells[6]
    received, sent = (int(x.replace(",", "")) for x in received_sent.split(" / "))
    assert sent > 1000 and received == sent, row
    assert float(ingested.replace(",", "")) > 0 and float(sent_rate.replace(",", "")) > 0, row
    assert gaps == "0", row
    assert re.search(r"\d+\.\d µs", cells[2]), row
