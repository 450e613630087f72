"""The policies on synthetic streams: the closed-form optimum, the heuristic schedule, the adaptive policy's
convergence, stability, switching off and back on, and the registry's errors.

The adaptive policy runs inside a :class:`SpeculationController` (as it does live) against
:mod:`synthetic_streams`: known i.i.d. acceptance per depth, known cost curves with ±2 % noise.
"""

from __future__ import annotations

import itertools
from collections import Counter
from collections.abc import Callable

import pytest
from synthetic_streams import (
    DRAFT_MS_PER_TOKEN,
    MS,
    constant_alpha,
    cpu_verify_seconds,
    linear_verify,
    run_stream,
)

from specserve.core.errors import UserError
from specserve.core.tree.shapes import TreeBudget, TreeSpec
from specserve.policies import (
    POLICY_NAMES,
    AdaptivePolicy,
    Budget,
    FixedPolicy,
    HeuristicPolicy,
    PolicyState,
    ReplicaPrior,
    SpeculationController,
    build_policy,
    optimal_gamma,
)
from specserve.policies.policies import probe_due
from specserve.policies.rates import constant_alpha_rate, expected_tokens_constant


def state(**changes: object) -> PolicyState:
    fields: dict[str, object] = {
        "alpha": (0.8,) * 16,
        "draft_seconds_per_token": DRAFT_MS_PER_TOKEN * MS,
        "draft_fixed_seconds": 0.0,
        "verify_seconds": tuple(cpu_verify_seconds(k) for k in range(1, 66)),
    }
    fields.update(changes)
    return PolicyState(**fields)


def adaptive_controller(**options: object) -> SpeculationController:
    return SpeculationController(build_policy("adaptive", **options), prior=None, max_gamma_cap=16)


# ---------------------------------------------------------------------------------------------------------
# The closed form


def test_expected_tokens_closed_form_matches_the_sum() -> None:
    for alpha in (0.0, 0.3, 0.8, 1.0):
        for gamma in range(6):
            direct = 1 + sum(alpha**i for i in range(1, gamma + 1))
            assert expected_tokens_constant(alpha, gamma) == pytest.approx(direct)


def test_optimal_gamma_worked_example_and_limits() -> None:
    t_verify = linear_verify(17.05, 0.45, k1_ms=13.5)
    assert optimal_gamma(0.8, 1.3 * MS, 0.0, t_verify, 16) == 6
    assert optimal_gamma(0.05, 1.3 * MS, 0.0, t_verify, 16) == 0
    assert optimal_gamma(0.99, 0.1 * MS, 0.0, linear_verify(20, 0.01), 16) == 16
    assert optimal_gamma(0.8, 1.3 * MS, 0.0, t_verify, 0) == 0
    # overlap hides the drafting: never a shorter γ than sequential
    for alpha in (0.5, 0.7, 0.9):
        assert optimal_gamma(alpha, 1.3 * MS, 0.0, t_verify, 16, overlap=True) >= optimal_gamma(
            alpha, 1.3 * MS, 0.0, t_verify, 16
        )


# ---------------------------------------------------------------------------------------------------------
# Fixed and heuristic


def test_fixed_policy_always_returns_its_budget() -> None:
    assert FixedPolicy(3).decide(state()) == Budget(3)
    tree = Budget(0, TreeSpec("dynamic", budget=TreeBudget(3, 2, 6)))
    assert build_policy("fixed", budget=tree).decide(state(previous=Budget(9))) == tree
    assert build_policy("fixed", gamma=0).decide(state()) == Budget(0)


def test_heuristic_schedule_is_plus_two_minus_one_floor_one() -> None:
    policy = HeuristicPolicy(start_gamma=3)
    assert policy.decide(state()) == Budget(3)
    outcomes = [(3, 3), (5, 5), (7, 2), (6, 0), (5, 1), (4, 0), (3, 0), (2, 0), (1, 0), (1, 1)]
    previous = Budget(3)
    gammas = []
    for drafted, accepted in outcomes:
        s = state(previous=previous, cycles=1, last_drafted=drafted, last_accepted=accepted)
        previous = policy.decide(s)
        gammas.append(previous.gamma)
    assert gammas == [5, 7, 6, 5, 4, 3, 2, 1, 1, 3]
    assert HeuristicPolicy().decide(state()) == Budget(20)  # transformers' default num_assistant_tokens
    capped = HeuristicPolicy(start_gamma=4, max_gamma=5)
    assert capped.decide(state(previous=Budget(4), cycles=1, last_drafted=4, last_accepted=4)) == Budget(5)


# ---------------------------------------------------------------------------------------------------------
# Adaptive: the decision itself


def test_probe_schedule_backs_off_exponentially_up_to_the_cap() -> None:
    due = [n for n in range(1, 600) if probe_due(n, 16, 128)]
    assert due == [16, 48, 112, 240, 368, 496]
    assert not probe_due(0, 16, 128)


