"""Drafting through text: a draft model with another tokenizer than the target's (universal assisted generation).

A draft model whose vocabulary differs from the target's cannot propose the target's token ids, so it drafts in
its own: the committed text (the target's tokens, decoded) is encoded with the draft's tokenizer, the draft model
continues it greedily (a :class:`~specserve.drafters.model.DraftModelDrafter` in the draft's vocabulary, its KV
cache rolled back to the longest prefix it shares with the new encoding), and the continuation's text is encoded
with the target's tokenizer into the proposal. The proposal is a function of the committed text alone, sent
without q: a point mass, which the chain rules accept with probability p(x) and whose rejection leaves the residual
p without x — exact at any temperature (docs/verification.md, rule A with a point mass).

The boundary: encoding the continuation alone could split or merge tokens differently from encoding it after the
text it continues. The drafter encodes the text of the last ``window`` committed tokens together with the
continuation, checks that the window comes back as the same committed tokens, and proposes what follows them (at
most ``budget`` tokens); when the window does not come back, it proposes nothing this cycle. A draft that ends the
text ends the proposal with the target's end-of-text token. Chains only. Spec:
``text:DIR`` (a draft model directory with its own tokenizer).
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from specserve.core.draft.drafter import Draft
from specserve.core.errors import UserError
from specserve.core.model.causal_lm import CausalLM, TargetDescription
from specserve.core.sampling.params import SamplingParams
from specserve.drafters.history import CommittedHistory
from specserve.drafters.model import DraftModelDrafter

DEFAULT_WINDOW = 8  # committed tokens re-encoded with the continuation to check the boundary


class TextDrafter(CommittedHistory):
    """A draft model of another vocabulary drafting for the target through text."""

    name = "text"

    def __init__(self, draft: CausalLM, target: CausalLM | TargetDescription, window: int = DEFAULT_WINDOW) -> None:
        if draft.tokenizer is None or target.tokenizer is None:
            raise UserError(
                "drafting through text needs both tokenizers: "
                f"{'the draft model' if draft.tokenizer is None else 'the target'} has none"
            )
        if window < 1:
            raise ValueError(f"window must be >= 1, got {window}")
        self.draft_tokenizer = draft.tokenizer
        self.target_tokenizer = target.tokenizer
        self.window = window
        self.inner = DraftModelDrafter(draft)  # drafts in the draft's own vocabulary
        self.target = target
        self._output_device = target.device
        self.history: list[int] = []  # the target's committed tokens

    def fresh(self) -> TextDrafter:
        """A drafter for another request over the same draft model (shared, not copied), with none of this one's
        per-request state (a batched engine gives each request one)."""
        return type(self)(self.inner.model, self.target, self.window)

    def start(self, prompt_ids: Sequence[int], params: SamplingParams, generator: torch.Generator) -> None:
        super().start(prompt_ids, params, generator)
        # greedy in its own vocabulary, whatever the request's sampling: a point mass needs no q
        self.inner.start(self._draft_ids(self.history), SamplingParams(), generator)

    def propose(self, budget: int) -> Draft:
        if budget <= 0:
            return Draft.empty(self._output_device)
        self._follow(self._draft_ids(self.history))
        continuation = self.inner.propose(budget).tokens.tolist()
        ends = self.draft_tokenizer.eos_token_id in continuation
        if ends:  # the draft ends the text: what comes before, then the target's end of text
            continuation = continuation[: continuation.index(self.draft_tokenizer.eos_token_id)]
        text = str(self.draft_tokenizer.decode(continuation, skip_special_tokens=True))
        tokens = self._target_ids_after_context(text) if text else []
        if ends and (tokens or not text) and self.target_tokenizer.eos_token_id is not None:
            tokens.append(int(self.target_tokenizer.eos_token_id))
        return Draft(torch.tensor(tokens[:budget], dtype=torch.long, device=self._output_device), None)

    # ------------------------------------------------------------------------------------------

    def _draft_ids(self, target_ids: Sequence[int]) -> list[int]:
        text = self.target_tokenizer.decode(list(target_ids), skip_special_tokens=True)
        return list(self.draft_tokenizer(text, add_special_tokens=False)["input_ids"])

    def _follow(self, draft_ids: list[int]) -> None:
        """The inner drafter's context becomes ``draft_ids`` (rewound to the prefix it shares, then extended)."""
        current = self.inner.context
        keep = 0
        while keep < min(len(current), len(draft_ids)) and current[keep] == draft_ids[keep]:
            keep += 1
        self.inner.rewind(keep)
        self.inner.accept(draft_ids[keep:])

    def _target_ids_after_context(self, text: str) -> list[int]:
        """``text`` as the target's tokens after the committed ones, checked at the boundary; [] when the window of
        committed tokens does not encode back to itself together with the text."""
        window = self.history[-self.window :]
        head = str(self.target_tokenizer.decode(window, skip_special_tokens=False))
        ids = list(self.target_tokenizer(head + text, add_special_tokens=False)["input_ids"])
        if ids[: len(window)] != window:
            return []
        return ids[len(window) :]
