"""Draft trees: the node structure every drafter produces and the target verifies in one pass.

A :class:`DraftTree` holds draft nodes in topological order (a node's parent comes before it):
their tokens, parent indices (``-1`` = a child of the *root*, which is the last committed
token), and, per parent (the root first, then every node), the exact draft distribution that
parent's children were drawn from — or ``None`` when the tokens were chosen deterministically
(greedy, n-gram lookup) — and how they were drawn from it (:class:`ChildSampling`). A chain is
the degenerate tree whose node ``i`` has parent ``i - 1``.

Everything the target needs is derived here once per tree: depths, root-to-node paths,
children lists, and — for the verify block ``[root] + nodes`` that follows ``prefix_len``
cached positions — the additive 4-D attention mask (each node sees the cached prefix, the
root, its ancestors and itself) and the position ids (``prefix_len + 1 + depth``). Static tree
*shapes* come from topology data (:class:`TreeTopology`: index paths, as Medusa and EAGLE-1
publish them); they and the dynamic budgets live, torch-free, in :mod:`specserve.core.tree.shapes`
and are re-exported here.

Pure tensors and index arithmetic: no model, no sampling, no verification rules.
"""

from __future__ import annotations

import enum
from collections.abc import Sequence
from dataclasses import dataclass
from functools import cached_property
from typing import Protocol

import torch

from specserve.core.tree.shapes import ROOT, InvalidTree

__all__ = ["ChildSampling", "DraftTree", "VerifyRules", "block_nodes", "check_probe", "committed_tokens"]


class ChildSampling(enum.StrEnum):
    """How a node's sampled children were drawn from its ``child_probs`` row (deterministic children: no q)."""

    IID = "iid"  # independently, each from q
    WITHOUT_REPLACEMENT = "without_replacement"  # distinct, one after another from q with the earlier ones removed


class VerifyRules(enum.StrEnum):
    """Which exact rules the target applies to a proposal (what travels on the wire as ``Rules``)."""

    CHAIN = "chain"  # one sampled child per depth: rule A (a :class:`~specserve.core.draft.drafter.Draft`)
    TREE_IID = "tree_iid"  # tree rules, children drawn i.i.d. from their parent's q: rule B (or D without q)
    TREE_WITHOUT_REPLACEMENT = "tree_without_replacement"  # tree rules, distinct children: rule C (or D)


_TREE_RULES = {
    ChildSampling.IID: VerifyRules.TREE_IID,
    ChildSampling.WITHOUT_REPLACEMENT: VerifyRules.TREE_WITHOUT_REPLACEMENT,
}


class PathVerdict(Protocol):
    """What a verdict says about a proposal: the accepted root path (node indices) and the token after it."""

    @property
    def accepted(self) -> tuple[int, ...]: ...

    @property
    def next_token(self) -> int: ...


def committed_tokens(
    tokens: torch.Tensor, parents: Sequence[int], verdict: PathVerdict, kind: str = "tree"
) -> list[int]:
    """The tokens ``verdict`` commits after a proposal of ``tokens`` / ``parents``: the accepted path's tokens and
    the next token. Raises :class:`InvalidTree` when the path is not a root path of that proposal."""
    path = list(verdict.accepted)
    expected = ROOT
    for node in path:
        if not 0 <= node < len(parents) or parents[node] != expected:
            raise InvalidTree(
                f"the verdict's path {path[:8]} is not a root path of the {len(parents)}-node {kind} sent"
            )
        expected = node
    return [*(int(tokens[node]) for node in path), int(verdict.next_token)]


def check_probe(probe: DraftTree | None) -> None:
    """Raises :class:`InvalidTree` unless ``probe`` is ``None`` or a deterministic tree without a probe of its own."""
    if probe is None:
        return
    if probe.child_probs is not None or probe.probe is not None:
        raise InvalidTree("a probe is a deterministic tree (no q) and carries no probe of its own")
    if probe.size == 0:
        raise InvalidTree("a probe needs at least one node; send none instead")


def block_nodes(
    tokens: torch.Tensor, parents: Sequence[int], probe: DraftTree | None
) -> tuple[torch.Tensor, tuple[int, ...]]:
    """The nodes of a verify block after its root: the draft's, then the probe's, whose parents are shifted past
    the draft's (a probe node's parent is the root or another probe node, never a draft node). A draft node never
    sees a probe node: with tree attention each node sees only its ancestors."""
    if probe is None:
        return tokens, tuple(parents)
    n = len(parents)
    shifted = tuple(parent if parent == ROOT else parent + n for parent in probe.parents)
    return torch.cat([tokens, probe.tokens.to(tokens.device)]), (*parents, *shifted)


