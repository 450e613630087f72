"""Sampling parameters, the warps that turn logits into the target's sampling distribution, and draws.

Warps follow the order transformers applies them: temperature, then top-k, then top-p.
Temperature 0 means greedy: the distribution is a point mass on the argmax (lowest id on ties),
so every verification rule degenerates to "accept while the draft equals the argmax".

Randomness is always an argument: each request owns ``torch.Generator`` objects made by
:func:`make_generators`; nothing here touches the global RNG.

``SamplingParams.drafter_invariant`` selects the drafter-invariant mode of
:mod:`specserve.core.invariant` (VERIFICATION.md, rule E): every token is argmax(log p + Gumbel
noise keyed by (seed, position)), so the output depends on the seed and the target only, never on
the drafter, gamma, tree or tensor-parallel layout. It has no effect at temperature 0.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from specserve.core.errors import UserError

MAX_TOP_K = 1 << 20


class InvalidSamplingParams(UserError):
    """A sampling parameter is out of range; the message says which and what is allowed."""


@dataclass(frozen=True)
class SamplingParams:
    temperature: float = 0.0
    top_k: int = 0  # 0 = no top-k truncation
    top_p: float = 1.0  # 1 = no nucleus truncation
    seed: int = 0
    # Drafter-invariant sampling (specserve.core.invariant): tokens are argmax(log p + Gumbel noise keyed
    # by (seed, absolute position)); same seed -> same output whatever the drafter, gamma, tree or TP
    # degree. Exact, but accepts fewer drafts than rejection sampling. No effect when greedy.
    drafter_invariant: bool = False

    def __post_init__(self) -> None:
        if not (self.temperature >= 0.0) or self.temperature == float("inf"):
            raise InvalidSamplingParams(f"temperature must be a finite number >= 0, got {self.temperature}")
        if not (0.0 < self.top_p <= 1.0):
            raise InvalidSamplingParams(f"top_p must be in (0, 1], got {self.top_p}")
        if self.top_k < 0 or self.top_k > MAX_TOP_K:
            raise InvalidSamplingParams(f"top_k must be between 0 (off) and {MAX_TOP_K}, got {self.top_k}")
        if not (0 <= self.seed < 2**63):
            raise InvalidSamplingParams(f"seed must be in [0, 2**63), got {self.seed}")
        if not isinstance(self.drafter_invariant, bool):
            raise InvalidSamplingParams(f"drafter_invariant must be true or false, got {self.drafter_invariant!r}")

    @property
    def greedy(self) -> bool:
        return self.temperature == 0.0

    @property
    def invariant_sampling(self) -> bool:
        """Tokens come from the keyed Gumbel noise of :mod:`specserve.core.invariant` (asked for and not greedy)."""
        return self.drafter_invariant and not self.greedy


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
    """The distribution a token is sampled from after temperature, top-k and top-p."""
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
    return logits.softmax(-1)


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
