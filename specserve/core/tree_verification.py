"""Exact verification of a draft tree: pure functions over the target's per-node distributions.

The target's verify pass gives one distribution per *parent* (row 0 for the root, row ``i + 1``
for node ``i``; see :meth:`~specserve.core.model.CausalLM.forward_tree`). The verifier walks from
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
:func:`verify_tree` exactly on the same generator state. Does not run models or touch caches.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from specserve.core.tree import ROOT, ChildSampling, DraftTree
from specserve.core.verification import TokenKind


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
    argmax = target_logits.argmax(-1).tolist()  # torch.argmax picks the first maximum
    tokens = tree.tokens.tolist()
    path: list[int] = []
    node = ROOT
    while True:
        children = tree.children[node + 1]
        want = argmax[node + 1]
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
    sampling = tree.sampling if sampling is None else sampling
    vocab = target_probs.shape[-1]
    uniforms, noise = _draw_randomness(tree, vocab, generator)
    probs = target_probs.to(torch.float64)
    child_probs = tree.child_probs.to(torch.float64) if tree.child_probs is not None else None
    tokens = tree.tokens.tolist()
    path: list[int] = []
    node = ROOT
    while True:
        row = node + 1
        residual = probs[row]
        children = tree.children[row]
        taken = torch.zeros(vocab, dtype=torch.bool, device=probs.device)
        chosen = None
        for child in children:
            x = tokens[child]
            proposal = _proposal(child_probs, row, x, taken, sampling, vocab, probs.device)
            if float(uniforms[child]) * float(proposal[x]) < float(residual[x]):
                chosen = child
                break
            rest = (residual - proposal).clamp_min(0.0)
            total = rest.sum()
            residual = rest / total if float(total) > 0 else residual  # empty only by rounding: p == q
            taken[x] = True
        if chosen is None:
            token = int((residual / noise[row]).argmax())
            return TreeVerdict(tuple(path), token, TokenKind.RECOVERED if children else TokenKind.BONUS)
        path.append(chosen)
        node = chosen


def _proposal(
    child_probs: torch.Tensor | None,
    row: int,
    x: int,
    taken: torch.Tensor,
    sampling: ChildSampling,
    vocab: int,
    device: torch.device,
) -> torch.Tensor:
    """The law the child with token ``x`` was drawn from, given the siblings drawn before it."""
    if child_probs is None:
        one_hot = torch.zeros(vocab, dtype=torch.float64, device=device)
        one_hot[x] = 1.0
        return one_hot
    q = child_probs[row]
    if sampling == ChildSampling.WITHOUT_REPLACEMENT and bool(taken.any()):
        q = q.masked_fill(taken, 0.0)
        q = q / q.sum()
    return q


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