@dataclass(frozen=True)
class DraftTree:
    tokens: torch.Tensor  # [n] int64
    parents: tuple[int, ...]  # [n]; ROOT (-1) or the index of an earlier node
    # [n + 1, vocab]: row 0 = the distribution the root's children were drawn from, row i + 1 = node i's
    # children's; None = every token was chosen deterministically (verification treats q as a point mass)
    child_probs: torch.Tensor | None = None
    sampling: ChildSampling = ChildSampling.IID  # how sampled children were drawn (the verifier needs it)
    # Nodes the target computes in the same forward but does not verify (Lookahead's Jacobi window): a
    # deterministic tree after the root, seen by none of the draft nodes (see core.draft.drafter.ProbingDrafter)
    probe: DraftTree | None = None

    def __post_init__(self) -> None:
        n = int(self.tokens.shape[0]) if self.tokens.dim() == 1 else -1
        if n < 0:
            raise InvalidTree(f"tokens must be a 1-D tensor, got shape {tuple(self.tokens.shape)}")
        if len(self.parents) != n:
            raise InvalidTree(f"{n} tokens but {len(self.parents)} parents")
        for i, parent in enumerate(self.parents):
            if not ROOT <= parent < i:
                raise InvalidTree(f"node {i} has parent {parent}; parents must be -1 (root) or an earlier node")
        if self.child_probs is not None and (self.child_probs.dim() != 2 or self.child_probs.shape[0] != n + 1):
            raise InvalidTree(f"child_probs must be [{n + 1}, vocab], got {tuple(self.child_probs.shape)}")
        check_probe(self.probe)

    # Construction ----------------------------------------------------------------------------

    @staticmethod
    def chain(tokens: torch.Tensor, draft_probs: torch.Tensor | None = None) -> DraftTree:
        """A chain: ``draft_probs[i]`` (as in :class:`~specserve.core.draft.drafter.Draft`) is the q token ``i`` was
        drawn from, i.e. the distribution of the children of node ``i - 1`` (the root for ``i = 0``)."""
        n = int(tokens.shape[0])
        probs = None
        if draft_probs is not None:
            probs = torch.cat([draft_probs, draft_probs.new_zeros(1, draft_probs.shape[1])])  # the leaf has none
        return DraftTree(tokens, tuple(range(-1, n - 1)), probs)

    @staticmethod
    def empty(device: torch.device | str = "cpu") -> DraftTree:
        return DraftTree(torch.empty(0, dtype=torch.long, device=device), ())

    @staticmethod
    def from_node_probs(
        tokens: torch.Tensor,
        parents: tuple[int, ...],
        node_probs: torch.Tensor | None,  # [n, vocab]: the q each node was drawn from; None = deterministic
        sampling: ChildSampling = ChildSampling.IID,
    ) -> DraftTree:
        """The tree whose node ``i`` was drawn from ``node_probs[i]`` (the inverse of :attr:`node_probs`).

        Siblings were drawn from their parent's one distribution, so their rows must be equal."""
        tree = DraftTree(tokens, parents, sampling=sampling)
        if node_probs is None:
            return tree
        if node_probs.dim() != 2 or node_probs.shape[0] != tree.size:
            raise InvalidTree(f"node_probs must be [{tree.size}, vocab], got {tuple(node_probs.shape)}")
        rows = node_probs.new_zeros(tree.size + 1, node_probs.shape[1])
        for parent, children in enumerate(tree.children):
            if children:
                first = node_probs[children[0]]
                if any(not torch.equal(node_probs[c], first) for c in children[1:]):
                    raise InvalidTree(
                        f"the children of node {parent - 1} carry different q; siblings share their parent's q"
                    )
                rows[parent] = first
        return DraftTree(tokens, parents, rows, sampling)

    # Structure ---------------------------------------------------------------------------------

    @property
    def size(self) -> int:
        return len(self.parents)

    @cached_property
    def depths(self) -> tuple[int, ...]:
        """Depth of each node: 0 for the root's children."""
        depths: list[int] = []
        for parent in self.parents:
            depths.append(0 if parent == ROOT else depths[parent] + 1)
        return tuple(depths)

    @property
    def depth(self) -> int:
        """Depth of the tree: the longest root-to-leaf path in nodes (0 when empty)."""
        return max(self.depths) + 1 if self.depths else 0

    @cached_property
    def children(self) -> tuple[tuple[int, ...], ...]:
        """``children[0]``: the root's children; ``children[i + 1]``: node ``i``'s (in index order)."""
        out: list[list[int]] = [[] for _ in range(self.size + 1)]
        for i, parent in enumerate(self.parents):
            out[parent + 1].append(i)
        return tuple(tuple(c) for c in out)

    @cached_property
    def paths(self) -> tuple[tuple[int, ...], ...]:
        """Root-to-node paths: ``paths[i]`` lists the node indices from depth 0 down to ``i``."""
        out: list[tuple[int, ...]] = []
        for i, parent in enumerate(self.parents):
            out.append((i,) if parent == ROOT else (*out[parent], i))
        return tuple(out)

    @property
    def rules(self) -> VerifyRules:
        """The tree rules (B, C, or D without q) for how its children were drawn, even when chain-shaped."""
        return _TREE_RULES[self.sampling]

    @property
    def node_probs(self) -> torch.Tensor | None:
        """[n, vocab]: per node, the q it was drawn from (its parent's children's row); None = deterministic."""
        if self.child_probs is None:
            return None
        return self.child_probs[[p + 1 for p in self.parents]]

    def committed_by(self, verdict: PathVerdict) -> list[int]:
        """The tokens a verdict on this tree commits (path + next token), checked against the tree."""
        return committed_tokens(self.tokens, self.parents, verdict)

    @property
    def is_chain(self) -> bool:
        return all(parent == i - 1 for i, parent in enumerate(self.parents))

    def to(self, device: torch.device | str) -> DraftTree:
        probs = self.child_probs.to(device) if self.child_probs is not None else None
        probe = self.probe.to(device) if self.probe is not None else None
        return DraftTree(self.tokens.to(device), self.parents, probs, self.sampling, probe)

    def truncate(self, max_depth: int) -> DraftTree:
        """The nodes shallower than ``max_depth`` (a verdict adds one token after the path: a tree never
        needs to reach past the request's remaining budget). The probe is kept whole: the KV a request
        reserves holds it (:func:`~specserve.core.batch_step.kv_tokens`)."""
        if self.depth <= max_depth:
            return self
        return self.keep([i for i, d in enumerate(self.depths) if d < max_depth])  # ancestors are shallower

    def keep(self, kept: Sequence[int]) -> DraftTree:
        """The tree of the nodes ``kept`` (increasing, every kept node's parent kept too), renumbered in order; each
        kept parent keeps its children's q row. The probe is kept whole."""
        index = {node: i for i, node in enumerate(kept)}
        if any(self.parents[node] != ROOT and self.parents[node] not in index for node in kept):
            raise InvalidTree("a kept node's parent must be kept too")
        probs = None
        if self.child_probs is not None:
            probs = self.child_probs[[0, *(i + 1 for i in kept)]]
        parents = tuple(index[self.parents[i]] if self.parents[i] != ROOT else ROOT for i in kept)
        return DraftTree(self.tokens[list(kept)], parents, probs, self.sampling, self.probe)

    def path_tokens(self, node: int) -> list[int]:
        return [int(self.tokens[i]) for i in self.paths[node]]

    # What the target's forward needs ----------------------------------------------------------

    def ancestry(self) -> torch.Tensor:
        """[n + 1, n + 1] bool over the verify block ``[root] + nodes``: row i may attend column j."""
        n = self.size
        allowed = torch.zeros(n + 1, n + 1, dtype=torch.bool)
        allowed[:, 0] = True  # everyone sees the root
        for i, path in enumerate(self.paths):
            allowed[i + 1, [j + 1 for j in path]] = True
        return allowed

    def attention_mask(self, prefix_len: int, dtype: torch.dtype, device: torch.device | str = "cpu") -> torch.Tensor:
        """Additive [1, 1, n + 1, prefix_len + n + 1] mask for the block ``[root] + nodes`` after the cache."""
        n = self.size
        mask = torch.zeros(n + 1, prefix_len + n + 1, dtype=dtype)
        mask[:, prefix_len:].masked_fill_(~self.ancestry(), torch.finfo(dtype).min)
        return mask[None, None].to(device)

    def position_ids(self, prefix_len: int, device: torch.device | str = "cpu") -> torch.Tensor:
        """[1, n + 1]: the root at ``prefix_len``, a node at depth d at ``prefix_len + 1 + d``."""
        positions = [prefix_len, *(prefix_len + 1 + d for d in self.depths)]
        return torch.tensor([positions], dtype=torch.long, device=device)
