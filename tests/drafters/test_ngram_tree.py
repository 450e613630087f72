"""Tests of n-gram (prompt lookup) draft trees and the ``none`` drafter's empty tree.

The trie and the static/dynamic selections are checked on hand-made histories and on random
small-alphabet ones (many matches, many branches); the engine runs with ``drafter="ngram"`` and
trees must give exactly transformers' greedy output, and reproducible sampled output.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

import numpy as np
import pytest
import torch
from conftest import TinyPair

from specserve.core.draft.drafter import TreeDrafter
from specserve.core.engine import SpeculativeEngine
from specserve.core.model.causal_lm import CausalLM
from specserve.core.request import GenerationConfig
from specserve.core.sampling.params import SamplingParams
from specserve.core.sampling.warps import make_generators
from specserve.core.tree.draft_tree import DraftTree
from specserve.core.tree.shapes import ROOT, TreeBudget, TreeSpec, TreeTopology
from specserve.drafters import NgramDrafter, NoDrafter
from specserve.drafters.ngram import ContinuationTrie, continuations, lookup, ngram_tree
from specserve.drafters.registry import build_drafter_set

GREEDY = SamplingParams()


def dynamic(depth: int, width: int, nodes: int) -> TreeSpec:
    return TreeSpec("dynamic", budget=TreeBudget(depth=depth, width=width, nodes=nodes))


def static(*paths: Sequence[int]) -> TreeSpec:
    return TreeSpec("static", topology=TreeTopology.from_lists(paths))


def random_histories(count: int, alphabet: int = 4, seed: int = 0) -> list[list[int]]:
    """Short histories over a few tokens: the trailing n-gram recurs, with many different continuations."""
    rng = np.random.default_rng(seed)
    return [rng.integers(10, 10 + alphabet, size=int(rng.integers(0, 40))).tolist() for _ in range(count)]


def rank0_path(tokens: Sequence[int], parents: Sequence[int]) -> list[int]:
    """Follow the first-listed child from the root (children are listed in rank order in every selection)."""
    path: list[int] = []
    node = ROOT
    while (child := next((i for i, p in enumerate(parents) if p == node), None)) is not None:
        path.append(tokens[child])
        node = child
    return path


def paths_of(tokens: Sequence[int], parents: Sequence[int]) -> set[tuple[int, ...]]:
    tree = DraftTree(torch.tensor(list(tokens), dtype=torch.long), tuple(parents))
    return {tuple(tree.path_tokens(i)) for i in range(tree.size)}


# ---------------------------------------------------------------------------------------------
# Continuations and the trie


def test_several_matches_give_several_branches() -> None:
    # "4 5" occurred three times before the end, followed by 1 2, 1 3 and 2 7 (most recent last)
    history = [4, 5, 1, 2, 9, 4, 5, 1, 3, 8, 4, 5, 2, 7, 4, 5]
    assert continuations(history, 3, max_ngram=2, min_ngram=1) == [[2, 7, 4], [1, 3, 8], [1, 2, 9]]
    tokens, parents = ngram_tree(history, dynamic(3, 3, 20), max_ngram=2, min_ngram=1)
    assert paths_of(tokens, parents) == {(2,), (2, 7), (2, 7, 4), (1,), (1, 3), (1, 3, 8), (1, 2), (1, 2, 9)}
    assert [tokens[i] for i, p in enumerate(parents) if p == ROOT] == [2, 1]  # two branches at the root


def test_shared_prefixes_merge() -> None:
    trie = ContinuationTrie.build([[1, 2, 3], [1, 2, 4], [1, 5], [6]])
    assert trie.tokens == (1, 2, 3, 4, 5, 6)
    assert trie.parents == (ROOT, 0, 1, 1, 0, ROOT)
    assert trie.ranks == (0, 0, 0, 1, 1, 1)
    assert trie.children == ((0, 5), (1, 4), (2, 3), (), (), (), ())
    assert ContinuationTrie.build([[1, 2], [1, 2], [1]]).tokens == (1, 2)  # repeats and prefixes add nothing


def test_continuations_prefer_longer_ngrams_and_recent_matches() -> None:
    # the 3-gram (7, 8, 9) matched only at the start (-> 1 0); the 1-gram 9 also matched later (-> 5)
    history = [7, 8, 9, 1, 0, 9, 5, 7, 8, 9]
    assert continuations(history, 2, max_ngram=3, min_ngram=1) == [[1, 0], [5, 7]]
    assert continuations(history, 2, max_ngram=1, min_ngram=1) == [[5, 7], [1, 0]]
    # a continuation stops at the end of the history
    assert continuations([7, 7, 7, 7], 3, max_ngram=2, min_ngram=1) == [[7], [7, 7], [7, 7, 7]]


def test_matches_per_ngram_are_bounded() -> None:
    history = [3, 10, 3, 11, 3, 12, 3, 13, 3]
    assert continuations(history, 1, max_ngram=1, min_ngram=1) == [[13], [12], [11], [10]]
    assert continuations(history, 1, max_ngram=1, min_ngram=1, max_matches=2) == [[13], [12]]


@pytest.mark.parametrize("history", [[], [3], [1, 2, 3, 4, 5], [1, 2, 3, 1, 9]])
def test_no_match_gives_an_empty_tree(history: list[int]) -> None:
    for spec in (dynamic(4, 2, 8), static([0], [1], [0, 0])):
        assert ngram_tree(history, spec, max_ngram=3, min_ngram=2) == ([], ())
    drafter = NgramDrafter(max_ngram=3, min_ngram=2)
    drafter.start(history, GREEDY, make_generators(0).draft)
    tree = drafter.propose_tree(dynamic(4, 2, 8))
    assert tree.size == 0 and tree.tokens.dtype == torch.long and tree.child_probs is None


# ---------------------------------------------------------------------------------------------
# Selections


def test_random_histories_branch() -> None:
    """The random histories below are worth testing on: most give trees wider than a chain."""
    shapes = [ngram_tree(h, dynamic(4, 2, 8), max_ngram=3, min_ngram=1) for h in random_histories(40)]
    trees = [DraftTree(torch.tensor(tokens, dtype=torch.long), parents) for tokens, parents in shapes]
    assert sum(tree.size > tree.depth for tree in trees) >= 20


@pytest.mark.parametrize("history", random_histories(40))
def test_rank0_path_is_the_chain_proposal(history: list[int]) -> None:
    depth = 4
    chain = lookup(history, depth, max_ngram=3, min_ngram=1)
    for spec in (dynamic(depth, 3, 12), dynamic(depth, 1, depth), static([0], [1], [0, 0], [0, 0, 0], [0, 0, 0, 0])):
        tokens, parents = ngram_tree(history, spec, max_ngram=3, min_ngram=1)
        path = rank0_path(tokens, parents)
        # it starts with the chain and equals it whenever the chain fills the depth (a chain cut short by the
        # end of the history may be continued by a later match)
        assert path[: len(chain)] == chain
        if len(chain) == depth:
            assert path == chain


@pytest.mark.parametrize("history", random_histories(40, seed=1))
@pytest.mark.parametrize(
    "budget", [TreeBudget(1, 1, 1), TreeBudget(4, 2, 8), TreeBudget(3, 3, 6), TreeBudget(5, 4, 30)]
)
def test_dynamic_trees_respect_the_budget(history: list[int], budget: TreeBudget) -> None:
    tokens, parents = ngram_tree(history, TreeSpec("dynamic", budget=budget), max_ngram=3, min_ngram=1)
    tree = DraftTree(torch.tensor(tokens, dtype=torch.long), parents)  # validates: parents come first
    assert tree.size <= budget.nodes and tree.depth <= budget.depth
    assert all(len(children) <= budget.width for children in tree.children)
    siblings = [[int(tree.tokens[c]) for c in children] for children in tree.children]
    assert all(len(set(s)) == len(s) for s in siblings)  # distinct tokens per parent
    # every path is (a prefix of) a continuation actually seen, and the chain comes first
    seen = continuations(history, budget.depth, max_ngram=3, min_ngram=1)
    assert all(any(list(path) == c[: len(path)] for c in seen) for path in paths_of(tokens, parents))
    chain = lookup(history, budget.depth, max_ngram=3, min_ngram=1)
    if len(chain) <= budget.nodes:
        assert tokens[: len(chain)] == chain and parents[: len(chain)] == tuple(range(-1, len(chain) - 1))


def test_dynamic_budget_prefers_the_chain_then_shallow_single_deviations() -> None:
    trie = ContinuationTrie.build([[1, 2, 3], [1, 4, 5], [6, 7, 8], [9]])
    # keys (deviation, depth): 1 2 3 -> 0; 6 -> (1, 0); 4 -> (1, 1); 7 -> (1, 1); 5, 8 -> (1, 2); 9 -> (2, 0)
    assert [trie.tokens[n] for n in trie.select_budget(TreeBudget(3, 3, 20))] == [1, 2, 3, 6, 4, 7, 5, 8, 9]
    assert [trie.tokens[n] for n in trie.select_budget(TreeBudget(3, 3, 5))] == [1, 2, 3, 6, 4]
    assert [trie.tokens[n] for n in trie.select_budget(TreeBudget(2, 2, 20))] == [1, 2, 6, 4, 7]
    assert [trie.tokens[n] for n in trie.select_budget(TreeBudget(3, 1, 20))] == [1, 2, 3]


def test_static_topology_keeps_the_paths_the_trie_fills() -> None:
    trie = ContinuationTrie.build([[1, 2, 3], [1, 4], [6, 7]])  # root -> 1 (2 (3), 4), 6 (7)
    topology = TreeTopology.from_lists([[0], [1], [2], [0, 0], [0, 1], [0, 2], [1, 0], [2, 0], [0, 0, 0], [0, 1, 0]])
    nodes = trie.select_topology(topology)
    assert [trie.tokens[n] for n in nodes] == [1, 6, 2, 4, 7, 3]
    assert trie.subtree(nodes) == ([1, 6, 2, 4, 7, 3], (ROOT, ROOT, 0, 0, 1, 2))
    # a path whose parent could not be filled is dropped even if the trie has that rank elsewhere
    sparse = TreeTopology.from_lists([[0], [3], [3, 0], [0, 0]])
    assert trie.subtree(trie.select_topology(sparse)) == ([1, 2], (ROOT, 0))


@pytest.mark.parametrize("history", random_histories(20, seed=2))
def test_static_trees_are_valid_subsets_of_the_topology(history: list[int]) -> None:
    topology = TreeTopology.from_lists([[0], [1], [2], [0, 0], [0, 1], [1, 0], [0, 0, 0], [0, 1, 0], [0, 0, 0, 0]])
    tokens, parents = ngram_tree(history, TreeSpec("static", topology=topology), max_ngram=3, min_ngram=1)
    tree = DraftTree(torch.tensor(tokens, dtype=torch.long), parents)
    assert tree.size <= topology.size and tree.depth <= 4
    trie = ContinuationTrie.build(continuations(history, 4, max_ngram=3, min_ngram=1))
    assert tree.size == len(trie.select_topology(topology))


# ---------------------------------------------------------------------------------------------
# The drafters


def test_ngram_drafter_proposes_trees_of_its_history() -> None:
    drafter = NgramDrafter(max_ngram=2, min_ngram=1, device="cpu")
    assert isinstance(drafter, TreeDrafter)
    drafter.start([4, 5, 1, 2, 9, 4, 5, 1, 3, 8], GREEDY, make_generators(0).draft)
    drafter.accept([4, 5, 2, 7, 4, 5])
    spec = dynamic(3, 2, 6)
    tree = drafter.propose_tree(spec)
    assert tree.child_probs is None and tree.tokens.dtype == torch.long and tree.tokens.device.type == "cpu"
    assert (tree.tokens.tolist(), tree.parents) == ngram_tree(drafter.history, spec, 2, 1)
    assert tree.tokens.tolist() == [2, 7, 4, 1, 3, 8] and tree.parents == (ROOT, 0, 1, ROOT, 3, 4)
    assert drafter.propose(3).tokens.tolist() == [2, 7, 4]  # the chain is unchanged: the rank-0 path
    drafter.rewind(10)  # back to "... 3 8": 8 never occurred before
    assert drafter.propose_tree(spec).size == 0
    drafter.rewind(7)  # back to "... 4 5": one earlier match, a chain
    assert drafter.propose_tree(spec).tokens.tolist() == [1, 2, 9]


def test_none_drafter_proposes_an_empty_tree() -> None:
    drafter = NoDrafter("cpu")
    assert isinstance(drafter, TreeDrafter)
    drafter.start([1, 2, 1, 2], GREEDY, make_generators(0).draft)
    for spec in (dynamic(4, 2, 8), static([0], [0, 0])):
        tree = drafter.propose_tree(spec)
        assert tree.size == 0 and tree.tokens.dtype == torch.long and tree.child_probs is None


# ---------------------------------------------------------------------------------------------
# The engine: exact output with n-gram trees

ENGINE_SPECS = {
    "static": static([0], [1], [2], [0, 0], [1, 0], [0, 1], [0, 0, 0]),
    "dynamic": dynamic(4, 3, 10),
}
REPETITIVE = [(5, 6, 7, 8, 5, 6, 9, 5, 6, 7, 10, 5, 6), (40, 41, 40, 42, 40, 41, 43, 40, 41, 40)]


@pytest.fixture()
def engine(pair: TinyPair) -> SpeculativeEngine:
    return SpeculativeEngine(pair.target, build_drafter_set("ngram", pair.target))


@pytest.mark.parametrize("spec", sorted(ENGINE_SPECS))
@pytest.mark.parametrize("prompt", REPETITIVE)
def test_greedy_ngram_trees_equal_transformers(
    engine: SpeculativeEngine,
    pair: TinyPair,
    spec: str,
    prompt: tuple[int, ...],
    hf_greedy: Callable[[CausalLM, Sequence[int], int], list[int]],
) -> None:
    config = GenerationConfig(max_new_tokens=30, drafter="ngram", tree=ENGINE_SPECS[spec])
    result = engine.generate(list(prompt), GREEDY, config)
    assert result.output_ids == hf_greedy(pair.target, prompt, 30)
    shapes = result.stats.tree_shapes
    assert len(shapes) == result.stats.cycles
    assert any(nodes > depth for nodes, depth in shapes)  # some cycles really branched
    assert result.stats.drafted_tokens == sum(nodes for nodes, _ in shapes)


def test_sampled_ngram_trees_are_reproducible(engine: SpeculativeEngine) -> None:
    params = SamplingParams(temperature=1.0, seed=7)
    config = GenerationConfig(max_new_tokens=24, drafter="ngram", tree=ENGINE_SPECS["dynamic"], ignore_eos=True)
    first = engine.generate(list(REPETITIVE[0]), params, config)
    again = engine.generate(list(REPETITIVE[0]), params, config)
    assert first.output_ids == again.output_ids and len(first.output_ids) == 24
    assert first.stats.tree_shapes == again.stats.tree_shapes


@pytest.mark.parametrize("spec", sorted(ENGINE_SPECS))
def test_none_drafter_with_a_tree_is_plain_greedy(
    engine: SpeculativeEngine,
    pair: TinyPair,
    spec: str,
    hf_greedy: Callable[[CausalLM, Sequence[int], int], list[int]],
) -> None:
    prompt = REPETITIVE[1]
    result = engine.generate(
        list(prompt), GREEDY, GenerationConfig(max_new_tokens=16, drafter="none", tree=ENGINE_SPECS[spec])
    )
    assert result.output_ids == hf_greedy(pair.target, prompt, 16)
    assert result.stats.drafted_tokens == 0 and set(result.stats.tree_shapes) == {(0, 0)}
    assert result.stats.cycles == len(result.output_ids)
