"""Turning a request's prompt into token ids and token ids back into text, with the checks both need.

Shared by the single-process engine and the distributed coordinator so that a prompt is
validated, and an output decoded, the same way wherever it runs. Knows the target's vocabulary,
context length and tokenizer, and so also checks what of a request's sampling parameters needs them
(:meth:`PromptCodec.check_params`: logit-bias ids, the grammar); knows nothing about drafting or
verification.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from specserve.core.errors import InvalidRequest
from specserve.core.model.causal_lm import ModelInfo
from specserve.core.sampling.params import SamplingParams
from specserve.core.verify.grammar import compiler_for
from specserve.core.verify.processors import check_logit_bias

__all__ = ["PromptCodec"]


class PromptCodec:
    def __init__(self, info: ModelInfo, tokenizer: Any | None) -> None:
        self.info = info
        self.tokenizer = tokenizer

    def encode(self, prompt: str | Sequence[int]) -> list[int]:
        if isinstance(prompt, str):
            if not prompt:
                raise InvalidRequest("the prompt is empty; pass at least one character of text")
            if self.tokenizer is None:
                raise InvalidRequest("this target has no tokenizer; pass prompt token ids instead of text")
            ids = list(self.tokenizer(prompt, add_special_tokens=False)["input_ids"])
        else:
            ids = [int(t) for t in prompt]
        if not ids:
            raise InvalidRequest("the prompt is empty; pass at least one token")
        vocab = self.info.vocab_size
        if any(not 0 <= t < vocab for t in ids):
            raise InvalidRequest(f"prompt token ids must be in [0, {vocab})")
        return ids

    def check_length(self, prompt_ids: Sequence[int], max_new_tokens: int) -> None:
        limit = self.info.max_positions
        if len(prompt_ids) + max_new_tokens > limit:
            raise InvalidRequest(
                f"prompt ({len(prompt_ids)} tokens) + max_new_tokens ({max_new_tokens}) exceeds the "
                f"target's context of {limit} tokens; shorten the prompt or lower max_new_tokens"
            )

    def check_params(self, params: SamplingParams, ignore_eos: bool = False) -> None:
        """Raises :class:`InvalidRequest` for a logit bias outside the vocabulary or a bad grammar
        (:meth:`check_grammar`)."""
        check_logit_bias(params, self.info.vocab_size)
        self.check_grammar(params, ignore_eos)

    def check_grammar(self, params: SamplingParams, ignore_eos: bool = False) -> None:
        """Raises :class:`InvalidRequest` for a grammar that does not compile for this tokenizer, or a grammar with
        ``ignore_eos`` (a finished grammar allows only the end of text)."""
        if params.grammar is None:
            return
        if ignore_eos:
            raise InvalidRequest("structured output cannot be combined with ignore_eos: a grammar ends the text")
        compiler_for(self.tokenizer, self.info.vocab_size, self.info.eos_token_ids).check(params.grammar)

    def decode(self, ids: Sequence[int]) -> str:
        if self.tokenizer is None:
            return ""
        # Special tokens (EOS) stay in ``output_ids`` but not in the text, as OpenAI-style APIs expect.
        return str(self.tokenizer.decode(list(ids), skip_special_tokens=True))
