"""The adaptive policy's off switch: it needs evidence to turn speculation off, and comes back after a good probe."""

from __future__ import annotations

from specserve.core.draft.schedule import Budget
from specserve.policies.base import PolicyState
from specserve.policies.policies import AdaptivePolicy

# a cost curve where drafting pays only when acceptance is high (k = 1 is cheap, as on this CPU)
VERIFY = tuple([0.0135] + [0.0175 + 0.00045 * k for k in range(2, 18)])


def state(
    alpha: float, weight: float, previous: Budget | None, cycles_off: int = 0, last_accepted: int = 0
) -> PolicyState:
    return PolicyState(
        alpha=(alpha,) * 16,
        alpha_weight=(weight,) * 16,
        draft_seconds_per_token=0.0013,
        draft_fixed_seconds=0.0,
        verify_seconds=VERIFY,
        previous=previous,
        cycles=10,
        cycles_off=cycles_off,
        last_accepted=last_accepted,
        last_drafted=previous.nodes if previous is not None else 0,
    )


def test_a_few_bad_cycles_do_not_switch_speculation_off() -> None:
    policy = AdaptivePolicy()
    assert policy.decide(state(0.3, weight=6.0, previous=Budget(3))) == Budget(3)  # little evidence: keep drafting
    assert policy.decide(state(0.3, weight=40.0, previous=Budget(3))) == Budget(0)  # enough of it: off
    assert policy.decide(state(0.3, weight=6.0, previous=None)).nodes > 0  # a request's first decision


def test_a_good_probe_switches_speculation_back_on() -> None:
    policy = AdaptivePolicy()
    probe = Budget(policy.probe_gamma)
    # after the probe: mean 0.45 on 6 pseudo-counts is worth trying again; 0.05 on 40 is not
    assert policy.decide(state(0.45, weight=6.0, previous=probe, cycles_off=17, last_accepted=2)).nodes > 0
    assert policy.decide(state(0.05, weight=40.0, previous=probe, cycles_off=17, last_accepted=1)) == Budget(0)
    assert policy.decide(state(0.9, weight=6.0, previous=probe, cycles_off=17, last_accepted=0)) == Budget(0)


def test_optimistic_state_raises_alpha_by_its_uncertainty() -> None:
    base = state(0.5, weight=8.0, previous=None)
    raised = base.optimistic(1.0)
    assert all(r > a for r, a in zip(raised.alpha, base.alpha, strict=True))
    sure = state(0.5, weight=800.0, previous=None).optimistic(1.0)
    assert all(r - 0.5 < 0.02 for r in sure.alpha)
    assert base.optimistic(0.0).alpha == base.alpha
