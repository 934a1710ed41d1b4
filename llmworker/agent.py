"""Sidecar agent: publish a real engine's load to the extproc (docs/events.md, docs/worker.md).

``python -m llmworker.agent --engine vllm|sglang --engine-url URL --model M
--endpoint HOST:PORT --worker-id ID --publish tcp://HOST:PORT [--listen H:P
--engine-request-limit N]``; ``--help`` lists every flag with its unit.

Every ``--interval`` seconds the agent scrapes the engine's Prometheus
``/metrics`` page, turns it into a :class:`~llmworker.engine_metrics.EngineSnapshot`
and hands ``config`` and per-rank ``load`` to an
:class:`~extproc.events.publisher.EventPublisher`, which sends changes at once
and repeats everything every heartbeat. Nothing is announced before the first
good scrape. A failed scrape (engine unreachable, HTTP error, malformed text) is
logged once per change of state and publishes nothing new; the last state keeps
being repeated for ``--engine-down-grace`` seconds, then the agent says ``bye``
and announces the worker again when the metrics come back.

With ``--listen H:P`` the agent is also an HTTP reverse proxy in front of the
engine (:mod:`llmworker.proxy`; responses, SSE included, are streamed
through chunk by chunk with their status and headers), counts the prompt tokens
of requests it forwards, and with ``--engine-request-limit N`` applies
worker-side admission (N in the engine, Q = ``DYN_DYNAMO_REQUEST_QUEUE_LIMIT``
waiting, the rest rejected with the overload status, ``x-worker-overloaded: 1``
and a flat JSON body). ``GET /metrics`` through the proxy returns the engine's
metrics plus the ``dynamo_*`` admission series. The announced endpoint is then
the listen address unless ``--endpoint`` says otherwise.

How engine metrics become event fields. Each cell lists sources in order, the
first one present wins; a flag applies only when the engine does not print the
value; "omitted" means the key is left out ("not reported"). Metric names drop
their ``vllm:`` / ``sglang:`` prefix.

vLLM (`--engine vllm`):

| event field                     | source                                                       |
|---------------------------------|--------------------------------------------------------------|
| `load.dp_rank`                  | label `engine` of each series (a)                            |
| `config.block_size`             | `cache_config_info{block_size}`; `--block-size`; 16          |
| `config.kv_total_blocks` (b)    | `cache_config_info{num_gpu_blocks}`; `--kv-total-blocks`     |
| `config.max_num_batched_tokens` | `vllm_config_info` (c); `--max-num-batched-tokens`; omitted  |
| `config.dp_size`                | `--dp-size`, raised to the ranks seen; the ranks seen        |
| `load.active_decode_blocks`     | `round(kv_cache_usage_perc * kv_total_blocks)` (d); omitted  |
| `load.active_prefill_tokens`    | `num_requests_waiting * mean_prompt` (e); omitted            |

SGLang (`--engine sglang`, started with `--enable-metrics`):

| event field                     | source                                                       |
|---------------------------------|--------------------------------------------------------------|
| `load.dp_rank`                  | label `dp_rank` of each series (a)                           |
| `config.block_size`             | `page_size` (f); `--block-size`; 16 (g)                      |
| `config.kv_total_blocks` (b)    | `max_total_num_tokens // block_size`; `--kv-total-blocks`    |
| `config.max_num_batched_tokens` | `--max-num-batched-tokens`; omitted                          |
| `config.dp_size`                | `--dp-size`, raised to the ranks seen; the ranks seen        |
| `load.active_decode_blocks`     | `ceil(num_used_tokens / block_size)`; `token_usage` (h)      |
| `load.active_prefill_tokens`    | `num_prefill_tokens` (f); `num_queue_reqs * mean_prompt` (e) |

(a) Ranks are numbered 0, 1, ... in ascending label order; a series without
the label is rank 0; several series of one rank (SGLang prints one per TP/PP
rank) give the largest value.
(b) Per rank; a rank whose total differs from rank 0's also sends it in its
`load`. Omitted when no source has it.
(c) Label `scheduler_config_max_num_batched_tokens`, if the vLLM build prints
that info series.
(d) `kv_cache_usage_perc` is a 0-1 fraction; `gpu_cache_usage_perc` (vLLM
before 0.9) is read when it is absent. Omitted while `kv_total_blocks` is
unknown.
(e) `mean_prompt` is the mean prompt length of finished requests: vLLM
`request_prompt_tokens_sum / request_prompt_tokens_count`, else
`prompt_tokens_total / request_success_total` (summed over finish reasons);
SGLang `prompt_tokens_histogram_sum / _count`, else `prompt_tokens_total /
num_requests_total`. The product is rounded; it is 0 when nothing waits and
omitted while requests wait and no mean is known yet. It misses chunked
prefill still running inside the engine. With `--listen`, the larger of this
and the agent's own count (below) is sent.
(f) Not printed by upstream SGLang's collector; read when a build prints it.
(g) SGLang counts its KV pool in tokens; the blocks announced are logical
blocks of `block_size` tokens, the unit the router uses for its estimate.
(h) When `num_used_tokens` is absent: `round(token_usage * kv_total_blocks)`.

The agent's own count: the prompt tokens (``ceil(UTF-8 bytes / 4)``, as the
router counts them) of each proxied inference request, from dispatch until the
first SSE event that carries generated text (a non-streaming request: until its
response arrives), charged to the rank with the fewest such tokens.

The engine's TTFT: the difference of `vllm:time_to_first_token_seconds` (SGLang:
`sglang:time_to_first_token_seconds`) between two scrapes, per bucket, goes out
once with the rank's next `load` as `ttft_seconds` (the first scrape sets the
baseline; a restarted engine's lower counts are skipped; the `+Inf` bucket counts
at the largest finite bound). The extproc's latency controller reads it with
`--ttft-source engine`.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import logging
import os
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Annotated, Any, ClassVar, Literal

import aiohttp
from prometheus_client import CollectorRegistry
from pydantic import AfterValidator, BeforeValidator, model_validator
from yarl import URL

from extproc.events.curve import CurveClient
from extproc.events.publisher import EventPublisher, PublisherError
from extproc.events.schema import ConfigEvent, EventRejected, decode, encode
from llmworker import cli
from llmworker.admission import ADMISSION_ENVS, ENGINE_LIMIT_ENV, Admission, AdmissionConfig
from llmworker.engine_metrics import (
    ENGINES,
    Engine,
    EngineSnapshot,
    MetricsParseError,
    RankStats,
    parse_engine_metrics,
    ttft_delta,
)
from llmworker.netaddr import advertised_endpoint, join_host_port, join_url
from llmworker.proxy import EngineProxy, PrefillLedger
from llmworker.settings import Number, OptWhole, SettingsError, option

log = logging.getLogger("llmworker.agent")

DEFAULT_BLOCK_SIZE = 16
MAX_METRICS_BYTES = 32 * 1024 * 1024


@dataclass(frozen=True, slots=True)
class AgentSettings:
    """Everything the agent needs, validated."""

    engine: Engine
    engine_url: URL
    model: str
    worker_id: str
    publish: tuple[str, ...]
    endpoint: str | None = None
    listen: tuple[str, int] | None = None
    admission: AdmissionConfig = field(default_factory=AdmissionConfig)
    metrics_path: str = "/metrics"
    interval: float = 0.1
    scrape_timeout: float = 1.0
    engine_down_grace: float = 10.0
    block_size: int | None = None
    kv_total_blocks: int | None = None
    max_num_batched_tokens: int | None = None
    dp_size: int | None = None
    worker_type: str = "decode"
    heartbeat: float = 2.0
    debounce: float = 0.005
    curve: CurveClient | None = None
    shutdown_timeout: float = 5.0
    log_level: str = "INFO"

    @property
    def metrics_url(self) -> URL:
        return join_url(self.engine_url, self.metrics_path)


# ---------------------------------------------------------------------------
# snapshot -> event fields (no I/O)


@dataclass(frozen=True, slots=True)
class RankLoad:
    """The ``load`` fields of one rank; None = not reported."""

    active_decode_blocks: int | None
    active_prefill_tokens: int | None
    kv_total_blocks: int | None = None


@dataclass(frozen=True, slots=True)
class WorkerView:
    """What one scrape says about the worker: config fields and per-rank loads."""

    block_size: int
    kv_total_blocks: int | None
    max_num_batched_tokens: int | None
    dp_size: int
    loads: dict[int, RankLoad]
    ranks_seen: int


def _total_blocks(
    stats: RankStats, engine: Engine, block_size: int, fallback: int | None
) -> int | None:
    if engine == "vllm":
        return stats.kv_total_blocks or fallback
    if stats.kv_total_tokens:
        return stats.kv_total_tokens // block_size
    return fallback


def _decode_blocks(stats: RankStats, block_size: int, total: int | None) -> int | None:
    if stats.kv_used_tokens is not None:
        return -(-stats.kv_used_tokens // block_size)
    if stats.kv_usage is not None and total:
        return round(stats.kv_usage * total)
    return None


def _prefill_estimate(stats: RankStats) -> int | None:
    if stats.prefill_tokens is not None:
        return stats.prefill_tokens
    if stats.num_waiting == 0:
        return 0
    if stats.num_waiting is not None and stats.avg_prompt_tokens is not None:
        return round(stats.num_waiting * stats.avg_prompt_tokens)
    return None


def worker_view(
    snapshot: EngineSnapshot,
    settings: AgentSettings,
    proxied_prefill: Sequence[int] | None = None,
) -> WorkerView:
    """Config fields and per-rank loads from one snapshot (see the module table).

    ``proxied_prefill``: the agent's own prompt-token count per rank in proxy mode.
    """
    ranks = snapshot.ranks
    engine_block = next((r.block_size for r in ranks if r.block_size), None)
    block_size = engine_block or settings.block_size or DEFAULT_BLOCK_SIZE
    totals = [
        _total_blocks(r, snapshot.engine, block_size, settings.kv_total_blocks) for r in ranks
    ]
    config_total = totals[0] if totals else settings.kv_total_blocks
    loads: dict[int, RankLoad] = {}
    for dp_rank, (stats, total) in enumerate(zip(ranks, totals, strict=True)):
        prefill = _prefill_estimate(stats)
        if proxied_prefill is not None:
            own = proxied_prefill[dp_rank] if dp_rank < len(proxied_prefill) else 0
            prefill = max(own, prefill or 0)
        loads[dp_rank] = RankLoad(
            active_decode_blocks=_decode_blocks(stats, block_size, total),
            active_prefill_tokens=prefill,
            kv_total_blocks=total if total != config_total else None,
        )
    return WorkerView(
        block_size=block_size,
        kv_total_blocks=config_total,
        max_num_batched_tokens=snapshot.max_num_batched_tokens or settings.max_num_batched_tokens,
        dp_size=max(settings.dp_size or len(ranks) or 1, len(ranks)),
        loads=loads,
        ranks_seen=len(ranks),
    )


# ---------------------------------------------------------------------------
# the agent


class ScrapeFailed(Exception):
    """One scrape did not give a usable snapshot; ``kind`` labels the state."""

    def __init__(self, kind: str, message: str) -> None:
        super().__init__(message)
        self.kind = kind


class Agent:
    """Scrapes the engine, publishes its load, and optionally proxies it."""

    def __init__(self, settings: AgentSettings) -> None:
        self.settings = settings
        self.admission = Admission(settings.admission)
        self.registry = CollectorRegistry()
        self.registry.register(self.admission.collector())
        self.ledger = PrefillLedger(self._publish_loads)
        self.proxy: EngineProxy | None = None
        self.publisher: EventPublisher | None = None
        self.snapshot: EngineSnapshot | None = None
        # The engine's cumulative TTFT histogram per rank at the previous scrape.
        self._ttft_seen: dict[int, tuple[tuple[float, float], ...]] = {}
        self.endpoint = settings.endpoint or ""
        self.scrapes = 0
        self.failed_scrapes = 0
        self.failed = asyncio.Event()  # set if the agent had to give up (publisher error)
        self._state: str | None = None  # "ok" or the kind of the current failure
        self._down_since: float | None = None
        self._warned: set[str] = set()
        self._session: aiohttp.ClientSession | None = None
        self._task: asyncio.Task[None] | None = None

    async def start(self) -> None:
        """Listen (proxy mode), then scrape every interval in the background."""
        s = self.settings
        self._session = aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=s.scrape_timeout))
        if s.listen is not None:
            self.proxy = EngineProxy(
                s.engine_url, self.admission, self.ledger, self.registry, s.shutdown_timeout
            )
            host, port = s.listen
            bound = await self.proxy.start(host, port)
            if not s.endpoint:
                self.endpoint = advertised_endpoint(host, bound)
            log.info(
                "proxying http://%s -> %s (admission %s)",
                join_host_port(host, bound),
                s.engine_url,
                f"N={s.admission.engine_request_limit} Q={s.admission.queue_limit}"
                if s.admission.enabled
                else "off",
            )
        log.info(
            "worker %s: scraping %s every %g s, announcing %s for model %s",
            s.worker_id,
            s.metrics_url,
            s.interval,
            self.endpoint,
            s.model,
        )
        self._task = asyncio.get_running_loop().create_task(self._scrape_loop(), name="scrape")

    async def stop(self) -> None:
        """Say ``bye``, stop scraping and proxying (in-flight requests get the timeout)."""
        if self._task is not None:
            self._task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._task
            self._task = None
        if self.publisher is not None:
            await self.publisher.close()
            self.publisher = None
        if self.proxy is not None:
            await self.proxy.stop()
        if self._session is not None:
            await self._session.close()
            self._session = None

    # scraping ----------------------------------------------------------------

    async def _scrape_loop(self) -> None:
        loop = asyncio.get_running_loop()
        next_at = loop.time()
        while True:
            try:
                await self.scrape_once()
            except PublisherError as exc:
                log.error("cannot publish to %s: %s", ", ".join(self.settings.publish), exc)
                self.failed.set()
                return
            except Exception as exc:  # keep scraping whatever one scrape did
                if repr(exc) not in self._warned:
                    self._warned.add(repr(exc))
                    log.exception("unexpected error while publishing the engine's load")
            next_at = max(next_at + self.settings.interval, loop.time())
            await asyncio.sleep(next_at - loop.time())

    async def scrape_once(self) -> None:
        """One scrape: publish what it says, or record the failure."""
        self.scrapes += 1
        try:
            snapshot = parse_engine_metrics(self.settings.engine, await self._fetch())
        except MetricsParseError as exc:
            await self._scrape_failed(ScrapeFailed("malformed", f"malformed metrics: {exc}"))
            return
        except ScrapeFailed as exc:
            await self._scrape_failed(exc)
            return
        if self._state != "ok":
            if self._state is None:
                log.info("engine metrics readable at %s", self.settings.metrics_url)
            else:
                log.info("engine metrics at %s readable again", self.settings.metrics_url)
        self._state, self._down_since = "ok", None
        self.snapshot = snapshot
        await self._publish(snapshot)

    async def _fetch(self) -> str:
        assert self._session is not None
        url = self.settings.metrics_url
        try:
            async with self._session.get(url) as response:
                if response.status != 200:
                    raise ScrapeFailed("http", f"GET {url} answered HTTP {response.status}")
                body = b""
                while len(body) <= MAX_METRICS_BYTES:
                    chunk = await response.content.read(MAX_METRICS_BYTES + 1 - len(body))
                    if not chunk:
                        break
                    body += chunk
        except TimeoutError:
            raise ScrapeFailed(
                "timeout", f"GET {url} took longer than {self.settings.scrape_timeout} s"
            ) from None
        except (aiohttp.ClientError, OSError) as exc:
            raise ScrapeFailed("unreachable", f"GET {url} failed: {exc}") from None
        if len(body) > MAX_METRICS_BYTES:
            raise ScrapeFailed("malformed", f"GET {url}: more than {MAX_METRICS_BYTES} bytes")
        return body.decode("utf-8", errors="replace")

    async def _scrape_failed(self, failure: ScrapeFailed) -> None:
        self.failed_scrapes += 1
        now = asyncio.get_running_loop().time()
        if self._down_since is None:
            self._down_since = now
        if failure.kind != self._state:
            log.warning("%s; publishing nothing new until it recovers", failure)
            self._state = failure.kind
        grace = self.settings.engine_down_grace
        if self.publisher is not None and now - self._down_since >= grace:
            log.warning(
                "no usable engine metrics for %g s: saying bye; the worker is announced again "
                "when they return",
                grace,
            )
            publisher, self.publisher = self.publisher, None
            await publisher.close()

    # publishing --------------------------------------------------------------

    def _view(self, snapshot: EngineSnapshot) -> WorkerView:
        proxied = self.ledger.per_rank() if self.proxy is not None else None
        return worker_view(snapshot, self.settings, proxied)

    def _config_fields(self, view: WorkerView) -> dict[str, Any]:
        return {
            "kv_total_blocks": view.kv_total_blocks,
            "block_size": view.block_size,
            "max_num_batched_tokens": view.max_num_batched_tokens,
            "dp_size": view.dp_size,
            "worker_type": self.settings.worker_type,
        }

    async def _publish(self, snapshot: EngineSnapshot) -> None:
        view = self._view(snapshot)
        self._warn_about_overrides(snapshot, view)
        self.ledger.resize(view.dp_size)
        fields = self._config_fields(view)
        publisher = self.publisher
        if publisher is None:
            s = self.settings
            config = ConfigEvent(
                worker_id=s.worker_id, model=s.model, endpoint=self.endpoint, **fields
            )
            publisher = EventPublisher(
                s.publish, config, heartbeat=s.heartbeat, debounce=s.debounce, curve=s.curve
            )
            self._send_loads(publisher, view)
            self._send_ttft(publisher, snapshot, view)
            await publisher.start()
            self.publisher = publisher
            log.info(
                "announced %s: kv_total_blocks=%s block_size=%d dp_size=%d to %s",
                s.worker_id,
                view.kv_total_blocks,
                view.block_size,
                view.dp_size,
                ", ".join(s.publish),
            )
            return
        try:
            publisher.update_config(**fields)
        except ValueError as exc:
            log.error("not announcing config change: %s", exc)
        self._send_loads(publisher, view)
        self._send_ttft(publisher, snapshot, view)

    def _send_ttft(
        self, publisher: EventPublisher, snapshot: EngineSnapshot, view: WorkerView
    ) -> None:
        """The engine's TTFT histogram since the previous scrape, per rank, with the next
        load message (the first scrape only sets the baseline)."""
        for dp_rank, stats in enumerate(snapshot.ranks):
            before = self._ttft_seen.get(dp_rank)
            self._ttft_seen[dp_rank] = stats.ttft_buckets
            if before and stats.ttft_buckets and dp_rank < view.dp_size:
                delta = [(b, n) for b, n in ttft_delta(before, stats.ttft_buckets) if b <= 86_400]
                if delta:
                    publisher.report_ttft_counts(dp_rank, delta)

    def _publish_loads(self) -> None:
        """The proxy's prefill count changed: send the loads without waiting to scrape."""
        if self.publisher is not None and self.snapshot is not None and self._state == "ok":
            self._send_loads(self.publisher, self._view(self.snapshot))

    @staticmethod
    def _send_loads(publisher: EventPublisher, view: WorkerView) -> None:
        for rank, load in view.loads.items():
            if rank < view.dp_size:
                publisher.update_load(
                    rank,
                    active_decode_blocks=load.active_decode_blocks,
                    active_prefill_tokens=load.active_prefill_tokens,
                    kv_total_blocks=load.kv_total_blocks,
                )

    def _warn_about_overrides(self, snapshot: EngineSnapshot, view: WorkerView) -> None:
        s = self.settings
        first = snapshot.ranks[0] if snapshot.ranks else None
        checks = [
            ("--block-size", s.block_size, first.block_size if first else None),
            ("--max-num-batched-tokens", s.max_num_batched_tokens, snapshot.max_num_batched_tokens),
        ]
        if first is not None and (first.kv_total_blocks or first.kv_total_tokens):
            checks.append(("--kv-total-blocks", s.kv_total_blocks, view.kv_total_blocks))
        for flag, given, reported in checks:
            if given is not None and reported is not None and given != reported:
                self._warn_once(
                    flag,
                    f"{flag} {given} ignored: the engine reports {reported} "
                    "(the flag applies only when the engine does not)",
                )
        if s.dp_size is not None and view.ranks_seen > s.dp_size:
            self._warn_once(
                "--dp-size",
                f"--dp-size {s.dp_size} but the engine reports {view.ranks_seen} ranks: "
                f"announcing dp_size {view.dp_size}",
            )

    def _warn_once(self, key: str, message: str) -> None:
        if key not in self._warned:
            self._warned.add(key)
            log.warning("%s", message)


