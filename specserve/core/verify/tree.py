"""Exact verification of a draft tree: pure functions over the target's per-node distributions.

The target's verify pass gives one distribution per *parent* (row 0 for the root, row ``i + 1``
for node ``i``; see :meth:`~specserve.core.model.causal_lm.CausalLM.forward_tree`). The verifier walks from
the root:

* **greedy** — follow the child whose token equals the target's argmax (lowest id on ties); when
  no child matches, emit the argmax (*recovered*; *bonus* when the node is a leaf).
* **sampling** — recursive rejection over a node's children in index order (SpecInfer's
  multi-step speculative sampling): with residual r = p, child j with token x_j, drawn from
  proposal q_j, is accepted with probability min(1, r(x_j) / q_j(x_j)); on rejection
  r <- norm(max(0, r - q_j)) and the next child is tried. An accepted child becomes the new node
  (r = its own p); when every child is rejected the *recovered* token comes from the final
  residual, and at a leaf the *bonus* token from p. The proposal q_j of each child is what it
  was really drawn from:

  - ``iid``: children drawn independently from the parent's q: q_j = q;
  - ``without_replacement``: distinct children drawn one after another from q with the earlier
    ones removed: q_j = norm(q with x_1 .. x_{j-1} zeroed);
  - no q (deterministic children: greedy top-k, n-gram matches): q_j = one-hot(x_j).

  Each step is an exact rejection step for the law its candidate was drawn from, so every
  emitted token is distributed exactly as the target's (conditionally on the path so far).

Randomness is drawn in a fixed order — one uniform per node, then one exponential race row per
parent — so :func:`reference_verify_tree` (plain Python floats, written for reading) reproduces
:func:`verify_tree` exactly on the same generator state.

On the device, what happens at a row depends only on that row (its p, its children, their q and uniforms), not on
how the walk reached it: :func:`tree_rows_stochastic` decides every row at once — its accepted child, or the token it
emits — and the host follows the accepted children from the root (:func:`sampled_tree_walk`;
:func:`greedy_tree_walk` from every row's argmax). A batched step copies those rows with every other request's in
one transfer (:mod:`specserve.core.verify.staged`). Does not run models or touch caches.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch

from specserve.core.tree.draft_tree import ChildSampling, DraftTree
from specserve.core.tree.shapes import ROOT
from specserve.core.verify.chain import TokenKind


@dataclass(frozen=True)
class TreeVerdict:
    accepted: tuple[int, ...]  # node indices of the accepted path, from depth 0 down
    next_token: int  # the recovered or bonus token after the path
    next_kind: TokenKind  # RECOVERED (a node with children, all rejected) or BONUS (a leaf)

    @property
    def num_accepted(self) -> int:
        return len(self.accepted)


def verify_tree_greedy(target_logits: torch.Tensor, tree: DraftTree) -> TreeVerdict:
    """``target_logits``: [n + 1, vocab], row 0 after the root, row i + 1 after node i."""
    # torch.argmax picks the first maximum
    return greedy_tree_walk(target_logits.argmax(-1).tolist(), tree.tokens.tolist(), tree)


def greedy_tree_walk(argmax: Sequence[int], tokens: Sequence[int], tree: DraftTree) -> TreeVerdict:
    """The greedy tree rule on the host, from every row's argmax (row 0 after the root, row i + 1 after node i) and
    the nodes' tokens: what a batched step reads from its one copy."""
    if len(argmax) != tree.size + 1 or len(tokens) != tree.size:
        raise ValueError(f"{len(argmax)} argmaxes and {len(tokens)} tokens for a tree of {tree.size} nodes")
    path: list[int] = []
    node = ROOT
    while True:
        children = tree.children[node + 1]
        want = int(argmax[node + 1])
        match = next((c for c in children if tokens[c] == want), None)
        if match is None:
            return TreeVerdict(tuple(path), want, TokenKind.RECOVERED if children else TokenKind.BONUS)
        path.append(match)
        node = match


def _draw_randomness(tree: DraftTree, vocab: int, generator: torch.Generator) -> tuple[torch.Tensor, torch.Tensor]:
    device = generator.device
    uniforms = torch.rand(tree.size, generator=generator, device=device, dtype=torch.float64)
    noise = torch.empty(tree.size + 1, vocab, device=device, dtype=torch.float64)
    noise.exponential_(1.0, generator=generator)
    return uniforms, noise


def verify_tree(
    target_probs: torch.Tensor,  # [n + 1, vocab] warped target distributions per parent
    tree: DraftTree,
    generator: torch.Generator,
    sampling: ChildSampling | None = None,
) -> TreeVerdict:
    """Recursive rejection sampling down the tree (see the module docstring). ``sampling`` overrides how the
    children are taken to have been drawn (``tree.sampling``); tests use it to check a wrong rule fails."""
    chosen, next_by_row = tree_rows_stochastic(target_probs, tree, generator, sampling)
    host_chosen, host_next = torch.stack([chosen, next_by_row]).tolist()  # one sync
    return sampled_tree_walk(host_chosen, host_next, tree)


