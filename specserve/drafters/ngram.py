"""Prompt lookup (n-gram) drafting: copy what followed the latest earlier occurrence of the last n tokens.

Searches prompt + generated text for the most recent earlier match of the trailing n-gram,
trying n from ``max_ngram`` down to ``min_ngram``, and proposes the tokens that followed it
(Saxena 2023, "prompt lookup decoding"). The choice is deterministic, so no q is sent and the
verifier treats each proposal as a point mass — exact at any temperature. No model, no state
beyond the token history.

Trees (:meth:`NgramDrafter.propose_tree`): several matches give several branches. The distinct
continuations of up to ``MAX_MATCHES`` matches per n (longest n first, most recent match first:
the order :func:`lookup` tries them in) are merged into a :class:`ContinuationTrie`, whose
children are ranked by the order they were found, so the rank-0 path starts with the chain
proposal. A static topology keeps the index paths the trie can fill; a dynamic budget keeps the
chain first, then the branches with the fewest and lowest-ranked deviations from it (see
:meth:`ContinuationTrie.select_budget`). The trie logic is plain Python lists, testable without
torch or a model.
"""

from __future__ import annotations

from collections.abc import Iterable, Iterator, Sequence
from dataclasses import dataclass

import numpy as np
import torch

from specserve.core.draft.drafter import Draft
from specserve.core.errors import UserError
from specserve.core.tree.draft_tree import DraftTree
from specserve.core.tree.shapes import ROOT, TreeBudget, TreeSpec, TreeTopology
from specserve.drafters.history import CommittedHistory

# Matches of one n-gram size whose continuations a tree may use: bounds the work on long histories.
MAX_MATCHES = 16


class NgramDrafter(CommittedHistory):
    name = "ngram"

    def __init__(self, max_ngram: int = 3, min_ngram: int = 1, device: torch.device | str = "cpu") -> None:
        if not 1 <= min_ngram <= max_ngram:
            raise UserError(f"n-gram sizes need 1 <= min_ngram <= max_ngram, got {min_ngram}..{max_ngram}")
        self.max_ngram = max_ngram
        self.min_ngram = min_ngram
        self._device = device
        self.history: list[int] = []

    def propose(self, budget: int) -> Draft:
        tokens = lookup(self.history, budget, self.max_ngram, self.min_ngram)
        return Draft(torch.tensor(tokens, dtype=torch.long, device=self._device), None)

    def propose_tree(self, spec: TreeSpec) -> DraftTree:
        """A tree of the continuations of earlier matches (point masses: ``child_probs`` is None)."""
        tokens, parents = ngram_tree(self.history, spec, self.max_ngram, self.min_ngram)
        if not tokens:
            return DraftTree.empty(self._device)
        return DraftTree(torch.tensor(tokens, dtype=torch.long, device=self._device), parents)


def lookup(history: Sequence[int], budget: int, max_ngram: int, min_ngram: int) -> list[int]:
    """Up to ``budget`` tokens that followed the latest earlier occurrence of the longest matching suffix."""
    if budget <= 0 or len(history) < 2:
        return []
    ids = np.asarray(history, dtype=np.int64)
    for starts in _match_continuations(ids, max_ngram, min_ngram):
        if starts.size:
            start = int(starts[0])
            return ids[start : start + budget].tolist()
    return []


def continuations(
    history: Sequence[int], depth: int, max_ngram: int, min_ngram: int, max_matches: int = MAX_MATCHES
) -> list[list[int]]:
    """The distinct continuations (up to ``depth`` tokens each) of earlier matches of the trailing n-gram.

    In the order :func:`lookup` prefers them: n from ``max_ngram`` down to ``min_ngram``, and within
    one n the most recent match first; at most ``max_matches`` matches per n are looked at. The first
    is :func:`lookup`'s proposal. A continuation may be shorter than ``depth`` when it runs into the end.
    """
    if depth <= 0 or len(history) < 2:
        return []
    ids = np.asarray(history, dtype=np.int64)
    found: dict[tuple[int, ...], None] = {}  # insertion-ordered set
    for starts in _match_continuations(ids, max_ngram, min_ngram):
        for start in starts[:max_matches].tolist():
            found.setdefault(tuple(ids[start : start + depth].tolist()))
    return [list(tokens) for tokens in found]


def _match_continuations(ids: np.ndarray, max_ngram: int, min_ngram: int) -> Iterator[np.ndarray]:
    """For n from ``max_ngram`` down to ``min_ngram``: where the text after each earlier occurrence of the
    trailing n-gram starts (int64 positions, most recent occurrence first; empty when there is none)."""
    length = int(ids.shape[0])  # [length] int64
    for n in range(min(max_ngram, length - 1), min_ngram - 1, -1):
        # windows[i] = ids[i : i + n] for every start i before the suffix's own start.
        windows = np.lib.stride_tricks.sliding_window_view(ids[: length - 1], n)
        hits = np.flatnonzero((windows == ids[length - n :]).all(axis=1))
        yield hits[::-1] + n


