"""The sidecar agent: metrics parsing, the event mapping, and the agent against real engines.

Fixtures under ``fixtures/`` are ``/metrics`` pages in the shape vLLM (V1 engine, two
data-parallel engines) and SGLang (``--enable-metrics``, DP attention, two ranks) print.
"""

from __future__ import annotations

import asyncio
import logging
import sys
import time
from collections.abc import AsyncIterator
from dataclasses import dataclass
from pathlib import Path

import aiohttp
import pytest
from aiohttp import web
from yarl import URL

from extproc.devstack import AgentProcess, SimProcess, free_port
from extproc.devstack import async_wait_until as wait_until
from extproc.events.schema import ByeEvent, ConfigEvent, LoadEvent
from llmworker.agent import Agent, RankLoad, worker_view
from llmworker.agent_settings import AgentSettings, parse_args
from llmworker.engine_metrics import (
    Engine,
    EngineSnapshot,
    MetricsParseError,
    RankStats,
    parse_engine_metrics,
    parse_text,
)
from tests.llmworker.support import Subscriber

FIXTURES = Path(__file__).parent / "fixtures"
VLLM_TEXT = (FIXTURES / "vllm_metrics.txt").read_text()
SGLANG_TEXT = (FIXTURES / "sglang_metrics.txt").read_text()
OVERLOAD_BODY = (
    b'{"message":"Server overloaded: worker at capacity","type":"Overloaded","code":529}'
)


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


# --- parsing ------------------------------------------------------------------------------


def test_vllm_fixture_parses_into_per_engine_snapshot() -> None:
    assert parse_engine_metrics("vllm", VLLM_TEXT) == EngineSnapshot(
        engine="vllm",
        ranks=(
            RankStats(
                rank=0,
                num_running=3,
                num_waiting=2,
                kv_usage=0.2514,
                kv_total_blocks=27355,
                block_size=16,
                avg_prompt_tokens=51234 / 87,
                num_preemptions=4,
                requests_waiting=2,
                slots_active=3,
            ),
            RankStats(
                rank=1,
                num_running=1,
                num_waiting=0,
                kv_usage=0.0581,
                kv_total_blocks=27355,
                block_size=16,
                avg_prompt_tokens=540.0,
                num_preemptions=0,
                requests_waiting=0,
                slots_active=1,
            ),
        ),
    )


def test_sglang_fixture_parses_into_per_dp_rank_snapshot() -> None:
    assert parse_engine_metrics("sglang", SGLANG_TEXT) == EngineSnapshot(
        engine="sglang",
        ranks=(
            RankStats(
                rank=0,
                num_running=12,
                num_waiting=3,
                kv_usage=0.25,
                kv_used_tokens=131072,
                kv_total_tokens=524288,
                avg_prompt_tokens=1536.0,
                num_preemptions=2,
                requests_waiting=3,
                slots_active=12,
            ),
            RankStats(
                rank=1,
                num_running=5,
                num_waiting=0,
                kv_usage=0.08,
                kv_used_tokens=40000,
                kv_total_tokens=524288,
                avg_prompt_tokens=1536.0,
                num_preemptions=0,
                requests_waiting=0,
                slots_active=5,
            ),
        ),
    )


def test_vllm_fixture_maps_to_config_and_per_rank_loads() -> None:
    view = worker_view(parse_engine_metrics("vllm", VLLM_TEXT), _settings())
    assert (view.block_size, view.kv_total_blocks, view.dp_size) == (16, 27355, 2)
    assert view.max_num_batched_tokens is None
    assert view.loads == {
        0: RankLoad(active_decode_blocks=6877, active_prefill_tokens=1178),  # 2 waiting x 588.9
        1: RankLoad(active_decode_blocks=1589, active_prefill_tokens=0),
    }


