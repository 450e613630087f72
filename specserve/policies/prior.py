"""What every estimator of the policies starts from: the defaults, the forgetting, and the prior a request begins with.

The constants (a default acceptance, pseudo-counts, half-lives, the shipped pair's costs), :func:`decay_factor`
(per-cycle forgetting for a half-life) and :class:`EstimatorPrior` (a replica's pooled estimates, or the defaults),
shared by the acceptance estimator (:mod:`specserve.policies.acceptance`), the cost estimator
(:mod:`specserve.policies.costs`), the step-cost estimator and the bundles of :mod:`specserve.policies.estimators`.
Does not estimate anything itself, nor read a clock.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass, field

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

VERIFY_TABLE_SIZE = 65
"""Positions k = 1 .. 65 in a snapshot's T_verify table (a 64-node tree plus the root); beyond it
:meth:`PolicyState.t_verify` extrapolates linearly."""

DEFAULT_MAX_DEPTH = 16
TREE_BONUS_KEY = "tree_bonus_per_node"  # PolicyState.extra key read by the rate model for trees


def decay_factor(half_life: float | None) -> float:
    """Per-cycle weight multiplier for a half-life in cycles; ``None`` means no forgetting (1.0)."""
    if half_life is None:
        return 1.0
    if not half_life > 0:
        raise ValueError(f"half_life must be > 0 cycles (or None for no forgetting), got {half_life}")
    return 2.0 ** (-1.0 / half_life)


def weighted_line(points: Sequence[tuple[float, float, float]]) -> tuple[float, float] | None:
    """(intercept, slope) of the weighted least-squares line through ``points`` (x, y, weight), the slope clamped at
    >= 0 (a cost never falls with more positions); None with fewer than two points."""
    if len(points) < 2:
        return None
    w = sum(p[2] for p in points)
    x = sum(p[2] * p[0] for p in points) / w
    y = sum(p[2] * p[1] for p in points) / w
    sxx = sum(p[2] * (p[0] - x) ** 2 for p in points)
    sxy = sum(p[2] * (p[0] - x) * (p[1] - y) for p in points)
    slope = max(0.0, sxy / sxx) if sxx > 0 else 0.0
    return y - slope * x, slope


def linear_extrapolation(table: Sequence[float], k: int) -> float:
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
        return linear_extrapolation(self.verify_seconds, k)


DEFAULT_PRIOR = EstimatorPrior()


def effective_window(half_life: float | None) -> float:
    """Total forgetting weight at steady state, in cycles (1 / (1 − λ)); infinite without forgetting."""
    d = decay_factor(half_life)
    return math.inf if d == 1.0 else 1.0 / (1.0 - d)
