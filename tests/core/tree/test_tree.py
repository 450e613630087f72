"""Draft trees: structure, masks and positions, tree attention against path-wise forwards, KV compaction.

Tree attention is checked the way the issue states it: on random tiny float64 models (Llama with
grouped-query attention, Qwen2 with biases and tied embeddings), under both the eager and the
SDPA attention kernels, every node's logits from one tree forward equal the logits of a plain
forward over that node's root-to-node path. Compaction is checked against a fresh prefill.
"""

from __future__ import annotations

import itertools
import random

import pytest
import torch
from conftest import TinyPair

from specserve.core.model.causal_lm import CausalLM
from specserve.core.tree.draft_tree import DraftTree
from specserve.core.tree.shapes import InvalidTree, TreeTopology

ATOL = 1e-10  # float64: the tree forward and the path forward add the same terms in different orders
# transformers' *eager* Llama/Qwen2 attention computes its softmax in float32 even for float64 models
# (modeling_llama.py: softmax(..., dtype=torch.float32)), so under eager both sides are float32-accurate
EAGER_ATOL = 1e-5

TOPOLOGIES = {
    "chain": (-1, 0, 1, 2),
    "star": (-1, -1, -1, -1),
    "binary": (-1, -1, 0, 0, 1, 1, 2, 2, 3),
    "lopsided": (-1, 0, 0, 1, 3, -1, 5, 2),
}


def random_tree(seed: int, size: int, vocab: int) -> DraftTree:
    rng = random.Random(seed)
    parents = tuple(rng.randrange(-1, i) for i in range(size))
    tokens = torch.tensor([rng.randrange(3, vocab) for _ in range(size)])
    return DraftTree(tokens, parents)


def tree_of(parents: tuple[int, ...], seed: int = 0, vocab: int = 96) -> DraftTree:
    generator = torch.Generator().manual_seed(seed)
    return DraftTree(torch.randint(3, vocab, (len(parents),), generator=generator), parents)


# ---------------------------------------------------------------------------------------------
# Structure


def test_structure_of_a_small_tree() -> None:
    tree = DraftTree(torch.tensor([10, 11, 12, 13, 14]), (-1, -1, 0, 0, 2))
    assert tree.depths == (0, 0, 1, 1, 2) and tree.depth == 3 and tree.size == 5
    assert tree.children == ((0, 1), (2, 3), (), (4,), (), ())
    assert tree.paths == ((0,), (1,), (0, 2), (0, 3), (0, 2, 4))
    assert tree.path_tokens(4) == [10, 12, 14] and not tree.is_chain
    assert tree.position_ids(7).tolist() == [[7, 8, 8, 9, 9, 10]]
    allowed = tree.ancestry()
    assert allowed.tolist() == [
        [True, False, False, False, False, False],  # root
        [True, True, False, False, False, False],  # node 0
        [True, False, True, False, False, False],  # node 1
        [True, True, False, True, False, False],  # node 2: root, 0, itself
        [True, True, False, False, True, False],  # node 3
        [True, True, False, True, False, True],  # node 4: root, 0, 2, itself
    ]
    mask = tree.attention_mask(3, torch.float64)
    assert mask.shape == (1, 1, 6, 9)
    assert (mask[0, 0, :, :3] == 0).all()  # everyone sees the cached prefix
    assert ((mask[0, 0, :, 3:] == 0) == allowed).all()
    assert (mask[0, 0, :, 3:][~allowed] == torch.finfo(torch.float64).min).all()


def test_chain_is_the_degenerate_tree() -> None:
    q = torch.softmax(torch.randn(3, 8, dtype=torch.float64), dim=-1)
    chain = DraftTree.chain(torch.tensor([4, 5, 6]), q)
    assert chain.parents == (-1, 0, 1) and chain.is_chain and chain.depths == (0, 1, 2)
    assert chain.child_probs is not None and chain.child_probs.shape == (4, 8)
    assert torch.equal(chain.child_probs[:3], q) and not chain.child_probs[3].any()
    assert (chain.ancestry() == torch.ones(4, 4, dtype=torch.bool).tril()).all()  # causal
    assert DraftTree.empty().size == 0 and DraftTree.empty().depth == 0