# ---------------------------------------------------------------------------
# command line


def _engine_url(text: str) -> URL:
    try:
        url = URL(text)
    except ValueError:
        url = URL()
    if url.scheme not in ("http", "https") or not url.host or url.query_string or url.fragment:
        raise ValueError("expected the engine's base URL like http://127.0.0.1:8000")
    return url


def _metrics_path(text: str) -> str:
    if not text.startswith("/"):
        raise ValueError("expected a path starting with '/'")
    return text


def _base_url(text: str) -> str:
    _engine_url(text)
    return text


def _listen(text: Any) -> tuple[str, int] | None:
    if text is None or isinstance(text, tuple):
        return text
    text = str(text)
    host, sep, port_text = text.rpartition(":")
    if not sep or not port_text.isdigit() or int(port_text) > 65535:
        raise ValueError("expected HOST:PORT (port 0-65535)")
    if host.startswith("[") and host.endswith("]"):
        host = host[1:-1]
    elif ":" in host:
        raise ValueError("expected HOST:PORT; an IPv6 listen address needs brackets")
    return host or "0.0.0.0", int(port_text)


class AgentFlags(cli.WorkerFlags):
    """The agent's settings table."""

    GROUPS: ClassVar[dict[str, tuple[str, str | None]]] = {
        "engine": ("engine", None),
        "facts": ("engine facts", "Used only when the engine's metrics do not carry the value."),
        "worker": ("worker", None),
        "events": cli.WorkerFlags.GROUPS["events"],
        "admission": ("proxy and worker-side admission", cli.ADMISSION_ENV_HELP),
        "logging": cli.WorkerFlags.GROUPS["logging"],
    }

    engine: Engine = option(
        ..., "--engine", "engine", "engine kind", choices=ENGINES, expected="an engine kind"
    )
    engine_url: Annotated[str, AfterValidator(_base_url)] = option(
        ...,
        "--engine-url",
        "engine",
        "engine's OpenAI HTTP server, e.g. http://127.0.0.1:8000",
        metavar="URL",
        expected="the engine's base URL",
    )
    metrics_path: Annotated[str, AfterValidator(_metrics_path)] = option(
        "/metrics",
        "--metrics-path",
        "engine",
        "engine's metrics path",
        metavar="PATH",
        expected="a path starting with '/'",
    )
    interval: Number = option(
        0.1,
        "--interval",
        "engine",
        "scrape period, in seconds",
        metavar="SECONDS",
        expected="a finite number of seconds > 0",
        gt=0,
    )
    scrape_timeout: Number = option(
        1.0,
        "--scrape-timeout",
        "engine",
        "timeout of one scrape, in seconds",
        metavar="SECONDS",
        expected="a finite number of seconds > 0",
        gt=0,
    )
    engine_down_grace: Number = option(
        10.0,
        "--engine-down-grace",
        "engine",
        "seconds without usable metrics before the agent says bye (the last state is "
        "repeated meanwhile)",
        metavar="SECONDS",
        expected="a finite number of seconds >= 0",
        ge=0,
    )
    block_size: OptWhole = option(
        None,
        "--block-size",
        "facts",
        "tokens per KV block (default: the engine's, else 16)",
        metavar="TOKENS",
        expected="an integer >= 1",
        ge=1,
    )
    kv_total_blocks: OptWhole = option(
        None,
        "--kv-total-blocks",
        "facts",
        "KV cache capacity per DP rank, in blocks of --block-size tokens",
        metavar="BLOCKS",
        expected="an integer >= 0",
        ge=0,
    )
    max_num_batched_tokens: OptWhole = option(
        None,
        "--max-num-batched-tokens",
        "facts",
        "engine's per-step token budget, in tokens",
        metavar="TOKENS",
        expected="an integer >= 1",
        ge=1,
    )
    dp_size: OptWhole = option(
        None,
        "--dp-size",
        "facts",
        "data-parallel ranks behind the endpoint (default: the ranks the metrics show)",
        metavar="N",
        expected="an integer >= 1",
        ge=1,
    )
    model: str = option(
        ..., "--model", "worker", "served model name, as clients send it", expected="a name"
    )
    worker_id: str = option(
        ..., "--worker-id", "worker", "stable worker id in events", expected="an id"
    )
    endpoint: cli.EventEndpoint | None = option(
        None,
        "--endpoint",
        "worker",
        "where Envoy reaches this worker's OpenAI server (required without --listen; "
        "default with --listen: the listen address)",
        metavar="HOST:PORT",
        expected="HOST:PORT",
    )
    worker_type: Literal["decode", "prefill"] = option(
        "decode",
        "--worker-type",
        "worker",
        "worker role",
        choices=("decode", "prefill"),
        expected="decode or prefill",
    )
    publish: list[cli.ConnectableZmqEndpoint] = option(
        ...,
        "--publish",
        "events",
        "ZeroMQ endpoint of the extproc event socket, e.g. tcp://127.0.0.1:5557 (repeatable)",
        metavar="ENDPOINT",
        action="append",
        expected="a ZeroMQ endpoint like tcp://127.0.0.1:5557",
    )
    listen: Annotated[tuple[str, int] | None, BeforeValidator(_listen)] = option(
        None,
        "--listen",
        "admission",
        "serve a reverse proxy to the engine here (port 0 = any free); unset = no proxy",
        metavar="HOST:PORT",
        expected="HOST:PORT (port 0-65535)",
    )
    shutdown_timeout: Number = option(
        5.0,
        "--shutdown-timeout",
        "admission",
        "seconds in-flight proxied requests get to finish on SIGTERM",
        metavar="SECONDS",
        expected="a finite number of seconds >= 0",
        ge=0,
    )

    @model_validator(mode="after")
    def _endpoint_and_admission(self) -> AgentFlags:
        if self.listen is None and self.endpoint is None:
            raise ValueError("--endpoint HOST:PORT is required unless --listen is given")
        if self.listen is None and self.engine_request_limit is not None:
            raise ValueError(
                "--engine-request-limit needs --listen: only the proxy can admit requests"
            )
        endpoint = self.endpoint
        if endpoint is None and self.listen is not None:
            endpoint = join_host_port(self.listen[0], self.listen[1] or 1)
        probe = ConfigEvent(worker_id=self.worker_id, model=self.model, endpoint=endpoint or "")
        try:
            decode(*encode(probe))
        except EventRejected as exc:
            raise ValueError(f"--worker-id/--model/--endpoint: {exc.detail}") from None
        return self


