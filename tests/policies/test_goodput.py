"""Goodput-aware budgets in batched steps: the step-cost curve, and the adaptive policy's choices under load.

Synthetic batches, no models: B requests, each with its own controller and constant acceptance, share one
:class:`~specserve.policies.step_costs.StepCostEstimator` (as the requests of one replica do). A step's
drafting chains are cut to the width that pays best for the step (as the batched engine does), and the step
costs T_step(B · k_max) from a known curve — the shipped target's measured forward times (issue 15: 12.5 ms
for 1 position, 18.8 ms for 5, 24.6 ms for 16 rows of one, 64.3 ms for 16 rows of 5) — plus each request's
drafting, ±2 % noise. The adaptive policy must draft less as the batch grows, switch off where drafting no
longer pays, keep drafting longer for well-accepted drafts, come back on when the batch shrinks, and reach
(close to) the batch goodput of the best fixed γ in hindsight at every batch size.
"""

from __future__ import annotations

import bisect
import random
import statistics

import pytest
from synthetic_streams import MS, draw_accepted

from specserve.core.draft_side import choose_chains
from specserve.policies import Budget, CycleObservation, ReplicaPrior, SpeculationController, build_policy
from specserve.policies.prior import EstimatorPrior
from specserve.policies.rates import expected_tokens_constant
from specserve.policies.step_costs import StepCostEstimator

STEP_POINTS_MS = ((1, 12.5), (5, 18.8), (16, 24.6), (80, 64.3))
DRAFT_MS_PER_TOKEN = 0.3  # a draft model drafting for the whole batch in shared forwards, per request


def step_seconds(positions: int) -> float:
    xs = [p[0] for p in STEP_POINTS_MS]
    ys = [p[1] for p in STEP_POINTS_MS]
    if positions >= xs[-1]:
        slope = (ys[-1] - ys[-2]) / (xs[-1] - xs[-2])
        return (ys[-1] + slope * (positions - xs[-1])) * MS
    i = bisect.bisect_left(xs, positions)
    if xs[i] == positions:
        return ys[i] * MS
    t = (positions - xs[i - 1]) / (xs[i] - xs[i - 1])
    return (ys[i - 1] + t * (ys[i] - ys[i - 1])) * MS


def batch_goodput(alphas: list[float], gammas: list[int]) -> float:
    """Expected committed tokens per second of one step of these requests (drafting sequential, per request)."""
    width = max(gammas) + 1
    seconds = step_seconds(len(alphas) * width) + sum(g * DRAFT_MS_PER_TOKEN * MS for g in gammas)
    return sum(expected_tokens_constant(a, g) for a, g in zip(alphas, gammas, strict=True)) / seconds


class Batch:
    """B requests with adaptive controllers sharing one replica prior and one step-cost estimator."""

    def __init__(self, alphas: list[float], seed: int = 0) -> None:
        self.prior = ReplicaPrior(EstimatorPrior(plain_measured=True))
        self.steps = StepCostEstimator(self.prior.prior())
        self.alphas = alphas
        self.controllers = [self._controller() for _ in alphas]
        self.rng = random.Random(seed)
        self.planned: list[list[int]] = []  # the γ each controller planned, per step (before the width)

    def _controller(self) -> SpeculationController:
        return SpeculationController(build_policy("adaptive", max_gamma=8), self.prior, 8, step_costs=self.steps)

    def run(self, steps: int, size: int | None = None) -> list[list[int]]:
        """``steps`` steps of the first ``size`` requests (all by default); the γ each sent, per step."""
        active = list(range(size or len(self.alphas)))
        history = []
        for _ in range(steps):
            planned = [self.controllers[i].next_budget(1_000_000, len(active)).gamma for i in active]
            self.planned.append(planned)
            # as the batched engine does: the width that pays best for the step, plans cut or lengthened to it
            mine = [self.controllers[i] for i in active]
            gammas = choose_chains(
                planned,
                [c.max_chain for c in mine],
                [c.expected_tokens for c in mine],
                [c.draft_seconds for c in mine],
                mine[0].step_seconds,
                len(active),
            )
            budgets = [Budget(g) for g in gammas]
            positions = len(active) * (max(gammas) + 1)
            seconds = step_seconds(positions) * (1 + self.rng.uniform(-0.02, 0.02))
            for i, budget in zip(active, budgets, strict=True):
                accepted = draw_accepted(self.rng, (self.alphas[i],), budget.gamma)
                self.controllers[i].observe(
                    CycleObservation(
                        budget,
                        budget.gamma,
                        budget.gamma,
                        accepted,
                        draft_seconds=budget.gamma * DRAFT_MS_PER_TOKEN * MS,
                        verify_seconds=seconds,
                        batch_size=len(active),
                        step_positions=positions,
                    )
                )
            history.append(gammas)
        return history


def test_the_step_cost_curve_interpolates_extrapolates_and_scales_the_prior() -> None:
    prior = EstimatorPrior()
    steps = StepCostEstimator(prior)
    assert steps.t_step(40) == pytest.approx(prior.t_verify(40))  # nothing seen: the prior
    for positions, ms in STEP_POINTS_MS[1:]:
        for _ in range(3):
            steps.observe(positions, ms * MS)
    assert steps.t_step(16) == pytest.approx(24.6 * MS)
    assert steps.t_step(48) == pytest.approx((24.6 + (64.3 - 24.6) / 2) * MS)  # halfway between 16 and 80
    assert steps.t_step(160) > steps.t_step(80) == pytest.approx(64.3 * MS)  # past the largest: the line
    assert steps.t_step(2) == pytest.approx(prior.t_verify(2) * (18.8 * MS) / prior.t_verify(5))
    table = steps.per_request_table(16, 5)
    assert table[0] == pytest.approx(24.6 * MS / 16) and table[4] == pytest.approx(64.3 * MS / 16)
    with pytest.raises(ValueError, match="position"):
        steps.observe(0, 1.0)


