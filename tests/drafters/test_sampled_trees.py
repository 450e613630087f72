"""Sampled draft trees (temperature > 0): children drawn without replacement from the warped draft q.

The drafter's trees must carry the very q each node's children were drawn from, distinct
children, the without-replacement rule and the budget; and decoding with them must emit tokens
distributed exactly as the target's (chi-square tests, each at significance 1e-3: with the seeds
fixed a correct implementation passes deterministically, and a wrong one fails with high power).
"""

from __future__ import annotations

from collections.abc import Sequence

import pytest
import torch
from conftest import TinyPair
from stats_helpers import batched_runs, check_single_engine_agrees, chi2_pvalue, draws_over_seeds

from specserve.core.batch_engine import BatchedEngine
from specserve.core.engine import SpeculativeEngine
from specserve.core.model.causal_lm import CausalLM
from specserve.core.request import GenerationConfig
from specserve.core.sampling.params import SamplingParams
from specserve.core.sampling.warps import warp_probs
from specserve.core.tree.draft_tree import ChildSampling, DraftTree
from specserve.core.tree.shapes import ROOT, TreeBudget, TreeSpec, TreeTopology
from specserve.drafters.model import DraftModelDrafter
from specserve.drafters.tree import TreeModelDrafter

ALPHA = 1e-3
PROMPT = [5, 17, 23, 8, 30]
TOPOLOGY = TreeTopology.from_lists([[0], [1], [2], [0, 0], [0, 1], [1, 0], [0, 0, 0]])
BUDGET = TreeBudget(depth=4, width=3, nodes=9)
PARAMS = SamplingParams(temperature=1.0, top_k=24, seed=0)


def plain_q(draft: CausalLM, ids: Sequence[int], params: SamplingParams) -> torch.Tensor:
    with torch.inference_mode():
        logits = draft.model(input_ids=torch.tensor([list(ids)])).logits[0, -1]
    return warp_probs(logits, params)


def drafter_for(pair: TinyPair, seed: int) -> TreeModelDrafter:
    drafter = TreeModelDrafter(pair.draft, pair.target)
    drafter.start(PROMPT)
    drafter.configure(PARAMS, torch.Generator().manual_seed(seed))
    return drafter


def check_sampled_tree(pair: TinyPair, tree: DraftTree) -> None:
    assert tree.sampling is ChildSampling.WITHOUT_REPLACEMENT and tree.child_probs is not None
    for parent, children in enumerate(tree.children):  # parent 0 = the root, i + 1 = node i
        if not children:
            continue
        before = tree.path_tokens(parent - 1) if parent > 0 else []
        want = plain_q(pair.draft, PROMPT + before, PARAMS)
        torch.testing.assert_close(tree.child_probs[parent], want, atol=1e-9, rtol=1e-6)
        tokens = [int(tree.tokens[c]) for c in children]
        assert len(set(tokens)) == len(tokens), "siblings drawn without replacement are distinct"
        assert all(want[t] > 0 for t in tokens), "every child lies in its parent's support"


@pytest.mark.parametrize("seed", range(4))
def test_static_sampled_trees_carry_their_q_and_keep_the_topology(pair: TinyPair, seed: int) -> None:
    tree = drafter_for(pair, seed).propose_static(TOPOLOGY)
    assert tree.parents == TOPOLOGY.parents  # top-k 24 support is wide enough for every rank
    check_sampled_tree(pair, tree)


@pytest.mark.parametrize("seed", range(4))
def test_dynamic_sampled_trees_respect_the_budget(pair: TinyPair, seed: int) -> None:
    tree = drafter_for(pair, seed).propose_dynamic_sampled(BUDGET)
    assert tree.size == BUDGET.nodes and tree.depth <= BUDGET.depth
    assert len(tree.children[0]) == BUDGET.width  # the root: the most confident node, width children
    assert all(len(c) <= BUDGET.width for c in tree.children)
    check_sampled_tree(pair, tree)


def test_a_support_smaller_than_the_topology_prunes_its_ranks(pair: TinyPair) -> None:
    drafter = TreeModelDrafter(pair.draft, pair.target)
    drafter.start(PROMPT)
    drafter.configure(SamplingParams(temperature=1.0, top_k=2), torch.Generator().manual_seed(0))
    tree = drafter.propose_static(TOPOLOGY)  # rank 2 at the root cannot be drawn from a 2-token support
    assert tree.size == TOPOLOGY.size - 1 and len(tree.children[0]) == 2
    assert all(parent == ROOT or parent < i for i, parent in enumerate(tree.parents))


def test_the_first_drawn_child_follows_q(pair: TinyPair) -> None:
    q = plain_q(pair.draft, PROMPT, PARAMS)
    firsts = draws_over_seeds(lambda seed: int(drafter_for(pair, seed).propose_static(TOPOLOGY).tokens[0]), 1500)
    assert chi2_pvalue(torch.tensor(firsts), q) > ALPHA


def target_probs(target: CausalLM, ids: Sequence[int], params: SamplingParams) -> torch.Tensor:
    with torch.inference_mode():
        return warp_probs(target.model(input_ids=torch.tensor([list(ids)])).logits[0, -1].double(), params)


@pytest.mark.parametrize("shape", ["static", "dynamic"])
def test_two_emitted_tokens_follow_the_target_joint_law(tiny_pairs: dict[str, TinyPair], shape: str) -> None:
    """Draft sampled trees, verify, compact, draft again: the first two tokens' joint law is the target's. 2,500
    seeds as requests of one batched engine, whose first seeds the single-request engine emits alike."""
    pair = tiny_pairs["llama"]
    spec = TreeSpec("static", topology=TOPOLOGY) if shape == "static" else TreeSpec("dynamic", budget=BUDGET)
    batched = BatchedEngine(pair.target, lambda name: DraftModelDrafter(pair.draft, pair.target), max_num_seqs=32)
    config = GenerationConfig(max_new_tokens=2, tree=spec, ignore_eos=True)
    runs = batched_runs(batched, PROMPT, SamplingParams(temperature=1.0, top_k=24), config, 2500)
    single = SpeculativeEngine(pair.target, DraftModelDrafter(pair.draft, pair.target))
    check_single_engine_agrees(single, runs, PROMPT, SamplingParams(temperature=1.0, top_k=24), config)
    pairs = [run.output_ids for run in runs]
    first = target_probs(pair.target, PROMPT, PARAMS)
    joint = torch.stack([first[a] * target_probs(pair.target, [*PROMPT, a], PARAMS) for a in range(first.numel())])
    cells = torch.tensor([a * first.numel() + b for a, b in pairs])
    assert chi2_pvalue(cells, joint) > ALPHA


@pytest.mark.parametrize("seed", range(3))
def test_expand_one_grows_a_single_path_with_alternatives(pair: TinyPair, seed: int) -> None:
    budget = TreeBudget(depth=4, width=3, nodes=10, expand=1)
    tree = drafter_for(pair, seed).propose_dynamic_sampled(budget)
    with_children = [p for p, children in enumerate(tree.children) if children]
    assert len({tree.depths[p - 1] if p else -1 for p in with_children}) == len(with_children)  # one per level
    assert tree.size == 10 and tree.depth == 4
    check_sampled_tree(pair, tree)
    greedy = TreeModelDrafter(pair.draft, pair.target)
    greedy.start(PROMPT)
    kept = greedy.propose_dynamic(budget)
    assert kept.size == budget.nodes and kept.depth <= budget.depth
