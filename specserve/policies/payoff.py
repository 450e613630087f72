"""The payoff guard: measured speculation against measured plain decoding, per request, with a stated bound.

A policy chooses budgets from a *model* (:mod:`specserve.policies.rates`: acceptance per depth, a linear draft cost,
a verify-cost curve). A model can be wrong in ways its own estimates never show it: acceptance that is not
independent across depths, costs the linear fit misses, a drafter's catch-up after a pause. :class:`PayoffGuard`
does not model anything. It measures what drafting actually delivers — committed tokens per second of this
request's drafting cycles, Σ(accepted + 1) / Σ(draft + verify + wire seconds), exponentially weighted over the last
:attr:`GuardSettings.half_life` drafting cycles — and compares it with what plain decoding measures at the same batch
size, one token per T_step(B) (:class:`~specserve.policies.step_costs.StepCostEstimator`: the replica's own plain
steps of B rows; at B = 1 the request's T_verify(1)). Their ratio is the **measured speedup**.

States (each transition records its reason, which the controller writes into the request's history):

* ``measuring`` — the policy's budgets go through. Once :attr:`GuardSettings.min_cycles` drafting cycles are measured
  and the speedup is below ``1 − margin`` *with confidence* — its upper bound, the measured speedup plus
  :attr:`GuardSettings.confidence` standard errors, is below it — the guard **falls back**: plain decoding for
  ``backoff`` cycles. A cycle's tokens vary a lot (1 to γ + 1), so a window's mean does too: the standard error is
  the ratio estimator's (delta method over the window's exponential weights, effective size (Σw)² / Σw²).
* ``fallback`` — every budget is vetoed to plain decoding. After ``backoff`` cycles comes a trial.
* ``trial`` — the policy's budgets go through again, measured afresh (the old window is dropped) for
  :attr:`GuardSettings.trial_cycles` drafting cycles. A speedup of at least 1 **returns** to ``measuring`` (the
  back-off resets); otherwise the guard falls back again with the back-off doubled, up to
  :attr:`GuardSettings.max_backoff` — so a request whose text becomes predictable again is re-probed and drafts again.

**The bound.** While drafting does not pay, the guard drafts only in trials: ``trial_cycles`` drafting cycles after
every back-off of plain cycles, the back-off doubling from ``first_backoff`` to ``max_backoff``. Measure time in plain
steps (one plain step makes one token) and let a drafting cycle take at most ``c`` plain steps and make tokens at ``s``
(< 1) of plain decoding's rate. Once the back-off has reached its cap, each period of ``max_backoff + trial_cycles``
cycles takes at most ``B + T c`` plain steps (B = ``max_backoff``, T = ``trial_cycles``) and loses at most ``T c (1 −
s)`` tokens against plain decoding, so the request keeps at least ``1 − T c (1 − s) / (B + T c)`` of plain decoding's
rate (:meth:`GuardSettings.rate_floor`: 0.971 with the defaults at c = 2, s = 0.5; 0.985 at s = 0.75). Before the
cap the doubling back-offs add at most ``log2(max_backoff / first_backoff)`` = 3 further trials, and the first
verdict comes after ``min_cycles`` drafting cycles: a bounded loss once, not a share.

Hysteresis: falling back needs a measured speedup below ``1 − margin``, returning one of at least 1, so a drafter at
plain decoding's rate does not flap. The guard never changes what is verified, only how much is drafted:
output stays exact whatever it decides.

**Per replica.** A request often ends before its own guard has measured enough to act, and the next request would
pay the same losing cycles again. The guards of one schedule factory (one replica, whose requests share a drafter)
share a :class:`ReplicaPayoff`: while its last verdict is a fallback, a new request starts with a *trial* (judged after
``trial_cycles`` drafting cycles, not ``min_cycles`` and a confident window) and the replica's back-off, so a drafter
that does not pay costs each request one short trial. It does not start in fallback: prompts differ (the same drafter
measured 0.97× plain on one held-out prompt and 1.6× on another), and one prompt's verdict must not hold the next,
paying one, to plain decoding. A trial that pays clears the replica's fallback; one that fails renews it.

Pure bookkeeping: no clock (the caller passes seconds in), no randomness, no model. Not here: the model-based choice
of γ (:mod:`specserve.policies.policies`), the per-request glue (:mod:`specserve.policies.controller`).
"""

from __future__ import annotations

