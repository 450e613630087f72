"""Online estimates of acceptance per draft depth and of drafting/verification cost, fed one cycle at a time.

Per request, :class:`Estimators` holds

* an :class:`AcceptanceEstimator` — the acceptance rate at each draft depth *conditional on reaching
  it*, as a Beta posterior per depth with exponential forgetting on two timescales, plus a rough
  per-extra-node bonus for trees; and
* a :class:`CostEstimator` — T_draft(γ) = fixed + per_token · γ and T_verify(k), k = verified positions
  including the root, which is *not* assumed flat (on a CPU the k = 1 → 2 step alone is ~40 %:
  matrix-vector versus matrix-matrix kernels).

A :class:`ReplicaPrior` pools every request's observations on one replica (same estimator types, a longer
memory, a lock) and exports an :class:`EstimatorPrior` that seeds each new request, so a request starts
from what the replica has seen rather than from a guess.

Conventions (all documented again where used):

* **Forgetting.** A request's statistics have a half-life of :data:`REQUEST_HALF_LIFE_CYCLES` cycles (its
  acceptance estimate also keeps a long memory, :data:`REQUEST_LONG_HALF_LIFE_CYCLES`, that restarts from the
  recent one on a significant change); the replica's have :data:`REPLICA_HALF_LIFE_CYCLES` pooled cycles.
  Acceptance and verify statistics age on every cycle, so while a request decodes plainly its old
  acceptance evidence fades back towards the prior; draft-cost statistics age only on cycles that drafted
  (plain decoding says nothing about drafting).
* **Prior.** Every depth's Beta prior has :data:`PRIOR_STRENGTH` pseudo-counts and is never forgotten.
  Its mean is the replica's estimate where the replica has at least that much evidence at that depth;
  below that it is *this request's estimate at the depth above* (so an unobserved depth falls back to
  the deepest observed one), and at depth 1 with nothing known it is :data:`DEFAULT_ALPHA`.
* **Costs.** Times are seconds. Verify time includes ``wire_seconds`` (the round trip is paid per cycle).
  Tree draft cost is modelled per level (one draft forward per depth, widths batched), so x = depth.
* **Verify buckets.** Given :class:`~specserve.core.model.buckets.VerifyBuckets` (a static-shape engine pads a
  block of k positions up to ``buckets.width(k)``), verify times are learned per width the forward ran at,
  and T_verify(k) is priced at its bucket — never above a wider bucket's cost (see :class:`CostEstimator`).
  Without buckets (the default) every block runs at its own width, as before.

This module holds the two bundles, :class:`Estimators` and :class:`ReplicaPrior`; the estimators themselves are
:mod:`specserve.policies.acceptance` and :mod:`specserve.policies.costs`, and the defaults and the prior they start
from :mod:`specserve.policies.prior`.

Not here: choosing a budget (:mod:`specserve.policies.policies`), the rate model
(:mod:`specserve.policies.rates`), per-request bookkeeping of decisions
(:mod:`specserve.policies.controller`). Nothing here reads a clock: callers time the cycle and pass the
seconds in. Batched steps: T_verify(k) learns from cycles verified alone; what a batched step costs is
learned by :mod:`specserve.policies.step_costs` (an observation with ``batch_size > 1`` adds its acceptance and
draft cost here, not its verify time).
"""

from __future__ import annotations

import threading

from specserve.core.model.buckets import NO_BUCKETS, VerifyBuckets
from specserve.policies.acceptance import AcceptanceEstimator
from specserve.policies.base import Budget, CycleObservation, PolicyState
from specserve.policies.costs import CostEstimator
from specserve.policies.prior import (
    DEFAULT_MAX_DEPTH,
    DEFAULT_PRIOR,
    REPLICA_HALF_LIFE_CYCLES,
    REQUEST_HALF_LIFE_CYCLES,
    REQUEST_LONG_HALF_LIFE_CYCLES,
    TREE_BONUS_KEY,
    VERIFY_TABLE_SIZE,
    EstimatorPrior,
)

# ---------------------------------------------------------------------------------------------------------
# Bundles: per request, per replica


