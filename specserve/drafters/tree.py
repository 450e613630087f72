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
Does not verify, sample, or know the target beyond its vocabulary.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterator, Sequence

import torch

from specserve.core.model import CausalLM, KVCache, TargetDescription
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
                for node, path in enumerate(topology.paths):
                    if len(path) - 1 == level:
                        parent = topology.parents[node]
                        tokens.append(int(logits[parent + 1].topk(path[-1] + 1).indices[-1]))
        return DraftTree(torch.tensor(tokens, dtype=torch.long, device=self._output_device), topology.parents)

    def propose_dynamic(self, budget: TreeBudget) -> DraftTree:
        tokens: list[int] = []
        parents: list[int] = []
        confidence: list[float] = []
        frontier = [ROOT]
        with self._tree_session() as grow:
            for _ in range(budget.depth):
                logits = grow(DraftTree(torch.tensor(tokens, dtype=torch.long), tuple(parents)))
                log_probs = torch.log_softmax(logits.double(), dim=-1)
                new_frontier = []
                for parent in frontier:
                    base = confidence[parent] if parent != ROOT else 0.0
                    top = log_probs[parent + 1].topk(budget.width)
                    for value, token in zip(top.values.tolist(), top.indices.tolist(), strict=True):
                        tokens.append(int(token))
                        parents.append(parent)
                        confidence.append(base + value)
                        new_frontier.append(len(tokens) - 1)
                frontier = sorted(new_frontier, key=lambda n: -confidence[n])[: budget.width]
        return self._keep_best(tokens, parents, confidence, budget.nodes)

    # -----------------------------------------------------------------------------------------

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