import threading
from dataclasses import dataclass
from typing import Literal

from specserve.core.draft.schedule import CycleObservation

GuardMode = Literal["measuring", "fallback", "trial"]


@dataclass(frozen=True)
class GuardSettings:
    """How the guard measures and when it acts (see the module docstring for the bound they give)."""

    half_life: float = 16.0  # drafting cycles the measured rate averages over (exponential window)
    min_cycles: int = 8  # drafting cycles measured before the first verdict
    margin: float = 0.03  # fall back below a measured speedup of 1 - margin; return at >= 1
    confidence: float = 2.0  # ... when the speedup plus this many standard errors is below 1 - margin
    trial_cycles: int = 8  # drafting cycles a trial measures before it is judged
    first_backoff: int = 32  # plain cycles before the first trial
    max_backoff: int = 256  # the back-off doubles after each failed trial, up to this

    def __post_init__(self) -> None:
        if not self.half_life >= 1:
            raise ValueError(f"half_life must be >= 1 cycle, got {self.half_life}")
        if self.min_cycles < 1 or self.trial_cycles < 1:
            raise ValueError("min_cycles and trial_cycles must be >= 1")
        if not 0 <= self.margin < 1:
            raise ValueError(f"margin must lie in [0, 1), got {self.margin}")
        if not self.confidence >= 0:
            raise ValueError(f"confidence must be >= 0 standard errors, got {self.confidence}")
        if not 1 <= self.first_backoff <= self.max_backoff:
            raise ValueError(f"need 1 <= first_backoff <= max_backoff, got {self.first_backoff}, {self.max_backoff}")

    def rate_floor(self, worst_speedup: float, longest_cycle: float) -> float:
        """The long-run share of plain decoding's rate the guard keeps while drafting does not pay, once its back-off
        has reached the cap: a drafting cycle takes at most ``longest_cycle`` plain steps and makes tokens at
        ``worst_speedup`` (< 1) of plain decoding's rate."""
        if not 0 <= worst_speedup <= 1 or not longest_cycle >= 1:
            raise ValueError(f"need 0 <= worst_speedup <= 1 and longest_cycle >= 1: {worst_speedup}, {longest_cycle}")
        trial_time = self.trial_cycles * longest_cycle
        return 1.0 - trial_time * (1.0 - worst_speedup) / (self.max_backoff + trial_time)


class RatioWindow:
    """An exponentially weighted ratio of means, Σx / Σy, over the last observations (half-life ``half_life``), with
    its standard error (the delta method for a ratio, over the weights' effective size (Σw)² / Σw²): tokens over
    time in plain steps, i.e. a measured speedup over plain decoding. Shared by the guard and the ceiling."""

    def __init__(self, half_life: float) -> None:
        if not half_life >= 1:
            raise ValueError(f"half_life must be >= 1 observation, got {half_life}")
        self._decay = 0.5 ** (1.0 / half_life)
        self._sums = [0.0] * 7  # w, w², x, y, x², y², xy
        self.count = 0  # observations since the last reset

    def add(self, x: float, y: float) -> None:
        w, w2, sx, sy, sxx, syy, sxy = (v * self._decay for v in self._sums)
        w2 *= self._decay
        self._sums = [w + 1, w2 + 1, sx + x, sy + y, sxx + x * x, syy + y * y, sxy + x * y]
        self.count += 1

    def reset(self) -> None:
        self._sums = [0.0] * 7
        self.count = 0

    @property
    def ratio(self) -> float | None:
        """Σx / Σy over the window (None before any observation)."""
        sx, sy = self._sums[2], self._sums[3]
        if self.count == 0 or sy <= 0:
            return None
        return sx / sy

    def standard_error(self) -> float:
        """The ratio's standard error (0 before two observations)."""
        w, w2, sx, sy, sxx, syy, sxy = self._sums
        if self.count < 2 or sy <= 0:
            return 0.0
        ratio = sx / sy
        mx, my = sx / w, sy / w
        var_x, var_y, cov = sxx / w - mx * mx, syy / w - my * my, sxy / w - mx * my
        spread = max(0.0, var_x - 2 * ratio * cov + ratio * ratio * var_y)
        n_eff = w * w / w2
        return (spread / n_eff) ** 0.5 / my


