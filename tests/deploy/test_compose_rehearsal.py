"""``docker-compose.yml`` run for real, without a container engine.

Each container is a process in a network namespace of its own on one bridge, with its own
hostname and a DNS server that answers service names with every replica's address
(``tests/support/compose_netns.py``). The services run the commands ``docker-compose
config`` renders, in dependency order, gated by their own health checks, restarted by their
restart policies. So this checks what no container-free test can: that the worker command
announces an address Envoy's DNS cluster has as a member, that scaling adds and removes
members on both sides, that the health checks pass, that a restarted extproc learns the
workers again, and that the locust service drives Envoy by its service name.
"""

from __future__ import annotations

import collections
import concurrent.futures
import json
import os
import signal
import subprocess
import threading
import time
import urllib.parse
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from extproc.devstack import http, metric_value, wait_until
from extproc.devstack.llamacpp import is_engine
from tests.support.compose_netns import Container, Rehearsal, available

WHY_NOT = available()
pytestmark = pytest.mark.skipif(WHY_NOT is not None, reason=f"compose rehearsal: {WHY_NOT}")

TOKEN = "rehearsal-token"
MODEL = "sim-model"
OVERLOAD_BODY = {"message": "Service temporarily overloaded", "type": "Overloaded", "code": 529}


@pytest.fixture(scope="module")
def compose(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Rehearsal]:
    rehearsal = Rehearsal(
        tmp_path_factory.mktemp("compose"),
        env={"EXTPROC_ADMIN_TOKEN": TOKEN},
        profiles=("loadtest",),
    )
    rehearsal.up(timeout=90)
    try:
        yield rehearsal
    finally:
        rehearsal.down()


def _envoy(compose: Rehearsal) -> str:
    return f"http://{compose.ip('envoy')}:8000"


def _admin(compose: Rehearsal) -> str:
    return f"http://{compose.ip('extproc')}:9003"


def _workers(compose: Rehearsal) -> dict[str, str]:
    """worker id -> announced endpoint, as the extproc knows them."""
    status, _, body = http("GET", _admin(compose) + "/debug/workers", timeout=5)
    assert status == 200, body
    return {w["worker_id"]: w["endpoint"] for w in json.loads(body)["workers"]}


def _expected_workers(compose: Rehearsal) -> dict[str, str]:
    """What each running worker container should announce: its hostname and address."""
    return {f"worker-{c.hostname}": f"{c.ip}:8000" for c in compose.of("worker") if not c.stopped}


def _chat(base: str, max_tokens: int = 8, timeout: float = 30.0) -> tuple[int, str, bytes]:
    status, headers, body = http(
        "POST",
        base + "/v1/chat/completions",
        {"model": MODEL, "messages": [{"role": "user", "content": "hello " * 100}],
         "max_tokens": max_tokens},
        timeout=timeout,
    )  # fmt: skip
    return status, headers.get("x-worker-id", ""), body


Result = tuple[int, str, bytes]  # status, x-worker-id, body


def _burst(base: str, count: int, concurrency: int, max_tokens: int) -> list[Result]:
    with concurrent.futures.ThreadPoolExecutor(concurrency) as pool:
        return list(pool.map(lambda _: _chat(base, max_tokens), range(count)))


def _envoy_members(compose: Rehearsal) -> set[str]:
    """Members of Envoy's ``workers`` cluster, from its admin (loopback of its namespace)."""
    envoy = compose.of("envoy")[0]
    out = subprocess.run(
        ["ip", "netns", "exec", envoy.ns, "curl", "-s", "-m", "3",
         "http://127.0.0.1:9901/clusters?format=json"],
        capture_output=True, text=True, timeout=10, check=True,
    ).stdout  # fmt: skip
    members = set()
    for cluster in json.loads(out)["cluster_statuses"]:
        if cluster["name"] == "workers":
            for host in cluster.get("host_statuses", []):
                addr = host["address"]["socket_address"]
                members.add(f"{addr['address']}:{addr['port_value']}")
    return members


def metric(admin: str, series: str) -> float:
    """One sample of the extproc's /metrics, by its exact series text; 0 if absent."""
    for line in http("GET", admin + "/metrics")[2].decode().splitlines():
        if line.startswith(series + " "):
            return float(line.split()[-1])
    return 0.0


