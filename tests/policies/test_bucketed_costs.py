"""Bucketed verify costs: a static-shape engine pads a block of k positions to ``buckets.width(k)``, the policy
learns T_verify per bucket and never drafts into a bucket that costs more than a wider one.

The device here has buckets 1, 2, 4, 6, 8 and a width 6 that is slower than width 8 (:data:`RAW_MS`: say,
kernels that like multiples of 8), so a block of 5 or 6 positions pays 22 ms while one of 7 or 8 pays 19.5 ms.
Streams are seeded synthetic ones (:mod:`synthetic_streams`); no model runs.
"""

from __future__ import annotations

import dataclasses
import random
from collections.abc import Callable, Mapping

import pytest
from synthetic_streams import DRAFT_MS_PER_TOKEN, MS, constant_alpha, cpu_verify_seconds, run_stream
from test_simulator import record_trace

from specserve.core.draft.schedule import Schedule
from specserve.core.model.buckets import NO_BUCKETS, VerifyBuckets, bucketed_costs
from specserve.policies import (
    AdaptivePolicy,
    Budget,
    CostEstimator,
    CycleObservation,
    EstimatorPrior,
    Estimators,
    Policy,
    PolicyState,
    ReplicaPrior,
    SpeculationController,
    optimal_gamma,
)
from specserve.policies.schedules import schedules
from specserve.policies.simulator import WorkloadModel, controller_schedules, simulate
from specserve.policies.traces import TraceRecord

BUCKETS = VerifyBuckets((1, 2, 4, 6, 8))
MAX_GAMMA = 7  # blocks up to k = 8, the widest bucket

# Forward cost per width on the imagined device (ms): width 6 is dearer than width 8
RAW_MS: Mapping[int, float] = {1: 13.5, 2: 17.5, 3: 18.0, 4: 18.4, 5: 21.5, 6: 22.0, 7: 19.3, 8: 19.5}
# The same device with a well-behaved width 6 (the control: there, k = 5 and 6 are worth drafting)
CHEAP_SIX_MS: Mapping[int, float] = {**RAW_MS, 5: 18.8, 6: 19.0}


def paid(raw_ms: Mapping[int, float]) -> Callable[[int], float]:
    """What a block of k positions costs the static-shape engine (seconds): the forward at its bucket."""
    padded = bucketed_costs(raw_ms, BUCKETS)
    return lambda k: padded[k] * MS


def chain(gamma: int, verify_s: float, accepted: int = 0) -> CycleObservation:
    return CycleObservation(Budget(gamma), gamma, gamma, accepted, 0.0, verify_s)


def measured_prior(raw_ms: Mapping[int, float]) -> EstimatorPrior:
    """A replica prior that has measured every width (a start-up measurement, or pooled cycles)."""
    return EstimatorPrior(verify_seconds=tuple(raw_ms[w] * MS for w in sorted(raw_ms)), plain_measured=True)


# ---------------------------------------------------------------------------------------------------------
# The estimator


def test_a_block_is_recorded_at_the_width_it_ran_at_and_priced_at_its_bucket() -> None:
    costs = CostEstimator(buckets=VerifyBuckets((1, 2, 4, 8)))
    for _ in range(5):
        costs.observe(chain(5, 30 * MS))  # k = 6 ran at bucket 8
    assert costs.observed_verify() == {8: pytest.approx(30 * MS)}
    table = costs.verify_table(8)
    assert table[4:8] == pytest.approx((30 * MS,) * 4)  # k = 5 .. 8 all run at 8
    assert costs.t_verify(6) == costs.t_verify(8) == pytest.approx(30 * MS)
    # the prior's shape is read at the bucket width: level 30 / T_prior(8), applied at bucket 4 (k = 3 and 4)
    prior = EstimatorPrior()
    expected_four = prior.t_verify(4) * 30 * MS / prior.t_verify(8)
    assert costs.t_verify(3) == costs.t_verify(4) == pytest.approx(expected_four)


def test_plain_decoding_is_measured_at_its_bucket() -> None:
    estimators = Estimators(buckets=VerifyBuckets((2, 4, 8)))  # no bucket 1: a plain step runs at width 2
    assert not estimators.plain_measured
    estimators.observe(chain(0, 15 * MS))
    assert estimators.plain_measured and estimators.costs.observed_verify() == {2: pytest.approx(15 * MS)}
    assert estimators.costs.t_verify(1) == estimators.costs.t_verify(2) == pytest.approx(15 * MS)


