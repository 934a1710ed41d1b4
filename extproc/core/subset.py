"""The candidates of a gateway's endpoint subset: which worker stands behind each address.

A Kubernetes gateway (Endpoint Picker protocol) may name the endpoints a request may go
to, as the pods' ``ip:port``. Each address in the subset is matched to what the workers
announced, in this order:

1. a worker of the request's model at that address: the one that announced it, else one
   that announced a host name which resolved to it (the match a served host gets,
   :meth:`~extproc.core.pool.WorkerPool.worker_at`);
2. else the one worker of the model on the same host with another port, its host as
   announced or as resolved (the pod's IP with the engine's port, while the gateway
   targets a proxy or sidecar port): its load counts for the address, and the request goes
   to the gateway's address;
3. else, when no worker of another model announced the address (or resolved to it), a
   worker known only from the gateway: no load events, so free, with the router's own
   estimate for what it sends there (the rule for a worker that sent ``config`` but no
   ``load``).

An address announced only by workers of other models is not a candidate (that engine does
not serve the model); a worker whose address is not in the subset is never picked.

A worker known only from the gateway is made once, by the first decision whose subset
names its address for its model, with the limits of a worker that announced no capacity
(only the prefill-token threshold can fire). The pool lists it among its ``unlisted``
workers: in no index, but their limits follow threshold and share changes when those are
made, like every worker's. A decision only reads them. Plain values, no I/O.
"""

from __future__ import annotations

from collections.abc import Sequence

from extproc.core.busy import class_limits
from extproc.core.pool import WorkerPool
from extproc.core.worker import Rank, Worker

# Workers known only from the gateway, kept for their router estimates; past this many,
# the ones with nothing in flight are forgotten.
MAX_GATEWAY_WORKERS = 1024
GATEWAY_ID_PREFIX = "gateway:"


def host_of(endpoint: str) -> str:
    """``host`` of ``host:port`` (an IPv6 host keeps its brackets)."""
    return endpoint.rpartition(":")[0]


class GatewayWorkers:
    """Matches a subset's addresses to workers; makes the workers known only from it."""

    def __init__(self, pool: WorkerPool) -> None:
        self.pool = pool
        # (address, model) -> worker; the pool's table, which keeps their limits current.
        self._known = pool.unlisted

    def __len__(self) -> int:
        return len(self._known)

    def get(self, address: str, model: str) -> Worker:
        """The worker known only from the gateway for ``address`` serving ``model``, made
        on first use."""
        key = (address, model)
        worker = self._known.get(key)
        if worker is None:
            if len(self._known) >= MAX_GATEWAY_WORKERS:
                self._forget_idle()
            worker = self._known[key] = self._make(address, model)
        return worker

    def _make(self, address: str, model: str) -> Worker:
        """A worker with no capacity announced: free for every class (no data), its limits
        built from the model's thresholds and the classes' shares as the pool builds them."""
        pool = self.pool
        worker = Worker(GATEWAY_ID_PREFIX + address, pool.clock())
        worker.endpoint = address
        worker.model = model
        limits = class_limits(
            pool.thresholds_for(model),
            pool.shares,
            kv_mode=pool.kv_mode,
            kv_total_blocks=None,
            max_num_batched_tokens=None,
        )
        rank = worker.ranks[0]
        rank.limits, rank.class_limits = limits[0], limits[1:]
        rank.class_reasons = [None] * len(rank.class_limits)
        if len(limits) > 1:
            worker.busy_by_class = [False] * len(limits)
        return worker

    def _forget_idle(self) -> None:
        idle = [k for k, w in self._known.items() if not _inflight(w.ranks)]
        for key in idle:
            del self._known[key]

    def members(self, model: str, subset: Sequence[str]) -> dict[Worker, str]:
        """The candidates among ``subset`` for a request of ``model``: each worker and the
        address the request goes to, in the subset's order (module docstring)."""
        by_endpoint = self.pool.by_endpoint
        out: dict[Worker, str] = {}
        missing: list[str] = []
        for address in subset:
            worker = by_endpoint.get((address, model))
            if worker is None:
                missing.append(address)
            elif worker not in out:
                out[worker] = address
        if missing:
            self._add_unmatched(model, missing, out)
        return out

    def _add_unmatched(self, model: str, missing: list[str], out: dict[Worker, str]) -> None:
        pool = self.pool
        # What WorkerPool.worker_at matches past the announced endpoint: the addresses a
        # host name resolved to, the first worker of the model in the table's order.
        resolved_at: dict[str, Worker] = {}
        on_host: dict[str, list[Worker]] = {}
        for w in pool.by_model.get(model, ()):
            on_host.setdefault(host_of(w.endpoint), []).append(w)
            for resolved_to in w.addresses:
                resolved_at.setdefault(resolved_to, w)
                workers = on_host.setdefault(host_of(resolved_to), [])
                if w not in workers:
                    workers.append(w)
        resolved = pool.resolved
        other_models: set[str] = set()
        for endpoint, m in pool.by_endpoint:
            if m != model:
                other_models.add(endpoint)
                other_models.update(resolved.get(endpoint, ()))
        for address in missing:
            worker = resolved_at.get(address)
            if worker is not None:
                if worker not in out:
                    out[worker] = address
                continue
            same_host = on_host.get(host_of(address), ())
            if len(same_host) == 1 and same_host[0] not in out:
                out[same_host[0]] = address
            elif address not in other_models:
                out[self.get(address, model)] = address


def _inflight(ranks: list[Rank]) -> bool:
    return any(r.inflight for r in ranks)
