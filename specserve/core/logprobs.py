"""Log-probabilities of emitted tokens, taken from the verify forward that decided them.

A request that asks for ``logprobs`` (:attr:`~specserve.core.sampling.SamplingParams.logprobs`: how many
alternatives) gets, for every emitted token, its log-probability and the most likely alternatives at its position
(:class:`TokenLogprob`). They come from the rows of the cycle's verify forward that the committed tokens followed
(a chain's rows ``0 .. accepted``, a tree's root row and accepted nodes' rows): no extra target pass, and the same
numbers whichever drafter, γ or tree ran, since each row is the target's own distribution after the committed text.

Two distributions can be asked for (``logprobs_mode``), as in vLLM:

* ``raw`` (the default): the model's own, ``log_softmax(logits)``, before any processor or warp;
* ``processed``: the one the token was chosen from — after logit bias and penalties
  (:mod:`specserve.core.processors`) and, when sampling, temperature, top-k, top-p and min-p
  (:func:`~specserve.core.sampling.warp_probs`). Greedy decoding has no warp: its processed distribution is
  ``log_softmax`` of the processed logits. Tokens a warp removed have probability 0 and are never listed as
  alternatives.

Pure tensor work; one host transfer per cycle.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass

import torch

from specserve.core.sampling import SamplingParams, warp_probs


@dataclass(frozen=True)
class TokenLogprob:
    """One emitted token's log-probability and its position's ``top`` alternatives (most likely first)."""

    token: int
    logprob: float
    top: tuple[tuple[int, float], ...] = ()


def position_log_probs(raw: torch.Tensor, processed: torch.Tensor, params: SamplingParams) -> torch.Tensor:
    """[rows, vocab] log-probabilities under the distribution ``params.logprobs_mode`` names (module docstring);
    ``raw`` and ``processed`` are the same rows' logits before and after the logit processors."""
    if params.logprobs_mode == "raw":
        return torch.log_softmax(_at_least_float32(raw), dim=-1)
    if params.greedy:
        return torch.log_softmax(_at_least_float32(processed), dim=-1)
    return torch.log(warp_probs(processed, params))


def token_logprobs(
    raw: torch.Tensor,  # [k, vocab]: the rows the k tokens were chosen at
    processed: torch.Tensor,  # [k, vocab]: the same rows after the logit processors
    tokens: Sequence[int],  # [k]
    params: SamplingParams,
) -> tuple[TokenLogprob, ...]:
    """Each token's log-probability and its row's ``params.logprobs`` most likely alternatives."""
    if not tokens:
        return ()
    log_probs = position_log_probs(raw, processed, params)
    ids = torch.tensor(list(tokens), dtype=torch.long, device=log_probs.device)
    chosen = log_probs.gather(-1, ids[:, None])[:, 0].tolist()
    k = min(params.logprobs or 0, log_probs.shape[-1])
    if k:
        top_values, top_ids = log_probs.topk(k, dim=-1)
        values, alternatives = top_values.tolist(), top_ids.tolist()
    else:
        values, alternatives = [[] for _ in tokens], [[] for _ in tokens]
    return tuple(
        TokenLogprob(
            int(token),
            float(logprob),
            tuple((int(t), float(v)) for t, v in zip(row_ids, row_values, strict=True) if v > -math.inf),
        )
        for token, logprob, row_ids, row_values in zip(tokens, chosen, alternatives, values, strict=True)
    )


def _at_least_float32(logits: torch.Tensor) -> torch.Tensor:
    return logits.float() if logits.dtype in (torch.float16, torch.bfloat16) else logits
