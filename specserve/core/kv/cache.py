"""The KV cache of one sequence in this process: transformers' ``DynamicCache`` behind "keep the first ``length``
positions" (:meth:`KVCache.rollback`) and "keep these positions" (:meth:`KVCache.compact`, a tree's accepted path).

In transformers 5.x a ``DynamicCache`` grows on every forward and ``Cache.crop(n)`` takes a *negative* count of tokens
to drop; :meth:`KVCache.rollback` hides that. A sliding-window layer keeps every position too
(:func:`~specserve.core.attention.windows.full_cache`); a hybrid model's recurrent layers need more than cropping:
:class:`~specserve.core.kv.recurrent.RecurrentKVCache`. Does not run the model
(:class:`~specserve.core.model.causal_lm.CausalLM` does) and does not serve batches (:mod:`specserve.core.kv.pool`).
"""

from __future__ import annotations

import itertools
from collections.abc import Sequence
from typing import TYPE_CHECKING

import torch

from specserve.core.attention.windows import full_cache

if TYPE_CHECKING:
    from transformers import PreTrainedModel


class KVCache:
    """The KV cache of one sequence; ``length`` positions are cached."""

    def __init__(self, model: PreTrainedModel) -> None:
        self.inner = full_cache(model.config)  # a sliding-window layer keeps every position too: the masks apply it

    @property
    def length(self) -> int:
        return int(self.inner.get_seq_length())

    def rollback(self, length: int) -> None:
        """Keep the first ``length`` cached positions and drop the rest."""
        current = self.length
        if not 0 <= length <= current:
            raise ValueError(f"cannot roll back a cache of length {current} to {length}")
        if length < current:
            self.inner.crop(length - current)  # transformers 5.x: negative = tokens to remove

    @torch.inference_mode()  # the cached tensors are inference tensors: updated in place only in this mode
    def compact(self, keep: Sequence[int]) -> None:
        """Keep only the cached positions in ``keep`` (strictly increasing), moved to positions 0 .. len - 1.

        After a tree verify pass this drops the rejected branches: the prefix stays where it is
        and the accepted path's entries move down to follow it.
        """
        keep = list(keep)
        current = self.length
        ordered = all(a < b for a, b in itertools.pairwise(keep))
        if not ordered or (keep and not 0 <= keep[0] <= keep[-1] < current):
            raise ValueError(f"positions to keep must be strictly increasing and below {current}, got {keep}")
        unchanged = next((i for i, p in enumerate(keep) if p != i), len(keep))
        moved = keep[unchanged:]
        if moved:
            index = None
            for layer in self.inner.layers:
                for name in ("keys", "values"):
                    tensor = getattr(layer, name, None)
                    if not isinstance(tensor, torch.Tensor):
                        raise TypeError(f"cache layer {type(layer).__name__} holds no key/value tensors")
                    if index is None or index.device != tensor.device:
                        index = torch.tensor(moved, dtype=torch.long, device=tensor.device)
                    tensor[:, :, unchanged : unchanged + len(moved)] = tensor.index_select(2, index)
        self.rollback(len(keep))

    def snapshot(self) -> list[tuple[torch.Tensor, torch.Tensor]]:
        """A copy of the cached keys and values, per layer ([batch, heads, length, head_dim] each)."""
        copies = []
        for layer in self.inner.layers:
            keys, values = getattr(layer, "keys", None), getattr(layer, "values", None)
            if not isinstance(keys, torch.Tensor) or not isinstance(values, torch.Tensor):
                raise TypeError(f"cache layer {type(layer).__name__} holds no key/value tensors")
            copies.append((keys.clone(), values.clone()))
        return copies
