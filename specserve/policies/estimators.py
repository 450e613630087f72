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
* **Verify buckets.** Given :class:`~specserve.core.buckets.VerifyBuckets` (a static-shape engine pads a
  block of k positions up to ``buckets.width(k)``), verify times are learned per width the forward ran at,
  and T_verify(k) is priced at its bucket — never above a wider bucket's cost (see :class:`CostEstimator`).
  Without buckets (the default) every block runs at its own width, as before.

Not here: choosing a budget (:mod:`specserve.policies.policies`), the rate model
(:mod:`specserve.policies.rates`), per-request bookkeeping of decisions
(:mod:`specserve.policies.controller`). Nothing here reads a clock: callers time the cycle and pass the
seconds in. Batched steps: T_verify(k) learns from cycles verified alone; what a batched step costs is
learned by :mod:`specserve.policies.step_costs` (an observation with ``batch_size > 1`` adds its acceptance and
draft cost here, not its verify time).
"""

from __future__ import annotations

import bisect
import math
import threading
from collections.abc import Sequence
from dataclasses import dataclass, field

from specserve.core.buckets import NO_BUCKETS, VerifyBuckets
from specserve.policies.base import Budget, CycleObservation, PolicyState

# ---------------------------------------------------------------------------------------------------------
# Constants

DEFAULT_ALPHA = 0.6
"""Prior acceptance when nothing is known: the shipped draft's per-position acceptance in the engine is 0.68-0.75
greedy and 0.61-0.68 at T = 1 (models/README.md, BENCHMARKS.md §1), and weaker drafters (n-gram lookup on prose)
sit far lower; 0.6 errs low, so a request starts with a moderate γ and the first few cycles correct it either way."""

PRIOR_STRENGTH = 4.0
"""Pseudo-counts behind every depth's prior mean: a request's own evidence outweighs the prior after four
cycles that reach a depth, quickly enough for per-request differences (code versus prose) to show, slowly
enough that a single unlucky first cycle does not switch speculation off."""

REQUEST_HALF_LIFE_CYCLES = 16.0
"""A request's recent memory: weights halve every 16 cycles (an effective window of 1 / (1 − 2^(−1/16)) ≈ 23.6
cycles). It is what costs are tracked with and what acceptance changes are detected with: after a collapse
of acceptance (a drafter that stops agreeing) speculation stopped within 54 cycles instead of 105 with 32 (the
worst of 20 seeded synthetic runs, tests/policies). Its noise (standard error ≈ 0.06 at α = 0.8) does not reach
decisions directly: acceptance is read from the long memory below."""

REQUEST_LONG_HALF_LIFE_CYCLES = 256.0
"""A request's long acceptance memory (≈ 740 effective samples for the variance at steady state): the
estimate a policy reads while nothing changes. On a flat rate curve neighbouring γ differ by 1–3 %, finer than
a 16- or 32-cycle estimate resolves (with one 32-cycle memory the settled γ missed the closed-form optimum,
beyond ±1 within 2 %, in about a quarter of seeded runs); a change still shows within the recent half-life
because the long memory restarts from the recent one (see :class:`AcceptanceEstimator`)."""

CHANGE_Z = 3.0
"""Standard errors by which the recent and long estimates at a depth must differ before the long memory
restarts from the recent one (a false restart is harmless: it only costs the long memory's extra precision
for a while)."""

RESUME_GAP_CYCLES = 8
"""Cycles without drafting after which the next drafting cycle restarts the long memory (a probe after an
off period speaks for the present; shorter gaps — a drafter that found nothing once — do not)."""

REPLICA_HALF_LIFE_CYCLES = 512.0
"""The replica's pooled memory: many requests' cycles, so a longer window (≈ 740 cycles) that follows a
drift in the workload but not one request's peculiarities."""

