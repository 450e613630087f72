"""Exact verification of a draft chain: pure tensor functions, no model, no I/O.

Rules (see docs/verification.md#rule-a-chain-one-sampled-child-per-depth; Leviathan et al. 2023, Chen et al. 2023):

* greedy — accept draft tokens while each equals the target's argmax (lowest id on ties); the
  next token is the target's argmax at the first mismatch (*recovered*) or after the last draft
  (*bonus*).
* stochastic — accept draft x_i with probability min(1, p_i(x_i) / q_i(x_i)); at the first
  rejection emit a *recovered* token from norm(max(0, p_i - q_i)); if all are accepted emit a
  *bonus* token from p_gamma. Every emitted token is then distributed exactly as p.
  Drafts that carry no q (n-gram lookup) are proposals from a point mass: q_i = one-hot(x_i).

Both fast functions draw their randomness in a fixed order (gamma uniforms, then one exponential
race per candidate row) so :func:`reference_verify_chain`, a plain loop written for
readability, reproduces them bit for bit on the same generator state. The fast path keeps all
work on device and returns tensors: ``chain_rows_*`` give the accepted count and every row's next
token, which a batched step copies to the host with every other request's in one transfer and
:func:`chain_verdict` reads; :func:`verify_chain` does both for one chain (one sync).
"""

from __future__ import annotations

import enum
from collections.abc import Sequence
from dataclasses import dataclass

import torch

from specserve.core.sampling.warps import sample


class TokenKind(enum.IntEnum):
    """The three kinds of committed token, one name each in code, metrics and logs."""

    ACCEPTED = 0  # a draft token that passed verification
    RECOVERED = 1  # resampled from the residual after a rejection (target argmax when greedy)
    BONUS = 2  # sampled from the target after every draft token was accepted


@dataclass(frozen=True)
class ChainVerdict:
    num_accepted: int  # leading draft tokens accepted, 0..gamma
    next_token: int  # the recovered or bonus token appended after them
    next_kind: TokenKind  # RECOVERED or BONUS

    @property
    def accepted(self) -> tuple[int, ...]:
        """The accepted nodes of the chain, as a tree verdict names them: ``0, 1, ..., num_accepted - 1``."""
        return tuple(range(self.num_accepted))


# ---------------------------------------------------------------------------------------------
# Fast paths


def verify_chain_greedy(
    target_logits: torch.Tensor,  # [gamma + 1, vocab]
    draft_tokens: torch.Tensor,  # [gamma] int64
) -> tuple[torch.Tensor, torch.Tensor]:  # (num_accepted [] int64, next_token [] int64)
    num_accepted, target_argmax = chain_rows_greedy(target_logits, draft_tokens)
    return num_accepted, target_argmax[num_accepted]


def chain_rows_greedy(
    target_logits: torch.Tensor,  # [gamma + 1, vocab]
    draft_tokens: torch.Tensor,  # [gamma] int64
) -> tuple[torch.Tensor, torch.Tensor]:  # (num_accepted [] int64, next token of every row [gamma + 1] int64)
    """The greedy chain rule on the device: the accepted count, and the token each row emits if the chain stops
    there (its argmax); :func:`chain_verdict` reads them on the host."""
    gamma = draft_tokens.shape[0]
    target_argmax = target_logits.argmax(-1)  # [gamma + 1]; torch.argmax picks the first maximum
    matches = draft_tokens == target_argmax[:gamma]
    return matches.long().cumprod(0).sum(), target_argmax


def residual_rows(
    target_probs: torch.Tensor,  # [gamma + 1, vocab]
    draft_tokens: torch.Tensor,  # [gamma] int64
    draft_probs: torch.Tensor | None,  # [gamma, vocab], or None for point-mass drafts
) -> torch.Tensor:  # [gamma + 1, vocab] unnormalised: rows 0..gamma-1 residuals, row gamma = p_gamma
    gamma = draft_tokens.shape[0]
    head = target_probs[:gamma]
    if draft_probs is None:
        residual = head.scatter(-1, draft_tokens[:, None], 0.0)
    else:
        residual = (head - draft_probs.to(head.dtype)).clamp_min(0.0)
    # A rejection can only happen where p != q, so the residual has mass; if rounding left it
    # empty (p == q up to float error) fall back to p itself, which is then the right law.
    empty = residual.sum(-1, keepdim=True) <= 0
    residual = torch.where(empty, head, residual)
    return torch.cat([residual, target_probs[gamma:]], dim=0)


def verify_chain_stochastic(
    target_probs: torch.Tensor,  # [gamma + 1, vocab], warped target distributions
    draft_tokens: torch.Tensor,  # [gamma] int64
    draft_probs: torch.Tensor | None,  # [gamma, vocab] the exact q each token was drawn from; None = point mass
    generator: torch.Generator,
) -> tuple[torch.Tensor, torch.Tensor]:  # (num_accepted [] int64, next_token [] int64)
    num_accepted, candidates = chain_rows_stochastic(target_probs, draft_tokens, draft_probs, generator)
    return num_accepted, candidates[num_accepted]


