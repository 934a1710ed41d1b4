"""``python -m loadtest.overload --engine vllm``: its settings, each engine's preemptions per
cell, and the report it writes, with plain values and a page a real vLLM printed.

The full run starts two vLLM engines (a minute on this machine before the first request) and
takes about eight minutes; its results are in docs/overload-vllm-results.md. What is checked
here is what turns vLLM's counters and the run's numbers into that report: a wrong
subtraction, a counter read from the wrong engine, or a report that leaves out a cell would
all pass unseen in a long run's prose.
"""

from __future__ import annotations

import asyncio
import json
import math
from collections.abc import Awaitable, Callable
from dataclasses import asdict
from functools import partial
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import aiohttp
import pytest
from aiohttp import web

from loadtest.overload import (
    VllmResults,
    parse_args,
    preemption_deltas,
    report,
)
from loadtest.shedbench.stats import Cell
from loadtest.shedbench.vllm_workers import VllmWorkers, max_model_len

REAL_PAGE = Path(__file__).parents[1] / "llmworker" / "data" / "vllm_metrics_real.txt"


def test_vllm_defaults_are_the_engine_shape_the_results_describe() -> None:
    cfg, plan, _ = parse_args(["--engine", "vllm"])
    assert cfg.engine == "vllm" and cfg.name == "overload-vllm"
    assert (cfg.kv_total_blocks, cfg.block_size, cfg.max_num_seqs) == (7, 128, 4)
    assert cfg.ignore_eos  # a real model may stop early; every request must cost the same
    assert cfg.loads == (1.0, 3.0, 10.0)
    assert plan is None  # no recovery rounds on vLLM by default
    # vLLM refuses to start unless one sequence of --max-model-len fits the 6 usable blocks.
    assert max_model_len(cfg) == 768
    assert max_model_len(parse_args(["--engine", "vllm", "--kv-total-blocks", "17"])[0]) == 1024
    # A request (about 100 prompt tokens and 64 output) outgrows its first block as it decodes.
    assert cfg.max_tokens + 31 + 2 * cfg.prompt_tokens > cfg.block_size


@pytest.mark.parametrize(
    ("flags", "named"),
    [
        (["--block-size", "16"], "--block-size: 16 is not vLLM's block size on CPU; expected 128"),
        (["--kv-total-blocks", "1"], "--kv-total-blocks: 1 leaves vLLM no block"),
        (["--speedup", "2"], "--speedup: 2 cannot change a real engine"),
    ],
)
def test_vllm_refuses_a_shape_it_cannot_run(
    flags: list[str], named: str, capsys: pytest.CaptureFixture[str]
) -> None:
    with pytest.raises(SystemExit) as exc:
        parse_args(["--engine", "vllm", *flags])
    assert exc.value.code == 2
    assert named in capsys.readouterr().err


def test_preemptions_are_counted_per_engine_and_a_restart_is_an_error() -> None:
    assert preemption_deltas([3.0, 0.0], [7.0, 0.0]) == [4, 0]
    assert preemption_deltas([0.0, 5.0], [2.0, 6.0]) == [2, 1]
    with pytest.raises(RuntimeError, match=r"engine 2: vllm:num_preemptions_total went down"):
        preemption_deltas([3.0, 9.0], [4.0, 0.0])
    with pytest.raises(ValueError, match="2 engines before, 1 after"):
        preemption_deltas([0.0, 0.0], [0.0])


def _cell(load: float, on: bool, preemptions: int) -> Cell:
    return Cell(
        load=load, thresholds=on, offered_rps=load * 1.5, sent_rps=load * 1.5,
        sent=round(load * 24), accepted=10, rejected=0 if not on else 12, errors=0,
        unfinished=0, goodput_rps=1.2, slo_goodput_rps=1.0 if on else 0.3,
        ttft_p50_ms=150.0, ttft_p99_ms=400.0 if on else 9000.0, e2e_p99_ms=5000.0,
        censored_p99=False, rejection_rate=0.0 if not on else 0.5,
        preemptions=preemptions, waiting_max=0.0 if on else 20.0, waiting_mean=0.0,
        kv_usage_mean=0.5, cpu={"engines": 30.0, "agents": 1.0, "other": 5.0},
    )  # fmt: skip