def build_parser() -> argparse.ArgumentParser:
    return AgentFlags.build_parser(
        "python -m llmworker.agent",
        "Sidecar next to a vLLM or SGLang server: scrapes its Prometheus /metrics "
        "and publishes the worker's config and per-rank load to the extproc; optionally "
        "fronts the engine as a reverse proxy with worker-side admission.",
    )


def parse_args(
    argv: Sequence[str] | None = None, environ: Mapping[str, str] | None = None
) -> tuple[AgentSettings, str | None]:
    """(settings, startup warning or None); exits 2 with a message on a bad setting.

    Without ``--listen`` the admission variables are not read (only the proxy admits);
    a set DYN_ENGINE_REQUEST_LIMIT is then a warning."""
    parser = build_parser()
    args = vars(parser.parse_args(argv))
    env = os.environ if environ is None else environ
    proxied = "listen" in args
    try:
        flags = AgentFlags.read(
            args, env if proxied else {k: v for k, v in env.items() if k not in ADMISSION_ENVS}
        )
    except SettingsError as exc:
        parser.error(str(exc))
    admission, warning = flags.admission_config()
    if (
        not proxied
        and (os.environ if environ is None else environ).get(ENGINE_LIMIT_ENV, "").strip()
    ):
        warning = f"{ENGINE_LIMIT_ENV} is set but has no effect without --listen"
    settings = AgentSettings(
        engine=flags.engine,
        engine_url=_engine_url(flags.engine_url),
        model=flags.model,
        worker_id=flags.worker_id,
        publish=tuple(flags.publish),
        endpoint=flags.endpoint,
        listen=flags.listen,
        admission=admission,
        metrics_path=flags.metrics_path,
        interval=flags.interval,
        scrape_timeout=flags.scrape_timeout,
        engine_down_grace=flags.engine_down_grace,
        block_size=flags.block_size,
        kv_total_blocks=flags.kv_total_blocks,
        max_num_batched_tokens=flags.max_num_batched_tokens,
        dp_size=flags.dp_size,
        worker_type=flags.worker_type,
        heartbeat=flags.heartbeat,
        curve=flags.curve(),
        debounce=flags.debounce_ms / 1e3,
        shutdown_timeout=flags.shutdown_timeout,
        log_level=flags.log_level,
    )
    return settings, warning


async def serve(settings: AgentSettings) -> int:
    """Run until SIGTERM/SIGINT, then say ``bye`` and stop; the exit code."""
    agent = Agent(settings)
    return await cli.serve_until_signal(
        agent, log, f"agent {settings.worker_id}", failed=agent.failed
    )


def main(argv: Sequence[str] | None = None) -> None:
    settings, warning = parse_args(argv)
    cli.run(serve(settings), settings.log_level, warning, log)


if __name__ == "__main__":
    main()
