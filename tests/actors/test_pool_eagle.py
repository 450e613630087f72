"""An EAGLE-3 head on a drafter pool's member, drafting for the requests of two tensor-parallel replicas at once.

On the session's local Ray cluster: two TP 2 replicas of the tiny qwen2 pair (float64, two requests each) of
``drafter_placement: pool``, whose drafter is a published EAGLE-3 head (SafeAILab layout, random weights, reading
three of the target's layers), share one member of the model's shared pool. Every request's head state (its slots of
the head's keys and values, the features rank 0 sent it) lives on that member beside the other replica's request. For
one request of each replica at once, chains and trees: greedy output equals transformers' and the single-process
engine's with the same head, with exactly as many tokens drafted and accepted (the same features reached the head for
each request); seeded T = 1 sampling equals the engine's run with the same seed.

The draft model at TP 1 through a pool, and the pool's scaling, are test_drafter_pool.py's.
"""

from __future__ import annotations

from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from dataclasses import replace
from pathlib import Path
from typing import Any

import pytest
from conftest import TinyPair
from published_heads import LAYOUTS, write_head
from replicas import greedy_reference, replicas_at_once

from specserve.actors.coordinator import Coordinator
from specserve.actors.drafter_pool import SharedPool
from specserve.cluster.replica_config import ReplicaConfig
from specserve.core.engine import SpeculativeEngine
from specserve.core.request import GenerationConfig
from specserve.core.sampling.params import SamplingParams
from specserve.core.tree.shapes import TreeBudget, TreeSpec
from specserve.drafters.registry import build_drafter

pytestmark = pytest.mark.timeout(300)
TOKENS = 20
CONFIGS = (
    GenerationConfig(max_new_tokens=TOKENS, gamma=3),
    GenerationConfig(max_new_tokens=TOKENS, tree=TreeSpec("dynamic", budget=TreeBudget(depth=3, width=2, nodes=5))),
)


@pytest.fixture(scope="module")
def pooled(
    ray_cluster: Any, saved_pairs: dict[str, Path], tmp_path_factory: pytest.TempPathFactory
) -> Iterator[tuple[SharedPool, list[Coordinator], str]]:
    """The head saved, and two TP 2 replicas drafting with it on their shared pool's one member."""
    directory = tmp_path_factory.mktemp("eagle3-pool")
    layout = LAYOUTS["eagle3"]  # the tiny target has 2 layers: the embeddings and the input of layer 1 (twice)
    write_head(directory, replace(layout, config={**layout.config, "eagle_aux_hidden_state_layer_ids": [0, 1, 1]}))
    spec = f"eagle:{directory}"
    config = ReplicaConfig(
        target=str(saved_pairs["qwen2"] / "target"),
        draft=spec,
        dtype="float64",
        tp_degree=2,
        drafter_placement="pool",
        max_num_seqs=2,
        pool_max_members=1,
    )
    pool = SharedPool(config)
    try:
        with replicas_at_once(config) as coordinators:
            yield pool, coordinators, spec
    finally:
        pool.shutdown()


def test_two_tp2_replicas_draft_with_one_members_eagle_head_and_stay_exact(
    pooled: tuple[SharedPool, list[Coordinator], str], tiny_pairs: dict[str, TinyPair]
) -> None:
    pool, (first, second), spec = pooled
    pair = tiny_pairs["qwen2"]
    assert len(pool.members) == 1 and first.replica.drafter == second.replica.drafter == pool.members[0]
    assert first.processes()["drafter"] == second.processes()["drafter"]
    engine = SpeculativeEngine(pair.target, build_drafter(spec, pair.target))
    drafted = 0
    with ThreadPoolExecutor(2) as run:
        for config in CONFIGS:
            prompts = pair.prompts[:2]
            futures = [
                run.submit(coordinator.generate, prompt, SamplingParams(), config)
                for coordinator, prompt in zip([first, second], prompts, strict=True)
            ]
            for prompt, future in zip(prompts, futures, strict=True):
                got, want = future.result(), engine.generate(prompt, SamplingParams(), config)
                assert got.output_ids == want.output_ids == greedy_reference(pair, prompt, TOKENS), (prompt, config)
                # the same drafts as alone: the same features reached the head for this request
                assert (got.stats.drafted_tokens, got.stats.accepted_tokens) == (
                    want.stats.drafted_tokens,
                    want.stats.accepted_tokens,
                )
                drafted += got.stats.drafted_tokens

        for config in CONFIGS:
            seeds = [SamplingParams(temperature=1.0, top_k=30, seed=seed) for seed in (1, 2)]
            futures = [
                run.submit(coordinator.generate, pair.prompts[2], params, config)
                for coordinator, params in zip([first, second], seeds, strict=True)
            ]
            for params, future in zip(seeds, futures, strict=True):
                assert future.result().output_ids == engine.generate(pair.prompts[2], params, config).output_ids
    assert drafted > 0  # a random head is rarely right, but it drafted from the features it was sent
