"""Prompt lookup (n-gram) drafting: copy what followed the latest earlier occurrence of the last n tokens.

Searches prompt + generated text for the most recent earlier match of the trailing n-gram,
trying n from ``max_ngram`` down to ``min_ngram``, and proposes the tokens that followed it
(Saxena 2023, "prompt lookup decoding"). The choice is deterministic, so no q is sent and the
verifier treats each proposal as a point mass — exact at any temperature. No model, no state
beyond the token history.
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np
import torch

from specserve.core.draft import Draft
from specserve.core.errors import UserError
from specserve.core.sampling import SamplingParams


class NgramDrafter:
    name = "ngram"

    def __init__(self, max_ngram: int = 3, min_ngram: int = 1, device: torch.device | str = "cpu") -> None:
        if not 1 <= min_ngram <= max_ngram:
            raise UserError(f"n-gram sizes need 1 <= min_ngram <= max_ngram, got {min_ngram}..{max_ngram}")
        self.max_ngram = max_ngram
        self.min_ngram = min_ngram
        self._device = device
        self._history: list[int] = []

    def start(self, prompt_ids: Sequence[int], params: SamplingParams, generator: torch.Generator) -> None:
        self._history = list(prompt_ids)

    def accept(self, committed: Sequence[int]) -> None:
        self._history.extend(committed)

    def rewind(self, length: int) -> None:
        if not 0 <= length <= len(self._history):
            raise ValueError(f"cannot rewind {len(self._history)} committed tokens to {length}")
        del self._history[length:]

    def propose(self, budget: int) -> Draft:
        tokens = lookup(self._history, budget, self.max_ngram, self.min_ngram)
        return Draft(torch.tensor(tokens, dtype=torch.long, device=self._device), None)


def lookup(history: Sequence[int], budget: int, max_ngram: int, min_ngram: int) -> list[int]:
    """Up to ``budget`` tokens that followed the latest earlier occurrence of the longest matching suffix."""
    length = len(history)
    if budget <= 0 or length < 2:
        return []
    ids = np.asarray(history, dtype=np.int64)
    for n in range(min(max_ngram, length - 1), min_ngram - 1, -1):
        # windows[i] = ids[i : i + n] for every start i before the suffix's own start.
        windows = np.lib.stride_tricks.sliding_window_view(ids[: length - 1], n)
        hits = np.flatnonzero((windows == ids[length - n :]).all(axis=1))
        if hits.size:
            start = int(hits[-1]) + n
            return ids[start : start + budget].tolist()
    return []
