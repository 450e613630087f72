"""A KV pool for batched verification: many sequences' keys and values in preallocated tensors, one slot each.

Batched serving scores every running request's verify block in one target forward. The request
of slot s has ``length(s)`` cached positions and a block of k_s tokens (a chain, a tree, or a
prefill chunk); the forward runs a padded ``[B, k_max]`` batch whose additive 4-D mask lets each
row see only its own prefix and the causal (or tree-ancestry) part of its own block. Padded rows
were measured against one flat block-diagonal sequence on this CPU (``bench/batch_layout.py``,
BENCHMARKS.md §8): at 16 requests padded rows cost 1.7-2.1x less, since each query attends over
its own request's context instead of all of them; flat won only for a few very unequal blocks.

Layout: per model layer, keys and values are ``[num_slots, kv_heads, slot_capacity + scratch,
head_dim]``. A request owns one slot for its lifetime; its positions are columns ``0 ..
length - 1`` of its row, so rolling back is forgetting a length and compacting to a tree's
accepted path moves a few columns within the row — per request, never touching another's.
The ``scratch`` columns past the capacity take the keys of a batch's padding queries (a row's
block shorter than the longest), which no real query ever sees. The pool is sized by
configuration (slots × tokens per slot); a request whose prompt and output cannot fit a slot is
refused when it asks for one, never truncated.

The forward itself is :meth:`specserve.core.model.CausalLM.forward_batch`, which hands the model a
per-step :class:`PoolView` (a transformers ``Cache`` over the step's slots). This module knows
nothing of drafting, verification or scheduling.
"""

from __future__ import annotations

import itertools
from collections.abc import Sequence
from typing import Any

import torch
from transformers import PreTrainedModel
from transformers.cache_utils import Cache, CacheLayerMixin

from specserve.core.errors import UserError


class PoolFull(UserError):
    """No free slot, or a sequence longer than a slot holds; the message says which and what to change."""


class KVPool:
    """Keys and values of up to ``num_slots`` sequences of up to ``slot_capacity`` positions each."""

    def __init__(self, model: PreTrainedModel, num_slots: int, slot_capacity: int, scratch: int = 64) -> None:
        if num_slots < 1 or slot_capacity < 1 or scratch < 1:
            raise ValueError(
                f"num_slots, slot_capacity and scratch must be >= 1, got {num_slots}, {slot_capacity}, {scratch}"
            )
        config = model.config
        heads = getattr(config, "num_key_value_heads", None) or config.num_attention_heads
        shard = getattr(model, "tensor_parallel", None)  # a tensor-parallel rank holds its share of the KV heads
        if shard is not None:
            heads = shard.num_kv_heads
        head_dim = getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads
        parameter = next(model.parameters())
        shape = (num_slots, heads, slot_capacity + scratch, head_dim)
        self.keys = [
            torch.zeros(shape, dtype=parameter.dtype, device=parameter.device) for _ in range(config.num_hidden_layers)
        ]
        self.values = [torch.zeros_like(keys) for keys in self.keys]
        self.num_slots = num_slots
        self.slot_capacity = slot_capacity
        self.scratch = scratch
        self._lengths = [0] * num_slots
        self._free = list(range(num_slots - 1, -1, -1))  # pop() hands out the lowest free slot

    # -----------------------------------------------------------------------------------------
    # Slots

    @property
    def free_slots(self) -> int:
        return len(self._free)

    def allocate(self, tokens: int) -> int:
        """A free slot for a sequence that will hold at most ``tokens`` positions (prompt + output)."""
        if tokens > self.slot_capacity:
            raise PoolFull(
                f"a sequence of {tokens} tokens does not fit a KV slot of {self.slot_capacity}; "
                "shorten the prompt or max_new_tokens, or configure longer slots"
            )
        if not self._free:
            raise PoolFull(f"all {self.num_slots} KV slots are in use; wait for one to be freed")
        slot = self._free.pop()
        self._lengths[slot] = 0
        return slot

    def free(self, slot: int) -> None:
        self._check(slot)
        self._lengths[slot] = 0
        self._free.append(slot)
        self._free.sort(reverse=True)

    def length(self, slot: int) -> int:
        self._check(slot)
        return self._lengths[slot]

    def rollback(self, slot: int, length: int) -> None:
        """Keep the first ``length`` cached positions of ``slot``."""
        current = self.length(slot)
        if not 0 <= length <= current:
            raise ValueError(f"cannot roll slot {slot} of length {current} back to {length}")
        self._lengths[slot] = length

    @torch.inference_mode()
    def compact(self, slot: int, keep: Sequence[int]) -> None:
        """Keep only the positions ``keep`` (strictly increasing) of ``slot``, moved to ``0 .. len(keep) - 1``."""
        keep = list(keep)
        current = self.length(slot)
        if any(b <= a for a, b in itertools.pairwise(keep)) or (keep and not 0 <= keep[0] <= keep[-1] < current):
            raise ValueError(f"positions to keep must be strictly increasing and below {current}, got {keep}")
        unchanged = next((i for i, p in enumerate(keep) if p != i), len(keep))
        moved = keep[unchanged:]
        if moved:
            index = torch.tensor(moved, dtype=torch.long, device=self.keys[0].device)
            for tensor in (*self.keys, *self.values):
                row = tensor[slot]
                row[:, unchanged : unchanged + len(moved)] = row.index_select(1, index)
        self._lengths[slot] = len(keep)

    @torch.inference_mode()
    def move(self, source: int, target: int) -> None:
        """Move the sequence of slot ``source`` to the free slot ``target`` (its cached positions are copied)."""
        length = self.length(source)
        if target not in self._free:
            raise ValueError(f"slot {target} is not free")
        for tensor in (*self.keys, *self.values):
            tensor[target, :, :length] = tensor[source, :, :length]
        self._free.remove(target)
        self._lengths[target] = length
        self.free(source)

    def packing(self) -> list[tuple[int, int]]:
        """The moves (source, target) that put the allocated slots at ``0 .. n − 1``: each takes the highest allocated
        slot to the lowest free one below it. A step whose rows are consecutive slots reads the pool without copying
        it (:meth:`PoolView.read`), so callers pack between steps; :meth:`move` carries them out."""
        free, moves = sorted(self._free), []
        used = sorted(set(range(self.num_slots)) - set(free))
        while free and used and free[0] < used[-1]:
            moves.append((used.pop(), free.pop(0)))
            used.append(moves[-1][1])
            used.sort()
        return moves

    def snapshot(self, slot: int) -> list[tuple[torch.Tensor, torch.Tensor]]:
        """A copy of the slot's cached keys and values, per layer (``[1, heads, length, head_dim]`` each)."""
        length = self.length(slot)
        return [(k[slot : slot + 1, :, :length].clone(), v[slot : slot + 1, :, :length].clone())
                for k, v in zip(self.keys, self.values, strict=True)]  # fmt: skip

    def _check(self, slot: int) -> None:
        if not 0 <= slot < self.num_slots or slot in self._free:
            raise ValueError(f"slot {slot} is not allocated")

    # -----------------------------------------------------------------------------------------
    # One step's view

    def view(self, slots: Sequence[int], blocks: Sequence[int]) -> PoolView:
        """The cache one batched forward writes and reads: row b is ``slots[b]``, extended by ``blocks[b]`` tokens.

        Grows each slot's length by its block (the caller rolls back or compacts after verifying)."""
        lengths = [self.length(slot) for slot in slots]
        if len(set(slots)) != len(slots) or min(blocks) < 1:
            raise ValueError(
                f"a batch needs distinct slots and blocks of >= 1 token, got {list(slots)}, {list(blocks)}"
            )
        if max(blocks) - min(blocks) > self.scratch:
            raise ValueError(
                f"blocks of {min(blocks)} to {max(blocks)} tokens need more padding than the pool's {self.scratch} "
                "scratch columns"
            )
        for slot, length, k in zip(slots, lengths, blocks, strict=True):
            if length + k > self.slot_capacity:
                raise PoolFull(f"slot {slot} would hold {length + k} positions, more than its {self.slot_capacity}")
        for slot, length, k in zip(slots, lengths, blocks, strict=True):
            self._lengths[slot] = length + k
        return PoolView(self, list(slots), lengths, list(blocks))


