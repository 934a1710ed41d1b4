"""Holding a latency target: measured TTFT per worker, and the controller that scales limits.

A model with ``ttft_p99_target_ms`` (or ``itl_p99_target_ms``) set is run by a controller per
worker (docs/latency-target.md). Each worker's window of measured latencies gives a p99;
once a second :meth:`LatencyControl.tick` moves the worker's multiplier on its configured
limits (the ceiling) toward the largest value that keeps the p99 under the target:

- above the target: down by the factor target / p99, kept within 0.95 to 0.70;
- below ``RAISE_BELOW`` of the target: up by the factor ``RAISE_BELOW`` x target / p99 (the
  headroom), kept within +``STEP_UP`` and x``MAX_STEP_UP``; between the two it holds (the
  hysteresis band), so a p99 near the target does not make the limit hunt;
- only on samples of requests dispatched after its last move: at least ``MIN_SAMPLES`` of
  them to lower or hold; to raise, ``MIN_RAISE_SAMPLES`` of those of the last
  ``RECENT_SECONDS`` (their maximum is then the p99): a limit that throttles admission must
  not starve itself of the samples that would let it rise, nor hold on the samples of a
  load that has just gone; but within ``AFTER_CUT_SECONDS`` of a cut a raise needs
  ``MIN_SAMPLES`` too, or the fast requests the cut admits would undo it;
- a cut must pay: once a run of cuts, made while the worker was busy under its limit, has
  taken the limit to ``JUDGE_AFTER`` of where it began in 2 moves or more, and the p99 is
  still above ``FUTILE_BELOW`` of the one that began it, the delay is not the worker's
  (the gateway's own CPU, the network): the limit goes back to where the run began and
  holds, "target unreachable: delay not from the worker", until the p99 is within target
  again or leaves 2/3 to 3/2 of the judged one, or ``REJUDGE_SECONDS`` pass;
- frozen while its data is stale: no sample for ``STALE_SECONDS``;
- a streamed request still waiting for its first token past the target is a miss already:
  its age so far counts as a sample (a lower bound of its TTFT), so a queue that builds is
  cut while it builds, not a TTFT later when its requests finally answer.

The TTFT comes from the gateway (the request path times each streamed response) or, with
``source="engine"``, from what the engine reports in its load events (histogram buckets;
each request counts at its bucket's upper bound). A class's controller always uses the
gateway's: an engine does not know the classes.

Plain values and an injected clock; the measurements are fed in by the request path
(:meth:`LatencyControl.observe_ttft`) and :meth:`tick` is called by the service's timer.
"""

from __future__ import annotations

import math
import time
from collections import deque
from collections.abc import Callable, Iterator
from dataclasses import dataclass, replace

from extproc.core.classes import ClassRegistry, ClassTable, RequestClass
from extproc.core.pool import WorkerPool
from extproc.core.worker import Ticket, Worker

# Samples older than this are forgotten; with MIN_SAMPLES, a worker needs about 2 requests
# per second for the controller to cut, below that load its limit is not what binds.
WINDOW_SECONDS = 10.0
MAX_SAMPLES = 4096  # per worker and window; the p99 of the newest this many
MIN_SAMPLES = 20  # below this the p99 is the maximum of too few: no cut
# A raise needs fewer: the maximum of 5 samples under RAISE_BELOW of the target is enough
# to let more in (a miss is then cut on MIN_SAMPLES); at the 2-3 admitted requests per
# second of a throttled worker, a raise every 2 s instead of every 7-10 s.
MIN_RAISE_SAMPLES = 5
RECENT_SECONDS = 3.0  # the newest samples, which a raise is judged on
# For this long after a cut a raise needs MIN_SAMPLES too: the first requests a cut admits
# are fast because it just shortened the queue; raising on 5 of them undoes it at once.
AFTER_CUT_SECONDS = 5.0
STALE_SECONDS = 5.0
FLOOR = 0.1
STEP_UP = 0.05  # the smallest raise, of the ceiling
MAX_STEP_UP = 2.0  # the largest raise, a factor, taken only at a p99 under 40 % of the target
RAISE_BELOW = 0.8
MIN_STEP_DOWN = 0.95
MAX_STEP_DOWN = 0.70
# A run of cuts is judged once it has cut the limit to JUDGE_AFTER of where it began, in at
# least 2 moves: a p99 above FUTILE_BELOW of the one that started it means admitting less
# did not shorten the TTFT. A worker whose TTFT grows with what it runs gains 10-30 % per
# cut; a stall outside the worker gains nothing.
JUDGE_AFTER = 0.75
FUTILE_BELOW = 0.9
REJUDGE_SECONDS = 30.0
UNREACHABLE_HERE = "target unreachable: delay not from the worker"
SOURCES = ("gateway", "engine")
ENGINE_SAMPLES_MAX = 1000  # per load report: more only repeats the same buckets
# Where the TTFT of a streamed response was taken, as /debug/workers says it.
AT_BODY = "first generated tokens in the response body"
AT_HEADERS = (
    "response headers: no ext_proc stream delivers the body, and an engine that sends its "
    "headers before the first token (vLLM, the simulated worker) looks instantly fast; "
    "observe response bodies (envoy/envoy-track-output.yaml)"
)


