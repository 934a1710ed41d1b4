"""Scrape-time series for dashboards and alerts, beside the required ones (left as they are).

- ``extproc_worker_busy_limit{worker_id,dp_rank,worker_type,check}``: a rank's busy limit
  per check, in the unit of the load it is compared with (decode blocks for
  ``active_decode_blocks_threshold``, prefill tokens for the two prefill checks); absent
  while that check cannot fire on the rank. The rank is busy when its effective load
  (``dynamo_frontend_worker_active_*``) is above it.
- ``extproc_model_workers{model,state}``: routable workers of each model by state
  (``free``, ``busy``, ``overloaded``; all three, zeros included, for every model).
- ``extproc_worker_load_age_seconds{worker_id,model}``: seconds since the worker's last
  load event; ``+Inf`` for a worker that has sent none.
"""

from __future__ import annotations

import math
from collections.abc import Iterator

from prometheus_client.core import GaugeMetricFamily
from prometheus_client.registry import Collector

from extproc.core.busy import DECODE, PREFILL, PREFILL_FRAC
from extproc.core.pool import WorkerPool

STATES = ("free", "busy", "overloaded")


class StatusCollector(Collector):
    def __init__(self, pool: WorkerPool) -> None:
        self.pool = pool

    def describe(self) -> list[GaugeMetricFamily]:
        return []

    def collect(self) -> Iterator[GaugeMetricFamily]:
        pool = self.pool
        now = pool.clock()
        limits = GaugeMetricFamily(
            "extproc_worker_busy_limit",
            "A rank's busy limit per check, in blocks or tokens; the rank is busy above it.",
            labels=["worker_id", "dp_rank", "worker_type", "check"],
        )
        ages = GaugeMetricFamily(
            "extproc_worker_load_age_seconds",
            "Seconds since the worker's last load event (+Inf: none yet).",
            labels=["worker_id", "model"],
        )
        for worker in pool.workers.values():
            for rank in worker.ranks:
                lv = [worker.worker_id, str(rank.index), worker.worker_type]
                lim = rank.limits
                for check, value in (
                    (DECODE, lim.decode_blocks),
                    (PREFILL, lim.prefill_tokens),
                    (PREFILL_FRAC, lim.prefill_tokens_frac),
                ):
                    if value is not None:
                        limits.add_metric([*lv, check], value)
            if worker.configured:
                at = worker.last_load_at
                ages.add_metric(
                    [worker.worker_id, worker.model], math.inf if at is None else now - at
                )
        yield limits
        yield ages
        by_state = GaugeMetricFamily(
            "extproc_model_workers",
            "Routable workers of each model by state.",
            labels=["model", "state"],
        )
        for model, workers in pool.by_model.items():
            counts = dict.fromkeys(STATES, 0)
            for w in workers:
                counts[w.state(now)] += 1
            for state, n in counts.items():
                by_state.add_metric([model, state], n)
        yield by_state
