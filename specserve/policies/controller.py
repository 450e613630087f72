"""Per-request glue between estimators and a policy: decide the next budget, learn from each verdict.

One :class:`SpeculationController` per request. Each cycle the caller asks :meth:`next_budget` (with the
tokens the request may still produce), drafts and verifies, and reports the outcome with :meth:`observe`.
The controller keeps the request's own :class:`~specserve.policies.estimators.Estimators` (seeded from the
replica's :class:`~specserve.policies.estimators.ReplicaPrior` when given one), forwards every observation
to that prior, keeps the decision counters the policy reads (previous budget, cycles since a change,
cycles off), and records a JSON-ready :attr:`history`. In a batched engine it is also told how many requests
the next step verifies, and reads its share of such a step off the replica's
:class:`~specserve.policies.step_costs.StepCostEstimator`, which every cycle's observation feeds; it tells
the engine what it expects of a chain of each length and what drafting it costs, so that the engine can choose
the step's width (:class:`~specserve.core.draft.schedule.BatchPlanned`), which may cut or lengthen the chain it planned
(the observation says what was drafted). A probe the engine cut (one request's probe would widen
every row of the step) stays due and is asked again each cycle, so probes go through when enough requests
probe together.

Under a static-shape engine the controller is given the engine's
:class:`~specserve.core.model.buckets.VerifyBuckets` (by default the replica prior's): its estimators then learn
T_verify per bucket the forward ran at and price each block at its bucket
(:class:`~specserve.policies.costs.CostEstimator`); a replica prior pooling other buckets is refused.

A policy that sets ``calibrates_plain`` (the adaptive one) gets one plain-decoding cycle first when
neither the request nor the replica has measured T_verify(1): plain decoding is what every γ is compared
against, it is never observed while speculating, and its cost is not on the line through the others
(matrix-vector kernels). That cycle is not the policy's decision (it does not count as switching off).

Budgets are clipped here, never in policies: to ``max_gamma_cap`` draft depth (a replica's limit), to
``remaining − 1`` (a cycle always adds one token of its own: recovered or bonus) and, given a
:class:`~specserve.policies.ceiling.ReplicaCeiling`, to the deepest depth its measured cycles say still pays at the
step's batch size (its band open, at most the budget's depth); the depths it vetoes are given to the policy
(``PolicyState.vetoed_depths``), so an adaptive policy chooses among the open ones. A tree deeper than allowed is
cut to a dynamic tree of the allowed depth, or to a chain when it is a static topology. No band open is plain
decoding: the fallback when no drafting pays.

Not here: timing (the caller measures seconds), drafting or verification, thread-safety of one request's
controller (one request is driven by one thread; only the shared prior is locked).
"""

from __future__ import annotations

import dataclasses
from typing import Any

from specserve.core.model.buckets import NO_BUCKETS, VerifyBuckets
from specserve.core.tree.shapes import TreeSpec
from specserve.policies.base import Budget, CycleObservation, DecidesOffCheaply, Policy, PolicyState
from specserve.policies.ceiling import (
    CLOSED,
    FELL_BACK,
    REOPENED,
    RETURNED,
    ReplicaCeiling,
    ReplicaCeilings,
    band_label,
)
from specserve.policies.estimators import Estimators, ReplicaPrior
from specserve.policies.prior import REQUEST_HALF_LIFE_CYCLES, VERIFY_TABLE_SIZE, EstimatorPrior
from specserve.policies.rates import budget_depth, expected_tokens
from specserve.policies.step_costs import StepCostEstimator

DEFAULT_MAX_GAMMA_CAP = 16
MAX_REPORTED_EVENTS = 16  # the ceiling's last moves a request's report keeps


def clip_budget(budget: Budget, max_depth: int) -> Budget:
    """``budget`` with at most ``max_depth`` tokens on any path (0 → plain decoding)."""
    if max_depth <= 0:
        return Budget(0)
    if budget.tree is None:
        return budget if budget.gamma <= max_depth else Budget(max_depth)
    if budget_depth(budget) <= max_depth:
        return budget
    tree = budget.tree
    if tree.kind == "dynamic":
        assert tree.budget is not None
        clipped = dataclasses.replace(tree.budget, depth=max_depth)
        return Budget(budget.gamma, TreeSpec("dynamic", budget=clipped))
    return Budget(max_depth)