def _results() -> VllmResults:
    cfg, _, _ = parse_args(["--engine", "vllm"])
    per_engine = [[1, 2], [0, 0], [5, 4], [0, 1], [7, 6], [0, 0]]
    cells = [
        _cell(load, on, sum(counts))
        for (load, on), counts in zip(
            [(x, on) for x in (1.0, 3.0, 10.0) for on in (False, True)], per_engine, strict=True
        )
    ]
    return VllmResults(
        config=cfg,
        command="python -m loadtest.overload --engine vllm",
        unloaded_ttft_p50_ms=120.0,
        unloaded_ttft_p99_ms=250.0,
        unloaded_e2e_p99_ms=4000.0,
        sweep=[{"concurrency": 4, "completed_rps": 1.2}, {"concurrency": 8, "completed_rps": 1.5}],
        capacity_rps=1.5,
        knee_concurrency=8,
        cells=cells,
        seconds=480.0,
        load_average=[3.0, 4.0],
        engine_preemptions=per_engine,
        proc_loadavg=["3.01 4.50 5.02 2/160 1000", "4.02 4.10 4.90 3/170 2000"],
    )


def test_the_report_shows_each_engines_preemptions_and_the_machines_load() -> None:
    text = report(_results())
    # Every cell, each engine's count and their sum, which the main table shows too.
    for row in ("| 1x | off | 1 | 2 | 3 |", "| 3x | off | 5 | 4 | 9 |", "| 3x | on | 0 | 1 | 1 |",
                "| 10x | off | 7 | 6 | 13 |", "| 10x | on | 0 | 0 | 0 |"):  # fmt: skip
        assert row in text, row
    assert "| 10x | off | 15.0 | 1.20 | 0.30 |" in text and "| 13 | 20 / 0.0 |" in text
    assert "`vllm:num_preemptions_total`" in text
    assert "`3.01 4.50 5.02 2/160 1000`" in text and "`4.02 4.10 4.90 3/170 2000`" in text
    # The workers as they were started, and the goal judged at 3x as on llama.cpp.
    assert "--num-gpu-blocks-override 7 --max-num-seqs 4 --max-model-len 768" in text
    assert "`--engine vllm --interval 0.2 --max-num-seqs 4`" in text
    assert "Targets at 3x with thresholds on" in text
    assert "![goodput](overload-vllm-goodput.png)" in text


def test_the_json_keeps_the_per_engine_counts_and_the_load_average() -> None:
    saved = json.loads(json.dumps(asdict(_results()), default=str))
    assert saved["engine_preemptions"][4] == [7, 6]
    assert [c["preemptions"] for c in saved["cells"]] == [3, 0, 9, 1, 13, 0]
    assert saved["proc_loadavg"][0].startswith("3.01 ")
    assert saved["config"]["engine"] == "vllm"


async def _serve(pages: list[str], body: Callable[[list[str]], Awaitable[None]]) -> None:
    """One HTTP server on a free port per page, each serving its page as ``/metrics``, while
    ``body`` runs with their URLs."""
    runners: list[web.AppRunner] = []
    urls: list[str] = []
    try:
        for page in pages:
            app = web.Application()
            app.router.add_get("/metrics", partial(_page, page))
            runner = web.AppRunner(app)
            runners.append(runner)
            await runner.setup()
            site = web.TCPSite(runner, "127.0.0.1", 0)
            await site.start()
            urls.append(site.name.rstrip("/"))
        await body(urls)
    finally:
        for runner in runners:
            await runner.cleanup()


async def _page(text: str, _: web.Request) -> web.Response:
    return web.Response(text=text, content_type="text/plain")


def test_each_engines_counter_is_read_from_its_own_page() -> None:
    """A page a real vLLM printed (1 preemption, 3 running, 1 waiting, KV 1.0) on the first
    engine, the same with 4 more preemptions and an empty cache on the second."""
    real = REAL_PAGE.read_text()
    counter = 'vllm:num_preemptions_total{engine="0",model_name="smollm2"} '
    usage = 'vllm:kv_cache_usage_perc{engine="0",model_name="smollm2"} '
    assert counter + "1.0" in real and usage + "1.0" in real
    second = real.replace(counter + "1.0", counter + "5.0").replace(usage + "1.0", usage + "0.0")
    seen: dict[str, Any] = {}

    async def read(urls: list[str]) -> None:
        workers = VllmWorkers.__new__(VllmWorkers)  # the reading only: no engine started
        workers.servers = [SimpleNamespace(url=u) for u in urls]  # type: ignore[misc]
        async with aiohttp.ClientSession() as session:
            seen["counters"] = await workers.preemptions(session)
            seen["by_id"] = await workers.preempted(session)
            seen["load"] = await workers.load(session)

    asyncio.run(_serve([real, second], read))
    assert seen["counters"] == [1.0, 5.0]
    assert seen["by_id"] == {"vllm-1": 1.0, "vllm-2": 5.0}
    load = seen["load"]
    assert load.preemptions == 6.0
    assert (load.running, load.waiting) == (6.0, 2.0)
    assert math.isclose(load.kv_usage, 0.5)
