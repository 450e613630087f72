"""Drafting and verification cost, online: T_draft(γ) by a weighted line fit, T_verify(k) per verified width.

:class:`CostEstimator` is one request's (or one replica's) estimate of what drafting γ tokens and verifying k
positions cost, padded to the engine's verify buckets when it has them; its conventions are those of
:mod:`specserve.policies.estimators`. Does not estimate acceptance (:mod:`specserve.policies.acceptance`) or what a
batched step costs (:mod:`specserve.policies.step_costs`), choose a budget, or read a clock: callers pass seconds in.
"""

from __future__ import annotations

import bisect
from collections.abc import Sequence

from specserve.core.model.buckets import NO_BUCKETS, VerifyBuckets
from specserve.policies.base import CycleObservation
from specserve.policies.prior import (
    DEFAULT_PRIOR,
    REQUEST_HALF_LIFE_CYCLES,
    VERIFY_TABLE_SIZE,
    EstimatorPrior,
    decay_factor,
    linear_extrapolation,
    weighted_line,
)

COST_PRIOR_WEIGHT = 1.0
"""Weight (in cycles) of each prior pseudo-observation in the cost fits: enough to define the fit before any
data, small against the ≈ 24 cycles of a request's window."""

_MIN_VERIFY_WEIGHT = 1e-9  # an observed k never decays to "unobserved": its value stays the latest known
_MIN_SECONDS = 1e-9


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
        return weighted_line([(k, self._verify_mean[k], self._verify_weight[k]) for k in self._verify_mean if k >= 2])

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
        return linear_extrapolation(self.verify_table(horizon), k)
