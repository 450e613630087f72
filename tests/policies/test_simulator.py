"""Trace replay: the recording policy reproduces its own cycles, costs follow the curves, policies react to α.

Traces here are synthetic: a seeded per-position acceptance stream (the text a drafter would or would not
predict) recorded by a fixed γ with the engine's rules (drafts cut at ``remaining − 1``), with known costs.
"""

from __future__ import annotations

import random
from collections.abc import Callable, Sequence

import pytest

from specserve.core.draft.schedule import Budget, FixedSchedule
from specserve.core.errors import UserError
from specserve.core.tree.shapes import TreeBudget, TreeSpec
from specserve.policies.policies import build_policy
from specserve.policies.simulator import (
    CostCurves,
    RecordedRequest,
    WorkloadModel,
    controller_schedules,
    estimate_alpha,
    simulate,
)
from specserve.policies.traces import TraceRecord


def draft_cost(gamma: int) -> float:
    return 0.001 * gamma


def verify_cost(k: int) -> float:
    return 0.010 + 0.001 * k


def record_trace(
    acceptable: Sequence[Sequence[bool]],
    gamma: int,
    *,
    max_new_tokens: int,
    policy: str | None = None,
    noise: float = 0.0,
    seed: int = 0,
    workload: str = "synthetic",
    batch: int = 1,
    draft: Callable[[int], float] = draft_cost,
    verify: Callable[[int], float] = verify_cost,
) -> list[TraceRecord]:
    """Run a fixed γ over per-request acceptance streams as the engine would, recording every cycle (``draft`` and
    ``verify``: seconds for a draft of that many tokens, a verify of that many positions)."""
    rng = random.Random(seed)
    records = []
    for index, stream in enumerate(acceptable):
        position = cycle = 0
        while position < len(stream):
            remaining = max_new_tokens - position
            drafted = max(0, min(gamma, remaining - 1))
            accepted = 0
            while accepted < drafted and position + accepted < len(stream) and stream[position + accepted]:
                accepted += 1
            jitter = 1.0 + noise * rng.random()
            records.append(
                TraceRecord(
                    request_id=f"request-{index}",
                    workload=workload,
                    policy=policy or f"fixed:{gamma}",
                    cycle=cycle,
                    gamma=gamma,
                    tree=None,
                    nodes=drafted,
                    depth=drafted,
                    accepted=accepted,
                    accept_flags=(True,) * accepted + ((False,) if accepted < drafted else ()),
                    draft_seconds=draft(drafted) * jitter,
                    verify_seconds=verify(batch * (drafted + 1)) * jitter,
                    wire_seconds=0.0,
                    batch_size=batch,
                    temperature=0.0,
                    remaining=remaining,
                    step_positions=batch * (drafted + 1) if batch > 1 else 0,
                )
            )
            position += accepted + 1
            cycle += 1
    return records


def streams(alpha: float, requests: int, tokens: int, seed: int = 1) -> list[list[bool]]:
    rng = random.Random(seed)
    return [[rng.random() < alpha for _ in range(tokens)] for _ in range(requests)]


def fixed(gamma: int) -> Callable[[], FixedSchedule]:
    return lambda: FixedSchedule(Budget(gamma))


@pytest.mark.parametrize("gamma", [1, 3, 6])
def test_replaying_the_recording_fixed_policy_reproduces_every_cycle(gamma: int) -> None:
    records = record_trace(streams(0.7, 4, 60), gamma, max_new_tokens=64, noise=0.5)
    model = WorkloadModel.from_records(records)
    for schedules in (fixed(gamma), controller_schedules(build_policy("fixed", gamma=gamma))):
        result = simulate(model, schedules, seed=3)
        assert len(result.cycles) == len(records)
        for cycle, record in zip(result.cycles, records, strict=True):
            assert cycle.recorded
            assert (cycle.gamma, cycle.accepted) == (record.nodes, record.accepted)
            assert (cycle.draft_seconds, cycle.verify_seconds, cycle.wire_seconds) == (
                record.draft_seconds,
                record.verify_seconds,
                record.wire_seconds,
            )
        assert result.tokens == sum(r.accepted + 1 for r in records)
        assert result.seconds == pytest.approx(sum(r.seconds for r in records), rel=1e-12)


