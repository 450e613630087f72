"""A static-shape KV cache: preallocated keys and values, verify blocks padded to buckets, forwards replayable as
CUDA graphs.

:class:`StaticSlots` owns one model's *slots*, each holding the keys and values of one sequence in preallocated
tensors of ``columns = max_len + widest bucket`` positions per layer, and hands them out as :class:`StaticKVCache`
objects (one per request; the slot returns when the cache is released or dropped). A :class:`StaticKVCache` quacks
like :class:`~specserve.core.model.causal_lm.KVCache` — ``length``, ``rollback``, ``compact``, ``snapshot``. Subclasses
say how a step calls their model: :class:`StaticTarget` wraps a loaded :class:`~specserve.core.model.causal_lm.CausalLM`
(the target, or a draft model), whose :meth:`~specserve.core.model.causal_lm.CausalLM.forward` and
:meth:`~specserve.core.model.causal_lm.CausalLM.forward_tree` hand their blocks to the cache, so the engine's
:class:`~specserve.core.target.LocalSequence` and the draft model run on it unchanged; the EAGLE head's
``HeadSlots`` (:mod:`specserve.drafters.eagle`) feed its features beside the tokens.

A block (:class:`SlotBlock`) of k tokens — a chain, a tree, a prefill chunk, a drafter's tree level — runs at width
``buckets.width(k)`` (:mod:`specserve.core.model.buckets`): the pad tokens follow the real ones, see only themselves,
and write their keys and values at the columns after the block — beyond the committed text, where the verifier's
rollback drops them and the next block overwrites them. Real tokens never see a pad, so padding changes no output.
A block may *reach back* over the last cached positions and see only some of them (a tree level sees its ancestors
among the nodes forwarded before it); the reach pads to a bucket too, the extra positions being ones every row sees.
The step is one function of tensors only — the block's tokens, positions, what it sees, the cached length and reach
— which builds the attention mask and the columns it writes on the device. With a graph backend
(:mod:`specserve.core.static.graphs`: a CUDA device and ``cuda_graphs``) every (slot, width, outputs, reach) is captured
once and replayed; the step then attends over all ``columns`` positions under the mask, as the graph's shapes must
not depend on the length. Eagerly (a CPU, no graphs, a block wider than every bucket) it attends over the cached
length and the block only. A model with sliding windows gets them in the same masks, by position
(:mod:`specserve.core.attention.windows`: one mask per layer type when full and windowed layers alternate); a hybrid
model's recurrent layers are refused.

Does not verify or sample (the verifier does, on the logits it gets back) and serves one model in one process;
the batched engine's pool is :mod:`specserve.core.kv.pool`.
"""

from __future__ import annotations

import itertools
import weakref
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import torch
from transformers.cache_utils import Cache

from specserve.core.errors import UserError
from specserve.core.kv.pool import StepLayer, kv_widths
from specserve.core.model.causal_lm import BatchBlock, CausalLM, FeatureCapture, select_features
from specserve.core.static.graphs import CudaGraphs, GraphBackend, GraphCache
from specserve.core.static.options import StaticOptions

__all__ = [
    "SlotBlock",
    "SlotRows",
    "StaticCacheFull",
    "StaticKVCache",
    "StaticSlots",
    "StaticTarget",
    "use_static_shapes",
]


TAIL_ROOM = 128
"""Columns past ``max_len`` at least: a verify block may reach past the request's last position (a tree's nodes are
cut by depth, not by count), and a padded one by its padding."""

EAGER_COLUMNS = 256
"""Columns a slot starts with when no graph reads it (it doubles as its sequence grows, up to the full width): a
model with a long context, an EAGLE head's default slots among them, holds only what its sequences use."""


class StaticCacheFull(UserError):
    """A sequence outgrew its static cache; the message says how to size it."""