def test_a_dearer_bucket_is_priced_at_the_wider_one_and_no_chain_drafts_into_it() -> None:
    truth = paid(RAW_MS)
    costs = CostEstimator(buckets=BUCKETS)
    for k in range(1, MAX_GAMMA + 2):
        costs.observe_verify(k, truth(k))
    table, dominated = costs.verify_prices()
    assert costs.t_verify(6) == costs.t_verify(8) == table[5] == pytest.approx(19.5 * MS)  # the envelope
    assert table[4] == pytest.approx(19.5 * MS)  # k = 5 pads to 6: priced at 8 too
    assert table[3] == pytest.approx(18.4 * MS) and table[2] == pytest.approx(18.4 * MS)  # k = 3, 4: bucket 4
    assert dominated == {5, 6} == costs.dominated()
    state = PolicyState(
        alpha=(0.72,) * 16,
        alpha_weight=(1e6,) * 16,
        draft_seconds_per_token=DRAFT_MS_PER_TOKEN * MS,
        draft_fixed_seconds=0.0,
        verify_seconds=table,
        dominated_ks=dominated,
    )
    policy = AdaptivePolicy(max_gamma=MAX_GAMMA)
    best = optimal_gamma(0.72, DRAFT_MS_PER_TOKEN * MS, 0.0, truth, MAX_GAMMA)  # at what the engine really pays
    assert best == 6 and policy.decide(state) == Budget(best)
    # the envelope alone would draft γ = 5 (priced at bucket 8's 19.5 ms) and pay bucket 6's 22 ms
    assert policy.decide(dataclasses.replace(state, dominated_ks=frozenset())) == Budget(5)


def test_without_buckets_nothing_is_padded_or_enveloped() -> None:
    """The rule as before buckets: each k's own mean (a cheaper k = 5 below a dearer k = 3 stays so), unobserved
    k >= 2 on the weighted line through the observed k >= 2 (here slope < 0, clamped to a flat mean)."""
    for costs in (CostEstimator(), CostEstimator(buckets=NO_BUCKETS)):
        for k, ms in ((1, 10.0), (3, 20.0), (5, 18.0)):
            costs.observe_verify(k, ms * MS)
        decay = 2.0 ** (-1.0 / 16)  # the request half-life: k = 3 was seen one cycle before k = 5
        flat = (20.0 * decay + 18.0) / (decay + 1.0) * MS
        assert costs.observed_verify().keys() == {1, 3, 5}
        assert costs.verify_table(6) == pytest.approx((10 * MS, flat, 20 * MS, flat, 18 * MS, flat))
        assert costs.dominated() == frozenset()


def test_without_buckets_the_adaptive_decisions_are_unchanged() -> None:
    """Default, ``None`` and empty buckets are one and the same: the same γ, cycle for cycle, on a seeded stream."""
    runs = []
    for factory in (schedules(), schedules(buckets=None), schedules(buckets=NO_BUCKETS)):
        controller = factory("adaptive", Budget(4))
        assert isinstance(controller, SpeculationController) and controller.buckets == NO_BUCKETS
        gammas = run_stream(controller, constant_alpha(0.75), 150, cpu_verify_seconds, seed=3)
        runs.append((gammas, controller.snapshot().verify_seconds))
    assert runs[0] == runs[1] == runs[2]


# ---------------------------------------------------------------------------------------------------------
# Controllers, the replica prior and the schedule factory


def test_the_factory_threads_buckets_to_every_request_and_its_prior() -> None:
    buckets = VerifyBuckets((1, 2, 4, 8))
    factory = schedules(max_gamma_cap=MAX_GAMMA, buckets=buckets)
    first = factory("adaptive", Budget(4))
    assert isinstance(first, SpeculationController) and first.buckets == buckets
    assert first.replica_prior is not None and first.replica_prior.buckets == buckets
    for _ in range(8):
        first.observe(chain(5, 30 * MS))  # k = 6: the replica pools it at width 8
    pooled = first.replica_prior.prior().verify_seconds
    assert pooled[7] == pytest.approx(30 * MS) and pooled[5] != pytest.approx(30 * MS)
    second = factory("heuristic", Budget(3))
    assert isinstance(second, SpeculationController) and second.buckets == buckets
    assert second.estimators.costs.t_verify(5) == pytest.approx(30 * MS)  # seeded from the pooled bucket 8


def test_a_prior_pooling_other_buckets_is_refused() -> None:
    with pytest.raises(ValueError, match="build the ReplicaPrior with the engine's buckets"):
        schedules(ReplicaPrior(), buckets=BUCKETS)
    with pytest.raises(ValueError, match="buckets 1,2,4,6,8, not 1,2,4,8"):
        controller_schedules(AdaptivePolicy(), ReplicaPrior(buckets=BUCKETS), buckets=VerifyBuckets((1, 2, 4, 8)))
    inherited = schedules(ReplicaPrior(buckets=BUCKETS))("adaptive", Budget(4))  # the prior's buckets by default
    assert isinstance(inherited, SpeculationController) and inherited.buckets == BUCKETS


