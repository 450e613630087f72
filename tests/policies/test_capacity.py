"""The capacity planner (:mod:`specserve.policies.capacity`) against an independent reference written here.

* Every placement's cycle, γ, tokens/s, devices and tokens per dollar equal a brute force written from the model's
  statement (tokens per cycle as a sum over accepted prefixes, every γ tried), for fixed and random scenarios.
* Structural facts: a pool at ratio 1 is the per-replica placement; a pool member's cheap devices are ⌈N / r⌉; a
  misaligned pool pays a second drafting round; plain decoding never drafts; the recommendation is the cheapest per
  token, and where drafting costs nothing on a cheap device the pool at the largest ratio wins.
* Cost tables interpolate linearly, extend with the last slope, never go negative; bad inputs are refused.
"""

from __future__ import annotations

import math

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from specserve.policies.capacity import (
    CostTable,
    Scenario,
    cycle_seconds,
    evaluate,
    plan,
    recommend,
)

MS = 1e-3


def scenario(**changes: object) -> Scenario:
    base: dict[str, object] = {
        "alpha": (0.8, 0.6, 0.5),
        "verify": CostTable({(1, 1): 10 * MS, (1, 8): 12 * MS, (8, 1): 11 * MS, (8, 8): 20 * MS}),
        "draft_large": CostTable.from_rows({1: 2 * MS, 8: 3 * MS}),
        "draft_cheap": CostTable.from_rows({1: 4 * MS, 8: 5 * MS, 64: 12 * MS}),
        "hop_seconds": 1 * MS,
        "batch": 4,
        "large_price": 4.0,
        "cheap_price": 0.5,
        "tp": 2,
    }
    base.update(changes)
    return Scenario(**base)  # type: ignore[arg-type]