def test_sglang_fixture_maps_tokens_to_blocks_of_the_given_size() -> None:
    snapshot = parse_engine_metrics("sglang", SGLANG_TEXT)
    view = worker_view(snapshot, _settings(engine="sglang"))
    assert (view.block_size, view.kv_total_blocks, view.dp_size) == (16, 32768, 2)
    assert view.loads == {0: RankLoad(8192, 4608), 1: RankLoad(2500, 0)}
    view = worker_view(
        snapshot,
        _settings("--block-size", "64", "--max-num-batched-tokens", "8192", engine="sglang"),
    )
    assert (view.block_size, view.kv_total_blocks, view.max_num_batched_tokens) == (64, 8192, 8192)
    assert view.loads == {0: RankLoad(2048, 4608), 1: RankLoad(625, 0)}


def test_proxy_count_raises_the_prefill_estimate() -> None:
    view = worker_view(parse_engine_metrics("vllm", VLLM_TEXT), _settings(), [100, 700])
    assert view.loads[0].active_prefill_tokens == 1178  # the engine's estimate is larger
    assert view.loads[1].active_prefill_tokens == 700  # nothing waits in the engine


OLD_VLLM = """\
# TYPE vllm:gpu_cache_usage_perc gauge
vllm:gpu_cache_usage_perc{model_name="m"} 0.5
vllm:num_requests_waiting{model_name="m"} 4.0
vllm:prompt_tokens_total{model_name="m"} 9000.0
vllm:request_success_total{finished_reason="stop",model_name="m"} 20.0
vllm:request_success_total{finished_reason="length",model_name="m"} 10.0
vllm:cache_config_info{block_size="32",num_gpu_blocks="None"} 1.0
"""


def test_older_vllm_names_and_flag_fallbacks() -> None:
    snapshot = parse_engine_metrics("vllm", OLD_VLLM)
    assert snapshot.ranks == (
        RankStats(
            rank=0,
            num_waiting=4,
            kv_usage=0.5,
            block_size=32,
            avg_prompt_tokens=300.0,
            requests_waiting=4,
        ),
    )
    view = worker_view(snapshot, _settings())
    assert view.kv_total_blocks is None  # engine not initialised, no flag: not reported
    assert view.loads == {0: RankLoad(active_decode_blocks=None, active_prefill_tokens=1200)}
    view = worker_view(snapshot, _settings("--kv-total-blocks", "1000", "--dp-size", "2"))
    assert (view.block_size, view.kv_total_blocks, view.dp_size) == (32, 1000, 2)
    assert view.loads[0].active_decode_blocks == 500


def test_waiting_requests_without_a_known_prompt_length_leave_prefill_unreported() -> None:
    text = 'vllm:kv_cache_usage_perc{engine="0"} 0\nvllm:num_requests_waiting{engine="0"} 2\n'
    view = worker_view(parse_engine_metrics("vllm", text), _settings("--kv-total-blocks", "10"))
    assert view.loads == {0: RankLoad(active_decode_blocks=0, active_prefill_tokens=None)}


@pytest.mark.parametrize(
    ("engine", "text", "message"),
    [
        (
            "vllm",
            'vllm:num_requests_running{engine="0" 3.0\n',
            "line 1: not valid Prometheus text",
        ),
        ("vllm", "# HELP x y\nvllm:kv_cache_usage_perc 0.1 0.2x\n", "line 2: not valid Prometheus"),
        ("vllm", 'vllm:kv_cache_usage_perc{engine="0"} high\n', "convert string to float: 'high'"),
        ("vllm", "vllm:kv_cache_usage_perc{engine=0} 1\n", "Invalid labels: engine=0"),
        (
            "vllm",
            "<html><body>Not Found</body></html>\n",
            "line 1: not valid Prometheus text (invalid metric name",
        ),
        ("vllm", "", "no vllm:kv_cache_usage_perc"),
        ("vllm", SGLANG_TEXT, "is this a vLLM /metrics page"),
        ("sglang", VLLM_TEXT, "started with --enable-metrics"),
        ("vllm", 'vllm:kv_cache_usage_perc{engine="0"} 1.7\n', "expected a fraction in 0-1"),
        ("vllm", 'vllm:kv_cache_usage_perc{engine="x"} 0.1\n', "rank label engine='x'"),
        (
            "vllm",
            "vllm:kv_cache_usage_perc 0\nvllm:num_requests_waiting -1\n",
            "vllm:num_requests_waiting = -1.0: expected a finite count >= 0",
        ),
    ],
)
def test_malformed_metrics_raise_an_error_naming_the_problem(
    engine: Engine, text: str, message: str
) -> None:
    with pytest.raises(MetricsParseError) as caught:
        parse_engine_metrics(engine, text)
    assert message in str(caught.value)


