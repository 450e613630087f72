"""TreeModelDrafter: static and dynamic (EAGLE-2) trees from the draft model, and greedy tree decoding with them.

The drafter's trees are checked against plain forwards of the draft model over each node's path
(no cache, no tree attention), and decoding with them through ``TargetVerifier.verify``
must equal transformers' greedy decoding token for token.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

import pytest
import torch
from conftest import EOS_ID, TinyPair

from specserve.core.model.causal_lm import CausalLM
from specserve.core.sampling.params import SamplingParams
from specserve.core.target import LocalSequence, TargetVerifier
from specserve.core.tree.draft_tree import DraftTree
from specserve.core.tree.shapes import ROOT, InvalidTree, TreeBudget, TreeTopology
from specserve.drafters.tree import TreeModelDrafter

TOPOLOGY = TreeTopology.from_lists([[0], [1], [0, 0], [0, 1], [1, 0], [0, 0, 0], [0, 1, 0]])
PROMPT = [5, 17, 23, 8, 30]


def log_probs_after(draft: CausalLM, ids: Sequence[int]) -> torch.Tensor:
    with torch.inference_mode():
        return torch.log_softmax(draft.model(input_ids=torch.tensor([list(ids)])).logits[0, -1].double(), -1)


def test_static_tree_nodes_are_the_ranked_tokens_after_their_paths(pair: TinyPair) -> None:
    drafter = TreeModelDrafter(pair.draft, pair.target)
    drafter.start(PROMPT)
    tree = drafter.propose_static(TOPOLOGY)
    assert tree.parents == TOPOLOGY.parents and tree.child_probs is None
    for node, rank in enumerate(TOPOLOGY.ranks):
        parent = tree.parents[node]
        before = tree.path_tokens(parent) if parent != ROOT else []
        want = int(log_probs_after(pair.draft, PROMPT + before).topk(rank + 1).indices[rank])
        assert int(tree.tokens[node]) == want, node


def test_dynamic_tree_keeps_the_most_confident_nodes(pair: TinyPair) -> None:
    drafter = TreeModelDrafter(pair.draft, pair.target)
    drafter.start(PROMPT)
    budget = TreeBudget(depth=3, width=3, nodes=8)
    tree = drafter.propose_dynamic(budget)
    assert tree.size == 8 and tree.depth <= 3
    confidence = []
    for node in range(tree.size):
        parent = tree.parents[node]
        before = tree.path_tokens(parent) if parent != ROOT else []
        log_probs = log_probs_after(pair.draft, PROMPT + before)
        token = int(tree.tokens[node])
        assert token in log_probs.topk(budget.width).indices.tolist()  # one of its parent's best children
        confidence.append((confidence[parent] if parent != ROOT else 0.0) + float(log_probs[token]))
    assert all(confidence[n] <= confidence[p] + 1e-12 for n, p in enumerate(tree.parents) if p != ROOT)
    root_children = [n for n, p in enumerate(tree.parents) if p == ROOT]
    assert root_children  # the root's best child is always the most confident node
    best_first = int(log_probs_after(pair.draft, PROMPT).argmax())
    assert best_first in [int(tree.tokens[n]) for n in root_children]
    with pytest.raises(InvalidTree, match="budget"):
        TreeBudget(depth=0, width=2, nodes=4)


def decode(pair: TinyPair, propose: Callable[[TreeModelDrafter], DraftTree], max_new: int) -> list[int]:
    drafter = TreeModelDrafter(pair.draft, pair.target)
    drafter.start(PROMPT)
    verifier = TargetVerifier(
        LocalSequence(pair.target), PROMPT, SamplingParams(), torch.Generator(), max_new, [EOS_ID]
    )
    verifier.prefill()
    while verifier.finish is None:
        outcome = verifier.verify(propose(drafter))
        drafter.accept(outcome.new_tokens)
    return verifier.committed[len(PROMPT) :]


@pytest.mark.parametrize(
    "propose",
    [
        lambda d: d.propose_static(TOPOLOGY),
        lambda d: d.propose_dynamic(TreeBudget(depth=4, width=2, nodes=6)),
        lambda d: d.propose_dynamic(TreeBudget(depth=2, width=4, nodes=16)),
    ],
    ids=["static", "dynamic-deep", "dynamic-wide"],
)
def test_greedy_decoding_with_drafted_trees_equals_transformers(
    pair: TinyPair,
    propose: Callable[[TreeModelDrafter], DraftTree],
    hf_greedy: Callable[[CausalLM, Sequence[int], int], list[int]],
) -> None:
    assert decode(pair, propose, 30) == hf_greedy(pair.target, PROMPT, 30)
