"""--router-track-output-blocks with a worker that publishes no load (docs/routing.md).

The simulated engine runs without --publish: only its config is announced, so the
router's own estimate is all the decode-block check sees. Long generations grow the
KV use of each request. With the flag, the estimate grows with the streamed tokens
and the worker turns busy (529) before its KV cache overflows; without it, the
estimate stays at the prompt blocks, nothing is rejected and the engine preempts.
"""

from __future__ import annotations

import asyncio
import re
from pathlib import Path

import aiohttp
import pytest

from extproc.devstack import (
    PYTHON,
    ROOT,
    Envoy,
    Extproc,
    Proc,
    Publisher,
    free_port,
    http,
    wait_until,
)

KV_BLOCKS = 64
# Slow enough, with the limit at 70 % of the cache, that the streamed tokens reach the
# extproc well before the cache fills even on a machine loaded well past its cores: the
# 19 blocks (304 tokens) between the limit (44) and a full cache take the engine about 0.3 s
# with five requests decoding.
SPEEDUP = 4
THRESHOLD = 0.7


def _sim(log_dir: Path, name: str) -> tuple[Proc, int]:
    port = free_port()
    proc = Proc(
        name,
        [
            PYTHON,
            "-m",
            "llmworker.sim",
            "--host",
            "127.0.0.1",
            "--port",
            str(port),
            "--model",
            "m",
            "--worker-id",
            name,
            "--kv-total-blocks",
            str(KV_BLOCKS),
            "--block-size",
            "16",
            "--max-num-seqs",
            "32",
            "--max-num-batched-tokens",
            "256",
            "--dp-size",
            "1",
            "--speedup",
            str(SPEEDUP),
        ],
        log_dir,
    )
    wait_until(
        lambda: http("GET", f"http://127.0.0.1:{port}/health", timeout=1)[0] == 200, 15, "sim up"
    )
    return proc, port


def _engine(port: int) -> tuple[float, float]:
    text = http("GET", f"http://127.0.0.1:{port}/metrics")[2].decode()

    def value(name: str) -> float:
        m = re.search(rf"^{re.escape(name)}(?:{{[^}}]*}})? (\S+)$", text, re.M)
        return float(m.group(1)) if m else 0.0

    return value("vllm:num_preemptions_total"), value("vllm:kv_cache_usage_perc")


async def _drive(url: str, sim_port: int, n: int) -> list[tuple[int, float, float]]:
    """Start n long generations 40 ms apart; per request: status and the engine's
    preemption count and KV usage when the reply status arrived."""
    out: list[tuple[int, float, float]] = []
    body = {"model": "m", "prompt": "x" * 64, "max_tokens": 240, "stream": True}

    async def one(session: aiohttp.ClientSession, delay: float) -> None:
        await asyncio.sleep(delay)
        async with session.post(url + "/v1/completions", json=body) as resp:
            preempt, usage = await asyncio.to_thread(_engine, sim_port)
            out.append((resp.status, preempt, usage))
            await resp.read()

    async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=60)) as session:
        await asyncio.gather(*(one(session, i * 0.04) for i in range(n)))
    return out


@pytest.mark.parametrize("track", [True, False], ids=["flag-on", "flag-off"])
async def test_long_outputs_rejected_before_kv_overflow_only_with_the_flag(
    tmp_path: Path, track: bool
) -> None:
    sim, sim_port = _sim(tmp_path, f"sim-{track}")
    args = ["--active-decode-blocks-threshold", str(THRESHOLD), "--worker-ttl", "120"]
    ext = Extproc(tmp_path, [*args, "--router-track-output-blocks"] if track else args)
    # Output tokens are counted from streamed bodies: the observer config.
    envoy = Envoy(tmp_path, ext, [sim_port], source=ROOT / "envoy" / "envoy-track-output.yaml")
    pub = Publisher(ext.event_endpoint)
    try:
        pub.announce(
            ext, "sim", "m", f"127.0.0.1:{sim_port}", kv_total_blocks=KV_BLOCKS, block_size=16
        )
        results = await _drive(envoy.url, sim_port, 14)
        statuses = [r[0] for r in results]
        preemptions, _ = _engine(sim_port)
        if track:
            rejected = [r for r in results if r[0] == 529]
            assert rejected, statuses
            first = rejected[0]
            assert first[1] == 0, f"engine preempted before the first 529: {results}"
            assert first[2] < 1.0, f"KV full before the first 529: {results}"
        else:
            assert 529 not in statuses, statuses
            assert preemptions > 0, "expected the engine's KV cache to overflow without the flag"

        def released() -> bool:
            est = ext.workers()["sim"]["ranks"][0]["router_estimate"]
            return est == {
                "requests_in_flight": 0,
                "active_decode_blocks": 0,
                "active_prefill_tokens": 0,
            }

        await asyncio.to_thread(wait_until, released, 10, "estimate back to 0")
    finally:
        pub.close()
        envoy.stop()
        ext.stop()
        sim.stop()
