"""Timing one model forward: the median over repeats of a block scored after a fixed cached prefix.

Shared by ``specserve bench`` (the plain decode step) and ``bench/verify_cost.py`` (T_verify(k)).
The cache is rolled back after every repeat, so each one sees the same prefix.
"""

from __future__ import annotations

import time
from collections.abc import Sequence

import torch

from specserve.core.model import CausalLM


def median_forward_seconds(model: CausalLM, prefix: Sequence[int], block: Sequence[int], repeats: int = 21) -> float:
    """Median seconds of ``model.forward`` over ``block`` with ``prefix`` already in the KV cache."""
    cache = model.new_cache()
    if prefix:
        model.forward(cache, torch.tensor(list(prefix), dtype=torch.long), last_only=True)
    tokens = torch.tensor(list(block), dtype=torch.long)
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        model.forward(cache, tokens)
        times.append(time.perf_counter() - start)
        cache.rollback(len(prefix))
    return sorted(times)[len(times) // 2]
