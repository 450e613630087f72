"""Layer-skip chains drafted for many requests in shared forwards over the batched engine's own KV pool
(:mod:`specserve.drafters.layerskip_batch`): greedy output equals transformers', sampled output follows the target's
law and equals the single-request engine's seed for seed, drafts are accepted, and every span is given back to the
target as it was."""

from __future__ import annotations

import pytest
import torch
from conftest import assert_pool_empty, build_model, finish_all, hf_greedy_ids
from stats_helpers import batched_runs, check_single_engine_agrees, two_token_fit

from specserve.core.batch_engine import BatchedEngine
from specserve.core.engine import SpeculativeEngine
from specserve.core.errors import UserError
from specserve.core.kv.pool import KVPool
from specserve.core.model.causal_lm import CausalLM
from specserve.core.request import GenerationConfig
from specserve.core.sampling.params import SamplingParams
from specserve.drafters.layerskip import LayerSkipDrafter
from specserve.drafters.layerskip_batch import BatchedLayerSkip, PooledLayerSkipDrafter
from specserve.drafters.registry import request_drafters

PROMPTS = [[5, 17, 23, 8, 30, 41, 9], [3, 4, 5, 3, 4, 5, 3, 4], [12, 40, 2], [7, 7, 7, 7, 7, 7]]


def periodic_target(family: str) -> CausalLM:
    """A 4-layer target whose first layers predict it well enough that chains are accepted at every depth."""
    return CausalLM(build_model(family, num_layers=4, seed=5).double())


@pytest.mark.parametrize("family", ["llama", "qwen2"])
def test_batched_chains_equal_transformers_greedy_and_give_the_spans_back(family: str) -> None:
    target = periodic_target(family)
    new_drafter = request_drafters("layerskip:2", target, max_num_seqs=4, max_seq_len=64)
    drafter = new_drafter("default")
    assert isinstance(drafter, PooledLayerSkipDrafter) and isinstance(drafter.batcher, BatchedLayerSkip)
    engine = BatchedEngine(target, new_drafter, max_num_seqs=4, max_seq_len=64, prefill_tokens=8)
    config = GenerationConfig(max_new_tokens=16, gamma=3)
    forwards: list[int] = []
    batcher = drafter.batcher
    original = batcher.model.forward_batch

    def counting(pool, blocks, **kwargs):  # type: ignore[no-untyped-def]
        assert pool is engine.pool  # drafted in the target's own pool
        forwards.append(len(blocks))
        return original(pool, blocks, **kwargs)

    batcher.model.forward_batch = counting  # type: ignore[method-assign]
    ids = {engine.submit(prompt, SamplingParams(), config): prompt for prompt in PROMPTS}
    results = finish_all(engine)
    drafted = accepted = 0
    for request_id, prompt in ids.items():
        got = results[request_id]
        assert got.output_ids == hf_greedy_ids(target.model, prompt, 16), prompt
        drafted += got.stats.drafted_tokens
        accepted += got.stats.accepted_tokens
    assert drafted > accepted > 0
    assert max(forwards) > 1  # several requests' chains in one forward
    assert_pool_empty(engine)


def test_sampled_batched_chains_follow_the_target_law_and_the_single_engine() -> None:
    """Two tokens at T = 1 drafted by the target's first layer for 2,500 seeded requests of one batched engine
    (chi-square, significance 1e-3, fixed seeds); the first seeds equal the single-request engine's output."""
    target = periodic_target("llama")
    batched = BatchedEngine(target, request_drafters("layerskip:1", target, max_num_seqs=32, max_seq_len=16),
                            max_num_seqs=32, max_seq_len=16)  # fmt: skip
    prompt = [5, 17, 23, 8, 30]
    config = GenerationConfig(max_new_tokens=2, gamma=3, ignore_eos=True)
    params = SamplingParams(temperature=1.0, top_k=24)
    runs = batched_runs(batched, prompt, params, config, 2500)
    assert two_token_fit([run.output_ids for run in runs], target, prompt, params) > 1e-3
    assert sum(run.stats.accepted_tokens for run in runs) > 0
    check_single_engine_agrees(SpeculativeEngine(target, LayerSkipDrafter(target, 1)), runs, prompt, params, config)


def test_a_pool_without_plain_keys_is_refused_in_one_line() -> None:
    target = periodic_target("llama")
    pool = KVPool(target.model, capacity=16)
    pool.gathers = True  # as a multi-head latent attention pool
    drafter = request_drafters("layerskip:2", target, max_num_seqs=2, max_seq_len=16)("default")
    assert isinstance(drafter, PooledLayerSkipDrafter)
    drafter.start([1, 2, 3], SamplingParams(), torch.Generator())
    with pytest.raises(UserError, match="use a draft model or a head instead"):
        drafter.follow_target_pool(pool, pool.allocate(8))
    with pytest.raises(RuntimeError, match="this one was given none"):
        drafter.propose(2)
