"""Token log-probabilities in the two shapes of the OpenAI API.

* completions (legacy): ``{"tokens", "token_logprobs", "top_logprobs", "text_offset"}``, one list entry per token,
  ``top_logprobs`` a ``{token text: logprob}`` object per token (alternatives whose text coincides keep the
  likelier), ``text_offset`` each token's first character in the completion's text;
* chat: ``{"content": [{"token", "logprob", "bytes", "top_logprobs": [{"token", "logprob", "bytes"}]}],
  "refusal": null}``.

A token's text is its own decoding, special tokens included (an end-of-sequence token reads ``</s>``, though
the completion's text leaves it out). A log-probability of minus infinity (a token a warp removed, with
``logprobs_mode: processed``) is sent as :data:`NEG_INF_LOGPROB`, as vLLM does: JSON has no infinity. Shapes
what :mod:`specserve.core.verify.logprobs` computed; computes nothing itself.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from typing import Any

from specserve.core.verify.logprobs import TokenLogprob

NEG_INF_LOGPROB = -9999.0
TokenText = Callable[[int], str]  # one token id -> its text


def finite(logprob: float) -> float:
    return logprob if logprob > -math.inf else NEG_INF_LOGPROB


def completion_logprobs(entries: Sequence[TokenLogprob], token_text: TokenText, offset: int = 0) -> dict[str, Any]:
    """The completions API's ``logprobs`` object; ``offset``: characters of the completion before these tokens."""
    tokens = [token_text(entry.token) for entry in entries]
    offsets = []
    for text in tokens:
        offsets.append(offset)
        offset += len(text)
    top = []
    for entry in entries:
        alternatives: dict[str, float] = {}
        for token, logprob in entry.top:
            alternatives.setdefault(token_text(token), finite(logprob))
        top.append(alternatives)
    return {
        "tokens": tokens,
        "token_logprobs": [finite(entry.logprob) for entry in entries],
        "top_logprobs": top,
        "text_offset": offsets,
    }


def chat_logprobs(entries: Sequence[TokenLogprob], token_text: TokenText) -> dict[str, Any]:
    """The chat API's ``logprobs`` object."""

    def one(token: int, logprob: float) -> dict[str, Any]:
        text = token_text(token)
        return {"token": text, "logprob": finite(logprob), "bytes": list(text.encode("utf-8"))}

    content = [
        {**one(entry.token, entry.logprob), "top_logprobs": [one(token, lp) for token, lp in entry.top]}
        for entry in entries
    ]
    return {"content": content, "refusal": None}


def mean_logprob(entries: Sequence[TokenLogprob]) -> float:
    """The mean log-probability per token (``best_of`` ranks completions by it); 0 for no tokens."""
    return sum(entry.logprob for entry in entries) / len(entries) if entries else 0.0
