"""A KV pool for batched serving, sized in tokens: every sequence's keys and values in one arena per layer.

Batched serving scores every running request's verify block in one target forward. The pool holds
``capacity`` token positions per layer, ``[kv_heads, capacity + scratch, head_dim]``. A sequence
reserves a contiguous span of them when it is allocated — as many as it may ever hold (prompt, output
and the widest block it may verify) — so a running request never waits for room and is never cut
short; the positions it has cached are the first ``length`` of its span. Admission is by tokens: a
request waits while the pool's free tokens are fewer than it needs, and one that needs more than the
whole pool is refused, saying why. Its size (:func:`pool_tokens`): room for ``max_num_seqs`` requests of
``max_seq_len``, or fewer where that would take more than a fraction (:data:`DEFAULT_MEMORY_FRACTION`) of the memory
free on the device once the weights are loaded. When the free tokens are enough but scattered between spans, the
spans are moved down together (a copy of the cached positions, deterministic, so every tensor-parallel
rank that mirrors the allocations moves alike).

Rolling back is forgetting a length; compacting to a tree's accepted path moves a few positions within
the span — per sequence, never touching another's. The ``scratch`` columns past the capacity take the
keys of a batch's padding queries (a row's block shorter than the longest), which no query ever reads.

Reserving whole spans trades some capacity (a request that stops early held room for its whole
``max_tokens``) for steps that read each sequence's keys and values as a view: per-page tables were
measured to cost a gather of 5–16 ms per step at 16 requests on this CPU against a 34 ms plain step
(``bench/kv_paging.py``, BENCHMARKS.md §8).

The forward itself is :meth:`specserve.core.model.causal_lm.CausalLM.forward_batch`, which hands the model a
per-step :class:`PoolView` (a transformers ``Cache`` over the step's sequences) and attends each row over
its own span (:class:`specserve.core.attention.sdpa.RaggedBatch`). This module knows nothing of drafting,
verification or scheduling.
"""

from __future__ import annotations

import contextlib
import itertools
import os
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch
from transformers.cache_utils import (
    Cache,
    CacheLayerMixin,
    DummyLayer,
    LinearAttentionLayer,
    get_layer_types_and_kwargs,
)

from specserve.core.attention.sdpa import RaggedRow
from specserve.core.attention.windows import PARALLEL, RECURRENT
from specserve.core.errors import UserError
from specserve.core.kv.pool_states import PoolStates

if TYPE_CHECKING:
    from transformers import PreTrainedModel

# The share of the device's free memory (after the weights are loaded) a pool may take by default (kv_cache_memory)
DEFAULT_MEMORY_FRACTION = 0.5


class PoolFull(UserError):
    """Not enough free tokens, or a sequence longer than the pool; the message says which and what to change."""


@dataclass
class _Span:
    start: int  # first arena column
    reserved: int  # columns held
    length: int = 0  # cached positions: columns start .. start + length - 1


def kv_widths(config: Any) -> tuple[int, int, int]:
    """What one layer of a model with this transformers ``config`` caches per position: (heads, key width, value
    width). Multi-head latent attention (DeepSeek-V2/V3, Kimi K2) caches its compressed latent, as transformers
    does: one "head" of ``kv_lora_rank`` in the keys' place and the key's rotary part (``qk_rope_head_dim``) in the
    values'."""
    if getattr(config, "kv_lora_rank", None):
        return 1, int(config.kv_lora_rank), int(config.qk_rope_head_dim)
    heads = getattr(config, "num_key_value_heads", None) or config.num_attention_heads
    head_dim = getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads
    return int(heads), int(head_dim), int(head_dim)


