"""Deadline admission: predict each request's time to first token per worker, then dispatch,
hold or reject it against a TTFT target.

The prediction, for a prompt of ``p`` tokens on worker ``w`` with ``h`` requests held in the
router ahead of it::

    ttft    = wait + prefill + gateway
    wait    = 0                              when occupancy + h < slots (a slot is free for it)
            = the median of when the running requests have freed its slot, from their ages
                                             when occupancy + h - slots < AGES_FOR
            = (occupancy + h - slots + 1) / rate        otherwise
    prefill = (overhead + cost x (p + pending)) x pace + serial x ahead
    rate    = min(slots / service, sum over the running requests of 1 / remaining(age))
    remaining(age) = service     while age <= the longest of the last EWMA_SAMPLES slot times
                   = age         once age is past all of them

- ``occupancy``: the requests the worker holds now: the router's own in flight to it
  (dispatched, not ended: exact and immediate), plus what the engine's last load report
  counts beyond them (``request_active_slots + num_requests_waiting`` minus the router's in
  flight when that report came: requests of other clients). Past ``slots`` they wait at the
  engine or in the network; with the ``h`` held requests, ``occupancy + h - slots`` requests
  are ahead of it in line, and it starts at the completion after theirs.
- ``slots``: ``request_total_slots`` when the engine reports it, no more than its KV cache
  runs at once (its blocks over the blocks a running request holds, averaged over the load
  reports with requests running: 640 blocks and 512-token prompts run about 17 requests,
  not the 48 sequences an engine may be allowed). Without the KV bound, a worker whose
  cache had just drained its waiting requests counted all its sequences free again, and the
  requests sent to them waited at the engine: on simulated workers at the capacity at
  target, admitted requests spent a median 400 ms in the worker against a 150 ms target.
  Nor more than its free KV blocks start: a request needs at least a block of its own to
  start, so a worker whose cache is full runs what it runs now (its occupancy less the
  requests it reports waiting) and one more per free block. The free blocks are those of
  the last load report (less ``KV_ASIDE``, vLLM's null block), less one per request the
  router sent since and plus one per request that ended since (it freed at least one). On
  vLLM with 6 blocks of 128 tokens for 4 sequences, 3 requests decoding fill the cache; a
  4th sent to the 4th sequence waited there for one of them to end, up to 2.5 s against a
  2.5-s target: counting that slot full holds or refuses the request by its predicted wait
  instead. Requests waiting are not taken to mean the worker is full: an engine also keeps waiting
  the prompts its step's token budget cannot take yet, for one step. Only a worker that
  reports no KV cache, and reports requests waiting while fewer than its slots run, is taken
  to run no more than it runs now (``request_active_slots``). A worker that does not
  report its slots learns them from the gateway's timings: they are the smallest occupancy
  at which a request the router sent to a presumed free slot was seen queueing (its first
  byte came later than ``QUEUE_FACTOR`` x its predicted prefill + ``QUEUE_MARGIN``), raised
  to the most requests seen running at once (streaming together, or
  ``request_active_slots``); every ``PROBE_EVERY`` seconds one request may go past them to
  find out whether the worker runs more. Before any request
  queued, such a worker is never full, as the busy rule alone would have it. A worker that
  reports no slots and no waiting count is flagged ``gateway_only``: its prediction comes
  from the router's own timings alone.
- ``service``: mean time a request holds a slot: its decode (first body byte to stream end,
  measured) plus its prefill (the fit below), or for a non-streamed response that completes,
  dispatch to its end, an average of about the last
  ``EWMA_SAMPLES`` requests. ``slots / service`` is the rate at which a full worker
  completes requests. Taken on every request, not only while the worker is full, so the
  first overload is predicted from the load before it; an engine whose decode slows as it
  runs more sequences is followed as its recent requests slow down.
- ``remaining(age)``: the expected time a running request still holds its slot, given that
  it has held it ``age`` seconds (from its first byte, plus its predicted prefill; a
  non-streamed one from its dispatch; one that waited at the engine, and the engine's other
  requests, count as just started). While its age is within the recent slot times, the
  rate of the recent completions already averages over such ages: its slot frees at
  ``1 / service``. Once it has run longer than every one of them, the samples say nothing
  of how much longer it runs, and the estimate is its age (with nothing known but that a
  process has lasted ``age``, ``age`` is the median of what remains: the rule of the
  doubling time); so its slot frees at ``1 / age``, ever slower as it runs. The worker's
  rate is the sum of these (each request's remaining time taken as exponential, the first
  of them ends at the sum of their rates), never above ``slots / service``. So six long
  generations filling the slots, long past the short requests' recent slot times, are
  predicted to free a slot no sooner than about ``age / slots``, and a short request is
  rejected at once rather than held to its deadline. Using the conditional mean of the
  recent slot times for ages within them (a mean residual life) was measured worse: on the
  plant of tests/core/plant.py without load reports at 3x, 91 % of the 5-s windows within
  target against 98 % (32 samples make a noisy tail, and a near-certain end counted as
  ``1 / residual`` overstates the rate).
- The first ``AGES_FOR`` slots to free (a request with none or one ahead of it): when the
  running requests have freed that many, each ending independently after the rest of its
  worker's recent slot times given its age (``core/slot_wait.py``), its spread from the
  same distribution (its 10th and 90th percentiles). Where the requests' lengths are alike,
  the oldest request frees the next slot, and its end is near certain: the rate's
  memoryless wait (below) puts the 90th percentile of the first free slot at 2.3 x its
  mean whatever the ages say. On two plant workers of 17 slots, every request 512 prompt
  and 128 output tokens, at capacity with a 150-ms target, 1.1-1.5 points more requests
  were admitted, within target. A later slot is predicted from the rate, since a request
  started meanwhile may end before the running ones: from the ages, slots 4 to 8 were
  predicted 17-21 % late on the plant's mixed lengths at 0.9 of capacity (5-6 % from the
  rate).
- ``overhead``, ``cost`` and ``serial``: a recursive least-squares fit (forgetting
  ``FORGET`` a sample, about the last 100) of ``dispatch to first body byte = overhead +
  cost x tokens + serial x ahead``, on the requests that started on a free slot (the others
  include a wait). ``tokens`` is the request's prompt plus ``pending``: the prompt tokens of
  the requests already started on that worker and not yet at their first token, which the
  engine prefills in the same batches before or with it. ``ahead``: the seconds of those
  requests' predicted prefill still to run when it was sent (each one's prediction less the
  time since its dispatch). An engine that prefills a request's batch and only then takes the
  next one's (llama.cpp on a CPU, where a short prompt's batch costs the same 0.4 s whatever
  its tokens) makes a request sent during another's prefill wait for the rest of it: its
  tokens say little of that, and ``serial`` learns it (from 0, for an engine that prefills
  them in the same step, to ``SERIAL_MAX``, all of it). On llama.cpp at the capacity at
  target, the requests sent while another on their worker had no first token yet took a
  median 1.23 times their prediction (90th percentile 1.91), the others 0.98 (1.48), and 3 of
  the 4 late requests were among them; on the plant of tests/core/plant.py with such an
  engine (2 slots, 0.4 s a prompt), at its capacity with a 1.5-s target, the 90th percentile
  of TTFT over prediction was 1.21 with ``ahead`` against 1.48 without (99th: 1.56 against
  1.90); on the plant's batched engines, no change. For a request that must wait for a slot,
  ``pending`` and ``ahead`` are the means that requests started with lately (what it will
  likely share when it starts). A sample's residual is clipped to ``CLIP`` times the mean
  absolute residual, so one stall does not throw the fit; the overhead, cost and serial stay
  >= 0. The mean absolute residual (the prefill's
  spread, below) counts only the errors of a trusted fit, one of ``MIN_FIT_SAMPLES`` samples
  or more: the fit starts from nothing, so the first request's error is its whole prefill and
  the next few are most of theirs, and counted, they made a worker that had served a handful
  of requests look unpredictable for the next 30 or more (a cold start's stall, for longer).
  Under a tight target that made a fresh worker unreachable, and one that got no more
  requests stayed so: on the plant of tests/core/plant.py, two fresh workers of 4 slots,
  prefills of 0.3-0.7 s and a 1.5-s target, seeds 1 to 4, 94 % of the requests were admitted
  at 30 % of capacity (all let in, none would have been late) and 85 % at 50 %, 3 late in
  all, against 100 % and 99 %, 1 late, from a trusted fit's errors alone. Before its
  ``MIN_FIT_SAMPLES + 1``-th request a worker's prefill is judged without a spread.
- ``pace``: the prediction is ``fit x pace``. A fit of about the last 100 requests follows a
  worker that becomes slower (a neighbour on its GPU or CPU, a throttled clock) over about
  100 requests, and every one sent meanwhile is predicted fast. So when each of the last
  ``PACE_SAMPLES`` free-slot requests took longer than the fit predicted for it, the
  prediction is scaled by the smallest of their ratios (each of them was at least that much
  slower), and back to 1 as soon as one is not (the fit has caught up). The requests that
  seem to have waited for a slot (``QUEUE_FACTOR``, which the fit leaves out) count here:
  a worker three times slower looks the same, and the next request sent to a free slot
  will likely take as long (but not on a worker whose slots are learnt from the timings:
  there they lower the slots instead). Only upwards: a fit
  that predicts too long costs a few admissions for a while, one that predicts too short
  costs the target; and 3 errors in a row on the low side are common in steady state (a
  prefill's time is skewed: mostly a little under the fit, now and then far over), where
  scaling down by them let more requests in late. On two plant workers whose prefill is a
  large part of a 0.5-s target, at 3x, one twice as slow for 20 s: 113 requests late in that
  time and 5 s after against 229 from the fit alone (seeds 1 to 32).
- ``step pace``: the pace reads the first bytes of requests sent after a worker slowed, so
  the requests sent before three of them are back are predicted at the old speed. The
  worker's running streams show it sooner: the time between a stream's tokens is the
  engine's step, and a worker whose steps take twice as long has slowed as a whole. The step
  now is the time per token of about the last ``STEP_SAMPLES`` chunks of the worker's
  streams (each chunk's time since its stream's last, over its tokens; the first chunk, the
  prefill's, is not counted), from ``STEP_MIN`` tokens; its base is the time per token of all
  the chunks between two of the fit's samples, averaged over about the fit's last
  ``STEP_BASE_SAMPLES`` (as the fit forgets): the step the fit learnt at. A time per token,
  not a median of gaps: a worker paused for part of each 100 ms (a neighbour taking the CPU)
  delays one gap in several, and only the time per token doubles with it; and all the
  chunks between the fit's samples, not the ones just before a sample: those include the
  step that prefilled it, longer than the rest. When the step is ``STEP_TRIGGER`` times its
  base or more, the prefill is predicted at ``fit x`` that ratio (or the pace, if larger).
  Below, it does nothing: an engine's step grows with the sequences it decodes at once (the
  simulated workers model 20 ms a step and 0.2 ms a sequence; llama.cpp on a CPU grows by
  much more), and the fit learnt at the batches it has seen. The step keeps its last value
  while the worker streams nothing (a worker then predicted too slow for every request
  still gets a request now and then: the extproc sends a rejected request to a free worker
  whose idle prediction alone misses the target, every 0.25 s). On the plant of
  tests/core/plant.py streaming chunks of 4 tokens, two workers at 3x, one twice as slow
  for 20 s, seeds 1 to 8: with prefill a large part of a 0.5-s target, 14 requests late in
  that time and 5 s after against 34 from the pace alone; with a 1-s target, 0 against 9;
  no change before the slowdown (8 and 3 late). While the step shows the worker slowed, the
  pace is the middle of the last ``PACE_SAMPLES`` free-slot requests' ratios when that is
  larger than the step's, not their smallest: a slowed engine's prompts take at least as
  much longer as its steps, and may take more. A llama.cpp server on this 2-core CPU, paused
  for half of every 100 ms at 3x its capacity at target: its steps came 1.6-2.0 times their
  base, its prompts 2.5-4.6 times the fit, and the smallest of three ratios (1.1-1.3) stayed
  under the step, so it kept taking requests that came late. Only once the step confirmed
  it: in steady state one prefill in several is far over the fit, and the middle of three
  would scale every prediction up after two of them. And from then until a free-slot
  request's first byte is back within its fit, not only while the step stays up: a slowed
  server's step swings about the trigger and now and then falls under it while its prompts
  still take twice the fit or more, and each request it takes then, predicted at the
  smallest ratio, is likely late. That latch is set only when the prompts agree, their
  middle ratio ``STEP_TRIGGER`` or more: an engine whose step grows with its batch past the
  trigger while its prompts stay near the fit has not slowed, and latching it would move
  its requests to its neighbour for as long as it stays latched.
- ``gateway``: the router's own delay before dispatch (arrival to dispatch, less any time
  held), averaged like ``service``; it is part of what the client waits and no worker
  shortens it.

Missing inputs are named in :attr:`WorkerEstimate.missing`. A worker with no data yet is
routable: with no slot count it is never full; with slots but no completed request yet (no
``rate``) it takes requests while a slot is free, and once full its wait is unknown, so it
holds nobody and a request that finds it full is rejected as with the thresholds (Retry-After
1 s), until its first completion. Its prefill is taken as 0 until a free-slot request is
measured. "Target unreachable": a target below what an idle worker measures for the
request (``prefill + gateway``, no wait) can never be met on that worker.

The engine's own TTFT histogram (when it reports one) includes its queue, so it is not a
prefill measurement; it is kept for diagnostics beside the prediction.

The decision (:func:`decide`) judges each prediction with its spread added, since the target
is a p99 (a ``lenient`` decision, for the best of several request classes, judges the mean,
from the ages the median, alone: such a request is admitted when more likely than not to meet
its target): the wait for ``n`` completions at the rate is about Gamma(n, rate), whose 90th
percentile is near ``(n + WAIT_Z x sqrt(n)) / rate`` (from the ages: its own 90th
percentile), and the prefill fit is off by up to ``PREFILL_MARGIN`` mean absolute residuals.
Among the workers that can start the request now, the one with the smallest predicted TTFT
that fits gets it (a slot never sits idle while a request that fits waits), with one
exception: predictions within the smallest one's spread of it are the same to the predictor,
and of those the worker holding the fewest requests (its ``occupancy``) gets it. Otherwise a
worker whose prediction stays a few milliseconds below the others' (a fit that learnt a little
faster, a neighbour that was slowed earlier) takes every request until it is full, and a
worker packed that way is where the prediction is weakest: its slots are a KV cache's
estimate from the average running request, which young requests make too large, and every
request sent since the last load report counts one block. On the simulated workers at the
capacity at target, 18 of the first 22 requests went to one worker, and a request sent to
its last "free" slot waited 290 ms at the engine against a 51-ms prediction, in every run.
On the plant of tests/core/plant.py (whose workers do not slow with load), two workers at 3x,
one twice as slow for 20 s, prefill a large part of a 0.5-s target, seeds 1 to 32: 113
requests late in that time and 5 s after against 150 with the smallest prediction always;
at 3x and at 0.9x with nothing slowed, no change (0-9 late of 10,000-13,000 admitted either
way, seeds 1 to 16). The other plant figures in this docstring (all but the pace's) were
measured before this rule was made. Otherwise, if the
smallest prediction of all fits, the request is held in the router until a slot frees on one
of the workers it fits on even if the slot comes at the wait's upper bound (earliest deadline
first, ``core/held.py``), its deadline the latest dispatch that leaves room for its prefill
and the gateway on the slowest of them; otherwise it is rejected at once, with Retry-After
and retry-after-ms from the smallest predicted wait.

A held request is decided again whenever the held queue is pumped (a stream's end, a load
report, a deadline, and a periodic tick while any is held) with the prediction of that
moment, behind the held requests before it (:func:`still_fits`): when even the 10th
percentile of its wait (Gamma(n, rate), :func:`gamma_low`; from the ages, its own), with its
prefill and the gateway, no longer fits what is left of its target on any worker, it would
miss 9 times in 10, and it is answered at once instead of at its deadline. It was admitted on
the 90th percentile; it is dropped on the 10th: a held request that may still be served in
time keeps its place (a rate has no memory, so a wait's bound does not shrink between
completions, and judging it on the mean or the bound again would drop requests that the next
completion serves in time: on the mean, a request held with a 10-s target behind a generation
2.5 x longer than the recent ones was dropped 0.3 s before the slot freed). On the plant at
3x its capacity this changes little (0-3 requests rejected after a hold in 270 s): there the
wait's spread, not the running requests' ages, decides; the re-decision matters when the
running requests outlive the recent ones.

How the request path uses it: one :class:`WorkerEstimate` per worker, told of every
dispatch, first body byte, stream end and load report. For a request: ``held_ahead`` =
:meth:`HeldQueue.ahead_of` its would-be deadline (arrival + target - the smallest
:meth:`WorkerEstimate.idle_ttft` with the prefill's spread), then :func:`predict_all` over the
candidate workers (not busy by the thresholds, which stay ceilings) and :func:`decide`. A
:class:`Hold` is pushed on the model's :class:`HeldQueue` with its deadline, the deadline it
is served by and its workers. Held requests are served earliest deadline first, each by the
deadline its prediction's spread gives it: a request of the best class, judged on its mean,
is answered at the later deadline its mean gives it, but ordered with the spread like every
other (ordered by the later one, it would go after the lesser classes' requests of the same
target that arrived with it). On every stream end, load
report and held deadline, the path calls :meth:`HeldQueue.expire` (those get the overload
reply) and :func:`~extproc.core.held.fill_slots` with each worker's
:meth:`WorkerEstimate.free_slots`, and dispatches what it returns, each held request only to
a worker where it still fits now (:func:`fits_now`).

Pure: plain values, times passed in, no I/O.
"""

