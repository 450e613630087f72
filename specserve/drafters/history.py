"""The committed text a drafter continues: the ``start`` / ``accept`` / ``rewind`` of the drafter protocol.

Most drafters that look at the text (n-gram lookup, REST, Lookahead, drafting through text) keep the committed
tokens — prompt, then every cycle's accepted tokens — and nothing else that ``rewind`` must undo.
:class:`CommittedHistory` is that bookkeeping, once: a drafter mixes it in and reads ``history``; one that keeps
more state overrides a method and calls it first. Drafts nothing.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from specserve.core.sampling.params import SamplingParams


class CommittedHistory:
    """``history``: the committed tokens (prompt and output) of the request being drafted for."""

    history: list[int]

    def start(self, prompt_ids: Sequence[int], params: SamplingParams, generator: torch.Generator) -> None:
        self.history = [int(t) for t in prompt_ids]

    def accept(self, committed: Sequence[int]) -> None:
        self.history.extend(int(t) for t in committed)

    def rewind(self, length: int) -> None:
        """Forget the committed text beyond its first ``length`` tokens."""
        if not 0 <= length <= len(self.history):
            raise ValueError(f"cannot rewind {len(self.history)} committed tokens to {length}")
        del self.history[length:]