@pytest.mark.parametrize(
    ("tokens", "parents", "words"),
    [
        (torch.tensor([1, 2]), (-1,), "2 tokens but 1 parents"),
        (torch.tensor([1, 2]), (-1, 1), "node 1 has parent 1"),
        (torch.tensor([1, 2]), (0, -1), "node 0 has parent 0"),
        (torch.tensor([1, 2]), (-1, -2), "node 1 has parent -2"),
        (torch.tensor([[1, 2]]), (-1, 0), "1-D"),
    ],
)
def test_inconsistent_trees_are_refused(tokens: torch.Tensor, parents: tuple[int, ...], words: str) -> None:
    with pytest.raises(InvalidTree, match=words):
        DraftTree(tokens, parents)
    with pytest.raises(InvalidTree, match="child_probs"):
        DraftTree(torch.tensor([1]), (-1,), torch.zeros(1, 5))


def test_topology_from_index_paths() -> None:
    topology = TreeTopology.from_lists([[1], [0], [0, 0], [0, 1], [1, 0], [0, 0, 0]])
    assert topology.paths == ((0,), (1,), (0, 0), (0, 1), (1, 0), (0, 0, 0))
    assert topology.parents == (-1, -1, 0, 0, 1, 2) and topology.ranks == (0, 1, 0, 1, 0, 0)
    tree = DraftTree(torch.arange(topology.size), topology.parents)
    assert tree.depths == (0, 0, 1, 1, 1, 2)
    with pytest.raises(InvalidTree, match="no parent path"):
        TreeTopology.from_lists([[0], [1, 0]])
    with pytest.raises(InvalidTree, match="twice"):
        TreeTopology(((0,), (0,)))
    with pytest.raises(InvalidTree, match="non-empty"):
        TreeTopology.from_lists([[0], []])


# ---------------------------------------------------------------------------------------------
# Tree attention with the HF models


def path_logits(lm: CausalLM, prefix: list[int], path: list[int]) -> torch.Tensor:
    with torch.inference_mode():
        return lm.model(input_ids=torch.tensor([prefix + path])).logits[0, -1]


def check_tree_forward(lm: CausalLM, prefix: list[int], root: int, tree: DraftTree, atol: float = ATOL) -> None:
    cache = lm.new_cache()
    lm.forward(cache, torch.tensor(prefix))
    logits = lm.forward_tree(cache, root, tree)
    assert logits.shape[0] == tree.size + 1 and cache.length == len(prefix) + tree.size + 1
    torch.testing.assert_close(logits[0], path_logits(lm, prefix, [root]), atol=atol, rtol=0)
    for node in range(tree.size):
        want = path_logits(lm, prefix, [root, *tree.path_tokens(node)])
        torch.testing.assert_close(logits[node + 1], want, atol=atol, rtol=0, msg=f"node {node}")


@pytest.mark.parametrize("attention", ["sdpa", "eager"])
@pytest.mark.parametrize("shape", sorted(TOPOLOGIES))
def test_tree_logits_equal_pathwise_forwards(pair: TinyPair, shape: str, attention: str) -> None:
    lm = pair.target
    previous = lm.model.config._attn_implementation
    lm.model.config._attn_implementation = attention
    try:
        atol = EAGER_ATOL if attention == "eager" else ATOL
        check_tree_forward(lm, [5, 17, 23, 8, 40, 41], 33, tree_of(TOPOLOGIES[shape]), atol)
    finally:
        lm.model.config._attn_implementation = previous


@pytest.mark.parametrize("seed", range(4))
def test_random_trees_after_an_empty_and_a_long_prefix(pair: TinyPair, seed: int) -> None:
    tree = random_tree(seed, size=3 + 4 * seed, vocab=96)
    check_tree_forward(pair.target, [7], 12, tree)
    check_tree_forward(pair.target, list(range(3, 60)), 12, tree)


# ---------------------------------------------------------------------------------------------
# KV compaction


