"""``loadtest/locustfile.py`` against a real stack: Envoy -> extproc -> two simulated workers.

Locust runs headless for eight seconds, as a child process (it monkey-patches the
standard library with gevent, so it never runs inside pytest's process), and its CSV
report must show the rejected, TTFT and ITL rows next to the requests, with no failures.
"""

from __future__ import annotations

import csv
import importlib.util
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest

from extproc.devstack import PYTHON, ROOT, Envoy, Extproc, Proc, free_port, http, wait_until

LOCUSTFILE = ROOT / "loadtest" / "locustfile.py"
MODEL = "locust-model"
USERS = 12
# Long enough that every task gets both 200s and 529s on a slow machine: locust writes its
# CSV once a second, so the last second of a run may be missing from it.
RUN_TIME = "8s"
CLASSES = """
default: standard
classes:
  critical: {priority: 0, share: 1.0}
  standard: {priority: 1, share: 1.0}
  sheddable: {priority: 2, share: 1.0, status: 429}
"""

pytestmark = pytest.mark.skipif(
    importlib.util.find_spec("locust") is None,
    reason="locust is not installed: pip install -e '.[loadtest]'",
)


def _sim(log_dir: Path, name: str, events: str) -> tuple[Proc, int]:
    port = free_port()
    args = [
        PYTHON, "-m", "llmworker.sim", "--host", "127.0.0.1", "--port", str(port),
        "--model", MODEL, "--worker-id", name, "--publish", events,
        "--kv-total-blocks", "1024", "--block-size", "16", "--max-num-seqs", "16",
        "--max-num-batched-tokens", "2048", "--dp-size", "1", "--speedup", "20",
        "--log-level", "WARNING",
    ]  # fmt: skip
    proc = Proc(name, args, log_dir)
    wait_until(
        lambda: http("GET", f"http://127.0.0.1:{port}/health", timeout=1)[0] == 200,
        15,
        f"simulated worker {name}",
    )
    return proc, port


@pytest.fixture(scope="module")
def stack(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Envoy]:
    """Any used KV block makes a worker busy, so a few users get both 200s and 529s. With
    request classes: a request without a class is standard (529); sheddable answers 429."""
    log_dir = tmp_path_factory.mktemp("locust-stack")
    classes = log_dir / "classes.yaml"
    classes.write_text(CLASSES)
    ext = Extproc(
        log_dir,
        ["--active-decode-blocks-threshold", "0.0", "--log-level", "WARNING",
         "--classes-file", str(classes)],
    )  # fmt: skip
    sims = [_sim(log_dir, f"sim-{i}", ext.event_endpoint) for i in (1, 2)]
    envoy = None
    try:
        wait_until(lambda: len(ext.workers()) == 2, 10, "both workers announced")
        envoy = Envoy(log_dir, ext, [port for _, port in sims])
        yield envoy
    finally:
        if envoy is not None:
            envoy.stop()
        for proc, _ in sims:
            proc.stop()
        ext.stop()


def _run_locust(host: str, prefix: Path, *extra: str) -> subprocess.Popen[str]:
    args = [
        PYTHON, "-m", "locust", "-f", str(LOCUSTFILE), "--headless",
        "-u", str(USERS), "-r", str(USERS), "-t", RUN_TIME, "--stop-timeout", "0",
        "--host", host, "--model", MODEL, "--csv", str(prefix),
        "--only-summary", "--loglevel", "WARNING", *extra,
    ]  # fmt: skip
    return subprocess.Popen(
        args,
        cwd=prefix.parent,
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
    )


def _rows(prefix: Path, kind: str) -> list[dict[str, str]]:
    with open(f"{prefix}_{kind}.csv", newline="") as f:
        return list(csv.DictReader(f))


def test_csv_has_requests_rejections_ttft_and_itl(stack: Envoy, tmp_path: Path) -> None:
    plain = _run_locust(stack.url, tmp_path / "plain")
    backoff = ["--retries", "2", "--retry-base", "0.01", "--retry-max", "0.05"]
    retry = _run_locust(stack.url, tmp_path / "retry", *backoff)
    outputs = {}
    for name, proc in (("plain", plain), ("retry", retry)):
        try:
            outputs[name] = proc.communicate(timeout=25)[0]
        except subprocess.TimeoutExpired:
            proc.kill()
            outputs[name] = proc.communicate()[0]
            pytest.fail(f"locust ({name}) did not stop within 25 s:\n{outputs[name]}")
        # locust exits 1 when any request failed: rejections must not count as failures.
        assert proc.returncode == 0, f"locust ({name}) exited {proc.returncode}:\n{outputs[name]}"

    for name in ("plain", "retry"):
        prefix = tmp_path / name
        stats = {(r["Type"], r["Name"]): r for r in _rows(prefix, "stats")}
        for row in (
            ("POST", "chat-stream"),
            ("POST", "chat"),
            ("REJECTED", "chat-stream"),
            ("TTFT", "chat-stream"),
            ("ITL", "chat-stream"),
        ):
            assert row in stats, f"{name}: no {row} row in {sorted(stats)}\n{outputs[name]}"
            assert int(stats[row]["Request Count"]) > 0, (name, stats[row])
            assert int(stats[row]["Failure Count"]) == 0, (name, stats[row])
        # One TTFT sample per stream (those cut off when the run stops, at most one per user,
        # have a TTFT but no POST row); a stream's own time includes every token.
        ttft, stream = stats[("TTFT", "chat-stream")], stats[("POST", "chat-stream")]
        extra = int(ttft["Request Count"]) - int(stream["Request Count"])
        assert 0 <= extra <= USERS, (ttft, stream)
        assert float(stream["Median Response Time"]) > float(ttft["Median Response Time"])
        assert _rows(prefix, "failures") == [], _rows(prefix, "failures")
        assert _rows(prefix, "exceptions") == [], _rows(prefix, "exceptions")


