"""Log-probabilities of emitted tokens, taken from the verify forward that decided them.

A request that asks for ``logprobs`` (:attr:`~specserve.core.sampling.warps.SamplingParams.logprobs`: how many
alternatives) gets, for every emitted token, its log-probability and the most likely alternatives at its position
(:class:`TokenLogprob`). They come from the rows of the cycle's verify forward that the committed tokens followed
(a chain's rows ``0 .. accepted``, a tree's root row and accepted nodes' rows): no extra target pass, and the same
numbers whichever drafter, γ or tree ran, since each row is the target's own distribution after the committed text.

Two distributions can be asked for (``logprobs_mode``), as in vLLM:

* ``raw`` (the default): the model's own, ``log_softmax(logits)``, before any processor or warp;
* ``processed``: the one the token was chosen from — after logit bias and penalties
  (:mod:`specserve.core.verify.processors`) and, when sampling, temperature, top-k, top-p and min-p
  (:func:`~specserve.core.sampling.warps.warp_probs`). Greedy decoding has no warp: its processed distribution is
  ``log_softmax`` of the processed logits. Tokens a warp removed have probability 0 and are never listed as
  alternatives.

Pure tensor work: :func:`logprob_tensors` on the device, :func:`read_logprobs` on the host once the cycle's
one copy (:mod:`specserve.core.verify.staged`) brought them over.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import torch

from specserve.core.sampling.params import SamplingParams
from specserve.core.sampling.warps import warp_probs


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


def logprob_tensors(
    raw: torch.Tensor,  # [rows, vocab]: a verify block's rows, before the logit processors
    processed: torch.Tensor,  # [rows, vocab]: the same rows after them
    node_rows: torch.Tensor,  # [n] int64: the row each proposal node was drawn after (its parent's)
    node_tokens: torch.Tensor,  # [n] int64: each node's token
    next_by_row: torch.Tensor,  # [rows] int64: the token each row emits when the walk ends there
    params: SamplingParams,
) -> dict[str, torch.Tensor]:
    """On the device, what any outcome of the cycle may need: every node's log-probability at its parent's row
    (``node``), every row's next token's (``next``), and every row's ``params.logprobs`` alternatives (``top_values``,
    ``top_ids``); :func:`read_logprobs` picks the committed tokens' from them on the host."""
    log_probs = position_log_probs(raw, processed, params)
    k = min(params.logprobs or 0, log_probs.shape[-1])
    top_values, top_ids = log_probs.topk(k, dim=-1)
    return {
        "node": log_probs[node_rows, node_tokens],
        "next": log_probs.gather(-1, next_by_row[:, None])[:, 0],
        "top_values": top_values,
        "top_ids": top_ids,
    }


def read_logprobs(
    host: dict[str, list[Any]],  # :func:`logprob_tensors`'s, on the host
    tokens: Sequence[int],  # the committed tokens, in order
    nodes: Sequence[int],  # the accepted path's nodes: tokens[j] is node nodes[j] for j < len(nodes), then the next
    rows: Sequence[int],  # the row each committed token was chosen at
) -> tuple[TokenLogprob, ...]:
    """Each committed token's log-probability and its row's alternatives (alternatives of probability 0 left out)."""
    out = []
    for j, token in enumerate(tokens):
        logprob = host["node"][nodes[j]] if j < len(nodes) else host["next"][rows[j]]
        top = zip(host["top_ids"][rows[j]], host["top_values"][rows[j]], strict=True)
        out.append(TokenLogprob(int(token), float(logprob), tuple((int(t), float(v)) for t, v in top if v > -math.inf)))
    return tuple(out)


def _at_least_float32(logits: torch.Tensor) -> torch.Tensor:
    return logits.float() if logits.dtype in (torch.float16, torch.bfloat16) else logits
