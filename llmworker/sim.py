"""Simulated OpenAI-compatible LLM worker: ``python -m llmworker.sim --help``.

Serves ``/v1/chat/completions``, ``/v1/completions`` (streaming and not),
``/v1/embeddings``, ``/v1/models``, ``/health`` and ``/metrics`` (vLLM metric
names) from a :class:`~llmworker.engine.SimEngine`, optionally behind
worker-side admission, and publishes its ``config`` and per-rank ``load`` to the
extproc when given ``--publish``. Every response carries ``x-worker-id``.
"""

from __future__ import annotations

import asyncio
import base64
import hashlib
import logging
import struct
import time
import uuid
from collections.abc import Awaitable, Callable, Iterator, Sequence
from dataclasses import dataclass
from typing import Any

import msgspec
from aiohttp import web
from prometheus_client import CONTENT_TYPE_LATEST, CollectorRegistry, Histogram, generate_latest
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric
from prometheus_client.registry import Collector

from extproc.events.publisher import EventPublisher, PublisherError
from extproc.events.schema import ConfigEvent
from extproc.openai.request import estimate_tokens
from llmworker import cli
from llmworker.admission import Admission, Overloaded
from llmworker.engine import EngineStopped, RankLoad, RequestStream, SimEngine
from llmworker.httpserver import json_error, listen, rejection_response
from llmworker.netaddr import advertised_endpoint, join_host_port
from llmworker.sim_settings import SimSettings, parse_args

log = logging.getLogger("llmworker.sim")

WORKER_ID_HEADER = "x-worker-id"
# After ``bye``, keep serving this long: a request the router picked this worker for just
# before the bye may still be on its way (over a kept-alive connection, where a close
# would reset it rather than refuse it).
DRAIN_AFTER_BYE = 0.25
DP_RANK_HEADER = "x-worker-dp-rank"
WORDS = (
    "the", "quick", "brown", "fox", "jumps", "over", "a", "lazy", "dog", "while",
    "simulated", "engines", "stream", "tokens", "to", "patient", "clients", "behind", "envoy",
)  # fmt: skip
_json = msgspec.json.Encoder()
# vLLM's buckets for vllm:time_to_first_token_seconds.
TTFT_BUCKETS = (0.001, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1.0, 2.5, 5.0,
                7.5, 10.0, 20.0, 40.0, 80.0, 160.0, 640.0, 2560.0)  # fmt: skip
MAX_SLOWDOWN = 100.0


class HTTPError(Exception):
    """A client error answered with the flat JSON error body."""

    def __init__(self, status: int, message: str) -> None:
        super().__init__(message)
        self.status = status
        self.message = message


@dataclass(frozen=True, slots=True)
class Generation:
    """A validated chat or completions request."""

    chat: bool
    prompt_tokens: int
    max_tokens: int
    stream: bool
    include_usage: bool


def _json_response(payload: Any, status: int = 200) -> web.Response:
    return web.Response(body=_json.encode(payload), status=status, content_type="application/json")


