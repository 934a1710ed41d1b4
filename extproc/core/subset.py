"""The candidates of a gateway's endpoint subset: which worker stands behind each address.

A Kubernetes gateway (Endpoint Picker protocol) may name the endpoints a request may go
to, as the pods' ``ip:port``. Each address in the subset is matched to what the workers
announced, in this order:

1. a worker of the request's model that announced exactly that address;
2. else the one worker of the model announcing the same host on another port (the pod's
   IP with the engine's port, while the gateway targets a proxy or sidecar port): its load
   counts for the address, and the request goes to the gateway's address;
3. else, when no worker announced the address for another model, a worker known only
   from the gateway: no load events, so free, with the router's own estimate for what it
   sends there (the rule for a worker that sent ``config`` but no ``load``).

An address announced only by workers of other models is not a candidate (that engine does
not serve the model); a worker whose address is not in the subset is never picked. Plain
values, no I/O.
"""

from __future__ import annotations

from collections.abc import Sequence

from extproc.core.busy import BusyThresholds, Share
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
    """Workers known from the gateway's subset only, by (address, model)."""

    def __init__(self, pool: WorkerPool) -> None:
        self.pool = pool
        # (address, model) -> (worker, the thresholds and shares its limits were built from)
        self._known: dict[tuple[str, str], tuple[Worker, BusyThresholds, list[Share]]] = {}

    def __len__(self) -> int:
        return len(self._known)

    def get(self, address: str, model: str) -> Worker:
        """The worker for ``address`` serving ``model``, made on first use; its busy limits
        follow the model's thresholds (a change through the API applies here too)."""
        pool = self.pool
        key = (address, model)
        thresholds, shares = pool.thresholds_for(model), pool.shares
        entry = self._known.get(key)
        if entry is not None:
            worker, seen_thresholds, seen_shares = entry
            if seen_thresholds is thresholds and seen_shares is shares:
                return worker
        else:
            if len(self._known) >= MAX_GATEWAY_WORKERS:
                self._forget_idle()
            worker = Worker(GATEWAY_ID_PREFIX + address, pool.clock())
            worker.endpoint = address
            worker.model = model
        pool.adopt(worker)
        self._known[key] = (worker, thresholds, shares)
        return worker

    def _forget_idle(self) -> None:
        idle = [k for k, (w, _, _) in self._known.items() if not _inflight(w.ranks)]
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
        on_host: dict[str, list[Worker]] = {}
        for w in pool.by_model.get(model, ()):
            on_host.setdefault(host_of(w.endpoint), []).append(w)
        other_models = {ep for (ep, m) in pool.by_endpoint if m != model}
        for address in missing:
            same_host = on_host.get(host_of(address), ())
            if len(same_host) == 1 and same_host[0] not in out:
                out[same_host[0]] = address
            elif address not in other_models:
                out[self.get(address, model)] = address


def _inflight(ranks: list[Rank]) -> bool:
    return any(r.inflight for r in ranks)