def chain_rows_stochastic(
    target_probs: torch.Tensor,  # [gamma + 1, vocab], warped target distributions
    draft_tokens: torch.Tensor,  # [gamma] int64
    draft_probs: torch.Tensor | None,  # [gamma, vocab] the exact q each token was drawn from; None = point mass
    generator: torch.Generator,
) -> tuple[torch.Tensor, torch.Tensor]:  # (num_accepted [] int64, next token of every row [gamma + 1] int64)
    """The rejection-sampling chain rule on the device: the accepted count, and the token each row emits if the
    chain stops there (a residual's draw, the bonus draw at row gamma). Draws gamma uniforms, then one exponential
    race per row, whatever the outcome."""
    gamma = draft_tokens.shape[0]
    positions = torch.arange(gamma, device=draft_tokens.device)
    target_at_draft = target_probs[positions, draft_tokens]  # [gamma]
    if draft_probs is None:
        draft_at_draft = torch.ones_like(target_at_draft)
    else:
        draft_at_draft = draft_probs[positions, draft_tokens].to(target_at_draft.dtype)
    uniforms = torch.rand(gamma, generator=generator, device=target_probs.device, dtype=torch.float64)
    # u < p/q  <=>  u * q < p, in float64 (no division; p == 0 is never accepted)
    accepted = uniforms * draft_at_draft.double() < target_at_draft.double()
    num_accepted = accepted.long().cumprod(0).sum()
    candidates = sample(residual_rows(target_probs, draft_tokens, draft_probs), generator)  # [gamma + 1]
    return num_accepted, candidates


def verify_chain(
    target_logits: torch.Tensor,  # [gamma + 1, vocab]
    target_probs: torch.Tensor | None,  # [gamma + 1, vocab]; None when greedy
    draft_tokens: torch.Tensor,  # [gamma] int64
    draft_probs: torch.Tensor | None,  # [gamma, vocab] or None
    generator: torch.Generator | None,
) -> ChainVerdict:
    """Dispatch to the greedy or stochastic rule and sync once to host (the count and the token in one transfer)."""
    gamma = draft_tokens.shape[0]
    if target_probs is None:
        num, token = verify_chain_greedy(target_logits, draft_tokens)
    else:
        if generator is None:
            raise ValueError("stochastic verification needs the request's generator")
        num, token = verify_chain_stochastic(target_probs, draft_tokens, draft_probs, generator)
    n, next_token = torch.stack([num.reshape(()), token.reshape(())]).tolist()
    return ChainVerdict(n, next_token, TokenKind.BONUS if n == gamma else TokenKind.RECOVERED)


def chain_verdict(num_accepted: int, next_by_row: Sequence[int], gamma: int) -> ChainVerdict:
    """A chain's verdict on the host, from its rule's device results (:func:`chain_rows_greedy`,
    :func:`chain_rows_stochastic`) once copied: the count, and the token of the row the chain stopped at."""
    if not 0 <= num_accepted <= gamma or len(next_by_row) != gamma + 1:
        raise ValueError(f"{num_accepted} accepted of {gamma} with {len(next_by_row)} rows; need gamma + 1 rows")
    kind = TokenKind.BONUS if num_accepted == gamma else TokenKind.RECOVERED
    return ChainVerdict(num_accepted, int(next_by_row[num_accepted]), kind)


# ---------------------------------------------------------------------------------------------
# Slow reference: a loop that reads like the paper, for tests only.


def reference_verify_chain(
    target_probs: torch.Tensor,  # [gamma + 1, vocab]
    draft_tokens: torch.Tensor,  # [gamma]
    draft_probs: torch.Tensor | None,  # [gamma, vocab] or None
    generator: torch.Generator,
) -> ChainVerdict:
    gamma, vocab = draft_tokens.shape[0], target_probs.shape[-1]
    uniforms = torch.rand(gamma, generator=generator, device=target_probs.device, dtype=torch.float64).tolist()
    noise = torch.empty(gamma + 1, vocab, device=target_probs.device, dtype=target_probs.dtype)
    noise.exponential_(1.0, generator=generator)
    for i in range(gamma):
        x = int(draft_tokens[i])
        p_x = float(target_probs[i, x])
        q_row = torch.zeros(vocab, dtype=target_probs.dtype) if draft_probs is None else draft_probs[i].clone()
        if draft_probs is None:
            q_row[x] = 1.0
        q_x = float(q_row[x])
        if uniforms[i] * q_x < p_x:  # accept with probability min(1, p_x / q_x)
            continue
        residual = (target_probs[i] - q_row).clamp_min(0.0)
        if float(residual.sum()) <= 0.0:
            residual = target_probs[i].clone()
        # Exponential race: argmax(w / E) draws index j with probability w_j / sum(w), so the
        # residual needs no explicit normalisation.
        return ChainVerdict(i, int((residual / noise[i]).argmax()), TokenKind.RECOVERED)
    return ChainVerdict(gamma, int((target_probs[gamma] / noise[gamma]).argmax()), TokenKind.BONUS)
