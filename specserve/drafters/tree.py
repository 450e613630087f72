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

Each level is one draft forward over only the nodes of the level above that get children — leaves
are never forwarded, and the committed tokens the draft has not seen go in one causal forward
with the root (tree attention on the draft's own cache, rolled back to the committed text at the
end). A dynamic tree of depth d, like a chain of d tokens, costs d draft forwards of at most
``width`` rows each. Confidence uses the draft's plain softmax (temperature 1), whatever the
request's sampling parameters.

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
from collections.abc import Iterator, Sequence

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
        parents = topology.parents
        tokens = [0] * topology.size
        expanded = {parent for parent in parents if parent != ROOT}  # nodes the topology gives children
        levels = max((len(p) for p in topology.paths), default=0)
        with self._session() as session:
            rows = {ROOT: session.root_logits}  # draft logits after each node that has children
            for level in range(levels):
                at_level = [node for node, path in enumerate(topology.paths) if len(path) - 1 == level]
                ranked = self._children(rows, level, 1 + max(topology.ranks[n] for n in at_level))
                for node in at_level:
                    tokens[node] = ranked[parents[node]][topology.ranks[node]]
                grown = [node for node in at_level if node in expanded]
                if grown:
                    rows = dict(zip(grown, session.expand(grown, tokens, parents), strict=True))
        return DraftTree(torch.tensor(tokens, dtype=torch.long, device=self._output_device), parents)

    def propose_dynamic(self, budget: TreeBudget) -> DraftTree:
        tokens: list[int] = []
        parents: list[int] = []
        confidence: list[float] = []
        with self._session() as session:
            rows = {ROOT: session.root_logits}  # the frontier: nodes to expand, with their draft logits
            for level in range(budget.depth):
                frontier = list(rows)
                log_probs = torch.log_softmax(torch.stack([rows[n] for n in frontier]).double(), dim=-1)
                ranked = self._children(rows, level, budget.width)
                new_nodes = []
                for parent, row in zip(frontier, log_probs, strict=True):
                    base = confidence[parent] if parent != ROOT else 0.0
                    children = ranked[parent]
                    values = row[children].tolist()
                    values[0] = float(row.max())  # a coupled rank-0 child takes the best token's confidence
                    for value, token in zip(values, children, strict=True):
                        tokens.append(token)
                        parents.append(parent)
                        confidence.append(base + value)
                        new_nodes.append(len(tokens) - 1)
                if level + 1 == budget.depth:
                    break
                grown = sorted(new_nodes, key=lambda n: -confidence[n])[: budget.width]
                rows = dict(zip(grown, session.expand(grown, tokens, parents), strict=True))
        return self._keep_best(tokens, parents, confidence, budget.nodes)

    # -----------------------------------------------------------------------------------------

    def _children(self, rows: dict[int, torch.Tensor], level: int, k: int) -> dict[int, list[int]]:
        """Each node's ``k`` best children in rank order (its row of draft logits -> top-``k`` tokens; for
        drafter-invariant requests the coupled token first)."""
        nodes = list(rows)
        logits = torch.stack([rows[n] for n in nodes])
        top = logits.topk(min(k, logits.shape[-1]), dim=-1).indices.tolist()
        coupled = self._coupled(logits, level)
        if coupled is None:
            return dict(zip(nodes, top, strict=True))
        return {
            node: [c, *(token for token in row if token != c)][:k]
            for node, row, c in zip(nodes, top, coupled, strict=True)
        }

    def _coupled(self, logits: torch.Tensor, level: int) -> list[int] | None:
        """Drafter-invariant requests: per row of ``logits`` ([n + 1, vocab]), the coupled token for a child at
        depth ``level`` (absolute position ``len(context) + level``); only the rows of nodes one level up (or
        the root's) are read. ``None`` otherwise."""
        if self.coupling is None:
            return None
        position = len(self.context) + level
        return invariant_tokens(logits, self.coupling, [position] * logits.shape[0]).tolist()

    @contextlib.contextmanager
    def _session(self) -> Iterator[_Session]:
        if self._cache is None:
            raise RuntimeError("call start() before proposing")
        session = _Session(self.model, self._cache, self.context)
        try:
            yield session
        finally:
            session.close()

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


class _Session:
    """The draft forwards of one proposal on the draft's own cache, which holds the committed text but its last token.

    The first forward is causal: the committed tokens the cache lacks, ending with the root (the
    last committed token), whose next-token logits are :attr:`root_logits`. Then each
    :meth:`expand` forwards only the tree nodes that will get children (leaves never need a draft
    forward), with tree attention over the nodes forwarded before them. :meth:`close` rolls the
    cache back to the committed text.
    """

    def __init__(self, model: CausalLM, cache: KVCache, context: Sequence[int]) -> None:
        self.model, self.cache = model, cache
        self.committed = len(context) - 1
        if cache.length > self.committed:
            cache.rollback(self.committed)
        pending = torch.tensor(list(context[cache.length :]), dtype=torch.long)
        self.root_logits = model.forward(cache, pending, last_only=True)[-1]
        self._tokens: list[int] = []  # forwarded nodes, in order
        self._parents: list[int] = []  # their parents, as indices into the forwarded nodes
        self._index: dict[int, int] = {}  # tree node -> forwarded index

    def expand(self, nodes: Sequence[int], tokens: Sequence[int], parents: Sequence[int]) -> torch.Tensor:
        """Forward tree ``nodes`` (their parents forwarded already); ``[len(nodes), vocab]`` logits after each."""
        start = len(self._tokens)
        for node in nodes:
            parent = parents[node]
            self._parents.append(ROOT if parent == ROOT else self._index[parent])
            self._index[node] = len(self._tokens)
            self._tokens.append(int(tokens[node]))
        forwarded = DraftTree(torch.tensor(self._tokens, dtype=torch.long), tuple(self._parents))
        return self.model.extend_tree(self.cache, forwarded, start)

    def close(self) -> None:
        self.cache.rollback(self.committed)
