"""REST retrieval drafting (``rest:FILE``): draft what most often followed the context in a token datastore.

For each proposal the drafter finds the longest suffix of the committed text (at most
``max_length`` tokens) in the datastore built by ``specserve datastore build``
(:mod:`specserve.drafters.datastore`), counts the continuations of its occurrences (up to
``max_occurrences`` of them, ``depth`` tokens each) into a trie, and drafts from the counts: a chain
follows the most frequent child at every step; a tree keeps the nodes that most occurrences pass
through (a node's count estimates the chance its whole path is right), within the width and node
budget, or the index paths of a static topology with children ranked by count. He et al. 2023,
"REST: Retrieval-Based Speculative Decoding"; this implementation is the project's own.

The choice is deterministic, so no q is sent and every token is verified as a point mass: exact at
any temperature, whatever the datastore holds. No model; it knows only the datastore, which one
drafter per request shares (:meth:`RestDrafter.fresh`), and never learns from the text it serves
(a datastore is built offline). A datastore built with another tokenizer is refused when the
drafter is made.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

import torch

from specserve.core.draft.drafter import Draft
from specserve.core.errors import UserError
from specserve.core.model.causal_lm import CausalLM, TargetDescription
from specserve.core.sampling.params import SamplingParams
from specserve.core.tree.draft_tree import DraftTree
from specserve.core.tree.shapes import ROOT, TreeBudget, TreeSpec
from specserve.drafters.datastore import Datastore, Match
from specserve.drafters.history import CommittedHistory
from specserve.drafters.ngram import ContinuationTrie

MAX_LENGTH = 16  # longest context suffix looked up
MAX_OCCURRENCES = 256  # occurrences whose continuations are counted, per proposal


class RestDrafter(CommittedHistory):
    name = "rest"

    def __init__(
        self,
        datastore: Datastore,
        device: torch.device | str = "cpu",
        max_length: int = MAX_LENGTH,
        min_occurrences: int = 1,
        max_occurrences: int = MAX_OCCURRENCES,
    ) -> None:
        if max_length < 1 or min_occurrences < 1 or max_occurrences < 1:
            raise UserError(
                "REST drafting needs max_length, min_occurrences and max_occurrences >= 1, got "
                f"{max_length}, {min_occurrences}, {max_occurrences}"
            )
        self.datastore = datastore
        self.max_length = max_length
        self.min_occurrences = min_occurrences
        self.max_occurrences = max_occurrences
        self._device = device
        self.history: list[int] = []
        self.counters = {"proposals": 0, "matched": 0, "match_tokens": 0}  # this request's

    @classmethod
    def load(cls, path: str | Path, target: CausalLM | TargetDescription, **options: int) -> RestDrafter:
        """The drafter over the datastore at ``path``, refused (:class:`~specserve.drafters.datastore.DatastoreError`)
        when the file is not a usable datastore or was built with another tokenizer than the target's."""
        datastore = Datastore.open(path)
        datastore.check_target(target.info.vocab_size, target.tokenizer, target.info.path)
        return cls(datastore, device=target.device, **options)

    def fresh(self) -> RestDrafter:
        """A drafter with no history over the same (memory-mapped, read-only) datastore: one per request."""
        return RestDrafter(self.datastore, self._device, self.max_length, self.min_occurrences, self.max_occurrences)

    def start(self, prompt_ids: Sequence[int], params: SamplingParams, generator: torch.Generator) -> None:
        super().start(prompt_ids, params, generator)  # deterministic: params and generator are not needed
        self.counters = {"proposals": 0, "matched": 0, "match_tokens": 0}

    def lookup(self, depth: int) -> Match:
        match = self.datastore.lookup(self.history, depth, self.max_length, self.min_occurrences, self.max_occurrences)
        self.counters["proposals"] += 1
        self.counters["matched"] += match.length > 0
        self.counters["match_tokens"] += match.length
        return match

    def request_counters(self) -> dict[str, int]:
        """This request's proposals, those that matched the datastore, and their matched tokens."""
        return dict(self.counters)

    def propose(self, budget: int) -> Draft:
        if budget <= 0 or not self.history:
            return Draft.empty(self._device)
        chain = CountTrie.build(self.lookup(budget).continuations).chain()
        return Draft(torch.tensor(chain, dtype=torch.long, device=self._device), None)

    def propose_tree(self, spec: TreeSpec) -> DraftTree:
        """A tree of the most frequent continuations (point masses: ``child_probs`` is None)."""
        if not self.history:
            return DraftTree.empty(self._device)
        if spec.kind == "static":
            assert spec.topology is not None
            trie = CountTrie.build(self.lookup(max(len(path) for path in spec.topology.paths)).continuations)
            tokens, parents = trie.trie.subtree(trie.trie.select_topology(spec.topology))
        else:
            assert spec.budget is not None
            trie = CountTrie.build(self.lookup(spec.budget.depth).continuations)
            tokens, parents = trie.trie.subtree(trie.select_budget(spec.budget))
        if not tokens:
            return DraftTree.empty(self._device)
        return DraftTree(torch.tensor(tokens, dtype=torch.long, device=self._device), parents)