@pytest.mark.parametrize(("shape", "accepted"), [("binary", 8), ("lopsided", 4), ("star", 2), ("chain", 3)])
def test_compaction_equals_a_fresh_prefill(pair: TinyPair, shape: str, accepted: int) -> None:
    lm, prefix, root = pair.target, [5, 17, 23, 8], 33
    tree = tree_of(TOPOLOGIES[shape], seed=3)
    path = list(tree.paths[accepted])
    cache = lm.new_cache()
    lm.forward(cache, torch.tensor(prefix))
    lm.forward_tree(cache, root, tree)
    keep = [*range(len(prefix) + 1), *(len(prefix) + 1 + i for i in path)]
    cache.compact(keep)
    committed = [*prefix, root, *tree.path_tokens(accepted)]
    fresh = lm.new_cache()
    lm.forward(fresh, torch.tensor(committed))
    assert cache.length == fresh.length == len(committed)
    for (k, v), (fk, fv) in zip(cache.snapshot(), fresh.snapshot(), strict=True):
        torch.testing.assert_close(k, fk, atol=ATOL, rtol=0)
        torch.testing.assert_close(v, fv, atol=ATOL, rtol=0)
    # and decoding continues exactly as after the fresh prefill
    torch.testing.assert_close(
        lm.forward(cache, torch.tensor([9, 10])), lm.forward(fresh, torch.tensor([9, 10])), atol=ATOL, rtol=0
    )


def test_compaction_refuses_bad_positions(pair: TinyPair) -> None:
    cache = pair.target.new_cache()
    pair.target.forward(cache, torch.tensor([5, 6, 7, 8]))
    for keep in ([0, 2, 1], [0, 1, 4], [1, 1]):
        with pytest.raises(ValueError, match="strictly increasing"):
            cache.compact(keep)
    cache.compact([0, 1, 2, 3])  # everything: a no-op
    assert cache.length == 4
    cache.compact([])
    assert cache.length == 0


@pytest.mark.parametrize("shape", ["binary", "lopsided"])
def test_extending_a_tree_level_by_level_equals_one_forward(pair: TinyPair, shape: str) -> None:
    lm, prefix, root = pair.target, [5, 17, 23, 8], 33
    tree = tree_of(TOPOLOGIES[shape], seed=5)
    whole = lm.new_cache()
    lm.forward(whole, torch.tensor(prefix))
    want = lm.forward_tree(whole, root, tree)
    cache = lm.new_cache()
    lm.forward(cache, torch.tensor(prefix))
    rows = list(lm.forward_tree(cache, root, DraftTree(tree.tokens[:0], ())))
    for end in sorted({*(i + 1 for i, d in enumerate(tree.depths) if i + 1 == tree.size or tree.depths[i + 1] != d)}):
        rows.extend(lm.extend_tree(cache, DraftTree(tree.tokens[:end], tree.parents[:end]), len(rows) - 1))
    torch.testing.assert_close(torch.stack(rows), want, atol=ATOL, rtol=0)
    for (k, v), (wk, wv) in zip(cache.snapshot(), whole.snapshot(), strict=True):
        torch.testing.assert_close(k, wk, atol=ATOL, rtol=0)
        torch.testing.assert_close(v, wv, atol=ATOL, rtol=0)
    with pytest.raises(ValueError, match="start"):
        lm.extend_tree(cache, tree, tree.size)  # nothing left to add


def test_best_first_topology_takes_the_most_probable_paths() -> None:
    probs = [0.6, 0.2, 0.1]
    topology = TreeTopology.best_first(8, probs, max_depth=4)
    assert topology.size == 8

    def value(path: tuple[int, ...]) -> float:
        return float(torch.tensor([probs[r] for r in path], dtype=torch.float64).prod())

    every = [p for d in range(1, 5) for p in itertools.product(range(3), repeat=d)]
    kept = sorted(value(p) for p in topology.paths)
    left = max(value(p) for p in every if p not in set(topology.paths))
    assert kept[0] >= left - 1e-12  # nothing left out beats anything kept
    assert all(len(p) == 1 or p[:-1] in topology.paths for p in topology.paths)
    assert TreeTopology.best_first(3, [0.9, 0.05]).paths == ((0,), (0, 0), (0, 0, 0))  # a confident drafter: a chain
    assert TreeTopology.best_first(2, [0.5, 0.6]).paths == ((0,), (1,))  # ranks made non-increasing
    assert TreeTopology.best_first(40, [0.5, 0.5], max_depth=2).size == 6  # only 2 + 4 paths exist
    with pytest.raises(InvalidTree):
        TreeTopology.best_first(0, [0.5])
    with pytest.raises(InvalidTree):
        TreeTopology.best_first(3, [1.5])