def test_replaying_none_charges_t_verify_1_per_token() -> None:
    acceptable = streams(0.8, 3, 40)
    records = record_trace(acceptable, 2, max_new_tokens=40) + record_trace(acceptable, 4, max_new_tokens=40)
    model = WorkloadModel.from_records(records)
    assert model.costs.t_verify(1) == pytest.approx(verify_cost(1))  # extrapolated from k = 3 and 5
    result = simulate(model, fixed(0))
    assert result.tokens == len(result.cycles) == 3 * 40
    assert all(c.accepted == 0 and c.draft_seconds == 0.0 for c in result.cycles)
    assert all(c.verify_seconds == pytest.approx(verify_cost(1)) for c in result.cycles)
    assert result.tokens_per_second == pytest.approx(1 / verify_cost(1))
    assert result.mean_accepted == 1.0 and result.mean_gamma == 0.0


def test_other_gammas_are_charged_the_cost_curves() -> None:
    records = record_trace(streams(0.8, 2, 50), 2, max_new_tokens=50) + record_trace(
        streams(0.8, 2, 50), 5, max_new_tokens=50
    )
    costs = CostCurves.from_records(records)
    assert costs.draft_fixed_seconds == pytest.approx(0.0, abs=1e-12)
    assert costs.draft_seconds_per_token == pytest.approx(0.001)
    for k in (1, 3, 4, 5, 9):
        assert costs.t_verify(k) == pytest.approx(verify_cost(k))  # medians at recorded ks, lines elsewhere
    model = WorkloadModel.from_records(records, source_policy="fixed:2")
    result = simulate(model, fixed(3))
    charged = [c for c in result.cycles if not c.recorded]
    assert charged and all(c.seconds == pytest.approx(draft_cost(c.gamma) + verify_cost(c.gamma + 1)) for c in charged)


def test_accepted_is_the_recorded_run_cut_at_gamma() -> None:
    # request: positions 0-2 acceptable, 3 rejected, 4-9 acceptable, 10 rejected, rest acceptable
    stream = [True] * 3 + [False] + [True] * 6 + [False] + [True] * 9
    model = WorkloadModel.from_records(record_trace([stream], 8, max_new_tokens=len(stream)))
    request = model.acceptance.requests[0]
    assert request.labels[:11] == (True, True, True, False, *(True,) * 6, False)
    result = simulate(model, fixed(2))
    # γ = 2 cycles start at 0, 3, 4, 7, 10, 11, ...: runs cut at 2, then the rejections at 3 and 10
    assert [(c.position, c.accepted) for c in result.cycles[:6]] == [(0, 2), (3, 0), (4, 2), (7, 2), (10, 0), (11, 2)]


def test_alpha_counts_censored_cycles_where_they_reached() -> None:
    records = record_trace([[True, True, True], [False, True, True]], 2, max_new_tokens=3)
    # cycles: (2 of 2 accepted, censored); (0 of 2 accepted), then (1 of 1 accepted, censored: cut at the end)
    assert [(r.nodes, r.accepted) for r in records] == [(2, 2), (2, 0), (1, 1)]
    assert estimate_alpha(records) == (2 / 3, 1.0)


def test_censored_runs_are_extended_with_alpha() -> None:
    always = record_trace([[True] * 40] * 2, 1, max_new_tokens=40)  # every cycle censored: α̂ = 1
    model = WorkloadModel.from_records(always)
    assert model.alpha == (1.0,)
    result = simulate(model, fixed(4))
    assert all(c.accepted == c.gamma for c in result.cycles) and result.cycles[0].gamma == 4

    half = record_trace(streams(0.5, 4, 40), 1, max_new_tokens=40)
    model = WorkloadModel.from_records(half)
    runs = [[c.accepted for c in simulate(model, fixed(6), seed=seed).cycles] for seed in (0, 0, 1)]
    assert runs[0] == runs[1]  # seeded
    assert runs[0] != runs[2]  # the unknown positions are drawn
    assert max(runs[0]) > 1  # beyond what γ = 1 could show


