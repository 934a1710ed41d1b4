"""``python -m llmworker.sim`` as a process: events, signals, startup errors."""

from __future__ import annotations

import contextlib
import signal
import subprocess

import aiohttp
import pytest

from extproc.devstack import SimProcess, free_port, run_sim
from extproc.devstack import async_wait_until as wait_until
from extproc.events.schema import ByeEvent, ConfigEvent, LoadEvent
from tests.llmworker.support import Subscriber


async def _healthy(port: int) -> bool:
    try:
        async with (
            aiohttp.ClientSession() as http,
            http.get(f"http://127.0.0.1:{port}/health") as r,
        ):
            return r.status == 200
    except aiohttp.ClientError:
        return False


async def test_publishes_config_and_per_rank_load_then_bye_on_sigterm() -> None:
    sub = Subscriber()
    port = free_port()
    sim = SimProcess(
        [
            "--port", str(port), "--model", "m-pub", "--worker-id", "wk-pub",
            "--publish", sub.endpoint, "--kv-total-blocks", "300", "--block-size", "8",
            "--max-num-seqs", "4", "--max-num-batched-tokens", "128", "--dp-size", "2",
            "--speedup", "50", "--heartbeat", "0.5",
        ]
    )  # fmt: skip
    try:
        config = await sub.next_of(ConfigEvent, timeout=15)
        assert config == ConfigEvent(
            worker_id="wk-pub",
            model="m-pub",
            endpoint=f"127.0.0.1:{port}",
            kv_total_blocks=300,
            block_size=8,
            max_num_batched_tokens=128,
            dp_size=2,
            worker_type="decode",
        )
        ranks: dict[int, LoadEvent] = {}
        while len(ranks) < 2:
            load = await sub.next_of(LoadEvent)
            assert load.dp_rank is not None
            ranks[load.dp_rank] = load
        assert all(
            (e.active_decode_blocks, e.active_prefill_tokens) == (0, 0) for e in ranks.values()
        )
        await wait_until(lambda: _healthy(port), timeout=10, what="the sim to serve")
        body = {"model": "m-pub", "prompt": "q" * 400, "max_tokens": 30}
        async with (
            aiohttp.ClientSession() as http,
            http.post(f"http://127.0.0.1:{port}/v1/completions", json=body) as r,
        ):
            assert r.status == 200
        busy = await sub.next_of(LoadEvent)
        while not busy.active_prefill_tokens and not busy.active_decode_blocks:
            busy = await sub.next_of(LoadEvent)
        assert busy.active_prefill_tokens in (0, 100)
        idle = await sub.next_of(LoadEvent)
        while idle.dp_rank != busy.dp_rank or idle.active_decode_blocks:
            idle = await sub.next_of(LoadEvent)
        assert idle.active_prefill_tokens == 0
    finally:
        code, err = sim.stop(), sim.log()
    try:
        assert await sub.next_of(ByeEvent) == ByeEvent(worker_id="wk-pub")
    finally:
        sub.close()
    assert code == 0, err


async def test_sigint_stops_cleanly_without_publishing() -> None:
    port = free_port()
    sim = SimProcess(["--port", str(port)])
    try:
        await wait_until(lambda: _healthy(port), timeout=15, what="the sim to serve")
    finally:
        sim.send_signal(signal.SIGINT)
        # Let SIGINT alone end it: stop() would send SIGTERM to a worker still stopping.
        with contextlib.suppress(subprocess.TimeoutExpired):
            sim.popen.wait(15)
        code, err = sim.stop(), sim.log()
    assert code == 0, err


@pytest.mark.parametrize(
    ("flags", "env", "named"),
    [
        (["--engine-request-limit", "0"], {}, "--engine-request-limit='0'"),
        (["--engine-request-limit", "two"], {}, "--engine-request-limit='two'"),
        ([], {"DYN_ENGINE_REQUEST_LIMIT": "-1"}, "DYN_ENGINE_REQUEST_LIMIT='-1'"),
        (
            ["--engine-request-limit", "4"],
            {"DYN_DYNAMO_REQUEST_QUEUE_LIMIT": "1"},
            "DYN_DYNAMO_REQUEST_QUEUE_LIMIT='1'",
        ),
        (
            [],
            {"DYN_ENGINE_REQUEST_LIMIT": "4", "DYN_DYNAMO_REQUEST_QUEUE_LIMIT": "1.5"},
            "DYN_DYNAMO_REQUEST_QUEUE_LIMIT='1.5'",
        ),
        (["--kv-total-blocks", "0"], {}, "--kv-total-blocks"),
        (["--speedup", "-2"], {}, "--speedup"),
        (["--publish", "localhost:5557"], {}, "--publish"),
    ],
)
def test_bad_settings_exit_2_naming_the_setting(
    flags: list[str], env: dict[str, str], named: str
) -> None:
    result = run_sim(["--port", "0", *flags], env=env)
    assert result.returncode == 2, result.stderr
    assert named in result.stderr
    assert "Traceback" not in result.stderr