def test_text_format_details() -> None:
    samples = parse_text(
        '# EOF is not reached yet\nm{a="x\\"y\\\\z\\n",b="",} +Inf 1700000000000\r\n'
        "n NaN\n\n# EOF\nthis is ignored\n"
    )
    assert samples["m"][0].labels == {"a": 'x"y\\z\n', "b": ""}
    assert samples["m"][0].value == float("inf")
    assert set(samples) == {"m", "n"}


# --- the agent in process, against a fake engine ------------------------------------------


@dataclass
class FakeEngine:
    """A /metrics page whose text and status the test changes."""

    text: str
    status: int = 200
    hits: int = 0
    url: str = ""


@pytest.fixture
async def fake_engine() -> AsyncIterator[FakeEngine]:
    engine = FakeEngine(text="")

    async def metrics(request: web.Request) -> web.Response:
        engine.hits += 1
        return web.Response(text=engine.text, status=engine.status)

    app = web.Application()
    app.router.add_get("/metrics", metrics)
    runner = web.AppRunner(app)
    await runner.setup()
    await web.TCPSite(runner, "127.0.0.1", 0).start()
    engine.url = f"http://127.0.0.1:{runner.addresses[0][1]}"
    yield engine
    await runner.cleanup()


def _agent(engine: FakeEngine, sub: Subscriber, *flags: str) -> Agent:
    settings, _ = parse_args(
        [
            "--engine", "vllm", "--engine-url", engine.url, "--model", "m", "--worker-id", "w-in",
            "--endpoint", "10.0.0.5:8000", "--publish", sub.endpoint, "--interval", "0.01",
            *flags,
        ],
        environ={},
    )  # fmt: skip
    return Agent(settings)


async def test_malformed_metrics_publish_nothing_and_are_logged_once(
    fake_engine: FakeEngine, caplog: pytest.LogCaptureFixture
) -> None:
    caplog.set_level(logging.WARNING, logger="llmworker.agent")
    fake_engine.text = VLLM_TEXT.replace("vllm:kv_cache_usage_perc{", "vllm:kv_cache_usage_perc{{")
    bad_line = VLLM_TEXT.split("\n").index(
        next(line for line in VLLM_TEXT.split("\n") if line.startswith("vllm:kv_cache_usage_perc{"))
    )
    sub = Subscriber()
    agent = _agent(fake_engine, sub)
    await agent.start()
    try:
        await wait_until(lambda: fake_engine.hits >= 10, what="ten scrapes")
        assert agent.publisher is None
        assert await sub.drain(0.1) == []
        warnings = [r.getMessage() for r in caplog.records if r.levelno == logging.WARNING]
        assert len(warnings) == 1, warnings
        assert (
            f"malformed metrics: line {bad_line + 1}: not valid Prometheus text (Invalid labels"
            in warnings[0]
        )
        fake_engine.text = VLLM_TEXT
        config = await sub.next_of(ConfigEvent)
        assert (config.kv_total_blocks, config.block_size, config.dp_size) == (27355, 16, 2)
        assert config.endpoint == "10.0.0.5:8000"
    finally:
        await agent.stop()
        sub.close()