def tree_rows_stochastic(
    target_probs: torch.Tensor,  # [n + 1, vocab] warped target distributions per parent
    tree: DraftTree,
    generator: torch.Generator,
    sampling: ChildSampling | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:  # (accepted child of every row or -1 [n + 1], next token of every row [n + 1])
    """The sampled tree rule on the device, for every row at once: the child the walk takes from that row (-1 when
    it rejects them all) and the token it emits if it ends there (the final residual's draw, or p's at a leaf);
    :func:`sampled_tree_walk` follows them from the root on the host. What happens at a row depends only on the row,
    so every row is decided, reached or not, with the randomness :func:`verify_tree` has always drawn (one uniform
    per node, one exponential race per row, in that order): the loop runs over the i-th child of every row at once."""
    sampling = tree.sampling if sampling is None else sampling
    vocab = target_probs.shape[-1]
    uniforms, noise = _draw_randomness(tree, vocab, generator)
    device = target_probs.device
    residual = target_probs.to(torch.float64)  # [rows, vocab]: each row's residual after its rejected children
    rows = residual.shape[0]
    chosen = torch.full((rows,), -1, dtype=torch.long, device=device)
    width = max((len(children) for children in tree.children), default=0)
    if width:
        table = [[*children, *([-1] * (width - len(children)))] for children in tree.children]
        index = torch.tensor(table, dtype=torch.long).to(device)  # [rows, width]: each row's children, -1 padded
        tokens = tree.tokens.to(device=device, dtype=torch.long)
        child_probs = tree.child_probs.to(device=device, dtype=torch.float64) if tree.child_probs is not None else None
        taken = torch.zeros(rows, vocab, dtype=torch.bool, device=device)  # tokens of each row's rejected children
        walking = torch.ones(rows, dtype=torch.bool, device=device)  # no child accepted yet
        at = torch.arange(rows, device=device)
        for i in range(width):
            child = index[:, i]
            x = tokens[child.clamp_min(0)]
            point = torch.nn.functional.one_hot(x, vocab)
            q = _proposals(child_probs, taken, sampling, point)
            tried = walking & (child >= 0)
            accept = tried & (uniforms[child.clamp_min(0)] * q[at, x] < residual[at, x])
            chosen = torch.where(accept, child, chosen)
            rejected = tried & ~accept
            rest = (residual - q).clamp_min(0.0)
            total = rest.sum(dim=-1, keepdim=True)
            shrunk = torch.where(total > 0, rest / total, residual)  # empty only by rounding: p == q
            residual = torch.where(rejected[:, None], shrunk, residual)
            taken = taken | (rejected[:, None] & point.bool())
            walking = walking & ~accept
    return chosen, (residual / noise).argmax(dim=-1)


def sampled_tree_walk(chosen: Sequence[int], next_by_row: Sequence[int], tree: DraftTree) -> TreeVerdict:
    """Follow :func:`tree_rows_stochastic`'s accepted children from the root, on the host."""
    if len(chosen) != tree.size + 1 or len(next_by_row) != tree.size + 1:
        raise ValueError(f"{len(chosen)} and {len(next_by_row)} rows for a tree of {tree.size} nodes")
    path: list[int] = []
    node = ROOT
    while chosen[node + 1] >= 0:
        node = int(chosen[node + 1])
        path.append(node)
    kind = TokenKind.RECOVERED if tree.children[node + 1] else TokenKind.BONUS
    return TreeVerdict(tuple(path), int(next_by_row[node + 1]), kind)


def _proposals(
    child_probs: torch.Tensor | None, taken: torch.Tensor, sampling: ChildSampling, point: torch.Tensor
) -> torch.Tensor:
    """[rows, vocab] float64: the law each row's next child was drawn from, given the siblings drawn before it (the
    tokens ``taken``): its row of q, renormalised without them when drawn without replacement; a point mass on its
    own token (``point``) without q."""
    if child_probs is None:
        return point.to(torch.float64)
    if sampling != ChildSampling.WITHOUT_REPLACEMENT:
        return child_probs
    kept = child_probs.masked_fill(taken, 0.0)
    return torch.where(taken.any(dim=-1, keepdim=True), kept / kept.sum(dim=-1, keepdim=True), child_probs)


# ---------------------------------------------------------------------------------------------
# Slow reference, for tests: the same rule as nested loops over Python floats.


def reference_verify_tree(
    target_probs: torch.Tensor,
    tree: DraftTree,
    generator: torch.Generator,
    sampling: ChildSampling | None = None,
) -> TreeVerdict:
    sampling = tree.sampling if sampling is None else sampling
    vocab = target_probs.shape[-1]
    uniform_t, noise_t = _draw_randomness(tree, vocab, generator)
    uniforms, noise = uniform_t.tolist(), noise_t.tolist()
    p_rows = target_probs.double().tolist()
    q_rows = tree.child_probs.double().tolist() if tree.child_probs is not None else None
    tokens = tree.tokens.tolist()
    accepted: list[int] = []
    node = ROOT
    while True:
        r = list(p_rows[node + 1])
        children = [c for c in range(tree.size) if tree.parents[c] == node]
        drawn: list[int] = []
        next_node = None
        for c in children:
            x = tokens[c]
            if q_rows is None:
                q = [1.0 if v == x else 0.0 for v in range(vocab)]
            elif sampling == ChildSampling.IID or not drawn:
                q = list(q_rows[node + 1])
            else:
                kept = [0.0 if v in drawn else q_rows[node + 1][v] for v in range(vocab)]
                q = [w / sum(kept) for w in kept]
            if uniforms[c] * q[x] < r[x]:  # accept with probability min(1, r(x) / q(x))
                next_node = c
                break
            rest = [max(0.0, a - b) for a, b in zip(r, q, strict=True)]
            if sum(rest) > 0:
                r = [w / sum(rest) for w in rest]
            drawn.append(x)
        if next_node is None:
            scores = [r[v] / noise[node + 1][v] for v in range(vocab)]  # exponential race: v with prob r(v)
            token = max(range(vocab), key=lambda v: scores[v])
            kind = TokenKind.RECOVERED if children else TokenKind.BONUS
            return TreeVerdict(tuple(accepted), token, kind)
        accepted.append(next_node)
        node = next_node
