"""Prometheus series of the service (docs/admin-api.md), names and labels as Dynamo's.

Counters and histograms are updated where things happen. Per-worker gauges
are produced at scrape time from the pool by :class:`PoolCollector`, so a
worker that leaves takes its series with it.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator, Mapping
from typing import TYPE_CHECKING, Any

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, disable_created_metrics
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily
from prometheus_client.registry import Collector

if TYPE_CHECKING:
    from extproc.core.latency import DeadlineAdmission
    from extproc.core.pool import WorkerPool

DECISION_OUTCOMES = (
    "routed",
    "overloaded",
    "no_workers",
    "model_not_found",
    "bad_request",
    "passthrough",
    "queue_timeout",
    "deadline",
)
EVENT_TOPICS = ("config", "load", "bye")
GRPC_CLOSE_REASONS = ("protocol_error", "keepalive_timeout")
# What to change when streamed responses reach the extproc without their bodies while
# --router-track-output-blocks is on (extproc_output_unobserved_responses_total).
UNOBSERVED_OUTPUT_FIX = (
    "use envoy/envoy-track-output.yaml, or stream the response body on the main filter "
    "(response_body_mode: STREAMED)"
)

disable_created_metrics()


class _Children(dict[str, Any]):
    """Label children created on first use, so a labelled series appears with its labels."""

    def __init__(self, metric: Counter) -> None:
        super().__init__()
        self.metric = metric

    def __missing__(self, key: str) -> Any:
        child = self[key] = self.metric.labels(key)
        return child


class Metrics:
    """All series on one registry (one per service instance, so tests stay apart)."""

    def __init__(self) -> None:
        self.registry = CollectorRegistry(auto_describe=True)
        r = self.registry
        self.rejections = Counter(
            "dynamo_frontend_model_rejection",
            "Requests rejected because every worker of the model was busy.",
            ["model", "endpoint"],
            registry=r,
        )
        self.by_class = Counter(
            "extproc_requests_by_class",
            "Inference requests by request class and outcome (routed or overloaded).",
            ["model", "endpoint", "class", "outcome"],
            registry=r,
        )
        self.worker_unreachable = Counter(
            "extproc_worker_unreachable",
            "Routed requests Envoy could not deliver (connection refused or reset before the "
            "response): answered with the overload reply, the worker skipped for 1 s.",
            ["model"],
            registry=r,
        )
        self.served_elsewhere = Counter(
            "extproc_served_elsewhere",
            "Routed responses served by another host than the pick (an Envoy retry moved "
            "them): their estimate moved to that worker (served=worker) or, the host not being "
            "a known worker of the model, was released (served=unknown).",
            ["model", "served"],
            registry=r,
        )
        self.background_errors = Counter(
            "extproc_background_errors",
            "Failures of a background task (sweeper, replica_publisher, curve_refusals, "
            "status_history, h2_keepalive, held_timer): the first one of each task is logged "
            "with its traceback, and the task keeps running.",
            ["task"],
            registry=r,
        )
        self.output_unobserved = Counter(
            "extproc_output_unobserved_responses",
            "Streamed 2xx responses that ended while --router-track-output-blocks is on and "
            "no ext_proc stream received their body: their generated tokens were not counted. "
            f"Fix: {UNOBSERVED_OUTPUT_FIX}.",
            registry=r,
        )
        # time.monotonic() of the last of them, for the admin views' warning.
        self.output_unobserved_at: float | None = None
        self.class_unknown = Counter(
            "extproc_request_class_unknown",
            "Requests that named a class that is not configured (decided as the default).",
            registry=r,
        )
        self.subset_hint_malformed = Counter(
            "extproc_subset_hint_malformed",
            "Requests whose endpoint subset hint was not a list or string of ip:port "
            "(decided as if none were given; --protocol epp).",
            registry=r,
        )
        self.decisions = Counter(
            "extproc_decisions", "Routing decisions by outcome.", ["outcome"], registry=r
        )
        self.decision_seconds = Histogram(
            "extproc_decision_seconds",
            "Time to decide one request (parse body, check busy, pick).",
            buckets=(2e-5, 5e-5, 1e-4, 2e-4, 5e-4, 1e-3, 2.5e-3, 5e-3, 1e-2, 5e-2),
            registry=r,
        )
        self.events = Counter(
            "extproc_events", "Well-formed worker events received, by topic.", ["topic"], registry=r
        )
        self.events_dropped = Counter(
            "extproc_events_dropped", "Worker events dropped, by reason.", ["reason"], registry=r
        )
        self.events_refused = Counter(
            "extproc_events_refused",
            "Publishers refused on the event socket (CURVE on), by reason: unknown_key "
            "(not in the publishers directory) or handshake_failed (no or wrong server key).",
            ["reason"],
            registry=r,
        )
        self.replica_sent = Counter(
            "extproc_replica_messages_sent",
            "Messages this replica sent to the other replicas, by topic (estimate, "
            "thresholds, replica_bye).",
            ["topic"],
            registry=r,
        )
        self.events_lost = Counter(
            "extproc_events_lost", "Load events lost (gaps in per-worker seq).", registry=r
        )
        self.event_seconds = Counter(
            "extproc_event_seconds",
            "Time the event loop spent reading and applying worker events. Its rate is the "
            "share of the loop they take; near 1 with the requests' share, events queue up.",
            registry=r,
        )
        self.queue_wait = Histogram(
            "extproc_router_queue_wait_seconds",
            "Time requests waited in the router queue.",
            buckets=(0.001, 0.005, 0.01, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10),
            registry=r,
        )
        # Deadline admission (models and request classes with a TTFT target).
        self.predicted_ttft = Histogram(
            "extproc_predicted_ttft_seconds",
            "Smallest predicted time to first token over the candidate workers, per request "
            "decided against a TTFT target (wait for a slot + prefill + gateway delay).",
            ["model"],
            buckets=(0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60),
            registry=r,
        )
        self.held_wait = Histogram(
            "extproc_held_wait_seconds",
            "Time requests were held in the router for a slot (deadline admission), whatever "
            "ended it: dispatched, past their deadline, or the client gone.",
            buckets=(0.001, 0.005, 0.01, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30),
            registry=r,
        )
        self.deadline_rejections = Counter(
            "extproc_deadline_rejections",
            "Requests answered with the overload reply because no worker was predicted to "
            "give them a first token within their TTFT target, per model.",
            ["model"],
            registry=r,
        )
        self.ttft_target_met = Counter(
            "extproc_ttft_target_met",
            "Admitted streamed requests with a TTFT target, by whether their first body byte "
            "came within it (measured from their arrival at the router).",
            ["model", "met"],
            registry=r,
        )
        self.streams = Gauge(
            "extproc_streams",
            "Open ext_proc streams: one per HTTP request in Envoy's ext_proc filter "
            "(two with the output observer).",
            registry=r,
        )
        self.buffered_body_bytes = Gauge(
            "extproc_buffered_body_bytes",
            "Bytes of FULL_DUPLEX_STREAMED request bodies held while they are gathered before "
            "the decision, all streams (at most --request-body-budget-mib).",
            registry=r,
        )
        self.body_rejections = Counter(
            "extproc_request_body_rejections",
            "Full-duplex request bodies refused before the decision, by reason: budget (the "
            "overload reply: the bodies being gathered hold the budget) or too_large (400).",
            ["reason"],
            registry=r,
        )
        self.body_rejected = _Children(self.body_rejections)
        for reason in ("budget", "too_large"):
            self.body_rejected[reason]
        self.outcome = _Children(self.decisions)
        self.topic = _Children(self.events)
        self.dropped = _Children(self.events_dropped)
        self.refused = _Children(self.events_refused)
        self.replica_topic = _Children(self.replica_sent)

    def attach(
        self, pool: WorkerPool, queue_depth: Callable[[], dict[str, int]] | None = None
    ) -> None:
        self.registry.register(PoolCollector(pool, queue_depth or dict))

    def watch_admission(self, admission: DeadlineAdmission) -> None:
        """Series of deadline admission read at scrape time: the held requests."""
        self.registry.register(HeldCollector(admission))

    def watch_grpc(
        self, connections: Callable[[], int], closed: Callable[[], Mapping[str, int]]
    ) -> None:
        """Series of the builtin ext_proc server: open connections, connections it closed."""
        self.registry.register(GrpcCollector(connections, closed))


class HeldCollector(Collector):
    """``extproc_held_requests{model}``: requests held in the router for a slot now, per
    model that has held any since the start (0 when none is held)."""

    def __init__(self, admission: DeadlineAdmission) -> None:
        self.admission = admission

    def describe(self) -> list[GaugeMetricFamily]:
        return []

    def collect(self) -> Iterator[GaugeMetricFamily]:
        held = GaugeMetricFamily(
            "extproc_held_requests",
            "Requests held in the router for a slot (deadline admission), per model.",
            labels=["model"],
        )
        queues = self.admission.held
        for model in sorted(self.admission.held_models):
            q = queues.get(model)
            held.add_metric([model], len(q) if q else 0)
        yield held
        target = GaugeMetricFamily(
            "extproc_ttft_target_seconds",
            "The TTFT target of each model that has one (requests without a class).",
            labels=["model"],
        )
        for entry in self.admission.models():
            target.add_metric([entry.model], entry.target_s)
        yield target


class GrpcCollector(Collector):
    """Scrape-time series of the builtin ext_proc server."""

    def __init__(
        self, connections: Callable[[], int], closed: Callable[[], Mapping[str, int]]
    ) -> None:
        self.connections = connections
        self.closed = closed

    def describe(self) -> list[GaugeMetricFamily]:
        return []

    def collect(self) -> Iterator[GaugeMetricFamily | CounterMetricFamily]:
        yield GaugeMetricFamily(
            "extproc_grpc_connections",
            "Open ext_proc (HTTP/2) connections from Envoy.",
            value=self.connections(),
        )
        closed = CounterMetricFamily(
            "extproc_grpc_connections_closed",
            "ext_proc connections the extproc closed on an error, by reason.",
            labels=["reason"],
        )
        counts = self.closed()
        for reason in GRPC_CLOSE_REASONS:
            closed.add_metric([reason], counts.get(reason, 0))
        yield closed


class PoolCollector(Collector):
    """Scrape-time gauges read from the pool."""

    def __init__(self, pool: WorkerPool, queue_depth: Callable[[], dict[str, int]]) -> None:
        self.pool = pool
        self.queue_depth = queue_depth

    def describe(self) -> list[GaugeMetricFamily]:
        return []

    def collect(self) -> Iterator[GaugeMetricFamily]:
        labels = ["worker_id", "dp_rank", "worker_type"]
        blocks = GaugeMetricFamily(
            "dynamo_frontend_worker_active_decode_blocks",
            "Effective active KV blocks per worker rank (max of reported and router estimate).",
            labels=labels,
        )
        prefill = GaugeMetricFamily(
            "dynamo_frontend_worker_active_prefill_tokens",
            "Effective active prefill tokens per worker rank.",
            labels=labels,
        )
        for worker, rank in self.pool.inflight():
            lv = [worker.worker_id, str(rank.index), worker.worker_type]
            b, p = rank.decode_blocks, rank.prefill_tokens
            if b is not None:
                blocks.add_metric(lv, b)
            if p is not None:
                prefill.add_metric(lv, p)
        yield blocks
        yield prefill
        states = GaugeMetricFamily(
            "extproc_workers", "Routable workers by state.", labels=["state"]
        )
        for state, n in self.pool.counts().items():
            states.add_metric([state], n)
        yield states
        depth = GaugeMetricFamily(
            "extproc_router_queue_depth", "Requests waiting in the router queue.", labels=["model"]
        )
        for model, n in self.queue_depth().items():
            depth.add_metric([model], n)
        yield depth
