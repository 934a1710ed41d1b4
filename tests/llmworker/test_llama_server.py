"""``python -m llmworker.llama_server``: llama-server's flags onto llama.cpp's own HTTP server
(the xllamacpp wheel) in one process, or the binary ``LLAMA_SERVER`` names exec'd with them.

The flag parsing is checked as such; every mapped flag is then checked where it shows on the
real server with the SmolLM2 model: ``/slots`` (one slot per ``--parallel``, each
``--ctx-size / --parallel`` tokens), ``/props`` (``total_slots``, the alias), ``/metrics``
(the ``llamacpp:*`` names the agent reads), a reply's ``model`` (the alias), and the lines
the server logs at ``--verbosity 4`` (threads, HTTP threads, batch sizes, prompt cache).
SIGTERM and SIGINT stop it with status 0 and free the port.
"""

from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest

from extproc.devstack import free_port, http, wait_until
from extproc.devstack.llamacpp import smollm2_model
from llmworker.llama_server import FLAGS, Options, parse
from tests.support.engine import require_engine

LAUNCHER = [sys.executable, "-m", "llmworker.llama_server"]
WAIT = 60.0  # the machine is shared: the model loads in 1-3 s alone, more when busy


# --- the flags ----------------------------------------------------------------------------


def test_long_and_short_flags_map_to_the_options() -> None:
    long = parse(
        ["--model", "m.gguf", "--alias", "a", "--host", "0.0.0.0", "--port", "9", "--ctx-size",
         "1024", "--parallel", "2", "--threads", "3", "--threads-batch", "4", "--threads-http",
         "5", "--batch-size", "256", "--ubatch-size", "128", "--cache-ram", "0", "--metrics",
         "--no-slots", "--props", "--verbosity", "4"]
    )  # fmt: skip
    assert long == Options(
        model="m.gguf", alias="a", host="0.0.0.0", port=9, ctx_size=1024, parallel=2,
        threads=3, threads_batch=4, threads_http=5, batch_size=256, ubatch_size=128,
        cache_ram=0, metrics=True, slots=False, props=True, verbosity=4,
    )  # fmt: skip
    short = parse(
        ["-m", "m.gguf", "-a", "a", "--host=0.0.0.0", "--port=9", "-c", "1024", "-np", "2",
         "-t", "3", "-tb", "4", "--threads-http", "5", "-b", "256", "-ub", "128", "-cram", "0",
         "--metrics", "--no-slots", "--props", "-lv", "4"]
    )  # fmt: skip
    assert short == long


def test_flags_not_given_keep_the_defaults() -> None:
    assert parse(["--model", "m.gguf"]) == Options(model="m.gguf")
    assert Options(model="m").port == 8080 and Options(model="m").host == "127.0.0.1"
    assert Options(model="m").slots and not Options(model="m").metrics


@pytest.mark.parametrize(
    ("argv", "fragment"),
    [
        (["--model", "m", "--no-such-flag"], "unsupported flag --no-such-flag: "),
        (
            ["--model", "m", "--flash-attn", "on", "-ngl", "9"],
            "unsupported flags --flash-attn -ngl",
        ),
        (["--model", "m", "--par", "2"], "unsupported flag --par: "),  # no abbreviations
        (["--model", "m", "--parallel", "0"], "-np/--parallel: 0 is below the minimum 1"),
        (["--model", "m", "--ctx-size", "big"], "-c/--ctx-size: 'big' is not an integer"),
        (["--model", "m", "--port", "70000"], "--port: 70000 is not a TCP port (0-65535)"),
        (["--alias", "a"], "-m/--model (the GGUF model file) is required"),
    ],
)
def test_wrong_flags_are_named(
    argv: list[str], fragment: str, capsys: pytest.CaptureFixture[str]
) -> None:
    with pytest.raises(SystemExit) as exc:
        parse(argv)
    assert exc.value.code == 2
    err = capsys.readouterr().err
    assert fragment in err, err
    if "unsupported" in fragment:  # says what it takes and how to get the rest
        assert "--ctx-size" in err and "LLAMA_SERVER=/path/to/llama-server" in err, err


