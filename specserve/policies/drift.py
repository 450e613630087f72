"""Acceptance drift and the speedup a replica is getting now: change points per drafter and draft position.

:class:`DriftMonitor` is fed every finished request's cycles (:class:`~specserve.core.draft.schedule.CycleObservation`)
with the drafter that drafted them, and keeps per drafter:

* **Acceptance by position, smoothed.** For draft position i (a tree's depth), the acceptance of i given every
  earlier one was accepted — the Bernoulli outcomes ``accept_flags`` gives — as an exponentially weighted mean
  with a half-life of :data:`RATE_HALF_LIFE` outcomes (the gauge ``specserve_acceptance_rate``).
* **A change-point test** per position (:class:`RequestCusum`), on each request's own acceptance rate there (a
  request counts once its cycles reached the position :data:`MIN_REACHED` times). Outcomes are not independent:
  a hard prompt's cycles fail together, and a request's cycles arrive together when it finishes, so a test on
  single outcomes mistakes a run of hard prompts for a change. Per request, the rate varies by prompt and by
  chance, and the replica's own history says by how much: the reference is the mean and spread of the first
  :data:`WARMUP` requests' rates, then slow averages of them (half-life :data:`REFERENCE_HALF_LIFE` requests)
  that move only while no change is building up. A two-sided tabular CUSUM of the standardised rates with
  allowance :data:`SLACK` and threshold :data:`THRESHOLD` (standard deviations) raises a drift event (``down``:
  the drafter got worse), and the test then learns the new level afresh (another warm-up). Measured on seeded
  simulated traffic (``tests/policies/test_drift.py``: prompts whose acceptance varies, binomial outcomes):
  see there and docs/monitoring.md for the false-alarm rate and the delays.
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
import statistics
import threading
from collections import deque
from collections.abc import Iterable
from dataclasses import dataclass

from specserve.core.draft.schedule import CycleObservation
from specserve.policies.prior import decay_factor
from specserve.policies.step_costs import StepCostEstimator

SLACK = 0.5  # the CUSUM's allowance k, in standard deviations of a request's rate: it targets shifts of 2k = 1 sd
THRESHOLD = 12.0  # the decision threshold h, in standard deviations
CLIP = 2.0  # standardised rates are clipped to [-2, 2]: per-request rates are skewed (a few hard prompts)
WARMUP = 50  # requests that set a reference (mean and spread), at the start and after each event
REFERENCE_HALF_LIFE = 200.0  # requests
MIN_REACHED = 4  # a request counts at a position once its cycles reached it this often
MIN_SD = 0.02  # the spread's floor (a drafter accepted always, or never, still has a scale)
RATE_HALF_LIFE = 50.0  # outcomes: the smoothed rate the gauge shows
SPEEDUP_HALF_LIFE = 200.0  # cycles
MAX_POSITIONS = 16  # draft positions tested per drafter
MAX_EVENTS = 100  # drift events the monitor remembers


@dataclass(frozen=True)
class DriftEvent:
    drafter: str
    position: int  # draft position (0 = the first draft token)
    direction: str  # "down" (acceptance fell) or "up"
    requests: int  # requests tested at this position since the reference was set (this one included)
    total: int  # requests tested at this position since the monitor started
    cycles: int  # the drafter's drafting cycles since the monitor started
    reference: float  # the mean per-request rate before
    rate: float  # the smoothed rate now (per outcome)


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


class RequestCusum:
    """A two-sided tabular CUSUM on per-request acceptance rates, standardised by the replica's own history."""

    def __init__(
        self,
        slack: float = SLACK,
        threshold: float = THRESHOLD,
        warmup: int = WARMUP,
        reference_half_life: float = REFERENCE_HALF_LIFE,
        clip: float = CLIP,
    ) -> None:
        self.clip = clip
        self.slack = slack
        self.threshold = threshold
        self.warmup = warmup
        self.reference_decay = decay_factor(reference_half_life)
        self.total = 0  # requests ever
        self._restart()

    def _restart(self) -> None:
        self.seen = 0  # requests since the reference was (re)started
        self._warm: list[float] = []
        self.mean: float | None = None
        self.variance = 0.0
        self.down = 0.0
        self.up = 0.0

    @property
    def sd(self) -> float:
        return max(math.sqrt(self.variance), MIN_SD)

    def update(self, rate: float) -> str | None:
        """One request's acceptance rate at this position; ``"down"`` or ``"up"`` when it completes a change point."""
        self.total += 1
        self.seen += 1
        if self.mean is None:
            self._warm.append(rate)
            if len(self._warm) >= self.warmup:
                self.mean = statistics.fmean(self._warm)
                self.variance = statistics.pvariance(self._warm, self.mean)
            return None
        z = min(max((rate - self.mean) / self.sd, -self.clip), self.clip)  # one odd prompt moves the sums little
        self.down = max(0.0, self.down - z - self.slack)
        self.up = max(0.0, self.up + z - self.slack)
        if self.down > self.threshold or self.up > self.threshold:
            direction = "down" if self.down > self.threshold else "up"
            self._restart()
            return direction
        if max(self.down, self.up) < self.threshold / 2:  # no change building up: the reference follows slowly
            keep = self.reference_decay
            deviation = rate - self.mean
            self.mean += (1 - keep) * deviation
            self.variance = keep * (self.variance + (1 - keep) * deviation * deviation)
        return None


