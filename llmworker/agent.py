"""Sidecar agent: publish a real engine's load to the extproc (docs/events.md, docs/worker.md).

``python -m llmworker.agent --engine vllm|sglang|llamacpp --engine-url URL --model M
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

With ``--kv-events-bind tcp://HOST:PORT`` (vLLM only) the agent also binds a ZMQ SUB socket for
vLLM's own KV events (:mod:`llmworker.vllm_kv_events`; vLLM's ``--kv-events-config`` names the
same endpoint): the blocks vLLM stores between two scrapes are added to the last scrape's
blocks in use and published at once; the next scrape re-anchors the count.

Which engine metric feeds which event field, per engine: docs/worker.md (the mapping tables).
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections.abc import Sequence
from dataclasses import dataclass, field, replace
from typing import Any

import aiohttp
from prometheus_client import CollectorRegistry
from yarl import URL

from extproc.events.publisher import EventPublisher, PublisherError
from extproc.events.schema import ConfigEvent
from llmworker import cli
from llmworker.admission import Admission
from llmworker.agent_settings import AgentSettings, parse_args
from llmworker.engine_metrics import (
    Engine,
    EngineSnapshot,
    MetricsParseError,
    RankStats,
    parse_engine_metrics,
    ttft_delta,
)
from llmworker.llamacpp import SLOTS_PATH, missing_flag, parse_llamacpp
from llmworker.netaddr import advertised_endpoint, join_host_port, join_url
from llmworker.proxy import EngineProxy, PrefillLedger
from llmworker.vllm_kv_events import KvEventSubscriber

log = logging.getLogger("llmworker.agent")

DEFAULT_BLOCK_SIZE = 16
MAX_METRICS_BYTES = 32 * 1024 * 1024


# ---------------------------------------------------------------------------
# snapshot -> event fields (no I/O)


@dataclass(frozen=True, slots=True)
class RankLoad:
    """The ``load`` fields of one rank; None = not reported."""

    active_decode_blocks: int | None
    active_prefill_tokens: int | None
    kv_total_blocks: int | None = None


@dataclass(frozen=True, slots=True)
class RankQueue:
    """The engine's queue and sequence slots on one rank, as the ``load`` fields of the same
    names carry them; None = not reported."""

    num_requests_waiting: int | None = None
    request_active_slots: int | None = None
    request_total_slots: int | None = None


@dataclass(frozen=True, slots=True)
class WorkerView:
    """What one scrape says about the worker: config fields, per-rank loads and queues."""

    block_size: int
    kv_total_blocks: int | None
    max_num_batched_tokens: int | None
    dp_size: int
    loads: dict[int, RankLoad]
    ranks_seen: int
    queues: dict[int, RankQueue] = field(default_factory=dict)


def _total_blocks(
    stats: RankStats, engine: Engine, block_size: int, fallback: int | None
) -> int | None:
    if engine == "vllm":
        return stats.kv_total_blocks or fallback
    if stats.kv_total_tokens:
        return stats.kv_total_tokens // block_size
    return fallback


def usable_blocks(engine: Engine, total: int) -> int:
    """The blocks that can hold tokens: vLLM keeps one of its ``num_gpu_blocks`` aside (its
    null block) and its ``kv_cache_usage_perc`` is a fraction of the others."""
    return max(total - 1, 0) if engine == "vllm" else total


def _decode_blocks(
    stats: RankStats, engine: Engine, block_size: int, total: int | None
) -> int | None:
    if stats.kv_used_tokens is not None:
        return -(-stats.kv_used_tokens // block_size)
    if stats.kv_usage is not None and total:
        return round(stats.kv_usage * usable_blocks(engine, total))
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
    """Config fields, per-rank loads and queues from one snapshot (docs/worker.md).

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
    queues: dict[int, RankQueue] = {}
    for dp_rank, (stats, total) in enumerate(zip(ranks, totals, strict=True)):
        prefill = _prefill_estimate(stats)
        if proxied_prefill is not None:
            own = proxied_prefill[dp_rank] if dp_rank < len(proxied_prefill) else 0
            prefill = max(own, prefill or 0)
        loads[dp_rank] = RankLoad(
            active_decode_blocks=_decode_blocks(stats, snapshot.engine, block_size, total),
            active_prefill_tokens=prefill,
            kv_total_blocks=total if total != config_total else None,
        )
        queues[dp_rank] = RankQueue(
            num_requests_waiting=stats.requests_waiting,
            request_active_slots=stats.slots_active,
            request_total_slots=stats.slots_total or settings.max_num_seqs,
        )
    return WorkerView(
        block_size=block_size,
        kv_total_blocks=config_total,
        max_num_batched_tokens=snapshot.max_num_batched_tokens or settings.max_num_batched_tokens,
        dp_size=max(settings.dp_size or len(ranks) or 1, len(ranks)),
        loads=loads,
        ranks_seen=len(ranks),
        queues=queues,
    )