from __future__ import annotations

import math
from collections import deque
from collections.abc import Hashable, Sequence
from dataclasses import dataclass, replace

from extproc.core.slot_wait import FirstFree, Survival, nth_free

TOKENS_UNIT = 1000.0  # the prefill fit's cost is per this many tokens (a conditioned matrix)
EWMA_SAMPLES = 32  # service time and gateway delay: about the last 32 requests
FORGET = 0.99  # the prefill fit's forgetting factor: about the last 100 requests
FIT_PRIOR = 1.0  # the prefill fit's initial uncertainty (s^2): a second either way
FIT_TRACE_MAX = 10.0  # bounds the fit's uncertainty when all prompts are alike (no windup)
CLIP = 4.0  # a prefill sample's residual is clipped at this many mean absolute residuals
CLIP_FLOOR = 0.002  # s: the smallest clip, so a perfect fit still learns a change
MIN_FIT_SAMPLES = 4  # before this many free-slot requests the prefill is not trusted
# A request sent while others are still before their first token waits for at most all of
# what remains of their prefill (an engine that prefills one batch at a time, then the next).
SERIAL_MAX = 1.0
# The prefill's pace (the module's rule): when each of the last this many free-slot
# requests took longer than the fit predicted, the prediction is scaled up by the smallest
# of their ratios until the fit has caught up.
PACE_SAMPLES = 3
# The engine's step (the module's rule): the time per token of about the last STEP_SAMPLES
# chunks of the worker's streams, against its value when the fit learnt (the time per token
# between the fit's samples, averaged over about its last STEP_BASE_SAMPLES); from STEP_MIN
# tokens, and acting from STEP_TRIGGER times slower.
STEP_SAMPLES = 32
STEP_BASE_SAMPLES = 100
STEP_MIN = 8
STEP_TRIGGER = 1.5
QUEUE_FACTOR = 2.0  # a first byte later than this x the predicted prefill ...
QUEUE_MARGIN = 0.05  # ... + this (s) means the request waited for a slot
PROBE_EVERY = 10.0  # s: how often a gateway-only worker may take one request past its slots
# A prediction's spread, which admission judges a request on (the module's rule). Measured
# on the plant of tests/core/plant.py at 3x its capacity with a 1 s target: without it, 21 %
# of the admitted requests were held past their deadline (a late rejection) and the p99 TTFT
# was 0.99-1.01 s; with it, 3-4 % and 0.88-0.90 s, the plant as busy as with all let in.
WAIT_Z = 1.28
PREFILL_MARGIN = 2.0
MAX_RETRY_AFTER = 60
# The first this many slots to free (a request's with none or one ahead of it, held or
# waiting at the engine) are predicted from the running requests' ages (core/slot_wait.py);
# a later one from the rate, as requests started meanwhile may end first.
AGES_FOR = 2
# A KV cache's blocks that never hold a request's tokens: vLLM counts its null block in
# ``num_gpu_blocks`` (the total its agent reports) but not in its usage.
KV_ASIDE = 1
ROUNDING = 1e-9  # a wait of 0.7000000000000002 s is 700 ms, not 701

