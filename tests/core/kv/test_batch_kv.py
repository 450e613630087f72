"""The batched engine's KV pool, step by step: each running request's sequence equals a fresh prefill of its committed
text (all but the last token, which heads the next block) after every step, and the pool is empty once every
request finished or was cancelled. Chains and trees, greedy and sampled, one request cancelled mid-run."""

from __future__ import annotations

import torch
from conftest import TinyPair, assert_pool_empty
from test_kv_pool import assert_same_kv

from specserve.core.batch_engine import BatchedEngine
from specserve.core.request import GenerationConfig
from specserve.core.sampling.params import SamplingParams
from specserve.core.tree.shapes import TreeBudget, TreeSpec
from specserve.drafters.registry import request_drafters

TREE = TreeSpec("dynamic", budget=TreeBudget(depth=3, width=2, nodes=5))


def test_every_sequence_equals_a_fresh_prefill_after_every_step(pair: TinyPair) -> None:
    engine = BatchedEngine(
        pair.target, request_drafters(pair.draft, pair.target, max_num_seqs=3, max_seq_len=96), max_num_seqs=3,
        max_seq_len=96, prefill_tokens=6,
    )  # fmt: skip
    requests = [
        (SamplingParams(), GenerationConfig(max_new_tokens=18, gamma=3)),
        (SamplingParams(temperature=1.0, seed=3), GenerationConfig(max_new_tokens=14, tree=TREE)),
        (SamplingParams(temperature=0.8, top_p=0.9, seed=4), GenerationConfig(max_new_tokens=16, gamma=2)),
        (SamplingParams(), GenerationConfig(max_new_tokens=12, gamma=4, drafter="ngram")),
    ]
    ids = [engine.submit(list(pair.prompts[i]), params, config) for i, (params, config) in enumerate(requests)]
    cancel_at, steps, checked = 5, 0, 0
    while engine.has_work:
        engine.step()
        steps += 1
        if steps == cancel_at:
            engine.cancel(ids[1])  # mid-run: its KV is freed at once
        for request in engine._running.values():  # the engine's own bookkeeping, read-only
            verifier = request.verifier
            assert verifier is not None
            if verifier.unprefilled:
                continue
            assert_same_kv(engine.pool, request.seq_id, pair.target, torch.tensor(verifier.committed[:-1]))
            checked += 1
    assert checked > 10 and steps > cancel_at
    assert_pool_empty(engine)
    draft_pool = engine.new_drafter("default").batcher.pool  # type: ignore[attr-defined]
    assert draft_pool.num_sequences == 0