async def test_engine_down_past_the_grace_says_bye_and_comes_back(
    fake_engine: FakeEngine, caplog: pytest.LogCaptureFixture
) -> None:
    caplog.set_level(logging.INFO, logger="llmworker.agent")
    fake_engine.text = VLLM_TEXT
    sub = Subscriber()
    agent = _agent(fake_engine, sub, "--engine-down-grace", "0.2")
    await agent.start()
    try:
        await sub.next_of(ConfigEvent)
        fake_engine.status = 503
        down_at = time.monotonic()
        assert await sub.next_of(ByeEvent) == ByeEvent(worker_id="w-in")
        assert time.monotonic() - down_at >= 0.2
        assert agent.publisher is None
        fake_engine.status = 200
        assert (await sub.next_of(ConfigEvent)).worker_id == "w-in"
        failures = [r.getMessage() for r in caplog.records if "HTTP 503" in r.getMessage()]
        assert len(failures) == 1, failures
    finally:
        await agent.stop()
        sub.close()


async def test_the_queue_and_slots_of_each_rank_go_out_with_its_load(
    fake_engine: FakeEngine, caplog: pytest.LogCaptureFixture
) -> None:
    caplog.set_level(logging.WARNING, logger="llmworker.agent")
    fake_engine.text = VLLM_TEXT
    sub = Subscriber()
    agent = _agent(fake_engine, sub, "--max-num-seqs", "256")
    await agent.start()
    try:
        ranks: dict[int, LoadEvent] = {}
        while len(ranks) < 2:
            load = await sub.next_of(LoadEvent)
            ranks[load.dp_rank or 0] = load
        assert [
            (e.num_requests_waiting, e.request_active_slots, e.request_total_slots)
            for _, e in sorted(ranks.items())
        ] == [(2, 3, 256), (0, 1, 256)]
        # The engine starts printing its own value: it wins, and the flag is reported once.
        fake_engine.text = (
            VLLM_TEXT + 'vllm:vllm_config_info{scheduler_config_max_num_seqs="128"} 1\n'
        )
        load = await sub.next_of(LoadEvent)
        while load.request_total_slots != 128:
            load = await sub.next_of(LoadEvent)
        warnings = [r.getMessage() for r in caplog.records if "--max-num-seqs" in r.getMessage()]
        assert warnings == [
            "--max-num-seqs 256 ignored: the engine reports 128 "
            "(the flag applies only when the engine does not)"
        ]
    finally:
        await agent.stop()
        sub.close()


# --- the agent as a process, against the simulated engine ---------------------------------


def _sim(port: int) -> SimProcess:
    return SimProcess(
        [
            "--host", "127.0.0.1", "--port", str(port), "--model", "m", "--worker-id", "sim",
            "--kv-total-blocks", "64", "--block-size", "16", "--max-num-seqs", "8",
            "--max-num-batched-tokens", "256", "--dp-size", "1", "--speedup", "50",
        ]
    )  # fmt: skip


async def _stream(http: aiohttp.ClientSession, url: str, max_tokens: int) -> list[bytes]:
    """A streaming completion; the SSE chunks as they arrived."""
    body = {"model": "m", "prompt": "p" * 64, "max_tokens": max_tokens, "stream": True}
    async with http.post(url, json=body) as response:
        assert response.status == 200, await response.text()
        return [chunk async for chunk in response.content.iter_any()]


