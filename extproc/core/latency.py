"""Holding a TTFT target: deadline admission for the models and request classes with one.

A request of a model with ``ttft_p99_target_ms`` set (or of a request class with its own
target, which then is its deadline) is admitted only if a worker is predicted to give it a
first token within the target (docs/latency-target.md):

    predicted TTFT = wait for a slot + prefill of its prompt + the gateway's own delay

each measured per worker by a :class:`~extproc.core.deadline.WorkerEstimate` from what the
router and the engine already see: the router's dispatch, first body byte and stream end
of every request, and the engine's queue fields in its load reports (requests waiting,
running, slots). Among the candidates (the workers the configured thresholds leave free:
thresholds are ceilings), the one with the smallest predicted TTFT gets it now if that
fits (of the predictions within its spread of it, the least loaded worker's); when no
worker can start it now but the wait fits it is held in the router (a
:class:`~extproc.core.held.HeldQueue` per model, earliest deadline first) until a slot
frees; else it is rejected at once with a Retry-After from the predicted wait
(:func:`~extproc.core.deadline.decide`).

:class:`DeadlineAdmission` keeps the estimates (one per worker, fed for every routed
request, target or not, so that a target set later starts from measurements), the held
queues, and the share of admitted requests that met their target, per model. Plain values,
times passed in or read from the pool's clock, no I/O: the request path
(``handlers/held.py``, ``handlers/inflight.py``) owns the waiting.
"""

from __future__ import annotations

import bisect
import math
from collections.abc import Hashable, Iterator, Sequence
from dataclasses import dataclass, replace

from extproc.core.classes import ClassRegistry
from extproc.core.deadline import (
    PREFILL_MARGIN,
    Decision,
    Dispatch,
    Prediction,
    Reject,
    WorkerEstimate,
    decide,
    predict_all,
    still_fits,
)
from extproc.core.held import HeldQueue
from extproc.core.pool import WorkerPool
from extproc.core.worker import Worker

# What /debug/workers says of a worker that reports no slots and no waiting count.
GATEWAY_ONLY = "predicted from the gateway's timings alone"
# A worker with a slot free that a request is rejected from anyway (its measured idle TTFT,
# with its spread, is above the target) still gets one request this often, so that the
# measurement follows the worker: a cold start or a stall is not held against it for ever.
PROBE_UNREACHABLE_SECONDS = 0.25
# A retry (a client's attempt after an overload reply, as the OpenAI SDKs number theirs in
# ``x-stainless-retry-count``) yields (is answered at once) while the deadline has refused,
# this recently, a first attempt of its model of its class's priority or a better one: its
# user has already waited past the first answer and the backoff, so a slot it would take is
# one on which such a first attempt could still meet its target. Lesser classes are not made
# to yield to better ones this way: tried on the simulated workers at the capacity at target
# (20 % critical, 50 % standard, 30 % sheddable), it lost SLO goodput against the flat run
# and critical requests were still refused.
YIELD_SECONDS = 1.0
# A retry's deadline is its user's. The router remembers, per model, when the retry of each
# request it answered with the deadline reply is due (the reply's time plus the
# ``retry-after-ms`` it named: the OpenAI SDKs come back after exactly that) and when that
# request's user first asked. A retry that arrives at most this long after such a due time
# is taken as that user's (the latest due first, each once), and its deadline counts from
# the user's first attempt: a retry that can no longer give its user a first token within
# the target is refused, and the slot goes to a request that still can. A retry that matches
# no refusal (it came after a worker's error, or after a wait of its own) counts from its
# own arrival.
RETRY_MATCH_SECONDS = 0.25
RETRY_EARLY_SECONDS = 0.01  # the clocks of the reply and of the retry's arrival may differ
RETRY_MEMORY = 4096  # due retries remembered per model; beyond it the earliest are forgotten


@dataclass(slots=True)
class TargetMet:
    """Admitted requests of one model with a target, by whether their first body byte came
    within it (measured from the request's arrival at the router)."""

    met: int = 0
    missed: int = 0

    @property
    def share(self) -> float | None:
        total = self.met + self.missed
        return None if not total else self.met / total


@dataclass(frozen=True, slots=True)
class ModelLatency:
    """One model with a target as the metrics and the status page show it."""

    model: str
    target_s: float
    held: int
    met: TargetMet