def p99(values: list[float]) -> float:
    """The nearest-rank 99th percentile (the smallest value with 99 % at or below it)."""
    ordered = sorted(values)
    return ordered[max(0, math.ceil(0.99 * len(ordered)) - 1)]


class LatencyWindow:
    """Recent latencies of one worker as (time observed, seconds), oldest first."""

    __slots__ = ("last_at", "samples")

    def __init__(self) -> None:
        self.samples: deque[tuple[float, float]] = deque(maxlen=MAX_SAMPLES)
        self.last_at: float | None = None  # when the newest sample was observed

    def add(self, now: float, seconds: float) -> None:
        self.samples.append((now, seconds))
        self.last_at = now

    def since(self, now: float, start: float) -> list[float]:
        """The latencies observed within the window of requests dispatched at or after
        ``start`` (a TTFT longer than the window still counts when it ends)."""
        cutoff = now - WINDOW_SECONDS
        samples = self.samples
        while samples and samples[0][0] < cutoff:
            samples.popleft()
        return [s for t, s in samples if t - s >= start]


@dataclass(frozen=True, slots=True)
class Step:
    """One controller decision: the new multiplier and why."""

    scale: float
    direction: int  # -1 down, 0 hold, +1 up
    reason: str
    unreachable: bool = False


def control_step(scale: float, p99_s: float, target_s: float) -> Step:
    """The move for a measured p99 against the target; pure arithmetic, no state."""
    ratio = p99_s / target_s
    shown = f"p99 {p99_s * 1000:.0f} ms, target {target_s * 1000:.0f} ms"
    if ratio > 1.0:
        if scale <= FLOOR:
            return Step(FLOOR, 0, f"target unreachable: {shown} at the floor", True)
        factor = min(MIN_STEP_DOWN, max(MAX_STEP_DOWN, 1.0 / ratio))
        return Step(max(FLOOR, round(scale * factor, 4)), -1, f"lowering: {shown}")
    if ratio < RAISE_BELOW and scale < 1.0:
        # Proportional to the headroom: TTFT grows at most in proportion to what is
        # admitted (less where part of it is the idle engine's), so x RAISE_BELOW / ratio
        # lands at or below the band's low edge.
        factor = MAX_STEP_UP if ratio <= 0 else min(MAX_STEP_UP, RAISE_BELOW / ratio)
        raised = max(scale + STEP_UP, scale * factor)
        return Step(min(1.0, round(raised, 4)), 1, f"raising: {shown}")
    if scale >= 1.0:
        return Step(1.0, 0, f"at the ceiling: {shown}")
    return Step(scale, 0, f"holding: {shown}")


def step_for(
    scale: float,
    since_move: list[float],
    recent: list[float],
    target_s: float,
    after_cut: bool = False,
) -> tuple[Step, float] | None:
    """The move for the samples since the last move and the newest of them (the last
    ``RECENT_SECONDS``), with the p99 it is taken on; None: too few to move. A cut or a hold
    needs ``MIN_SAMPLES``; a raise ``MIN_RAISE_SAMPLES`` of the newest, so that a load that
    has just fallen raises at once instead of holding on the samples from before it, except
    right ``after_cut`` (``AFTER_CUT_SECONDS``): the first requests a cut admits are fast
    because it just cut the queue, and raising on them would undo it; that raise needs
    ``MIN_SAMPLES`` too."""
    full = None
    if len(since_move) >= MIN_SAMPLES:
        measured = p99(since_move)
        full = (control_step(scale, measured, target_s), measured)
        if full[0].direction < 0 or full[0].unreachable or after_cut:
            return full
    if after_cut:
        return None
    if len(recent) >= MIN_RAISE_SAMPLES:
        measured = p99(recent)
        step = control_step(scale, measured, target_s)
        if step.direction > 0:
            return step, measured
    return full


