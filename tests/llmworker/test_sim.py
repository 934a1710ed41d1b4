"""The simulated worker end to end over real HTTP on 127.0.0.1."""

from __future__ import annotations

import asyncio
import json
import re
import time
from typing import Any

import aiohttp
import pytest

from extproc.devstack import async_wait_until as wait_until
from extproc.openai.request import estimate_tokens
from llmworker.engine import EngineConfig, EngineCore, SeqState
from llmworker.sim import SimWorker
from tests.llmworker.support import StartSim

MESSAGES = [
    {"role": "system", "content": "You are terse."},
    {"role": "user", "content": [{"type": "text", "text": "Héllo wörld, how are you today?"}]},
]


def url(worker: SimWorker, path: str) -> str:
    return f"http://127.0.0.1:{worker.port}{path}"


async def sse_events(response: aiohttp.ClientResponse) -> list[Any]:
    """The decoded ``data:`` payloads of an SSE response; ``[DONE]`` as the string."""
    events: list[Any] = []
    buffer = b""
    async for chunk in response.content.iter_any():
        buffer += chunk
        while b"\n\n" in buffer:
            block, buffer = buffer.split(b"\n\n", 1)
            assert block.startswith(b"data: "), block
            data = block[len(b"data: ") :]
            events.append("[DONE]" if data == b"[DONE]" else json.loads(data))
    assert buffer == b""
    return events


def metric(text: str, name: str, **labels: str) -> float:
    """The value of one sample in Prometheus text; fails if absent."""
    for line in text.splitlines():
        if line.startswith("#"):
            continue
        m = re.fullmatch(r"([^{\s]+)(?:\{(.*)\})? (\S+)", line)
        if not m or m.group(1) != name:
            continue
        found = dict(re.findall(r'(\w+)="([^"]*)"', m.group(2) or ""))
        if all(found.get(k) == v for k, v in labels.items()):
            return float(m.group(3))
    raise AssertionError(f"no sample {name} {labels} in\n{text}")


async def scrape(http: aiohttp.ClientSession, worker: SimWorker) -> str:
    async with http.get(url(worker, "/metrics")) as r:
        assert r.status == 200
        return await r.text()