async def test_against_the_sim_load_follows_requests_and_sigterm_says_bye() -> None:
    sub = Subscriber()
    sim_port = free_port()
    sim = _sim(sim_port)
    agent = AgentProcess(
        [
            "--engine", "vllm", "--engine-url", f"http://127.0.0.1:{sim_port}", "--model", "m",
            "--endpoint", f"127.0.0.1:{sim_port}", "--worker-id", "agent-a",
            "--publish", sub.endpoint, "--interval", "0.02",
        ]
    )  # fmt: skip
    code, err = -1, ""
    try:
        config = await sub.next_of(ConfigEvent, timeout=15)
        assert config == ConfigEvent(
            worker_id="agent-a",
            model="m",
            endpoint=f"127.0.0.1:{sim_port}",
            kv_total_blocks=64,
            block_size=16,
            dp_size=1,
            worker_type="decode",
        )
        async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=20)) as http:
            url = f"http://127.0.0.1:{sim_port}/v1/completions"
            request = asyncio.ensure_future(_stream(http, url, max_tokens=600))
            busy = await sub.next_of(LoadEvent)
            while not busy.active_decode_blocks:
                busy = await sub.next_of(LoadEvent)
            assert not request.done(), "the generation ended before the agent saw it"
            assert busy.dp_rank == 0 and 0 < busy.active_decode_blocks <= 64
            chunks = await request
            assert b"".join(chunks).endswith(b"data: [DONE]\n\n")
        idle = await sub.next_of(LoadEvent)
        while idle.active_decode_blocks:
            idle = await sub.next_of(LoadEvent)
        assert (idle.active_decode_blocks, idle.active_prefill_tokens) == (0, 0)
    finally:
        code, err = agent.stop(), agent.log()
        sim.stop()
        print(err, file=sys.stderr)  # shown when the test fails
    try:
        assert await sub.next_of(ByeEvent) == ByeEvent(worker_id="agent-a")
    finally:
        sub.close()
    assert code == 0, err


async def _gauge(http: aiohttp.ClientSession, port: int, name: str) -> float:
    """A series the agent's proxy appends to the engine's /metrics."""
    async with http.get(f"http://127.0.0.1:{port}/metrics") as response:
        samples = parse_text(await response.text())[name]
    assert len(samples) == 1, samples  # the sim's own dynamo_* series were replaced
    return samples[0].value


async def _gauge_is(http: aiohttp.ClientSession, port: int, name: str, value: float) -> bool:
    return await _gauge(http, port, name) == value


async def test_proxy_admits_n_plus_q_and_rejects_the_rest_at_once() -> None:
    sub = Subscriber()
    sim_port, agent_port = free_port(), free_port()
    sim = _sim(sim_port)
    agent = AgentProcess(
        [
            "--engine", "vllm", "--engine-url", f"http://127.0.0.1:{sim_port}", "--model", "m",
            "--worker-id", "agent-p", "--publish", sub.endpoint, "--interval", "0.05",
            "--listen", f"127.0.0.1:{agent_port}", "--engine-request-limit", "1",
        ],
        env={"DYN_DYNAMO_REQUEST_QUEUE_LIMIT": "2"},
    )  # fmt: skip
    try:
        config = await sub.next_of(ConfigEvent, timeout=15)
        assert config.endpoint == f"127.0.0.1:{agent_port}"  # the listen address
        url = f"http://127.0.0.1:{agent_port}/v1/completions"
        async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=20)) as http:
            first = asyncio.ensure_future(_stream(http, url, max_tokens=900))
            await wait_until(
                lambda: _gauge_is(http, agent_port, "dynamo_engine_request", 1),
                timeout=10,
                what="the first request in the engine",
            )
            queued = [asyncio.ensure_future(_stream(http, url, max_tokens=16)) for _ in range(2)]
            await wait_until(
                lambda: _gauge_is(http, agent_port, "dynamo_request_queue", 2),
                timeout=10,
                what="two requests queued",
            )

            async def rejected() -> tuple[int, str | None, bytes, float]:
                started = time.monotonic()
                body = {"model": "m", "prompt": "p", "max_tokens": 900, "stream": True}
                async with http.post(url, json=body) as response:
                    data = await response.read()
                    return (
                        response.status,
                        response.headers.get("x-worker-overloaded"),
                        data,
                        time.monotonic() - started,
                    )

            rejections = await asyncio.gather(rejected(), rejected())
            assert not first.done(), "the first request ended before the burst was rejected"
            for status, header, data, seconds in rejections:
                assert (status, header, data) == (529, "1", OVERLOAD_BODY)
                assert seconds < 1.0
            streams = await asyncio.gather(first, *queued)
            for chunks in streams:
                assert b"".join(chunks).endswith(b"data: [DONE]\n\n")
            assert len(streams[0]) > 1  # streamed through chunk by chunk, not buffered
            assert await _gauge(http, agent_port, "dynamo_rejection_request_total") == 2

            # A client that leaves mid-stream frees its slot and the engine's sequence.
            generated = await _gauge(http, agent_port, "vllm:generation_tokens_total")
            body = {"model": "m", "prompt": "p", "max_tokens": 900, "stream": True}
            async with http.post(url, json=body) as response:
                await response.content.readany()
            await wait_until(
                lambda: _gauge_is(http, agent_port, "dynamo_engine_request", 0),
                what="the slot released",
            )
            await wait_until(
                lambda: _gauge_is(http, agent_port, "vllm:num_requests_running", 0),
                what="the engine to drop the sequence",
            )
            aborted = await _gauge(http, agent_port, "vllm:generation_tokens_total") - generated
            assert aborted < 900, "the proxy read the abandoned stream to its end"
    finally:
        code, err = agent.stop(), agent.log()
        sim.stop()
        sub.close()
        print(err, file=sys.stderr)  # shown when the test fails
    assert code == 0, err


