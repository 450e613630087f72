"""Acceptance per draft depth, online: Beta posteriors with forgetting on two timescales, fed one cycle at a time.

:class:`AcceptanceEstimator` is one request's (or one replica's) estimate of the acceptance rate at each draft depth
*conditional on reaching it*, plus a rough per-extra-node bonus for trees; its conventions (forgetting, the prior) are
those of :mod:`specserve.policies.estimators`. Does not estimate costs (:mod:`specserve.policies.costs`), choose a
budget, or read a clock.
"""

from __future__ import annotations

import math
from collections.abc import Sequence

from specserve.policies.base import CycleObservation
from specserve.policies.prior import (
    DEFAULT_ALPHA,
    DEFAULT_PRIOR,
    REQUEST_HALF_LIFE_CYCLES,
    REQUEST_LONG_HALF_LIFE_CYCLES,
    EstimatorPrior,
    decay_factor,
)

CHANGE_Z = 3.0
"""Standard errors by which the recent and long estimates at a depth must differ before the long memory
restarts from the recent one (a false restart is harmless: it only costs the long memory's extra precision
for a while)."""

RESUME_GAP_CYCLES = 8
"""Cycles without drafting after which the next drafting cycle restarts the long memory (a probe after an
off period speaks for the present; shorter gaps — a drafter that found nothing once — do not)."""


# ---------------------------------------------------------------------------------------------------------
# Acceptance


class _DepthCounts:
    """Forgetting-weighted accepted / reached counts per depth (index i = depth i + 1)."""

    def __init__(self, decay: float):
        self.decay = decay
        self.accepted: list[float] = []  # [depths seen]
        self.reached: list[float] = []  # [depths seen]

    def age(self) -> None:
        if self.decay != 1.0:
            self.accepted = [a * self.decay for a in self.accepted]
            self.reached = [n * self.decay for n in self.reached]

    def add(self, flags: Sequence[bool]) -> None:
        while len(self.reached) < len(flags):
            self.accepted.append(0.0)
            self.reached.append(0.0)
        for i, accepted in enumerate(flags):
            self.reached[i] += 1.0
            if accepted:
                self.accepted[i] += 1.0
            else:
                break

    def copy_from(self, other: _DepthCounts, depths: Sequence[int]) -> None:
        while len(self.reached) < len(other.reached):
            self.accepted.append(0.0)
            self.reached.append(0.0)
        for i in depths:
            self.accepted[i] = other.accepted[i]
            self.reached[i] = other.reached[i]

    def posterior(self, prior: EstimatorPrior, max_depth: int) -> tuple[tuple[float, ...], tuple[float, ...]]:
        """(posterior means, pseudo-counts behind them) at depths 1 .. ``max_depth``."""
        strength = prior.strength
        means: list[float] = []
        weights: list[float] = []
        for i in range(max_depth):
            if i < len(prior.alpha):
                mean = prior.alpha[i]
            elif means:
                mean = means[-1]
            else:
                mean = DEFAULT_ALPHA
            accepted = self.accepted[i] if i < len(self.accepted) else 0.0
            reached = self.reached[i] if i < len(self.reached) else 0.0
            means.append((strength * mean + accepted) / (strength + reached))
            weights.append(strength + reached)
        return tuple(means), tuple(weights)


