"""transformers' own decoding, the baseline the benchmarks measure our engine against.

:func:`hf_generate` runs ``model.generate`` on one prompt the way every benchmark compares with: transformers'
own attention (:func:`~specserve.core.attention.sdpa.native_attention`, for an assistant model too), the target's
EOS tokens, greedy or sampled with top-k and top-p off, seeded through torch's global generator (which is what
``generate`` samples from). Extra keyword arguments go to ``generate`` unchanged: an ``assistant_model``,
``prompt_lookup_num_tokens``, ``cache_implementation="static"`` (which transformers compiles by itself on a GPU).

Imports nothing beyond :mod:`specserve.core`, so a script that must run without Ray or pydantic (the device
check, ``bench/device_check.py``) can use it. Does not time anything: callers do.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch

from specserve.core.attention.sdpa import native_attention
from specserve.core.model.causal_lm import CausalLM


def hf_generate(
    target: CausalLM,
    prompt_ids: Sequence[int],
    max_new_tokens: int,
    temperature: float = 0.0,
    seed: int = 0,
    **generate_kwargs: Any,
) -> list[int]:
    """The new token ids (prompt stripped; EOS kept when it ended the generation) of transformers' ``generate``."""
    model = target.model
    eos = list(target.info.eos_token_ids)
    sampling: dict[str, Any] = (
        {"do_sample": True, "temperature": temperature, "top_k": 0, "top_p": 1.0}
        if temperature > 0
        else {"do_sample": False}
    )
    torch.manual_seed(seed)
    input_ids = torch.tensor([list(prompt_ids)], device=target.device)
    assistant = generate_kwargs.get("assistant_model")
    with torch.inference_mode(), native_attention(model), native_attention(assistant):
        out = model.generate(
            input_ids,
            attention_mask=torch.ones_like(input_ids),
            max_new_tokens=max_new_tokens,
            eos_token_id=eos or None,  # none: the model's own generation config decides
            pad_token_id=eos[0] if eos else 0,
            **sampling,
            **generate_kwargs,
        )
    return [int(t) for t in out[0, input_ids.shape[1] :].tolist()]
