"""Drafter-invariant sampling: Gumbel noise keyed by (request seed, absolute position).

Rule E of docs/verification.md (#rule-e-gumbel-coupling-drafter-invariant; Daliri, Musco, Suresh
2024, "Coupling without communication and drafter-invariant speculative decoding"). With
``SamplingParams.drafter_invariant`` the token at absolute position t (its index in prompt + output) is

    y_t = argmax_x  log p_t(x) + G_t(x),     G_t(x) i.i.d. standard Gumbel,

where p_t is the target's warped distribution (temperature, top-k, top-p: ``warp_probs``).

* **Exact.** By the Gumbel-max trick y_t is a sample from p_t; tokens with p_t = 0 score -inf
  and never win. Because G_t is drawn afresh per position, tokens at different positions get
  independent noise, so a whole sequence is a sample from the target's sequence law.
* **Drafter-invariant.** G_t depends on (seed, t) only, so for a given seed the output is a
  function of the target alone: the same whatever the drafter, gamma, draft tree or
  tensor-parallel degree, and equal to plain decoding (the ``none`` drafter). Verification is
  greedy verification on the scores log p + G: accept drafts while they equal y_t, then emit y_t.
  (Bit-identical outputs also need the target's own logits to agree across those layouts; they
  do up to floating-point rounding, which in float64 essentially never flips an argmax.)
* **Trade-off.** A drafter that ignores the noise is accepted with probability sum_x p(x) q(x),
  below the 1 - TV(p, q) of rejection sampling. A drafter that couples to the same noise —
  proposing argmax(log q + G_t) — is accepted with probability >= (1 - TV) / (1 + TV), still
  below 1 - TV: the mode trades acceptance for reproducibility. Each verified (or drafted)
  position costs one vocabulary-sized noise draw on the host.

The noise is generated on the CPU by a ``torch.Generator`` seeded with
:func:`noise_key(seed, position) <noise_key>` (a splitmix64 hash, see there) and only then moved
to the caller's device, so it is bit-identical on any device, in any process, and independent
of any request generator (which this mode never consumes). Pure functions; no model, no state.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from specserve.core.sampling.params import SamplingParams
from specserve.core.sampling.warps import warp_probs

_MASK64 = (1 << 64) - 1


def _splitmix64(x: int) -> int:
    """One step of splitmix64 (Steele, Lea, Flood 2014): a bijection on 64-bit integers with full avalanche."""
    x = (x + 0x9E3779B97F4A7C15) & _MASK64
    x = ((x ^ (x >> 30)) * 0xBF58476D1CE4E5B9) & _MASK64
    x = ((x ^ (x >> 27)) * 0x94D049BB133111EB) & _MASK64
    return x ^ (x >> 31)


def noise_key(seed: int, position: int) -> int:
    """The generator seed of position ``position``'s noise: splitmix64(splitmix64(seed) xor position), top 63 bits.

    The inner hash spreads the request seed over 64 bits, so neighbouring seeds do not give
    overlapping keys for neighbouring positions; for one seed, distinct positions give distinct
    keys (splitmix64 is a bijection before the final shift drops one bit, so at most pairs collide).
    The keys are unrelated to ``manual_seed(seed)``, which seeds the request's own generators.
    """
    if seed < 0 or position < 0:
        raise ValueError(f"seed and position must be >= 0, got seed={seed}, position={position}")
    return _splitmix64(_splitmix64(seed & _MASK64) ^ (position & _MASK64)) >> 1


def _gumbel_row(seed: int, position: int, vocab: int) -> torch.Tensor:  # [vocab] float64, on the CPU
    generator = torch.Generator(device="cpu").manual_seed(noise_key(seed, position))
    uniforms = torch.rand(vocab, generator=generator, dtype=torch.float64)
    # u = 0 has probability 2**-53; clamping keeps every score finite (it only lowers that token's noise).
    return -torch.log(-torch.log(uniforms.clamp_min(torch.finfo(torch.float64).tiny)))


def gumbel_noise(
    seed: int,
    positions: Sequence[int],  # [k] absolute positions (indices into prompt + output)
    vocab: int,
    device: torch.device | str = "cpu",
    dtype: torch.dtype = torch.float64,
) -> torch.Tensor:  # [k, vocab]: row j = G_{positions[j]}, i.i.d. standard Gumbel
    """Standard Gumbel noise for each position; rows at the same position are equal (drawn once)."""
    positions = [int(p) for p in positions]
    if not positions:
        return torch.empty(0, vocab, device=device, dtype=dtype)
    distinct = sorted(set(positions))
    rows = torch.stack([_gumbel_row(seed, position, vocab) for position in distinct])  # [distinct, vocab]
    row_of = {position: i for i, position in enumerate(distinct)}
    index = torch.tensor([row_of[p] for p in positions], dtype=torch.long)
    return rows[index].to(device=device, dtype=dtype)


def invariant_scores(
    logits: torch.Tensor,  # [k, vocab] next-token logits (target or draft), row j predicting positions[j]
    params: SamplingParams,
    positions: Sequence[int],  # [k] absolute positions of the predicted tokens
) -> torch.Tensor:  # [k, vocab] float64: log p + G, -inf where the warped p is 0
    """log(warp_probs(logits)) + G_position, in float64; its argmax is a sample from the warped law."""
    if logits.shape[0] != len(positions):
        raise ValueError(f"{logits.shape[0]} rows of logits but {len(positions)} positions")
    log_probs = warp_probs(logits.double(), params).log()
    return log_probs + gumbel_noise(params.seed, positions, logits.shape[-1], logits.device)


def invariant_tokens(
    logits: torch.Tensor,  # [k, vocab]
    params: SamplingParams,
    positions: Sequence[int],  # [k]
) -> torch.Tensor:  # [k] int64: argmax of the scores (lowest id on ties)
    """The token each row picks under the keyed noise: the target's emitted token, or a coupled draft's proposal."""
    return invariant_scores(logits, params, positions).argmax(-1)