def judge_cut(c: WorkerControl, step: Step, measured: float, busy: bool, now: float) -> Step:
    """``step`` unless the cuts of ``c`` have stopped paying (the module's rule); updates the
    run under judgement. ``busy``: the worker is at its limit now, so a cut binds."""
    if c.futile is not None:
        p99_then, since = c.futile
        if (
            step.direction < 0
            and now - since < REJUDGE_SECONDS
            and p99_then / 1.5 <= measured <= p99_then * 1.5
        ):
            shown = step.reason.split(": ", 1)[-1]
            return Step(c.scale, 0, f"{UNREACHABLE_HERE}; cuts did not shorten it: {shown}", True)
        c.futile = None
    if step.direction >= 0:
        if not step.unreachable:
            c.anchor, c.cuts = None, 0
        return step
    if c.anchor is None or not busy:
        c.anchor, c.cuts = (c.scale, measured), 0  # a cut that does not bind proves nothing
    elif c.cuts >= 2 and c.scale <= JUDGE_AFTER * c.anchor[0]:
        scale_then, p99_then = c.anchor
        c.anchor, c.cuts = (c.scale, measured), 0
        if measured > FUTILE_BELOW * p99_then:
            c.futile = (measured, now)
            c.anchor = None
            return Step(
                scale_then,
                1,
                f"{UNREACHABLE_HERE}: p99 {measured * 1000:.0f} ms "
                f"at x{c.scale:g}, {p99_then * 1000:.0f} ms at x{scale_then:g}; "
                f"{step.reason.split(': ', 1)[-1]}",
                True,
            )
    c.cuts += 1
    return step


class WorkerControl:
    """The controller state of one worker."""

    __slots__ = (
        "anchor",
        "cuts",
        "direction",
        "engine",
        "futile",
        "itl",
        "measured_at",
        "moved_at",
        "overdue",
        "p99_s",
        "reason",
        "scale",
        "ttft",
        "unreachable",
    )

    def __init__(self, now: float) -> None:
        self.ttft = LatencyWindow()
        self.engine = LatencyWindow()  # the engine-reported TTFT
        self.itl = LatencyWindow()
        self.scale = 1.0
        self.direction = 0
        # Never moved: every request in the window counts, also those dispatched just
        # before the controller was created.
        self.moved_at = now - WINDOW_SECONDS
        self.reason = "waiting for samples"
        self.unreachable = False
        self.p99_s: float | None = None  # the TTFT p99 of the current window
        self.overdue = 0  # requests waiting for their first token past the target
        self.measured_at = AT_BODY
        # The run of cuts under judgement: (scale, p99) where it began, and its cuts since.
        self.anchor: tuple[float, float] | None = None
        self.cuts = 0
        # A judged-futile run: (p99 then, when), holding the limit until it is stale.
        self.futile: tuple[float, float] | None = None

    def view(self, now: float) -> dict[str, object]:
        engine = self.engine.since(now, -math.inf)
        return {
            "limit": self.scale,
            "why": self.reason,
            "target_unreachable": self.unreachable,
            "ttft_p99_ms": None if self.p99_s is None else round(self.p99_s * 1000, 1),
            "waiting_past_target": self.overdue,
            "ttft_measured_at": self.measured_at,
            "engine_ttft_p99_ms": round(p99(engine) * 1000, 1) if engine else None,
        }


@dataclass(frozen=True, slots=True)
class Turn:
    """A change of direction of one worker's limit: what the service logs."""

    worker_id: str
    model: str
    request_class: str  # "" = the model's target
    direction: int
    scale: float
    reason: str


@dataclass(frozen=True, slots=True)
class Targets:
    """The targets one controller holds, in ms."""

    ttft_p99_target_ms: float | None
    itl_p99_target_ms: float | None