class _Slot:
    """One sequence's preallocated keys and values (``[1, kv_heads, columns, head_dim]`` per layer)."""

    def __init__(self, index: int, keys: list[torch.Tensor], values: list[torch.Tensor]) -> None:
        self.index = index
        self.keys = keys
        self.values = values
        self._length = 0
        # the length on the device too, set by a kernel rather than copied from the host: a step needs no copy
        self.length_t = torch.zeros(1, dtype=torch.long, device=keys[0].device)
        self.columns: torch.Tensor | None = None  # the current step's write columns (set inside the step)
        self.visible = 0  # columns the current step attends over

    @property
    def length(self) -> int:
        return self._length

    @length.setter
    def length(self, value: int) -> None:
        if value != self._length:
            self.length_t.fill_(value)
        self._length = value

    @property
    def capacity(self) -> int:
        return int(self.keys[0].shape[2])

    def grow(self, columns: int) -> None:
        """Reallocate to ``columns`` positions, keeping the cached ones (never for a slot a graph reads)."""
        n = self._length
        for tensors in (self.keys, self.values):
            for i, old in enumerate(tensors):
                new = old.new_zeros(*old.shape[:2], columns, old.shape[3])
                new[:, :, :n] = old[:, :, :n]
                tensors[i] = new


class _SlotLayer(StepLayer):
    """One model layer's share of a slot: writes a step's keys and values at its columns."""

    def __init__(self, slot: _Slot, layer: int) -> None:
        super().__init__()
        self.slot = slot
        self.layer = layer

    def update(
        self, key_states: torch.Tensor, value_states: torch.Tensor, *args: Any, **kwargs: Any
    ) -> tuple[torch.Tensor, torch.Tensor]:
        slot = self.slot
        assert slot.columns is not None, "a slot layer is updated only inside a static step"
        keys, values = slot.keys[self.layer], slot.values[self.layer]
        keys.index_copy_(2, slot.columns, key_states)
        values.index_copy_(2, slot.columns, value_states)
        return keys[:, :, : slot.visible], values[:, :, : slot.visible]

    def get_mask_sizes(self, query_length: int) -> tuple[int, int]:
        return self.slot.visible, 0

    def get_seq_length(self) -> int:
        return self.slot.length


class _SlotCache(Cache):
    """The transformers ``Cache`` a static step hands the model."""

    def __init__(self, slot: _Slot) -> None:
        super().__init__(layers=[_SlotLayer(slot, i) for i in range(len(slot.keys))])


class _RowsLayer(StepLayer):
    """One model layer's share of a :class:`SlotRows`."""

    def __init__(self, rows: SlotRows, layer: int) -> None:
        super().__init__()
        self.rows = rows
        self.layer = layer

    def update(
        self, key_states: torch.Tensor, value_states: torch.Tensor, *args: Any, **kwargs: Any
    ) -> tuple[torch.Tensor, torch.Tensor]:
        return self.rows.write(self.layer, key_states, value_states)

    def get_mask_sizes(self, query_length: int) -> tuple[int, int]:
        return self.rows.columns, 0

    def get_seq_length(self) -> int:
        return max(self.rows.lengths)