@dataclass(frozen=True)
class CountTrie:
    """Continuations merged by shared prefix, each node with the number of occurrences whose continuation passes
    through it. Nodes are breadth-first with each parent's children by count (ties: smaller token first), so a
    node's rank in ``trie`` (a :class:`~specserve.drafters.ngram.ContinuationTrie`) is its place by frequency."""

    trie: ContinuationTrie
    counts: tuple[int, ...]  # [n]

    @staticmethod
    def build(continuations: Sequence[tuple[Sequence[int], int]]) -> CountTrie:
        # a nested dict per node: token -> [count, children]
        root: dict[int, list] = {}
        for sequence, count in continuations:
            level = root
            for token in sequence:
                entry = level.setdefault(int(token), [0, {}])
                entry[0] += count
                level = entry[1]
        tokens: list[int] = []
        parents: list[int] = []
        ranks: list[int] = []
        counts: list[int] = []
        children: list[tuple[int, ...]] = []
        queue: list[tuple[int, dict[int, list]]] = [(ROOT, root)]
        for parent, level in queue:  # breadth-first: the queue grows while it is read
            ordered = sorted(level.items(), key=lambda item: (-item[1][0], item[0]))
            indices = []
            for rank, (token, (count, below)) in enumerate(ordered):
                indices.append(len(tokens))
                tokens.append(token)
                parents.append(parent)
                ranks.append(rank)
                counts.append(count)
                queue.append((len(tokens) - 1, below))
            children.append(tuple(indices))
        # children were appended in queue order: the root's, then node i's in node order (the queue is node order)
        trie = ContinuationTrie(tuple(tokens), tuple(parents), tuple(ranks), tuple(children))
        return CountTrie(trie, tuple(counts))

    @property
    def size(self) -> int:
        return self.trie.size

    def chain(self) -> list[int]:
        """The rank-0 path: the most frequent next token at every step."""
        path: list[int] = []
        siblings = self.trie.children[0]
        while siblings:
            node = siblings[0]
            path.append(self.trie.tokens[node])
            siblings = self.trie.children[node + 1]
        return path

    def select_budget(self, budget: TreeBudget) -> list[int]:
        """The nodes a dynamic budget keeps, parents first: only ranks below ``width`` and depths below ``depth``,
        then the ``nodes`` most frequent (ties: shallower first, then breadth-first order). A child is never more
        frequent than its parent and is deeper, so any such set is ancestor-closed and its order topological."""
        keys: dict[int, tuple[int, int, int]] = {}  # node -> (-count, depth, node)
        for node in range(self.size):
            parent, rank = self.trie.parents[node], self.trie.ranks[node]
            if rank >= budget.width or (parent != ROOT and parent not in keys):
                continue
            depth = keys[parent][1] + 1 if parent != ROOT else 0
            if depth < budget.depth:
                keys[node] = (-self.counts[node], depth, node)
        return sorted(keys, key=keys.__getitem__)[: budget.nodes]
