"""``python -m llmworker.llama_server FLAGS``: llama.cpp's HTTP server with llama-server's flags.

The server is llama.cpp's own C++ HTTP server (``tools/server``), compiled into the
``xllamacpp`` wheel (MIT, prebuilt: ``pip install 'envoy-llm-shedder[engine]'``, no
compiler) and run in this process: the same pages as the ``llama-server`` binary
(``/health``, ``/metrics`` with the ``llamacpp:*`` names, ``/slots``, ``/props``,
``/v1/chat/completions``, ``/v1/completions``), which is all the agent reads. It serves
until SIGTERM or SIGINT, then stops its HTTP server and its slots and exits with status 0.

With ``LLAMA_SERVER=/path/to/llama-server`` in the environment, that binary is exec'd
instead with the same arguments, untouched (the same process id: a supervisor, or a
test, that holds the PID holds the binary). That is the way to run a build of your own, or
a flag this launcher does not take.

The flags taken, with llama-server's meaning and short forms (:data:`FLAGS` is the list).
Any other flag stops the launcher with status 2, naming it. A flag not given keeps
xllamacpp's default, which is llama.cpp's own, except ``--port`` (8080, as llama-server)
and ``--threads`` (the CPUs this process may run on).
"""

from __future__ import annotations

import argparse
import os
import signal
import sys
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any, NoReturn

PROG = "python -m llmworker.llama_server"
ENV_BINARY = "LLAMA_SERVER"
"""The environment variable naming a ``llama-server`` binary to exec instead."""


@dataclass(frozen=True)
class Options:
    """The parsed flags; None: not given (the default applies)."""

    model: str
    alias: str | None = None
    host: str = "127.0.0.1"
    port: int = 8080
    ctx_size: int | None = None
    parallel: int | None = None
    threads: int | None = None
    threads_batch: int | None = None
    threads_http: int | None = None
    batch_size: int | None = None
    ubatch_size: int | None = None
    cache_ram: int | None = None
    metrics: bool = False
    slots: bool = True
    props: bool = False
    verbosity: int | None = None


def _count(minimum: int) -> Any:
    def parse(text: str) -> int:
        try:
            value = int(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"{text!r} is not an integer") from None
        if value < minimum:
            raise argparse.ArgumentTypeError(f"{value} is below the minimum {minimum}")
        return value

    return parse


def _port(text: str) -> int:
    value: int = _count(0)(text)
    if value > 65535:
        raise argparse.ArgumentTypeError(f"{value} is not a TCP port (0-65535)")
    return value


# (option strings, Options field, argparse keywords): llama-server's flags that this
# launcher maps onto xllamacpp's CommonParams (see build_params).
FLAGS: tuple[tuple[tuple[str, ...], str, dict[str, Any]], ...] = (
    (("-m", "--model"), "model", {"metavar": "FNAME", "help": "the GGUF model file (required)"}),
    (("-a", "--alias"), "alias", {"metavar": "NAME",
                                  "help": "the model's name in the API (default: --model)"}),
    (("--host",), "host", {"help": "address to listen on (default 127.0.0.1)"}),
    (("--port",), "port", {"type": _port, "help": "port to listen on (default 8080)"}),
    (("-c", "--ctx-size"), "ctx_size", {"type": _count(0), "metavar": "N",
                                        "help": "the whole context in tokens, split evenly "
                                        "over the slots (0: the model's)"}),
    (("-np", "--parallel"), "parallel", {"type": _count(1), "metavar": "N",
                                         "help": "slots: requests decoded at once"}),
    (("-t", "--threads"), "threads", {"type": _count(1), "metavar": "N",
                                      "help": "CPU threads for generation (default: the "
                                      "CPUs this process may use)"}),
    (("-tb", "--threads-batch"), "threads_batch", {"type": _count(1), "metavar": "N",
                                                   "help": "CPU threads for prompts "
                                                   "(default: --threads)"}),
    (("--threads-http",), "threads_http", {"type": _count(1), "metavar": "N",
                                           "help": "threads serving HTTP"}),
    (("-b", "--batch-size"), "batch_size", {"type": _count(1), "metavar": "N",
                                            "help": "logical batch size in tokens"}),
    (("-ub", "--ubatch-size"), "ubatch_size", {"type": _count(1), "metavar": "N",
                                               "help": "physical batch size in tokens"}),
    (("-cram", "--cache-ram"), "cache_ram", {"type": _count(0), "metavar": "MIB",
                                             "help": "RAM for the prompt cache, MiB "
                                             "(0: none)"}),
    (("--metrics",), "metrics", {"action": "store_true",
                                 "help": "serve /metrics (Prometheus, llamacpp:* names)"}),
    (("--slots",), "slots", {"action": "store_true", "default": True,
                             "help": "serve /slots (the default)"}),
    (("--no-slots",), "slots", {"action": "store_false", "help": "do not serve /slots"}),
    (("--props",), "props", {"action": "store_true",
                             "help": "let POST /props change the server's settings"}),
    (("-lv", "--verbosity", "--log-verbosity"), "verbosity",
     {"type": _count(0), "metavar": "N",
      "help": "log lines up to this level (4: also the settings at start)"}),
)  # fmt: skip


class _Parser(argparse.ArgumentParser):
    def error(self, message: str) -> NoReturn:
        self.exit(2, f"{self.prog}: {message}\n")


