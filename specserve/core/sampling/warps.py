"""The warps that turn logits into the target's sampling distribution, and draws.

The parameters themselves (:class:`SamplingParams`, checked without torch) live in
:mod:`specserve.core.sampling.params` and are re-exported here.

Warps follow the order transformers applies them: temperature, then top-k, then top-p, then min-p
(drop every token less likely than ``min_p`` times the most likely one). The logit processors that
need the text so far (penalties, logit bias) run before them, in :mod:`specserve.core.verify.processors`.
Temperature 0 means greedy: the distribution is a point mass on the argmax (lowest id on ties),
so every verification rule degenerates to "accept while the draft equals the argmax".

Randomness is always an argument: each request owns ``torch.Generator`` objects made by
:func:`make_generators`; nothing here touches the global RNG.

``SamplingParams.drafter_invariant`` selects the drafter-invariant mode of
:mod:`specserve.core.verify.invariant` (rule E of docs/verification.md): every token is
argmax(log p + Gumbel noise keyed by (seed, position)), so the output depends on the seed and the target only, never on
the drafter, gamma, tree or tensor-parallel layout. It has no effect at temperature 0.

``SamplingParams.acceptance = "typical"`` selects Medusa's typical acceptance
(:mod:`specserve.core.verify.typical`), which is NOT exact: the output is no longer distributed as the
target's. It runs only with ``lossy=True`` as well, and everything it produces says ``lossy``.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from specserve.core.sampling.params import (
    SamplingParams,
)

__all__ = ["RequestGenerators", "make_generators", "sample", "warp_probs"]


@dataclass
class RequestGenerators:
    """Independent per-request random streams: one for the verifier, one for the drafter."""

    verify: torch.Generator
    draft: torch.Generator


def make_generators(seed: int, device: torch.device | str = "cpu") -> RequestGenerators:
    verify = torch.Generator(device=device).manual_seed(seed)
    # A distinct stream for the drafter, derived deterministically from the request seed.
    draft = torch.Generator(device=device).manual_seed((seed * 0x9E3779B97F4A7C15 + 1) % 2**63)
    return RequestGenerators(verify=verify, draft=draft)


def warp_probs(
    logits: torch.Tensor,  # [..., vocab]
    params: SamplingParams,
) -> torch.Tensor:  # [..., vocab], float32 or float64, rows sum to 1
    """The distribution a token is sampled from after temperature, top-k, top-p and min-p."""
    logits = logits.float() if logits.dtype in (torch.float16, torch.bfloat16) else logits
    if params.greedy:
        return torch.nn.functional.one_hot(logits.argmax(-1), logits.shape[-1]).to(logits.dtype)
    logits = logits / params.temperature
    vocab = logits.shape[-1]
    if 0 < params.top_k < vocab:
        kth = torch.topk(logits, params.top_k, dim=-1).values[..., -1:]
        logits = logits.masked_fill(logits < kth, float("-inf"))
    if params.top_p < 1.0:
        sorted_logits, order = torch.sort(logits, dim=-1, descending=False)
        cumulative = sorted_logits.softmax(-1).cumsum(-1)
        # Drop the low tail whose mass is <= 1 - top_p; always keep the most likely token.
        drop_sorted = cumulative <= (1.0 - params.top_p)
        drop_sorted[..., -1] = False
        drop = drop_sorted.scatter(-1, order, drop_sorted)
        logits = logits.masked_fill(drop, float("-inf"))
    probs = logits.softmax(-1)
    if params.min_p > 0.0:
        probs = probs.masked_fill(probs < params.min_p * probs.amax(-1, keepdim=True), 0.0)
        probs = probs / probs.sum(-1, keepdim=True)
    return probs


def sample(
    probs: torch.Tensor,  # [..., vocab], rows sum to 1 (unnormalised non-negative weights also work)
    generator: torch.Generator,
) -> torch.Tensor:  # [...] int64
    """One categorical draw per row without a host sync (exponential-race / Gumbel-max trick).

    argmax(w / E) with E ~ Exp(1) i.i.d. picks index i with probability w_i / sum(w).
    Zero-weight entries can never win.
    """
    noise = torch.empty_like(probs).exponential_(1.0, generator=generator)
    return (probs / noise).argmax(-1)