@pytest.mark.parametrize("alpha", [0.72, 0.78, 0.85])
def test_adaptive_requests_never_draft_into_a_dearer_bucket(alpha: float) -> None:
    """Three requests per α on a replica that measured its widths: no γ = 4 or 5 (k = 5, 6 would pay bucket 6's
    22 ms), the policy drafts (mostly γ >= 3), and t_verify(6) stays at t_verify(8). The control — the same run
    with a well-behaved width 6 — does draft γ = 4 or 5, so the property is not a quirk of these α."""
    for raw, dear in ((RAW_MS, True), (CHEAP_SIX_MS, False)):
        factory = schedules(ReplicaPrior(measured_prior(raw), buckets=BUCKETS), MAX_GAMMA, buckets=BUCKETS)
        gammas: list[int] = []
        for seed in range(3):
            controller = factory("adaptive", Budget(4))
            assert isinstance(controller, SpeculationController)
            gammas += run_stream(controller, constant_alpha(alpha), 120, paid(raw), seed=seed)
            if dear:
                assert controller.estimators.costs.t_verify(6) == controller.estimators.costs.t_verify(8)
        into_six = sum(g in (4, 5) for g in gammas)
        if dear:
            assert into_six == 0
            assert sum(g >= 3 for g in gammas) > 0.9 * len(gammas)
        elif alpha < 0.8:  # where k = 5 or 6 is (near) the best at a cheap width 6
            assert into_six > 0


# ---------------------------------------------------------------------------------------------------------
# The trace simulator


class EnvelopeOnly:
    """The adaptive policy reading the enveloped table but blind to which blocks would pay a dearer bucket."""

    name = "adaptive"
    calibrates_plain = True

    def __init__(self) -> None:
        self.inner = AdaptivePolicy(max_gamma=MAX_GAMMA)

    def decide(self, state: PolicyState) -> Budget:
        return self.inner.decide(dataclasses.replace(state, dominated_ks=frozenset()))


def replay(policy: Policy, records: list[TraceRecord]) -> tuple[list[int], float]:
    """(γ chosen each cycle, tokens/s) of ``policy`` replayed over ``records`` on a replica that pooled them."""
    replica = ReplicaPrior(buckets=BUCKETS)
    for record in records:
        replica.observe(record.observation())
    controllers: list[SpeculationController] = []
    make = controller_schedules(policy, replica, MAX_GAMMA, buckets=BUCKETS)

    def fresh() -> Schedule:
        controllers.append(make())
        return controllers[-1]

    result = simulate(WorkloadModel.from_records(records), fresh, seed=1)
    chosen = [int(entry["chosen"][len("chain(gamma=") : -1]) for c in controllers for entry in c.history]
    assert len(chosen) == len(result.cycles)
    return chosen, result.tokens_per_second


def test_a_replay_with_bucketed_costs_drafts_only_blocks_that_pad_for_free() -> None:
    """Recorded at every γ 0..7 on the static-shape engine (α ≈ 0.74, 2 ms per draft token), then replayed under
    the adaptive policy on a replica that pooled those recordings: every γ chosen has a block that is a bucket
    (k = 1, 2, 4, 8) or pads to one that costs no more than any wider bucket (k = 3, 7) — never k = 5 or 6, which
    pay bucket 6. The same replay blind to that (the envelope alone) drafts γ = 5 and commits fewer tokens/s."""
    truth = paid(RAW_MS)
    rng = random.Random(7)
    streams = [[rng.random() < 0.74 for _ in range(160)] for _ in range(4)]
    records = [
        r
        for gamma in range(MAX_GAMMA + 1)
        for r in record_trace(
            streams, gamma, max_new_tokens=160, noise=0.02, seed=gamma, workload="bucketed",
            draft=lambda drafted: 2.0 * MS * drafted, verify=truth,
        )
    ]  # fmt: skip
    chosen, rate = replay(AdaptivePolicy(max_gamma=MAX_GAMMA), records)
    assert len(chosen) > 100
    cheapest_from = {w: min(RAW_MS[b] for b in BUCKETS.widths if b >= w) for w in BUCKETS.widths}
    for gamma in chosen:
        width = BUCKETS.width(gamma + 1)
        assert RAW_MS[width] == cheapest_from[width], gamma  # a bucket on the envelope: padding is free
    assert not {4, 5} & set(chosen) and {3, 6} <= set(chosen)  # bucket 4 full, and k = 7 padded to 8
    blind, blind_rate = replay(EnvelopeOnly(), records)
    assert 5 in blind and rate > blind_rate
