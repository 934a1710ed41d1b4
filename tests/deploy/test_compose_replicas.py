"""``docker-compose.replicas.yml`` run for real without a container engine (network
namespaces, tests/support/compose_netns.py): two gateways and two extprocs behind one
entry point, sharing through the forwarder."""

from __future__ import annotations

import json
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from extproc.devstack import http, wait_until
from tests.support.compose_netns import Rehearsal, available

WHY_NOT = available()
pytestmark = pytest.mark.skipif(WHY_NOT is not None, reason=f"compose rehearsal: {WHY_NOT}")

ROOT = Path(__file__).resolve().parents[2]
TOKEN = "replicas-token"
MODEL = "sim-model"


@pytest.fixture(scope="module")
def compose(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Rehearsal]:
    rehearsal = Rehearsal(
        tmp_path_factory.mktemp("compose-replicas"),
        env={"EXTPROC_ADMIN_TOKEN": TOKEN, "SIM_SPEEDUP": "20"},
        compose_file=ROOT / "docker-compose.replicas.yml",
        project="replicas",
    )
    rehearsal.up(timeout=120)
    try:
        for service in ("front", "envoy", "worker"):
            for container in rehearsal.of(service):
                rehearsal.wait_healthy(container, 60)
        yield rehearsal
    finally:
        rehearsal.down()


def front(compose: Rehearsal) -> str:
    return f"http://{compose.ip('front')}:8000"


def admins(compose: Rehearsal) -> list[str]:
    return [f"http://{c.ip}:9003" for c in compose.of("extproc") if not c.stopped]


def chat(base: str) -> tuple[int, dict[str, str], bytes]:
    body = {"model": MODEL, "messages": [{"role": "user", "content": "hello"}], "max_tokens": 4}
    return http("POST", base + "/v1/chat/completions", body, timeout=30)


def thresholds(admin: str) -> Any:
    status, _, body = http("GET", admin + "/busy_threshold", timeout=5)
    assert status == 200, body
    return json.loads(body)["thresholds"]


def test_every_extproc_knows_every_worker_and_requests_flow(compose: Rehearsal) -> None:
    workers = {f"worker-{c.hostname}" for c in compose.of("worker")}
    for admin in admins(compose):
        wait_until(
            lambda a=admin: (
                workers
                <= {
                    w["worker_id"]
                    for w in json.loads(http("GET", a + "/debug/workers")[2])["workers"]
                }
            ),
            30,
            f"workers known at {admin}",
        )
    served = {chat(front(compose))[1].get("x-worker-id") for _ in range(12)}
    assert served == workers


def test_a_threshold_set_through_the_entry_point_applies_on_every_extproc(
    compose: Rehearsal,
) -> None:
    status, _, body = http(
        "POST",
        front(compose) + "/busy_threshold",
        {
            "model": MODEL,
            "active_decode_blocks_threshold": 0.0,
            "active_prefill_tokens_threshold": 0,
        },
        headers={"authorization": f"Bearer {TOKEN}"},
    )
    assert status == 200, body
    for admin in admins(compose):
        wait_until(
            lambda a=admin: thresholds(a)[0]["active_prefill_tokens_threshold"] == 0, 5, admin
        )
    # Every worker busy on every extproc (a request in flight anywhere makes its worker
    # busy everywhere; idle simulated workers report 0 and stay free): lift it again.
    status, _, body = http(
        "POST",
        front(compose) + "/busy_threshold",
        {"model": MODEL, "disable": ["active_decode_blocks_threshold",
                                     "active_prefill_tokens_threshold"]},
        headers={"authorization": f"Bearer {TOKEN}"},
    )  # fmt: skip
    assert status == 200, body
    for admin in admins(compose):
        wait_until(
            lambda a=admin: thresholds(a)[0]["active_prefill_tokens_threshold"] is None, 5, admin
        )


def routed(admin: str) -> float:
    text = http("GET", admin + "/metrics", timeout=5)[2].decode()
    for line in text.splitlines():
        if line.startswith('extproc_decisions_total{outcome="routed"}'):
            return float(line.split()[-1])
    return 0.0


def test_a_killed_extproc_leaves_the_other_deciding(compose: Rehearsal) -> None:
    victim = compose.of("extproc")[0]
    compose.kill(victim)

    def decided() -> float:
        total = 0.0
        for c in compose.of("extproc"):
            try:
                total += routed(f"http://{c.ip}:9003")
            except OSError:  # the killed one, until its restart serves
                continue
        return total

    def all_decided() -> bool:
        before = decided()
        statuses = [chat(front(compose))[0] for _ in range(5)]
        assert all(s == 200 for s in statuses), statuses
        return decided() - before == 5

    # Every request is answered throughout. The gateways' health check takes the dead
    # extproc out within about a second (meanwhile its share fails open: answered, not
    # decided); its restart, which listens for events for a second before it serves,
    # comes back into the rotation.
    wait_until(all_decided, 10, "every request decided by a live extproc")
    # The restart policy brings it back, and it learns the workers again.
    wait_until(lambda: compose.healthy(victim), 60, "the killed extproc back")
    statuses = [chat(front(compose))[0] for _ in range(10)]
    assert all(s == 200 for s in statuses), statuses