class DeadlineAdmission:
    """Per-worker estimates, per-model held queues and the targets of models and classes."""

    def __init__(self, pool: WorkerPool, classes: ClassRegistry | None = None) -> None:
        self.pool = pool
        self.classes = classes
        self.estimates: dict[str, WorkerEstimate] = {}
        self.held: dict[str, HeldQueue] = {}
        # Every model that has held a request since the start (its series stay, at 0).
        self.held_models: set[str] = set()
        self.met: dict[str, TargetMet] = {}
        # When each worker last got a request its target was unreachable for (a probe).
        self.probed_at: dict[str, float] = {}
        # When the deadline last refused a first attempt of each model, per class priority
        # (0 without classes).
        self.refused_at: dict[str, dict[int, float]] = {}
        # Per model, the retries the deadline replies asked for: (due, the user's first
        # attempt), by due time.
        self.due: dict[str, list[tuple[float, float]]] = {}

    # ----- targets -------------------------------------------------------------------

    def target_s(self, model: str, class_name: str = "") -> float | None:
        """The TTFT target of a request (seconds): its class's when the class has one (a
        class's target is its deadline), else its model's; None: no target."""
        classes = self.classes
        if class_name and classes is not None and classes.table.enabled:
            try:
                cls = classes.table.by_name(class_name)
            except KeyError:
                cls = None
            if cls is not None and cls.ttft_p99_target_ms is not None:
                return cls.ttft_p99_target_ms / 1000
        ms = self.pool.thresholds_for(model).ttft_p99_target_ms
        return None if ms is None else ms / 1000

    # ----- measurements ----------------------------------------------------------------

    def estimate(self, worker_id: str) -> WorkerEstimate:
        est = self.estimates.get(worker_id)
        if est is None:
            est = self.estimates[worker_id] = WorkerEstimate(worker_id)
        return est

    def load(self, worker: Worker) -> None:
        """A load report of ``worker`` was applied: its ranks' queue fields, summed over
        the ranks that report each (a field no rank reports stays unreported)."""
        ranks = worker.ranks
        if len(ranks) == 1:
            r = ranks[0]
            waiting, active, total = (
                r.reported_waiting,
                r.reported_active_slots,
                r.reported_total_slots,
            )
            blocks, kv_total = r.reported_blocks, worker.kv_total(r)
        else:
            waiting = _sum(r.reported_waiting for r in ranks)
            active = _sum(r.reported_active_slots for r in ranks)
            total = _sum(r.reported_total_slots for r in ranks)
            blocks = _sum(r.reported_blocks for r in ranks)
            kv_total = _sum(worker.kv_total(r) for r in ranks)
        self.estimate(worker.worker_id).load(waiting, active, total, blocks, kv_total)

    def engine_ttft(self, worker: Worker, buckets: list[tuple[float, int]]) -> None:
        """The engine's own TTFT buckets of one load report (kept for diagnostics)."""
        self.estimate(worker.worker_id).engine_ttft(buckets)

    def dispatched(
        self,
        key: Hashable,
        worker: Worker,
        prompt_tokens: int,
        now: float,
        arrived: float | None = None,
        held: float = 0.0,
    ) -> None:
        """Request ``key`` was sent to ``worker`` at ``now``."""
        est = self.estimate(worker.worker_id)
        if key not in est.flights:
            est.dispatched(key, prompt_tokens, now, arrived, held)

    def first_byte(self, key: Hashable, worker: Worker, now: float) -> None:
        est = self.estimates.get(worker.worker_id)
        if est is not None:
            est.first_byte(key, now)

    def tokens(self, key: Hashable, worker: Worker, now: float, count: int) -> None:
        """``count`` more generated tokens of ``key``'s stream reached the router."""
        est = self.estimates.get(worker.worker_id)
        if est is not None:
            est.tokens(key, now, count)

    def ended(
        self,
        key: Hashable,
        worker: Worker,
        now: float,
        output_tokens: int | None = None,
        completed: bool = False,
    ) -> None:
        """Request ``key`` ended; ``completed``: its 2xx response finished normally."""
        est = self.estimates.get(worker.worker_id)
        if est is not None:
            est.ended(key, now, output_tokens, completed)

    def ttft_measured(self, model: str, seconds: float, target_s: float) -> bool:
        """An admitted request's measured TTFT against its target; whether it met it."""
        met = self.met.get(model)
        if met is None:
            met = self.met[model] = TargetMet()
        ok = seconds <= target_s
        if ok:
            met.met += 1
        else:
            met.missed += 1
        return ok

    def prune(self) -> list[str]:
        """Drop the estimates of workers the pool no longer lists; returns their ids."""
        gone = [wid for wid in self.estimates if wid not in self.pool.workers]
        for wid in gone:
            del self.estimates[wid]
            self.probed_at.pop(wid, None)
        return gone

    # ----- the decision ----------------------------------------------------------------

    def predictions(
        self,
        model: str,
        candidates: Sequence[Worker],
        prompt_tokens: int,
        target_s: float,
        arrived: float,
        now: float,
    ) -> list[Prediction]:
        """Every candidate's predicted TTFT for a request of ``model`` that arrived at
        ``arrived``, behind the held requests served before it: those whose deadline (with
        its spread, as they are served by) comes before the one it would have."""
        ests = [self.estimate(w.worker_id) for w in candidates]
        held_ahead = 0
        queue = self.held.get(model)
        if queue:
            idle = min(
                e.idle_ttft(prompt_tokens) + PREFILL_MARGIN * (e.fit.abs_residual.get() or 0.0)
                for e in ests
            )
            held_ahead = queue.ahead_of(arrived + target_s - idle)
        return predict_all(ests, prompt_tokens, held_ahead, now)

    def admit(
        self,
        model: str,
        candidates: Sequence[Worker],
        prompt_tokens: int,
        target_s: float,
        arrived: float,
        now: float,
        retry: bool = False,
        priority: int = 0,
        numbered: bool = False,
    ) -> tuple[Decision, list[Prediction]]:
        """Dispatch, hold or reject one request (``candidates``: not empty, not busy by
        the thresholds); with the predictions it was decided on. ``retry``: the client says
        this is a retry of a refused attempt; ``priority``: its class's (lower goes first).
        While a first attempt of the model of that priority or a better one was refused
        within :data:`YIELD_SECONDS`, a retry is refused too (``yielded``), with the wait
        that decision gave or what is left of that second, whichever is longer. So a first
        attempt refused now, from a client that numbers its attempts (``numbered``), is
        told to wait at least :data:`YIELD_SECONDS`: its retry, sooner, would be refused."""
        preds = self.predictions(model, candidates, prompt_tokens, target_s, arrived, now)
        decision = decide(preds, target_s, now, arrived, lenient=self.best_class(priority))
        refused = self.refused_at.setdefault(model, {})
        before = max(
            (t for q, t in refused.items() if retry and q <= priority),
            default=-math.inf,
        )
        since = now - before
        if since < YIELD_SECONDS:
            wait = None if isinstance(decision, Dispatch) else decision.wait
            return Reject(max(YIELD_SECONDS - since, wait or 0.0), yielded=True), preds
        if not retry and type(decision) is Reject:
            refused[priority] = now
            if numbered and decision.wait is not None and decision.wait < YIELD_SECONDS:
                decision = replace(decision, wait=YIELD_SECONDS)
        return decision, preds

    def told(self, model: str, user_arrived: float, retry_after_ms: int, now: float) -> None:
        """A request of ``model`` whose user first asked at ``user_arrived`` got the deadline
        reply at ``now``, naming ``retry_after_ms``: its retry is due then."""
        due = self.due.setdefault(model, [])
        _forget(due, now)
        bisect.insort(due, (now + retry_after_ms / 1000, user_arrived))
        if len(due) > RETRY_MEMORY:
            del due[0]

    def no_retry_fits(
        self,
        model: str,
        prompt_tokens: int,
        target_s: float,
        start: float,
        retry_after_ms: int,
        now: float,
        priority: int = 0,
    ) -> bool:
        """Whether the retry of a request of ``model`` refused at ``now``, coming back
        after ``retry_after_ms`` (as the OpenAI SDKs do), can no longer be admitted: its
        deadline counts from ``start`` (its user's first attempt), and what will be left of
        ``target_s`` then is below every worker's idle TTFT for its prompt with the spread
        of the prefill fit (the least any later prediction of it can be; without the spread
        for the best class, judged on its mean). False while no worker is measured."""
        lenient = self.best_class(priority)
        floors = []
        for w in self.pool.by_model.get(model, ()):
            est = self.estimates.get(w.worker_id)
            if est is None or not est.fit.count:
                return False  # unmeasured: it may be faster than any other
            spread = 0.0 if lenient else PREFILL_MARGIN * (est.fit.abs_residual.get() or 0.0)
            floors.append(est.idle_ttft(prompt_tokens) + spread)
        left = target_s - (now + retry_after_ms / 1000 - start)
        return bool(floors) and min(floors) > left

    def user_arrival(self, model: str, arrived: float, retry: bool, now: float) -> float:
        """When the deadline of a request that reached the router at ``arrived`` counts
        from: for a retry that arrives when one the deadline reply asked for is due, its
        user's first attempt (:data:`RETRY_MATCH_SECONDS`); else ``arrived``."""
        due = self.due.get(model) if retry else None
        if not due:
            return arrived
        _forget(due, now)
        i = bisect.bisect_right(due, (now + RETRY_EARLY_SECONDS, math.inf)) - 1
        user = due.pop(i)[1] if i >= 0 else arrived
        if not due:
            del self.due[model]
        return min(user, arrived)

    def best_class(self, priority: int) -> bool:
        """Whether ``priority`` is the best of the classes when lesser ones are configured:
        its requests are judged on their mean predicted TTFT, not its 90th percentile (a
        request more likely than not to meet its target is admitted)."""
        classes = self.classes
        if classes is None:
            return False
        priorities = {c.priority for c in classes.table.classes}
        return len(priorities) > 1 and priority == min(priorities)

    def recheck(
        self,
        candidates: Sequence[Worker],
        prompt_tokens: int,
        target_s: float,
        arrived: float,
        now: float,
        ahead: int,
    ) -> Reject | None:
        """A held request decided again behind the ``ahead`` held requests before it
        (:func:`~extproc.core.deadline.still_fits`): None while its mean prediction still
        fits what is left of its target on one of ``candidates``, else its reply now, with
        the smallest predicted wait."""
        ests = [self.estimate(w.worker_id) for w in candidates]
        preds = predict_all(ests, prompt_tokens, ahead, now)
        if still_fits(preds, target_s, now, arrived):
            return None
        waits = [p.wait for p in preds if p.wait is not None]
        return Reject(min(waits) if waits else None)

    def probe(self, decision: Decision, preds: Sequence[Prediction], now: float) -> str | None:
        """The worker a rejected request goes to anyway, to measure it again: when it is
        rejected although a worker has a slot free and no prompt to prefill before it (only
        its measured prefill and gateway delay, with their spread, are above the target: a
        cold start or a stall may be all there is to it), the free worker with the smallest
        idle TTFT that has not had such a request for :data:`PROBE_UNREACHABLE_SECONDS`;
        None: reject. A retry that yields its slot is never one."""
        if not isinstance(decision, Reject) or decision.yielded:
            return None
        idle = [p for p in preds if p.can_start and p.wait == 0 and p.ttft == p.idle]
        for p in sorted(idle, key=lambda p: p.idle):
            if now - self.probed_at.get(p.worker, -math.inf) >= PROBE_UNREACHABLE_SECONDS:
                self.probed_at[p.worker] = now
                return p.worker
        return None

    def queue(self, model: str) -> HeldQueue:
        q = self.held.get(model)
        if q is None:
            q = self.held[model] = HeldQueue()
            self.held_models.add(model)
        return q

    def held_count(self, worker_id: str) -> int:
        """Held requests that may go to ``worker_id``."""
        worker = self.pool.workers.get(worker_id)
        q = self.held.get(worker.model) if worker is not None else None
        return 0 if not q else sum(1 for h in q if h.fits(worker_id))

    # ----- what is shown ---------------------------------------------------------------

    def models(self) -> Iterator[ModelLatency]:
        """Per model with a TTFT target: the target, its held requests, the share met."""
        for model in self.pool.models():
            target = self.target_s(model)
            if target is None:
                continue
            q = self.held.get(model)
            yield ModelLatency(model, target, len(q) if q else 0, self.met.get(model, TargetMet()))

    def unreachable(self, worker: Worker) -> bool:
        """The model's target is below what an idle ``worker`` measures for a typical
        request: it can never be met there."""
        target = self.target_s(worker.model)
        est = self.estimates.get(worker.worker_id)
        if target is None or est is None:
            return False
        typical = round(est.prompt_tokens.get() or 0)
        return est.idle_ttft(typical) > target

    def view(self, worker: Worker) -> dict[str, object]:
        """What /debug/workers shows of ``worker``'s prediction (times in ms)."""
        est = self.estimates.get(worker.worker_id)
        if est is None:
            est = WorkerEstimate(worker.worker_id)  # no request and no report yet
        target = self.target_s(worker.model) if worker.model else None
        out = est.view(self.pool.clock(), target)
        out["held_requests"] = self.held_count(worker.worker_id)
        if est.gateway_only:
            out["from"] = GATEWAY_ONLY
        if target is not None:
            out["ttft_p99_target_ms"] = round(target * 1000, 3)
        out["target_unreachable"] = "target" in out
        return out


def _forget(due: list[tuple[float, float]], now: float) -> None:
    """Drop the due retries no arrival can match any more."""
    del due[: bisect.bisect_left(due, (now - RETRY_MATCH_SECONDS, -math.inf))]


def _sum(values: Iterator[int | None]) -> int | None:
    total = None
    for v in values:
        if v is not None:
            total = v if total is None else total + v
    return total
