"""Tree drafting with a small LM: static trees from a topology, dynamic trees in the EAGLE-2 manner.

The drafter's children are *deterministic*: the draft model's top-ranked tokens after each
node's path. They carry no q, so verification treats each child as a point-mass proposal
(:mod:`specserve.core.tree_verification`), which is exact at any temperature.

* **static** — a :class:`~specserve.core.tree.TreeTopology` (index paths): the node at path
  ``(r_0, ..., r_d)`` is the rank-``r_d`` token after its parent's path.
* **dynamic** (EAGLE-2) — grow level by level: expand the ``width`` frontier nodes with the
  highest cumulative draft confidence (product of the draft's probabilities along the path)
  into their ``width`` best children, down to ``depth``; then keep the ``nodes`` best nodes of
  the whole tree. A child's confidence never exceeds its parent's, so the best ``nodes`` (ties
  broken towards shallower nodes) always include their ancestors.

Each level is one draft forward over the nodes that level added (tree attention on the draft's
own cache, which holds the levels before it; rolled back to the committed text at the end). Confidence uses the
draft's plain softmax (temperature 1), whatever the request's sampling parameters.

For drafter-invariant requests (``coupling`` set to their :class:`SamplingParams`; see
:mod:`specserve.core.invariant`) each node's rank-0 child is the *coupled* token
argmax(log q + G_t) under the request's keyed Gumbel noise at the child's absolute position t
(the one the target will emit if it agrees with the draft), followed by the draft's best tokens
other than it; in dynamic trees it takes the rank-0 child's confidence, so pruning keeps it as
it would the draft's best token. The children stay deterministic, so this changes acceptance only.
Does not verify, sample, or know the target beyond its vocabulary.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterator, Sequence

import torch

from specserve.core.invariant import invariant_tokens
from specserve.core.model import CausalLM, KVCache, TargetDescription
from specserve.core.sampling import SamplingParams
from specserve.core.tree import ROOT, DraftTree, TreeBudget, TreeSpec, TreeTopology
from specserve.drafters.model import check_same_vocabulary


class TreeModelDrafter:
    name = "model-tree"

    def __init__(self, draft: CausalLM, target: CausalLM | TargetDescription | None = None) -> None:
        if target is not None:
            check_same_vocabulary(target, draft)
        self.model = draft
        self._output_device = target.device if target is not None else draft.device
        self._cache: KVCache | None = None
        self.context: list[int] = []  # the committed text (a chain drafter sharing the model may share this list)
        self.coupling: SamplingParams | None = None  # drafter-invariant requests: rank 0 = the coupled token

    def start(self, prompt_ids: Sequence[int]) -> None:
        self._cache = self.model.new_cache()
        self.context = list(prompt_ids)

    def accept(self, committed: Sequence[int]) -> None:
        self.context.extend(committed)

    def propose_tree(self, spec: TreeSpec) -> DraftTree:
        if spec.kind == "static":
            assert spec.topology is not None
            return self.propose_static(spec.topology)
        assert spec.budget is not None
        return self.propose_dynamic(spec.budget)

    # -----------------------------------------------------------------------------------------

    def propose_static(self, topology: TreeTopology) -> DraftTree:
        tokens: list[int] = []
        levels = max((len(p) for p in topology.paths), default=0)
        with self._tree_session() as grow:
            for level in range(levels):
                logits = grow(DraftTree(torch.tensor(tokens, dtype=torch.long), topology.parents[: len(tokens)]))
                coupled = self._coupled(logits, level)
                for node, path in enumerate(topology.paths):
                    if len(path) - 1 == level:
                        row = topology.parents[node] + 1
                        ranked = self._ranked(logits[row], path[-1] + 1, None if coupled is None else coupled[row])
                        tokens.append(ranked[-1])
        return DraftTree(torch.tensor(tokens, dtype=torch.long, device=self._output_device), topology.parents)

    def propose_dynamic(self, budget: TreeBudget) -> DraftTree:
        tokens: list[int] = []
        parents: list[int] = []
        confidence: list[float] = []
        frontier = [ROOT]
        with self._tree_session() as grow:
            for level in range(budget.depth):
                logits = grow(DraftTree(torch.tensor(tokens, dtype=torch.long), tuple(parents)))
                log_probs = torch.log_softmax(logits.double(), dim=-1)
                coupled = self._coupled(logits, level)
                new_frontier = []
                for parent in frontier:
                    base = confidence[parent] if parent != ROOT else 0.0
                    row = log_probs[parent + 1]
                    ranked = self._ranked(row, budget.width, None if coupled is None else coupled[parent + 1])
                    values = row[ranked].tolist()
                    values[0] = float(row.max())  # a coupled rank-0 child takes the best token's confidence
                    for value, token in zip(values, ranked, strict=True):
                        tokens.append(int(token))
                        parents.append(parent)
                        confidence.append(base + value)
                        new_frontier.append(len(tokens) - 1)
                frontier = sorted(new_frontier, key=lambda n: -confidence[n])[: budget.width]
        return self._keep_best(tokens, parents, confidence, budget.nodes)

    # -----------------------------------------------------------------------------------------

    def _coupled(self, logits: torch.Tensor, level: int) -> list[int] | None:
        """Drafter-invariant requests: per row of ``logits`` ([n + 1, vocab]), the coupled token for a child at
        depth ``level`` (absolute position ``len(context) + level``); only the rows of nodes one level up (or
        the root's) are read. ``None`` otherwise."""
        if self.coupling is None:
            return None
        position = len(self.context) + level
        return invariant_tokens(logits, self.coupling, [position] * logits.shape[0]).tolist()

    @staticmethod
    def _ranked(row: torch.Tensor, k: int, coupled: int | None) -> list[int]:
        """A node's ``k`` best children in rank order: the draft's top-``k`` tokens, or the coupled token
        followed by the draft's best tokens other than it."""
        top: list[int] = row.topk(k).indices.tolist()
        if coupled is None:
            return top
        return [coupled, *(token for token in top if token != coupled)][:k]

    @contextlib.contextmanager
    def _tree_session(self) -> Iterator[Callable[[DraftTree], torch.Tensor]]:
        """Grow a tree level by level on the draft's cache; yields ``grow(tree)`` -> logits after the root
        and every node so far ([n + 1, vocab]), forwarding only the nodes added since the last call.
        The cache is rolled back to the committed text afterwards."""
        if self._cache is None:
            raise RuntimeError("call start() before proposing")
        cache, context = self._cache, self.context
        committed = len(context) - 1  # the cache holds every committed token but the last (the root)
        if cache.length > committed:
            cache.rollback(committed)
        if cache.length < committed:
            self.model.forward(cache, torch.tensor(context[cache.length : committed]), last_only=True)
        rows: list[torch.Tensor] = []

        def grow(tree: DraftTree) -> torch.Tensor:
            if not rows:
                rows.extend(self.model.forward_tree(cache, context[-1], tree))
            elif tree.size + 1 > len(rows):
                rows.extend(self.model.extend_tree(cache, tree, len(rows) - 1))
            return torch.stack(rows)

        try:
            yield grow
        finally:
            cache.rollback(committed)

    def _keep_best(self, tokens: list[int], parents: list[int], confidence: list[float], keep: int) -> DraftTree:
        depth = DraftTree(torch.tensor(tokens, dtype=torch.long), tuple(parents)).depths
        best = sorted(range(len(tokens)), key=lambda n: (-confidence[n], depth[n], n))[:keep]
        chosen = set(best)
        for node in best:  # ancestor-closed by construction; make sure under float ties
            parent = parents[node]
            while parent != ROOT and parent not in chosen:
                chosen.add(parent)
                parent = parents[parent]
        order = sorted(chosen, key=lambda n: (depth[n], n))  # parents before children
        index = {node: i for i, node in enumerate(order)}
        return DraftTree(
            torch.tensor([tokens[n] for n in order], dtype=torch.long, device=self._output_device),
            tuple(index[parents[n]] if parents[n] != ROOT else ROOT for n in order),
        )