def test_whole_plain_steps_are_measured_per_batch_size_and_scaled_along_the_curve_between() -> None:
    """A whole plain step (planning to verdicts) costs more than its forward: measured at a batch size, that is the
    answer there; at another, the nearest measured size's, scaled along T_step; before any, T_step itself."""
    steps = StepCostEstimator(EstimatorPrior())
    for positions, ms in STEP_POINTS_MS[1:]:
        steps.observe(positions, ms * MS)
    assert steps.t_plain_step(16) == pytest.approx(steps.t_step(16))  # nothing measured whole: the forward's
    for _ in range(16):  # one step of 16 rows, each row reporting a sixteenth of it
        steps.observe_plain_step(16, 30.0 * MS, 1 / 16)
    assert steps.t_plain_step(16) == pytest.approx(30.0 * MS)
    assert steps.t_plain_step(80) == pytest.approx(30.0 * MS * steps.t_step(80) / steps.t_step(16))
    steps.observe_plain_step(16, 40.0 * MS)  # a whole step more: the mean weighs steps, not rows
    assert steps.t_plain_step(16) == pytest.approx(35.0 * MS)
    for _ in range(200):  # a window of at most STEP_WINDOW steps: a slower machine is followed
        steps.observe_plain_step(16, 50.0 * MS)
    assert steps.t_plain_step(16) == pytest.approx(50.0 * MS, rel=1e-3)
    with pytest.raises(ValueError, match="batch_size"):
        steps.observe_plain_step(0, 1.0)
    with pytest.raises(ValueError, match="weight"):
        steps.observe_plain_step(4, 1.0, weight=2.0)


def test_a_single_request_drafts_and_a_large_batch_switches_off() -> None:
    alone = Batch([0.75]).run(200)
    assert statistics.mean(g[0] for g in alone[-100:]) >= 2
    full = Batch([0.75] * 32).run(120)  # at 32 rows a longer block costs more of the step than it returns
    assert statistics.mean(g for step in full[-60:] for g in step) < 0.5


@pytest.mark.parametrize("size", [1, 2, 4, 8, 16, 32])
def test_adaptive_reaches_the_goodput_of_the_best_fixed_gamma_at_every_batch_size(size: int) -> None:
    alphas = [0.75] * size
    # 600 steps: a batch that starts off (a pessimistic prior) learns the drafts' acceptance from its probes,
    # which come at 16, 48, 112, ... cycles off; the last 300 steps are the settled behaviour
    history = Batch(alphas, seed=size).run(600)
    settled = history[-300:]
    adaptive = statistics.mean(batch_goodput(alphas, gammas) for gammas in settled)
    best_fixed = max(batch_goodput(alphas, [g] * size) for g in range(9))
    # 0.95: the policy decides from noisy estimates, probes while off, and pays for hysteresis
    assert adaptive >= 0.95 * best_fixed, (size, adaptive, best_fixed)


def test_well_accepted_drafts_keep_drafting_longer_under_load() -> None:
    batch = Batch([0.95] * 4 + [0.4] * 4, seed=7)
    history = batch.run(300)
    high = statistics.mean(g for step in history[-150:] for g in step[:4])
    low = statistics.mean(g for step in history[-150:] for g in step[4:])
    assert high > low + 1


def test_speculation_comes_back_when_the_batch_shrinks() -> None:
    batch = Batch([0.75] * 32, seed=3)
    batch.run(150)
    assert batch.controllers[0].snapshot().previous == Budget(0)
    after = batch.run(6, size=1)  # the others left: alone again, well before the next probe
    assert after[-1][0] >= 2


def test_a_width_is_rated_with_the_chains_the_ceiling_allows_at_it() -> None:
    """Two rows planning 3 drafts whose ceilings veto depth 2 (a depth is cut to the deepest open one below it).
    Width 3 would cut both plans to 2 drafts, which the ceilings cut to 1: rated at 2 drafts each it looks best
    (4.88 tokens / 1.2 s), but what would run is 1 draft each in a 3-wide step (3.6 / 1.2). Rated as it would
    run, width 4 (3 drafts each: 5.90 / 1.6 = 3.69) beats width 2 (1 draft each: 3.6 / 1.0)."""
    alpha = 0.8

    def expected(gamma: int) -> float:
        return sum(alpha**j for j in range(gamma + 1))

    def allowed(gamma: int) -> int:
        return 1 if gamma == 2 else gamma

    steps = {2: 0.9, 4: 1.0, 6: 1.2, 8: 1.6}
    args = ([3, 3], [3, 3], [expected] * 2, [lambda g: 0.0] * 2, steps.__getitem__, 2)
    assert choose_chains(*args) == [2, 2]  # no ceiling: width 3
    assert choose_chains(*args, allowed=[allowed] * 2) == [3, 3]
    assert choose_chains(*args, allowed=[lambda g: min(g, 1)] * 2) == [1, 1]  # only one draft open: width 2
