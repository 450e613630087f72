"""Medusa's typical acceptance — a LOSSY verification rule, NOT exact: pure functions, no model.

**This rule does not keep the output distributed as the target's.** Every other rule in specserve
does (docs/verification.md, rules A-E); this one is listed there under "What is not exact" and runs only when
a request asks for it explicitly (``SamplingParams(acceptance="typical", lossy=True)``), and
whatever it produces is labelled ``lossy``.

The rule (Cai et al. 2024, "Medusa: Simple LLM Inference Acceleration Framework with Multiple
Decoding Heads", typical acceptance): with p the target's warped distribution (temperature, top-k,
top-p) at a node's parent and H(p) = -sum_v p(v) log p(v) its entropy, the node's draft token x is
*acceptable* when

    p(x) > min(epsilon, delta * exp(-H(p)))

— a token the target finds typical enough, whatever the drafter's q (q is never read). A node is
accepted when it is acceptable and its parent is accepted (the root always is); the verdict is the
longest accepted root path (ties: the lowest node index; Medusa's code breaks ties by path
likelihood instead). The token after the path is drawn from p at the path's end with the request's
generator — or, with no generator (greedy), is p's argmax, lowest id on ties. The defaults
epsilon = 0.09 and delta = 0.3 = sqrt(epsilon) are those of Medusa's code (``posterior_threshold``
and ``posterior_alpha``).

Why it is lossy: a token with p(x) above the threshold is accepted with probability 1 whenever
drafted, so tokens the drafter over-proposes (q(x) > p(x)) come out more often than p says, and
the next token is drawn from p rather than from a residual that would correct for that.

At temperature 0 p is a point mass on the argmax: H = 0, the threshold is min(epsilon, delta) < 1,
so exactly the argmax token is acceptable and the rule *is* greedy verification
(:func:`~specserve.core.verify.tree.verify_tree_greedy`).

Verdicts reuse :class:`~specserve.core.verify.tree.TreeVerdict` (a chain is the tree with
parents -1, 0, 1, ...; :func:`verify_chain_typical` returns a
:class:`~specserve.core.verify.chain.ChainVerdict`). Does not run models or touch caches.
"""

from __future__ import annotations

import torch

from specserve.core.sampling.params import TYPICAL_DELTA, TYPICAL_EPSILON
from specserve.core.sampling.warps import sample
from specserve.core.tree.draft_tree import DraftTree
from specserve.core.tree.shapes import ROOT
from specserve.core.verify.chain import ChainVerdict, TokenKind
from specserve.core.verify.tree import TreeVerdict


def typical_thresholds(
    target_probs: torch.Tensor,  # [rows, vocab] warped target distributions
    epsilon: float = TYPICAL_EPSILON,
    delta: float = TYPICAL_DELTA,
) -> torch.Tensor:  # [rows] float64: min(epsilon, delta * exp(-H(p))) per row
    probs = target_probs.double()
    entropy = torch.special.entr(probs).sum(-1)  # entr(0) = 0: zero-probability tokens add nothing
    return (delta * torch.exp(-entropy)).clamp_max(epsilon)


def typical_acceptable(
    target_probs: torch.Tensor,  # [n + 1, vocab]: row 0 after the root, row i + 1 after node i
    tree: DraftTree,
    epsilon: float = TYPICAL_EPSILON,
    delta: float = TYPICAL_DELTA,
) -> torch.Tensor:  # [n] bool: node i's token passes the threshold at its parent (ancestors not considered)
    probs = target_probs.double()
    rows = torch.tensor([parent + 1 for parent in tree.parents], dtype=torch.long, device=probs.device)
    at_token = probs[rows, tree.tokens.to(probs.device)]
    return at_token > typical_thresholds(probs, epsilon, delta)[rows]


def verify_tree_typical(
    target_probs: torch.Tensor,  # [n + 1, vocab] warped target distributions per parent
    tree: DraftTree,
    generator: torch.Generator | None,  # None = greedy: the next token is the argmax
    epsilon: float = TYPICAL_EPSILON,
    delta: float = TYPICAL_DELTA,
) -> TreeVerdict:
    """Typical acceptance over a draft tree (LOSSY; see the module docstring). ``tree.child_probs`` is ignored."""
    passes = typical_acceptable(target_probs, tree, epsilon, delta).tolist()  # one host sync
    accepted = [False] * tree.size
    end, end_depth = ROOT, 0  # the deepest accepted node so far (ties: the first, i.e. the lowest index)
    for node, parent in enumerate(tree.parents):  # topological order: a parent is decided before its children
        accepted[node] = passes[node] and (parent == ROOT or accepted[parent])
        if accepted[node] and tree.depths[node] + 1 > end_depth:
            end, end_depth = node, tree.depths[node] + 1
    row = end + 1
    # Greedy: torch.argmax picks the first maximum (lowest id). Otherwise one draw from p at the path's end.
    token = int(target_probs[row].argmax() if generator is None else sample(target_probs[row].double(), generator))
    path = tree.paths[end] if end != ROOT else ()
    # The path's end has no accepted child (a longer path would exist): RECOVERED if it has children, else BONUS.
    return TreeVerdict(path, token, TokenKind.RECOVERED if tree.children[row] else TokenKind.BONUS)


def verify_chain_typical(
    target_probs: torch.Tensor,  # [gamma + 1, vocab] warped target distributions
    draft_tokens: torch.Tensor,  # [gamma] int64
    generator: torch.Generator | None,  # None = greedy
    epsilon: float = TYPICAL_EPSILON,
    delta: float = TYPICAL_DELTA,
) -> ChainVerdict:
    """Typical acceptance over a chain (LOSSY): the tree rule on the chain's tree, as a chain verdict."""
    verdict = verify_tree_typical(target_probs, DraftTree.chain(draft_tokens), generator, epsilon, delta)
    return ChainVerdict(verdict.num_accepted, verdict.next_token, verdict.next_kind)
