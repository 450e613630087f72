"""Learned drafters through the distributed runtime: EAGLE and Medusa read features that cross the gRPC stream.

The heads run in the drafter actor (a published EAGLE-3 head at TP 2 on a drafter pool's member and a published Medusa
head at TP 2 among them), which holds only the target's description (and loads the target's weights it needs itself).
For the hidden-state drafters (EAGLE, Medusa) the prompt's features come back from rank 0's prefill and each verdict
carries its root's and accepted path's features — at TP 2 from rank 0, whose residual stream is whole after every
all-reduce. Layer-skip with a trained exit head needs no features. Output equals the single-process engine with the
same drafter (the same accepted counts: the same features reached the drafter) and transformers' greedy decoding;
seeded sampling equals the engine's run. The cases' replicas are spawned all at once as the module starts.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

import pytest
import torch
from conftest import TinyPair, cases_in_use
from head_helpers import trained_head
from published_heads import LAYOUTS, write_head
from published_medusa import LAYOUTS as MEDUSA_LAYOUTS
from published_medusa import write_head as write_medusa_head
from replicas import greedy_reference, spawned_at_once

from specserve.actors.coordinator import Coordinator
from specserve.actors.replica import ReplicaConfig
from specserve.core.engine import SpeculativeEngine
from specserve.core.request import GenerationConfig
from specserve.core.sampling.params import SamplingParams
from specserve.core.tree.shapes import TreeBudget, TreeSpec
from specserve.drafters.layerskip import ExitHead, save_exit_head
from specserve.drafters.registry import build_drafter

pytestmark = pytest.mark.timeout(300)

CASES = {  # name: family, TP degree, drafter placement, drafter
    "eagle-llama-tp1-colocated": ("llama", 1, "colocated", "eagle"),
    # a published EAGLE-3 head (SafeAILab layout, random weights, 40-token draft vocabulary) reading three layers, on
    # a member of a drafter pool (the model's shared pool: the head's KV and features on the member, per request)
    "eagle3-published-qwen2-tp2-pool": ("qwen2", 2, "pool", "eagle3"),
    # a published FasterDecoding Medusa head (random weights, two blocks per head)
    "medusa-published-llama-tp2-separate": ("llama", 2, "separate", "medusa"),
    "layerskip-exit-head-qwen2-tp1-colocated": ("qwen2", 1, "colocated", "layerskip"),
}
CONFIGS = (
    GenerationConfig(max_new_tokens=20, gamma=3),
    GenerationConfig(max_new_tokens=20, tree=TreeSpec("dynamic", budget=TreeBudget(depth=3, width=2, nodes=5))),
)


@dataclass
class Running:
    kind: str
    pair: TinyPair
    coordinator: Coordinator
    engine: SpeculativeEngine


def save_head(kind: str, pair: TinyPair, directory: Path) -> str:
    """A head of ``kind`` for the pair's target saved in ``directory``; the ``--draft`` spec that loads it."""
    if kind == "eagle":
        trained_head(pair).save(directory)
        return f"eagle:{directory}"
    if kind == "eagle3":  # the tiny target has 2 layers: read the embeddings and the input of layer 1 (twice)
        layout = LAYOUTS["eagle3"]
        write_head(directory, replace(layout, config={**layout.config, "eagle_aux_hidden_state_layer_ids": [0, 1, 1]}))
        return f"eagle:{directory}"
    if kind == "medusa":  # a published FasterDecoding head (random weights, two blocks per head, safetensors)
        write_medusa_head(
            directory, MEDUSA_LAYOUTS["fd-st-2"], pair.target.model.get_output_embeddings().weight.detach()
        )
        return f"medusa:{directory}"
    head = ExitHead(pair.target.model.config.hidden_size, generator=torch.Generator().manual_seed(0)).double()
    with torch.no_grad():
        head.down.weight.normal_(0.0, 0.05, generator=torch.Generator().manual_seed(1))
    save_exit_head(directory, head, pair.target, 1)
    return f"layerskip:{directory}"


def config_for(name: str, models: Path, spec: str) -> ReplicaConfig:
    _, tp, placement, kind = CASES[name]
    return ReplicaConfig(
        target=str(models / "target"),
        draft=spec,
        dtype="float64",
        tp_degree=tp,
        drafter_placement=placement,  # type: ignore[arg-type]
        # asked for, but a hidden-state drafter waits for each verdict's features (so its seeded runs match the
        # engine's); layer-skip would draft ahead, which changes a seed's text (README: overlap mode)
        overlap=kind != "layerskip",
        # the EAGLE replicas are batched: rank 0's prefix cache serves their requests, features and all
        max_num_seqs=4 if kind.startswith("eagle") else 1,
    )