def resolve_buckets(prior: ReplicaPrior | None, buckets: VerifyBuckets | None) -> VerifyBuckets:
    """The verify buckets requests sharing ``prior`` price blocks at: ``buckets``, else the prior's, else none.

    Refuses buckets other than the prior's: the prior records each verify at the width it believes it ran at.
    """
    if prior is None:
        return buckets if buckets is not None else NO_BUCKETS
    if buckets is not None and buckets != prior.buckets:
        raise ValueError(
            f"the replica prior pools verify times at buckets {prior.buckets.describe()}, not {buckets.describe()}: "
            "build the ReplicaPrior with the engine's buckets"
        )
    return prior.buckets


class SpeculationController:
    """Decides and learns for one request; see the module docstring."""

    def __init__(
        self,
        policy: Policy,
        prior: ReplicaPrior | None = None,
        max_gamma_cap: int = DEFAULT_MAX_GAMMA_CAP,
        *,
        half_life: float | None = REQUEST_HALF_LIFE_CYCLES,
        step_costs: StepCostEstimator | None = None,
        buckets: VerifyBuckets | None = None,
        ceiling: ReplicaCeiling | ReplicaCeilings | None = None,
    ):
        if max_gamma_cap < 0:
            raise ValueError(f"max_gamma_cap must be >= 0, got {max_gamma_cap}")
        self.policy = policy
        self.replica_prior = prior
        self.max_gamma_cap = max_gamma_cap
        self.buckets = resolve_buckets(prior, buckets)
        seed = prior.prior(max_depth=max(1, max_gamma_cap)) if prior is not None else EstimatorPrior()
        self.estimators = Estimators(seed, half_life, buckets=self.buckets)
        self.history: list[dict[str, Any]] = []
        self._chosen: Budget | None = None  # the policy's last decision after the cap (what hysteresis compares)
        self._cycles_since_change = 0
        self._cycles_off = 0
        self._calibrate = bool(getattr(policy, "calibrates_plain", False))
        # what a batched step costs: shared by the replica's requests when given, this request's own otherwise
        self.step_costs = step_costs if step_costs is not None else StepCostEstimator(seed)
        self._batch_off = 0  # while off: the smallest batch size at which the policy chose not to draft
        # its budgets price a batched step as if every request drafted alike: a batched engine may align them
        self.aligns_in_batch = policy.name == "adaptive"
        self._state: PolicyState | None = None  # what the last decision was made from
        # a probe a batched step cut to nothing (it would have widened every row for one request): asked again
        # each cycle until it goes through, which it does once enough requests probe in the same step
        self._deferred_probe: Budget | None = None
        # the replica's measured ceiling on how deep a draft may be (specserve.policies.ceiling), per drafter when
        # given the replica's ReplicaCeilings (the configured drafter's until use_drafter names one); None: the
        # policy's budgets go through as chosen
        self._ceilings = ceiling if isinstance(ceiling, ReplicaCeilings) else None
        self.ceiling = ceiling.get() if isinstance(ceiling, ReplicaCeilings) else ceiling
        self._cap: int | None = None  # the deepest draft the ceiling allowed at the last decision (None: any)
        self._batch_size = 1  # ... and its step's batch size
        self._ceiling_events: list[str] = []

    # What a batched engine asks to choose a step's width (specserve.core.draft.schedule.BatchPlanned)

    def use_drafter(self, name: str) -> None:
        """Measure under the ceiling of drafter ``name`` (:class:`~specserve.core.draft.schedule.PerDrafter`)."""
        if self._ceilings is not None:
            self.ceiling = self._ceilings.get(name)

    def expected_tokens(self, gamma: int) -> float:
        """E[tokens committed] by a chain of ``gamma`` drafts under the estimates of the last decision."""
        return expected_tokens(self._decision_state(), Budget(gamma))

    def draft_seconds(self, gamma: int) -> float:
        """T_draft(γ) under the estimates of the last decision (0 for plain decoding)."""
        return self._decision_state().t_draft(gamma)

    def _decision_state(self) -> PolicyState:
        """The estimates of the last decision (snapshotted now if it was made without them, before any verdict)."""
        if self._state is None:
            self._state = self.snapshot(max(1, self._batch_size))
        return self._state

    @property
    def max_chain(self) -> int:
        return self.max_gamma_cap if self._cap is None else min(self.max_gamma_cap, self._cap)

    def allowed_chain(self, gamma: int) -> int:
        gamma = max(0, min(gamma, self.max_chain))
        return gamma if self.ceiling is None or gamma == 0 else self.ceiling.allowed(gamma, self._batch_size)

    def step_seconds(self, positions: int) -> float:
        return self.step_costs.t_step(positions)

    def snapshot(self, batch_size: int = 1) -> PolicyState:
        """The state the next decision will be made from, in a step that verifies ``batch_size`` requests: beyond
        one, T_verify(k) is this request's share of such a step if all drafted alike,
        T_step(batch_size · k) / batch_size (:mod:`specserve.policies.step_costs`)."""
        # a batched step prices verification by the step's curve (chains need k <= cap + 1; longer blocks, trees,
        # extrapolate the table's last two entries), with no per-request bucket envelope
        verify = None
        if batch_size > 1:
            verify = (self.step_costs.per_request_table(batch_size, self.max_gamma_cap + 2), frozenset[int]())
        state = self.estimators.snapshot(
            self._chosen,
            cycles_since_change=self._cycles_since_change,
            cycles_off=self._cycles_off,
            max_depth=max(1, self.max_gamma_cap),
            max_k=VERIFY_TABLE_SIZE,
            verify=verify,
        )
        if batch_size == 1:
            return dataclasses.replace(state, batch_size_off=self._batch_off) if self._batch_off else state
        return dataclasses.replace(state, batch_size=batch_size, batch_size_off=self._batch_off)

    def next_budget(self, remaining: int, batch_size: int = 1) -> Budget:
        """The budget for the next cycle (whose target forward verifies ``batch_size`` requests): the policy's
        choice, capped, and cut to ``remaining − 1`` (``remaining`` = tokens the request may still emit; the
        verdict always adds one of its own)."""
        if remaining < 1:
            raise ValueError(f"remaining must be >= 1, got {remaining}")
        if batch_size < 1:
            raise ValueError(f"batch_size must be >= 1, got {batch_size}")
        if self._calibrate:
            self._calibrate = False
            if not self.estimators.plain_measured:
                self.history.append(self._entry(Budget(0), Budget(0), remaining, probe=False, calibration=True))
                return Budget(0)
        chosen = clip_budget(self._decide(batch_size), self.max_gamma_cap)
        if self._deferred_probe is not None and chosen.nodes == 0:
            chosen = self._deferred_probe
        self._deferred_probe = None
        previous = self._chosen
        probe = chosen.nodes > 0 and self._cycles_off > 0 and previous is not None and previous.nodes == 0
        if chosen.nodes == 0 or probe:
            if chosen.nodes == 0:
                self._batch_off = min(self._batch_off, batch_size) if self._cycles_off else batch_size
            self._cycles_off += 1
        else:
            self._cycles_off = 0
            self._batch_off = 0
        self._cycles_since_change = self._cycles_since_change + 1 if chosen == previous else 0
        self._chosen = chosen
        sent = clip_budget(chosen, remaining - 1)
        capped = False
        self._batch_size = batch_size
        if self.ceiling is not None:
            allowed = self.ceiling.allowed(budget_depth(sent), batch_size)
            self._cap = self.ceiling.cap(batch_size)
            self._ceiling_events.extend(self.ceiling.take_events(batch_size))
            if allowed < budget_depth(sent):
                sent, capped = clip_budget(sent, allowed), True
        entry = self._entry(chosen, sent, remaining, probe=probe, calibration=False)
        if batch_size > 1:
            entry["batch_size"] = batch_size
        if capped:
            entry["ceiling"] = budget_depth(sent)
        self.history.append(entry)
        return sent

    def _decide(self, batch_size: int) -> Budget:
        """The policy's choice for a step of ``batch_size`` requests. While off it is usually plain decoding or a due
        probe, told without estimates (:class:`~specserve.policies.base.DecidesOffCheaply`): the state is then
        snapshotted only if asked for (:meth:`expected_tokens`), which saved a batched replica ~0.3 ms per plain row
        and step."""
        self._state = None
        if isinstance(self.policy, DecidesOffCheaply):
            off = self.policy.decide_off(self._chosen, self._cycles_off, batch_size, self._batch_off)
            if off is not None:
                return off
        state = self._state = self.snapshot(batch_size)
        if self.ceiling is not None:  # the depths the ceiling would cut are no choice (plain decoding never is cut)
            vetoed = self.ceiling.vetoed(max(1, self.max_gamma_cap), batch_size)
            if vetoed:
                state = self._state = dataclasses.replace(state, vetoed_depths=vetoed)
        return self.policy.decide(state)

    def _entry(self, chosen: Budget, sent: Budget, remaining: int, probe: bool, calibration: bool) -> dict[str, Any]:
        return {
            "cycle": len(self.history),
            "policy": self.policy.name,
            "chosen": chosen.describe(),
            "sent": sent.describe(),
            "gamma": budget_depth(sent),
            "nodes": sent.nodes,
            "probe": probe,
            "calibration": calibration,
            "remaining": remaining,
        }

    def report(self) -> dict[str, Any]:
        """What this request's policy decided and why (:class:`~specserve.core.draft.schedule.ReportingSchedule`):
        its decisions (the calibration cycle included), how many were plain decoding, the budgets' sum and, under a
        ceiling, how many decisions it cut, which bands of drafted depth were open at the last one (``open_bands``),
        what each band measured there and the ceiling's moves this request saw (``closed``, ``reopened``;
        ``fallbacks``: closings that left no band open; ``returns``: reopenings from none), with their reasons."""
        decisions = [e for e in self.history if "sent" in e]
        report: dict[str, Any] = {
            "policy": self.policy.name,
            "decisions": len(decisions),
            "plain_decisions": sum(1 for e in decisions if e["nodes"] == 0),
            "budget_sum": sum(e["nodes"] for e in decisions),
        }
        if self.ceiling is not None:
            events = self._ceiling_events
            report.update(
                capped=sum(1 for e in decisions if "ceiling" in e),
                open_bands=self.ceiling.open_bands(self._batch_size),
                measured_speedup={band: round(v, 4) for band, v in self.ceiling.speedups(self._batch_size).items()},
                closed=sum(1 for e in events if e.startswith((CLOSED, FELL_BACK))),
                reopened=sum(1 for e in events if e.startswith((REOPENED, RETURNED))),
                fallbacks=sum(1 for e in events if e.startswith(FELL_BACK)),
                returns=sum(1 for e in events if e.startswith(RETURNED)),
                events=events[-MAX_REPORTED_EVENTS:],
            )
        return report

    def observe(self, obs: CycleObservation) -> None:
        """The verdict of the last cycle: updates this request's estimators and the replica's prior."""
        self.estimators.observe(obs)
        if self.replica_prior is not None:
            self.replica_prior.observe(obs)
        self.step_costs.observe(obs.positions, obs.verify_seconds + obs.wire_seconds)
        batch_size = max(1, obs.batch_size)
        if obs.step_seconds > 0 and obs.positions == batch_size:  # a whole plain step: every row one position
            self.step_costs.observe_plain_step(batch_size, obs.step_seconds, 1.0 / batch_size)
        decision = self.history[-1] if self.history and "accepted" not in self.history[-1] else None
        if self.ceiling is not None:
            # a batched row waited its whole step: against a whole plain step; a cycle of its own against T_step(1)
            costs = self.step_costs
            self.ceiling.observe(obs, costs.t_plain_step(batch_size) if obs.step_seconds else costs.t_step(batch_size))
        if (
            decision is not None
            and decision["probe"]
            and obs.budget.nodes == 0
            and self._chosen is not None
            and "ceiling" not in decision  # cut by the ceiling, not by the batch: nothing to ask again
        ):
            # the batch cut this probe: nothing was learned, so it stays due (and the request stays off)
            self._deferred_probe, self._chosen = self._chosen, Budget(0)
            decision["deferred"] = True
        record = {
            "drafted": obs.drafted,
            "depth": obs.depth,
            "accepted": obs.accepted,
            "draft_seconds": obs.draft_seconds,
            "verify_seconds": obs.verify_seconds,
            "wire_seconds": obs.wire_seconds,
        }
        if self.ceiling is not None and obs.depth > 0:  # what the drafts of this depth measure on the replica
            speedup = self.ceiling.speedups(max(1, obs.batch_size)).get(band_label(obs.depth))
            if speedup is not None:
                record["measured_speedup"] = round(speedup, 4)
        if self.history and "accepted" not in self.history[-1]:
            self.history[-1].update(record)
        else:  # an observation without a decision from this controller (e.g. a replayed trace)
            self.history.append({"cycle": len(self.history), **record})
