"""Shared fixtures: the real Envoy, the extproc service and echo workers on 127.0.0.1."""

from __future__ import annotations

import os
import signal
from collections.abc import Iterator
from pathlib import Path

import pytest

from extproc.devstack import Envoy, Extproc, Proc, Publisher, start_echo_worker
from extproc.devstack.procs import _HANDED_OUT, _fixed_ports

# Every extproc a test starts serves at once instead of after the 1-s startup grace (its
# wait for the workers' publishers to reconnect after a restart), a second saved per start.
# A test about a restart passes ``--startup-grace`` itself; exporting the variable wins.
os.environ.setdefault("EXTPROC_STARTUP_GRACE", "0")

# The ext_proc servers a module's stack runs on: the builtin one (default) and grpcio's.
GRPC_SERVERS = ["builtin", "grpcio"]
ECHO_STOP_GRACE_S = 2.0


@pytest.fixture(scope="session")
def log_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return tmp_path_factory.mktemp("logs")


@pytest.fixture(scope="session")
def echo_workers(log_dir: Path) -> Iterator[dict[str, int]]:
    """Three echo workers by name -> port, shared by the whole session."""
    procs: list[Proc] = []
    ports: dict[str, int] = {}
    for name in ("a", "b", "c"):
        proc, port = start_echo_worker(log_dir, name)
        procs.append(proc)
        ports[name] = port
    yield ports
    # A worker still holding a hung request (x-test-hang) waits out aiohttp's graceful
    # shutdown: signal them all at once, so that they wind down together, and give each a
    # short grace before the kill instead of 10 s one after the other.
    for proc in procs:
        proc.send_signal(signal.SIGTERM)
    for proc in procs:
        proc.stop(timeout=ECHO_STOP_GRACE_S)


class Stack:
    """Envoy -> extproc -> echo workers, plus a publisher into the extproc."""

    def __init__(
        self,
        log_dir: Path,
        workers: dict[str, int],
        args: list[str],
        env: dict[str, str] | None = None,
    ) -> None:
        self.workers = workers
        self.ext = Extproc(log_dir, args, env)
        self.envoy = Envoy(log_dir, self.ext, list(workers.values()))
        self.pub = Publisher(self.ext.event_endpoint)

    def endpoint(self, name: str) -> str:
        return f"127.0.0.1:{self.workers[name]}"

    def close(self) -> None:
        self.pub.close()
        self.envoy.stop()
        self.ext.stop()


@pytest.fixture(scope="module")
def make_stack(log_dir: Path, echo_workers: dict[str, int]) -> Iterator[type]:
    """Factory for stacks with given extproc flags; all are stopped at module end."""
    made: list[Stack] = []

    def factory(args: list[str], env: dict[str, str] | None = None) -> Stack:
        stack = Stack(log_dir, echo_workers, args, env)
        made.append(stack)
        return stack

    yield factory  # type: ignore[misc]
    # Signal every process first: each winds down its open streams while the others do.
    for stack in made:
        stack.envoy.proc.send_signal(signal.SIGTERM)
        stack.ext.proc.send_signal(signal.SIGTERM)
    for stack in made:
        stack.close()


# Test folders whose every test runs the real Envoy (or a whole stack); elsewhere a test is
# marked by using the stack fixtures. ``make test-unit`` deselects the ``envoy`` marker.
ENVOY_DIRS = {"integration", "deploy", "loadtest"}
STACK_FIXTURES = {"make_stack", "echo_workers"}
TESTS = Path(__file__).resolve().parent


# ``make test``'s two processes (pytest-xdist, a module per process at a time, in this
# order: ``--no-loadscope-reorder``) take the longest modules first, so that no long module
# starts last and leaves the other process idle until it ends: the modules that took 12 s or
# more in one ``make test`` on 2 cores (seconds, setup included), longest first; then the
# folders of the other benchmarks and whole stacks; then the rest.
LONG_MODULES = {
    "integration/test_vllm.py": 194,
    "loadtest/test_slo_bench.py": 72,
    "core/test_deadline.py": 70,
    "integration/test_faults.py": 69,
    "loadtest/test_soak.py": 64,
    "loadtest/test_overload_llamacpp.py": 57,
    "admin/test_status_page.py": 57,
    "deploy/test_devstack_vllm.py": 56,
    "loadtest/test_overload_bench.py": 42,
    "integration/test_latency_target.py": 39,
    "deploy/test_compose_rehearsal.py": 38,
    "integration/test_llamacpp.py": 30,
    "deploy/test_devstack.py": 30,
    "integration/test_track_output_blocks.py": 27,
    "deploy/test_prometheus_grafana.py": 25,
    "loadtest/test_locustfile.py": 22,
    "integration/test_epp_deadline.py": 21,
    "deploy/test_devstack_llamacpp.py": 19,
    "handlers/test_router_queue.py": 18,
    "integration/test_served_host.py": 18,
    "deploy/test_compose_vllm.py": 17,
    "integration/test_llamacpp_deadline.py": 17,
    "integration/test_request_path.py": 17,
    "integration/test_extproc_restart.py": 13,
    "integration/test_replicas.py": 12,
}
LONG_FIRST = ("loadtest", "integration", "deploy")


def pytest_configure(config: pytest.Config) -> None:
    _own_ports_only()


def _own_ports_only() -> None:
    """Under pytest-xdist, each process hands out only its own share of the free ports
    (port modulo the number of processes): two processes never pick the same one between
    its check and its server's bind."""
    worker = os.environ.get("PYTEST_XDIST_WORKER", "")
    count = int(os.environ.get("PYTEST_XDIST_WORKER_COUNT", "1"))
    if not worker.startswith("gw") or count < 2:
        return
    index = int(worker[2:])
    _HANDED_OUT.update(p for p in _fixed_ports() if p % count != index)


# Modules that time the real engine against itself (a slowdown's ratio), or hold a class's
# admitted share to a bar at a capacity given in requests per second: another test's load
# beside them skews it. ``make test`` runs them alone, with the ``serial`` marker.
SERIAL_MODULES = {"loadtest/test_slo_llamacpp.py", "loadtest/test_mixed_bench.py"}


def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    for item in items:
        relative = item.path.relative_to(TESTS)
        folder = relative.parts[0]
        if folder in ENVOY_DIRS or STACK_FIXTURES & set(getattr(item, "fixturenames", ())):
            item.add_marker(pytest.mark.envoy)
        if relative.as_posix() in SERIAL_MODULES:
            item.add_marker(pytest.mark.serial)

    def rank(item: pytest.Item) -> tuple[int, int]:
        relative = item.path.relative_to(TESTS)
        folder = relative.parts[0]
        return (
            -LONG_MODULES.get(relative.as_posix(), 0),
            LONG_FIRST.index(folder) if folder in LONG_FIRST else len(LONG_FIRST),
        )

    items.sort(key=rank)  # stable: each module's own order is kept
