"""Speculation policies (how much to draft each cycle), the online estimators they read, and the per-request
controller that ties the two together (docs/architecture.md#performance-model; docs/policies.md).

The decision side touches no model, clock or random generator: estimators are fed
:class:`~specserve.policies.base.CycleObservation` records and policies are pure functions of a
:class:`~specserve.policies.base.PolicyState` snapshot. A policy only changes how much is proposed, never
how proposals are verified, so the output stays exact whichever policy runs. Around it:
:mod:`~specserve.policies.schedules` (per-request schedules for the engine and the drafter actor),
:mod:`~specserve.policies.traces` (msgpack cycle traces) and :mod:`~specserve.policies.simulator` (replays
traces with a seeded RNG). The package knows only :mod:`specserve.core`: the experiment harness that runs
policies against real models (``specserve experiment``) sits above it, in
:mod:`specserve.benchmarks.experiment`.
"""

from specserve.policies.acceptance import AcceptanceEstimator
from specserve.policies.base import Budget, CycleObservation, Policy, PolicyState
from specserve.policies.controller import SpeculationController
from specserve.policies.costs import CostEstimator
from specserve.policies.estimators import Estimators, ReplicaPrior
from specserve.policies.policies import (
    POLICY_NAMES,
    AdaptivePolicy,
    FixedPolicy,
    HeuristicPolicy,
    build_policy,
)
from specserve.policies.prior import EstimatorPrior
from specserve.policies.rates import optimal_gamma, predicted_rate

__all__ = [
    "POLICY_NAMES",
    "AcceptanceEstimator",
    "AdaptivePolicy",
    "Budget",
    "CostEstimator",
    "CycleObservation",
    "EstimatorPrior",
    "Estimators",
    "FixedPolicy",
    "HeuristicPolicy",
    "Policy",
    "PolicyState",
    "ReplicaPrior",
    "SpeculationController",
    "build_policy",
    "optimal_gamma",
    "predicted_rate",
]