def _set_threshold(compose: Rehearsal, **values: Any) -> tuple[int, bytes]:
    status, _, body = http(
        "POST",
        _envoy(compose) + "/busy_threshold",
        {"model": MODEL, **values},
        headers={"authorization": f"Bearer {TOKEN}"},
    )
    return status, body


def test_every_service_passes_its_health_check(compose: Rehearsal) -> None:
    names = collections.Counter(c.service for c in compose.containers)
    assert names == {"extproc": 1, "worker": 2, "envoy": 1, "locust": 1}  # deploy.replicas: 2
    for c in compose.containers:
        compose.wait_healthy(c, timeout=30)


def test_workers_announce_their_own_address_and_envoy_has_it_as_a_member(
    compose: Rehearsal,
) -> None:
    expected = _expected_workers(compose)
    wait_until(lambda: _workers(compose) == expected, 15, f"extproc to know {expected}")
    wait_until(lambda: _envoy_members(compose) == set(expected.values()), 15, "Envoy members")


def test_requests_through_envoy_reach_every_replica(compose: Rehearsal) -> None:
    results = _burst(_envoy(compose), count=24, concurrency=8, max_tokens=16)
    assert [r[0] for r in results] == [200] * 24, [r for r in results if r[0] != 200][:3]
    served = collections.Counter(r[1] for r in results)
    assert set(served) == set(_expected_workers(compose)), served
    # Envoy names the host that served each response by its DNS-resolved address: the one
    # the worker announced, so the extproc finds it among its workers (an address it did not
    # know would be counted here as "unknown").
    status, _, body = http("GET", _admin(compose) + "/metrics", timeout=5)
    assert status == 200
    unknown = metric_value(
        body.decode(), "extproc_served_elsewhere_total", {"model": MODEL, "served": "unknown"}
    )
    assert unknown is None, unknown


def test_admin_writes_need_the_token_and_every_busy_replica_means_529(compose: Rehearsal) -> None:
    status, _, body = http(
        "POST", _envoy(compose) + "/busy_threshold",
        {"model": MODEL, "active_decode_blocks_threshold": 0.01},
    )  # fmt: skip
    assert status == 401, body
    status, body = _set_threshold(compose, active_decode_blocks_threshold=0.01)
    assert status == 200, body
    try:
        # 0.01 x 1024 blocks: one 100-token prompt with its output fills a worker.
        results = _burst(_envoy(compose), count=40, concurrency=20, max_tokens=40)
        codes = collections.Counter(r[0] for r in results)
        assert set(codes) == {200, 529}, codes
        assert codes[529] >= 20, codes
        for status, _, body in results:
            if status == 529:
                assert json.loads(body) == OVERLOAD_BODY
    finally:
        status, body = _set_threshold(compose, disable=["active_decode_blocks_threshold"])
        assert status == 200, body
    assert _chat(_envoy(compose))[0] == 200


def test_scaling_up_adds_a_worker_on_both_sides(compose: Rehearsal) -> None:
    (added,) = compose.scale_to("worker", 3)
    compose.wait_healthy(added, timeout=30)
    expected = _expected_workers(compose)
    assert len(expected) == 3
    wait_until(lambda: _workers(compose) == expected, 15, "the extproc to know the new worker")
    # The workers cluster re-resolves every 2 s.
    wait_until(lambda: added.ip + ":8000" in _envoy_members(compose), 15, "Envoy to add it")
    new_id = f"worker-{added.hostname}"

    def served_by_new() -> bool:
        return any(r[1] == new_id for r in _burst(_envoy(compose), 12, 6, 16))

    wait_until(served_by_new, 20, f"a request served by {new_id}")


class Traffic:
    """Chat requests through Envoy, six at a time, from a thread, until ``stop()`` or a
    bound (``seconds``, ``limit`` requests), whichever comes first."""

    def __init__(self, base: str, seconds: float = 20.0, limit: int = 3000) -> None:
        self.results: list[Result] = []
        self.started: list[float] = []  # when each request of ``results`` was sent
        self._base, self._limit = base, limit
        self._until = time.monotonic() + seconds
        self._done = threading.Event()
        self._thread = threading.Thread(target=self._run)
        self._thread.start()
        wait_until(lambda: len(self.results) >= 12, 10, "traffic to flow")

    def _run(self) -> None:
        with concurrent.futures.ThreadPoolExecutor(6) as pool:
            while (
                not self._done.is_set()
                and time.monotonic() < self._until
                and len(self.results) < self._limit
            ):
                for sent, result in pool.map(self._timed, range(6)):
                    self.started.append(sent)
                    self.results.append(result)

    def _timed(self, _: int) -> tuple[float, Result]:
        return time.monotonic(), _chat(self._base, 24)

    def stop(self) -> list[Result]:
        """Let it run for one more round of requests, stop, and return every result."""
        seen = len(self.results)
        wait_until(lambda: len(self.results) >= seen + 6, 15, "one more round of requests")
        self._done.set()
        self._thread.join(30)
        return self.results


