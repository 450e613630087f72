"""Synthetic cycle streams for the policy tests: known acceptance per depth, known cost curves, no models.

Acceptance at each depth is an i.i.d. Bernoulli draw from a seeded ``random.Random`` (a test fixture's
randomness, not sampling); costs come from a known curve with small multiplicative noise. Nothing here
decides anything: it only plays the part of drafter + target for a controller.
"""

from __future__ import annotations

import bisect
import random
from collections.abc import Callable, Sequence

from specserve.policies import Budget, CycleObservation, SpeculationController

MS = 1e-3

# T_verify(k) measured for the shipped pair on the development CPU (k: milliseconds); the k = 1 -> 2 step is
# matrix-vector versus matrix-matrix kernels, and k = 5 really is a little cheaper than k = 2.
CPU_VERIFY_POINTS_MS: tuple[tuple[int, float], ...] = (
    (1, 13.5),
    (2, 19.0),
    (5, 18.0),
    (9, 20.0),
    (17, 23.5),
    (33, 32.0),
)
DRAFT_MS_PER_TOKEN = 1.3


def cpu_verify_seconds(k: int) -> float:
    """Piecewise-linear interpolation of :data:`CPU_VERIFY_POINTS_MS`, extended linearly past k = 33."""
    ks = [p[0] for p in CPU_VERIFY_POINTS_MS]
    ms = [p[1] for p in CPU_VERIFY_POINTS_MS]
    if k >= ks[-1]:
        slope = (ms[-1] - ms[-2]) / (ks[-1] - ks[-2])
        return (ms[-1] + slope * (k - ks[-1])) * MS
    i = bisect.bisect_left(ks, k)
    if ks[i] == k:
        return ms[i] * MS
    t = (k - ks[i - 1]) / (ks[i] - ks[i - 1])
    return (ms[i - 1] + t * (ms[i] - ms[i - 1])) * MS


def linear_verify(base_ms: float, per_position_ms: float, k1_ms: float | None = None) -> Callable[[int], float]:
    """T_verify(k) = base + per_position · (k − 1) ms, optionally with a distinct k = 1 value."""

    def t_verify(k: int) -> float:
        if k == 1 and k1_ms is not None:
            return k1_ms * MS
        return (base_ms + per_position_ms * (k - 1)) * MS

    return t_verify


AlphaSchedule = Callable[[int], Sequence[float]]  # cycle -> acceptance per depth (last entry repeats)


def constant_alpha(alpha: float) -> AlphaSchedule:
    return lambda cycle: (alpha,)


def draw_accepted(rng: random.Random, alphas: Sequence[float], depth: int) -> int:
    """Accepted path length of a chain of ``depth`` drafts, each depth accepted with its own probability."""
    accepted = 0
    while accepted < depth and rng.random() < alphas[min(accepted, len(alphas) - 1)]:
        accepted += 1
    return accepted


def chain_observation(
    budget: Budget,
    accepted: int,
    t_verify: Callable[[int], float],
    rng: random.Random,
    draft_ms_per_token: float = DRAFT_MS_PER_TOKEN,
    draft_fixed_ms: float = 0.0,
    noise: float = 0.02,
) -> CycleObservation:
    """What one chain cycle of ``budget`` reports, with ±``noise`` relative jitter on both times."""
    gamma = budget.gamma
    draft = 0.0 if gamma == 0 else (draft_fixed_ms + draft_ms_per_token * gamma) * MS
    return CycleObservation(
        budget=budget,
        drafted=gamma,
        depth=gamma,
        accepted=accepted,
        draft_seconds=draft * (1 + rng.uniform(-noise, noise)),
        verify_seconds=t_verify(gamma + 1) * (1 + rng.uniform(-noise, noise)),
    )


def observe_stream(
    controller: SpeculationController,
    alpha: AlphaSchedule,
    cycles: int,
    t_verify: Callable[[int], float],
    seed: int,
    draft_ms_per_token: float = DRAFT_MS_PER_TOKEN,
) -> list[CycleObservation]:
    """Drive ``controller`` for ``cycles`` cycles of a long request; return every cycle's observation."""
    rng = random.Random(seed)
    observations: list[CycleObservation] = []
    for cycle in range(cycles):
        budget = controller.next_budget(1_000_000)
        accepted = draw_accepted(rng, alpha(cycle), budget.gamma)
        observation = chain_observation(budget, accepted, t_verify, rng, draft_ms_per_token)
        controller.observe(observation)
        observations.append(observation)
    return observations


def run_stream(
    controller: SpeculationController,
    alpha: AlphaSchedule,
    cycles: int,
    t_verify: Callable[[int], float],
    seed: int,
    draft_ms_per_token: float = DRAFT_MS_PER_TOKEN,
) -> list[int]:
    """Drive ``controller`` for ``cycles`` cycles of a long request; return the γ sent each cycle."""
    observations = observe_stream(controller, alpha, cycles, t_verify, seed, draft_ms_per_token)
    return [o.budget.gamma for o in observations]