DEFAULT_DRAFT_SECONDS_PER_TOKEN = 1.3e-3  # the shipped 1-layer draft on the development CPU (≈ 1.3 ms/token)
DEFAULT_DRAFT_FIXED_SECONDS = 0.0
DEFAULT_VERIFY_SECONDS_K1 = 13.5e-3  # the shipped 8-layer target at k = 1 (matrix-vector kernels)
DEFAULT_VERIFY_SECONDS_K2 = 17.5e-3  # ... and its k >= 2 line: 17.5 ms + 0.45 ms per extra position
DEFAULT_VERIFY_SECONDS_PER_POSITION = 0.45e-3
DEFAULT_TREE_BONUS_PER_NODE = 0.05
"""Expected extra accepted tokens per side node of a tree, before any tree was observed: a second-choice
child is accepted only when the first was rejected and the target agrees with the drafter's runner-up,
a few percent of the time for the shipped pair. A rough starting point, replaced by observations."""

COST_PRIOR_WEIGHT = 1.0
"""Weight (in cycles) of each prior pseudo-observation in the cost fits: enough to define the fit before any
data, small against the ≈ 24 cycles of a request's window."""

VERIFY_TABLE_SIZE = 65
"""Positions k = 1 .. 65 in a snapshot's T_verify table (a 64-node tree plus the root); beyond it
:meth:`PolicyState.t_verify` extrapolates linearly."""

DEFAULT_MAX_DEPTH = 16
TREE_BONUS_KEY = "tree_bonus_per_node"  # PolicyState.extra key read by the rate model for trees

_MIN_VERIFY_WEIGHT = 1e-9  # an observed k never decays to "unobserved": its value stays the latest known
_MIN_SECONDS = 1e-9


def decay_factor(half_life: float | None) -> float:
    """Per-cycle weight multiplier for a half-life in cycles; ``None`` means no forgetting (1.0)."""
    if half_life is None:
        return 1.0
    if not half_life > 0:
        raise ValueError(f"half_life must be > 0 cycles (or None for no forgetting), got {half_life}")
    return 2.0 ** (-1.0 / half_life)


def _linear_extrapolation(table: Sequence[float], k: int) -> float:
    """``table[k - 1]``, or a linear continuation of its last two entries (never decreasing)."""
    if k <= len(table):
        return table[k - 1]
    if len(table) >= 2:
        return table[-1] + max(0.0, table[-1] - table[-2]) * (k - len(table))
    return table[-1]


# ---------------------------------------------------------------------------------------------------------
# Prior


def _default_verify_table() -> tuple[float, ...]:
    line = (DEFAULT_VERIFY_SECONDS_K2 + DEFAULT_VERIFY_SECONDS_PER_POSITION * (k - 2) for k in range(2, 18))
    return (DEFAULT_VERIFY_SECONDS_K1, *line)


@dataclass(frozen=True)
class EstimatorPrior:
    """What a new request's estimators start from: a replica's pooled estimates, or the defaults.

    ``alpha`` covers only the depths the replica has evidence for; deeper depths take their prior mean
    from the request's own estimate at the depth above (and depth 1 from :data:`DEFAULT_ALPHA`).
    """

    alpha: tuple[float, ...] = ()  # [known depths] prior mean acceptance at depth i + 1
    strength: float = PRIOR_STRENGTH  # pseudo-counts behind each depth's prior mean
    draft_seconds_per_token: float = DEFAULT_DRAFT_SECONDS_PER_TOKEN
    draft_fixed_seconds: float = DEFAULT_DRAFT_FIXED_SECONDS
    # [k] T_verify(k), k = 1.. : what a target forward over k positions costs (a width, if blocks are padded)
    verify_seconds: tuple[float, ...] = field(default_factory=_default_verify_table)
    tree_bonus_per_node: float = DEFAULT_TREE_BONUS_PER_NODE
    plain_measured: bool = False  # whether verify_seconds[0] (plain decoding, k = 1) was measured, not assumed

    def __post_init__(self) -> None:
        if not self.strength > 0:
            raise ValueError(f"prior strength must be > 0 pseudo-counts, got {self.strength}")
        if any(not 0.0 <= a <= 1.0 for a in self.alpha):
            raise ValueError(f"prior acceptance rates must lie in [0, 1], got {self.alpha}")
        if not self.verify_seconds or any(not t > 0 for t in self.verify_seconds):
            raise ValueError(
                f"prior verify times must be a non-empty table of positive seconds, got {self.verify_seconds}"
            )
        if self.draft_seconds_per_token < 0 or self.draft_fixed_seconds < 0:
            raise ValueError("prior draft costs must be >= 0 seconds")

    def t_verify(self, k: int) -> float:
        return _linear_extrapolation(self.verify_seconds, k)


