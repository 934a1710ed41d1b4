"""Requests held in the router for a slot under deadline admission, until one frees.

A request whose target fits only after a wait for a slot (``core/latency.py``) waits here,
in its model's :class:`~extproc.core.held.HeldQueue`, earliest deadline first. The queue is
pumped (:meth:`HeldRequests.pump`) whenever a slot may have freed: a stream's end (the
pool's capacity listener), a load report, a threshold or target change, and a held
request's deadline or the periodic re-decision (a timer per model). A pump

1. answers the requests past their deadline with the deadline reply;
2. decides the requests whose target was removed by the plain rule (the thresholds);
3. gives every free slot a held request, earliest deadline first: a worker is free for a
   held request when it is in the request's endpoint subset (when a gateway named one), the
   thresholds leave it free for the request's class and it has a slot free (its
   :meth:`~extproc.core.deadline.WorkerEstimate.free_slots`; a worker that never showed a
   limit always has one), and the request fits there now
   (:func:`~extproc.core.deadline.fits_now`): its predicted prefill there now (at the
   worker's pace, after the prefill still ahead of it there: requests sent before it and not
   yet at their first token), the gateway delay and the prefill's spread (not for a request
   admitted on its mean, the best of several classes) still end by its arrival plus its
   target, whether or not it was held for that worker. One that slowed down since, its pace
   risen, no longer takes it: on llama.cpp with a worker paused half of every 100 ms, the
   requests late on it had been held a median 0.6 s and then sent to it by the worker set of
   their hold. Nor does one whose free slot is behind another request's prefill that leaves
   it too little time: judged on its own prefill alone, a held request went to a llama.cpp
   worker still prefilling a request sent just before it, and came late. So no slot sits
   idle while a request that fits waits;
4. decides every request still held again with the prediction of now, behind the held
   requests before it (:meth:`~extproc.core.latency.DeadlineAdmission.recheck`): one whose
   mean predicted TTFT no longer fits what is left of its target on any worker gets the
   deadline reply at once, not at its deadline. Besides stream ends and load reports, a
   timer pumps the queue every :data:`RECHECK_SECONDS` while any request is held (the
   prediction changes as the running requests age).

While a request is held Envoy's message timer is extended (``override_message_timeout``,
as for the router queue), by at most :data:`HOLD_MAX_SECONDS`: the shipped Envoy configs
allow 30 s (``max_message_timeout``), so a request is never held longer. A client that goes
away leaves the queue at once (:meth:`HeldRequests.drop`, from the stream's end).
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import math
from collections.abc import Callable, Hashable
from dataclasses import dataclass, field
from typing import Any

from extproc.background import HELD_TIMER, Guard
from extproc.core.deadline import Hold, Reject, fits_now
from extproc.core.latency import DeadlineAdmission
from extproc.core.pool import WorkerPool
from extproc.core.scheduling import is_free
from extproc.core.worker import Worker
from extproc.metrics.registry import Metrics

log = logging.getLogger("extproc.handlers")

# Envoy's max_message_timeout in the shipped configs is 30 s; a held request's extension
# stays under it with room for the reply.
HOLD_MAX_SECONDS = 28.0
# A timer fires this long after a deadline, so that the deadline has passed (expire takes
# the requests with deadline < now).
TIMER_SLACK = 0.001
# While requests are held they are decided again at least this often (besides every stream
# end and load report), so that one whose prediction stopped fitting (the running requests
# grew old) is answered within this long rather than at its deadline.
RECHECK_SECONDS = 0.1
# A deadline timer whose step raised (counted as a failure of the ``held_timer`` background
# task) fires again this much later, so that the held requests are still answered.
TIMER_RETRY = 0.05


@dataclass(eq=False, slots=True)
class Waiter:
    """One held request: what its later decision needs."""

    key: Hashable
    model: str
    prompt_tokens: int
    variant: int
    class_name: str
    arrived: float
    since: float
    future: asyncio.Future[Any] = field(repr=False)
    only: frozenset[str] | None = None  # the workers it may go to (a gateway's subset)
    lenient: bool = False  # judged on its mean prediction (the best of several classes)

    def may_use(self, worker: Worker) -> bool:
        return self.only is None or worker.worker_id in self.only


# What the processor supplies: send the request to a worker (its routing reply), answer it
# with the deadline reply (the smallest predicted wait, None: unknown), decide it by the
# plain rule (a reply, or the router queue's marker).
RouteFn = Callable[[Hashable, Worker], bytes]
RejectFn = Callable[[Hashable, Reject], bytes]
PlainFn = Callable[[Hashable], Any]


class HeldRequests:
    """The waiting side of the held queues."""

    def __init__(
        self,
        pool: WorkerPool,
        admission: DeadlineAdmission,
        metrics: Metrics,
        route: RouteFn,
        reject: RejectFn,
        plain: PlainFn,
    ) -> None:
        self.pool = pool
        self.admission = admission
        self.metrics = metrics
        self.route = route
        self.reject = reject
        self.plain = plain
        self.waiters: dict[Hashable, Waiter] = {}
        self._timers: dict[str, asyncio.TimerHandle] = {}
        self._pumping: set[str] = set()
        self._guard = Guard(HELD_TIMER, metrics.background_errors)

    def hold(
        self,
        key: Hashable,
        model: str,
        decision: Hold,
        *,
        prompt_tokens: int,
        variant: int,
        class_name: str,
        arrived: float,
        only: frozenset[str] | None = None,
        lenient: bool = False,
    ) -> tuple[asyncio.Future[Any], float]:
        """Hold request ``key`` (its deadline capped at :data:`HOLD_MAX_SECONDS` from now);
        returns the future its reply (or the plain rule's decision) is set on, and how
        long Envoy must wait for it (s). ``only``: the ids of the workers it may go to (a
        gateway's endpoint subset); None: any of its model's. ``lenient``: it was admitted
        on its mean prediction (the best of several classes), and a slot is judged so."""
        now = self.pool.clock()
        deadline = min(decision.deadline, now + HOLD_MAX_SECONDS)
        loop = asyncio.get_running_loop()
        future: asyncio.Future[Any] = loop.create_future()
        self.admission.queue(model).push(
            key, deadline, now, decision.workers or None, decision.order
        )
        self.waiters[key] = Waiter(
            key, model, prompt_tokens, variant, class_name, arrived, now, future, only, lenient
        )
        self._arm(model)
        return future, deadline - now

    def drop(self, key: Hashable) -> None:
        """The client went away (or the stream ended): out of the queue, nothing sent."""
        w = self.waiters.pop(key, None)
        if w is None:
            return
        q = self.admission.held.get(w.model)
        if q is not None:
            q.remove(key)
        self.metrics.held_wait.observe(max(0.0, self.pool.clock() - w.since))
        if not w.future.done():
            w.future.cancel()

    def _finish(self, w: Waiter, result: Any) -> None:
        self.waiters.pop(w.key, None)
        self.metrics.held_wait.observe(max(0.0, self.pool.clock() - w.since))
        if not w.future.done():
            w.future.set_result(result)

    def pump_all(self) -> None:
        for model in list(self.admission.held):
            self.pump(model)

    def pump(self, model: str) -> None:
        """Expire, re-decide and dispatch the held requests of ``model`` (the module's
        rule). Re-entrant calls (a dispatch that frees nothing) are folded into this one. An
        error is logged and leaves the requests held (their deadline still answers them): it
        never reaches the stream whose end or report called the pump."""
        q = self.admission.held.get(model)
        if not q or model in self._pumping:
            return
        self._pumping.add(model)
        try:
            self._pump(model)
        except Exception:
            log.exception("error deciding the held requests of model %s; they stay held", model)
        finally:
            self._pumping.discard(model)
            self._arm(model)

    def _pump(self, model: str) -> None:
        admission = self.admission
        pool = self.pool
        q = admission.held[model]
        now = pool.clock()
        for h in q.expire(now):
            w = self.waiters.get(h.key)
            if w is not None:
                self._finish(w, self.reject(w.key, self._late(w, now)))
        for h in list(q):
            w = self.waiters.get(h.key)
            if w is None:
                q.remove(h.key)
            elif admission.target_s(model, w.class_name) is None:
                q.remove(h.key)  # the target was removed: the plain rule decides it now
                self._finish(w, self.plain(w.key))
        if not q:
            return
        workers = [w for w in pool.by_model.get(model, ()) if w.configured]
        self._fill(model, workers, now)
        self._redecide(model, workers, now)

    def _fill(self, model: str, workers: list[Worker], now: float) -> None:
        """Give every free slot a held request (the module's rule, step 3)."""
        admission = self.admission
        q = admission.held[model]
        free: dict[str, int] = {}
        for worker in workers:
            n = admission.estimate(worker.worker_id).free_slots(now)
            free[worker.worker_id] = len(q) if n is None else n
        if not any(free.values()):
            return
        # The cheapest worker first: smallest idle TTFT for a typical request.
        workers.sort(key=lambda wk: admission.estimate(wk.worker_id).idle_ttft(0))
        for h in list(q):
            w = self.waiters[h.key]
            for worker in workers:
                wid = worker.worker_id
                if free.get(wid, 0) <= 0 or not w.may_use(worker):
                    continue
                if not is_free(worker, w.variant, now):
                    continue
                # Whether it fits there now, held for that worker or not (the module's rule).
                est = admission.estimate(wid)
                target = admission.target_s(model, w.class_name) or 0.0
                if not fits_now(est, w.prompt_tokens, target, w.arrived, now, w.lenient):
                    continue
                q.remove(h.key)
                free[wid] -= 1
                self._finish(w, self.route(w.key, worker))
                break
            if not any(free.values()):
                break

    def _redecide(self, model: str, workers: list[Worker], now: float) -> None:
        """Decide each request still held again on the prediction now, behind the held
        requests before it (the module's rule, step 4): one that no longer fits on any worker
        the thresholds leave free for it is answered at once."""
        admission = self.admission
        q = admission.held.get(model)
        if not q:
            return
        for ahead, h in enumerate(list(q)):
            w = self.waiters.get(h.key)
            target = admission.target_s(model, w.class_name) if w is not None else None
            if w is None or target is None:
                continue
            candidates = [wk for wk in workers if w.may_use(wk) and is_free(wk, w.variant, now)]
            if not candidates:
                continue  # busy by the thresholds: its deadline answers it
            reply = admission.recheck(candidates, w.prompt_tokens, target, w.arrived, now, ahead)
            if reply is not None:
                q.remove(h.key)
                self._finish(w, self.reject(w.key, reply))

    def _late(self, w: Waiter, now: float) -> Reject:
        """The deadline reply's wait for a request whose deadline passed: the smallest
        predicted wait now (None: unknown)."""
        workers = [
            wk
            for wk in self.pool.by_model.get(w.model, ())
            if wk.configured and w.may_use(wk) and is_free(wk, w.variant, now)
        ]
        target = self.admission.target_s(w.model, w.class_name)
        if not workers or target is None:
            return Reject(None)
        preds = self.admission.predictions(
            w.model, workers, w.prompt_tokens, target, w.arrived, now
        )
        waits = [p.wait for p in preds if p.wait is not None]
        return Reject(min(waits) if waits else None)

    def _fire(self, model: str) -> None:
        """The deadline timer of ``model``: its step runs guarded (a failure is counted and
        the first logged); after a failure the timer fires again :data:`TIMER_RETRY` later."""
        self._timers.pop(model, None)  # this timer has fired
        if not self._guard.call(self._due, model) and model not in self._timers:
            self._arm(model, TIMER_RETRY)

    def _due(self, model: str) -> None:
        """The earliest held deadline of ``model`` passed: decide its held requests."""
        self.pump(model)

    def _arm(self, model: str, at_least: float = 0.0) -> None:
        """A timer for the earliest held deadline of ``model``, at least ``at_least`` s from
        now (none when none is held)."""
        old = self._timers.pop(model, None)
        if old is not None:
            old.cancel()
        q = self.admission.held.get(model)
        if not q:
            self.admission.held.pop(model, None)
            return
        first = q.first_deadline()
        assert first is not None  # the queue is not empty
        with contextlib.suppress(RuntimeError):  # no running loop: nothing to time
            loop = asyncio.get_running_loop()
            due = max(0.0, first - self.pool.clock()) + TIMER_SLACK
            delay = max(at_least, min(due, RECHECK_SECONDS))
            self._timers[model] = loop.call_later(delay, self._fire, model)

    def close(self) -> None:
        for handle in self._timers.values():
            handle.cancel()
        self._timers.clear()


def extension_seconds(wait: float) -> int:
    """Whole seconds Envoy waits for a held request's reply: its longest hold plus 2."""
    return min(int(HOLD_MAX_SECONDS) + 2, math.ceil(max(0.0, wait)) + 2)
