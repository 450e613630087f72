"""The performance model (docs/architecture.md#performance-model) as pure functions: tokens, time, rate.

Per cycle, T = T_draft(budget) + T_verify(k) (sequential) or max(T_draft, T_verify) (overlap mode), with
k = draft nodes + 1 (the root). A chain of γ drafts with conditional acceptance α̂_1 .. α̂_γ yields
E[accepted + 1] = 1 + Σ_{i ≤ γ} Π_{j ≤ i} α̂_j tokens; with a constant α that is (1 − α^{γ+1}) / (1 − α).
γ = 0 is plain decoding: one token per T_verify(1).

Trees are modelled simply: a tree of depth D and N nodes yields what a chain of depth D yields plus
``tree_bonus_per_node`` (an estimate from observed trees, :class:`~specserve.policies.acceptance.AcceptanceEstimator`)
per node beyond the D of its main path, never more than D accepted. Its draft cost is T_draft(D) (one draft
forward per level) and its verify cost T_verify(N + 1).

Not here: estimating any of these inputs (:mod:`specserve.policies.estimators`) or choosing a budget
(:mod:`specserve.policies.policies`).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

from specserve.core.tree.shapes import TreeSpec
from specserve.policies.base import Budget, PolicyState
from specserve.policies.prior import TREE_BONUS_KEY


def expected_accepted(alpha: Sequence[float], depth: int) -> float:
    """E[accepted] for a chain of ``depth`` drafts; depths past ``alpha``'s end reuse its last entry."""
    if depth <= 0:
        return 0.0
    if not alpha:
        raise ValueError("need at least one acceptance estimate")
    total, reach = 0.0, 1.0
    for i in range(depth):
        reach *= alpha[min(i, len(alpha) - 1)]
        total += reach
    return total


def expected_tokens_constant(alpha: float, gamma: int) -> float:
    """E[accepted + 1] for a chain of ``gamma`` drafts at constant acceptance: (1 − α^{γ+1}) / (1 − α)."""
    if not 0.0 <= alpha <= 1.0:
        raise ValueError(f"alpha must lie in [0, 1], got {alpha}")
    if alpha == 1.0:
        return gamma + 1.0
    return (1.0 - alpha ** (gamma + 1)) / (1.0 - alpha)


def tree_depth(spec: TreeSpec) -> int:
    """Levels below the root of a tree spec (its longest path)."""
    if spec.kind == "static":
        assert spec.topology is not None
        return max(len(path) for path in spec.topology.paths)
    assert spec.budget is not None
    return spec.budget.depth


def budget_depth(budget: Budget) -> int:
    """How many tokens a budget can get accepted at most (γ for a chain, the depth for a tree)."""
    return budget.gamma if budget.tree is None else tree_depth(budget.tree)


def expected_tokens(state: PolicyState, budget: Budget) -> float:
    """E[accepted + 1] for one cycle of ``budget`` under ``state``'s estimates."""
    depth = budget_depth(budget)
    accepted = expected_accepted(state.alpha, depth)
    if budget.tree is not None:
        extra_nodes = max(0, budget.nodes - depth)
        accepted = min(float(depth), accepted + state.extra.get(TREE_BONUS_KEY, 0.0) * extra_nodes)
    return 1.0 + accepted


def cycle_seconds(state: PolicyState, budget: Budget, overlap: bool = False) -> float:
    """Predicted seconds for one cycle of ``budget``: draft + verify, or their max in overlap mode."""
    draft = state.t_draft(budget_depth(budget))
    verify = state.t_verify(budget.nodes + 1)
    return max(draft, verify) if overlap else draft + verify


def predicted_rate(state: PolicyState, budget: Budget, overlap: bool = False) -> float:
    """Predicted tokens per second of ``budget`` under ``state``'s estimates."""
    return expected_tokens(state, budget) / cycle_seconds(state, budget, overlap)


def constant_alpha_rate(
    alpha: float,
    gamma: int,
    t_draft_per_token: float,
    t_draft_fixed: float,
    t_verify: Callable[[int], float],
    overlap: bool = False,
) -> float:
    """Tokens per second of a chain of ``gamma`` at constant acceptance ``alpha`` (closed form)."""
    draft = 0.0 if gamma == 0 else t_draft_fixed + t_draft_per_token * gamma
    verify = t_verify(gamma + 1)
    seconds = max(draft, verify) if overlap else draft + verify
    return expected_tokens_constant(alpha, gamma) / seconds


def optimal_gamma(
    alpha: float,
    t_draft_per_token: float,
    t_draft_fixed: float,
    t_verify: Callable[[int], float],
    max_gamma: int,
    overlap: bool = False,
) -> int:
    """argmax over γ ∈ {0 .. max_gamma} of the expected rate at constant acceptance ``alpha`` (ties: the smaller γ).

    Worked example: α = 0.8, 1.3 ms per draft token, no fixed draft cost, T_verify(k) = 13.5 ms at k = 1
    and 17.5 + 0.45 · (k − 2) ms from k = 2: γ = 0 gives 1 / 13.5 ms = 74 tokens/s, γ = 4 gives
    3.36 / 24.1 ms = 140, γ = 5 gives 3.69 / 25.8 ms = 143.0, γ = 6 gives 3.95 / 27.6 ms = 143.4 (the best),
    γ = 10 gives 4.57 / 34.6 ms = 132.
    """
    if max_gamma < 0:
        raise ValueError(f"max_gamma must be >= 0, got {max_gamma}")
    rates = [
        constant_alpha_rate(alpha, g, t_draft_per_token, t_draft_fixed, t_verify, overlap) for g in range(max_gamma + 1)
    ]
    return max(range(len(rates)), key=lambda g: (rates[g], -g))
