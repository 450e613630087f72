"""The drafter contract the engine loop talks to, and the draft it returns.

A drafter serves one request at a time:

1. ``start(prompt_ids, params, generator)`` resets it for a new request;
2. ``propose(budget)`` returns up to ``budget`` draft tokens that continue the committed text,
   with the exact distribution q each was sampled from, or ``None`` when the tokens were chosen
   deterministically (greedy, n-gram lookup) — verification then treats q as a point mass;
3. ``accept(committed)`` hands back the tokens the target committed this cycle (accepted draft
   tokens followed by the recovered or bonus token); the drafter rolls its own state back to
   the longest prefix that is still valid;
4. ``rewind(length)`` drops committed text beyond ``length`` tokens (used when a drafter has
   been told an assumed verdict in overlap mode and the real one differs).

Drafter implementations live in ``specserve.drafters``; this module defines only the contract.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Protocol, runtime_checkable

import torch

from specserve.core.sampling import SamplingParams


@dataclass(frozen=True)
class Draft:
    tokens: torch.Tensor  # [gamma] int64, on the target's device
    draft_probs: torch.Tensor | None  # [gamma, vocab] the exact q of each token; None = point mass

    @property
    def gamma(self) -> int:
        return int(self.tokens.shape[0])

    @staticmethod
    def empty(device: torch.device | str = "cpu") -> Draft:
        return Draft(torch.empty(0, dtype=torch.long, device=device), None)


@runtime_checkable
class Drafter(Protocol):
    name: str

    def start(self, prompt_ids: Sequence[int], params: SamplingParams, generator: torch.Generator) -> None: ...

    def propose(self, budget: int) -> Draft: ...

    def accept(self, committed: Sequence[int]) -> None: ...

    def rewind(self, length: int) -> None:
        """Forget the committed text beyond its first ``length`` tokens (overlap mode drafts ahead
        on an assumed verdict and rewinds when the real one differs)."""
        ...


def propose_within(drafter: Drafter, gamma: int, remaining: int, device: torch.device | str = "cpu") -> Draft:
    """Ask for ``gamma`` tokens but never more than ``remaining - 1``: the verdict always adds one more.

    A drafter that overruns its budget is trimmed rather than trusted.
    """
    budget = min(gamma, remaining - 1)
    if budget <= 0:
        return Draft.empty(device)
    draft = drafter.propose(budget)
    if draft.gamma > budget:
        probs = draft.draft_probs[:budget] if draft.draft_probs is not None else None
        draft = Draft(draft.tokens[:budget], probs)
    return draft