def test_every_flag_is_in_the_help() -> None:
    out = subprocess.run(
        [*LAUNCHER, "--help"], capture_output=True, text=True, timeout=30,
        env={k: v for k, v in os.environ.items() if k != "LLAMA_SERVER"},
    ).stdout  # fmt: skip
    for names, _, _ in FLAGS:
        assert all(n in out for n in names), (names, out)
    assert "LLAMA_SERVER" in out


# --- LLAMA_SERVER: a binary exec'd instead --------------------------------------------------


def test_llama_server_binary_is_execd_with_the_same_arguments(tmp_path: Path) -> None:
    """The same process (a supervisor's PID stays valid), every argument untouched, also
    those the in-process server does not take."""
    record = tmp_path / "argv"
    binary = tmp_path / "llama-server"
    binary.write_text(f'#!/bin/sh\necho "$$" > {record}\nprintf "%s\\n" "$@" >> {record}\n')
    binary.chmod(0o755)
    argv = ["--model", "x.gguf", "--port", "1", "--flash-attn", "on", "--alias", "a b"]
    proc = subprocess.Popen(
        [*LAUNCHER, *argv],
        env={**os.environ, "LLAMA_SERVER": str(binary)},
        stderr=subprocess.PIPE,
        text=True,
    )
    _, err = proc.communicate(timeout=30)
    assert proc.returncode == 0, err
    pid, *args = record.read_text().splitlines()
    assert (int(pid), args) == (proc.pid, argv)


def test_llama_server_that_cannot_run_is_named(tmp_path: Path) -> None:
    not_executable = tmp_path / "llama-server"
    not_executable.write_text("")
    for path, what in (
        (tmp_path / "nothing", "does not exist"),
        (not_executable, "is not an executable file"),
    ):
        proc = subprocess.run(
            [*LAUNCHER, "--model", "x.gguf"],
            env={**os.environ, "LLAMA_SERVER": str(path)},
            capture_output=True,
            text=True,
            timeout=30,
        )
        assert proc.returncode == 2, proc
        assert f"LLAMA_SERVER={path} {what}; expected the path of llama-server" in proc.stderr


# --- the real server ------------------------------------------------------------------------


@pytest.fixture(scope="module")
def model() -> Path:
    require_engine()
    return smollm2_model()


class Launched:
    """The launcher as a child process, its output in a file."""

    def __init__(self, log: Path, *flags: str) -> None:
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self.log_path = log
        env = {k: v for k, v in os.environ.items() if k != "LLAMA_SERVER"}
        with open(log, "wb") as out:
            self.proc = subprocess.Popen(
                [*LAUNCHER, "--port", str(self.port), *flags],
                stdout=out,
                stderr=subprocess.STDOUT,
                env=env,
            )

    def log(self) -> str:
        return self.log_path.read_text(errors="replace")

    def healthy(self) -> bool:
        assert self.proc.poll() is None, f"exited with {self.proc.returncode}:\n{self.log()}"
        try:
            return http("GET", self.url + "/health", timeout=2)[0] == 200
        except OSError:
            return False

    def stop_by(self, sig: signal.Signals, timeout: float = 15.0) -> int:
        """Send ``sig``; the exit status, or a failure with the log if it does not exit."""
        self.proc.send_signal(sig)
        try:
            return self.proc.wait(timeout)
        except subprocess.TimeoutExpired:
            raise AssertionError(
                f"still running {timeout} s after {sig.name}:\n{self.log()}"
            ) from None

    def stop(self) -> None:
        if self.proc.poll() is None:
            self.proc.kill()
            self.proc.wait(10)


@pytest.fixture
def launched(tmp_path: Path) -> Iterator[list[Launched]]:
    started: list[Launched] = []
    yield started
    for one in started:
        one.stop()


def _port_closed(port: int) -> bool:
    with socket.socket() as s:
        return s.connect_ex(("127.0.0.1", port)) != 0