def test_adaptive_hysteresis_keeps_a_close_previous_choice_then_relaxes() -> None:
    policy = AdaptivePolicy(hysteresis=0.05, hysteresis_half_life=64, hysteresis_floor=0.01)
    s = state()
    rates = policy.rates(s)
    best = max(rates, key=lambda b: rates[b])
    close = next(b for b in rates if rates[best] / 1.05 <= rates[b] < rates[best] / 1.01)
    far = Budget(1)
    assert rates[far] * 1.05 < rates[best]
    assert policy.decide(state(previous=close, cycles=10)) == close
    assert policy.decide(state(previous=far, cycles=10)) == best
    # a decision that has stood for long has to be only 1 % worse to be revisited
    assert policy.margin(0) == pytest.approx(0.05) and policy.margin(64) == pytest.approx(0.025)
    assert policy.margin(10_000) == pytest.approx(0.01)
    assert policy.decide(state(previous=close, cycles=500, cycles_since_change=400)) == best
    assert AdaptivePolicy(hysteresis=0.0, hysteresis_floor=0.0).decide(state(previous=close, cycles=10)) == best


def test_adaptive_stays_off_until_a_probe_then_follows_the_probe() -> None:
    policy = AdaptivePolicy(probe_interval=4, max_probe_interval=16, probe_gamma=2)
    high = (0.9,) * 16
    assert policy.decide(state(alpha=high, previous=Budget(0), cycles_off=3)) == Budget(0)
    assert policy.decide(state(alpha=high, previous=Budget(0), cycles_off=4)) == Budget(2)
    # after the probe: on if it got something accepted and the estimates beat plain decoding
    after = {"previous": Budget(2), "cycles_off": 5, "last_drafted": 2}
    on = policy.decide(state(alpha=high, last_accepted=2, **after))
    assert on.gamma == policy.decide(state(alpha=high)).gamma > 0
    assert policy.decide(state(alpha=high, last_accepted=0, **after)) == Budget(0)
    assert policy.decide(state(alpha=(0.05,) * 16, last_accepted=1, **after)) == Budget(0)


def test_adaptive_overlap_mode_uses_the_max_of_the_two_costs() -> None:
    sequential = AdaptivePolicy().decide(state())
    overlapped = AdaptivePolicy(overlap=True).decide(state())
    assert overlapped.gamma > sequential.gamma


def test_adaptive_tree_mode_picks_a_tree_only_when_trees_pay() -> None:
    tree = TreeSpec("dynamic", budget=TreeBudget(depth=4, width=2, nodes=8))
    policy = AdaptivePolicy(max_gamma=8, trees=(tree,))
    assert policy.decide(state(alpha=(0.6,) * 16, extra={"tree_bonus_per_node": 0.0})).tree is None
    assert policy.decide(state(alpha=(0.6,) * 16, extra={"tree_bonus_per_node": 0.4})).tree == tree


# ---------------------------------------------------------------------------------------------------------
# Adaptive on synthetic streams


SCENARIOS: dict[str, tuple[float, Callable[[int], float], float]] = {
    # name: (alpha, T_verify, draft ms per token)
    "cpu-curve-alpha-0.6": (0.6, cpu_verify_seconds, DRAFT_MS_PER_TOKEN),
    "cpu-curve-alpha-0.8": (0.8, cpu_verify_seconds, DRAFT_MS_PER_TOKEN),
    "cpu-curve-alpha-0.9": (0.9, cpu_verify_seconds, DRAFT_MS_PER_TOKEN),
    "steep-linear-alpha-0.7": (0.7, linear_verify(10.0, 1.0), 2.0),
    "plain-wins-alpha-0.5": (0.5, linear_verify(8.0, 0.8, k1_ms=6.0), 0.6),
    "flat-linear-alpha-0.9": (0.9, linear_verify(15.0, 0.5, k1_ms=12.0), 0.5),
}


def settle(name: str, seed: int, warm_cycles: int = 0) -> tuple[int, int, Callable[[int], float]]:
    """(most frequent γ over cycles 400..700, optimal_gamma's γ, true rate of a γ) for one seeded run of an
    adaptive request; with ``warm_cycles`` its replica first served a heuristic-policy request on the same
    workload (so the replica prior knows the acceptance and the cost curve at many k)."""
    alpha, t_verify, draft_ms = SCENARIOS[name]
    replica = ReplicaPrior()
    if warm_cycles:
        warm = SpeculationController(HeuristicPolicy(start_gamma=4), replica)
        run_stream(warm, constant_alpha(alpha), warm_cycles, t_verify, seed=1000 + seed, draft_ms_per_token=draft_ms)
    controller = SpeculationController(build_policy("adaptive"), replica)
    gammas = run_stream(controller, constant_alpha(alpha), 700, t_verify, seed=seed, draft_ms_per_token=draft_ms)
    settled = Counter(gammas[400:]).most_common(1)[0][0]

    def rate(g: int) -> float:
        return constant_alpha_rate(alpha, g, draft_ms * MS, 0.0, t_verify)

    return settled, optimal_gamma(alpha, draft_ms * MS, 0.0, t_verify, 16), rate