DEFAULT_PRIOR = EstimatorPrior()


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


# ---------------------------------------------------------------------------------------------------------
# Costs


class CostEstimator:
    """Drafting and verification cost, online.

    **Draft**: T_draft(γ) = fixed + per_token · γ by weighted least squares over drafting cycles
    (x = depth drafted, y = draft seconds), with forgetting, plus two never-forgotten pseudo-observations
    of weight :data:`COST_PRIOR_WEIGHT` from the prior, at x = 0 (the prior's fixed cost) and x = 1. When
    every cycle drafts the same γ the data cannot separate the two terms; the x = 0 pseudo-point then
    attributes the cost to the per-token term, the safer reading for choosing γ. Both terms are clamped
    at >= 0.

    **Verify**: an exponentially weighted mean per observed width w, the positions the target forward ran
    at (without buckets w = k = drafted + 1; a plain cycle is k = 1). An unobserved w >= 2 is read off a
    weighted linear fit over the observed w >= 2 (weights = the forgetting weights, slope clamped at >= 0)
    when at least two distinct w >= 2 were observed; otherwise off the prior's curve scaled to the observed
    level. The w = 1 value is never part of the line: a measured T(1) is kept as measured; unmeasured, it is
    the prior's w = 1 scaled like the rest. :meth:`width_table` is that curve.

    **Buckets**: with ``buckets`` a block of k positions runs at ``w = buckets.width(k)``, so it is recorded
    under w, and the prior's shape is read at w too (the prior's table is per width). An unobserved width is
    then not read off the line but off the prior's curve, scaled by the measured / prior ratio interpolated
    between the nearest observed widths on either side (the nearest one's ratio past either end): a bucketed
    curve need not be a line (a wider bucket can be the cheaper: aligned kernels, one graph per width), and a
    prior that measured the buckets (a replica's pooled table, or a start-up measurement) keeps its shape where
    this request has seen nothing, so a cheaper wider bucket is known before it is tried. T_verify(k) is then
    T(w), lowered to the cheapest wider bucket within the table — min over buckets b with w <= b <= max_k of
    T(b), a lower envelope from the right — so no k looks dearer than a bucket it could fill with more drafts.
    A k whose own bucket costs more than that (:meth:`dominated`: possible with buckets not chosen from
    measurements, or after costs drift) would still run at its own, dearer, bucket, so the adaptive policy
    drafts no chain of such a k (:class:`~specserve.policies.policies.AdaptivePolicy`). Without buckets
    (``None`` or empty) nothing is padded and T_verify(k) is T(k).
    """

    def __init__(
        self,
        prior: EstimatorPrior = DEFAULT_PRIOR,
        half_life: float | None = REQUEST_HALF_LIFE_CYCLES,
        buckets: VerifyBuckets | None = None,
    ):
        self.prior = prior
        self.half_life = half_life
        self.buckets = buckets if buckets is not None else NO_BUCKETS
        self._decay = decay_factor(half_life)
        # draft: forgetting-weighted sums of w, w·x, w·y, w·x², w·x·y over drafting cycles
        self._w = self._x = self._y = self._xx = self._xy = 0.0
        # verify: per width run at, the weighted mean seconds and its forgetting weight
        self._verify_mean: dict[int, float] = {}
        self._verify_weight: dict[int, float] = {}

    def observe(self, obs: CycleObservation) -> None:
        if obs.batch_size == 1:  # a batched step's time is the whole batch's (specserve.policies.step_costs)
            self.observe_verify(obs.drafted + 1, obs.verify_seconds + obs.wire_seconds)
        # drafting was attempted, even if the drafter came back empty; a resumed drafter's catch-up is not per-cycle
        if obs.budget.nodes > 0 and not obs.resumed:
            self.observe_draft(obs.depth, obs.draft_seconds)

    def observe_verify(self, k: int, seconds: float) -> None:
        """One verify of ``k`` positions (root included) that took ``seconds``, recorded under the width it ran
        at (``buckets.width(k)``); ages every width."""
        if k < 1:
            raise ValueError(f"verify positions k must be >= 1, got {k}")
        width = self.buckets.width(k)
        for key in self._verify_weight:
            self._verify_weight[key] = max(_MIN_VERIFY_WEIGHT, self._verify_weight[key] * self._decay)
        weight = self._verify_weight.get(width, 0.0)
        mean = self._verify_mean.get(width, 0.0)
        self._verify_mean[width] = (weight * mean + seconds) / (weight + 1.0)
        self._verify_weight[width] = weight + 1.0

    def observe_draft(self, depth: int, seconds: float) -> None:
        """One drafting step of ``depth`` levels that took ``seconds``; ages the draft statistics."""
        d = self._decay
        self._w = self._w * d + 1.0
        self._x = self._x * d + depth
        self._y = self._y * d + seconds
        self._xx = self._xx * d + depth * depth
        self._xy = self._xy * d + depth * seconds

    # -- draft

    def draft_fit(self) -> tuple[float, float]:
        """(fixed seconds, seconds per token) of T_draft(γ) = fixed + per_token · γ."""
        f0, b0, p = self.prior.draft_fixed_seconds, self.prior.draft_seconds_per_token, COST_PRIOR_WEIGHT
        # pseudo-observations (0, f0) and (1, f0 + b0), each of weight p
        w = self._w + 2 * p
        x = self._x + p
        y = self._y + p * (2 * f0 + b0)
        xx = self._xx + p
        xy = self._xy + p * (f0 + b0)
        det = w * xx - x * x  # > 0: the pseudo-points sit at two distinct x
        per_token = (w * xy - x * y) / det
        fixed = (y - per_token * x) / w
        if fixed < 0.0:  # refit through the origin
            fixed, per_token = 0.0, max(0.0, xy / xx)
        elif per_token < 0.0:
            fixed, per_token = y / w, 0.0
        return fixed, per_token

    def t_draft(self, gamma: int) -> float:
        if gamma <= 0:
            return 0.0
        fixed, per_token = self.draft_fit()
        return fixed + per_token * gamma

    # -- verify

    def observed_verify(self) -> dict[int, float]:
        """The measured T(w) for every width w a verify ran at so far (w = k without buckets)."""
        return dict(self._verify_mean)

    @property
    def plain_measured(self) -> bool:
        """Whether plain decoding's cost (a block of k = 1, at its width) was measured here."""
        return self.buckets.width(1) in self._verify_mean

    def _line(self) -> tuple[float, float] | None:
        """(intercept, slope) of the weighted fit over observed w >= 2, or None with < 2 distinct w."""
        points = [(k, self._verify_mean[k], self._verify_weight[k]) for k in self._verify_mean if k >= 2]
        if len(points) < 2:
            return None
        w = sum(p[2] for p in points)
        x = sum(p[2] * p[0] for p in points) / w
        y = sum(p[2] * p[1] for p in points) / w
        sxx = sum(p[2] * (p[0] - x) ** 2 for p in points)
        sxy = sum(p[2] * (p[0] - x) * (p[1] - y) for p in points)
        slope = max(0.0, sxy / sxx) if sxx > 0 else 0.0
        return y - slope * x, slope

    def _prior_ratio(self, ks: Sequence[int]) -> float | None:
        """Observed level relative to the prior's curve over widths ``ks`` (weighted), or None if none observed."""
        ks = [k for k in ks if k in self._verify_mean]
        if not ks:
            return None
        measured = sum(self._verify_weight[k] * self._verify_mean[k] for k in ks)
        expected = sum(self._verify_weight[k] * self.prior.t_verify(k) for k in ks)
        return measured / expected

    def width_table(self, max_width: int = VERIFY_TABLE_SIZE) -> tuple[float, ...]:
        """T(w) of a forward at width w = 1 .. ``max_width``: measured where observed, filled as the class
        docstring says; no bucket is applied (this is what a replica exports as a prior)."""
        if max_width < 1:
            raise ValueError(f"max_width must be >= 1, got {max_width}")
        if self.buckets.widths:
            return self._prior_shaped_widths(max_width)
        line = self._line()
        multi = [k for k in self._verify_mean if k >= 2]
        ratio_multi = self._prior_ratio(multi)
        ratio_one = self._prior_ratio([1])
        table: list[float] = []
        for k in range(1, max_width + 1):
            if k in self._verify_mean:
                value = self._verify_mean[k]
            elif k >= 2 and line is not None:
                value = line[0] + line[1] * k
            else:
                ratio = ratio_multi if ratio_multi is not None else ratio_one
                value = self.prior.t_verify(k) * (1.0 if ratio is None else ratio)
            table.append(max(_MIN_SECONDS, value))
        return tuple(table)

    def _prior_shaped_widths(self, max_width: int) -> tuple[float, ...]:
        """T(w) for w = 1 .. ``max_width`` with buckets: measured where observed, else the prior's T(w) times the
        measured / prior ratio interpolated between the nearest observed widths (see the class docstring)."""
        observed = sorted(self._verify_mean)
        ratios = [self._verify_mean[w] / self.prior.t_verify(w) for w in observed]
        table: list[float] = []
        for w in range(1, max_width + 1):
            i = bisect.bisect_left(observed, w)
            if i < len(observed) and observed[i] == w:
                value = self._verify_mean[w]
            else:
                if not observed:
                    ratio = 1.0
                elif i == 0:
                    ratio = ratios[0]
                elif i == len(observed):
                    ratio = ratios[-1]
                else:
                    lo, hi = observed[i - 1], observed[i]
                    ratio = ratios[i - 1] + (ratios[i] - ratios[i - 1]) * (w - lo) / (hi - lo)
                value = self.prior.t_verify(w) * ratio
            table.append(max(_MIN_SECONDS, value))
        return tuple(table)

    def verify_prices(self, max_k: int = VERIFY_TABLE_SIZE) -> tuple[tuple[float, ...], frozenset[int]]:
        """(:meth:`verify_table`, :meth:`dominated`) at once: T_verify(k) for k = 1 .. ``max_k``, and the k whose
        own bucket costs more than that (see the class docstring)."""
        if max_k < 1:
            raise ValueError(f"max_k must be >= 1, got {max_k}")
        if not self.buckets.widths:
            return self.width_table(max_k), frozenset()
        widths = self.width_table(max(max_k, self.buckets.width(max_k)))
        # cheapest[i]: the cheapest bucket from the i-th on, within the table (the envelope from the right)
        inside = [b for b in self.buckets.widths if b <= max_k]
        cheapest = [widths[b - 1] for b in inside]
        for i in range(len(cheapest) - 2, -1, -1):
            cheapest[i] = min(cheapest[i], cheapest[i + 1])
        table: list[float] = []
        dominated: set[int] = set()
        for k in range(1, max_k + 1):
            width = self.buckets.width(k)
            own = widths[width - 1]
            index = bisect.bisect_left(inside, width)
            value = min(own, cheapest[index]) if index < len(inside) else own
            if value < own:
                dominated.add(k)
            table.append(value)
        return tuple(table), frozenset(dominated)

    def verify_table(self, max_k: int = VERIFY_TABLE_SIZE) -> tuple[float, ...]:
        """T_verify(k) for k = 1 .. ``max_k``: T at k's width, filled and (with buckets) enveloped as the class
        docstring says."""
        return self.verify_prices(max_k)[0]

    def dominated(self, max_k: int = VERIFY_TABLE_SIZE) -> frozenset[int]:
        """The k <= ``max_k`` whose bucket costs more than a wider bucket within the table (empty without buckets)."""
        return self.verify_prices(max_k)[1]

    def t_verify(self, k: int) -> float:
        # with buckets, the envelope reaches as far as the policy's table does, so this agrees with it
        horizon = max(k, 2) if not self.buckets.widths else max(k, VERIFY_TABLE_SIZE)
        return _linear_extrapolation(self.verify_table(horizon), k)


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
    ) -> PolicyState:
        """The state a policy decides from; ``previous`` and the decision counters come from the caller."""
        fixed, per_token = self.costs.draft_fit()
        verify_seconds, dominated = self.costs.verify_prices(max_k)
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


def effective_window(half_life: float | None) -> float:
    """Total forgetting weight at steady state, in cycles (1 / (1 − λ)); infinite without forgetting."""
    d = decay_factor(half_life)
    return math.inf if d == 1.0 else 1.0 / (1.0 - d)