class AcceptanceEstimator:
    """Acceptance per draft depth, conditional on reaching it: Beta posteriors with exponential forgetting,
    on two timescales.

    At depth i (1-based) a posterior mean is ``(S·μ_i + s_i) / (S + n_i)``, where ``s_i`` and ``n_i`` are
    forgetting-weighted counts of accepted and reached drafts at that depth (from
    :attr:`CycleObservation.accept_flags`), ``S`` the prior strength and ``μ_i`` the prior mean (the
    replica's estimate, else the estimate at depth i − 1, else :data:`DEFAULT_ALPHA`).

    Two sets of counts are kept: *recent* ones with ``half_life`` (16 cycles by default) and *long* ones
    with ``long_half_life`` (256). The estimate reported is the long one — four times less noisy, which is
    what keeps a stationary request's γ from wandering — and it restarts from the recent counts (i) at a
    depth where the two disagree by more than :data:`CHANGE_Z` standard errors (the regime changed: the
    long memory would lag it) and (ii) at every depth when drafting resumes after
    :data:`RESUME_GAP_CYCLES` or more cycles without (a probe after an off period: what was true before
    the pause is not trusted over what the probe shows). So a change is followed about as fast as the
    recent counts alone would follow it. ``long_half_life=None`` keeps one timescale (the replica's pooled
    estimator); ``half_life=None`` means no forgetting at all (one timescale).

    Only chain-shaped drafts (one node per level) feed the per-depth counts: a tree's conditional
    acceptance includes its side branches. Trees feed a per-extra-node bonus instead:
    ``(accepted − E_chain[accepted | depth]) / (nodes − depth)``, averaged with the recent forgetting and
    shrunk towards the prior's bonus with the same strength.
    """

    def __init__(
        self,
        prior: EstimatorPrior = DEFAULT_PRIOR,
        half_life: float | None = REQUEST_HALF_LIFE_CYCLES,
        long_half_life: float | None = REQUEST_LONG_HALF_LIFE_CYCLES,
    ):
        self.prior = prior
        self.half_life = half_life
        self.long_half_life = long_half_life if half_life is not None else None
        self._recent = _DepthCounts(decay_factor(half_life))
        self._long = _DepthCounts(decay_factor(self.long_half_life)) if self.long_half_life is not None else None
        self._bonus_sum = 0.0
        self._bonus_weight = 0.0
        self._since_drafting = 0  # cycles since the last one that drafted (resume detection)
        self.restarts = 0  # how often the long memory restarted from the recent one (diagnostics)

    @property
    def _reported(self) -> _DepthCounts:
        return self._long if self._long is not None else self._recent

    def observe(self, obs: CycleObservation) -> None:
        """One cycle: age everything, then add what the cycle showed (nothing for plain decoding)."""
        self._age()
        if obs.drafted <= 0 or obs.depth <= 0:
            self._since_drafting += 1
            return
        resumed = self._since_drafting >= RESUME_GAP_CYCLES
        self._since_drafting = 0
        if obs.drafted == obs.depth:  # one node per level: a chain, whatever the budget asked for
            self._add_flags(obs.accept_flags, resumed)
        else:
            expected = self.expected_accepted(obs.depth)
            self._bonus_sum += (obs.accepted - expected) / (obs.drafted - obs.depth)
            self._bonus_weight += 1.0

    def observe_flags(self, flags: Sequence[bool]) -> None:
        """One chain cycle given directly as per-depth flags (accepted until the first False)."""
        self._age()
        self._since_drafting = 0
        self._add_flags(flags, resumed=False)

    def _age(self) -> None:
        self._recent.age()
        if self._long is not None:
            self._long.age()
        d = self._recent.decay
        self._bonus_sum *= d
        self._bonus_weight *= d

    def _add_flags(self, flags: Sequence[bool], resumed: bool) -> None:
        self._recent.add(flags)
        if self._long is None:
            return
        self._long.add(flags)
        depths = len(self._recent.reached)
        if resumed:
            self._long.copy_from(self._recent, range(depths))
            self.restarts += 1
            return
        recent, recent_weight = self._recent.posterior(self.prior, depths)
        long, long_weight = self._long.posterior(self.prior, depths)
        for i in range(min(len(flags), depths)):
            variance = recent[i] * (1 - recent[i]) / recent_weight[i] + long[i] * (1 - long[i]) / long_weight[i]
            spread = math.sqrt(variance)
            if abs(recent[i] - long[i]) > CHANGE_Z * spread:
                # deeper depths are conditional on this one: a change here restarts them too
                self._long.copy_from(self._recent, range(i, depths))
                self.restarts += 1
                break

    def reached(self, depth: int) -> float:
        """Forgetting-weighted count of chain cycles that reached ``depth`` (1-based), as reported."""
        counts = self._reported.reached
        return counts[depth - 1] if 0 < depth <= len(counts) else 0.0

    def weights(self, max_depth: int) -> tuple[float, ...]:
        """The pseudo-counts behind :meth:`alphas` (prior strength + forgetting-weighted reached counts)."""
        return self._reported.posterior(self.prior, max_depth)[1]

    def alphas(self, max_depth: int) -> tuple[float, ...]:
        """Estimated acceptance at depths 1 .. ``max_depth`` (index i is depth i + 1)."""
        return self._reported.posterior(self.prior, max_depth)[0]

    def recent_alphas(self, max_depth: int) -> tuple[float, ...]:
        """The same from the recent counts only (what change detection compares against)."""
        return self._recent.posterior(self.prior, max_depth)[0]

    def alpha(self, depth: int) -> float:
        """Estimated acceptance at ``depth`` (1-based), conditional on reaching it."""
        if depth < 1:
            raise ValueError(f"depth is 1-based, got {depth}")
        return self.alphas(depth)[-1]

    def expected_accepted(self, depth: int) -> float:
        """E[accepted] for a chain of ``depth`` drafts: Σ_{i ≤ depth} Π_{j ≤ i} α̂_j."""
        total, reach = 0.0, 1.0
        for a in self.alphas(depth):
            reach *= a
            total += reach
        return total

    def tree_bonus_per_node(self) -> float:
        """Expected extra accepted tokens per tree node beyond the chain of the tree's depth (>= 0)."""
        strength = self.prior.strength
        estimate = (strength * self.prior.tree_bonus_per_node + self._bonus_sum) / (strength + self._bonus_weight)
        return max(0.0, estimate)

    def known_depths(self, min_weight: float) -> int:
        """How many leading depths have at least ``min_weight`` forgetting-weighted observations."""
        counts = self._reported.reached
        n = 0
        while n < len(counts) and counts[n] >= min_weight:
            n += 1
        return n
