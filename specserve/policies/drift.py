"""Acceptance drift and the speedup a replica is getting now: change points per drafter and draft position.

:class:`DriftMonitor` is fed every finished request's cycles (:class:`~specserve.core.schedule.CycleObservation`)
with the drafter that drafted them, and keeps per drafter:

* **Acceptance by position, smoothed.** For draft position i (a tree's depth), the acceptance of i given every
  earlier one was accepted — the Bernoulli outcomes ``accept_flags`` gives — as an exponentially weighted mean
  with a half-life of :data:`RATE_HALF_LIFE` outcomes (the gauge ``specserve_acceptance_rate``).
* **A change-point test** per position (:class:`BernoulliCusum`): a two-sided CUSUM of the log-likelihood ratio
  between the replica's own reference rate p0 and p0 ∓ :data:`SHIFT`. The reference is the mean of the first
  :data:`WARMUP` outcomes, then a slow average (half-life :data:`REFERENCE_HALF_LIFE`) that moves only while
  neither sum has built up to half the threshold, so a sudden change is not absorbed before it is seen. A sum
  past :data:`THRESHOLD` is a drift event (a side whose alternative would leave [0.01, 0.99] is not tested: a
  drafter accepted 5 % of the time cannot fall by 0.15) (``down``: the drafter got worse); the test then learns the new
  level from scratch (another warm-up). With these constants, steady streams raised no event in 300 runs of
  5,000 outcomes (100 each at p = 0.3, 0.6 and 0.9: a false-alarm rate below 1 % per 5,000 outcomes at 95 %
  confidence), and a fall from 0.7 to 0.3 is caught after 55 outcomes at the median (from 0.6 to 0.01: 37);
  ``tests/policies/test_drift.py`` measures both.
* **The draft budget the policy chooses**, smoothed the same way (the adaptive policy drafts less when
  acceptance falls: the gauge ``specserve_draft_budget`` shows it happen).
* **The speedup over plain decoding, from the replica's own measured costs**: committed tokens per second of
  this drafter's cycles — E[accepted + 1] / E[draft + verify + wire seconds], smoothed over
  :data:`SPEEDUP_HALF_LIFE` cycles — times the time of a plain step at the cycles' mean batch size, T_step(B),
  from a :class:`~specserve.policies.step_costs.StepCostEstimator` that every cycle of every drafter feeds (a
  plain step computes B positions; measured whenever the replica decoded plainly, else extrapolated along the
  curve of the steps it did measure). On a batched replica the price is the whole step's: a request's
  speculation also makes its neighbours' steps longer, which this ratio counts.

Thread-safe (one lock). Does not: export metrics (the serving layer does), choose budgets, or read a clock.
"""

from __future__ import annotations

import math
import threading
from collections import deque
from collections.abc import Iterable
from dataclasses import dataclass

from specserve.core.schedule import CycleObservation
from specserve.policies.prior import decay_factor
from specserve.policies.step_costs import StepCostEstimator

SHIFT = 0.15  # the change (absolute acceptance) the test is tuned to detect
THRESHOLD = 12.0  # CUSUM decision threshold (log-likelihood ratio)
WARMUP = 300  # outcomes that set a reference, at the start and after each event
REFERENCE_HALF_LIFE = 1000.0  # outcomes
RATE_HALF_LIFE = 50.0  # outcomes: the smoothed rate the gauge shows
SPEEDUP_HALF_LIFE = 200.0  # cycles
MAX_POSITIONS = 16  # draft positions tested per drafter
MAX_EVENTS = 100  # drift events the monitor remembers
_CLAMP = 0.01  # rates are kept in [0.01, 0.99]; a side whose alternative falls outside is not tested


@dataclass(frozen=True)
class DriftEvent:
    drafter: str
    position: int  # draft position (0 = the first draft token)
    direction: str  # "down" (acceptance fell) or "up"
    outcomes: int  # outcomes at this position since the reference was set
    total: int  # outcomes at this position since the monitor started (this one included)
    reference: float  # the rate before
    rate: float  # the smoothed rate now


class _Ewma:
    def __init__(self, half_life: float) -> None:
        self.decay = decay_factor(half_life)
        self.weight = 0.0
        self.total = 0.0

    def add(self, value: float) -> None:
        self.weight = self.weight * self.decay + 1.0
        self.total = self.total * self.decay + value

    @property
    def value(self) -> float | None:
        return self.total / self.weight if self.weight > 0 else None


