"""Logit processors that read the text so far: logit bias, repetition, frequency and presence penalties.

The target's verifier (:class:`~specserve.core.target.TargetVerifier`) processes every verified row of a cycle
with *its own* history: the committed text plus the draft tokens on the path from the root to that row (a chain's
row ``j`` follows ``draft[:j]``; a tree's row ``i + 1`` follows node ``i``'s root path). A row's processed logits
are then exactly what plain decoding computes at that position if the path is accepted, so every rule of
docs/verification.md — chains and trees, greedy, rejection sampling, drafter-invariant — decides on the target's
processed distribution, and the output is distributed as plain decoding with the same processors. Drafts are not
processed: a drafter may propose from any law it reports (its q), and the rules stay exact.

What each does, in this order (vLLM's order; the penalties are OpenAI's and transformers'):

1. ``logit_bias``: ``l[v] += bias[v]``;
2. ``repetition_penalty`` r, over the prompt and the output (transformers' ``RepetitionPenaltyLogitsProcessor``):
   every token seen so far gets ``l[v] / r`` when ``l[v] > 0`` and ``l[v] * r`` otherwise;
3. ``frequency_penalty`` f and ``presence_penalty`` a, over the output only (OpenAI):
   ``l[v] -= f * count(v) + a * [count(v) > 0]``.

The warps that follow (temperature, top-k, top-p, min-p) are :func:`specserve.core.sampling.warps.warp_probs`; greedy
decoding takes the argmax of the processed logits. A resumed request (:mod:`specserve.core.resume`) counts the
last ``prior_output_tokens`` of its prompt as output, as it did before it moved. Does not sample or verify.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from specserve.core.errors import InvalidRequest
from specserve.core.sampling.params import SamplingParams
from specserve.core.tree.shapes import ROOT


def check_logit_bias(params: SamplingParams, vocab: int) -> None:
    """Raises :class:`InvalidRequest` when ``logit_bias`` names a token outside the vocabulary."""
    outside = [token for token, _ in params.logit_bias if token >= vocab]
    if outside:
        raise InvalidRequest(f"logit_bias names token ids outside the vocabulary [0, {vocab}): {outside[:8]}")


def path_counts(tokens: torch.Tensor, parents: Sequence[int], vocab: int, dtype: torch.dtype) -> torch.Tensor:
    """[n + 1, vocab]: row 0 zeros, row ``i + 1`` how often each token occurs on node ``i``'s root path (node ``i``
    included) of the proposal ``tokens`` / ``parents``."""
    n = len(parents)
    on_path = torch.zeros(n + 1, n, dtype=dtype, device=tokens.device)
    for node, parent in enumerate(parents):
        if parent != ROOT:
            on_path[node + 1] = on_path[parent + 1]
        on_path[node + 1, node] = 1.0
    one_hot = torch.nn.functional.one_hot(tokens.long(), vocab).to(dtype)
    return on_path @ one_hot


class PenaltyState:
    """One request's processors and the counts they need: which tokens the text holds, how often each was output.

    :meth:`apply` processes a cycle's rows; :meth:`commit` adds the tokens the cycle committed."""

    def __init__(
        self, params: SamplingParams, prompt_ids: Sequence[int], vocab: int, device: torch.device | str = "cpu"
    ) -> None:
        check_logit_bias(params, vocab)
        self.params = params
        self.vocab = vocab
        self.device = torch.device(device)
        self.seen = torch.zeros(vocab, dtype=torch.bool, device=self.device)  # in the prompt or the output
        self.counts = torch.zeros(vocab, dtype=torch.float64, device=self.device)  # in the output
        self.bias = torch.zeros(vocab, dtype=torch.float64, device=self.device)
        for token, bias in params.logit_bias:
            self.bias[token] = bias
        prompt = list(prompt_ids)
        prior = min(params.prior_output_tokens, len(prompt))
        self.seen[torch.tensor(prompt, dtype=torch.long, device=self.device)] = True
        self.commit(prompt[len(prompt) - prior :])

    def commit(self, tokens: Sequence[int]) -> None:
        """Count ``tokens`` as output."""
        if not tokens:
            return
        ids = torch.tensor(list(tokens), dtype=torch.long, device=self.device)
        self.seen[ids] = True
        self.counts.index_add_(0, ids, torch.ones(len(ids), dtype=self.counts.dtype, device=self.device))

    def apply(
        self,
        logits: torch.Tensor,  # [n + 1, vocab]: row 0 after the committed text, row i + 1 after node i
        tokens: torch.Tensor,  # [n] the proposal's tokens
        parents: Sequence[int],  # [n] their parents (ROOT or an earlier node)
    ) -> torch.Tensor:  # [n + 1, vocab] in logits' dtype (float32 at least)
        """Every row processed with its own history: the committed text and the tokens on its root path."""
        params = self.params
        dtype = torch.float32 if logits.dtype in (torch.float16, torch.bfloat16) else logits.dtype
        out = logits.to(dtype)
        if params.logit_bias:
            out = out + self.bias.to(dtype)
        if params.repetition_penalty == 1.0 and not (params.presence_penalty or params.frequency_penalty):
            return out
        counts = self.counts.to(dtype) + path_counts(tokens.to(self.device), parents, self.vocab, dtype)
        if params.repetition_penalty != 1.0:
            penalty = params.repetition_penalty
            seen = self.seen | (counts > 0)
            out = torch.where(seen, torch.where(out > 0, out / penalty, out * penalty), out)
        if params.frequency_penalty:
            out = out - params.frequency_penalty * counts
        if params.presence_penalty:
            out = out - params.presence_penalty * (counts > 0).to(dtype)
        return out