def layer_kinds(model: PreTrainedModel) -> tuple[list[int], list[int]]:
    """The indices of ``model``'s decoder layers that cache keys and values, and of those that keep a recurrent state
    (a hybrid's: :mod:`specserve.core.kv.pool_states`); a layer with neither (an MLP-only one) is in neither."""
    types, _ = get_layer_types_and_kwargs(model.config.get_text_config(decoder=True))
    if PARALLEL in types:
        raise UserError(
            f"{type(model).__name__} runs attention and a recurrent mixer side by side in its layers, which the "
            "batched KV pool does not hold yet; serve it one request at a time (--max-num-seqs 1)"
        )
    attention = [i for i, kind in enumerate(types) if kind not in (RECURRENT, "dummy")]
    return attention, [i for i, kind in enumerate(types) if kind == RECURRENT]


def _layout(model: PreTrainedModel) -> tuple[int, int, int, int, torch.dtype, torch.device]:
    """Layers with keys and values, KV heads (a tensor-parallel rank's share), key and value widths, dtype and device
    of ``model``'s KV."""
    config = model.config
    heads, key_width, value_width = kv_widths(config)
    shard = getattr(model, "tensor_parallel", None)  # a tensor-parallel rank holds its share of the KV heads
    if shard is not None:
        heads = shard.num_kv_heads
    parameter = next(model.parameters())
    return len(layer_kinds(model)[0]), heads, key_width, value_width, parameter.dtype, parameter.device


def token_bytes(model: PreTrainedModel) -> int:
    """Bytes one token position takes in a pool of ``model``'s keys and values (this rank's share of the heads; a
    hybrid's recurrent states, per sequence and not per position, are not counted)."""
    layers, heads, key_width, value_width, dtype, _ = _layout(model)
    return layers * heads * (key_width + value_width) * torch.empty((), dtype=dtype).element_size()


def free_memory(device: torch.device) -> int:
    """Bytes free for new tensors on ``device``: the GPU's free memory, or the host's available memory (Linux's
    ``MemAvailable``; elsewhere the free physical pages)."""
    if device.type == "cuda":
        return int(torch.cuda.mem_get_info(device)[0])
    with contextlib.suppress(OSError, ValueError, IndexError):
        for line in Path("/proc/meminfo").read_text(encoding="ascii").splitlines():
            if line.startswith("MemAvailable:"):
                return int(line.split()[1]) * 1024
    return os.sysconf("SC_AVPHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")


def memory_tokens(model: PreTrainedModel, memory_fraction: float) -> int:
    """The token positions of ``model``'s KV that fit in ``memory_fraction`` of the memory free now on its device."""
    if not 0 < memory_fraction <= 1:
        raise ValueError(f"memory_fraction must be in (0, 1], got {memory_fraction}")
    return int(memory_fraction * free_memory(_layout(model)[5])) // token_bytes(model)


def pool_tokens(
    model: PreTrainedModel, max_num_seqs: int, max_seq_len: int, memory_fraction: float, fitting: int | None = None
) -> int:
    """The positions of a pool with room for ``max_num_seqs`` requests of ``max_seq_len`` tokens, or as many as fit
    in ``memory_fraction`` of the memory free now on the model's device (``fitting``, when the caller agreed on it
    with other ranks: :func:`memory_tokens`), whichever is fewer. Raises :class:`PoolFull` when that cannot hold one
    request of ``max_seq_len``."""
    if fitting is None:
        fitting = memory_tokens(model, memory_fraction)
    if fitting < max_seq_len:
        device = _layout(model)[5]
        raise PoolFull(
            f"the KV pool may take {memory_fraction:g} of the {free_memory(device) / 2**30:.1f} GiB free on {device} "
            f"(kv_cache_memory): {fitting} token positions of {token_bytes(model)} bytes, fewer than one request of "
            f"max_seq_len {max_seq_len}; raise kv_cache_memory, lower max_seq_len, or set kv_pool_tokens"
        )
    return min(max_num_seqs * max_seq_len, fitting)