class _PoolLayer(CacheLayerMixin):
    """One model layer's share of a :class:`PoolView`: writes the step's keys and values into the pool rows."""

    is_sliding = False
    is_compileable = False

    def __init__(self, view: PoolView, layer: int) -> None:
        super().__init__()
        self.view = view
        self.layer = layer
        self.is_initialized = True

    def lazy_initialization(self, key_states: torch.Tensor, value_states: torch.Tensor) -> None:
        pass  # the pool is allocated up front

    def update(
        self, key_states: torch.Tensor, value_states: torch.Tensor, *args: Any, **kwargs: Any
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """``key_states`` [B, kv_heads, k_max, head_dim] -> the rows' keys and values up to the step's width."""
        view = self.view
        keys, values = view.pool.keys[self.layer], view.pool.values[self.layer]
        rows, columns = view.write_index
        keys[rows, :, columns] = key_states.transpose(1, 2)  # [B, k_max, kv_heads, head_dim] at (slot, column)
        values[rows, :, columns] = value_states.transpose(1, 2)
        return view.read(keys), view.read(values)

    def get_mask_sizes(self, query_length: int) -> tuple[int, int]:
        return self.view.width, 0

    def get_seq_length(self) -> int:
        return self.view.width - self.view.block_width

    def get_max_length(self) -> int:
        return -1


class PoolView(Cache):
    """A transformers ``Cache`` over the slots of one batched forward (built by :meth:`KVPool.view`).

    Row b writes its block at columns ``lengths[b] ..`` of slot ``slots[b]``; a padding query of a
    shorter block writes into the scratch columns. Reads return ``[B, kv_heads, width, head_dim]``
    with ``width = max(lengths[b] + blocks[b])``: the caller's 4-D mask hides, per row, what lies past
    its own prefix and block.
    """

    def __init__(self, pool: KVPool, slots: list[int], lengths: list[int], blocks: list[int]) -> None:
        self.pool = pool
        self.slots = slots
        self.lengths = lengths
        self.blocks = blocks
        self.block_width = max(blocks)
        self.width = max(length + k for length, k in zip(lengths, blocks, strict=True))
        device = pool.keys[0].device
        columns = torch.empty(len(slots), self.block_width, dtype=torch.long)
        for b, (length, k) in enumerate(zip(lengths, blocks, strict=True)):
            columns[b, :k] = torch.arange(length, length + k)
            columns[b, k:] = torch.arange(pool.slot_capacity, pool.slot_capacity + self.block_width - k)
        self.write_index = (torch.tensor(slots, device=device)[:, None], columns.to(device))
        contiguous = slots == list(range(slots[0], slots[0] + len(slots)))
        self._rows = None if contiguous else torch.tensor(slots, device=device)
        super().__init__(layers=[_PoolLayer(self, i) for i in range(len(pool.keys))])

    def read(self, tensor: torch.Tensor) -> torch.Tensor:
        """The step's rows of one pool tensor, up to the step's width (a view when the slots are consecutive)."""
        if self._rows is None:
            return tensor[self.slots[0] : self.slots[0] + len(self.slots), :, : self.width]
        return tensor[:, :, : self.width].index_select(0, self._rows)
