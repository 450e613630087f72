"""Draft-tree *shapes* as a request asks for them: a static topology or a dynamic budget. Torch-free.

:class:`TreeTopology` holds a static tree as index paths (Medusa's and EAGLE-1's published form)
and can find the best-first topology for calibrated rank probabilities; :class:`TreeBudget` bounds
a dynamic (EAGLE-2-style) tree; :class:`TreeSpec` is one of the two. They are checked when made
(:class:`InvalidTree` says what is wrong), so the command line and the HTTP edge validate a tree
option before any model or torch loads. The trees themselves (tokens, masks, positions) are
:mod:`specserve.core.tree.draft_tree`.
"""

from __future__ import annotations

import heapq
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Literal

ROOT = -1  # the parent index of a child of the root (the last committed token)


class InvalidTree(ValueError):
    """A tree whose structure is inconsistent; the message says which node and why."""


@dataclass(frozen=True)
class TreeBudget:
    """A dynamic tree's budget: levels below the root, children per expanded node, nodes kept for
    verification, and nodes expanded per level (``expand``; default ``width``, as EAGLE-2 does).

    ``expand = 1`` grows one path of the most confident nodes and hangs up to ``width - 1``
    alternatives on each of its nodes: each level costs the drafter a one-row forward, like a chain.
    """

    depth: int
    width: int
    nodes: int
    expand: int | None = None

    def __post_init__(self) -> None:
        if self.depth < 1 or self.width < 1 or self.nodes < 1 or (self.expand is not None and self.expand < 1):
            raise InvalidTree(f"tree budget needs depth, width, nodes (and expand) >= 1, got {self}")

    @property
    def expanded(self) -> int:
        """Nodes expanded per level."""
        return self.width if self.expand is None else self.expand


@dataclass(frozen=True)
class TreeSpec:
    """How a request drafts trees: a static topology, or a dynamic tree within a budget."""

    kind: Literal["static", "dynamic"]
    topology: TreeTopology | None = None
    budget: TreeBudget | None = None

    def __post_init__(self) -> None:
        if self.kind == "static" and self.topology is None:
            raise InvalidTree("a static tree needs a topology")
        if self.kind == "dynamic" and self.budget is None:
            raise InvalidTree("a dynamic tree needs a budget (depth, width, nodes)")

    def describe(self) -> str:
        if self.kind == "static":
            assert self.topology is not None
            return f"static({self.topology.size} nodes)"
        assert self.budget is not None
        budget = self.budget
        expand = f", expand={budget.expand}" if budget.expand is not None else ""
        return f"dynamic(depth={budget.depth}, width={budget.width}, nodes={budget.nodes}{expand})"


@dataclass(frozen=True)
class TreeTopology:
    """A static tree shape as index paths: ``(0,)`` = the root's best child, ``(0, 1)`` = its second-best
    child, ... (Medusa's and EAGLE-1's published trees use this form). Every path's prefix must be
    listed too. ``parents`` and ``ranks`` give the nodes in breadth-first order."""

    paths: tuple[tuple[int, ...], ...]
    parents: tuple[int, ...] = field(init=False)
    ranks: tuple[int, ...] = field(init=False)  # which candidate (0 = best) of its parent each node is

    def __post_init__(self) -> None:
        ordered = sorted(set(self.paths), key=lambda p: (len(p), p))
        if len(ordered) != len(self.paths):
            raise InvalidTree("topology lists a path twice")
        index = {path: i for i, path in enumerate(ordered)}
        parents = []
        for path in ordered:
            if not path or any(not isinstance(k, int) or k < 0 for k in path):
                raise InvalidTree(f"topology path {path!r} must be a non-empty tuple of candidate ranks >= 0")
            if len(path) > 1 and path[:-1] not in index:
                raise InvalidTree(f"topology path {path!r} has no parent path {path[:-1]!r}")
            parents.append(index[path[:-1]] if len(path) > 1 else ROOT)
        object.__setattr__(self, "paths", tuple(ordered))
        object.__setattr__(self, "parents", tuple(parents))
        object.__setattr__(self, "ranks", tuple(path[-1] for path in ordered))

    @staticmethod
    def from_lists(paths: Sequence[Sequence[int]]) -> TreeTopology:
        """From JSON-style lists of lists (the form topology files use)."""
        return TreeTopology(tuple(tuple(int(k) for k in path) for path in paths))

    @property
    def size(self) -> int:
        return len(self.paths)

    @staticmethod
    def best_first(nodes: int, rank_probs: Sequence[float], max_depth: int = 16) -> TreeTopology:
        """The ``nodes`` paths with the highest product of ``rank_probs`` along them (Medusa's calibrated trees).

        ``rank_probs[r]`` estimates how often the target's token is the drafter's rank-``r``
        candidate; a path's product is then its chance of being accepted. Probabilities are made
        non-increasing in rank first, so a path's first child and next sibling are its best
        successors and a best-first search finds the top ``nodes`` exactly. Ancestor-closed: a
        prefix never scores below its extension.
        """
        probs = [float(p) for p in rank_probs]
        if nodes < 1 or max_depth < 1 or not probs or any(not 0.0 < p <= 1.0 for p in probs):
            raise InvalidTree(f"best_first needs nodes, max_depth >= 1 and rank_probs in (0, 1], got {nodes}, "
                              f"{max_depth}, {probs}")  # fmt: skip
        for r in range(1, len(probs)):
            probs[r] = min(probs[r], probs[r - 1])
        heap: list[tuple[float, tuple[int, ...]]] = [(-probs[0], (0,))]
        chosen: list[tuple[int, ...]] = []
        while heap and len(chosen) < nodes:
            negative, path = heapq.heappop(heap)
            chosen.append(path)
            if len(path) < max_depth:  # first child
                heapq.heappush(heap, (negative * probs[0], (*path, 0)))
            if path[-1] + 1 < len(probs):  # next sibling
                value = negative / probs[path[-1]] * probs[path[-1] + 1]
                heapq.heappush(heap, (value, (*path[:-1], path[-1] + 1)))
        return TreeTopology(tuple(chosen))
