"""``--draft mtp`` through the distributed runtime: the MTP layer of a DeepSeek-V3 checkpoint drafts in a drafter
actor of its own, which holds only the target's description and reads the MTP tensors from the checkpoint itself,
with the target's features crossing the gRPC stream from rank 0.

A tiny DeepSeek-V3 target (multi-head latent attention and a mixture of experts, in the target shard's KV pool and
the head's slots alike) written as published (``tests/mtp_checkpoints.py``). Greedy output equals transformers'
``generate`` and the single-process engine's, with the same accepted counts (the same features reached the head).
TP 2 is not run: the DeepSeek-V3 and GLM-4.5 families do not shard yet.
"""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from conftest import EOS_ID, hf_greedy_ids
from mtp_checkpoints import write_checkpoint

from specserve.actors.coordinator import Coordinator
from specserve.actors.replica import ReplicaConfig
from specserve.core.engine import SpeculativeEngine
from specserve.core.model.causal_lm import CausalLM
from specserve.core.request import GenerationConfig
from specserve.core.sampling.params import SamplingParams
from specserve.core.tree.shapes import TreeBudget, TreeSpec
from specserve.drafters.registry import build_drafter

pytestmark = pytest.mark.timeout(300)

PROMPTS = ((5, 17, 23, 8), (60, 61, 62, 3, 9), (40, 41))
CONFIGS = (
    GenerationConfig(max_new_tokens=16, gamma=3),
    GenerationConfig(max_new_tokens=16, tree=TreeSpec("dynamic", budget=TreeBudget(depth=3, width=2, nodes=5))),
)


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory: pytest.TempPathFactory) -> Path:
    directory = tmp_path_factory.mktemp("deepseek-v3-mtp")
    write_checkpoint(directory, "deepseek_v3", seed=3)
    return directory


@pytest.fixture(scope="module")
def coordinator(ray_cluster: Any, checkpoint: Path) -> Iterator[Coordinator]:
    config = ReplicaConfig(
        target=str(checkpoint), draft="mtp", dtype="float64", tp_degree=1, drafter_placement="separate", overlap=True
    )
    running = Coordinator.spawn(config)
    try:
        yield running
    finally:
        running.shutdown()


def test_mtp_in_a_drafter_actor_stays_exact_with_the_same_drafts(coordinator: Coordinator, checkpoint: Path) -> None:
    target = CausalLM.load(checkpoint, dtype="float64")
    engine = SpeculativeEngine(target, build_drafter("mtp", target))
    drafted = 0
    for config in CONFIGS:
        for prompt in PROMPTS:
            got = coordinator.generate(prompt, SamplingParams(), config)
            want = engine.generate(list(prompt), SamplingParams(), config)
            reference = hf_greedy_ids(target.model, prompt, 16)
            reference = reference[: reference.index(EOS_ID) + 1] if EOS_ID in reference else reference
            assert got.output_ids == want.output_ids == reference, (prompt, config)
            assert got.stats.accepted_tokens == want.stats.accepted_tokens  # the same features reached the head
            assert got.stats.drafted_tokens == want.stats.drafted_tokens
            drafted += got.stats.drafted_tokens
    assert drafted > 0