def with_stored_blocks(view: WorkerView, engine: Engine, stored: dict[int, int]) -> WorkerView:
    """``view`` with the blocks vLLM stored since the scrape (its KV events) added to each
    rank's blocks in use, at most the blocks that can hold tokens (docs/worker.md)."""
    loads = dict(view.loads)
    for rank, added in stored.items():
        load = loads.get(rank)
        if load is None or load.active_decode_blocks is None or added <= 0:
            continue
        total = load.kv_total_blocks or view.kv_total_blocks
        blocks = load.active_decode_blocks + added
        if total:
            blocks = min(blocks, usable_blocks(engine, total))
        loads[rank] = replace(load, active_decode_blocks=max(blocks, load.active_decode_blocks))
    return replace(view, loads=loads)


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
        self.misconfigured = False  # the engine lacks a page the agent needs (exit 2)
        self._state: str | None = None  # "ok" or the kind of the current failure
        self._down_since: float | None = None
        self._warned: set[str] = set()
        self._session: aiohttp.ClientSession | None = None
        self._task: asyncio.Task[None] | None = None
        # vLLM's KV events: blocks stored per rank at the start of the last good scrape.
        self.kv_events: KvEventSubscriber | None = None
        self._kv_anchor: dict[int, int] = {}
        self._kv_busy_since: float | None = None  # a scrape first showed blocks held

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
        if s.kv_events_bind is not None:
            self.kv_events = KvEventSubscriber(
                s.kv_events_endpoints, s.kv_events_topic, on_stored=self._kv_stored
            )
            self.registry.register(self.kv_events.collector())
            self.kv_events.start()  # OSError naming the flag if it cannot bind
            log.info(
                "listening for vLLM's KV events (topic %r) on %s",
                s.kv_events_topic,
                ", ".join(s.kv_events_endpoints),
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
        if self.kv_events is not None:
            await self.kv_events.stop()

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
        marks = self._kv_marks()
        try:
            snapshot = await self._read_engine()
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
        self._kv_anchor = marks
        await self._publish(snapshot)

    async def _read_engine(self) -> EngineSnapshot:
        s = self.settings
        if s.engine != "llamacpp":
            return parse_engine_metrics(s.engine, await self._fetch(s.metrics_url))
        metrics = await self._fetch(s.metrics_url)
        return parse_llamacpp(metrics, await self._fetch(join_url(s.engine_url, SLOTS_PATH)))

    async def _fetch(self, url: URL) -> str:
        assert self._session is not None
        try:
            async with self._session.get(url) as response:
                if response.status == 501 and self.settings.engine == "llamacpp":
                    self._not_supported(url, await response.text())
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

    def _not_supported(self, url: URL, body: str) -> None:
        """llama-server answers 501 for a page it was started without: nothing to wait for."""
        log.error(
            "GET %s answered HTTP 501 (%s): start llama-server with %s",
            url,
            body.strip()[:200],
            missing_flag(body, url.path),
        )
        self.misconfigured = True
        self.failed.set()
        raise ScrapeFailed("unsupported", f"GET {url} answered HTTP 501")

    async def _scrape_failed(self, failure: ScrapeFailed) -> None:
        self.failed_scrapes += 1
        if failure.kind == "unsupported":
            return  # logged by _not_supported; the agent is stopping
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
        view = worker_view(snapshot, self.settings, proxied)
        if self.kv_events is None:
            return view
        return with_stored_blocks(view, snapshot.engine, self.kv_events_since_scrape())

    # vLLM's KV events -----------------------------------------------------------

    def _kv_marks(self) -> dict[int, int]:
        """Blocks stored so far per rank (taken when a scrape starts)."""
        if self.kv_events is None:
            return {}
        return {r: kv.stored_total for r, kv in self.kv_events.state.ranks.items()}

    def kv_events_since_scrape(self) -> dict[int, int]:
        """Blocks vLLM stored per rank since the last good scrape started."""
        if self.kv_events is None:
            return {}
        return {
            r: kv.stored_total - self._kv_anchor.get(r, 0)
            for r, kv in self.kv_events.state.ranks.items()
        }

    def _kv_stored(self, dp_rank: int) -> None:
        """vLLM stored blocks: publish the loads now (the publisher debounces)."""
        self._publish_loads()

    def _check_kv_events(self, base: WorkerView) -> None:
        """Warn once when vLLM holds blocks for ``--kv-events-timeout`` seconds and no KV
        event arrived (an idle vLLM sends none; two blocks held mean one was full, which
        vLLM announces)."""
        s = self.settings
        if self.kv_events is None or self.kv_events.state.stats.messages:
            return
        if not any((load.active_decode_blocks or 0) >= 2 for load in base.loads.values()):
            return
        now = asyncio.get_running_loop().time()
        if self._kv_busy_since is None:
            self._kv_busy_since = now
        elif now - self._kv_busy_since >= s.kv_events_timeout:
            self._warn_once(
                "--kv-events-config",
                f"no KV event from vLLM on {', '.join(s.kv_events_endpoints)} although it "
                f"has held blocks for {s.kv_events_timeout:g} s: start vLLM with "
                '--kv-events-config \'{"enable_kv_cache_events": true, "publisher": '
                f'"zmq", "endpoint": "{s.kv_events_bind}", "topic": '
                f'"{s.kv_events_topic}"}}\' (a host the agent binds, not *); '
                "the agent goes on with the scrape alone",
            )

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
        self._warn_about_missing(snapshot, view)
        if self.kv_events is not None:
            self._check_kv_events(worker_view(snapshot, self.settings))
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
                queue = view.queues.get(rank, RankQueue())
                publisher.update_load(
                    rank,
                    active_decode_blocks=load.active_decode_blocks,
                    active_prefill_tokens=load.active_prefill_tokens,
                    kv_total_blocks=load.kv_total_blocks,
                    num_requests_waiting=queue.num_requests_waiting,
                    request_active_slots=queue.request_active_slots,
                    request_total_slots=queue.request_total_slots,
                )

    def _warn_about_overrides(self, snapshot: EngineSnapshot, view: WorkerView) -> None:
        s = self.settings
        first = snapshot.ranks[0] if snapshot.ranks else None
        checks = [
            ("--block-size", s.block_size, first.block_size if first else None),
            ("--max-num-batched-tokens", s.max_num_batched_tokens, snapshot.max_num_batched_tokens),
            ("--max-num-seqs", s.max_num_seqs, first.slots_total if first else None),
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

    def _warn_about_missing(self, snapshot: EngineSnapshot, view: WorkerView) -> None:
        """A vLLM that does not print what the agent needs: say which flag supplies it."""
        s = self.settings
        if snapshot.engine != "vllm" or not snapshot.ranks:
            return
        first = snapshot.ranks[0]
        if first.block_size is None and s.block_size is None:
            self._warn_once(
                "missing --block-size",
                "vLLM's /metrics has no vllm:cache_config_info{block_size}: announcing "
                f"block_size {view.block_size}; give --block-size with vLLM's block size "
                "(128 on CPU, 16 on GPU unless vLLM's --block-size says otherwise)",
            )
        if view.kv_total_blocks is None:
            self._warn_once(
                "missing --kv-total-blocks",
                "vLLM's /metrics has no vllm:cache_config_info{num_gpu_blocks}: "
                "active_decode_blocks is not reported; give --kv-total-blocks with the "
                "number of GPU blocks vLLM logs at start",
            )
        if first.slots_total is None and s.max_num_seqs is None:
            self._warn_once(
                "missing --max-num-seqs",
                "vLLM's /metrics does not say its max_num_seqs: request_total_slots is not "
                "reported; give --max-num-seqs with the value vLLM was started with",
            )
        if self.kv_events is not None:
            sizes = {kv.block_size for kv in self.kv_events.state.ranks.values() if kv.block_size}
            if sizes and sizes != {view.block_size}:
                self._warn_once(
                    "kv-events block size",
                    f"vLLM's KV events have block_size {sorted(sizes)} but block_size "
                    f"{view.block_size} is announced",
                )

    def _warn_once(self, key: str, message: str) -> None:
        if key not in self._warned:
            self._warned.add(key)
            log.warning("%s", message)


async def serve(settings: AgentSettings) -> int:
    """Run until SIGTERM/SIGINT, then say ``bye`` and stop; the exit code."""
    agent = Agent(settings)
    code = await cli.serve_until_signal(
        agent, log, f"agent {settings.worker_id}", failed=agent.failed
    )
    return 2 if agent.misconfigured else code


def main(argv: Sequence[str] | None = None) -> None:
    settings, warning = parse_args(argv)
    cli.run(serve(settings), settings.log_level, warning, log)


if __name__ == "__main__":
    main()
