"""Tree drafting with a small LM: static trees from a topology, dynamic trees in the EAGLE-2 manner.

How a node's children are chosen depends on the request (:meth:`TreeModelDrafter.configure`):

* **greedy** (temperature 0) — *deterministic* children: the draft model's top-ranked tokens
  after the node's path. They carry no q; verification treats each as a point-mass proposal
  (:mod:`specserve.core.verify.tree`), exact at any temperature.
* **sampled** (temperature > 0) — children drawn *without replacement* from the draft's warped
  distribution q (same temperature / top-k / top-p as the request), sent with q so the verifier
  runs SpecInfer's recursive rejection for that law: the first child alone is accepted with
  probability 1 - TV(p, q), where a point mass would get only p(x).
* **drafter-invariant** requests — deterministic children, the first being the token coupled to
  the request's noise (below).

Shapes:

* **static** — a :class:`~specserve.core.tree.draft_tree.TreeTopology` (index paths): the node at path
  ``(r_0, ..., r_d)`` is the rank-``r_d`` child of its parent (the r-th best, or the r-th drawn).
* **dynamic**, greedy (EAGLE-2) — grow level by level: expand the ``width`` frontier nodes with
  the highest cumulative draft confidence (product of the draft's probabilities along the path)
  (``expand`` of them, if set) into their ``width`` best children, down to ``depth``; then keep
  the ``nodes`` best nodes of
  the whole tree. A child's confidence never exceeds its parent's, so the best ``nodes`` (ties
  broken towards shallower nodes) always include their ancestors.
* **dynamic**, sampled — the same expansion, but a sampled child must never be pruned by its
  own value (that would change the law it was drawn from), so the budget is spent while
  growing instead (:meth:`TreeModelDrafter.propose_dynamic_sampled`).

Each level is one draft forward over only the nodes of the level above that get children — leaves
are never forwarded, and the committed tokens the draft has not seen go in one causal forward
with the root (tree attention on the draft's own cache, rolled back to the committed text at the
end). A dynamic tree of depth d, like a chain of d tokens, costs d draft forwards of at most
``width`` rows each. Confidence uses the draft's plain softmax (temperature 1), whatever the
request's sampling parameters.

For drafter-invariant requests (``coupling`` = their :class:`SamplingParams`; see
:mod:`specserve.core.verify.invariant`) each node's rank-0 child is the *coupled* token
argmax(log q + G_t) under the request's keyed Gumbel noise at the child's absolute position t
(the one the target will emit if it agrees with the draft), followed by the draft's best tokens
other than it; in dynamic trees it takes the rank-0 child's confidence, so pruning keeps it as
it would the draft's best token. The children stay deterministic, so this changes acceptance only.
Does not verify, sample, or know the target beyond its vocabulary.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator, Sequence
from typing import Protocol

import torch

from specserve.core.draft.drafter import Draft
from specserve.core.kv.cache import KVCache
from specserve.core.model.causal_lm import CausalLM, TargetDescription
from specserve.core.sampling.params import SamplingParams
from specserve.core.sampling.warps import sample, warp_probs
from specserve.core.tree.draft_tree import ChildSampling, DraftTree
from specserve.core.tree.shapes import ROOT, TreeBudget, TreeSpec, TreeTopology
from specserve.core.verify.invariant import invariant_tokens
from specserve.drafters.vocabulary import check_same_vocabulary


class TreeModelDrafter:
    name = "model-tree"

    def __init__(self, draft: CausalLM, target: CausalLM | TargetDescription | None = None) -> None:
        if target is not None:
            check_same_vocabulary(target, draft)
        self.model = draft
        self.vocab_size = draft.info.vocab_size
        self._output_device = target.device if target is not None else draft.device
        self._cache: KVCache | None = None
        self.context: list[int] = []  # the committed text (a chain drafter sharing the model may share this list)
        self.params = SamplingParams()  # the request's sampling (configure): greedy until told otherwise
        self._generator: torch.Generator | None = None

    def start(self, prompt_ids: Sequence[int]) -> None:
        self._cache = self.model.new_cache()
        self.context = list(prompt_ids)

    def use_cache(self, cache: KVCache) -> None:
        """Draft on ``cache`` (holding the committed text but its last token) instead of a cache of its own, e.g.
        the target's first layers for layer-skip; every proposal rolls it back to the committed text."""
        self._cache = cache

    def accept(self, committed: Sequence[int]) -> None:
        self.context.extend(committed)

    def configure(self, params: SamplingParams, generator: torch.Generator | None) -> None:
        """The request's sampling: sampled requests (temperature > 0, not drafter-invariant) get children drawn
        without replacement from the warped draft distribution, using ``generator``; the others top-k children."""
        self.params, self._generator = params, generator

    @property
    def coupling(self) -> SamplingParams | None:
        """Drafter-invariant requests: their parameters (each node's rank-0 child is the coupled token)."""
        return self.params if self.params.invariant_sampling else None

    @property
    def generator(self) -> torch.Generator | None:
        """The request's generator for draws (:meth:`configure`)."""
        return self._generator

    @property
    def sampled(self) -> bool:
        return not self.params.greedy and not self.params.invariant_sampling and self._generator is not None

    def propose_tree(self, spec: TreeSpec) -> DraftTree:
        if spec.kind == "static":
            assert spec.topology is not None
            return self.propose_static(spec.topology)
        assert spec.budget is not None
        if self.sampled:
            return self.propose_dynamic_sampled(spec.budget)
        return self.propose_dynamic(spec.budget)

    def propose_chain(self, budget: int) -> Draft:
        """A chain of ``budget`` tokens drafted through the session (for drafters whose only model access is a
        session, e.g. EAGLE's head): the argmax when greedy, the coupled token for drafter-invariant requests
        (no q either way), otherwise a draw from the warped draft distribution, sent as q."""
        if budget <= 0:
            return Draft.empty(self._output_device)
        tokens: list[int] = []
        probs: list[torch.Tensor] = []
        with self._session() as session:
            logits = session.root_logits
            for i in range(budget):
                tokens.append(self.choose_chain_token(logits, i, probs))
                if i + 1 < budget:
                    logits = session.expand([i], tokens, [ROOT, *range(i)])[0]
        return self.chain_draft(tokens, probs)

    def choose_chain_token(self, logits: torch.Tensor, index: int, probs: list[torch.Tensor]) -> int:
        """A chain's token ``index`` from the draft's ``logits`` after the ones before it: the argmax when greedy, the
        coupled token for drafter-invariant requests, otherwise a draw from the warped draft distribution with the
        request's generator (its row appended to ``probs``, the q sent with the chain)."""
        if self.params.greedy:
            return int(logits.argmax(-1))
        if self.coupling is not None:
            return int(invariant_tokens(logits[None], self.coupling, [len(self.context) + index])[0])
        assert self._generator is not None
        row = warp_probs(logits, self.params)
        probs.append(row)
        return int(sample(row, self._generator))

    def chain_draft(self, tokens: Sequence[int], probs: Sequence[torch.Tensor]) -> Draft:
        """The chain, with its q when sampled, on the output device."""
        draft_probs = torch.stack(list(probs)).to(self._output_device) if probs else None
        return Draft(torch.tensor(list(tokens), dtype=torch.long, device=self._output_device), draft_probs)

    # -----------------------------------------------------------------------------------------

    def propose_static(self, topology: TreeTopology) -> DraftTree:
        """The topology's shape; a sampled request's tree lacks the paths whose rank exceeds the support of q."""
        parents = topology.parents
        tokens = [0] * topology.size
        expanded = {parent for parent in parents if parent != ROOT}  # nodes the topology gives children
        levels = max((len(p) for p in topology.paths), default=0)
        kept: list[int] = []  # nodes present (a sampled tree may lack ranks beyond q's support)
        q_rows: dict[int, torch.Tensor] = {}  # sampled requests: the q each node's children were drawn from
        with self._session() as session:
            rows = {ROOT: session.root_logits}  # draft logits after each node that gets children
            for level in range(levels):
                at_level = [n for n, path in enumerate(topology.paths) if len(path) - 1 == level and parents[n] in rows]
                if not at_level:
                    break
                count = 1 + max(topology.ranks[n] for n in at_level)
                if self.sampled:
                    ranked = {}
                    for parent, logits in rows.items():
                        q_rows[parent], ranked[parent] = self._draw(logits, count)
                    at_level = [n for n in at_level if topology.ranks[n] < len(ranked[parents[n]])]
                else:
                    ranked = self._children(rows, level, count)
                for node in at_level:
                    tokens[node] = ranked[parents[node]][topology.ranks[node]]
                kept.extend(at_level)
                grown = [node for node in at_level if node in expanded]
                rows = dict(zip(grown, session.expand(grown, tokens, parents), strict=True)) if grown else {}
        if not self.sampled:
            return DraftTree(torch.tensor(tokens, dtype=torch.long, device=self._output_device), parents)
        return self._sampled_tree(sorted(kept), tokens, parents, q_rows)

    def propose_dynamic_sampled(self, budget: TreeBudget) -> DraftTree:
        """A dynamic tree whose children are *sampled* (without replacement from the warped q), for temperature > 0.

        Exactness needs each node's number of children fixed before they are drawn, so the tree is never
        pruned by its children's own values (EAGLE-2's final reranking would bias them). Instead, level by
        level, the ``expand`` (default ``width``) most confident nodes are expanded — the i-th most
        confident with ``max(1, width - i)`` children — until ``depth`` levels or ``nodes`` nodes. A first
        drawn child counts as its parent's best token (it is tried first, and accepted with probability
        1 - TV(p, q) whatever its own q), later ones by their q.
        """
        tokens: list[int] = []
        parents: list[int] = []
        confidence: list[float] = []
        q_rows: dict[int, torch.Tensor] = {}
        with self._session() as session:
            rows = {ROOT: session.root_logits}  # the nodes to expand, most confident first
            for level in range(budget.depth):
                new_nodes = []
                for rank, (parent, logits) in enumerate(rows.items()):
                    count = min(max(1, budget.width - rank), budget.nodes - len(tokens))
                    if count <= 0:
                        break
                    q, children = self._draw(logits, count)
                    q_rows[parent] = q
                    base = confidence[parent] if parent != ROOT else 0.0
                    values = q[children].double().log().tolist()
                    # the first drawn child is tried first and accepted most often (with probability 1 - TV(p, q),
                    # whatever its own q): rank it as the draft's best token, so it is the one expanded
                    values[0] = float(q.max().double().log())
                    for token, log_q in zip(children, values, strict=True):
                        tokens.append(token)
                        parents.append(parent)
                        confidence.append(base + log_q)
                        new_nodes.append(len(tokens) - 1)
                if level + 1 == budget.depth or len(tokens) >= budget.nodes:
                    break
                grown = sorted(new_nodes, key=lambda n: -confidence[n])[: budget.expanded]
                rows = dict(zip(grown, session.expand(grown, tokens, parents), strict=True))
        return self._sampled_tree(list(range(len(tokens))), tokens, parents, q_rows)

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
                grown = sorted(new_nodes, key=lambda n: -confidence[n])[: budget.expanded]
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

    def _draw(self, logits: torch.Tensor, count: int) -> tuple[torch.Tensor, list[int]]:
        """q = the request's warp of the draft logits, and up to ``count`` distinct tokens drawn from it one after
        another without replacement (an exponential race: sorting q / E, E ~ Exp(1), gives that order)."""
        assert self._generator is not None
        q = warp_probs(logits, self.params)
        race = q / torch.empty_like(q).exponential_(1.0, generator=self._generator)
        count = min(count, int((q > 0).sum()))
        return q, race.topk(count).indices.tolist()

    def _sampled_tree(
        self, nodes: list[int], tokens: list[int], parents: Sequence[int], q_rows: dict[int, torch.Tensor]
    ) -> DraftTree:
        """The tree of ``nodes`` (ancestor-closed, parents first) with each parent's q; children without replacement."""
        index = {node: i for i, node in enumerate(nodes)}
        dtype = next(iter(q_rows.values())).dtype if q_rows else torch.float32
        device = next(iter(q_rows.values())).device if q_rows else self._output_device
        zeros = torch.zeros(self.vocab_size, dtype=dtype, device=device)
        rows = [q_rows.get(node, zeros) for node in [ROOT, *nodes]]
        return DraftTree(
            torch.tensor([tokens[n] for n in nodes], dtype=torch.long, device=self._output_device),
            tuple(index[parents[n]] if parents[n] != ROOT else ROOT for n in nodes),
            torch.stack([row.to(zeros.dtype) if row.dtype != zeros.dtype else row for row in rows]).to(
                self._output_device
            ),
            ChildSampling.WITHOUT_REPLACEMENT,
        )

    @contextlib.contextmanager
    def _session(self) -> Iterator[DraftSession]:
        session = self._open_session()
        try:
            yield session
        finally:
            session.close()

    def _open_session(self) -> DraftSession:
        """The draft forwards of one proposal (a drafter over another kind of model overrides this)."""
        if self._cache is None:
            raise RuntimeError("call start() before proposing")
        return _Session(self.model, self._cache, self.context)

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


class DraftSession(Protocol):
    """What tree drafting needs from a model, for one proposal: the logits after the last committed token,
    then the logits after tree nodes, forwarded a level at a time; :meth:`close` forgets the nodes."""

    root_logits: torch.Tensor  # [vocab]

    def expand(self, nodes: Sequence[int], tokens: Sequence[int], parents: Sequence[int]) -> torch.Tensor:
        """Forward tree ``nodes`` (their parents forwarded already); ``[len(nodes), vocab]`` logits after each."""
        ...

    def close(self) -> None: ...


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
