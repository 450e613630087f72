"""Sampling parameters, the warps that turn logits into the target's sampling distribution, and draws.

Warps follow the order transformers applies them: temperature, then top-k, then top-p.
Temperature 0 means greedy: the distribution is a point mass on the argmax (lowest id on ties),
so every verification rule degenerates to "accept while the draft equals the argmax".

Randomness is always an argument: each request owns ``torch.Generator`` objects made by
:func:`make_generators`; nothing here touches the global RNG.

``SamplingParams.drafter_invariant`` selects the drafter-invariant mode of
:mod:`specserve.core.invariant` (rule E of docs/verification.md): every token is
argmax(log p + Gumbel noise keyed by (seed, position)), so the output depends on the seed and the target only, never on
the drafter, gamma, tree or tensor-parallel layout. It has no effect at temperature 0.

``SamplingParams.acceptance = "typical"`` selects Medusa's typical acceptance
(:mod:`specserve.core.typical`), which is NOT exact: the output is no longer distributed as the
target's. It runs only with ``lossy=True`` as well, and everything it produces says ``lossy``.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

import torch

from specserve.core.errors import UserError

MAX_TOP_K = 1 << 20
Acceptance = Literal["exact", "typical"]
ACCEPTANCE_MODES: tuple[Acceptance, ...] = ("exact", "typical")
# Medusa's defaults (Cai et al. 2024; its code's posterior_threshold and posterior_alpha = sqrt(threshold)).
TYPICAL_EPSILON = 0.09
TYPICAL_DELTA = 0.3


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
    # How drafts are accepted: "exact" (the rules of docs/verification.md) or "typical" (Medusa's typical acceptance,
    # specserve.core.typical: LOSSY, the output is no longer distributed as the target's). "typical" runs only
    # with lossy=True, the explicit opt-in; epsilon and delta are its threshold min(epsilon, delta * exp(-H(p))).
    acceptance: Acceptance = "exact"
    lossy: bool = False
    typical_epsilon: float = TYPICAL_EPSILON
    typical_delta: float = TYPICAL_DELTA

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
        self._check_acceptance()

    def _check_acceptance(self) -> None:
        if self.acceptance not in ACCEPTANCE_MODES:
            raise InvalidSamplingParams(f"acceptance must be 'exact' or 'typical', got {self.acceptance!r}")
        if not isinstance(self.lossy, bool):
            raise InvalidSamplingParams(f"lossy must be true or false, got {self.lossy!r}")
        if not (0.0 < self.typical_epsilon < 1.0):
            raise InvalidSamplingParams(f"typical_epsilon must be in (0, 1), got {self.typical_epsilon}")
        if not (0.0 < self.typical_delta <= 1.0):
            raise InvalidSamplingParams(f"typical_delta must be in (0, 1], got {self.typical_delta}")
        if self.acceptance == "typical" and not self.lossy:
            raise InvalidSamplingParams(
                "typical acceptance is lossy: the output is no longer distributed as the target's; "
                "opt in explicitly with lossy=True (CLI --lossy, HTTP speculation.lossy: true)"
            )
        if self.acceptance == "typical" and self.drafter_invariant:
            raise InvalidSamplingParams(
                "typical acceptance cannot be combined with drafter_invariant (which is exact); choose one"
            )

    @property
    def greedy(self) -> bool:
        return self.temperature == 0.0

    @property
    def invariant_sampling(self) -> bool:
        """Tokens come from the keyed Gumbel noise of :mod:`specserve.core.invariant` (asked for and not greedy)."""
        return self.drafter_invariant and not self.greedy

    @property
    def lossy_acceptance(self) -> bool:
        """A lossy acceptance rule runs (typical): every output made with these parameters must say ``lossy``."""
        return self.acceptance != "exact"

    @property
    def mode(self) -> str:
        """How the target's tokens are chosen, as outputs report it: ``greedy`` (temperature 0),
        ``drafter_invariant`` (keyed Gumbel noise, :mod:`specserve.core.invariant`), ``typical`` (lossy typical
        acceptance, :mod:`specserve.core.typical`) or ``rejection`` (speculative rejection sampling)."""
        if self.greedy:
            return "greedy"
        if self.lossy_acceptance:
            return "typical"
        return "drafter_invariant" if self.invariant_sampling else "rejection"


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