# Names of the inputs, as /debug/workers lists the missing ones.
WAITING = "num_requests_waiting"
ACTIVE = "request_active_slots"
TOTAL = "request_total_slots"
ENGINE_TTFT = "engine_ttft"
COMPLETIONS = "completions"  # no request ended yet: no rate
PREFILL = "prefill"  # fewer than MIN_FIT_SAMPLES free-slot requests
GATEWAY = "gateway_delay"  # no arrival time given with a dispatch


class Ewma:
    """A mean of about the last ``samples`` values; the plain mean until it has that many,
    so the first values are not pulled toward a made-up start."""

    __slots__ = ("count", "samples", "value")

    def __init__(self, samples: int = EWMA_SAMPLES) -> None:
        self.samples = samples
        self.count = 0
        self.value = 0.0

    def add(self, x: float) -> None:
        self.count += 1
        self.value += (x - self.value) / min(self.count, self.samples)

    def get(self) -> float | None:
        return self.value if self.count else None


class PrefillFit:
    """``seconds = overhead + cost x tokens + serial x ahead`` by recursive least squares
    with forgetting, residuals clipped (the module's rule)."""

    __slots__ = ("abs_residual", "cost", "count", "overhead", "p", "serial")

    def __init__(self) -> None:
        self.overhead = 0.0
        self.cost = 0.0  # seconds per TOKENS_UNIT tokens
        self.serial = 0.0  # seconds per second of prefill still ahead of it at dispatch
        self.p = [[FIT_PRIOR if i == j else 0.0 for j in range(3)] for i in range(3)]
        self.abs_residual = Ewma()
        self.count = 0

    def predict(self, tokens: float, ahead: float = 0.0) -> float:
        return self.overhead + self.cost * tokens / TOKENS_UNIT + self.serial * ahead

    def add(self, tokens: float, seconds: float, ahead: float = 0.0) -> None:
        x = (1.0, tokens / TOKENS_UNIT, ahead)
        p = self.p
        err = seconds - self.predict(tokens, ahead)
        if self.count >= MIN_FIT_SAMPLES:  # a trusted fit's error (the module's rule)
            scale = self.abs_residual.get()
            if scale is not None:
                bound = max(CLIP * scale, CLIP_FLOOR)
                err = max(-bound, min(bound, err))
            self.abs_residual.add(abs(err))
        px = [sum(p[i][j] * x[j] for j in range(3)) for i in range(3)]
        denom = FORGET + sum(x[i] * px[i] for i in range(3))
        k = [v / denom for v in px]
        self.overhead = max(0.0, self.overhead + k[0] * err)
        self.cost = max(0.0, self.cost + k[1] * err)
        self.serial = min(SERIAL_MAX, max(0.0, self.serial + k[2] * err))
        new = [[(p[i][j] - k[i] * px[j]) / FORGET for j in range(3)] for i in range(3)]
        trace = sum(new[i][i] for i in range(3))
        if trace > FIT_TRACE_MAX:
            new = [[v * FIT_TRACE_MAX / trace for v in row] for row in new]
        self.p = new
        self.count += 1