class Estimators:
    """One request's (or one replica's) estimators plus the observation counters a policy reads.

    ``half_life`` is the recent memory (costs, acceptance change detection); ``long_half_life`` the
    acceptance estimate's long memory (``None``: one timescale; ``half_life=None``: no forgetting at all);
    ``buckets`` the verify widths blocks are padded to (:class:`CostEstimator`; ``None``: none).
    """

    def __init__(
        self,
        prior: EstimatorPrior = DEFAULT_PRIOR,
        half_life: float | None = REQUEST_HALF_LIFE_CYCLES,
        long_half_life: float | None = REQUEST_LONG_HALF_LIFE_CYCLES,
        *,
        buckets: VerifyBuckets | None = None,
    ):
        self.prior = prior
        self.acceptance = AcceptanceEstimator(prior, half_life, long_half_life)
        self.costs = CostEstimator(prior, half_life, buckets)
        self.cycles = 0
        self.cycles_since_speculation = 0
        self.last_accepted = 0
        self.last_drafted = 0

    def observe(self, obs: CycleObservation) -> None:
        self.acceptance.observe(obs)
        self.costs.observe(obs)
        self.cycles += 1
        self.cycles_since_speculation = 0 if obs.drafted > 0 else self.cycles_since_speculation + 1
        self.last_accepted = obs.accepted
        self.last_drafted = obs.drafted

    def snapshot(
        self,
        previous: Budget | None,
        *,
        cycles_since_change: int = 0,
        cycles_off: int = 0,
        max_depth: int = DEFAULT_MAX_DEPTH,
        max_k: int = VERIFY_TABLE_SIZE,
        verify: tuple[tuple[float, ...], frozenset[int]] | None = None,
    ) -> PolicyState:
        """The state a policy decides from; ``previous`` and the decision counters come from the caller. ``verify``:
        T_verify(k) and its dominated widths when the caller prices verification itself (a batched step's share),
        instead of this request's own verify times."""
        fixed, per_token = self.costs.draft_fit()
        verify_seconds, dominated = verify if verify is not None else self.costs.verify_prices(max_k)
        return PolicyState(
            alpha=self.acceptance.alphas(max(1, max_depth)),
            alpha_weight=self.acceptance.weights(max(1, max_depth)),
            draft_seconds_per_token=per_token,
            draft_fixed_seconds=fixed,
            verify_seconds=verify_seconds,
            dominated_ks=dominated,
            previous=previous,
            cycles=self.cycles,
            cycles_since_change=cycles_since_change,
            cycles_since_speculation=self.cycles_since_speculation,
            last_accepted=self.last_accepted,
            last_drafted=self.last_drafted,
            cycles_off=cycles_off,
            extra={TREE_BONUS_KEY: self.acceptance.tree_bonus_per_node()},
        )

    def export_prior(self, max_depth: int = DEFAULT_MAX_DEPTH, max_k: int = VERIFY_TABLE_SIZE) -> EstimatorPrior:
        """These estimates as a prior for a new request: acceptance only at depths with at least
        ``prior.strength`` observations' worth of evidence, costs as fitted (verify per width, no bucket applied:
        :meth:`CostEstimator.width_table`)."""
        known = min(max_depth, self.acceptance.known_depths(self.prior.strength))
        fixed, per_token = self.costs.draft_fit()
        return EstimatorPrior(
            alpha=self.acceptance.alphas(known) if known else (),
            strength=self.prior.strength,
            draft_seconds_per_token=per_token,
            draft_fixed_seconds=fixed,
            verify_seconds=self.costs.width_table(max_k),
            tree_bonus_per_node=self.acceptance.tree_bonus_per_node(),
            plain_measured=self.plain_measured,
        )

    @property
    def plain_measured(self) -> bool:
        """Whether T_verify(1) is known from a measurement (here or in the prior), not from the prior's shape."""
        return self.prior.plain_measured or self.costs.plain_measured


class ReplicaPrior:
    """All requests' observations on one replica, pooled; seeds each new request's estimators.

    ``buckets``: the verify widths the replica's engine pads blocks to, so that pooled verify times are
    recorded at the width they ran at (its requests' controllers must use the same; ``None``: no padding).
    Thread-safe: the coordinator may run requests on threads, so every method takes the lock.
    """

    def __init__(
        self,
        prior: EstimatorPrior = DEFAULT_PRIOR,
        half_life: float | None = REPLICA_HALF_LIFE_CYCLES,
        *,
        buckets: VerifyBuckets | None = None,
    ):
        self._lock = threading.Lock()
        self.buckets = buckets if buckets is not None else NO_BUCKETS
        self._estimators = Estimators(prior, half_life, long_half_life=None, buckets=self.buckets)

    def observe(self, obs: CycleObservation) -> None:
        with self._lock:
            self._estimators.observe(obs)

    def prior(self, max_depth: int = DEFAULT_MAX_DEPTH) -> EstimatorPrior:
        """The prior a new request starts from (see :meth:`Estimators.export_prior`)."""
        with self._lock:
            return self._estimators.export_prior(max_depth)

    def snapshot(self, max_depth: int = DEFAULT_MAX_DEPTH) -> PolicyState:
        """The pooled estimates, for reports and metrics."""
        with self._lock:
            return self._estimators.snapshot(None, max_depth=max_depth)

    @property
    def cycles(self) -> int:
        with self._lock:
            return self._estimators.cycles