def reference(s: Scenario, placement: str, replicas: int, ratio: int = 1) -> tuple[int, float, float, float]:
    """(γ, tokens/s, dollars/hour, tokens per dollar), from the statement of the model, by brute force."""
    best = None
    for gamma in (0,) if placement == "plain" else range(1, 9):
        reach, tokens = 1.0, 1.0
        for i in range(gamma):  # the prefix of i + 1 drafts is accepted with probability α_1 ... α_{i+1}
            reach *= s.alpha[min(i, len(s.alpha) - 1)]
            tokens += reach
        verify = s.verify(gamma + 1, s.batch)
        cycle = {
            "plain": s.verify(1, s.batch),
            "colocated": gamma * s.draft_large(1, s.batch) + verify,
            "replica": gamma * s.draft_cheap(1, s.batch) + s.hop_seconds + verify,
            "pool": gamma * s.draft_cheap(1, ratio * s.batch) + s.hop_seconds + verify,
        }[placement]
        rate = replicas * s.batch * tokens / cycle
        if best is None or rate > best[1]:
            best = (gamma, rate)
    assert best is not None
    cheap = {"plain": 0, "colocated": 0, "replica": replicas, "pool": -(-replicas // ratio)}[placement]
    dollars = replicas * s.tp * s.large_price + cheap * s.cheap_price
    return best[0], best[1], dollars, best[1] * 3600 / dollars


@pytest.mark.parametrize("placement", ["plain", "colocated", "replica", "pool"])
@pytest.mark.parametrize("replicas", [1, 10, 1000])
def test_every_placement_equals_the_reference(placement: str, replicas: int) -> None:
    s = scenario()
    for ratio in (1, 3, 8) if placement == "pool" else (1,):
        got = evaluate(s, placement, replicas, ratio if placement == "pool" else None)
        gamma, rate, dollars, per_dollar = reference(s, placement, replicas, ratio)
        assert got.gamma == gamma
        assert got.tokens_per_second == pytest.approx(rate, rel=1e-12)
        assert got.dollars_per_hour == pytest.approx(dollars, rel=1e-12)
        assert got.tokens_per_dollar == pytest.approx(per_dollar, rel=1e-12)


@settings(max_examples=60, deadline=None)
@given(
    alpha=st.lists(st.floats(0.0, 1.0), min_size=1, max_size=6),
    verify_ms=st.tuples(st.floats(1, 50), st.floats(0, 5), st.floats(0, 3)),
    draft_ms=st.tuples(st.floats(0.1, 20), st.floats(0, 1)),
    hop_ms=st.floats(0, 10),
    batch=st.integers(1, 32),
    prices=st.tuples(st.floats(0.1, 10), st.floats(0.01, 5)),
    replicas=st.integers(1, 200),
    ratio=st.integers(1, 64),
)
def test_random_scenarios_equal_the_reference(
    alpha: list[float],
    verify_ms: tuple[float, float, float],
    draft_ms: tuple[float, float],
    hop_ms: float,
    batch: int,
    prices: tuple[float, float],
    replicas: int,
    ratio: int,
) -> None:
    base, per_k, per_b = verify_ms
    verify = CostTable({(k, b): (base + per_k * k + per_b * b) * MS for k in (1, 9) for b in (1, 64)})
    draft = CostTable.from_rows({1: draft_ms[0] * MS, 256: (draft_ms[0] + 255 * draft_ms[1]) * MS})
    s = Scenario(tuple(alpha), verify, draft, draft, hop_ms * MS, batch, prices[0], prices[1])
    for placement in ("plain", "colocated", "replica", "pool"):
        got = evaluate(s, placement, replicas, ratio if placement == "pool" else None)
        _, rate, _, per_dollar = reference(s, placement, replicas, ratio)
        assert got.tokens_per_second == pytest.approx(rate, rel=1e-9)
        assert got.tokens_per_dollar == pytest.approx(per_dollar, rel=1e-9)
        reached = cycle_seconds(s, placement, got.gamma, ratio)
        assert got.cycle_seconds == pytest.approx(reached, rel=1e-12)


def test_a_pool_at_ratio_one_is_a_drafter_per_replica() -> None:
    s = scenario()
    pooled, own = evaluate(s, "pool", 12, 1), evaluate(s, "replica", 12)
    assert pooled.row() | {"placement": "replica", "ratio": None} == own.row()


def test_pool_members_misalignment_and_plain_decoding() -> None:
    s = scenario()
    assert [evaluate(s, "pool", 10, r).cheap_devices for r in (1, 3, 4, 10, 16)] == [10, 4, 3, 1, 1]
    aligned = cycle_seconds(s, "pool", 3, ratio=4)
    drafting = 3 * s.draft_cheap(1, 16)
    assert cycle_seconds(s, "pool", 3, ratio=4, misaligned=True) == pytest.approx(aligned + drafting)
    assert cycle_seconds(s, "pool", 3, ratio=1, misaligned=True) == pytest.approx(cycle_seconds(s, "replica", 3))
    plain = evaluate(s, "plain", 5)
    assert plain.gamma == 0 and plain.cheap_devices == 0 and plain.large_devices == 10
    assert plain.tokens_per_second == pytest.approx(5 * 4 / s.verify(1, 4))


def test_the_recommendation_is_the_cheapest_per_token() -> None:
    # drafting is free on a cheap device whatever its rows, and no hop: more replicas per member only save money
    free = scenario(draft_cheap=CostTable.from_rows({1: 0.0}), hop_seconds=0.0)
    plans = plan(free, replicas=(100,), ratios=(1, 2, 4, 8, 16, 32))
    best = recommend(plans, 100)
    assert best.placement == "pool" and best.ratio == 32
    assert best.tokens_per_dollar == max(p.tokens_per_dollar for p in plans)
    # drafting on the large device is as fast as on the cheap one and nothing is saved by moving it: co-located wins
    costly = scenario(
        draft_cheap=CostTable.from_rows({1: 2 * MS, 8: 30 * MS, 64: 300 * MS}), hop_seconds=5 * MS, cheap_price=3.0
    )
    assert recommend(plan(costly, replicas=(10,)), 10).placement == "colocated"
    # no acceptance at all: speculation never pays, plain decoding is the most tokens per dollar
    hopeless = scenario(alpha=(0.0,))
    assert recommend(plan(hopeless, replicas=(10,)), 10).placement == "plain"
    with pytest.raises(ValueError, match="no plan for 7"):
        recommend(plans, 7)


def test_every_replica_count_gets_every_placement_and_ratios_up_to_it() -> None:
    plans = plan(scenario(), replicas=(1, 10), ratios=(1, 4, 16))
    assert {(p.replicas, p.placement, p.ratio) for p in plans} == {
        *((n, placement, None) for n in (1, 10) for placement in ("plain", "colocated", "replica")),
        (1, "pool", 1),
        (10, "pool", 1),
        (10, "pool", 4),
    }


def test_cost_tables_interpolate_extend_and_stay_non_negative() -> None:
    table = CostTable({(1, 1): 1.0, (1, 3): 3.0, (5, 1): 5.0, (5, 3): 9.0})
    assert table(1, 2) == pytest.approx(2.0) and table(5, 2) == pytest.approx(7.0)
    assert table(3, 2) == pytest.approx(4.5)  # between the widths, from the rows' values at each
    assert table(1, 5) == pytest.approx(5.0) and table(9, 1) == pytest.approx(9.0)  # the last slope, onwards
    falling = CostTable.from_rows({1: 2.0, 2: 1.0})
    assert falling(1, 10) == 0.0  # never negative
    assert CostTable.from_rows({4: 0.5})(1, 100) == 0.5  # one point: flat


@pytest.mark.parametrize(
    ("changes", "message"),
    [
        ({"alpha": ()}, "acceptance by position"),
        ({"alpha": (1.2,)}, "acceptance by position"),
        ({"batch": 0}, "batch and tp"),
        ({"hop_seconds": -1.0}, "hop and prices"),
    ],
)
def test_bad_scenarios_are_refused(changes: dict[str, object], message: str) -> None:
    with pytest.raises(ValueError, match=message):
        scenario(**changes)


def test_bad_tables_and_arguments_are_refused() -> None:
    with pytest.raises(ValueError, match="at least one measured point"):
        CostTable({})
    with pytest.raises(ValueError, match=">= 1"):
        CostTable({(0, 1): 1.0})
    with pytest.raises(ValueError, match="placement is one of"):
        cycle_seconds(scenario(), "elsewhere", 2)
    with pytest.raises(ValueError, match="replicas and ratio"):
        evaluate(scenario(), "pool", 0, 1)
    assert math.isinf(evaluate(scenario(large_price=0.0, cheap_price=0.0), "colocated", 1).tokens_per_dollar)


def test_a_scenario_loads_from_its_json_form() -> None:
    from specserve.policies.capacity import load_scenario

    data = {
        "alpha": [0.8, 0.6, 0.5],
        "verify_ms": [[1, 1, 10], [1, 8, 12], [8, 1, 11], [8, 8, 20]],
        "draft_large_ms": [[1, 2], [8, 3]],
        "draft_cheap_ms": [[1, 4], [8, 5], [64, 12]],
        "hop_ms": 1,
        "batch": 4,
        "tp": 2,
        "large": {"name": "big", "price_per_hour": 4.0},
        "cheap": {"name": "small", "price_per_hour": 0.5},
    }
    loaded = load_scenario(data)
    want = scenario()
    for placement in ("plain", "colocated", "replica", "pool"):
        assert evaluate(loaded, placement, 10, 4 if placement == "pool" else None).tokens_per_second == pytest.approx(
            evaluate(want, placement, 10, 4 if placement == "pool" else None).tokens_per_second
        )
    assert (loaded.large_name, loaded.cheap_name) == ("big", "small")
    with pytest.raises(ValueError, match="needs the field 'hop_ms'"):
        load_scenario({k: v for k, v in data.items() if k != "hop_ms"})
    with pytest.raises(ValueError, match="malformed"):
        load_scenario({**data, "verify_ms": [[1, 1]]})
