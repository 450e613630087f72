"""Timing one model forward: the median over repeats of a block scored after a fixed cached prefix.

Shared by ``specserve bench`` (the plain decode step), ``bench/verify_cost.py`` (T_verify(k)) and the device
check (T_verify(k) on the growing cache and on the static-shape engine's). The cache is rolled back after every
repeat, so each one sees the same prefix. On a GPU each repeat is timed between two synchronisations, so the time
is the forward's, not its launch's.
"""

from __future__ import annotations

import time
from collections.abc import Sequence

import torch

from specserve.core.kv.cache import KVCache
from specserve.core.model.causal_lm import CausalLM
from specserve.core.static.slots import StaticKVCache


def synchronize(device: torch.device) -> None:
    """Wait for the work queued on ``device`` (a no-op on a CPU, where every call returns finished)."""
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def median_forward_seconds(
    model: CausalLM,
    prefix: Sequence[int],
    block: Sequence[int],
    repeats: int = 21,
    cache: KVCache | StaticKVCache | None = None,
) -> float:
    """Median seconds of ``model.forward`` over ``block`` with ``prefix`` already in the KV cache: ``cache`` (empty;
    a static-shape engine's, say), else a new growing one."""
    cache = model.new_cache() if cache is None else cache
    if prefix:
        model.forward(cache, torch.tensor(list(prefix), dtype=torch.long), last_only=True)
    tokens = torch.tensor(list(block), dtype=torch.long)
    times = []
    for _ in range(repeats):
        synchronize(model.device)
        start = time.perf_counter()
        model.forward(cache, tokens)
        synchronize(model.device)
        times.append(time.perf_counter() - start)
        cache.rollback(len(prefix))
    return sorted(times)[len(times) // 2]
