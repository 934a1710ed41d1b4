"""CURVE on the event plane with real ZeroMQ sockets: admitted, refused and counted."""

from __future__ import annotations

import asyncio
import stat
import time
from pathlib import Path

import pytest

from extproc.core.busy import BusyThresholds
from extproc.core.pool import WorkerPool
from extproc.devstack import free_port
from extproc.events.curve import CurveClient, CurveKeyError, CurveServer, check_publisher_dir
from extproc.events.keys import main as keys_main
from extproc.events.publisher import EventPublisher
from extproc.events.schema import ConfigEvent
from extproc.events.subscriber import EventSubscriber
from extproc.metrics.registry import Metrics


@pytest.fixture
def keys(tmp_path: Path) -> Path:
    """Key pairs for the extproc and two publishers; only ``good`` is admitted."""
    for name in ("extproc", "good", "stranger"):
        assert keys_main([str(tmp_path / "keys"), name]) == 0
    admitted = tmp_path / "publishers"
    admitted.mkdir()
    (admitted / "good.key").write_bytes((tmp_path / "keys" / "good.key").read_bytes())
    return tmp_path


def config(worker_id: str) -> ConfigEvent:
    return ConfigEvent(worker_id=worker_id, model="m", endpoint=f"127.0.0.1:{free_port()}")


async def until(cond: object, timeout: float = 5.0) -> None:
    deadline = time.monotonic() + timeout
    while not cond():  # type: ignore[operator]
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out after {timeout}s")
        await asyncio.sleep(0.01)


def refused(metrics: Metrics, reason: str) -> float:
    value = metrics.registry.get_sample_value("extproc_events_refused_total", {"reason": reason})
    return value or 0.0


async def test_only_admitted_publishers_change_the_pool(keys: Path) -> None:
    pool, metrics = WorkerPool(BusyThresholds()), Metrics()
    server = CurveServer(
        keys / "keys" / "extproc.key_secret",
        keys / "publishers",
        lambda reason: metrics.refused[reason].inc(),
    )
    sub = EventSubscriber(pool, metrics, curve=server)
    endpoint = f"tcp://127.0.0.1:{free_port()}"
    await sub.start([endpoint], [])
    server_key = keys / "keys" / "extproc.key"
    intruders = [
        # a key the extproc does not admit
        EventPublisher(
            endpoint,
            config("stranger"),
            curve=CurveClient.from_files(keys / "keys" / "stranger.key_secret", server_key),
        ),
        # no CURVE at all
        EventPublisher(endpoint, config("plain")),
        # an admitted key, but not the extproc's public key
        EventPublisher(
            endpoint,
            config("wrong-server"),
            curve=CurveClient.from_files(
                keys / "keys" / "good.key_secret", keys / "keys" / "stranger.key"
            ),
        ),
    ]
    try:
        for pub in intruders:
            await pub.start()
        await until(lambda: refused(metrics, "unknown_key") >= 1)
        await until(lambda: refused(metrics, "handshake_failed") >= 2)
        good = EventPublisher(
            endpoint,
            config("good"),
            curve=CurveClient.from_files(keys / "keys" / "good.key_secret", server_key),
        )
        async with good:
            await until(lambda: "good" in pool.workers)
            good.update_load(0, active_decode_blocks=3)
            await until(lambda: pool.workers["good"].ranks[0].reported_blocks == 3)
        # The refused publishers kept trying (reconnects) and still changed nothing.
        assert set(pool.workers) <= {"good"}
        assert refused(metrics, "unknown_key") >= 1
    finally:
        for pub in intruders:
            await pub.close()
        sub.close()


def test_key_files_are_checked_and_named(keys: Path) -> None:
    with pytest.raises(CurveKeyError, match="holds no secret key"):
        CurveClient.from_files(keys / "keys" / "good.key", keys / "keys" / "extproc.key")
    with pytest.raises(CurveKeyError, match=r"missing\.key_secret"):
        CurveClient.from_files(keys / "missing.key_secret", keys / "keys" / "extproc.key")
    empty = keys / "empty"
    empty.mkdir()
    with pytest.raises(CurveKeyError, match=r"holds no '\*\.key' public key files"):
        check_publisher_dir(empty)
    with pytest.raises(CurveKeyError, match="is not a directory"):
        check_publisher_dir(keys / "keys" / "good.key")


def test_keys_command_writes_a_private_secret_and_never_overwrites(
    keys: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    secret = keys / "keys" / "good.key_secret"
    assert stat.S_IMODE(secret.stat().st_mode) == 0o600
    before = secret.read_bytes()
    with pytest.raises(SystemExit) as exc:
        keys_main([str(keys / "keys"), "good"])
    assert exc.value.code == 2
    assert "exists; not overwriting" in capsys.readouterr().err
    assert secret.read_bytes() == before
