"""Per-request schedules for the engine and the distributed runtime, from the policy name a request gives.

:func:`schedules` returns the :data:`~specserve.core.draft.schedule.ScheduleFactory` that
:class:`~specserve.core.engine.SpeculativeEngine` and the drafter actor call once per request:
``fixed`` drafts the request's own γ or tree every cycle; ``heuristic`` starts at the request's γ
and follows transformers' +2 / −1 schedule; ``adaptive`` chooses each cycle's γ (and, when the
request names a tree, that tree as a further candidate) from the online estimates, under the measured ceiling of
its drafter on this replica (:class:`~specserve.policies.ceiling.ReplicaCeilings`, one per factory): no deeper than
the replica's measured cycles say pays, plain decoding when none does (``fixed`` and ``heuristic`` are baselines:
nothing caps them). Every request's
controller is seeded from, and feeds, one :class:`~specserve.policies.estimators.ReplicaPrior`
per factory — one per engine or drafter actor, i.e. per replica — and learns what a batched step costs in one
:class:`~specserve.policies.step_costs.StepCostEstimator` per factory. A static-shape engine passes its verify
``buckets``: every controller (and the prior it makes) then learns T_verify per bucket and prices a block at
its bucket (:class:`~specserve.policies.costs.CostEstimator`). Does not draft, verify or time.
"""

from __future__ import annotations

from typing import Any

from specserve.core.draft.schedule import (
    POLICY_NAMES,
    Budget,
    FixedSchedule,
    Schedule,
    ScheduleFactory,
    check_policy_name,
)
from specserve.core.model.buckets import VerifyBuckets
from specserve.policies.ceiling import ReplicaCeilings
from specserve.policies.controller import DEFAULT_MAX_GAMMA_CAP, SpeculationController, resolve_buckets
from specserve.policies.estimators import ReplicaPrior
from specserve.policies.policies import build_policy
from specserve.policies.step_costs import StepCostEstimator

__all__ = ["POLICY_NAMES", "schedules"]


def schedules(
    prior: ReplicaPrior | None = None,
    max_gamma_cap: int = DEFAULT_MAX_GAMMA_CAP,
    *,
    buckets: VerifyBuckets | None = None,
) -> ScheduleFactory:
    """A schedule factory whose adaptive and heuristic requests share ``prior`` (a fresh one by default) and
    price verify blocks at ``buckets`` (by default the prior's; ``None`` with no prior: no padding). A given
    prior must pool at the same buckets (:class:`ValueError` otherwise)."""
    shared = prior if prior is not None else ReplicaPrior(buckets=buckets)
    widths = resolve_buckets(shared, buckets)
    steps = StepCostEstimator(shared.prior())  # what a (batched) step costs on this replica, shared like the prior
    ceilings = ReplicaCeilings()  # how deep a draft pays on this replica, per drafter and batch size

    def make(policy: str, budget: Budget) -> Schedule:
        check_policy_name(policy)
        if policy == "fixed":
            return FixedSchedule(budget)
        options: dict[str, Any] = {"max_gamma": max_gamma_cap}
        if policy == "heuristic":
            options["start_gamma"] = max(1, min(budget.gamma, max_gamma_cap))
        elif budget.tree is not None:
            options["trees"] = (budget.tree,)
        adaptive = policy == "adaptive"
        return SpeculationController(
            build_policy(policy, **options),
            shared,
            max_gamma_cap,
            step_costs=steps,
            buckets=widths,
            ceiling=ceilings if adaptive else None,
        )

    return make