@pytest.fixture(scope="module")
def replicas(
    request: pytest.FixtureRequest,
    ray_cluster: Any,
    saved_pairs: dict[str, Path],
    tiny_pairs: dict[str, TinyPair],
    tmp_path_factory: pytest.TempPathFactory,
) -> Iterator[tuple[dict[str, str], Callable[[str], Coordinator]]]:
    """Each case's head saved (its ``--draft`` spec), and its replica: all spawned at once (they fit the cluster
    together), each as soon as its head is saved."""
    specs: dict[str, str] = {}

    def configs() -> Iterator[tuple[str, ReplicaConfig]]:
        for name in cases_in_use(request, "running"):
            family, _, _, kind = CASES[name]
            specs[name] = save_head(kind, tiny_pairs[family], tmp_path_factory.mktemp(f"{kind}-{family}"))
            yield name, config_for(name, saved_pairs[family], specs[name])

    with spawned_at_once(configs()) as take:
        yield specs, take


@pytest.fixture(scope="module", params=list(CASES))
def running(
    request: pytest.FixtureRequest,
    replicas: tuple[dict[str, str], Callable[[str], Coordinator]],
    tiny_pairs: dict[str, TinyPair],
) -> Iterator[Running]:
    family, _, _, kind = CASES[request.param]
    pair = tiny_pairs[family]
    specs, take = replicas
    coordinator = take(request.param)
    try:
        engine = SpeculativeEngine(pair.target, build_drafter(specs[request.param], pair.target))
        yield Running(kind, pair, coordinator, engine)
    finally:
        coordinator.shutdown()


def test_greedy_stays_exact_with_the_same_drafts(running: Running) -> None:
    accepted = drafted = 0
    for config in CONFIGS:
        for prompt in running.pair.prompts:
            got = running.coordinator.generate(prompt, SamplingParams(), config)
            want = running.engine.generate(prompt, SamplingParams(), config)
            assert got.output_ids == want.output_ids == greedy_reference(running.pair, prompt, 20), (prompt, config)
            assert got.stats.accepted_tokens == want.stats.accepted_tokens  # the same drafts: the same features
            assert got.stats.drafted_tokens == want.stats.drafted_tokens
            accepted += got.stats.accepted_tokens
            drafted += got.stats.drafted_tokens
    if running.kind == "eagle":
        assert accepted > 0  # without the features the head could not draft at all
    if running.kind == "eagle3":
        assert drafted > 0  # a random head is rarely right, but it drafted from the features it was sent


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


def test_a_repeated_prompt_and_its_next_turn_come_from_the_prefix_cache(running: Running) -> None:
    """Batched replicas (EAGLE here) reuse the KV of a repeated prompt and of the last turn (prompt and answer), their
    drafter gets the cached prefix's features from rank 0, and the drafts and output are what they are cold; a
    one-at-a-time replica keeps no cache."""
    pair, coordinator = running.pair, running.coordinator
    prompt = max(pair.prompts, key=len)
    config = GenerationConfig(max_new_tokens=12, gamma=3, ignore_eos=True, cache_namespace=f"turns-{running.kind}")
    first = coordinator.generate(prompt, SamplingParams(), config)
    again = coordinator.generate(prompt, SamplingParams(), config)
    follow = [*prompt, *first.output_ids, 5, 6, 7]
    seeded = SamplingParams(temperature=1.0, top_k=30, seed=4)
    turn = coordinator.generate(follow, seeded, config)
    cached = [result.stats.cached_tokens for result in (first, again, turn)]
    if running.kind.startswith("eagle"):
        assert cached == [0, len(prompt) - 1, len(prompt) + len(first.output_ids) - 1]
    else:
        assert cached == [0, 0, 0]
    assert first.output_ids == again.output_ids
    for got, (text, params) in (
        (first, (prompt, SamplingParams())),
        (again, (prompt, SamplingParams())),
        (turn, (follow, seeded)),
    ):
        want = running.engine.generate(text, params, config)
        assert got.output_ids == want.output_ids
        assert (got.stats.drafted_tokens, got.stats.accepted_tokens) == (
            want.stats.drafted_tokens,
            want.stats.accepted_tokens,
        )  # the same features reached the drafter
