"""Policies in the engine loop: exactness is unchanged under every policy, and each cycle's budget is recorded.

The engine asks its request's schedule for a budget before every cycle (``specserve.policies.schedules``);
greedy output must still equal transformers' ``generate`` token for token whatever the policy chose,
tree budgets included, and a seeded sampled run must reproduce itself.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

import pytest
from conftest import REF_TOKENS, TinyPair

from specserve.core.draft.schedule import POLICY_NAMES as CORE_POLICY_NAMES
from specserve.core.engine import SpeculativeEngine
from specserve.core.errors import InvalidRequest
from specserve.core.model.causal_lm import CausalLM
from specserve.core.request import GenerationConfig
from specserve.core.sampling.params import SamplingParams
from specserve.core.tree.shapes import TreeBudget, TreeSpec
from specserve.drafters.registry import build_drafter_set
from specserve.policies import POLICY_NAMES
from specserve.policies.estimators import ReplicaPrior
from specserve.policies.schedules import schedules

HfGreedy = Callable[[CausalLM, Sequence[int], int], list[int]]


def engine_for(pair: TinyPair, drafter: str = "model", prior: ReplicaPrior | None = None) -> SpeculativeEngine:
    spec = pair.draft if drafter == "model" else drafter
    return SpeculativeEngine(pair.target, build_drafter_set(spec, pair.target), schedules=schedules(prior))


def test_core_and_policies_name_the_same_policies() -> None:
    assert tuple(POLICY_NAMES) == tuple(CORE_POLICY_NAMES)


@pytest.mark.parametrize("policy", ["fixed", "heuristic", "adaptive"])
@pytest.mark.parametrize("drafter", ["model", "ngram"])
def test_greedy_is_exact_under_every_policy(pair: TinyPair, hf_greedy: HfGreedy, policy: str, drafter: str) -> None:
    engine = engine_for(pair, drafter)
    for prompt in pair.prompts:
        result = engine.generate(prompt, SamplingParams(), GenerationConfig(max_new_tokens=REF_TOKENS, policy=policy))
        assert result.output_ids == hf_greedy(pair.target, prompt, REF_TOKENS), (policy, drafter, prompt)
        stats = result.stats
        assert len(stats.budgets) == len(stats.observations) == stats.cycles
        assert all(0 <= b <= 16 for b in stats.budgets)
        if policy == "fixed":
            assert set(stats.budgets) <= {4, *range(REF_TOKENS)}  # γ 4, cut near the end of the request


def test_adaptive_with_a_tree_candidate_stays_exact(pair: TinyPair, hf_greedy: HfGreedy) -> None:
    tree = TreeSpec("dynamic", budget=TreeBudget(depth=3, width=2, nodes=5))
    engine = engine_for(pair)
    for prompt in pair.prompts[:4]:
        config = GenerationConfig(max_new_tokens=REF_TOKENS, policy="adaptive", tree=tree)
        assert engine.generate(prompt, SamplingParams(), config).output_ids == hf_greedy(
            pair.target, prompt, REF_TOKENS
        )


def test_seeded_sampling_under_the_adaptive_policy_reproduces_when_drafter_invariant(pair: TinyPair) -> None:
    """The adaptive policy decides from measured seconds, so its γ sequence (and with it which random numbers a
    sampled run draws) can differ between runs; drafter-invariant sampling makes the tokens independent of γ,
    so the same seed gives the same tokens whatever the policy decided — and equals plain decoding."""
    params = SamplingParams(temperature=1.0, top_k=20, seed=5, drafter_invariant=True)
    prompt = pair.prompts[0]
    plain = engine_for(pair, "none").generate(prompt, params, GenerationConfig(max_new_tokens=20, gamma=0))
    for _ in range(2):
        got = engine_for(pair).generate(prompt, params, GenerationConfig(max_new_tokens=20, policy="adaptive"))
        assert got.output_ids == plain.output_ids


def test_the_replica_prior_learns_across_requests(pair: TinyPair) -> None:
    prior = ReplicaPrior()
    engine = engine_for(pair, prior=prior)
    before = prior.prior(max_depth=4)
    for prompt in pair.prompts[:3]:
        engine.generate(prompt, SamplingParams(), GenerationConfig(max_new_tokens=12, policy="adaptive"))
    assert prior.prior(max_depth=4) != before


def test_an_engine_without_policies_runs_fixed_only(pair: TinyPair) -> None:
    engine = SpeculativeEngine(pair.target, build_drafter_set(pair.draft, pair.target))
    assert engine.generate(pair.prompts[0], SamplingParams(), GenerationConfig(max_new_tokens=4)).output_ids
    with pytest.raises(InvalidRequest, match="schedules"):
        engine.generate(pair.prompts[0], SamplingParams(), GenerationConfig(max_new_tokens=4, policy="adaptive"))
    with pytest.raises(InvalidRequest, match="policy must be one of"):
        GenerationConfig(policy="greedy-ish")