# ---------------------------------------------------------------------------------------------
# Trees of continuations


def ngram_tree(
    history: Sequence[int], spec: TreeSpec, max_ngram: int, min_ngram: int, max_matches: int = MAX_MATCHES
) -> tuple[list[int], tuple[int, ...]]:
    """The draft tree (tokens, parents in topological order; empty when nothing matches) for ``spec``."""

    def trie(depth: int) -> ContinuationTrie:
        return ContinuationTrie.build(continuations(history, depth, max_ngram, min_ngram, max_matches))

    if spec.kind == "static":
        assert spec.topology is not None
        topology = spec.topology
        found = trie(max(len(path) for path in topology.paths))
        return found.subtree(found.select_topology(topology))
    assert spec.budget is not None
    found = trie(spec.budget.depth)
    return found.subtree(found.select_budget(spec.budget))


@dataclass(frozen=True)
class ContinuationTrie:
    """Token sequences merged by shared prefix. Nodes are in insertion order (a parent before its children);
    a node's rank is its place among its siblings, 0 = the first inserted."""

    tokens: tuple[int, ...]  # [n]
    parents: tuple[int, ...]  # [n]; ROOT (-1) or an earlier node
    ranks: tuple[int, ...]  # [n]
    children: tuple[tuple[int, ...], ...]  # [n + 1]: the root's children first, then node i's at i + 1

    @staticmethod
    def build(sequences: Iterable[Sequence[int]]) -> ContinuationTrie:
        tokens: list[int] = []
        parents: list[int] = []
        ranks: list[int] = []
        children: list[dict[int, int]] = [{}]  # per parent (root first): token -> node, in insertion order
        for sequence in sequences:
            node = ROOT
            for token in sequence:
                siblings = children[node + 1]
                if token not in siblings:
                    siblings[token] = len(tokens)
                    tokens.append(int(token))
                    parents.append(node)
                    ranks.append(len(siblings) - 1)
                    children.append({})
                node = siblings[token]
        return ContinuationTrie(tuple(tokens), tuple(parents), tuple(ranks), tuple(tuple(c.values()) for c in children))

    @property
    def size(self) -> int:
        return len(self.tokens)

    def select_budget(self, budget: TreeBudget) -> list[int]:
        """The nodes a dynamic budget keeps, parents first: only ranks below ``width`` and depths below
        ``depth``, then the ``nodes`` best by (deviation, depth, rank path), where a node's deviation is
        the sum of the ranks on its path. So the rank-0 chain comes first, then branches that leave it
        once (shallow before deep, rank 1 before rank 2), and so on. A child's key exceeds its parent's,
        so any best-k set is ancestor-closed and its key order is topological."""
        keys: dict[int, tuple[int, int, tuple[int, ...]]] = {}  # node -> (deviation, depth, rank path)
        for node in range(self.size):
            parent, rank = self.parents[node], self.ranks[node]
            if rank >= budget.width or (parent != ROOT and parent not in keys):
                continue
            deviation, depth, path = keys[parent] if parent != ROOT else (0, -1, ())
            if depth + 1 < budget.depth:
                keys[node] = (deviation + rank, depth + 1, (*path, rank))
        return sorted(keys, key=keys.__getitem__)[: budget.nodes]

    def select_topology(self, topology: TreeTopology) -> list[int]:
        """The trie node at each of the topology's index paths the trie can fill, in the topology's order
        (the node at ``(r_0, ..., r_d)`` is the rank-``r_d`` child of the node at ``(r_0, ..., r_{d-1})``)."""
        at: dict[tuple[int, ...], int] = {}
        for path in topology.paths:  # breadth-first: a parent path comes before its children
            parent = at.get(path[:-1]) if len(path) > 1 else ROOT
            if parent is None:
                continue
            siblings = self.children[parent + 1]
            if path[-1] < len(siblings):
                at[path] = siblings[path[-1]]
        return list(at.values())

    def subtree(self, nodes: Sequence[int]) -> tuple[list[int], tuple[int, ...]]:
        """Tokens and re-indexed parents of ``nodes`` (ancestor-closed, parents listed before children)."""
        index = {node: i for i, node in enumerate(nodes)}
        parents = tuple(index[self.parents[n]] if self.parents[n] != ROOT else ROOT for n in nodes)
        return [self.tokens[n] for n in nodes], parents
