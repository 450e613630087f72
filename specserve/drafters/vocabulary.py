"""Whether a draft model can propose tokens for a target: both must score the same token ids.

Shared by the chain drafter (:mod:`specserve.drafters.model`) and the tree drafter
(:mod:`specserve.drafters.tree`), which both load a separate draft model; it lives apart from them
so that neither has to import the other for it. Only compares vocabularies; drafts nothing.
"""

from __future__ import annotations

import weakref
from typing import Any

from specserve.core.errors import UserError
from specserve.core.model.causal_lm import CausalLM, TargetDescription

# target tokenizer -> draft tokenizers already found to match it (each per-request drafter checks again: comparing two
# vocabularies of 50k entries cost 8 ms a request)
_MATCHED: weakref.WeakKeyDictionary[Any, weakref.WeakSet[Any]] = weakref.WeakKeyDictionary()


class VocabularyMismatch(UserError):
    """The draft model cannot propose tokens for this target: their vocabularies differ."""


def check_same_vocabulary(target: CausalLM | TargetDescription, draft: CausalLM) -> None:
    """Raise :class:`VocabularyMismatch` unless both models score the same token ids."""
    if target.info.vocab_size != draft.info.vocab_size:
        raise VocabularyMismatch(
            f"draft model {draft.info.path} has a vocabulary of {draft.info.vocab_size} tokens but the target "
            f"{target.info.path} has {target.info.vocab_size}; a draft model must share the target's tokenizer, "
            f"or draft through text: --draft text:{draft.info.path}"
        )
    if target.tokenizer is None or draft.tokenizer is None or target.tokenizer is draft.tokenizer:
        return
    matched = _MATCHED.setdefault(target.tokenizer, weakref.WeakSet())
    if draft.tokenizer in matched:
        return
    if target.tokenizer.get_vocab() != draft.tokenizer.get_vocab():
        raise VocabularyMismatch(
            f"draft model {draft.info.path} and target {target.info.path} have different tokenizers "
            "(same size, different token ids); a draft model must share the target's tokenizer, or draft through "
            f"text: --draft text:{draft.info.path}"
        )
    matched.add(draft.tokenizer)