def test_each_flag_takes_effect_and_sigterm_stops_it_with_status_0(
    model: Path, tmp_path: Path, launched: list[Launched]
) -> None:
    server = Launched(
        tmp_path / "engine.log",
        "--model", str(model), "--alias", "smollm2", "--host", "127.0.0.1",
        "--ctx-size", "1024", "--parallel", "2", "--threads", "1", "--threads-batch", "1",
        "--threads-http", "3", "--batch-size", "256", "--ubatch-size", "128",
        "--cache-ram", "0", "--metrics", "--verbosity", "4",
    )  # fmt: skip
    launched.append(server)
    wait_until(server.healthy, WAIT, "the engine's /health answers 200")

    slots = json.loads(http("GET", server.url + "/slots")[2])
    assert [(s["id"], s["n_ctx"]) for s in slots] == [(0, 512), (1, 512)]
    props = json.loads(http("GET", server.url + "/props")[2])
    assert props["total_slots"] == 2 and props["model_alias"] == "smollm2", props
    assert props["endpoint_metrics"] and props["endpoint_slots"], props
    metrics = http("GET", server.url + "/metrics")[2].decode()
    for name in ("llamacpp:requests_processing", "llamacpp:requests_deferred",
                 "llamacpp:prompt_tokens_total", "llamacpp:tokens_predicted_total"):  # fmt: skip
        assert f"\n{name} " in metrics, (name, metrics)
    body = {"model": "smollm2", "messages": [{"role": "user", "content": "Hi"}],
            "max_tokens": 4}  # fmt: skip
    status, _, reply = http("POST", server.url + "/v1/chat/completions", body, timeout=60)
    assert status == 200, reply
    assert json.loads(reply)["model"] == "smollm2"
    models = json.loads(http("GET", server.url + "/v1/models")[2])
    assert [m["id"] for m in models["data"]] == ["smollm2"], models

    log = server.log()
    for line in ("n_threads = 1 (n_threads_batch = 1)", "using 3 threads for HTTP server",
                 "n_batch               = 256", "n_ubatch              = 128",
                 "prompt cache is disabled", "n_slots = 2, n_ctx_slot = 512"):  # fmt: skip
        assert line in log, (line, log)

    assert server.stop_by(signal.SIGTERM) == 0, server.log()
    assert "SIGTERM: stopping" in server.log()
    assert _port_closed(server.port)


def test_pages_off_by_default_answer_501_and_sigint_stops_it_with_status_0(
    model: Path, tmp_path: Path, launched: list[Launched]
) -> None:
    """Without ``--metrics`` and with ``--no-slots`` the pages answer 501, as llama-server's
    do (the agent names the missing flag from that); without ``--alias`` the model is named
    by its path."""
    server = Launched(
        tmp_path / "engine.log",
        "-m", str(model), "-c", "256", "-np", "1", "-t", "1", "--no-slots",
    )  # fmt: skip
    launched.append(server)
    wait_until(server.healthy, WAIT, "the engine's /health answers 200")
    assert http("GET", server.url + "/metrics")[0] == 501
    assert http("GET", server.url + "/slots")[0] == 501
    props = json.loads(http("GET", server.url + "/props")[2])
    assert props["total_slots"] == 1 and not props["endpoint_metrics"], props
    assert props["model_alias"] == str(model), props
    assert server.stop_by(signal.SIGINT) == 0, server.log()
    assert _port_closed(server.port)


def test_a_server_that_cannot_start_exits_naming_why(model: Path, tmp_path: Path) -> None:
    env = {k: v for k, v in os.environ.items() if k != "LLAMA_SERVER"}
    missing = subprocess.run(
        [*LAUNCHER, "--model", str(tmp_path / "none.gguf")],
        capture_output=True, text=True, timeout=30, env=env,
    )  # fmt: skip
    assert missing.returncode == 2
    assert f"--model {tmp_path / 'none.gguf'}: no such file" in missing.stderr
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = taken.getsockname()[1]
        busy = subprocess.run(
            [*LAUNCHER, "--model", str(model), "--port", str(port), "-c", "256", "-t", "1"],
            capture_output=True, text=True, timeout=WAIT, env=env,
        )  # fmt: skip
    assert busy.returncode == 1, busy.stderr
    assert f"the server did not start on 127.0.0.1:{port}" in busy.stderr, busy.stderr