def _parser() -> argparse.ArgumentParser:
    parser = _Parser(
        prog=PROG,
        allow_abbrev=False,  # --par is not --parallel: llama-server does not guess either
        description="llama.cpp's HTTP server (xllamacpp) with llama-server's flags. "
        f"{ENV_BINARY}=/path/to/llama-server in the environment execs that binary instead, "
        "with these arguments untouched.",
    )
    for names, dest, keywords in FLAGS:
        parser.add_argument(*names, dest=dest, **keywords)
    parser.add_argument("--version", action="store_true", help="print the version and exit")
    return parser


def parse(argv: Sequence[str]) -> Options:
    """The flags as :class:`Options`; SystemExit(2) with a message naming a flag that is
    not taken or a value that is wrong."""
    parser = _parser()
    namespace, unknown = parser.parse_known_args(list(argv))
    fields = vars(namespace)
    if fields.pop("version"):
        print(version())
        raise SystemExit(0)
    if unknown:
        flags = [a.split("=", 1)[0] for a in unknown if a.startswith("-")] or unknown
        taken = ", ".join(names[min(1, len(names) - 1)] for names, _, _ in FLAGS)
        plural = "s" if len(flags) > 1 else ""
        parser.error(
            f"unsupported flag{plural} {' '.join(flags)}: the in-process server takes {taken}; "
            f"for llama-server's other flags set {ENV_BINARY}=/path/to/llama-server"
        )
    if fields["model"] is None:
        parser.error("the flag -m/--model (the GGUF model file) is required")
    return Options(**{k: v for k, v in fields.items() if v is not None})


def version() -> str:
    """``xllamacpp <version> (llama.cpp build <n>, commit <c>)``; needs the wheel."""
    import xllamacpp

    info = xllamacpp.BUILD_INFO
    return (
        f"xllamacpp {xllamacpp.__version__} (llama.cpp build {info.get('build_number')}, "
        f"commit {info.get('commit')})"
    )


def default_threads() -> int:
    """The CPUs this process may run on (llama-server's default is the physical cores)."""
    return len(os.sched_getaffinity(0))


def build_params(opts: Options) -> Any:
    """xllamacpp's ``CommonParams`` for ``opts`` (the fields llama-server's flags set)."""
    import xllamacpp

    params = xllamacpp.CommonParams()
    params.model.path = opts.model
    if opts.alias is not None:
        params.model_alias = {opts.alias}
    params.hostnames = [opts.host]
    params.port = opts.port
    if opts.ctx_size is not None:
        params.n_ctx = opts.ctx_size
    if opts.parallel is not None:
        params.n_parallel = opts.parallel
    threads = opts.threads if opts.threads is not None else default_threads()
    params.cpuparams.n_threads = threads
    params.cpuparams_batch.n_threads = (
        opts.threads_batch if opts.threads_batch is not None else threads
    )
    if opts.threads_http is not None:
        params.n_threads_http = opts.threads_http
    if opts.batch_size is not None:
        params.n_batch = opts.batch_size
    if opts.ubatch_size is not None:
        params.n_ubatch = opts.ubatch_size
    if opts.cache_ram is not None:
        params.cache_ram_mib = opts.cache_ram
    params.endpoint_metrics = opts.metrics
    params.endpoint_slots = opts.slots
    params.endpoint_props = opts.props
    if opts.verbosity is not None:
        params.verbosity = opts.verbosity
    return params


def exec_binary(binary: str, argv: Sequence[str]) -> NoReturn:
    """Replace this process with ``binary argv``; status 2 naming it if it cannot run."""
    path = Path(binary)
    if not path.is_file() or not os.access(path, os.X_OK):
        what = "is not an executable file" if path.exists() else "does not exist"
        print(f"{PROG}: {ENV_BINARY}={binary} {what}; expected the path of llama-server",
              file=sys.stderr)  # fmt: skip
        sys.exit(2)
    os.execv(binary, [binary, *argv])


def serve(opts: Options) -> int:
    """Run the server until SIGTERM or SIGINT; 0 then, 1 if it did not start."""
    if not Path(opts.model).is_file():
        print(f"{PROG}: --model {opts.model}: no such file", file=sys.stderr)
        return 2
    try:
        import xllamacpp
    except ImportError as exc:
        needs = (
            " (it needs libgomp.so.1: apt-get install libgomp1)" if "libgomp" in str(exc) else ""
        )
        print(
            f"{PROG}: xllamacpp does not load: {exc}{needs}; pip install "
            f"'envoy-llm-shedder[engine]', or set {ENV_BINARY}=/path/to/llama-server",
            file=sys.stderr,
        )
        return 2
    # Blocked before the server's threads start, so they inherit the mask and the signal
    # waits for sigwait below, also when it arrives while the model loads.
    stop_signals = {signal.SIGTERM, signal.SIGINT}
    signal.pthread_sigmask(signal.SIG_BLOCK, stop_signals)
    try:
        server = xllamacpp.Server(build_params(opts))
    except RuntimeError as exc:
        print(
            f"{PROG}: the server did not start on {opts.host}:{opts.port} with --model "
            f"{opts.model}: {exc} (the log lines above say why)",
            file=sys.stderr,
        )
        return 1
    print(f"{PROG}: {version()} serving on {server.listening_address}", file=sys.stderr)
    received = signal.sigwait(stop_signals)
    print(f"{PROG}: {signal.Signals(received).name}: stopping", file=sys.stderr, flush=True)
    del server  # stops the HTTP server and the slots, and waits for them
    return 0


def main(argv: Sequence[str] | None = None) -> int:
    args = list(sys.argv[1:] if argv is None else argv)
    binary = os.environ.get(ENV_BINARY)
    if binary:
        exec_binary(binary, args)
    return serve(parse(args))


if __name__ == "__main__":
    sys.exit(main())