@pytest.mark.parametrize("name", [n for n in SCENARIOS if not n.startswith("flat")])
def test_adaptive_converges_to_the_closed_form_optimum(name: str) -> None:
    """A lone request on a fresh replica: after 400 cycles the most frequent γ of the next 300 is
    optimal_gamma's, or a neighbour whose true rate is within 2 % of the optimum's. (Its first cycle is plain
    decoding, which measures T_verify(1); ``plain-wins`` is a case where plain decoding is the optimum.)"""
    settled, best, rate = settle(name, seed=17)
    assert settled == best or (abs(settled - best) == 1 and rate(settled) >= 0.98 * rate(best)), (
        settled,
        best,
        [round(rate(g)) for g in range(17)],
    )


@pytest.mark.parametrize("name", sorted(SCENARIOS))
def test_adaptive_is_near_optimal_across_seeds(name: str) -> None:
    """Five seeds per scenario, on a replica warmed by an earlier request: the settled γ always delivers
    >= 98 % of the optimal true rate. On the flat curve several γ lie within 1 % of one another — finer than
    the estimates resolve — so the ±1 criterion above is not asserted there (it held in 15 of 20 seeded runs
    while measuring; every run was within 1 % of the optimal rate)."""
    for seed in range(5):
        settled, best, rate = settle(name, seed=seed, warm_cycles=200)
        assert rate(settled) >= 0.98 * rate(best), (seed, settled, best)


def test_adaptive_does_not_flap_on_a_stationary_stream() -> None:
    gammas = run_stream(adaptive_controller(), constant_alpha(0.8), 500, cpu_verify_seconds, seed=5)
    changes = sum(a != b for a, b in itertools.pairwise(gammas[200:]))
    assert changes <= 2


def test_adaptive_turns_speculation_off_for_a_drafter_that_rarely_agrees() -> None:
    gammas = run_stream(adaptive_controller(), constant_alpha(0.05), 600, cpu_verify_seconds, seed=9)
    assert gammas[0] == 0  # the plain calibration cycle
    assert 0 in gammas[1:20]
    late = gammas[100:]
    assert late.count(0) >= 0.95 * len(late)  # what is left: probes, and a few cycles after a lucky one


def test_adaptive_drafts_long_chains_when_nearly_everything_is_accepted() -> None:
    flat = linear_verify(20.0, 0.1)
    gammas = run_stream(adaptive_controller(), constant_alpha(0.97), 300, flat, seed=2)
    assert min(gammas[150:]) >= 8


def test_adaptive_switches_off_when_acceptance_collapses_and_back_on_when_it_returns() -> None:
    """α = 0.9 for 300 cycles, 0 for 500, 0.9 again.

    Off: the recent acceptance memory (half-life 16) has to wash out the good evidence, and deeper depths,
    no longer reached, follow through their restart; over 20 seeds it took at most 54 cycles — bound 100.
    On: the next probe after α returns (gaps capped at 128) gets something accepted with probability 0.9;
    allowing one failed probe the bound is 2 · 128 + 20 cycles, exceeded with probability ≈ 0.01 over seeds.
    """

    def alpha(cycle: int) -> tuple[float]:
        return (0.0,) if 300 <= cycle < 800 else (0.9,)

    gammas = run_stream(adaptive_controller(), alpha, 1100, cpu_verify_seconds, seed=4)
    assert min(gammas[150:300]) >= 3
    off = next(c for c in range(300, 800) if gammas[c] == 0)
    assert off - 300 <= 100
    assert gammas[off:800].count(0) >= 0.95 * (800 - off)  # off but for probes and a lucky probe's aftermath
    back_on = next(c for c in range(800, 1100) if all(g >= 3 for g in gammas[c : c + 20]))
    assert back_on - 800 <= 2 * 128 + 20


# ---------------------------------------------------------------------------------------------------------
# Registry


def test_policy_names() -> None:
    assert POLICY_NAMES == ("fixed", "heuristic", "adaptive")
    for name in POLICY_NAMES:
        assert build_policy(name).name == name


@pytest.mark.parametrize(
    ("name", "options", "message"),
    [
        ("greedy", {}, "unknown policy 'greedy'"),
        ("adaptive", {"gamma": 3}, "unknown option"),
        ("fixed", {"budget": -1}, "gamma must be >= 0"),
        ("fixed", {"budget": "4"}, "budget must be"),
        ("fixed", {"gamma": 2, "budget": 3}, "not both"),
        ("heuristic", {"start_gamma": 0}, "start_gamma must be an integer >= 1"),
        ("adaptive", {"max_gamma": 0}, "max_gamma must be an integer >= 1"),
        ("adaptive", {"hysteresis": 1.5}, "hysteresis"),
        ("adaptive", {"probe_interval": 32, "max_probe_interval": 16}, "max_probe_interval"),
        ("adaptive", {"probe_gamma": True}, "probe_gamma"),
        ("adaptive", {"overlap": "yes"}, "overlap"),
    ],
)
def test_build_policy_rejects_bad_input_with_a_clear_message(
    name: str, options: dict[str, object], message: str
) -> None:
    with pytest.raises(UserError, match=message):
        build_policy(name, **options)
