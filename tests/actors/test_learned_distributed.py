"""Hidden-state drafters through the distributed runtime: the target's features cross the gRPC stream.

An EAGLE head runs in the drafter actor, which holds only the target's description (and loads the
target's embeddings and LM head itself); the prompt's features come back from rank 0's prefill and
each verdict carries its root's and accepted path's features — at TP 2 from rank 0, whose residual
stream is whole after every all-reduce. Output equals the single-process engine with the same head
and transformers' greedy decoding; seeded sampling equals the engine's run; drafts are accepted,
which they could not be without the features.
"""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest
from conftest import TinyPair
from head_helpers import trained_head
from replicas import greedy_reference

from specserve.actors.coordinator import Coordinator
from specserve.actors.replica import ReplicaConfig
from specserve.core.engine import GenerationConfig, SpeculativeEngine
from specserve.core.sampling import SamplingParams
from specserve.core.tree import TreeBudget, TreeSpec
from specserve.drafters.eagle import EagleDrafter

pytestmark = pytest.mark.timeout(300)

CASES = {"llama-tp1-colocated": ("llama", 1, "colocated"), "qwen2-tp2-separate": ("qwen2", 2, "separate")}
CONFIGS = (
    GenerationConfig(max_new_tokens=20, gamma=3),
    GenerationConfig(max_new_tokens=20, tree=TreeSpec("dynamic", budget=TreeBudget(depth=3, width=2, nodes=5))),
)


@dataclass
class Running:
    pair: TinyPair
    coordinator: Coordinator
    engine: SpeculativeEngine


@pytest.fixture(scope="module", params=list(CASES))
def running(
    request: pytest.FixtureRequest,
    ray_cluster: Any,
    saved_pairs: dict[str, Path],
    tiny_pairs: dict[str, TinyPair],
    tmp_path_factory: pytest.TempPathFactory,
) -> Iterator[Running]:
    family, tp, placement = CASES[request.param]
    pair = tiny_pairs[family]
    head = trained_head(pair)
    head_dir = tmp_path_factory.mktemp(f"eagle-{family}")
    head.save(head_dir)
    config = ReplicaConfig(
        target=str(saved_pairs[family] / "target"),
        draft=f"eagle:{head_dir}",
        dtype="float64",
        tp_degree=tp,
        drafter_placement=placement,  # type: ignore[arg-type]
        overlap=True,  # asked for, but a hidden-state drafter waits for each verdict's features
    )
    coordinator = Coordinator.spawn(config)
    try:
        yield Running(pair, coordinator, SpeculativeEngine(pair.target, EagleDrafter.for_target(head, pair.target)))
    finally:
        coordinator.shutdown()


def test_features_cross_the_wire_and_greedy_stays_exact(running: Running) -> None:
    accepted = 0
    for config in CONFIGS:
        for prompt in running.pair.prompts:
            got = running.coordinator.generate(prompt, SamplingParams(), config)
            want = running.engine.generate(prompt, SamplingParams(), config)
            assert got.output_ids == want.output_ids == greedy_reference(running.pair, prompt, 20), (prompt, config)
            assert got.stats.accepted_tokens == want.stats.accepted_tokens  # the same drafts: the same features
            accepted += got.stats.accepted_tokens
    assert accepted > 0


def test_seeded_sampling_equals_the_engine(running: Running) -> None:
    for config in CONFIGS:
        for seed in range(3):
            params = SamplingParams(temperature=1.0, top_k=30, seed=seed)
            prompt = running.pair.prompts[seed]
            got = running.coordinator.generate(prompt, params, config)
            assert got.output_ids == running.engine.generate(prompt, params, config).output_ids, (seed, config)


def test_a_request_may_still_choose_ngram(running: Running) -> None:
    prompt = running.pair.prompts[0]
    config = GenerationConfig(max_new_tokens=20, gamma=3, drafter="ngram")
    got = running.coordinator.generate(prompt, SamplingParams(), config)
    assert got.output_ids == greedy_reference(running.pair, prompt, 20)