class BernoulliCusum:
    """A two-sided CUSUM for a change in a Bernoulli rate, against a reference learnt from the stream."""

    def __init__(
        self,
        shift: float = SHIFT,
        threshold: float = THRESHOLD,
        warmup: int = WARMUP,
        reference_half_life: float = REFERENCE_HALF_LIFE,
    ) -> None:
        self.shift = shift
        self.threshold = threshold
        self.warmup = warmup
        self.reference_decay = decay_factor(reference_half_life)
        self.rate = _Ewma(RATE_HALF_LIFE)
        self.total = 0  # outcomes ever
        self._restart()

    def _restart(self) -> None:
        self.seen = 0  # outcomes since the reference was (re)started
        self._sum = 0.0
        self.reference: float | None = None
        self.down = 0.0
        self.up = 0.0

    def update(self, accepted: bool) -> str | None:
        """One outcome; returns ``"down"`` or ``"up"`` when it completes a change point, else ``None``."""
        x = 1.0 if accepted else 0.0
        self.rate.add(x)
        self.total += 1
        self.seen += 1
        if self.reference is None:
            self._sum += x
            if self.seen >= self.warmup:
                self.reference = self._sum / self.seen
            return None
        p0 = min(max(self.reference, _CLAMP), 1 - _CLAMP)
        if p0 - self.shift > _CLAMP:  # a fall by `shift` is possible (below it, there is nothing to fall by)
            self.down = max(0.0, self.down + _llr(x, p0, p0 - self.shift))
        if p0 + self.shift < 1 - _CLAMP:
            self.up = max(0.0, self.up + _llr(x, p0, p0 + self.shift))
        if self.down > self.threshold or self.up > self.threshold:
            direction = "down" if self.down > self.threshold else "up"
            self._restart()
            return direction
        if max(self.down, self.up) < self.threshold / 2:  # no change building up: the reference follows slowly
            self.reference = self.reference * self.reference_decay + x * (1 - self.reference_decay)
        return None


def _llr(x: float, p0: float, p1: float) -> float:
    """log P(x | p1) / P(x | p0) for one Bernoulli outcome."""
    return math.log(p1 / p0) if x else math.log((1 - p1) / (1 - p0))


class _DrafterState:
    def __init__(self) -> None:
        self.tests: list[BernoulliCusum] = []
        self.budget = _Ewma(RATE_HALF_LIFE)
        self.tokens = _Ewma(SPEEDUP_HALF_LIFE)
        self.seconds = _Ewma(SPEEDUP_HALF_LIFE)
        self.batch = _Ewma(SPEEDUP_HALF_LIFE)


@dataclass(frozen=True)
class DrafterView:
    """What the monitor knows of one drafter now."""

    rates: tuple[float | None, ...]  # smoothed acceptance by position
    budget: float | None  # smoothed budget the policy chose per cycle
    speedup: float | None  # tokens/s over plain decoding's, from measured costs


class DriftMonitor:
    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._drafters: dict[str, _DrafterState] = {}
        self.steps = StepCostEstimator()  # T_step(N) of the replica's target: plain steps are N = batch size
        self.events: deque[DriftEvent] = deque(maxlen=MAX_EVENTS)  # the latest, newest last

    def observe(self, drafter: str, observations: Iterable[CycleObservation]) -> list[DriftEvent]:
        """One request's cycles, drafted by ``drafter`` (``"none"``: plain decoding, which feeds only the step
        costs); returns the drift events they completed."""
        events: list[DriftEvent] = []
        with self._lock:
            state = self._drafters.get(drafter) if drafter != "none" else None
            if state is None and drafter != "none":
                state = self._drafters[drafter] = _DrafterState()
            for obs in observations:
                self.steps.observe(max(obs.positions, 1), obs.verify_seconds)
                if state is None:
                    continue
                state.budget.add(obs.budget.nodes)
                state.tokens.add(obs.accepted + 1)
                state.seconds.add(obs.draft_seconds + obs.verify_seconds + obs.wire_seconds)
                state.batch.add(obs.batch_size)
                for position, accepted in enumerate(obs.accept_flags[:MAX_POSITIONS]):
                    while len(state.tests) <= position:
                        state.tests.append(BernoulliCusum())
                    test = state.tests[position]
                    reference, seen = test.reference, test.seen
                    direction = test.update(accepted)
                    if direction is not None:
                        rate = test.rate.value
                        event = DriftEvent(
                            drafter, position, direction, seen + 1, test.total, reference or 0.0, rate or 0.0
                        )
                        events.append(event)
                        self.events.append(event)
        return events

    def outcomes(self, drafter: str, position: int) -> int:
        """Outcomes seen at a drafter's draft position since the monitor started."""
        with self._lock:
            state = self._drafters.get(drafter)
            return state.tests[position].total if state is not None and position < len(state.tests) else 0

    def view(self, drafter: str) -> DrafterView:
        with self._lock:
            state = self._drafters.get(drafter)
            if state is None:
                return DrafterView((), None, None)
            tokens, seconds, batch = state.tokens.value, state.seconds.value, state.batch.value
            speedup = None
            if tokens is not None and seconds and batch is not None:
                speedup = tokens / seconds * self.steps.t_step(max(1, round(batch)))
            return DrafterView(tuple(t.rate.value for t in state.tests), state.budget.value, speedup)

    @property
    def drafters(self) -> list[str]:
        with self._lock:
            return sorted(self._drafters)