@dataclass(slots=True)
class _Flight:
    """One request the router sent to this worker, until its stream ends."""

    prompt_tokens: int
    dispatched: float
    occupancy: int  # the worker's occupancy when it was sent, not counting it
    free: bool  # a slot was free for it when it was sent
    pending: int  # prompt tokens started before it and not yet at their first token
    ahead: float  # seconds of those requests' predicted prefill still to run when it was sent
    expected: float  # its prefill as predicted when it was sent
    first_byte: float | None = None
    last_token: float | None = None  # when its stream's last tokens came


class WorkerEstimate:
    """What one worker is measured to do, updated online from plain values (the module's
    rule). Requests are named by an opaque ``key`` from dispatch to stream end."""

    def __init__(self, worker: str) -> None:
        self.worker = worker
        self.flights: dict[Hashable, _Flight] = {}
        self.streaming = 0  # in flight and past their first byte
        self.fit = PrefillFit()
        # The last PACE_SAMPLES free-slot requests' measured over fitted prefill.
        self.ratios: deque[float] = deque(maxlen=PACE_SAMPLES)
        # The step showed the worker slowed, and no free-slot request was on time since.
        self.slowed = False
        # The recent chunks of the streams: (seconds since the stream's last chunk, tokens);
        # their seconds and tokens in all (kept as they come and go: the step is read on
        # every chunk); the time and tokens since the fit's last sample; the time per token
        # at the fit's samples.
        self.gaps: deque[tuple[float, int]] = deque(maxlen=STEP_SAMPLES)
        self.gap_seconds = 0.0
        self.gap_tokens = 0
        self.since_fit = [0.0, 0]
        self.step_base = Ewma(STEP_BASE_SAMPLES)
        self.service = Ewma()
        self.slot_times: deque[float] = deque(maxlen=EWMA_SAMPLES)  # the recent ones, raw
        self._survival: Survival | None = None  # of the slot times, built when asked
        self.gateway = Ewma()
        self.decode_per_token = Ewma()  # s per output token, for diagnostics
        self.prompt_tokens = Ewma()  # the typical prompt, for diagnostics
        self.shared = Ewma()  # pending tokens a request started with: a later start's share
        self.shared_ahead = Ewma()  # and the seconds of their prefill still ahead of it
        self.engine_ttft_s = Ewma()
        # The engine's last load report; None = not reported.
        self.waiting: int | None = None
        self.active: int | None = None
        self.total_slots: int | None = None  # 0 counts as not reported
        self.extra = 0  # requests the engine counted beyond the router's own
        # KV blocks a running request holds, on average over the load reports with requests
        # running, and the worker's KV cache: how many requests its KV cache runs at once.
        self.blocks_per_running = Ewma()
        self.kv_total: int | None = None
        self.kv_used: int | None = None  # blocks in use at the last report
        # Blocks taken (+1 a dispatch) and freed (-1 an end) since that report: each request
        # needs at least a block of its own to start (the module's rule).
        self.kv_delta = 0
        # Slots learnt from the timings when none are reported (the module's rule).
        self.slots_guess: int | None = None
        self.guessed_at = -math.inf

    # ----- measurements ---------------------------------------------------------------

    def dispatched(
        self,
        key: Hashable,
        prompt_tokens: int,
        now: float,
        arrived: float | None = None,
        held: float = 0.0,
    ) -> None:
        """The router sent request ``key`` here at ``now``; ``arrived``: when it reached the
        router, ``held`` of that spent held for a slot (the rest is the gateway's delay)."""
        if key in self.flights:
            raise ValueError(f"request {key!r} is already in flight on {self.worker}")
        if prompt_tokens < 0:
            raise ValueError(f"prompt_tokens: {prompt_tokens} is negative; expected >= 0")
        occupancy = self.occupancy()
        slots = self.slots(now)
        free = slots is None or occupancy < slots
        if self.slots_guess is not None and occupancy >= self.slots_guess:
            self.guessed_at = now  # this one probes past the guess: the next in PROBE_EVERY
        pending, ahead = self.pending(now) if free else (0, 0.0)
        self.flights[key] = _Flight(
            prompt_tokens,
            now,
            occupancy,
            free,
            pending,
            ahead,
            self.prefill(prompt_tokens + pending, ahead),
        )
        self.prompt_tokens.add(prompt_tokens)
        self.kv_delta += 1
        if free:
            self.shared.add(pending)
            self.shared_ahead.add(ahead)
        if arrived is not None:
            self.gateway.add(max(0.0, now - arrived - held))

    def first_byte(self, key: Hashable, now: float) -> None:
        """The first body byte of ``key``'s response reached the router (its first token)."""
        f = self.flights.get(key)
        if f is None or f.first_byte is not None:
            return
        f.first_byte = now
        self.streaming += 1
        learn = self.total_slots is None  # slots not reported: learnt from the timings
        if learn and self.slots_guess is not None and self.streaming > self.slots_guess:
            self.slots_guess = self.streaming  # seen running at once: at least that many
        if not f.free:
            return
        elapsed = now - f.dispatched
        tokens = f.prompt_tokens + f.pending
        fitted = self.fit.predict(tokens, f.ahead)
        trusted = self.fit.count >= MIN_FIT_SAMPLES
        queued = trusted and elapsed > QUEUE_FACTOR * f.expected + QUEUE_MARGIN
        if queued and learn:  # sent to a presumed free slot, it waited: no more than that
            guess = f.occupancy if self.slots_guess is None else self.slots_guess
            self.slots_guess = max(1, min(guess, f.occupancy))
            self.guessed_at = now
            return
        if trusted and fitted > 0 and PACE_SAMPLES:
            # What the next request sent to a free slot will likely take: a request that
            # seemed to wait counts too, as a worker 3x slower looks the same.
            self.ratios.append(elapsed / fitted)
            if elapsed <= fitted:
                self.slowed = False
            else:
                self._latch()
        if not queued:
            self.fit.add(tokens, elapsed, f.ahead)
            seconds, count = self.since_fit
            if count >= STEP_MIN:  # the step the fit learnt at
                self.step_base.add(seconds / count)
                self.since_fit = [0.0, 0]

    def tokens(self, key: Hashable, now: float, count: int) -> None:
        """``count`` more generated tokens of ``key``'s stream reached the router at ``now``
        (after its first byte): the time since its last ones is the engine's step."""
        f = self.flights.get(key)
        if f is None or f.first_byte is None or count <= 0:
            return
        last = f.first_byte if f.last_token is None else f.last_token
        f.last_token = now
        gap = max(0.0, now - last)
        if len(self.gaps) == self.gaps.maxlen:
            old_gap, old_count = self.gaps[0]
            self.gap_seconds -= old_gap
            self.gap_tokens -= old_count
        self.gaps.append((gap, count))
        self.gap_seconds += gap
        self.gap_tokens += count
        self.since_fit[0] += gap
        self.since_fit[1] += count
        self._latch()

    def _latch(self) -> None:
        """Latch ``slowed`` when the step shows the engine slowed and its prompts agree: the
        middle of the last ``PACE_SAMPLES`` free-slot ratios is ``STEP_TRIGGER`` or more (the
        module's rule). An engine whose step grows with its batch, its prompts on time, is
        not latched."""
        r = self.ratios
        if self.slowed or len(r) < (r.maxlen or 0) or self.step_pace() <= 1.0:
            return
        if sorted(r)[len(r) // 2] >= STEP_TRIGGER:
            self.slowed = True

    def step(self) -> float | None:
        """The engine's step now: the time per token of the recent chunks (None: fewer than
        ``STEP_MIN`` tokens)."""
        if self.gap_tokens < STEP_MIN:
            return None
        return max(0.0, self.gap_seconds) / self.gap_tokens

    def step_pace(self) -> float:
        """How many times slower the engine's steps are now than when the fit learnt
        (the module's rule): from ``STEP_TRIGGER``, else 1."""
        step = self.step()
        base = self.step_base.get()
        if step is None or not base:
            return 1.0
        ratio = step / base
        return ratio if ratio >= STEP_TRIGGER else 1.0

    def ended(
        self,
        key: Hashable,
        now: float,
        output_tokens: int | None = None,
        completed: bool = False,
    ) -> None:
        """``key``'s stream ended (or failed, or the client left) at ``now``. ``completed``:
        a response whose first token was never seen (not streamed) finished normally: the
        time from its dispatch is the time it held a slot."""
        f = self.flights.pop(key, None)
        if f is None:
            return
        if f.first_byte is None:
            if completed:  # a whole non-streamed response: prefill and decode
                self.kv_delta -= 1
                self._slot_time(max(0.0, now - f.dispatched))
            return  # else it never started generating: no service time to learn
        self.kv_delta -= 1
        self.streaming -= 1
        decode = max(0.0, now - f.first_byte)
        self._slot_time(decode + self.fit.predict(f.prompt_tokens))
        if output_tokens:
            self.decode_per_token.add(decode / output_tokens)

    def _slot_time(self, seconds: float) -> None:
        self.service.add(seconds)
        self.slot_times.append(seconds)
        self._survival = None

    def pace(self) -> float:
        """How many times the fit's prefill the worker takes now (the module's rule): the
        smallest ratio of measured to fitted of the last ``PACE_SAMPLES`` free-slot
        requests when each took longer than fitted, or the engine's step pace, whichever is
        larger; once the step pace showed the worker slowed and until a free-slot request is
        back on time, their middle ratio if larger still; else 1."""
        r = self.ratios
        step = self.step_pace()
        if not r or len(r) < (r.maxlen or 0):
            return step
        if self.slowed or step > 1.0:  # the engine as a whole slowed: its prefill at least
            return max(step, sorted(r)[len(r) // 2])
        return max(1.0, min(r))

    def prefill(self, tokens: float, ahead: float = 0.0) -> float:
        """The predicted prefill of ``tokens`` here now, with ``ahead`` seconds of other
        requests' prefill still to run before its first token: the fit at the worker's pace
        (the seconds ahead are predictions at that pace already)."""
        fit = self.fit
        return fit.predict(tokens) * self.pace() + fit.serial * ahead

    def survival(self) -> Survival | None:
        """How long the recent requests held a slot, smoothed (``core/slot_wait.py``);
        None: no request ended yet."""
        if self._survival is None and self.slot_times:
            self._survival = Survival(self.slot_times)
        return self._survival

    def running(self, now: float) -> list[tuple[float, Survival]]:
        """Each running request's age with this worker's survival (empty: none ended
        yet, so nothing is known of how long they run)."""
        s = self.survival()
        return [] if s is None else [(age, s) for age in self.ages(now)]

    def load(
        self,
        waiting: int | None = None,
        active: int | None = None,
        total: int | None = None,
        kv_blocks: int | None = None,
        kv_total: int | None = None,
    ) -> None:
        """A load report from the engine (each field None when not reported); ``kv_blocks``
        and ``kv_total``: the KV cache blocks in use and in all."""
        self.waiting, self.active = waiting, active
        self.total_slots = total or None
        self.kv_total = kv_total or None
        self.kv_used, self.kv_delta = kv_blocks, 0
        if active and kv_blocks:
            self.blocks_per_running.add(kv_blocks / active)
        if self.total_slots is None and active and self.slots_guess is not None:
            self.slots_guess = max(self.slots_guess, active)  # seen running at once
        if waiting is None and active is None:
            self.extra = 0
        else:
            self.extra = max(0, (waiting or 0) + (active or 0) - len(self.flights))

    def engine_ttft(self, buckets: Sequence[tuple[float, int]]) -> None:
        """The engine's TTFT histogram delta of one load report: (upper bound s, count);
        each request counts at its bucket's upper bound (an infinite bound is skipped)."""
        for bound, count in buckets:
            if math.isfinite(bound):
                for _ in range(min(count, EWMA_SAMPLES)):
                    self.engine_ttft_s.add(bound)

    # ----- derived state --------------------------------------------------------------

    @property
    def gateway_only(self) -> bool:
        """No slot count and no waiting count reported: predicted from the router's timings."""
        return self.total_slots is None and self.waiting is None

    def occupancy(self) -> int:
        """Requests the worker holds now: the router's in flight plus the engine's others."""
        return len(self.flights) + self.extra

    def slots(self, now: float) -> int | None:
        """How many requests run at once; None: no limit seen yet. An engine that reports
        requests waiting while fewer than its slots run (vLLM short of KV cache) runs no
        more than it runs now."""
        if self.total_slots is not None:
            kv = self.kv_slots()
            if kv is not None:
                slots = min(self.total_slots, kv)
                room = self.kv_room()
                if room is None:
                    return slots
                # What it runs now (its occupancy less what it keeps waiting) and one more
                # per block free: none when a request would wait at the engine for blocks.
                return min(slots, max(1, self.occupancy() - (self.waiting or 0) + room))
            if self.waiting and self.active is not None:
                return max(1, min(self.total_slots, self.active))
            return self.total_slots
        if self.slots_guess is None:
            return None
        probe = 1 if now - self.guessed_at >= PROBE_EVERY else 0
        return self.slots_guess + probe

    def kv_slots(self) -> int | None:
        """How many requests the KV cache runs at once: its blocks over the blocks a running
        request holds on average (None: not reported, or nothing seen running yet)."""
        per = self.blocks_per_running.get()
        if not self.kv_total or not per:
            return None
        return max(1, int(self.kv_total / per))

    def kv_room(self) -> int | None:
        """KV blocks free for new requests: free at the last report, less one per request
        sent since, plus one per request ended since (None: the cache is not reported)."""
        if not self.kv_total or self.kv_used is None:
            return None
        return self.kv_total - self.kv_used - self.kv_delta - KV_ASIDE

    def free_slots(self, now: float) -> int | None:
        """Slots free for another request now (what :func:`~extproc.core.held.fill_slots`
        takes per worker); None: no limit seen yet."""
        slots = self.slots(now)
        return None if slots is None else max(0, slots - self.occupancy())

    def rate(self, now: float) -> float | None:
        """Requests a full worker completes per second; None: not measured yet."""
        service = self.service.get()
        slots = self.slots(now) if self.total_slots is not None else self.slots_guess
        if not service or slots is None:
            return None
        return slots / service

    def ages(self, now: float) -> list[float]:
        """How long each request running on the worker now has held its slot (the
        module's rule): the router's in flight in dispatch order, as many as run (the
        others wait at the engine), then the engine's others, taken as just started."""
        slots = self.slots(now)
        running = self.occupancy() if slots is None else min(slots, self.occupancy())
        out: list[float] = []
        for f in self.flights.values():  # in dispatch order
            if len(out) >= running:
                break
            if f.first_byte is not None:
                out.append(max(0.0, now - f.first_byte) + self.fit.predict(f.prompt_tokens))
            elif f.free:
                out.append(max(0.0, now - f.dispatched))
            else:
                out.append(0.0)  # it waited for a slot at the engine: its start is unknown
        out.extend([0.0] * (running - len(out)))
        return out

    def rate_now(self, now: float) -> float | None:
        """Requests a full worker is expected to complete per second from now, given how
        long its running requests have run (the module's rule): each running request frees
        its slot at ``1 / service``, or at ``1 / age`` once its age is past every recent
        slot time. None: not measured yet."""
        rate = self.rate(now)
        service = self.service.get()
        if rate is None or not service or not self.slot_times:
            return rate
        longest = max(self.slot_times)
        hazard = sum(1.0 / age if age > longest else 1.0 / service for age in self.ages(now))
        return min(rate, hazard) if hazard > 0 else rate

    def pending(self, now: float) -> tuple[int, float]:
        """The requests started here and not yet at their first token: their prompt tokens,
        and the seconds of their predicted prefill still to run (none past its prediction)."""
        slots = self.slots(now)
        room = len(self.flights) if slots is None else max(0, slots - self.streaming)
        total = 0
        ahead = 0.0
        for f in self.flights.values():  # in dispatch order
            if room <= 0:
                break
            if f.first_byte is None:
                total += f.prompt_tokens
                ahead += max(0.0, f.expected - (now - f.dispatched))
                room -= 1
        return total, ahead

    @property
    def missing(self) -> tuple[str, ...]:
        """The inputs this worker's prediction goes without, by name."""
        out = []
        if self.waiting is None:
            out.append(WAITING)
        if self.active is None:
            out.append(ACTIVE)
        if self.total_slots is None:
            out.append(TOTAL)
        if not self.engine_ttft_s.count:
            out.append(ENGINE_TTFT)
        if not self.service.count:
            out.append(COMPLETIONS)
        if self.fit.count < MIN_FIT_SAMPLES:
            out.append(PREFILL)
        if not self.gateway.count:
            out.append(GATEWAY)
        return tuple(out)

    def idle_ttft(self, prompt_tokens: int) -> float:
        """What an idle worker is measured to take for this prompt: prefill and gateway."""
        return self.prefill(prompt_tokens) + (self.gateway.get() or 0.0)

    def view(self, now: float, target_s: float | None = None) -> dict[str, object]:
        """Diagnostics for /debug/workers (times in ms)."""
        typical = round(self.prompt_tokens.get() or 0)
        p = predict_ttft(self, typical, 0, now)
        rate = self.rate(now)
        rate_now = self.rate_now(now)
        ages = self.ages(now)
        idle = self.idle_ttft(typical)
        out: dict[str, object] = {
            "predicted_wait_ms": None if p.wait is None else round(p.wait * 1000, 1),
            "predicted_ttft_ms": None if p.ttft is None else round(p.ttft * 1000, 1),
            "prefill_ms_per_1k_tokens": round(self.fit.cost * 1000, 3),
            "prefill_overhead_ms": round(self.fit.overhead * 1000, 1),
            "prefill_serial": round(self.fit.serial, 3),
            "prefill_pace": round(self.pace(), 3),
            "step_ms": None if (step := self.step()) is None else round(step * 1000, 2),
            "step_pace": round(self.step_pace(), 3),
            "slowed": self.slowed,
            "prefill_spread_ms": round(
                PREFILL_MARGIN * (self.fit.abs_residual.get() or 0.0) * 1000, 1
            ),
            "completion_rate_per_s": None if rate is None else round(rate, 3),
            "completion_rate_now_per_s": None if rate_now is None else round(rate_now, 3),
            "oldest_running_ms": round(max(ages) * 1000, 1) if ages else None,
            "service_ms": None if not self.service.count else round(self.service.value * 1000, 1),
            "gateway_delay_ms": round((self.gateway.get() or 0.0) * 1000, 1),
            "slots": self.slots(now),
            "kv_slots": self.kv_slots(),
            "kv_room_blocks": self.kv_room(),
            "occupancy": self.occupancy(),
            "in_flight": len(self.flights),
            "streaming": self.streaming,
            "typical_prompt_tokens": typical,
            "idle_ttft_ms": round(idle * 1000, 1),
            "engine_ttft_ms": (
                None if not self.engine_ttft_s.count else round(self.engine_ttft_s.value * 1000, 1)
            ),
            "from": "gateway timings alone" if self.gateway_only else "engine slots",
            "missing": list(self.missing),
        }
        if target_s is not None and idle > target_s:
            out["target"] = f"target unreachable: an idle worker takes {idle * 1000:.0f} ms"
        return out


@dataclass(frozen=True, slots=True)
class Prediction:
    """One worker's predicted TTFT for one request, with its parts (seconds)."""

    worker: str
    ttft: float | None  # None: the wait is unknown (full, and no rate measured yet)
    wait: float | None
    prefill: float
    gateway: float
    ahead: float  # requests ahead of it in line for a slot (0 when one is free for it)
    can_start: bool  # a slot is free on this worker now
    idle: float  # what an idle worker takes for this prompt: prefill + gateway, no wait
    wait_spread: float = 0.0  # the wait's 90th percentile less its mean
    prefill_spread: float = 0.0  # PREFILL_MARGIN mean absolute residuals of the prefill fit
    wait_low: float = 0.0  # the wait's mean less its 10th percentile
    gateway_only: bool = False
    missing: tuple[str, ...] = ()
    occupancy: int = 0  # requests the worker holds now (its in flight and the engine's others)

    @property
    def spread(self) -> float:
        """Added to ``ttft``: the bound admission judges a request on."""
        return self.wait_spread + self.prefill_spread


def predict_ttft(
    est: WorkerEstimate,
    prompt_tokens: int,
    held_ahead: float,
    now: float,
    first_slot: bool = True,
) -> Prediction:
    """The predicted TTFT of a request of ``prompt_tokens`` on ``est``'s worker with
    ``held_ahead`` requests held in the router before it (the module's formula);
    ``first_slot``: False when the caller predicts the first free slot itself."""
    slots = est.slots(now)
    occupancy = est.occupancy()
    can_start = slots is None or occupancy < slots
    gateway = est.gateway.get() or 0.0
    prefill_spread = PREFILL_MARGIN * (est.fit.abs_residual.get() or 0.0)
    wait_spread = wait_low = 0.0
    if slots is None or occupancy + held_ahead < slots:
        wait: float | None = 0.0
        ahead = 0.0
        pending, ahead = est.pending(now)
        prefill = est.prefill(prompt_tokens + pending, ahead)
    else:
        ahead = occupancy + held_ahead - slots
        rate = est.rate_now(now)
        wait = None if rate is None else (ahead + 1) / rate
        first = None
        if rate is not None and first_slot and ahead + 1 <= AGES_FOR:
            first = _nth_free(est.running(now), ahead + 1)
        if first is not None:  # the slot it frees for this one: from its requests' ages
            wait, wait_spread, wait_low = _spread(first)
        elif rate is not None:
            wait_spread = WAIT_Z * math.sqrt(ahead + 1) / rate
            wait_low = (ahead + 1 - gamma_low(ahead + 1)) / rate
        prefill = est.prefill(
            prompt_tokens + (est.shared.get() or 0.0), est.shared_ahead.get() or 0.0
        )
    return Prediction(
        est.worker,
        None if wait is None else wait + prefill + gateway,
        wait,
        prefill,
        gateway,
        ahead,
        can_start,
        est.prefill(prompt_tokens) + gateway,
        wait_spread,
        prefill_spread,
        wait_low,
        est.gateway_only,
        est.missing,
        occupancy,
    )


def gamma_low(n: float) -> float:
    """The 10th percentile of Gamma(n, 1) (the time of the n-th of completions at rate 1),
    by the Wilson-Hilferty approximation (within 7 % at n = 1, 0.3 % from n = 4)."""
    if n <= 0:
        return 0.0
    return n * max(0.0, 1.0 - 1.0 / (9.0 * n) - WAIT_Z / (3.0 * math.sqrt(n))) ** 3


@dataclass(frozen=True, slots=True)
class PoolWait:
    """When the full workers free the slot of a request with ``held_ahead`` requests held
    before it: at ``seconds``, after ``completions`` completions at ``rate`` in all."""

    seconds: float
    completions: float
    rate: float
    backlog: dict[str, float]  # the workers that free a slot by then, and their backlog


def pool_wait(estimates: Sequence[WorkerEstimate], held_ahead: int, now: float) -> PoolWait | None:
    """The wait of a request held behind ``held_ahead`` others for any of ``estimates``.

    A full worker first finishes the requests it holds beyond its slots (its backlog
    ``b``), then frees slots at its rate ``r``, and each freed slot takes the next held
    request; so by time ``T`` the workers have freed ``sum(max(0, r x T - b))`` slots, and
    the request's is the ``held_ahead + 1``-th, less the slots free now: with none held
    ahead, the first slot any of them frees. None when that is no wait at all (a worker
    never full, enough free slots) or no full worker has a measured rate."""
    need = float(max(0, held_ahead) + 1)
    lines: list[tuple[float, float, str]] = []  # (backlog, rate, worker) of the full workers
    for est in estimates:
        free = est.free_slots(now)
        if free is None:
            return None
        need -= free
        rate = est.rate_now(now)
        if not free and rate:
            lines.append((est.occupancy() - float(est.slots(now) or 0), rate, est.worker))
    if need <= 0 or not lines:
        return None
    # sum(max(0, r x T - b)) = need is piecewise linear and increasing in T: add the workers
    # in the order they start freeing slots for the held requests until T falls before the
    # next one starts.
    lines.sort(key=lambda brw: brw[0] / brw[1])
    sum_b = sum_r = 0.0
    t = math.inf
    used = 0
    for i, (b, r, _) in enumerate(lines):
        sum_b += b
        sum_r += r
        used = i + 1
        t = (need + sum_b) / sum_r
        if used == len(lines) or t <= lines[used][0] / lines[used][1]:
            break
    return PoolWait(t, need + sum_b, sum_r, {w: b for b, _, w in lines[:used]})


def predict_all(
    estimates: Sequence[WorkerEstimate], prompt_tokens: int, held_ahead: int, now: float
) -> list[Prediction]:
    """Every candidate's prediction for a request with ``held_ahead`` requests held before
    it. The held requests go to whichever worker frees a slot first (:func:`pool_wait`):
    a worker that frees one by the pool's wait is predicted at that wait (its spread from the
    completions the pool needs at its rate in all); the others at their own next free slot."""
    pool = pool_wait(estimates, held_ahead, now)
    first = None
    if pool is not None and pool.completions <= AGES_FOR + ROUNDING:
        # The slot they free for it, from the running requests' ages: when as many of them
        # have ended as there are requests ahead of it, held and waiting at the engines.
        full = [e for e in estimates if e.worker in pool.backlog]
        first = _nth_free([r for e in full for r in e.running(now)], pool.completions)
    out = []
    for est in estimates:
        if pool is None or est.worker not in pool.backlog:
            out.append(predict_ttft(est, prompt_tokens, 0 if pool else held_ahead, now))
            continue
        p = predict_ttft(est, prompt_tokens, 0, now, first_slot=False)  # its wait: the pool's
        wait = pool.seconds
        spread = WAIT_Z * math.sqrt(pool.completions) / pool.rate
        low = (pool.completions - gamma_low(pool.completions)) / pool.rate
        if first is not None:
            wait, spread, low = _spread(first)
        out.append(
            replace(
                p,
                ttft=wait + p.prefill + p.gateway,
                wait=wait,
                ahead=pool.backlog[est.worker] + held_ahead,
                wait_spread=spread,
                wait_low=low,
            )
        )
    return out


def _nth_free(running: list[tuple[float, Survival]], n: float) -> FirstFree | None:
    """When the ``n``-th of the running requests ends (None: ``n`` is not a whole number,
    or more than run: the later slots depend on requests not started yet)."""
    whole = round(n)
    if abs(n - whole) > ROUNDING or not 1 <= whole <= min(AGES_FOR, len(running)):
        return None
    return nth_free(running, whole)


def _spread(first: FirstFree) -> tuple[float, float, float]:
    """A wait's median, its 90th percentile less that, that less its 10th."""
    mid = first.median
    return mid, max(0.0, first.high - mid), max(0.0, mid - first.low)


# ----- the decision ------------------------------------------------------------------------


@dataclass(frozen=True, slots=True)
class Dispatch:
    """Send the request to ``worker`` now."""

    worker: str
    prediction: Prediction


@dataclass(frozen=True, slots=True)
class Hold:
    """Hold the request in the router until a slot frees on one of ``workers`` (those
    predicted to fit); ``worker``: the one predicted to free first; ``deadline``: the latest
    dispatch that still meets the target on any of them."""

    worker: str
    wait: float
    deadline: float
    workers: frozenset[str] = frozenset()
    # A request of the best class (judged on its mean): the deadline it is served by among
    # the held requests, the one its prediction's spread would give it, as every other
    # request's deadline counts it. None: served by ``deadline``.
    order: float | None = None


@dataclass(frozen=True, slots=True)
class Reject:
    """Answer the overload reply now: no worker gives a first token within the target.
    ``wait``: the smallest predicted wait (None: unknown); ``unreachable``: even an idle
    worker takes longer than the target for this request."""

    wait: float | None
    unreachable: bool = False
    idle: float | None = None  # the smallest idle TTFT, for the message
    yielded: bool = False  # a retry refused while first attempts are (it could fit)

    @property
    def retry_after(self) -> int:
        """``Retry-After``: the wait in whole seconds, rounded up, 1-60 (1 when unknown)."""
        if self.wait is None:
            return 1
        return max(1, min(MAX_RETRY_AFTER, math.ceil(self.wait - ROUNDING)))

    @property
    def retry_after_ms(self) -> int:
        """``retry-after-ms``: the same wait in milliseconds, rounded up, at least 1 (1000
        when unknown), at most the ``Retry-After`` ceiling."""
        if self.wait is None:
            return 1000
        return max(1, min(MAX_RETRY_AFTER * 1000, math.ceil(self.wait * 1000 - ROUNDING)))


Decision = Dispatch | Hold | Reject


def decide(
    predictions: Sequence[Prediction],
    target_s: float,
    now: float,
    arrived: float | None = None,
    lenient: bool = False,
) -> Decision:
    """Dispatch, hold or reject one request against its TTFT target (the module's rule).

    ``predictions``: one per candidate worker (not busy by the thresholds, which stay
    ceilings); ``arrived``: when the request reached the router (default ``now``), from
    which its deadline counts; ``lenient``: judged on the mean prediction, without its
    spread (a request of the best class, when lesser ones share the pool). Ties go to the
    first candidate."""
    if not predictions:
        raise ValueError("predictions: empty; expected at least one candidate worker")
    if not target_s > 0:
        raise ValueError(f"target_s: {target_s!r}; expected a number > 0")
    spreads = {p.worker: p.spread for p in predictions}
    prefill_spreads = {p.worker: p.prefill_spread for p in predictions}
    if lenient:
        predictions = [replace(p, wait_spread=0.0, prefill_spread=0.0) for p in predictions]
    start = now if arrived is None else arrived
    left = target_s - (now - start)  # what remains of the target
    fits = [p for p in predictions if p.ttft is not None and p.ttft + p.spread <= left]
    now_fits = [p for p in fits if p.can_start and p.wait == 0]
    if now_fits:
        # Predictions within the smallest one's spread of it are the same to the predictor:
        # of those, the worker holding the fewest requests gets it (the module's rule).
        best = min(now_fits, key=_ttft)
        near = _ttft(best) + spreads.get(best.worker, 0.0)
        best = min((p for p in now_fits if _ttft(p) <= near), key=lambda p: (p.occupancy, _ttft(p)))
        return Dispatch(best.worker, best)
    if fits:
        # Held for the workers on which it still fits if the slot comes late (at the wait's
        # upper bound), until the latest dispatch that fits on the slowest of them.
        best = min(fits, key=_ttft)
        wait = best.wait or 0.0
        slot_by = now + wait + best.wait_spread
        ends = [(p.prefill + p.gateway + p.prefill_spread, p.worker) for p in fits]
        workers = [(cost, w) for cost, w in ends if slot_by + cost <= start + target_s]
        slowest = max(cost for cost, _ in workers)
        deadline = start + target_s - slowest
        order = None
        if lenient:  # served by the deadline its spread would give it
            order = start + target_s - max(cost + prefill_spreads[w] for cost, w in workers)
        return Hold(best.worker, wait, deadline, frozenset(w for _, w in workers), order)
    idle = min(p.idle for p in predictions)
    waits = [p.wait for p in predictions if p.wait is not None]
    if not waits:
        return Reject(None, idle > left, idle)
    # When to come back: not before a slot frees (the wait), and not before the work ahead
    # has drained by what the prediction exceeds the target (a free slot with a long prefill
    # queue ahead has a wait of 0, and a retry 1 ms later would be refused the same way).
    excess = min(p.ttft - left for p in predictions if p.ttft is not None)
    return Reject(max(min(waits), excess), idle > left, idle)


def still_fits(
    predictions: Sequence[Prediction], target_s: float, now: float, arrived: float
) -> bool:
    """Whether a held request (``arrived`` at the router) may still get a first token within
    its target on some worker: the 10th percentile of its predicted wait, with its prefill
    and the gateway, fits what is left (the module's rule). False: it misses 9 times in 10;
    answer it now rather than at its deadline."""
    left = target_s - (now - arrived)
    return any(p.ttft is not None and p.ttft - p.wait_low <= left for p in predictions)


def fits_now(
    est: WorkerEstimate,
    prompt_tokens: int,
    target_s: float,
    arrived: float,
    now: float,
    lenient: bool = False,
) -> bool:
    """Whether a held request (``arrived`` at the router) sent now to a free slot of
    ``est``'s worker still gets its first token within its target: its prefill there now
    (with the prefill of the requests started before it and not yet at their first token, at
    the worker's pace), the gateway and, unless ``lenient``, the prefill's spread, as a
    request dispatched on arrival is judged."""
    p = predict_ttft(est, prompt_tokens, 0, now)
    spread = 0.0 if lenient else p.prefill_spread
    return now + p.prefill + p.gateway + spread <= arrived + target_s


def _ttft(p: Prediction) -> float:
    return math.inf if p.ttft is None else p.ttft