def test_class_mix_reports_each_class(stack: Envoy, tmp_path: Path) -> None:
    """Each request draws a class; rows are per class; a 429 with x-shed-reason is a rejection."""
    prefix = tmp_path / "mix"
    proc = _run_locust(stack.url, prefix, "--class-mix", "critical=1,sheddable=1")
    try:
        output = proc.communicate(timeout=25)[0]
    except subprocess.TimeoutExpired:
        proc.kill()
        pytest.fail(f"locust did not stop within 25 s:\n{proc.communicate()[0]}")
    assert proc.returncode == 0, f"locust exited {proc.returncode}:\n{output}"
    stats = {(r["Type"], r["Name"]): r for r in _rows(prefix, "stats")}
    for row in (
        ("POST", "chat-stream [critical]"),
        ("REJECTED", "chat-stream [critical]"),
        ("REJECTED", "chat-stream [sheddable]"),
        ("TTFT", "chat-stream [critical]"),
    ):
        assert row in stats, f"no {row} row in {sorted(stats)}\n{output}"
        assert int(stats[row]["Request Count"]) > 0, stats[row]
        assert int(stats[row]["Failure Count"]) == 0, stats[row]
    assert all(name.endswith("]") for _, name in stats if name != "Aggregated")
    assert _rows(prefix, "failures") == [], _rows(prefix, "failures")


def test_a_bad_class_mix_stops_locust_with_a_clear_error(stack: Envoy, tmp_path: Path) -> None:
    proc = _run_locust(stack.url, tmp_path / "bad", "--class-mix", "critical=lots")
    output = proc.communicate(timeout=25)[0]
    assert proc.returncode != 0
    assert "--class-mix: 'critical=lots' is not name=weight with a weight above 0" in output


def test_pure_helpers() -> None:
    """Overload status parsing and backoff bounds, checked in a child process (gevent)."""
    code = """
import random, sys
sys.path.insert(0, sys.argv[1])
import locustfile as lf
assert lf.overload_status({}) == 529
assert lf.overload_status({"DYN_HTTP_OVERLOAD_STATUS_CODE": " 503 "}) == 503
assert lf.overload_status({"DYN_HTTP_OVERLOAD_STATUS_CODE": "1000"}) == 529
assert lf.overload_status({"DYN_HTTP_OVERLOAD_STATUS_CODE": "abc"}) == 529
rng = random.Random(7)
for attempt in range(8):
    cap = min(8.0, 0.5 * 2**attempt)
    delays = [lf.backoff_seconds(attempt, 0.5, 8.0, rng) for _ in range(200)]
    assert all(0 <= d <= cap for d in delays), (attempt, max(delays))
    assert max(delays) > cap / 2, (attempt, max(delays))  # jittered across the range
assert lf.retry_after_seconds("3") == 3 and lf.retry_after_seconds(None) == 0
assert lf.has_text({"choices": [{"delta": {"content": "hi"}}]})
assert not lf.has_text({"choices": [], "usage": {"completion_tokens": 3}})
assert lf.has_text({"choices": [{"text": " fox"}]})
assert lf.parse_class_mix("") == []
assert lf.parse_class_mix("critical=20, standard=50,sheddable=30") == [
    ("critical", 20.0), ("standard", 50.0), ("sheddable", 30.0)]
for bad in ("critical", "critical=0", "=3", "critical=nan", "critical=x"):
    try:
        lf.parse_class_mix(bad)
    except ValueError as exc:
        assert repr(bad) in str(exc), exc
    else:
        raise AssertionError(bad)
print("ok")
"""
    out = subprocess.run(
        [sys.executable, "-c", code, str(LOCUSTFILE.parent)],
        capture_output=True,
        text=True,
        timeout=30,
    )
    assert out.returncode == 0 and out.stdout.strip().endswith("ok"), out.stdout + out.stderr
