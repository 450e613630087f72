"""The in-process engine with draft trees: greedy output equals transformers', sampled runs stay in bounds,
the stats record the tree shape per cycle, and drafters that cannot draft trees are refused
(n-gram and ``none`` trees: tests/drafters/test_ngram_tree.py)."""

from __future__ import annotations

from collections.abc import Callable, Sequence

import pytest
import torch
from conftest import TinyPair

from specserve.core.draft.drafter import Draft
from specserve.core.engine import SpeculativeEngine
from specserve.core.errors import InvalidRequest
from specserve.core.model.causal_lm import CausalLM
from specserve.core.request import GenerationConfig
from specserve.core.sampling.params import SamplingParams
from specserve.core.tree.shapes import TreeBudget, TreeSpec, TreeTopology
from specserve.drafters.registry import build_drafter_set

SPECS = {
    "static": TreeSpec("static", topology=TreeTopology.from_lists([[0], [1], [0, 0], [0, 1], [0, 0, 0]])),
    "dynamic": TreeSpec("dynamic", budget=TreeBudget(depth=4, width=2, nodes=8)),
    "dynamic_wide": TreeSpec("dynamic", budget=TreeBudget(depth=2, width=4, nodes=12)),
    "dynamic_one_path": TreeSpec("dynamic", budget=TreeBudget(depth=4, width=3, nodes=9, expand=1)),
}


@pytest.fixture()
def engine(pair: TinyPair) -> SpeculativeEngine:
    return SpeculativeEngine(pair.target, build_drafter_set(pair.draft, pair.target))


@pytest.mark.parametrize("spec", sorted(SPECS))
@pytest.mark.parametrize("prompt", [[5, 17, 23, 8], [60, 61, 62]])
def test_greedy_tree_generation_equals_transformers(
    engine: SpeculativeEngine,
    pair: TinyPair,
    spec: str,
    prompt: list[int],
    hf_greedy: Callable[[CausalLM, Sequence[int], int], list[int]],
) -> None:
    result = engine.generate(prompt, SamplingParams(), GenerationConfig(max_new_tokens=28, tree=SPECS[spec]))
    assert result.output_ids == hf_greedy(pair.target, prompt, 28)
    stats = result.stats
    assert len(stats.tree_shapes) == stats.cycles > 0
    assert all(1 <= depth <= nodes for nodes, depth in stats.tree_shapes[:-1])
    assert 0 <= stats.tree_shapes[-1][1] <= stats.tree_shapes[-1][0]  # the last may be cut to the budget left
    assert stats.drafted_tokens == sum(nodes for nodes, _ in stats.tree_shapes)
    assert stats.to_dict()["tree_shapes"] == [list(shape) for shape in stats.tree_shapes]


def test_sampled_tree_generation_is_reproducible_and_bounded(engine: SpeculativeEngine) -> None:
    params = SamplingParams(temperature=1.0, top_k=20, seed=5)
    config = GenerationConfig(max_new_tokens=20, tree=SPECS["dynamic"], ignore_eos=True)
    first = engine.generate([5, 17, 23, 8], params, config)
    again = engine.generate([5, 17, 23, 8], params, config)
    assert first.output_ids == again.output_ids and len(first.output_ids) == 20


class ChainOnlyDrafter:
    """Proposes chains (empty ones) and has no ``propose_tree``."""

    name = "chain-only"

    def start(self, prompt_ids: Sequence[int], params: SamplingParams, generator: torch.Generator) -> None: ...

    def propose(self, budget: int) -> Draft:
        return Draft.empty()

    def accept(self, committed: Sequence[int]) -> None: ...

    def rewind(self, length: int) -> None: ...


def test_trees_need_a_drafter_that_can_draft_them(pair: TinyPair) -> None:
    engine = SpeculativeEngine(pair.target, ChainOnlyDrafter())
    with pytest.raises(InvalidRequest, match="cannot draft trees"):
        engine.generate([5, 6], SamplingParams(), GenerationConfig(max_new_tokens=4, tree=SPECS["dynamic"]))