def _failed(results: list[Result]) -> str | None:
    bad = [(s, w, b[:200]) for s, w, b in results if s != 200]
    return f"{len(bad)} of {len(results)} failed, e.g. {bad[:3]}" if bad else None


def test_scaling_down_under_traffic_loses_no_request(compose: Rehearsal) -> None:
    running = [c for c in compose.of("worker") if not c.stopped]
    assert len(running) == 3, "runs after the scale-up test"
    leaving = running[-1]
    traffic = Traffic(_envoy(compose))
    assert compose.scale_to("worker", 2) == []  # stops the last replica (docker stop)
    assert leaving.stopped
    assert leaving.popen is not None and leaving.popen.returncode == 0, leaving.log()[-2000:]
    results = traffic.stop()
    assert not _failed(results), _failed(results)
    # It said bye: gone from the extproc at once, and from Envoy's DNS answer.
    assert f"worker-{leaving.hostname}" not in _workers(compose)
    wait_until(lambda: leaving.ip + ":8000" not in _envoy_members(compose), 15, "Envoy drop")


def test_a_crashed_worker_fails_only_what_it_was_serving(compose: Rehearsal) -> None:
    crashing = next(c for c in compose.of("worker") if not c.stopped)
    traffic = Traffic(_envoy(compose))
    restarts = crashing.restarts
    compose.kill(crashing)  # SIGKILL: no bye, its port refuses until it is back
    killed_at = time.monotonic()
    wait_until(lambda: crashing.restarts > restarts, 15, "a restart")
    compose.wait_healthy(crashing, timeout=30)
    results = traffic.stop()
    # Requests sent after the crash were retried on the next listed worker (connect-failure).
    after = [r for sent, r in zip(traffic.started, results, strict=True) if sent > killed_at]
    assert len(after) >= 12, len(after)
    assert not _failed(after), _failed(after)
    # Requests it was serving at the crash may fail; no more than were in flight.
    timed = list(zip(traffic.started, results, strict=True))
    assert sum(r[0] != 200 for sent, r in timed if sent <= killed_at) <= 6
    # Same hostname after the restart: the same worker id, announced again.
    expected = _expected_workers(compose)
    wait_until(lambda: _workers(compose) == expected, 15, "the worker to re-announce")


def test_a_killed_extproc_is_restarted_and_no_request_fails(compose: Rehearsal) -> None:
    extproc = compose.of("extproc")[0]
    old_pid, restarts = extproc.pid, extproc.restarts
    traffic = Traffic(_envoy(compose))
    compose.kill(extproc)
    wait_until(lambda: extproc.restarts > restarts and extproc.running(), 15, "a restart")
    assert extproc.pid != old_pid
    compose.wait_healthy(extproc, timeout=30)
    # The workers' publishers reconnect and send their config again to the new subscriber.
    expected = _expected_workers(compose)
    wait_until(lambda: _workers(compose) == expected, 15, "the workers to re-announce")
    # While it was gone Envoy failed open (failure_mode_allow: round robin to the workers).
    results = traffic.stop()
    assert not _failed(results), _failed(results)
    routed = wait_until(
        lambda: metric(_admin(compose), 'extproc_decisions_total{outcome="routed"}'),
        15, "the new extproc to route a request",
    )  # fmt: skip
    assert routed > 0