def test_adaptive_speculates_on_easy_text_and_stops_on_hopeless_text() -> None:
    adaptive = build_policy("adaptive", max_gamma=8)

    easy = WorkloadModel.from_records(record_trace(streams(0.9, 4, 200), 4, max_new_tokens=200))
    result = simulate(easy, controller_schedules(adaptive, max_gamma_cap=8), policy_name="adaptive")
    late = result.gammas[len(result.gammas) // 2 :]
    assert sum(g > 0 for g in late) / len(late) > 0.9
    assert result.tokens_per_second > simulate(easy, fixed(0)).tokens_per_second

    hopeless = WorkloadModel.from_records(record_trace(streams(0.02, 4, 200), 2, max_new_tokens=200))
    result = simulate(hopeless, controller_schedules(adaptive, max_gamma_cap=8), policy_name="adaptive")
    late = result.gammas[len(result.gammas) // 2 :]
    assert sum(g == 0 for g in late) / len(late) > 0.9  # off, apart from the occasional probe
    assert result.to_dict()["policy"] == "adaptive"


def test_tokens_option_repeats_requests() -> None:
    model = WorkloadModel.from_records(record_trace(streams(0.5, 2, 30), 2, max_new_tokens=30))
    result = simulate(model, fixed(2), tokens=150)
    assert result.tokens == 150
    assert {c.request for c in result.cycles} == set(range(5))


def test_bad_traces_are_user_errors() -> None:
    records = record_trace(streams(0.5, 1, 20), 2, max_new_tokens=20)
    with pytest.raises(UserError, match="cycles"):
        RecordedRequest.from_records(records + records)
    with pytest.raises(UserError, match="no chain-drafting records"):
        WorkloadModel.from_records(records, workload="other")
    with pytest.raises(UserError, match="has no records"):
        WorkloadModel.from_records(records, source_policy="adaptive")
    plain = WorkloadModel.from_records(record_trace(streams(0.5, 1, 20), 0, max_new_tokens=20))
    with pytest.raises(UserError, match="drafted anything"):
        simulate(plain, fixed(2))
    tree = Budget(0, TreeSpec("dynamic", budget=TreeBudget(2, 2, 3)))
    with pytest.raises(UserError, match="chain budgets only"):
        simulate(WorkloadModel.from_records(records), lambda: FixedSchedule(tree))


def test_batched_traces_replay_at_their_batch_size() -> None:
    """Recorded in steps of 16 requests (each step's forward over 16 · (γ + 1) positions), the same text makes the
    goodput-aware policy draft less than recorded alone, and other γ are charged the batch's forward."""
    text = streams(0.8, 4, 200)
    alone = WorkloadModel.from_records(record_trace(text, 4, max_new_tokens=200))
    batched = WorkloadModel.from_records(record_trace(text, 4, max_new_tokens=200, batch=16))
    assert batched.costs.t_verify(16 * 5) == pytest.approx(verify_cost(80))
    replay = simulate(batched, fixed(2))
    charged = [c for c in replay.cycles if not c.recorded]
    assert charged and all(c.verify_seconds == pytest.approx(verify_cost(16 * (c.gamma + 1))) for c in charged)
    adaptive = build_policy("adaptive", max_gamma=8)
    gammas = {}
    for name, model in (("alone", alone), ("batched", batched)):
        result = simulate(model, controller_schedules(adaptive, max_gamma_cap=8), policy_name="adaptive")
        late = result.gammas[len(result.gammas) // 2 :]
        gammas[name] = sum(late) / len(late)
    assert gammas["batched"] < gammas["alone"] - 1, gammas