class SlotRows(Cache):
    """The transformers ``Cache`` of one eager forward over several slots' sequences at once, each extended by a causal
    block of its own (``sizes[b]`` tokens; row b of the forward's ``[rows, width]`` input, padded after them).

    Each layer writes row b's keys and values into its slot after its cached positions and hands attention every
    row's cached positions and block, gathered and padded to the longest (a copy of the rows' keys and values per
    layer: for a small model's few layers, what many one-row forwards would cost in launches instead); the forward
    takes :attr:`attention_mask` (row b's real queries see its own positions causally, a padding query only its row's
    first position) and :attr:`position_ids`. :meth:`advance` then counts the blocks as cached. Real queries never
    see another row or a pad, so a row's outputs equal its one-row forward's up to rounding. Eager only: the slots
    grow as needed, and nothing is captured as a graph."""

    def __init__(self, caches: Sequence[StaticKVCache], sizes: Sequence[int], dtype: torch.dtype) -> None:
        if not caches or len(caches) != len(sizes) or min(sizes) < 1:
            raise ValueError(f"one block of >= 1 token per cache, got {len(caches)} caches and sizes {list(sizes)}")
        self.slots = [cache.slot for cache in caches]
        if len({id(slot) for slot in self.slots}) < len(self.slots):
            raise ValueError("a slot appears more than once in one forward")
        self.sizes = list(sizes)
        self.lengths = [slot.length for slot in self.slots]
        self.columns = max(length + k for length, k in zip(self.lengths, self.sizes, strict=True))
        width = max(self.sizes)
        for slot, length, k in zip(self.slots, self.lengths, self.sizes, strict=True):
            if length + k > slot.capacity:
                owner = caches[0].owner
                if length + k > owner.columns:
                    raise StaticCacheFull(f"{length + k} positions do not fit a static cache of {owner.columns}")
                slot.grow(min(owner.columns, max(2 * slot.capacity, length + k)))
        device = self.slots[0].keys[0].device
        visible = torch.zeros(len(self.slots), width, self.columns, dtype=torch.bool)
        positions = torch.zeros(len(self.slots), width, dtype=torch.long)
        for b, (length, k) in enumerate(zip(self.lengths, self.sizes, strict=True)):
            visible[b, :k, : length + k] = torch.ones(k, length + k, dtype=torch.bool).tril(length)
            visible[b, k:, 0] = True
            positions[b, :k] = torch.arange(length, length + k)
        mask = torch.zeros(visible.shape, dtype=dtype).masked_fill_(~visible, torch.finfo(dtype).min)
        self.attention_mask = mask[:, None].to(device)
        self.position_ids = positions.to(device)
        super().__init__(layers=[_RowsLayer(self, i) for i in range(len(self.slots[0].keys))])

    def write(
        self, layer: int, key_states: torch.Tensor, value_states: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """One layer's step: each row's block into its slot; every row's positions, gathered (``[rows, heads,
        columns, head_dim]`` each)."""
        rows, heads, _, _ = key_states.shape
        keys = key_states.new_zeros(rows, heads, self.columns, key_states.shape[3])
        values = value_states.new_zeros(rows, heads, self.columns, value_states.shape[3])
        for b, (slot, length, k) in enumerate(zip(self.slots, self.lengths, self.sizes, strict=True)):
            end = length + k
            for store, new, out in ((slot.keys[layer], key_states, keys), (slot.values[layer], value_states, values)):
                store[0, :, length:end] = new[b, :, :k]
                out[b, :, :end] = store[0, :, :end]
        return keys, values

    def advance(self) -> None:
        """The forward ran: each slot now caches its block too."""
        for slot, k in zip(self.slots, self.sizes, strict=True):
            slot.length += k


@dataclass(frozen=True)
class SlotBlock:
    """A block a slot's step appends after the cached length: its tokens, their positions after that length, what
    each sees, and any per-row inputs beside the tokens (an EAGLE head's features).

    ``sees`` is ``[k, back + k]`` bool over a *window*: the last ``back`` cached positions and the block itself;
    every cached position before the window is seen by every row. ``None`` is a causal chain (``back`` 0)."""

    tokens: torch.Tensor  # [k] int64
    offsets: tuple[int, ...]  # [k] positions after the cached length (negative ones reach back into the window)
    sees: torch.Tensor | None = None  # [k, back + k] bool; None = causal, back 0
    rows: tuple[torch.Tensor, ...] = ()  # [k, ...] each

    @property
    def size(self) -> int:
        return int(self.tokens.shape[0])

    @property
    def back(self) -> int:
        return 0 if self.sees is None else int(self.sees.shape[1]) - self.size

    @staticmethod
    def of(block: BatchBlock) -> SlotBlock:
        """A verify block (:class:`~specserve.core.model.causal_lm.BatchBlock`): its ancestry over itself, nothing
        cached before it seen selectively."""
        return SlotBlock(block.tokens, block.offsets, block.ancestry)


class StaticSlots:
    """One model's slots, buckets and graphs (see the module docstring); a subclass says how its step calls the
    model (:meth:`_call`). Steps are :meth:`run`: the block padded to its bucket, the mask and the write columns built
    on the device, captured and replayed per (slot, width, window, outputs) with a graph backend."""

    def __init__(
        self,
        config: Any,  # the transformers config of the layers whose keys and values the slots hold
        dtype: torch.dtype,
        device: torch.device,
        max_positions: int,
        options: StaticOptions,
        backend: GraphBackend | None = None,
    ) -> None:
        """``backend``: how graphs are captured; by default CUDA graphs on a CUDA device with ``cuda_graphs``, and
        none (every step eager) otherwise."""
        self.options = options
        self.dtype, self.device = dtype, device
        self.buckets = options.buckets_for(device.type)
        self.max_len = options.max_len or max_positions
        # room past max_len for a padded block, or a tree near the end (its nodes are cut by depth, not by count)
        self.columns = self.max_len + max(self.buckets.largest, TAIL_ROOM)
        if backend is None and options.cuda_graphs and device.type == "cuda":
            backend = CudaGraphs(device)
        self.graphs = GraphCache(backend)
        self._heads, self._key_dim, self._value_dim = kv_widths(config)
        self._layers = int(config.num_hidden_layers)
        self._slots: list[_Slot] = []
        self._free: list[_Slot] = []
        self._low = torch.finfo(dtype).min
        self._layouts: dict[tuple[int, int], tuple[torch.Tensor, torch.Tensor]] = {}  # a chain's, by (k, width)
        self._scalars: dict[int, torch.Tensor] = {}

    @property
    def graphed(self) -> bool:
        return self.graphs.backend is not None

    def new_cache(self) -> StaticKVCache:
        """A cache over a free slot (a new slot when every one is in use)."""
        slot = self._free.pop() if self._free else self._new_slot()
        slot.length = 0
        return StaticKVCache(self, slot)

    def _new_slot(self) -> _Slot:
        # a graph's slot has every column from the start; an eager one grows as its sequence does
        columns = self.columns if self.graphed else min(self.columns, EAGER_COLUMNS)
        shapes = ((1, self._heads, columns, width) for width in (self._key_dim, self._value_dim))
        keys, values = (
            [torch.zeros(shape, dtype=self.dtype, device=self.device) for _ in range(self._layers)] for shape in shapes
        )
        slot = _Slot(len(self._slots), keys, values)
        self._slots.append(slot)
        return slot

    def capture(self, last_only: Sequence[bool] = (False,)) -> list[object]:
        """Capture every bucket's chain step now (on a free slot, whose contents do not matter until a sequence
        writes them), rather than on a request's first block of that width; returns the keys captured. Nothing
        happens without a graph backend."""
        if not self.graphed:
            return []
        cache = self.new_cache()
        before = set(self.graphs.keys)
        try:
            for width in self.buckets.widths:
                if width > self.max_len:
                    break
                for last in last_only:
                    tokens = torch.zeros(width, dtype=torch.long)
                    self.run(cache.slot, SlotBlock(tokens, tuple(range(width)), rows=self._blank_rows(width)), last)
                    cache.rollback(0)
        finally:
            cache.release()
        return [key for key in self.graphs.keys if key not in before]

    def _release(self, slot: _Slot) -> None:
        if slot not in self._free:
            self._free.append(slot)

    # -----------------------------------------------------------------------------------------
    # What a subclass says

    def _call(
        self,
        cache: Cache,
        ids: torch.Tensor,
        rows: Sequence[torch.Tensor],
        shape: dict[str, torch.Tensor],
        last: torch.Tensor,
        last_only: bool,
        hidden: bool,
    ) -> tuple[torch.Tensor, ...]:
        """Run the model on ``ids`` (``[w]``) and ``rows`` with ``cache``; ``shape`` holds ``attention_mask`` and
        ``position_ids`` (none for a causal chain, whose mask and positions transformers builds). ``last`` (``[1]``)
        is the last real row, ``last_only`` whether only its outputs are wanted."""
        raise NotImplementedError

    def _blank_rows(self, width: int) -> tuple[torch.Tensor, ...]:
        """Per-row inputs of ``width`` rows for a capture (none but the tokens by default)."""
        return ()

    # -----------------------------------------------------------------------------------------
    # One step

    @torch.inference_mode()
    def run(
        self, slot: _Slot, block: SlotBlock, last_only: bool = False, hidden: bool = False
    ) -> tuple[tuple[torch.Tensor, ...], bool]:
        """Append ``block`` to the slot's sequence; the step's outputs at its padded width (rows past the block's
        ``k`` are padding), and whether they came from a graph: then they are the graph's own tensors, valid until
        its next replay, and a caller keeping them copies them."""
        k, back = block.size, block.back
        width = self.buckets.width(k)
        if slot.length + width > self.columns:
            if slot.length + k > self.columns:
                raise StaticCacheFull(
                    f"a sequence of {slot.length + k} positions does not fit the static cache of {self.max_len}; "
                    "raise --max-len (StaticOptions.max_len) or shorten the request"
                )
            width = k  # the padding would not fit, the block does: run it at its own width
        # a window reaching back pads its reach to a bucket too (the extra columns are cached text, seen by all)
        reach = self.buckets.width(back) if back else 0
        if reach > slot.length:
            reach = back
        ids = block.tokens.to(self.device, torch.long)  # where the drafter made them: no transfer back to the host
        rows = tuple(row.to(self.device) for row in block.rows)
        if width > k:
            ids = torch.cat([ids, ids.new_zeros(width - k)])
            rows = tuple(torch.cat([row, row.new_zeros(width - k, *row.shape[1:])]) for row in rows)
        offsets, sees = self._layout(block, width, reach)
        inputs = [ids, offsets, sees, slot.length_t, self._scalar(reach), self._scalar(k - 1), *rows]
        graphed = self.graphed and self.buckets.bucket(k) == width and (not back or self.buckets.bucket(back) == reach)
        if not graphed and slot.length + width > slot.capacity:
            slot.grow(min(self.columns, max(2 * slot.capacity, slot.length + width)))
        slot.visible = self.columns if graphed else slot.length + width

        # eagerly, an unpadded chain is an ordinary causal block: transformers builds its mask and positions, as for
        # a growing cache (a mask built here costs a one-token draft step about 10 % on a CPU); a sliding window is
        # applied in the masks built here
        causal = not graphed and width == k and block.sees is None and not self.windowed

        def step(tensors: Sequence[torch.Tensor]) -> tuple[torch.Tensor, ...]:
            return self._step(slot, tensors, last_only, hidden, causal)

        key = (slot.index, width, last_only, hidden, reach)
        outputs = self.graphs.run(key, step, inputs) if graphed else step(inputs)
        slot.length += k
        return outputs, graphed

    windowed = False  # whether the model attends within sliding windows (window_masks applies them)

    def window_masks(
        self, mask: torch.Tensor, query_positions: torch.Tensor, key_positions: torch.Tensor
    ) -> torch.Tensor | dict[str, torch.Tensor]:
        """The ``attention_mask`` a step passes for its additive ``mask`` (``[1, 1, width, visible]``; the queries'
        and the columns' positions): the mask itself, for a model without sliding windows."""
        return mask

    def _scalar(self, value: int) -> torch.Tensor:
        """``[value]`` on the device, kept."""
        if value not in self._scalars:
            self._scalars[value] = torch.tensor([value], dtype=torch.long, device=self.device)
        return self._scalars[value]

    def _layout(self, block: SlotBlock, width: int, reach: int) -> tuple[torch.Tensor, torch.Tensor]:
        """The block's positions after the cached length (``[width]``; a pad's is 0) and what each of its rows sees
        of the window (``[width, reach + width]`` bool over the last ``reach`` cached positions and the block; a
        pad sees only itself), on the device: a chain's are the same every time, kept."""
        k, back = block.size, block.back
        chain = block.sees is None
        if chain and (k, width) in self._layouts:
            return self._layouts[(k, width)]
        offsets = torch.zeros(width, dtype=torch.long)
        offsets[:k] = torch.tensor(block.offsets)
        sees = torch.zeros(width, reach + width, dtype=torch.bool)
        sees[:, reach:].fill_diagonal_(True)
        sees[:k, : reach - back] = True  # cached text the padded reach takes in: seen, as before the window
        own = torch.ones(k, k, dtype=torch.bool).tril() if block.sees is None else block.sees
        sees[:k, reach - back : reach + k] = own
        layout = offsets.to(self.device), sees.to(self.device)
        if chain:
            self._layouts[(k, width)] = layout
        return layout

    def _step(
        self, slot: _Slot, tensors: Sequence[torch.Tensor], last_only: bool, hidden: bool, causal: bool = False
    ) -> tuple[torch.Tensor, ...]:
        """The step as a function of tensors: ``ids``, ``offsets`` (positions after the cached length), ``sees``
        (``[w, reach + w]`` bool), ``length`` (cached positions), ``reach`` (cached positions in the window) and
        ``last`` (the last real token's row), ``[1]`` each, then the per-row inputs. Builds the mask and the columns
        on the device; ``causal`` (an eager, unpadded chain) leaves the mask and the positions to transformers."""
        ids, offsets, sees, length, reach, last, *rows = tensors
        width, window, device = ids.shape[0], sees.shape[1], ids.device
        slot.columns = length + torch.arange(width, device=device)
        shape: dict[str, Any] = {}
        if not causal:
            columns = torch.arange(slot.visible, device=device)
            relative = columns[None, :] - (length - reach)  # [1, visible]: column - the window's first column
            in_window = (relative >= 0) & (relative < window)
            row_sees = sees.gather(1, relative.clamp(0, window - 1).expand(width, -1))
            allowed = (relative < 0) | (in_window & row_sees)
            mask = torch.zeros(width, slot.visible, dtype=self.dtype, device=device)
            mask = mask.masked_fill_(~allowed, self._low)[None, None]
            shape["attention_mask"] = self.window_masks(mask, length + offsets, columns)
            shape["position_ids"] = (length + offsets)[None]
        try:
            return self._call(_SlotCache(slot), ids, rows, shape, last, last_only, hidden)
        finally:
            slot.columns = None


class StaticTarget(StaticSlots):
    """A :class:`~specserve.core.model.causal_lm.CausalLM`'s static-shape forwards (the target's, or a draft
    model's)."""

    def __init__(self, model: CausalLM, options: StaticOptions, backend: GraphBackend | None = None) -> None:
        if model.windows.recurrent:
            raise UserError(
                f"{model.info.architecture} has recurrent (linear-attention or state-space) layers, whose state the "
                "static-shape engine does not hold; serve it without --static-shapes"
            )
        config = model.model.config
        super().__init__(config, model.dtype, model.device, model.info.max_positions, options, backend)
        self.model = model
        self.windowed = model.windows.active
        self._model: Any = model.model
        if options.compile:
            self._model = torch.compile(model.model, dynamic=False)

    def window_masks(
        self, mask: torch.Tensor, query_positions: torch.Tensor, key_positions: torch.Tensor
    ) -> torch.Tensor | dict[str, torch.Tensor]:
        """The step's mask with the model's sliding windows applied, by position (per layer type when full and windowed
        layers alternate: :meth:`~specserve.core.attention.windows.LayerWindows.mask_argument`). A pad query (at the
        cached length) sees only itself, which is in every window."""
        return self.model.windows.mask_argument(mask, query_positions, key_positions)

    @torch.inference_mode()
    def forward_block(
        self, slot: _Slot, block: BatchBlock, last_only: bool = False, capture: FeatureCapture | None = None
    ) -> torch.Tensor:
        """Append ``block`` (its ``seq_id`` unused) to the slot's sequence; its ``[k, vocab]`` logits (``[1, vocab]``,
        the last token's, with ``last_only``), and with ``capture`` its tokens' features."""
        k = block.size
        outputs, graphed = self.run(slot, SlotBlock.of(block), last_only, capture is not None)
        logits = outputs[0][:1] if last_only else outputs[0][:k]
        if capture is not None:
            capture.value = select_features([h[:k] for h in outputs[1:]], capture.layers).clone()
        return logits.clone() if graphed else logits

    def _call(
        self,
        cache: Cache,
        ids: torch.Tensor,
        rows: Sequence[torch.Tensor],
        shape: dict[str, torch.Tensor],
        last: torch.Tensor,
        last_only: bool,
        hidden: bool,
    ) -> tuple[torch.Tensor, ...]:
        kwargs: dict[str, Any] = {self.model._cache_kwarg: cache, "use_cache": True, **shape}
        if last_only:
            kwargs["logits_to_keep"] = last if shape else 1
        if hidden:
            kwargs["output_hidden_states"] = True
        out = self._model(input_ids=ids[None], **kwargs)
        if hidden:
            return (out.logits[0], *(h[0] for h in out.hidden_states))
        return (out.logits[0],)


class StaticKVCache:
    """One sequence's KV in a slot of a :class:`StaticTarget`; the interface of
    :class:`~specserve.core.model.causal_lm.KVCache` plus :meth:`forward_block`. :meth:`release` (or dropping it)
    returns the slot."""

    def __init__(self, owner: StaticSlots, slot: _Slot) -> None:
        self.owner = owner
        self.slot = slot
        self._finalizer = weakref.finalize(self, owner._release, slot)

    @property
    def length(self) -> int:
        return self.slot.length

    def forward_block(
        self, block: BatchBlock, last_only: bool = False, capture: FeatureCapture | None = None
    ) -> torch.Tensor:
        assert isinstance(self.owner, StaticTarget), "verify blocks run on a model's slots"
        return self.owner.forward_block(self.slot, block, last_only, capture)

    def rollback(self, length: int) -> None:
        """Keep the first ``length`` cached positions (the rest stay in place, unseen, until overwritten)."""
        if not 0 <= length <= self.slot.length:
            raise ValueError(f"cannot roll back a cache of length {self.slot.length} to {length}")
        self.slot.length = length

    @torch.inference_mode()
    def compact(self, keep: Sequence[int]) -> None:
        """Keep only the cached positions in ``keep`` (strictly increasing), moved to positions 0 .. len - 1."""
        keep = list(keep)
        current = self.slot.length
        if any(b <= a for a, b in itertools.pairwise(keep)) or (keep and not 0 <= keep[0] <= keep[-1] < current):
            raise ValueError(f"positions to keep must be strictly increasing and below {current}, got {keep}")
        unchanged = next((i for i, p in enumerate(keep) if p != i), len(keep))
        moved = keep[unchanged:]
        if moved:
            index = torch.tensor(moved, dtype=torch.long, device=self.slot.keys[0].device)
            for tensor in (*self.slot.keys, *self.slot.values):
                tensor[:, :, unchanged : unchanged + len(moved)] = tensor.index_select(2, index)
        self.slot.length = len(keep)

    def snapshot(self) -> list[tuple[torch.Tensor, torch.Tensor]]:
        """A copy of the cached keys and values, per layer (``[1, heads, length, head_dim]`` each)."""
        n = self.slot.length
        return [
            (k[:, :, :n].clone(), v[:, :, :n].clone()) for k, v in zip(self.slot.keys, self.slot.values, strict=True)
        ]

    def rows(self, length: int) -> torch.Tensor:
        """A copy of the keys and values of the first ``length`` cached positions, one row per position (``[length,
        width]``: every layer's keys, then its values, over all heads), as :meth:`load_rows` takes them."""
        if not 0 <= length <= self.slot.length:
            raise ValueError(f"a cache of length {self.slot.length} has no {length} positions")
        pairs = zip(self.slot.keys, self.slot.values, strict=True)
        parts = [t[0, :, :length].transpose(0, 1).reshape(length, -1) for pair in pairs for t in pair]
        return torch.cat(parts, dim=1)

    @torch.inference_mode()
    def load_rows(self, rows: torch.Tensor) -> None:
        """Hold ``rows`` (:meth:`rows` of a cache of the same model) as the cached positions ``0 .. len(rows) - 1``, in
        place of what the cache holds."""
        slot, length = self.slot, int(rows.shape[0])
        tensors = [t for pair in zip(slot.keys, slot.values, strict=True) for t in pair]
        widths = [t.shape[1] * t.shape[3] for t in tensors]  # heads x head width
        if sum(widths) != rows.shape[1]:
            raise ValueError(f"rows of width {rows.shape[1]} are not this model's keys and values ({sum(widths)} wide)")
        if length > self.owner.columns:
            raise StaticCacheFull(f"{length} positions do not fit a static cache of {self.owner.columns} columns")
        if length > slot.capacity:
            slot.grow(min(self.owner.columns, max(2 * slot.capacity, length)))
            tensors = [t for pair in zip(slot.keys, slot.values, strict=True) for t in pair]
        for tensor, part in zip(tensors, rows.split(widths, dim=1), strict=True):
            part = part.to(tensor.device, tensor.dtype).reshape(length, tensor.shape[1], tensor.shape[3])
            tensor[0, :, :length] = part.transpose(0, 1)
        slot.length = length

    def release(self) -> None:
        """Hand the slot back (the cache must not be used afterwards)."""
        self._finalizer()


def use_static_shapes(drafter: object, options: StaticOptions) -> None:
    """Let a drafter that runs a model of its own (the draft model's ``use_static_shapes``) draft on static shapes
    too; other drafters have no forwards to shape."""
    method = getattr(drafter, "use_static_shapes", None)
    if method is not None:
        method(options)