class KVPool:
    """Keys and values of many sequences in ``capacity`` token positions, one contiguous span per sequence."""

    def __init__(self, model: PreTrainedModel, capacity: int, scratch: int = 1) -> None:
        if capacity < 1 or scratch < 1:
            raise ValueError(f"capacity and scratch must be >= 1, got {capacity}, {scratch}")
        layers, heads, key_width, value_width, dtype, device = _layout(model)
        self.keys, self.values = (
            [torch.zeros(heads, capacity + scratch, width, dtype=dtype, device=device) for _ in range(layers)]
            for width in (key_width, value_width)
        )
        self.capacity = capacity
        self.scratch = scratch
        # multi-head latent attention caches a latent the model expands to keys and values for every position a layer
        # returns: a step then returns only its rows' spans, gathered, not the whole arena (PoolView)
        self.gathers = bool(getattr(model.config, "kv_lora_rank", None))
        attention, recurrent = layer_kinds(model)
        self.num_layers = int(model.config.get_text_config(decoder=True).num_hidden_layers)
        self.arena_of = {layer: index for index, layer in enumerate(attention)}  # model layer -> keys / values index
        # a hybrid model's recurrent layers: their states per sequence, checkpointed (pool_states)
        self.states = PoolStates(recurrent) if recurrent else None
        self._spans: dict[int, _Span] = {}

    # -----------------------------------------------------------------------------------------
    # Sequences

    @property
    def free_tokens(self) -> int:
        """Positions no sequence has reserved."""
        return self.capacity - sum(span.reserved for span in self._spans.values())

    @property
    def num_sequences(self) -> int:
        return len(self._spans)

    @property
    def sequences(self) -> list[int]:
        """The ids of the sequences the pool holds."""
        return list(self._spans)

    def fits(self, tokens: int) -> bool:
        """Whether :meth:`allocate` of ``tokens`` would succeed now."""
        return tokens <= self.free_tokens

    def allocate(self, tokens: int) -> int:
        """Reserve ``tokens`` positions (all the sequence may ever hold) for a new sequence; returns its id."""
        if tokens < 1:
            raise ValueError(f"a sequence reserves at least 1 position, got {tokens}")
        if tokens > self.capacity:
            raise PoolFull(
                f"a sequence of {tokens} tokens does not fit a KV pool of {self.capacity}; shorten the prompt or "
                "max_new_tokens, or configure a larger pool"
            )
        if tokens > self.free_tokens:
            raise PoolFull(
                f"{tokens} tokens asked, {self.free_tokens} of the KV pool's {self.capacity} are free; wait for a "
                "sequence to finish"
            )
        start = self._gap(tokens)
        if start is None:  # enough free positions, but not in one piece
            self._pack()
            start = self.capacity - self.free_tokens
        sequence = next(i for i in itertools.count() if i not in self._spans)  # the lowest free id
        self._spans[sequence] = _Span(start, tokens)
        if self.states is not None:
            self.states.add(sequence)
        return sequence

    def free(self, sequence: int) -> None:
        self._span(sequence)
        del self._spans[sequence]
        if self.states is not None:
            self.states.remove(sequence)

    def length(self, sequence: int) -> int:
        return self._span(sequence).length

    def reserved(self, sequence: int) -> int:
        return self._span(sequence).reserved

    def rollback(self, sequence: int, length: int) -> None:
        """Keep the first ``length`` cached positions of ``sequence``."""
        span = self._span(sequence)
        if not 0 <= length <= span.length:
            raise ValueError(f"cannot roll sequence {sequence} of length {span.length} back to {length}")
        span.length = length
        if self.states is not None:
            self.states.rollback(sequence, length)

    def rewind_to_checkpoint(self, sequence: int) -> list[int]:
        """A hybrid's sequence before a step: its KV cut back to its recurrent states' checkpoint; the tokens past it,
        which the step reads again before the sequence's block (:meth:`PoolStates.pending`)."""
        assert self.states is not None, "only a pool with recurrent layers has checkpoints"
        span = self._span(sequence)
        pending = self.states.pending(sequence, span.length)
        span.length = self.states.start(sequence)
        return pending

    @torch.inference_mode()
    def compact(self, sequence: int, keep: Sequence[int]) -> None:
        """Keep only the positions ``keep`` (strictly increasing) of ``sequence``, moved to ``0 .. len(keep) - 1``."""
        keep = list(keep)
        span = self._span(sequence)
        if self.states is not None and keep != list(range(len(keep))):
            raise ValueError("a pool with recurrent layers keeps a prefix of a sequence only; its blocks are chains")
        if any(b <= a for a, b in itertools.pairwise(keep)) or (keep and not 0 <= keep[0] <= keep[-1] < span.length):
            raise ValueError(f"positions to keep must be strictly increasing and below {span.length}, got {keep}")
        unchanged = next((i for i, p in enumerate(keep) if p != i), len(keep))
        moved = keep[unchanged:]
        if moved:
            index = torch.tensor(moved, dtype=torch.long, device=self.keys[0].device) + span.start
            first = span.start + unchanged
            for tensor in (*self.keys, *self.values):
                tensor[:, first : first + len(moved)] = tensor.index_select(1, index)
        span.length = len(keep)

    @torch.inference_mode()
    def copy(self, source: int, target: int, start: int, stop: int) -> None:
        """Copy ``source``'s cached positions ``start .. stop - 1`` to the same positions of ``target``, which caches
        exactly ``start`` positions now and ``stop`` after (a prefix cache hit: the keys and values of the same
        tokens at the same positions)."""
        src, dst = self._span(source), self._span(target)
        kept = self.states is None or self.states.reusable(source, stop) == stop
        if source == target or not 0 <= start <= stop <= src.length or dst.length != start or stop > dst.reserved:
            raise ValueError(
                f"cannot copy positions {start}..{stop} of sequence {source} (length {src.length}) to sequence "
                f"{target} (length {dst.length}, reserved {dst.reserved})"
            )
        if not kept:
            raise ValueError(f"sequence {source}'s recurrent states are not kept after {stop} tokens: nothing to copy")
        for tensor in (*self.keys, *self.values):
            tensor[:, dst.start + start : dst.start + stop] = tensor[:, src.start + start : src.start + stop]
        dst.length = stop
        if self.states is not None:  # a hybrid's: up to the source's recurrent checkpoint, whose states it takes
            self.states.adopt(source, target, stop)

    def shrink(self, sequence: int, reserved: int) -> None:
        """Give back the reserved positions of ``sequence`` past ``reserved`` (at least its length, and 1)."""
        span = self._span(sequence)
        if not max(span.length, 1) <= reserved <= span.reserved:
            raise ValueError(f"sequence {sequence} of length {span.length} cannot reserve {reserved} positions")
        span.reserved = reserved

    def readable_layers(self, layers: int) -> bool:
        """Whether :meth:`read` can hand out the first ``layers`` model layers: each keeps plain keys and values here
        (not a latent, not a recurrent state)."""
        return not self.gathers and all(layer in self.arena_of for layer in range(layers))

    def read(self, sequence: int, layers: int, start: int, stop: int) -> list[tuple[torch.Tensor, torch.Tensor]]:
        """Views of ``sequence``'s cached keys and values at positions ``start .. stop - 1`` for the first ``layers``
        model layers (``[1, heads, stop - start, head_dim]`` each; valid until the pool next changes)."""
        span = self._span(sequence)
        if not self.readable_layers(layers):
            raise ValueError(f"the first {layers} layers of this pool do not all keep plain keys and values")
        if not 0 <= start <= stop <= span.length:
            raise ValueError(f"cannot read positions {start}..{stop} of sequence {sequence} (length {span.length})")
        first, last = span.start + start, span.start + stop
        arenas = [self.arena_of[layer] for layer in range(layers)]
        return [(self.keys[a][None, :, first:last], self.values[a][None, :, first:last]) for a in arenas]

    def snapshot(self, sequence: int) -> list[tuple[torch.Tensor, torch.Tensor]]:
        """A copy of the sequence's cached keys and values, per layer (``[1, heads, length, head_dim]`` each)."""
        span = self._span(sequence)
        stop = span.start + span.length
        return [(k[None, :, span.start : stop].clone(), v[None, :, span.start : stop].clone())
                for k, v in zip(self.keys, self.values, strict=True)]  # fmt: skip

    def _span(self, sequence: int) -> _Span:
        span = self._spans.get(sequence)
        if span is None:
            raise ValueError(f"sequence {sequence} is not allocated")
        return span

    def _gap(self, tokens: int) -> int | None:
        """The start of the first free run of at least ``tokens`` positions, if any."""
        cursor = 0
        for span in sorted(self._spans.values(), key=lambda s: s.start):
            if span.start - cursor >= tokens:
                return cursor
            cursor = span.start + span.reserved
        return cursor if self.capacity - cursor >= tokens else None

    @torch.inference_mode()
    def _pack(self) -> None:
        """Move every span down, in order, so the free positions form one run at the end."""
        cursor = 0
        for span in sorted(self._spans.values(), key=lambda s: s.start):
            if span.start != cursor:
                for tensor in (*self.keys, *self.values):
                    tensor[:, cursor : cursor + span.length] = tensor[:, span.start : span.start + span.length].clone()
                span.start = cursor
            cursor += span.reserved

    # -----------------------------------------------------------------------------------------
    # One step's view

    def extend(self, sequences: Sequence[int], blocks: Sequence[int]) -> tuple[list[int], list[int]]:
        """Grow each of ``sequences`` (distinct) by its block of ``blocks[b]`` (>= 1) tokens, within what it reserved;
        per sequence, its span's start and its length before the step."""
        if len(set(sequences)) != len(sequences) or min(blocks) < 1:
            raise ValueError(
                f"a batch needs distinct sequences and blocks of >= 1 token, got {list(sequences)}, {list(blocks)}"
            )
        spans = [self._span(sequence) for sequence in sequences]
        for sequence, span, k in zip(sequences, spans, blocks, strict=True):
            if span.length + k > span.reserved:
                raise PoolFull(
                    f"sequence {sequence} would hold {span.length + k} positions, more than the {span.reserved} it "
                    "reserved"
                )
        starts, lengths = [span.start for span in spans], [span.length for span in spans]
        for span, k in zip(spans, blocks, strict=True):
            span.length += k
        return starts, lengths

    def view(self, sequences: Sequence[int], blocks: Sequence[int], width: int | None = None) -> PoolView:
        """The cache one batched forward writes: row b is ``sequences[b]``, extended by ``blocks[b]`` tokens, every
        row ``width`` columns wide (default: the widest block; the rest of a row is padding).

        Grows each sequence's length by its block (the caller rolls back or compacts after verifying)."""
        if width is not None and width < max(blocks, default=0):
            raise ValueError(f"a step {width} columns wide cannot hold a block of {max(blocks)}")
        starts, lengths = self.extend(sequences, blocks)
        recurrent = self.states.step_layers(sequences) if self.states is not None else {}
        return PoolView(self, starts, lengths, list(blocks), width, recurrent)