@pytest.mark.parametrize(
    ("flags", "named"),
    [
        (["--engine-url", "127.0.0.1:8000", "--endpoint", "h:1"], "--engine-url"),
        ([], "--endpoint HOST:PORT is required"),
        (["--endpoint", "h:1", "--engine-request-limit", "2"], "needs --listen"),
        (["--listen", "127.0.0.1:0", "--engine-request-limit", "0"], "--engine-request-limit='0'"),
        (["--endpoint", "h:1", "--publish", "h:1"], "--publish"),
        (["--endpoint", "h:1", "--interval", "0"], "--interval"),
        (["--endpoint", "h:1", "--kv-total-blocks", "-3"], "--kv-total-blocks"),
        (["--endpoint", "h:1", "--engine", "trtllm"], "--engine"),
    ],
)
def test_bad_flags_exit_2_naming_the_flag(
    flags: list[str], named: str, capsys: pytest.CaptureFixture[str]
) -> None:
    base = ["--engine", "vllm", "--engine-url", "http://h:1", "--model", "m", "--worker-id", "w"]
    with pytest.raises(SystemExit) as exited:
        parse_args([*base, "--publish", "tcp://h:1", *flags], environ={})
    assert exited.value.code == 2
    assert named in capsys.readouterr().err


def test_admission_env_without_the_proxy_is_a_warning() -> None:
    flags = [
        "--engine", "vllm", "--engine-url", "http://h:1", "--model", "m", "--worker-id", "w",
        "--endpoint", "h:1", "--publish", "tcp://h:1",
    ]  # fmt: skip
    settings, warning = parse_args(flags, environ={"DYN_ENGINE_REQUEST_LIMIT": "4"})
    assert not settings.admission.enabled
    assert warning == "DYN_ENGINE_REQUEST_LIMIT is set but has no effect without --listen"
    settings, warning = parse_args(
        [*flags, "--listen", "[::1]:0"], environ={"DYN_ENGINE_REQUEST_LIMIT": "4"}
    )
    assert (settings.admission.engine_request_limit, settings.listen) == (4, ("::1", 0))
    assert warning is None


def test_engine_url_keeps_a_path_prefix() -> None:
    settings, _ = parse_args(
        [
            "--engine", "sglang", "--engine-url", "http://127.0.0.1:30000/engine/",
            "--model", "m", "--worker-id", "w", "--endpoint", "h:1", "--publish", "tcp://h:1",
        ],
        environ={},
    )  # fmt: skip
    assert settings.metrics_url == URL("http://127.0.0.1:30000/engine/metrics")