def test_locust_service_drives_envoy_by_its_service_name(compose: Rehearsal) -> None:
    locust = f"http://{compose.ip('locust')}:8089"
    form = urllib.parse.urlencode({"user_count": 4, "spawn_rate": 4}).encode()
    status, _, body = http(
        "POST", locust + "/swarm", form,
        headers={"content-type": "application/x-www-form-urlencoded"},
    )  # fmt: skip
    assert status == 200, body
    try:

        def stats() -> dict[str, Any]:
            data: dict[str, Any] = json.loads(http("GET", locust + "/stats/requests")[2])
            return data

        def enough() -> dict[str, Any] | None:
            data = stats()
            total = next(s for s in data["stats"] if s["name"] == "Aggregated")
            return data if total["num_requests"] >= 20 else None

        data = wait_until(enough, 30, "locust to make 20 requests")
        total = next(s for s in data["stats"] if s["name"] == "Aggregated")
        assert total["num_failures"] == 0, data.get("errors")
        # The locustfile's own entries: time to first token of the streaming users.
        assert any(s["method"] == "TTFT" for s in data["stats"]), data["stats"]
    finally:
        http("GET", locust + "/stop")


def test_down_stops_every_container_with_exit_0(compose: Rehearsal) -> None:
    codes = compose.down()
    assert codes and all(rc == 0 for rc in codes.values()), codes
    namespaces = subprocess.run(["ip", "netns", "list"], capture_output=True, text=True).stdout
    assert compose.containers[0].ns.split("-")[0] not in namespaces
    assert not any(Path("/etc/netns", c.ns).exists() for c in compose.containers)


# --- the llama.cpp worker (profile llamacpp) ------------------------------------------------


def _llama_server_pid(container: Container) -> int | None:
    """The engine process of the container (its processes share its session): the
    launcher, or the llama-server binary it became."""
    out = subprocess.run(
        ["ps", "-ww", "-eo", "pid=,sid=,args="], capture_output=True, text=True
    ).stdout
    for line in out.splitlines():
        pid, sid, args = line.split(None, 2)
        if int(sid) == container.pid and is_engine(args.split()):
            return int(pid)
    return None


def test_llamacpp_profile_serves_smollm2_beside_the_simulated_workers(tmp_path: Path) -> None:
    """``--profile llamacpp``: the engine and its agent in one container, a member of Envoy's
    worker pool by the alias; requests for each model reach its own workers; a dead engine
    takes the container down and the restart policy brings both back; down is clean."""
    try:
        from extproc.devstack.llamacpp import engine_command, smollm2_model

        engine_command()
        smollm2_model()
    except RuntimeError as exc:  # EngineMissing
        if os.environ.get("CI"):
            pytest.fail(f"the real engine is required under CI: {exc}", pytrace=False)
        pytest.skip(f"the real engine is not installed: {exc}")
    compose = Rehearsal(tmp_path, profiles=("llamacpp",), scale={"worker": 1})
    compose.up(timeout=120)
    try:
        llama = compose.of("llamacpp")[0]
        compose.wait_healthy(llama, timeout=60)
        sim = compose.of("worker")[0]
        expected = {
            f"llamacpp-{llama.hostname}": f"{llama.ip}:8000",
            f"worker-{sim.hostname}": f"{sim.ip}:8000",
        }
        wait_until(lambda: _workers(compose) == expected, 30, f"extproc to know {expected}")
        wait_until(lambda: _envoy_members(compose) == set(expected.values()), 15, "members")

        def chat(model: str) -> tuple[int, dict[str, str], bytes]:
            body = {"model": model, "messages": [{"role": "user", "content": "Hello"}],
                    "max_tokens": 16}  # fmt: skip
            return http("POST", _envoy(compose) + "/v1/chat/completions", body, timeout=60)

        status, _, body = chat("smollm2")
        assert status == 200, body
        reply = json.loads(body)
        assert reply["model"] == "smollm2" and reply["choices"][0]["message"]["content"]
        status, headers, body = chat(MODEL)
        assert (status, headers.get("x-worker-id")) == (200, f"worker-{sim.hostname}"), body

        engine = _llama_server_pid(llama)
        assert engine is not None, llama.log()[-2000:]
        os.kill(engine, signal.SIGKILL)
        wait_until(lambda: llama.restarts >= 1, 30, "the container restarted by its policy")
        compose.wait_healthy(llama, timeout=60)
        wait_until(lambda: _workers(compose) == expected, 30, "the llama.cpp worker back")
        assert chat("smollm2")[0] == 200
    finally:
        codes = compose.down()
    assert codes and all(rc == 0 for rc in codes.values()), codes
