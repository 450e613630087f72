"""The per-request controller: clipping to the request's end and the replica cap, counters, history, prior."""

from __future__ import annotations

import dataclasses
import json
import random

import pytest
from synthetic_streams import MS, chain_observation, constant_alpha, cpu_verify_seconds, run_stream

from specserve.core.tree.shapes import TreeBudget, TreeSpec, TreeTopology
from specserve.policies import (
    AdaptivePolicy,
    Budget,
    CycleObservation,
    FixedPolicy,
    HeuristicPolicy,
    PolicyState,
    ReplicaPrior,
    SpeculationController,
)
from specserve.policies.controller import clip_budget
from specserve.policies.prior import DEFAULT_ALPHA


def test_budgets_never_exceed_the_remaining_tokens_minus_one() -> None:
    controller = SpeculationController(FixedPolicy(8), prior=None)
    assert [controller.next_budget(r).gamma for r in (20, 9, 5, 2, 1)] == [8, 8, 4, 1, 0]


def test_the_replica_cap_bounds_a_growing_schedule() -> None:
    controller = SpeculationController(HeuristicPolicy(start_gamma=4), prior=None, max_gamma_cap=10)
    rng = random.Random(0)
    gammas = []
    for _ in range(8):  # every draft accepted: +2 each cycle, held at the cap
        budget = controller.next_budget(1000)
        gammas.append(budget.gamma)
        controller.observe(chain_observation(budget, budget.gamma, cpu_verify_seconds, rng))
    assert gammas == [4, 6, 8, 10, 10, 10, 10, 10]


def test_trees_are_clipped_to_depth_or_fall_back_to_a_chain() -> None:
    dynamic = Budget(0, TreeSpec("dynamic", budget=TreeBudget(depth=5, width=2, nodes=9)))
    clipped = clip_budget(dynamic, 3)
    assert clipped.tree is not None and clipped.tree.budget == TreeBudget(depth=3, width=2, nodes=9)
    static = Budget(0, TreeSpec("static", topology=TreeTopology.from_lists([[0], [0, 0], [0, 0, 0], [1]])))
    assert clip_budget(static, 3) == static
    assert clip_budget(static, 2) == Budget(2)
    assert clip_budget(dynamic, 0) == Budget(0)


def test_counters_follow_off_periods_and_probes() -> None:
    controller = SpeculationController(AdaptivePolicy(probe_interval=3, max_probe_interval=6), prior=None)
    gammas = run_stream(controller, constant_alpha(0.0), 60, cpu_verify_seconds, seed=3)
    assert gammas[-30:].count(0) >= 25
    probes = [entry["cycle"] for entry in controller.history if entry["probe"]]
    assert probes and all(controller.history[c]["gamma"] == 2 for c in probes)
    state = controller.snapshot()
    assert state.cycles == 60 and state.cycles_off > 0 and state.previous == Budget(gammas[-1])


def test_history_is_json_ready_and_pairs_decisions_with_verdicts() -> None:
    controller = SpeculationController(AdaptivePolicy(), prior=None)
    run_stream(controller, constant_alpha(0.8), 5, cpu_verify_seconds, seed=1)
    controller.observe(CycleObservation(Budget(3), 3, 3, 1, 4 * MS, 19 * MS))  # a verdict with no decision
    decoded = json.loads(json.dumps(controller.history))
    assert len(decoded) == 6
    assert {"chosen", "sent", "gamma", "probe", "accepted", "drafted", "verify_seconds"} <= set(decoded[0])
    assert "chosen" not in decoded[-1] and decoded[-1]["accepted"] == 1


def test_replica_prior_seeds_each_new_request_and_pools_observations() -> None:
    replica = ReplicaPrior()
    first = SpeculationController(AdaptivePolicy(), prior=replica)
    assert first.snapshot().alpha[0] == DEFAULT_ALPHA
    run_stream(first, constant_alpha(0.95), 300, cpu_verify_seconds, seed=8)
    assert replica.cycles == 300
    second = SpeculationController(AdaptivePolicy(), prior=replica)
    seeded = second.snapshot()
    assert seeded.alpha[0] > 0.9
    k = first.history[-1]["gamma"] + 1
    assert seeded.t_verify(k) == pytest.approx(first.snapshot().t_verify(k), rel=0.03)
    # seeded from the start, the second request speculates long right away
    assert second.next_budget(1000).gamma >= 6


def test_adaptive_requests_measure_plain_decoding_once_per_replica() -> None:
    replica = ReplicaPrior()
    first = SpeculationController(AdaptivePolicy(), prior=replica)
    assert first.next_budget(100) == Budget(0)
    assert first.history[0]["calibration"] and not first.history[0]["probe"]
    first.observe(CycleObservation(Budget(0), 0, 0, 0, 0.0, 12 * MS))
    assert first.snapshot().t_verify(1) == 12 * MS
    assert first.snapshot().cycles_off == 0 and first.snapshot().previous is None  # not a decision to stop
    assert first.next_budget(100).gamma > 0
    second = SpeculationController(AdaptivePolicy(), prior=replica)
    assert second.next_budget(100).gamma > 0  # the replica already measured it
    assert SpeculationController(FixedPolicy(3), prior=ReplicaPrior()).next_budget(100) == Budget(3)


class _WithoutTheOffShortcut:
    """An adaptive policy that always decides from the full state (no ``decide_off``)."""

    def __init__(self, policy: AdaptivePolicy) -> None:
        self.policy, self.name, self.calibrates_plain = policy, policy.name, policy.calibrates_plain

    def decide(self, state: PolicyState) -> Budget:
        return self.policy.decide(state)


def test_deciding_off_without_estimates_changes_no_decision() -> None:
    """The adaptive policy's off decisions told without a state (a due probe, else plain decoding, unless the batch
    shrank) are the decisions it makes from the full state: a stream whose acceptance drops from 0.8 to 0.05 and
    recovers, in batches that grow and shrink, gives the same budgets, probes and fill estimates either way."""

    def drive(policy: AdaptivePolicy | _WithoutTheOffShortcut) -> list[tuple[object, ...]]:
        controller = SpeculationController(policy, prior=None)
        rng = random.Random(5)
        trace: list[tuple[object, ...]] = []
        for cycle in range(400):
            alpha = 0.8 if cycle < 120 or cycle >= 300 else 0.05
            batch = (1, 8, 16, 4)[(cycle // 50) % 4]
            budget = controller.next_budget(1_000_000, batch_size=batch)
            trace.append((budget, controller.history[-1]["probe"], round(controller.expected_tokens(2), 9)))
            accepted = 0
            while accepted < budget.gamma and rng.random() < alpha:
                accepted += 1
            obs = chain_observation(budget, accepted, cpu_verify_seconds, rng)
            controller.observe(dataclasses.replace(obs, batch_size=batch, step_positions=batch * (budget.gamma + 1)))
        return trace

    policy = AdaptivePolicy(probe_interval=4, max_probe_interval=16)
    fast, full = drive(policy), drive(_WithoutTheOffShortcut(policy))
    assert fast == full
    budgets = [budget for budget, _, _ in fast]
    assert any(b.gamma > 0 for b in budgets[:120]) and budgets[200:300].count(Budget(0)) > 50  # it went off
    assert any(probe for _, probe, _ in fast[120:300])  # and probed while off