class _DrafterState:
    def __init__(self) -> None:
        self.tests: list[RequestCusum] = []  # by position
        self.rates: list[_Ewma] = []  # by position, per outcome
        self.cycles = 0  # drafting cycles seen
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
    tokens_per_cycle: float | None = None  # smoothed tokens committed per cycle: the speedup's count, no clock in it


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
            reached: list[int] = []  # this request's outcomes by position
            accepted: list[int] = []
            for obs in observations:
                self.steps.observe(max(obs.positions, 1), obs.verify_seconds)
                if state is None:
                    continue
                state.cycles += obs.drafted > 0
                state.budget.add(obs.budget.nodes)  # 0 when the policy chose plain decoding for the cycle
                state.tokens.add(obs.accepted + 1)
                state.seconds.add(obs.draft_seconds + obs.verify_seconds + obs.wire_seconds)
                state.batch.add(obs.batch_size)
                for position, flag in enumerate(obs.accept_flags[:MAX_POSITIONS]):
                    if position == len(reached):
                        reached.append(0)
                        accepted.append(0)
                    while len(state.rates) <= position:
                        state.rates.append(_Ewma(RATE_HALF_LIFE))
                        state.tests.append(RequestCusum())
                    state.rates[position].add(float(flag))
                    reached[position] += 1
                    accepted[position] += flag
            if state is not None:
                for position, (n, k) in enumerate(zip(reached, accepted, strict=True)):
                    if n < MIN_REACHED:
                        continue
                    test = state.tests[position]
                    reference, seen = test.mean, test.seen
                    direction = test.update(k / n)
                    if direction is not None:
                        event = DriftEvent(
                            drafter, position, direction, seen + 1, test.total, state.cycles, reference or 0.0,
                            state.rates[position].value or 0.0,
                        )  # fmt: skip
                        events.append(event)
                        self.events.append(event)
        return events

    def tested(self, drafter: str, position: int) -> int:
        """Requests whose rate at ``position`` the change-point test has taken, since the monitor started."""
        with self._lock:
            state = self._drafters.get(drafter)
            return state.tests[position].total if state is not None and position < len(state.tests) else 0

    def cycles(self, drafter: str) -> int:
        """Drafting cycles of ``drafter`` seen since the monitor started."""
        with self._lock:
            state = self._drafters.get(drafter)
            return state.cycles if state is not None else 0

    def view(self, drafter: str) -> DrafterView:
        with self._lock:
            state = self._drafters.get(drafter)
            if state is None:
                return DrafterView((), None, None)
            tokens, seconds, batch = state.tokens.value, state.seconds.value, state.batch.value
            speedup = None
            if tokens is not None and seconds and batch is not None:
                speedup = tokens / seconds * self.steps.t_step(max(1, round(batch)))
            return DrafterView(tuple(r.value for r in state.rates), state.budget.value, speedup, tokens)

    @property
    def drafters(self) -> list[str]:
        with self._lock:
            return sorted(self._drafters)