class ReplicaPayoff:
    """What one replica's guards know of whether drafting pays there (see the module docstring). Thread-safe."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self.falling_back = False
        self.backoff = 0  # the last fallback's back-off

    def fell_back(self, backoff: int) -> None:
        with self._lock:
            self.falling_back, self.backoff = True, backoff

    def returned(self) -> None:
        with self._lock:
            self.falling_back = False

    def start(self) -> int | None:
        """The back-off a new request's guard starts its trial with while the replica is falling back; None
        otherwise."""
        with self._lock:
            return self.backoff if self.falling_back else None


class PayoffGuard:
    """One request's guard; see the module docstring. Driven by the controller: :meth:`allows` before each cycle,
    :meth:`observe` after it. With ``replica``, it starts from and reports to the replica's memory."""

    def __init__(self, settings: GuardSettings | None = None, replica: ReplicaPayoff | None = None) -> None:
        self.settings = settings if settings is not None else GuardSettings()
        self.replica = replica
        self.mode: GuardMode = "measuring"
        self.backoff = self.settings.first_backoff
        self._wait = 0  # fallback cycles left before the next trial
        self._window = RatioWindow(self.settings.half_life)  # tokens over plain steps of the drafting cycles
        self.fallbacks = 0
        self.returns = 0
        self._events: list[str] = []  # transitions since the controller last read them
        inherited = replica.start() if replica is not None else None
        if inherited is not None:
            self.backoff = inherited
            self._enter("trial", "the replica's last verdict was a fallback: this request starts with a trial")

    # --- what the controller asks

    def allows(self) -> bool:
        """Whether the next cycle may draft (False: the budget is vetoed to plain decoding). Counts a fallback
        cycle, and starts a trial when the back-off has run out."""
        if self.mode != "fallback":
            return True
        if self._wait > 0:
            self._wait -= 1
            return False
        self._enter("trial", f"trial after {self.backoff} plain cycles")
        return True

    def observe(self, obs: CycleObservation, plain_seconds: float) -> None:
        """A verdict, and what a plain step at the cycle's batch size costs (seconds per token of plain decoding).

        Only drafting cycles are measured; a plain cycle chosen by the policy itself says nothing about drafting."""
        if obs.drafted == 0 or self.mode == "fallback":
            return
        seconds = obs.draft_seconds + obs.verify_seconds + obs.wire_seconds
        if not seconds > 0 or not plain_seconds > 0:
            return
        # the cycle's tokens, and its time in plain steps at its batch size: batch sizes mix fairly
        self._window.add(float(obs.accepted + 1), seconds / plain_seconds)
        needed = self.settings.trial_cycles if self.mode == "trial" else self.settings.min_cycles
        if self._window.count < needed:
            return
        speedup = self.speedup
        assert speedup is not None
        if self.mode == "trial":
            if speedup >= 1.0:
                self.backoff = self.settings.first_backoff
                self.returns += 1
                if self.replica is not None:
                    self.replica.returned()
                self._enter("measuring", f"returned: a trial measured {speedup:.2f}x plain decoding")
            else:
                self.backoff = min(2 * self.backoff, self.settings.max_backoff)
                self._fall_back(f"a trial measured {speedup:.2f}x plain decoding")
        elif speedup + self.settings.confidence * self.standard_error() < 1.0 - self.settings.margin:
            self._fall_back(f"measured {speedup:.2f}x plain decoding over the last drafting cycles")

    # --- what it reports

    @property
    def speedup(self) -> float | None:
        """The measured speedup over plain decoding of the current window (None before any drafting cycle)."""
        return self._window.ratio

    def standard_error(self) -> float:
        """The measured speedup's standard error (delta method for a ratio of means; 0 before two cycles)."""
        return self._window.standard_error()

    def take_events(self) -> list[str]:
        """The transitions since the last call, as reasons ("fallback: ...", "trial: ...", "measuring: ...")."""
        events, self._events = self._events, []
        return events

    # --- transitions

    def _fall_back(self, why: str) -> None:
        self.fallbacks += 1
        self._wait = self.backoff
        if self.replica is not None:
            self.replica.fell_back(self.backoff)
        self._enter("fallback", f"{why}; plain decoding for {self.backoff} cycles")

    def _enter(self, mode: GuardMode, reason: str) -> None:
        self.mode = mode
        self._events.append(f"{mode}: {reason}")
        if mode != "measuring":  # a trial measures afresh; a fallback keeps nothing of the losing window
            self._window.reset()
