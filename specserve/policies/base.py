"""The speculation-policy contract: a budget, what one cycle tells the estimators, and the pure decision.

A *policy* decides how much to draft in the next cycle — a chain length γ (0 = plain
decoding) or a tree budget — from a snapshot of the online estimates (:class:`PolicyState`).
It is a pure function of that state: no models, no clocks, no randomness beyond what the state
carries, so the same decision code runs live in the engine and coordinator and offline in the
trace simulator. Whatever it decides, the output stays exact: a budget only changes how much
is proposed, never how proposals are verified.

:class:`~specserve.core.draft.schedule.Budget` and :class:`~specserve.core.draft.schedule.CycleObservation` live in
``core`` (the engine loop speaks them without importing policies) and are re-exported here.
The estimators that produce the state live in :mod:`specserve.policies.estimators`; the
controller that ties estimators and a policy to one request in :mod:`specserve.policies.controller`.
"""

from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass, field
from typing import Protocol, runtime_checkable

from specserve.core.draft.schedule import Budget, CycleObservation

__all__ = ["Budget", "CycleObservation", "Policy", "PolicyState"]


@dataclass(frozen=True)
class PolicyState:
    """A snapshot of the estimates a policy decides from (all per request, shrunk towards the replica's prior)."""

    alpha: tuple[float, ...]  # acceptance at depth i (conditional on reaching it), i = 0 .. max depth - 1
    draft_seconds_per_token: float  # T_draft(γ) ≈ draft_fixed_seconds + γ · this
    draft_fixed_seconds: float
    verify_seconds: tuple[float, ...]  # T_verify(k) for k = 1 .. len (k = verified positions incl. the root)
    previous: Budget | None = None  # the last decision (hysteresis)
    cycles: int = 0  # cycles observed for this request
    cycles_since_change: int = 0
    cycles_since_speculation: int = 0  # cycles since the last one that drafted anything
    last_accepted: int = 0  # the previous cycle's accepted path length (what transformers' heuristic schedule reads)
    last_drafted: int = 0  # the previous cycle's draft nodes actually sent
    cycles_off: int = 0  # consecutive decisions spent off (plain decoding, probes included); 0 while speculating
    # pseudo-counts behind each alpha (prior strength + forgetting-weighted observations): how sure it is
    alpha_weight: tuple[float, ...] = ()
    # requests the next target forward verifies together, this one included; verify_seconds is then this request's
    # share of such a step (specserve.policies.step_costs)
    batch_size: int = 1
    batch_size_off: int = 0  # while off: the smallest batch size at which speculation was judged not to pay
    # block sizes k whose verify bucket costs more than a wider bucket: verify_seconds prices them at the wider one
    # (the lower envelope), but the engine pads them only to their own, so no chain of such a k is drafted
    dominated_ks: frozenset[int] = frozenset()
    # draft depths the replica's measured ceiling vetoes now (specserve.policies.ceiling): a budget that deep would
    # be cut below it, so a policy that can should choose among the others (plain decoding is never vetoed)
    vetoed_depths: frozenset[int] = frozenset()
    extra: dict[str, float] = field(default_factory=dict)

    def optimistic(self, z: float) -> PolicyState:
        """The same state with every alpha raised by ``z`` posterior standard deviations (capped at 1): what
        the drafts could still be worth given how little has been seen of them."""
        if not self.alpha_weight:
            return self
        raised = tuple(
            min(1.0, a + z * math.sqrt(a * (1.0 - a) / (w + 1.0)))
            for a, w in zip(self.alpha, self.alpha_weight, strict=False)
        )
        return dataclasses.replace(self, alpha=raised + self.alpha[len(raised) :])

    def t_verify(self, k: int) -> float:
        """T_verify(k), extrapolated linearly past the last estimated k."""
        table = self.verify_seconds
        if k <= len(table):
            return table[k - 1]
        if len(table) >= 2:
            slope = max(0.0, table[-1] - table[-2])
            return table[-1] + slope * (k - len(table))
        return table[-1]

    def t_draft(self, gamma: int) -> float:
        return 0.0 if gamma == 0 else self.draft_fixed_seconds + gamma * self.draft_seconds_per_token


@runtime_checkable
class Policy(Protocol):
    """Decides the next cycle's budget from estimator state; pure and cheap (called once per cycle)."""

    name: str

    def decide(self, state: PolicyState) -> Budget: ...


@runtime_checkable
class DecidesOffCheaply(Protocol):
    """A policy whose decision while off needs no estimates (most cycles of a request it has turned off): the
    controller asks :meth:`decide_off` first and builds a :class:`PolicyState` only when it answers ``None``."""

    def decide_off(
        self, previous: Budget | None, cycles_off: int, batch_size: int, batch_size_off: int
    ) -> Budget | None:
        """What :meth:`Policy.decide` would return for a state with these fields, when it can tell from them alone;
        ``None`` otherwise."""
        ...