@dataclass(frozen=True, slots=True)
class ModelLatency:
    """One model's latency as the metrics and the status page show it (seconds)."""

    model: str
    ttft_p99: float | None  # measured at the gateway
    engine_ttft_p99: float | None  # reported by the engines
    limit: float  # the mean multiplier of its workers


MODEL = ""  # the key of the model's own target among a worker's controllers
UNKNOWN_PRIORITY = 10**9  # past every class's (0-1000)


class LatencyControl:
    """The controllers of every worker with a latency target: the model's (flag, API), and
    one per request class with its own target (classes file). A class's multiplier applies
    to its requests and to every class of no higher priority, so a miss of a critical class
    sheds the sheddable too; a variant's limits use the lowest multiplier that applies."""

    def __init__(
        self,
        pool: WorkerPool,
        clock: Callable[[], float] = time.monotonic,
        classes: ClassRegistry | None = None,
        source: str = "gateway",
    ) -> None:
        if source not in SOURCES:
            raise ValueError(f"TTFT source must be one of {', '.join(SOURCES)}, got {source!r}")
        self.pool = pool
        self.clock = clock
        self.classes = classes
        self.source = source
        # Per worker id: its controllers by MODEL or class name.
        self.workers: dict[str, dict[str, WorkerControl]] = {}
        # Timed streamed requests before their first token, by id(ticket): (ticket, class).
        self.pending: dict[int, tuple[Ticket, str]] = {}
        # Per tick: per worker id, (dispatch time, class) of its pending requests.
        self._waiting: dict[str, list[tuple[float, str]]] = {}
        self._class_targets: dict[str, Targets] = {}
        self._variants: list[RequestClass] = []
        if classes is not None:
            self._on_classes(classes.table)
            classes.listeners.append(self._on_classes)

    def _on_classes(self, table: ClassTable) -> None:
        """A class table in force: a class whose target was removed stops shedding now."""
        self._variants = table.variant_classes() if table.enabled else []
        self._class_targets = {
            c.name: Targets(c.ttft_p99_target_ms, c.itl_p99_target_ms)
            for c in table.classes
            if c.has_target and table.enabled
        }
        self.pool.set_class_target(bool(self._class_targets))
        for wid, controls in self.workers.items():
            for name in [n for n in controls if n != MODEL and n not in self._class_targets]:
                del controls[name]
            worker = self.pool.workers.get(wid)
            if worker is not None:
                self._apply(worker, controls)

    def _targets(self, model: str) -> Targets | None:
        th = self.pool.thresholds_for(model)
        if not th.has_target:
            return None
        return Targets(th.ttft_p99_target_ms, th.itl_p99_target_ms)

    def _timed(self, worker: Worker, request_class: str) -> list[WorkerControl]:
        """The controllers a request of ``request_class`` on ``worker`` feeds."""
        out: list[WorkerControl] = []
        if not self._targets(worker.model) and request_class not in self._class_targets:
            return out
        controls = self.workers.setdefault(worker.worker_id, {})
        for key in (MODEL, request_class) if request_class else (MODEL,):
            if (key == MODEL and self._targets(worker.model)) or key in self._class_targets:
                control = controls.get(key)
                if control is None:
                    control = controls[key] = WorkerControl(self.clock())
                out.append(control)
        return out

    def timed(self, model: str, request_class: str = "") -> bool:
        """Whether a request of ``model`` (and ``request_class``) is timed at all."""
        return self.pool.thresholds_for(model).has_target or request_class in self._class_targets

    def dispatched(self, ticket: Ticket, request_class: str = "") -> None:
        """A timed streamed request was routed: until its first token (or its end), its
        age counts as a lower bound of its TTFT once it passes the target."""
        if self._timed(ticket.worker, request_class):  # its controllers exist from now
            self.pending[id(ticket)] = (ticket, request_class)

    def _collect_waiting(self) -> None:
        """Forget the pending requests that got their first token or ended; group the rest
        by the worker they are on now."""
        waiting: dict[str, list[tuple[float, str]]] = {}
        for key, (ticket, cls) in list(self.pending.items()):
            if ticket.released or not ticket.in_prefill:
                del self.pending[key]
            else:
                waiting.setdefault(ticket.worker.worker_id, []).append((ticket.started, cls))
        self._waiting = waiting

    def _overdue(
        self, worker: Worker, key: str, since: float, target_s: float, now: float
    ) -> list[float]:
        """The ages of ``worker``'s requests (of class ``key``; MODEL: all) dispatched at or
        after ``since`` and still waiting for their first token after ``target_s``."""
        return [
            now - started
            for started, cls in self._waiting.get(worker.worker_id, ())
            if started >= since and now - started > target_s and (key == MODEL or cls == key)
        ]

    def observe_ttft(
        self, worker: Worker, seconds: float, at_headers: bool = False, request_class: str = ""
    ) -> None:
        """One request's time to first token on ``worker`` (the request path), taken at
        its first generated tokens, or at its response headers (``at_headers``)."""
        now = self.clock()
        for control in self._timed(worker, request_class):
            control.ttft.add(now, seconds)
            control.measured_at = AT_HEADERS if at_headers else AT_BODY

    def observe_engine(self, worker: Worker, buckets: list[tuple[float, int]]) -> None:
        """The engine's TTFT buckets of one load report: each request at its upper bound."""
        if not self._targets(worker.model):
            return
        window = self._timed(worker, "")[0].engine
        now = self.clock()
        left = ENGINE_SAMPLES_MAX
        for bound, count in buckets:
            for _ in range(min(count, left)):
                window.add(now, bound)
            left -= min(count, left)

    def observe_itl(self, worker: Worker, seconds: float, request_class: str = "") -> None:
        """One request's mean inter-token latency on ``worker``."""
        now = self.clock()
        for control in self._timed(worker, request_class):
            control.itl.add(now, seconds)

    def tick(self) -> list[Turn]:
        """Move every controlled worker's limits once; returns the changes of direction."""
        now = self.clock()
        pool = self.pool
        turns: list[Turn] = []
        self._collect_waiting()
        for worker_id in [w for w in self.workers if w not in pool.workers]:
            del self.workers[worker_id]
        for model, workers in pool.by_model.items():
            model_targets = self._targets(model)
            for worker in workers:
                controls = self.workers.get(worker.worker_id, {})
                if model_targets is None:
                    controls.pop(MODEL, None)
                for key, control in controls.items():
                    targets = model_targets if key == MODEL else self._class_targets.get(key)
                    if targets is None:
                        continue
                    engine = key == MODEL and self.source == "engine"
                    turn = self._tick_one(worker, key, control, targets, now, engine)
                    if turn is not None:
                        turns.append(turn)
                self._apply(worker, controls)
        return turns

    def _apply(self, worker: Worker, controls: dict[str, WorkerControl]) -> None:
        """The worker's multipliers from its controllers' scales."""
        model = controls.get(MODEL) if self._targets(worker.model) else None
        scale = 1.0 if model is None else model.scale
        by_variant: tuple[float, ...] = ()
        if self._variants and any(k != MODEL for k in controls):
            by_variant = tuple(
                min(
                    [1.0]
                    + [
                        c.scale
                        for key, c in controls.items()
                        if key != MODEL and v.priority >= self._priority(key)
                    ]
                )
                for v in self._variants
            )
        self.pool.set_latency_scale(worker, scale, by_variant)

    def _priority(self, name: str) -> int:
        """The class's priority (0 is the most important); an unknown class is below every
        class, so its multiplier applies to none."""
        for c in self._variants:
            if c.name == name:
                return c.priority
        return UNKNOWN_PRIORITY

    def _tick_one(
        self,
        worker: Worker,
        key: str,
        c: WorkerControl,
        targets: Targets,
        now: float,
        engine: bool = False,
    ) -> Turn | None:
        step = self._decide(c, targets, now, engine, worker, key)
        if step is None:
            return None
        c.reason = step.reason
        c.unreachable = step.unreachable
        if step.scale != c.scale:
            c.scale = step.scale
            c.moved_at = now
        if step.direction and step.direction != c.direction:
            c.direction = step.direction
            return Turn(
                worker.worker_id, worker.model, key, step.direction, step.scale, step.reason
            )
        return None

    def _decide(
        self,
        c: WorkerControl,
        targets: Targets,
        now: float,
        engine: bool,
        worker: Worker,
        key: str,
    ) -> Step | None:
        """The step for this tick, or None when frozen (the reason says why)."""
        source = c.engine if engine else c.ttft
        ttft_ms = targets.ttft_p99_target_ms
        overdue: list[float] = []
        if ttft_ms is not None and not engine:
            overdue = self._overdue(worker, key, c.moved_at, ttft_ms / 1000, now)
        c.overdue = len(overdue)
        newest = max((t for t in (source.last_at, c.itl.last_at) if t is not None), default=None)
        if overdue:
            newest = now  # requests waiting past the target are news
        everything = source.since(now, -math.inf)
        c.p99_s = p99(everything) if everything else None
        if newest is None:
            c.reason = "waiting for samples"
            return None
        if now - newest > STALE_SECONDS:
            c.reason = f"frozen: no latency sample for {now - newest:.0f} s"
            return None
        steps: list[tuple[Step, float]] = []
        recent_from = max(c.moved_at, now - RECENT_SECONDS)
        for name, window, target_ms, waiting in (
            ("", source, ttft_ms, overdue),
            ("ITL ", c.itl, targets.itl_p99_target_ms, []),
        ):
            if target_ms is None:
                continue
            recent_waiting = [age for age in waiting if now - age >= recent_from]
            found = step_for(
                c.scale,
                window.since(now, c.moved_at) + waiting,
                window.since(now, recent_from) + recent_waiting,
                target_ms / 1000,
                after_cut=c.direction < 0 and now - c.moved_at < AFTER_CUT_SECONDS,
            )
            if found is not None:
                step, measured = found
                steps.append((replace(step, reason=name + step.reason), measured))
        if not steps:
            c.reason = f"waiting for {MIN_SAMPLES} samples since the last move"
            return None
        # The most cautious of the two targets decides.
        step, measured = min(steps, key=lambda s: (s[0].scale, not s[0].unreachable))
        return judge_cut(c, step, measured, worker.busy, now)

    def unreachable(self, worker: Worker) -> bool:
        """Some target of ``worker`` is out of reach: above it at the floor, or by delay
        that cutting its limit did not shorten."""
        return any(c.unreachable for c in self.workers.get(worker.worker_id, {}).values())

    def models(self) -> Iterator[ModelLatency]:
        """Per model with a target: the TTFT p99 over all its workers' windows, measured at
        the gateway and reported by the engines (s), and the mean multiplier."""
        now = self.clock()
        for model, workers in self.pool.by_model.items():
            if not self.pool.thresholds_for(model).has_target:
                continue
            samples: list[float] = []
            engine: list[float] = []
            scales: list[float] = []
            for worker in workers:
                c = self.workers.get(worker.worker_id, {}).get(MODEL)
                scales.append(worker.latency_scale)
                if c is not None:
                    samples.extend(c.ttft.since(now, -math.inf))
                    engine.extend(c.engine.since(now, -math.inf))
            yield ModelLatency(
                model,
                p99(samples) if samples else None,
                p99(engine) if engine else None,
                sum(scales) / len(scales) if scales else 1.0,
            )

    def view(self, worker: Worker) -> dict[str, object] | None:
        """What /debug/workers shows for ``worker``: None when nothing of it is timed. The
        model's controller first (``limit``, ``why``...), then ``classes`` by name."""
        has_model = self.pool.thresholds_for(worker.model).has_target
        if not has_model and not self._class_targets:
            return None
        controls = self.workers.get(worker.worker_id, {})
        control = controls.get(MODEL)
        now = self.clock()
        if control is not None:
            out = control.view(now)
        else:
            out = {"limit": worker.latency_scale, "why": "waiting for samples" if has_model
                   else "no target for the model", "target_unreachable": False,
                   "ttft_p99_ms": None, "waiting_past_target": 0, "ttft_measured_at": None,
                   "engine_ttft_p99_ms": None}  # fmt: skip
        if self._class_targets:
            out["classes"] = {
                name: controls[name].view(now) if name in controls else {
                    "limit": 1.0, "why": "waiting for samples", "target_unreachable": False,
                    "ttft_p99_ms": None, "waiting_past_target": 0,
                    "ttft_measured_at": None}
                for name in self._class_targets
            }  # fmt: skip
        return out