async def test_chat_non_stream_usage_matches_the_estimate(
    start_sim: StartSim, http: aiohttp.ClientSession
) -> None:
    worker = await start_sim("--model", "m1", "--worker-id", "wk-a")
    body = {"model": "m1", "messages": MESSAGES, "max_tokens": 7}
    async with http.post(url(worker, "/v1/chat/completions"), json=body) as r:
        assert r.status == 200
        assert r.headers["x-worker-id"] == "wk-a"
        assert r.content_type == "application/json"
        data = await r.json()
    prompt = estimate_tokens(MESSAGES)
    assert prompt == -(-len("You are terse.Héllo wörld, how are you today?".encode()) // 4)
    assert data["usage"] == {
        "prompt_tokens": prompt,
        "completion_tokens": 7,
        "total_tokens": prompt + 7,
    }
    choice = data["choices"][0]
    assert data["object"] == "chat.completion" and data["model"] == "m1"
    assert choice["message"]["role"] == "assistant"
    assert len(choice["message"]["content"].split()) == 7  # one word per token
    assert choice["finish_reason"] == "length"


async def test_chat_stream_one_event_per_token_and_usage_chunk(
    start_sim: StartSim, http: aiohttp.ClientSession
) -> None:
    worker = await start_sim("--worker-id", "wk-s")
    body = {
        "model": "sim-model",
        "messages": MESSAGES,
        "max_completion_tokens": 5,
        "max_tokens": 99,
        "stream": True,
        "stream_options": {"include_usage": True},
    }
    async with http.post(url(worker, "/v1/chat/completions"), json=body) as r:
        assert r.status == 200
        assert r.headers["x-worker-id"] == "wk-s"
        assert r.content_type == "text/event-stream"
        events = await sse_events(r)
    assert events[-1] == "[DONE]"
    *chunks, usage_chunk, _ = events
    assert len(chunks) == 5
    assert all(c["object"] == "chat.completion.chunk" for c in chunks)
    assert chunks[0]["choices"][0]["delta"]["role"] == "assistant"
    assert all(c["choices"][0]["delta"]["content"] for c in chunks)
    assert [c["choices"][0]["finish_reason"] for c in chunks] == [None] * 4 + ["length"]
    assert usage_chunk["choices"] == []
    prompt = estimate_tokens(MESSAGES)
    assert usage_chunk["usage"] == {
        "prompt_tokens": prompt,
        "completion_tokens": 5,
        "total_tokens": prompt + 5,
    }


async def test_completions_stream_and_non_stream(
    start_sim: StartSim, http: aiohttp.ClientSession
) -> None:
    worker = await start_sim("--default-max-tokens", "3")
    body: dict[str, Any] = {"model": "sim-model", "prompt": "x" * 41}
    async with http.post(url(worker, "/v1/completions"), json=body) as r:
        data = await r.json()
    assert data["object"] == "text_completion"
    assert data["usage"] == {"prompt_tokens": 11, "completion_tokens": 3, "total_tokens": 14}
    assert len(data["choices"][0]["text"].split()) == 3
    body = {"model": "sim-model", "prompt": [1, 2, 3, 4, 5], "max_tokens": 2, "stream": True}
    async with http.post(url(worker, "/v1/completions"), json=body) as r:
        assert r.headers["x-worker-id"] == worker.settings.worker_id
        events = await sse_events(r)
    assert events[-1] == "[DONE]"
    assert [e["choices"][0]["text"] != "" for e in events[:-1]] == [True, True]
    assert all("usage" not in e for e in events[:-1])  # include_usage not asked


async def test_embeddings_models_health(start_sim: StartSim, http: aiohttp.ClientSession) -> None:
    worker = await start_sim("--model", "emb", "--embedding-dim", "4", "--worker-id", "wk-e")
    body = {"model": "emb", "input": ["first text", "second"]}
    async with http.post(url(worker, "/v1/embeddings"), json=body) as r:
        assert r.status == 200 and r.headers["x-worker-id"] == "wk-e"
        data = await r.json()
    assert [d["index"] for d in data["data"]] == [0, 1]
    assert all(len(d["embedding"]) == 4 for d in data["data"])
    tokens = estimate_tokens(["first text", "second"])
    assert data["usage"] == {"prompt_tokens": tokens, "total_tokens": tokens}
    async with http.get(url(worker, "/v1/models")) as r:
        assert r.headers["x-worker-id"] == "wk-e"
        assert [m["id"] for m in (await r.json())["data"]] == ["emb"]
    async with http.get(url(worker, "/health")) as r:
        assert r.status == 200 and r.headers["x-worker-id"] == "wk-e"


BAD_BODIES: list[tuple[str, bytes, str]] = [
    ("/v1/chat/completions", b"{not json", "not valid JSON"),
    ("/v1/chat/completions", b"\xff\xfe", "not valid JSON"),
    ("/v1/chat/completions", b"", "not valid JSON"),
    ("/v1/chat/completions", b"[1, 2]", "JSON object"),
    ("/v1/chat/completions", b'{"messages": []}', "'model'"),
    ("/v1/chat/completions", b'{"model": 5, "messages": []}', "'model' must be a string"),
    ("/v1/chat/completions", b'{"model": "sim-model"}', "'messages'"),
    ("/v1/chat/completions", b'{"model": "sim-model", "messages": "hi"}', "'messages'"),
    ("/v1/chat/completions", b'{"model": "sim-model", "messages": [3]}', "messages[0]"),
    (
        "/v1/chat/completions",
        b'{"model": "sim-model", "messages": [{"content": 7}]}',
        "messages[0].content",
    ),
    (
        "/v1/chat/completions",
        b'{"model": "sim-model", "messages": [{"content": "a"}], "max_tokens": "5"}',
        "'max_tokens'",
    ),
    (
        "/v1/chat/completions",
        b'{"model": "sim-model", "messages": [{"content": "a"}], "max_tokens": 0}',
        "'max_tokens'",
    ),
    (
        "/v1/chat/completions",
        b'{"model": "sim-model", "messages": [{"content": "a"}], "max_tokens": true}',
        "'max_tokens'",
    ),
    (
        "/v1/chat/completions",
        b'{"model": "sim-model", "messages": [{"content": "a"}], "stream": "yes"}',
        "'stream'",
    ),
    (
        "/v1/chat/completions",
        b'{"model": "sim-model", "messages": [{"content": "a"}], "n": 2}',
        "n=1",
    ),
    (
        "/v1/chat/completions",
        b'{"model": "sim-model", "messages": [{"content": "a"}], "stream": true,'
        b' "stream_options": 1}',
        "'stream_options'",
    ),
    (
        "/v1/chat/completions",
        b'{"model": "sim-model", "messages": [{"content": "a"}], "max_tokens": 99999999}',
        "maximum context length",
    ),
    ("/v1/completions", b'{"model": "sim-model"}', "'prompt'"),
    ("/v1/completions", b'{"model": "sim-model", "prompt": {"a": 1}}', "'prompt'"),
    ("/v1/completions", b'{"model": "sim-model", "prompt": [1, "a"]}', "'prompt'"),
    ("/v1/embeddings", b'{"model": "sim-model"}', "'input'"),
    ("/v1/embeddings", b'{"model": "sim-model", "input": ""}', "empty"),
    ("/v1/embeddings", b'{"model": "sim-model", "input": [[]]}', "'input'"),
]


@pytest.mark.parametrize(("path", "raw", "message"), BAD_BODIES)
async def test_bad_bodies_get_a_400_json_error(
    start_sim: StartSim, http: aiohttp.ClientSession, path: str, raw: bytes, message: str
) -> None:
    worker = await start_sim("--kv-total-blocks", "64")
    async with http.post(url(worker, path), data=raw) as r:
        assert r.status == 400
        assert r.content_type == "application/json"
        assert r.headers["x-worker-id"] == worker.settings.worker_id
        body = await r.json()
    assert body["code"] == 400 and body["type"] == "Bad Request"
    assert message in body["message"]
    assert worker.engine.loads()[0].num_waiting == 0


async def test_unknown_model_path_and_method(
    start_sim: StartSim, http: aiohttp.ClientSession
) -> None:
    worker = await start_sim()
    body = {"model": "other", "messages": [{"content": "a"}]}
    async with http.post(url(worker, "/v1/chat/completions"), json=body) as r:
        assert r.status == 404 and "other" in (await r.json())["message"]
    async with http.get(url(worker, "/nope")) as r:
        assert r.status == 404 and r.headers["x-worker-id"] == worker.settings.worker_id
    async with http.get(url(worker, "/v1/chat/completions")) as r:
        assert r.status == 405 and "POST" in r.headers["Allow"]


async def test_metrics_use_vllm_names_and_kv_usage_is_a_fraction(
    start_sim: StartSim, http: aiohttp.ClientSession
) -> None:
    worker = await start_sim(
        "--model", "mm", "--kv-total-blocks", "100", "--block-size", "16", "--speedup", "10"
    )
    text = await scrape(http, worker)
    labels = {"engine": "0", "model_name": "mm"}
    assert metric(text, "vllm:kv_cache_usage_perc", **labels) == 0
    assert metric(text, "vllm:num_requests_running", **labels) == 0
    assert metric(text, "vllm:num_requests_waiting", **labels) == 0
    assert metric(text, "vllm:num_preemptions_total", **labels) == 0
    assert metric(text, "vllm:cache_config_info", num_gpu_blocks="100", block_size="16") == 1
    for name in ("dynamo_rejection_request_total", "dynamo_engine_request", "dynamo_request_queue"):
        assert metric(text, name) == 0
    body = {"model": "mm", "prompt": "y" * 400, "max_tokens": 1000, "stream": True}
    async with http.post(url(worker, "/v1/completions"), json=body) as r:
        await r.content.readuntil(b"\n\n")  # the first token is out
        text = await scrape(http, worker)
        usage = metric(text, "vllm:kv_cache_usage_perc", **labels)
        held = worker.engine.loads()[0].active_decode_blocks
        assert 0 < usage < 1
        assert abs(usage - held / 100) <= 0.011  # a step may have passed between the reads
        assert metric(text, "vllm:num_requests_running", **labels) == 1
        assert metric(text, "dynamo_engine_request") == 1
        r.close()


async def test_preemptions_are_counted(start_sim: StartSim, http: aiohttp.ClientSession) -> None:
    worker = await start_sim("--kv-total-blocks", "4", "--block-size", "4")
    body = {"model": "sim-model", "prompt": "abcdefghijkl", "max_tokens": 8}
    responses = await asyncio.gather(
        *(http.post(url(worker, "/v1/completions"), json=body) for _ in range(2))
    )
    for r in responses:
        assert (await r.json())["usage"]["completion_tokens"] == 8
        r.release()
    text = await scrape(http, worker)
    assert metric(text, "vllm:num_preemptions_total", engine="0") >= 1
    assert metric(text, "vllm:kv_cache_usage_perc", engine="0") == 0


async def test_dp_ranks_each_get_requests_and_metrics(
    start_sim: StartSim, http: aiohttp.ClientSession
) -> None:
    worker = await start_sim("--dp-size", "2", "--speedup", "20")
    body = {"model": "sim-model", "prompt": "z" * 200, "max_tokens": 20}
    responses = await asyncio.gather(
        *(http.post(url(worker, "/v1/completions"), json=body) for _ in range(4))
    )
    ranks = sorted(r.headers["x-worker-dp-rank"] for r in responses)
    for r in responses:
        r.release()
    assert ranks == ["0", "0", "1", "1"]
    text = await scrape(http, worker)
    for rank in ("0", "1"):
        assert metric(text, "vllm:kv_cache_usage_perc", engine=rank) == 0
        assert metric(text, "vllm:cache_config_info", engine=rank) == 1


async def test_client_disconnect_mid_stream_frees_kv_and_slot(
    start_sim: StartSim, http: aiohttp.ClientSession
) -> None:
    worker = await start_sim("--engine-request-limit", "1", "--speedup", "10")
    body = {"model": "sim-model", "prompt": "p" * 100, "max_tokens": 10000, "stream": True}
    r = await http.post(url(worker, "/v1/completions"), json=body)
    await r.content.readuntil(b"\n\n")
    assert worker.engine.loads()[0].active_decode_blocks > 0
    assert worker.admission.in_engine == 1
    r.close()  # drop the connection
    await wait_until(
        lambda: (
            worker.engine.loads()[0].active_decode_blocks == 0
            and worker.engine.loads()[0].num_running == 0
            and worker.admission.in_engine == 0
        ),
        what="KV and slot released",
    )


async def test_client_leaving_a_non_stream_request_or_the_queue_frees_everything(
    start_sim: StartSim, http: aiohttp.ClientSession
) -> None:
    worker = await start_sim("--engine-request-limit", "1", "--speedup", "10")
    body = {"model": "sim-model", "prompt": "p" * 100, "max_tokens": 10000}
    running = asyncio.create_task(http.post(url(worker, "/v1/completions"), json=body))
    await wait_until(lambda: worker.engine.loads()[0].num_running == 1, what="one running")
    queued = asyncio.create_task(http.post(url(worker, "/v1/completions"), json=body))
    await wait_until(lambda: worker.admission.queued == 1, what="one queued")
    queued.cancel()
    await wait_until(lambda: worker.admission.queued == 0, what="the queue to empty")
    assert worker.admission.in_engine == 1
    running.cancel()
    await wait_until(
        lambda: (
            worker.admission.in_engine == 0 and worker.engine.loads()[0].active_decode_blocks == 0
        ),
        what="slot and KV released",
    )
    await asyncio.gather(running, queued, return_exceptions=True)


@pytest.mark.parametrize(
    ("status_env", "status", "reason"),
    [(None, 529, "Overloaded"), ("503", 503, "Service Unavailable")],
)
async def test_admission_burst_rejects_exactly_the_excess(
    start_sim: StartSim,
    http: aiohttp.ClientSession,
    status_env: str | None,
    status: int,
    reason: str,
) -> None:
    n, q, k = 2, 3, 4
    env = {"DYN_DYNAMO_REQUEST_QUEUE_LIMIT": str(q)}
    if status_env:
        env["DYN_HTTP_OVERLOAD_STATUS_CODE"] = status_env
    # speedup 1: every admitted request takes about 20 steps x 20 ms.
    worker = await start_sim("--engine-request-limit", str(n), "--speedup", "1", env=env)
    body = {"model": "sim-model", "prompt": "hello", "max_tokens": 20}
    started = time.monotonic()

    async def one() -> tuple[int, dict[str, str], bytes, float]:
        async with http.post(url(worker, "/v1/completions"), json=body) as r:
            raw = await r.read()
            return r.status, dict(r.headers), raw, time.monotonic() - started

    tasks = [asyncio.create_task(one()) for _ in range(n + q + k)]
    results = await asyncio.gather(*tasks)
    ok = [res for res in results if res[0] == 200]
    rejected = [res for res in results if res[0] != 200]
    assert len(ok) == n + q
    assert len(rejected) == k
    expected = (
        f'{{"message":"Server overloaded: worker at capacity","type":"{reason}","code":{status}}}'
    ).encode()
    for got_status, headers, raw, _ in rejected:
        assert got_status == status
        assert headers["x-worker-overloaded"] == "1"
        assert headers["Content-Type"] == "application/json"
        assert headers["x-worker-id"] == worker.settings.worker_id
        assert raw == expected
    assert max(res[3] for res in rejected) < min(res[3] for res in ok)  # rejected at once
    for _, _, raw, _ in ok:
        assert json.loads(raw)["usage"]["completion_tokens"] == 20
    text = await scrape(http, worker)
    assert metric(text, "dynamo_rejection_request_total") == k
    assert metric(text, "dynamo_engine_request") == 0
    assert metric(text, "dynamo_request_queue") == 0


async def test_admission_gauges_show_engine_and_queue(
    start_sim: StartSim, http: aiohttp.ClientSession
) -> None:
    worker = await start_sim(
        "--engine-request-limit", "1", env={"DYN_DYNAMO_REQUEST_QUEUE_LIMIT": "2"}
    )
    body = {"model": "sim-model", "prompt": "p", "max_tokens": 5000, "stream": True}
    first = await http.post(url(worker, "/v1/completions"), json=body)
    pending = [
        asyncio.create_task(http.post(url(worker, "/v1/completions"), json=body)) for _ in range(2)
    ]

    async def gauges() -> bool:
        text = await scrape(http, worker)
        return (
            metric(text, "dynamo_engine_request") == 1 and metric(text, "dynamo_request_queue") == 2
        )

    await wait_until(gauges, what="1 in engine, 2 queued")
    for task in pending:
        task.cancel()
    first.close()
    await asyncio.gather(*pending, return_exceptions=True)
    await wait_until(lambda: worker.admission.in_engine == 0 and worker.admission.queued == 0)


async def _stream_seconds(http: aiohttp.ClientSession, worker: SimWorker, tokens: int) -> float:
    body = {"model": "m1", "messages": MESSAGES, "max_tokens": tokens, "stream": True}
    start = time.monotonic()
    async with http.post(url(worker, "/v1/chat/completions"), json=body) as r:
        assert r.status == 200
        events = await sse_events(r)
    assert events[-1] == "[DONE]"
    return time.monotonic() - start


async def test_slowdown_multiplies_every_step_until_set_back(
    start_sim: StartSim, http: aiohttp.ClientSession
) -> None:
    # 20 ms per step and nothing else: 5 tokens are 5 steps, 100 ms unslowed.
    worker = await start_sim(
        "--model", "m1", "--speedup", "1", "--step-base-ms", "20",
        "--step-prefill-token-us", "0", "--step-decode-seq-us", "0",
    )  # fmt: skip
    async with http.post(url(worker, "/sim/slowdown"), json={"factor": 4}) as r:
        assert r.status == 200
        assert await r.json() == {"factor": 4.0}
    slowed = await _stream_seconds(http, worker, 5)
    assert slowed >= 0.95 * 5 * 0.080  # each step sleeps at least 4 x 20 ms
    async with http.get(url(worker, "/sim/slowdown")) as r:
        assert await r.json() == {"factor": 4.0}
    async with http.post(url(worker, "/sim/slowdown"), json={"factor": 1}) as r:
        assert r.status == 200
    again = min([await _stream_seconds(http, worker, 5) for _ in range(3)])
    assert again < slowed / 2


@pytest.mark.parametrize(
    "body, shown",
    [
        ({"factor": 0.5}, "0.5"),
        ({"factor": 101}, "101"),
        ({"factor": "2"}, "'2'"),
        ({"factor": True}, "True"),
        ({}, "None"),
        ([2], "[2]"),
    ],
)
async def test_a_bad_slowdown_is_refused_and_changes_nothing(
    start_sim: StartSim, http: aiohttp.ClientSession, body: Any, shown: str
) -> None:
    worker = await start_sim("--model", "m1")
    async with http.post(url(worker, "/sim/slowdown"), json={"factor": 3}) as r:
        assert r.status == 200
    async with http.post(url(worker, "/sim/slowdown"), json=body) as r:
        assert r.status == 422
        message = (await r.json())["message"]
    assert "'factor'" in message and shown in message, message
    async with http.get(url(worker, "/sim/slowdown")) as r:
        assert await r.json() == {"factor": 3.0}


async def test_ttft_histogram_counts_streamed_requests_from_submission_to_first_token(
    start_sim: StartSim, http: aiohttp.ClientSession
) -> None:
    worker = await start_sim(
        "--model", "m1", "--speedup", "1", "--step-base-ms", "30",
        "--step-prefill-token-us", "0", "--step-decode-seq-us", "0",
    )  # fmt: skip
    for _ in range(3):
        await _stream_seconds(http, worker, 2)
    text = await scrape(http, worker)
    name = "vllm:time_to_first_token_seconds"
    labels = {"engine": "0", "model_name": "m1"}
    assert metric(text, f"{name}_count", **labels) == 3
    assert metric(text, f"{name}_sum", **labels) >= 3 * 0.030 * 0.95  # one 30 ms step each
    assert metric(text, f"{name}_bucket", le="0.02", **labels) == 0
    assert metric(text, f"{name}_bucket", le="+Inf", **labels) == 3


def test_reserved_blocks_hold_no_tokens_so_preemption_comes_a_block_sooner() -> None:
    """vLLM keeps one block of its cache aside (its null block): of 3 blocks, 2 hold tokens.
    Two requests of 3 and 2 prompt tokens fill one block each; the older one's 5th token
    needs a second block, so the younger is preempted, where 3 usable blocks hold all
    three."""
    for reserved, preempted in ((1, 1), (0, 0)):
        cfg = EngineConfig(
            kv_total_blocks=3, block_size=4, max_num_seqs=2, reserved_blocks=reserved
        )
        core = EngineCore(cfg)
        assert cfg.max_model_len == 4 * (3 - reserved)
        older, younger = core.add(3, 4), core.add(2, 4)
        core.complete(core.schedule())  # both prompts, each with its first token: 1 block
        assert (older.blocks, younger.blocks) == (1, 1)
        # The usage is of the blocks that hold tokens, as vLLM's kv_cache_usage_perc is.
        assert core.load().kv_usage == 2 / (3 - reserved)
        assert core.load().kv_total_blocks == 3  # vLLM's num_gpu_blocks counts the null one
        plan = core.schedule()
        assert plan.preempted == preempted, reserved
        assert (younger.state is SeqState.WAITING) == bool(preempted)


def test_reserved_blocks_must_leave_a_block_for_tokens() -> None:
    with pytest.raises(ValueError, match="reserved_blocks 2 leaves none of kv_total_blocks 2"):
        EngineConfig(kv_total_blocks=2, reserved_blocks=2)
    with pytest.raises(ValueError, match="reserved_blocks must be an integer >= 0, got -1"):
        EngineConfig(reserved_blocks=-1)


async def test_vllm_cpu_profile_reports_usage_of_the_blocks_that_hold_tokens(
    start_sim: StartSim, http: aiohttp.ClientSession
) -> None:
    """``--profile vllm-cpu``: blocks of 128, 17 of them with one aside; the page says 17 as
    vLLM's does, and the usage of a request is of 16."""
    worker = await start_sim("--model", "mm", "--profile", "vllm-cpu", "--speedup", "20")
    text = await scrape(http, worker)
    assert metric(text, "vllm:cache_config_info", num_gpu_blocks="17", block_size="128") == 1
    body = {"model": "mm", "prompt": "y" * 1200, "max_tokens": 200, "stream": True}
    async with http.post(url(worker, "/v1/completions"), json=body) as r:
        await r.content.readuntil(b"\n\n")  # the first token is out: 301 tokens, 3 blocks
        text = await scrape(http, worker)
        assert worker.engine.loads()[0].active_decode_blocks == 3
        assert metric(text, "vllm:kv_cache_usage_perc", engine="0", model_name="mm") == 3 / 16
        r.close()


async def test_vllm_cpu_profile_counts_the_chat_template_in_a_chat_prompt(
    start_sim: StartSim, http: aiohttp.ClientSession
) -> None:
    """vLLM counts SmolLM2's chat template (31 tokens for one user message) in a chat
    request's prompt, the router does not; a completion has no template."""
    worker = await start_sim("--model", "mm", "--profile", "vllm-cpu", "--speedup", "20")
    messages = [{"role": "user", "content": "y" * 400}]
    chat = {"model": "mm", "messages": messages, "max_tokens": 2}
    async with http.post(url(worker, "/v1/chat/completions"), json=chat) as r:
        assert (await r.json())["usage"]["prompt_tokens"] == estimate_tokens(messages) + 31
    plain = {"model": "mm", "prompt": "y" * 400, "max_tokens": 2}
    async with http.post(url(worker, "/v1/completions"), json=plain) as r:
        assert (await r.json())["usage"]["prompt_tokens"] == 100
    with pytest.raises(ValueError, match="chat_template_tokens must be an integer >= 0, got -1"):
        EngineConfig(chat_template_tokens=-1)