class StepLayer(CacheLayerMixin):
    """A transformers cache layer over keys and values allocated up front, for one step: initialised from the start,
    never lazily, with no maximum length. Subclasses say where a step writes and what it attends over."""

    is_sliding = False
    is_compileable = False

    def __init__(self) -> None:
        super().__init__()
        self.is_initialized = True

    def lazy_initialization(self, key_states: torch.Tensor, value_states: torch.Tensor) -> None:
        pass  # allocated up front

    def get_max_length(self) -> int:
        return -1


class _PoolLayer(StepLayer):
    """One model layer's share of a :class:`PoolView`: writes the step's keys and values into the arena."""

    def __init__(self, view: PoolView, layer: int) -> None:
        super().__init__()
        self.view = view
        self.layer = layer

    def update(
        self, key_states: torch.Tensor, value_states: torch.Tensor, *args: Any, **kwargs: Any
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """``key_states`` [B, kv_heads, k_max, head_dim] -> this layer's whole arena, ``[1, kv_heads, columns,
        head_dim]`` (each row attends over its own span of it)."""
        keys, values = self.view.pool.keys[self.layer], self.view.pool.values[self.layer]
        heads, columns = keys.shape[0], self.view.columns
        keys.index_copy_(1, columns, key_states.transpose(0, 1).reshape(heads, columns.numel(), -1))
        values.index_copy_(1, columns, value_states.transpose(0, 1).reshape(heads, columns.numel(), -1))
        gathered = self.view.gathered
        if gathered is not None:  # only the rows' spans, one after another (PoolView.rows numbers them so)
            return keys.index_select(1, gathered)[None], values.index_select(1, gathered)[None]
        return keys[None], values[None]

    def get_mask_sizes(self, query_length: int) -> tuple[int, int]:
        return self.view.pool.capacity + self.view.pool.scratch, 0

    def get_seq_length(self) -> int:
        return max(self.view.lengths)


class PoolView(Cache):
    """A transformers ``Cache`` over the sequences of one batched forward (built by :meth:`KVPool.view`).

    Row b writes its block at columns ``starts[b] + lengths[b] ..`` of the arena; a padding query of a
    shorter block writes into the scratch columns. Every layer returns its whole arena: the caller's
    :class:`~specserve.core.attention.sdpa.RaggedBatch` (:meth:`rows`) attends each row over its own span. A latent pool
    (multi-head latent attention, whose model expands every position a layer returns into every head's keys and
    values) returns only the rows' spans instead, gathered one after another, so a step expands its own positions,
    not the whole pool's.
    """

    def __init__(
        self,
        pool: KVPool,
        starts: list[int],
        lengths: list[int],
        blocks: list[int],
        width: int | None = None,
        recurrent: dict[int, LinearAttentionLayer] | None = None,
    ) -> None:
        self.pool = pool
        self.starts = starts
        self.lengths = lengths
        self.blocks = blocks
        width = max(blocks) if width is None else width
        columns = torch.empty(len(blocks), width, dtype=torch.long)
        for b, (start, length, k) in enumerate(zip(starts, lengths, blocks, strict=True)):
            columns[b, :k] = torch.arange(start + length, start + length + k)
            columns[b, k:] = pool.capacity + torch.arange(width - k) % pool.scratch
        self.columns = columns.flatten().to(pool.keys[0].device)  # row-major: row b's columns, then row b + 1's
        # a latent pool (multi-head latent attention) returns each row's span after this step, gathered in row order
        self.gathered: torch.Tensor | None = None
        if pool.gathers:
            spans = zip(starts, lengths, blocks, strict=True)
            self.gathered = torch.cat([torch.arange(start, start + n + k) for start, n, k in spans])
            self.gathered = self.gathered.to(pool.keys[0].device)
        self.width = width
        self.recurrent = recurrent or {}  # a hybrid's recurrent layers: the rows' states (pool_states)
        layers: list[Any] = []
        for layer in range(pool.num_layers):
            arena = pool.arena_of.get(layer)
            layers.append(_PoolLayer(self, arena) if arena is not None else self.recurrent.get(layer, DummyLayer()))
        super().__init__(layers=layers)

    def rows(
        self, masks: Sequence[torch.Tensor | None], positions: Sequence[torch.Tensor] | None = None
    ) -> list[RaggedRow]:
        """Per row, its span after this step's block, its mask (``[k, length + k]`` additive, or ``None``) and, for a
        model with sliding windows, its block's positions (``[k]``)."""
        where = positions if positions is not None else [None] * len(masks)
        starts = self.starts
        if self.gathered is not None:  # the layers return the rows' spans one after another
            spans = (length + k for length, k in zip(self.lengths, self.blocks, strict=True))
            starts = list(itertools.accumulate(spans, initial=0))
        return [
            RaggedRow(start, start + length + k, k, mask, row_positions)
            for start, length, k, mask, row_positions in zip(
                starts, self.lengths, self.blocks, masks, where, strict=False
            )
        ]