def _is_int(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def _optional_int(body: dict[str, Any], key: str, minimum: int) -> int | None:
    value = body.get(key)
    if value is None:
        return None
    if not _is_int(value) or value < minimum:
        raise HTTPError(400, f"'{key}' must be an integer >= {minimum}, got {value!r}")
    return int(value)


def _optional_bool(body: dict[str, Any], key: str) -> bool:
    value = body.get(key)
    if value is None:
        return False
    if not isinstance(value, bool):
        raise HTTPError(400, f"'{key}' must be a boolean, got {value!r}")
    return value


def _check_prompt(value: Any, key: str) -> None:
    """A string, a list of strings, a list of token ids, or a list of such lists."""
    if isinstance(value, str):
        return
    if isinstance(value, list) and value:
        if all(isinstance(v, str) for v in value):
            return
        if all(_is_int(v) and v >= 0 for v in value):
            return
        if all(isinstance(v, list) and v and all(_is_int(t) and t >= 0 for t in v) for v in value):
            return
    raise HTTPError(
        400,
        f"'{key}' must be a string, a non-empty list of strings or of token ids, got "
        f"{type(value).__name__}",
    )


def _check_messages(value: Any) -> None:
    if not isinstance(value, list) or not value:
        raise HTTPError(400, "'messages' must be a non-empty list of message objects")
    for i, message in enumerate(value):
        if not isinstance(message, dict):
            raise HTTPError(400, f"'messages[{i}]' must be an object")
        content = message.get("content")
        if content is not None and not isinstance(content, str | list):
            raise HTTPError(400, f"'messages[{i}].content' must be a string or a list of parts")


class SimWorker:
    """The simulated worker: HTTP app, engine, admission and publisher."""

    def __init__(self, settings: SimSettings) -> None:
        self.settings = settings
        self.engine = SimEngine(settings.engine, settings.dp_size, on_load=self._on_load)
        self.admission = Admission(settings.admission)
        self.publisher: EventPublisher | None = None
        self.registry = CollectorRegistry()
        self.registry.register(_EngineCollector(self))
        self.registry.register(self.admission.collector())
        self.ttft = Histogram(
            "vllm:time_to_first_token_seconds",
            "Histogram of time to first token in seconds.",
            ["engine", "model_name"],
            buckets=TTFT_BUCKETS,
            registry=self.registry,
        )
        self.app = self._make_app()
        self.port = settings.port
        self.endpoint = ""
        self._runner: web.AppRunner | None = None
        self._created = int(time.time())

    # lifecycle -------------------------------------------------------------

    async def start(self) -> None:
        """Start the engine, listen, then announce ``config`` and initial loads."""
        s = self.settings
        self.engine.start()
        self._runner, self.port = await listen(self.app, s.host, s.port, s.shutdown_timeout)
        self.endpoint = s.advertise or advertised_endpoint(s.host, self.port)
        log.info(
            "worker %s serving %s on http://%s (advertised %s, dp_size %d)",
            s.worker_id,
            s.model,
            join_host_port(s.host, self.port),
            self.endpoint,
            s.dp_size,
        )
        if s.publish:
            publisher = EventPublisher(
                s.publish,
                self.config_event(),
                heartbeat=s.heartbeat,
                debounce=s.debounce,
                curve=s.curve,
            )
            for rank in self.engine.ranks:
                self._publish_load(publisher, rank.rank, rank.load())
            await publisher.start()
            self.publisher = publisher
            log.info("publishing load events to %s", ", ".join(s.publish))

    async def stop(self) -> None:
        """Say ``bye``, stop serving (in-flight requests get the shutdown timeout), stop."""
        if self.publisher is not None:
            await self.publisher.close()
            await asyncio.sleep(DRAIN_AFTER_BYE)
        if self._runner is not None:
            await self._runner.cleanup()
            self._runner = None
        await self.engine.stop()

    def config_event(self) -> ConfigEvent:
        s = self.settings
        return ConfigEvent(
            worker_id=s.worker_id,
            model=s.model,
            endpoint=self.endpoint,
            kv_total_blocks=s.engine.kv_total_blocks,
            block_size=s.engine.block_size,
            max_num_batched_tokens=s.engine.max_num_batched_tokens,
            dp_size=s.dp_size,
            worker_type="decode",
        )

    def _on_load(self, rank: int, load: RankLoad) -> None:
        if self.publisher is not None:
            self._publish_load(self.publisher, rank, load)

    def _publish_load(self, publisher: EventPublisher, rank: int, load: RankLoad) -> None:
        publisher.update_load(
            rank,
            active_decode_blocks=load.active_decode_blocks,
            active_prefill_tokens=load.active_prefill_tokens,
            num_requests_waiting=load.num_waiting,
            request_active_slots=load.num_running,
            request_total_slots=self.settings.engine.max_num_seqs,
        )

    # HTTP ------------------------------------------------------------------

    def _make_app(self) -> web.Application:
        app = web.Application(middlewares=[self._errors], client_max_size=16 * 1024 * 1024)
        app.on_response_prepare.append(self._add_worker_header)
        app.router.add_post("/v1/chat/completions", self._chat)
        app.router.add_post("/v1/completions", self._completions)
        app.router.add_post("/v1/embeddings", self._embeddings)
        app.router.add_get("/v1/models", self._models)
        app.router.add_get("/health", self._health)
        app.router.add_get("/metrics", self._metrics)
        app.router.add_get("/sim/slowdown", self._get_slowdown)
        app.router.add_post("/sim/slowdown", self._set_slowdown)
        return app

    async def _add_worker_header(self, request: web.Request, response: web.StreamResponse) -> None:
        response.headers[WORKER_ID_HEADER] = self.settings.worker_id

    @web.middleware
    async def _errors(
        self,
        request: web.Request,
        handler: Callable[[web.Request], Awaitable[web.StreamResponse]],
    ) -> web.StreamResponse:
        try:
            return await handler(request)
        except HTTPError as exc:
            return json_error(exc.status, exc.message)
        except web.HTTPException as exc:
            if exc.status < 400:
                raise
            response = json_error(exc.status, exc.reason)
            if "Allow" in exc.headers:
                response.headers["Allow"] = exc.headers["Allow"]
            return response
        except Overloaded:
            return rejection_response(self.admission)
        except (asyncio.CancelledError, ConnectionResetError):
            raise
        except Exception:
            log.exception("unexpected error on %s %s", request.method, request.path)
            return json_error(500, "Internal error in the simulated worker")

    async def _read_body(self, request: web.Request) -> dict[str, Any]:
        raw = await request.read()
        try:
            body = msgspec.json.decode(raw)
        except msgspec.DecodeError as exc:
            raise HTTPError(400, f"Request body is not valid JSON: {exc}") from None
        if not isinstance(body, dict):
            raise HTTPError(400, "Request body must be a JSON object")
        model = body.get("model")
        if model is None:
            raise HTTPError(400, "Request body has no 'model' field")
        if not isinstance(model, str):
            raise HTTPError(400, f"'model' must be a string, got {type(model).__name__}")
        if model != self.settings.model:
            raise HTTPError(404, f"The model `{model}` does not exist.")
        return body

    def _parse_generation(self, body: dict[str, Any], *, chat: bool) -> Generation:
        if chat:
            _check_messages(body.get("messages"))
            prompt_tokens = estimate_tokens(body["messages"])
            prompt_tokens += self.settings.engine.chat_template_tokens
            max_tokens = _optional_int(body, "max_completion_tokens", 1)
            if max_tokens is None:
                max_tokens = _optional_int(body, "max_tokens", 1)
        else:
            if body.get("prompt") is None:
                raise HTTPError(400, "Request body has no 'prompt' field")
            _check_prompt(body["prompt"], "prompt")
            prompt_tokens = estimate_tokens(body["prompt"])
            max_tokens = _optional_int(body, "max_tokens", 1)
        n = _optional_int(body, "n", 1)
        if n is not None and n != 1:
            raise HTTPError(400, f"only n=1 is supported, got n={n}")
        stream = _optional_bool(body, "stream")
        options = body.get("stream_options")
        if options is not None and not isinstance(options, dict):
            raise HTTPError(400, "'stream_options' must be an object")
        include_usage = stream and _optional_bool(options or {}, "include_usage")
        gen = Generation(
            chat=chat,
            prompt_tokens=prompt_tokens,
            max_tokens=max_tokens if max_tokens is not None else self.settings.default_max_tokens,
            stream=stream,
            include_usage=include_usage,
        )
        try:
            self.engine.check(gen.prompt_tokens, gen.max_tokens)
        except ValueError as exc:
            raise HTTPError(400, str(exc)) from None
        return gen

    async def _chat(self, request: web.Request) -> web.StreamResponse:
        gen = self._parse_generation(await self._read_body(request), chat=True)
        return await self._generate(request, gen)

    async def _completions(self, request: web.Request) -> web.StreamResponse:
        gen = self._parse_generation(await self._read_body(request), chat=False)
        return await self._generate(request, gen)

    async def _generate(self, request: web.Request, gen: Generation) -> web.StreamResponse:
        async with self.admission.slot():
            submitted = time.monotonic()
            stream = self.engine.submit(gen.prompt_tokens, gen.max_tokens)
            try:
                if gen.stream:
                    return await self._stream_sse(request, gen, stream, submitted)
                try:
                    await stream.wait()
                except EngineStopped:
                    return json_error(503, "The worker is shutting down")
                return self._full_response(gen, stream)
            finally:
                stream.abort()  # no-op when finished; frees KV and slot otherwise

    def _full_response(self, gen: Generation, stream: RequestStream) -> web.Response:
        text = "".join(_token_text(i, gen.chat) for i in range(stream.num_output))
        usage = _usage(stream.prompt_tokens, stream.num_output)
        choice: dict[str, Any]
        if gen.chat:
            choice = {
                "index": 0,
                "message": {"role": "assistant", "content": text},
                "logprobs": None,
                "finish_reason": "length",
            }
            prefix, obj = "chatcmpl", "chat.completion"
        else:
            choice = {"index": 0, "text": text, "logprobs": None, "finish_reason": "length"}
            prefix, obj = "cmpl", "text_completion"
        response = _json_response(
            {
                "id": f"{prefix}-{uuid.uuid4().hex}",
                "object": obj,
                "created": int(time.time()),
                "model": self.settings.model,
                "choices": [choice],
                "usage": usage,
            }
        )
        response.headers[DP_RANK_HEADER] = str(stream.rank)
        return response

    async def _stream_sse(
        self, request: web.Request, gen: Generation, stream: RequestStream, submitted: float
    ) -> web.StreamResponse:
        """The SSE stream of a request; its time to first token (from its submission to the
        engine, as vLLM's histogram counts it) is reported with the next load event."""
        response = web.StreamResponse(
            headers={
                "content-type": "text/event-stream",
                "cache-control": "no-cache",
                DP_RANK_HEADER: str(stream.rank),
            }
        )
        await response.prepare(request)
        base: dict[str, Any] = {
            "id": f"{'chatcmpl' if gen.chat else 'cmpl'}-{uuid.uuid4().hex}",
            "object": "chat.completion.chunk" if gen.chat else "text_completion",
            "created": int(time.time()),
            "model": self.settings.model,
        }
        last = gen.max_tokens - 1
        try:
            async for i in stream:
                if i == 0:
                    ttft = time.monotonic() - submitted
                    self.ttft.labels(str(stream.rank), self.settings.model).observe(ttft)
                    if self.publisher is not None:
                        self.publisher.report_ttft(stream.rank, ttft)
                finish = "length" if i == last else None
                choice: dict[str, Any]
                if gen.chat:
                    delta = {"content": _token_text(i, True)}
                    if i == 0:
                        delta = {"role": "assistant", **delta}
                    choice = {"index": 0, "delta": delta, "logprobs": None, "finish_reason": finish}
                else:
                    choice = {
                        "index": 0,
                        "text": _token_text(i, False),
                        "logprobs": None,
                        "finish_reason": finish,
                    }
                chunk = {**base, "choices": [choice]}
                if gen.include_usage:
                    chunk["usage"] = None
                await response.write(_sse(chunk))
            if gen.include_usage:
                usage = _usage(stream.prompt_tokens, stream.num_output)
                await response.write(_sse({**base, "choices": [], "usage": usage}))
            await response.write(b"data: [DONE]\n\n")
            await response.write_eof()
        except EngineStopped:
            response.force_close()  # no [DONE]: the client sees a cut stream
        except ConnectionResetError:
            pass  # client gone; the caller aborts the sequence
        return response

    async def _embeddings(self, request: web.Request) -> web.StreamResponse:
        body = await self._read_body(request)
        value = body.get("input")
        if value is None:
            raise HTTPError(400, "Request body has no 'input' field")
        _check_prompt(value, "input")
        fmt = body.get("encoding_format") or "float"
        if fmt not in ("float", "base64"):
            raise HTTPError(400, f"'encoding_format' must be 'float' or 'base64', got {fmt!r}")
        prompt_tokens = estimate_tokens(value)
        if prompt_tokens < 1:
            raise HTTPError(400, "'input' must not be empty")
        try:
            self.engine.check(prompt_tokens, 0, prefill_only=True)
        except ValueError as exc:
            raise HTTPError(400, str(exc)) from None
        items = value if isinstance(value, list) and not _is_int(value[0]) else [value]
        async with self.admission.slot():
            stream = self.engine.submit(prompt_tokens, 0, prefill_only=True)
            try:
                await stream.wait()
            except EngineStopped:
                return json_error(503, "The worker is shutting down")
            finally:
                stream.abort()
        data = [
            {
                "object": "embedding",
                "index": i,
                "embedding": _embedding(item, self.settings.embedding_dim, fmt),
            }
            for i, item in enumerate(items)
        ]
        response = _json_response(
            {
                "object": "list",
                "data": data,
                "model": self.settings.model,
                "usage": {"prompt_tokens": prompt_tokens, "total_tokens": prompt_tokens},
            }
        )
        response.headers[DP_RANK_HEADER] = str(stream.rank)
        return response

    async def _models(self, request: web.Request) -> web.StreamResponse:
        model = self.settings.model
        return _json_response(
            {
                "object": "list",
                "data": [
                    {
                        "id": model,
                        "object": "model",
                        "created": self._created,
                        "owned_by": "extproc-sim",
                        "root": model,
                        "parent": None,
                        "max_model_len": self.settings.engine.max_model_len,
                    }
                ],
            }
        )

    async def _health(self, request: web.Request) -> web.StreamResponse:
        return _json_response({"status": "ok", "worker_id": self.settings.worker_id})

    async def _metrics(self, request: web.Request) -> web.StreamResponse:
        return web.Response(
            body=generate_latest(self.registry), headers={"content-type": CONTENT_TYPE_LATEST}
        )

    async def _get_slowdown(self, request: web.Request) -> web.StreamResponse:
        return _json_response({"factor": self.engine.slowdown})

    async def _set_slowdown(self, request: web.Request) -> web.StreamResponse:
        """``{"factor": f}``: every engine step takes ``f`` times as long until set back to 1."""
        raw = await request.read()
        try:
            body = msgspec.json.decode(raw)
        except msgspec.DecodeError as exc:
            raise HTTPError(400, f"Request body is not valid JSON: {exc}") from None
        factor = body.get("factor") if isinstance(body, dict) else None
        if (
            isinstance(factor, bool)
            or not isinstance(factor, int | float)
            or not 1.0 <= factor <= MAX_SLOWDOWN
        ):
            raise HTTPError(
                422,
                f"'factor' must be a number from 1 (no slowdown) to {MAX_SLOWDOWN:g}, "
                f"got {factor!r}" if isinstance(body, dict) else
                f"Request body must be a JSON object with 'factor', got {body!r}",
            )  # fmt: skip
        self.engine.slowdown = float(factor)
        log.info("engine slowdown x%g", factor)
        return _json_response({"factor": self.engine.slowdown})


class _EngineCollector(Collector):
    """vLLM-named per-rank engine series, read from the engine at scrape time."""

    def __init__(self, worker: SimWorker) -> None:
        self._worker = worker

    def collect(self) -> Iterator[Metric]:
        worker = self._worker
        model = worker.settings.model
        cfg = worker.settings.engine
        labels = ["engine", "model_name"]
        running = GaugeMetricFamily(
            "vllm:num_requests_running",
            "Number of requests in model execution batches.",
            None,
            labels,
        )
        waiting = GaugeMetricFamily(
            "vllm:num_requests_waiting", "Number of requests waiting to be processed.", None, labels
        )
        usage = GaugeMetricFamily(
            "vllm:kv_cache_usage_perc", "KV-cache usage. 1 means 100 percent usage.", None, labels
        )
        preemptions = CounterMetricFamily(
            "vllm:num_preemptions", "Cumulative number of preemption from the engine.", None, labels
        )
        prompt = CounterMetricFamily(
            "vllm:prompt_tokens", "Number of prefill tokens processed.", None, labels
        )
        generation = CounterMetricFamily(
            "vllm:generation_tokens", "Number of generation tokens processed.", None, labels
        )
        info = GaugeMetricFamily(
            "vllm:cache_config_info",
            "Information of the LLMEngine CacheConfig",
            None,
            ["block_size", "cache_dtype", "enable_prefix_caching", "engine", "num_gpu_blocks"],
        )
        for rank in worker.engine.ranks:
            values = [str(rank.rank), model]
            core = rank.core
            load = core.load()
            running.add_metric(values, load.num_running)
            waiting.add_metric(values, load.num_waiting)
            usage.add_metric(values, load.kv_usage)
            preemptions.add_metric(values, core.num_preemptions)
            prompt.add_metric(values, core.num_prompt_tokens)
            generation.add_metric(values, core.num_generated_tokens)
            info.add_metric(
                [str(cfg.block_size), "auto", "False", str(rank.rank), str(cfg.kv_total_blocks)], 1
            )
        yield from (running, waiting, usage, preemptions, prompt, generation, info)


def _token_text(i: int, chat: bool) -> str:
    word = WORDS[i % len(WORDS)]
    return word if chat and i == 0 else " " + word


def _usage(prompt_tokens: int, completion_tokens: int) -> dict[str, int]:
    return {
        "prompt_tokens": prompt_tokens,
        "completion_tokens": completion_tokens,
        "total_tokens": prompt_tokens + completion_tokens,
    }


def _sse(payload: Any) -> bytes:
    return b"data: " + _json.encode(payload) + b"\n\n"


def _embedding(item: Any, dim: int, fmt: str) -> list[float] | str:
    """A deterministic unit vector derived from the input text."""
    digest = hashlib.blake2b(repr(item).encode(), digest_size=max(dim, 1)).digest()
    raw = [b / 127.5 - 1.0 for b in digest[:dim]]
    norm = sum(v * v for v in raw) ** 0.5 or 1.0
    vector = [round(v / norm, 6) for v in raw]
    if fmt == "base64":
        return base64.b64encode(struct.pack(f"<{dim}f", *vector)).decode()
    return vector


async def serve(settings: SimSettings) -> int:
    """Run until SIGTERM/SIGINT, then say ``bye`` and stop; the exit code."""
    return await cli.serve_until_signal(
        SimWorker(settings),
        log,
        f"worker {settings.worker_id}",
        start_errors=(OSError, PublisherError),
    )


def main(argv: Sequence[str] | None = None) -> None:
    settings, warning = parse_args(argv)
    cli.run(serve(settings), settings.log_level, warning, log)


if __name__ == "__main__":
    main()
