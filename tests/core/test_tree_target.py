"""TargetVerifier.verify on draft trees in one process: greedy tree decoding equals transformers' greedy decoding.

Trees come from a simple test drafter: a static topology (index paths) filled with the draft
model's top-ranked tokens after each node's path (a plain forward per node, no cache: slow and
obviously right). Every cycle runs the tree-attention forward, the exact tree rules and KV
compaction; at the end the target's cache must equal a fresh prefill of the committed text.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

import pytest
import torch
from conftest import EOS_ID, TinyPair

from specserve.core.model.causal_lm import CausalLM
from specserve.core.sampling.params import SamplingParams
from specserve.core.sampling.warps import warp_probs
from specserve.core.target import LocalSequence, TargetVerifier
from specserve.core.tree.draft_tree import ChildSampling, DraftTree
from specserve.core.tree.shapes import TreeTopology

TOPOLOGIES = {
    "chain4": [[0], [0, 0], [0, 0, 0], [0, 0, 0, 0]],
    "width3": [[0], [1], [2]],
    "medusa_like": [[0], [1], [0, 0], [0, 1], [1, 0], [0, 0, 0], [0, 0, 1], [0, 1, 0]],
}


def draft_logits(draft: CausalLM, ids: Sequence[int]) -> torch.Tensor:
    with torch.inference_mode():
        return draft.model(input_ids=torch.tensor([list(ids)])).logits[0, -1]


def topk_tree(draft: CausalLM, committed: list[int], topology: TreeTopology) -> DraftTree:
    """Each node = the draft's rank-r token after its parent's path (deterministic: no q)."""
    tokens: list[int] = []
    paths: list[list[int]] = []
    for parent, rank in zip(topology.parents, topology.ranks, strict=True):
        before = paths[parent] if parent >= 0 else []
        token = int(draft_logits(draft, committed + before).topk(rank + 1).indices[rank])
        tokens.append(token)
        paths.append([*before, token])
    return DraftTree(torch.tensor(tokens), topology.parents)


def sampled_tree(
    draft: CausalLM, committed: list[int], topology: TreeTopology, params: SamplingParams, gen: torch.Generator
) -> DraftTree:
    """Each node's children drawn without replacement from the draft's warped q after the node's path."""
    tokens: list[int] = [0] * topology.size
    q_rows: dict[int, torch.Tensor] = {}
    paths: dict[int, list[int]] = {-1: []}
    for node in [-1, *range(topology.size)]:
        children = [c for c in range(topology.size) if topology.parents[c] == node]
        if not children:
            continue
        q = warp_probs(draft_logits(draft, committed + paths[node])[None].double(), params)[0]
        picks = torch.multinomial(q, len(children), replacement=False, generator=gen).tolist()
        q_rows[node] = q
        for child, token in zip(children, picks, strict=True):
            tokens[child] = token
            paths[child] = [*paths[node], token]
    vocab = draft.info.vocab_size
    rows = [q_rows.get(node, torch.zeros(vocab, dtype=torch.float64)) for node in [-1, *range(topology.size)]]
    return DraftTree(torch.tensor(tokens), topology.parents, torch.stack(rows), ChildSampling.WITHOUT_REPLACEMENT)


def run_tree_decoding(
    pair: TinyPair, prompt: list[int], max_new: int, make_tree: Callable[[list[int]], DraftTree], params: SamplingParams
) -> TargetVerifier:
    verifier = TargetVerifier(
        LocalSequence(pair.target), prompt, params, torch.Generator().manual_seed(0), max_new, [EOS_ID]
    )
    verifier.prefill()
    while verifier.finish is None:
        verifier.verify(make_tree(verifier.committed))
    return verifier


def assert_cache_is_the_committed_text(pair: TinyPair, verifier: TargetVerifier) -> None:
    sequence = verifier.sequence
    assert isinstance(sequence, LocalSequence)
    fresh = pair.target.new_cache()
    pair.target.forward(fresh, torch.tensor(verifier.committed[:-1]))
    assert sequence.cache.length == fresh.length
    for (k, v), (fk, fv) in zip(sequence.cache.snapshot(), fresh.snapshot(), strict=True):
        torch.testing.assert_close(k, fk, atol=1e-10, rtol=0)
        torch.testing.assert_close(v, fv, atol=1e-10, rtol=0)


@pytest.mark.parametrize("shape", sorted(TOPOLOGIES))
@pytest.mark.parametrize("prompt", [[5, 17, 23, 8], [40, 41, 42, 43, 44, 45, 46]])
def test_greedy_tree_decoding_equals_transformers(
    pair: TinyPair, shape: str, prompt: list[int], hf_greedy: Callable[[CausalLM, Sequence[int], int], list[int]]
) -> None:
    topology = TreeTopology.from_lists(TOPOLOGIES[shape])
    verifier = run_tree_decoding(
        pair, prompt, 24, lambda committed: topk_tree(pair.draft, committed, topology), SamplingParams()
    )
    want = hf_greedy(pair.target, prompt, 24)
    assert verifier.committed[len(prompt) :] == want
    assert verifier.finish == ("eos" if want[-1] == EOS_ID else "length")
    assert_cache_is_the_committed_text(pair, verifier)


def test_greedy_trees_accept_more_than_one_token_per_cycle(pair: TinyPair) -> None:
    topology = TreeTopology.from_lists(TOPOLOGIES["medusa_like"])
    verifier = TargetVerifier(LocalSequence(pair.target), [5, 17, 23, 8], SamplingParams(), torch.Generator(), 24)
    verifier.prefill()
    accepted = []
    while verifier.finish is None:
        outcome = verifier.verify(topk_tree(pair.draft, verifier.committed, topology))
        accepted.append(outcome.verdict.num_accepted)
    assert max(accepted) >= 1  # the draft shares the target's first block: some branch is right sometimes


def test_sampled_tree_decoding_runs_and_keeps_the_cache_exact(pair: TinyPair) -> None:
    topology = TreeTopology.from_lists(TOPOLOGIES["medusa_like"])
    params = SamplingParams(temperature=1.0, seed=3)
    gen = torch.Generator().manual_seed(11)
    verifier = run_tree_decoding(
        pair, [5, 17, 23, 8], 30, lambda c: sampled_tree(pair.draft, c, topology, params, gen), params
    )
    assert 1 <= verifier.num_output <= 30
    assert verifier.finish == "eos" or verifier.num_output == 30
    assert_cache_is_the_committed_text(pair, verifier)
