"""Captured batched steps: a batched forward over the KV pool, replayed as a CUDA graph at bucketed shapes.

A batched step (:meth:`~specserve.core.model.causal_lm.CausalLM.forward_batch`) eagerly builds each row's mask and write
columns on the host and attends row by row, or in one FlexAttention call (:mod:`specserve.core.attention.flex`): its
shapes and its Python follow the batch. :class:`BatchGraphs` runs the same step as one function of tensors at a
bucketed shape — ``rows`` (the batch, padded with dummy rows), ``width`` (the widest block, padded as
:mod:`specserve.core.model.buckets` pads one request's) and ``span`` (the longest row's cached prefix and block, padded
to a power of two) — so that a graph backend (:mod:`specserve.core.static.graphs`: CUDA graphs on a GPU) captures each
shape once and replays it. Everything a step reads comes in two tensors, copied to the device once per step: per row,
its span's start in the arena, its cached length, its block's size and last token, its tokens and their positions after
the cached length (one ``int64`` table), and what each of its block's tokens sees of the block (``bool`` ``[rows, width,
width]``: causal for a chain or a prefill, the ancestry of a tree). On the device the step builds:

* the write columns: row r's token i at ``start + length + i``; a padding token (past its row's block, or a dummy
  row's) at the first scratch column of the pool, which no real query reads;
* per row, the arena columns of its span gathered and padded to ``span`` (``[rows, kv_heads, span, head_dim]`` per
  layer), and one additive mask ``[rows, 1, width, span]``: a real query sees its row's cached prefix and, of its
  block, what its ancestry allows (and, in a sliding-window layer, only keys within the window behind it); a padding
  query sees only its row's first column, so that its softmax stays finite. Real queries never see a pad, a scratch
  column or another row, so a row's logits equal the eager step's up to rounding (float summation order), and its
  keys and values land where the eager step writes them;
* one attention call per layer for the whole batch (SDPA under the mask, through
  :func:`~specserve.core.attention.sdpa.grouped_sdpa_attention`; soft-capped logits and sinks eagerly, as that function
  computes them).

What does not fit a bucket runs eagerly, through the ordinary batched forward: more rows than the largest row bucket,
a block wider than the largest width bucket, a span longer than :attr:`BatchGraphs.max_span`, and every step of a model
with recurrent layers (their states are per-sequence Python objects, :mod:`specserve.core.kv.pool_states`), multi-head
latent attention (a latent pool gathers positions of its own) or experts run one by one (transformers' ``eager``
experts, which read on the host which experts a step hits: :func:`refusal`). Graphs past the cache's limit, or whose
capture failed, run eagerly too (:class:`~specserve.core.static.graphs.GraphCache`). Outputs are copied out of the
graph's tensors before they are handed back, so a later replay never overwrites what a caller kept.

The price of fixed shapes: each layer copies every row's span out of the arena (padded to ``span``) before it attends,
which the eager paths do not (they read the arena in place). Attending the arena in place inside a graph — FlexAttention
with a block mask built on the device from the same two tensors — is what a GPU should measure next (docs/gpu.md). Does
not decide which requests share a step, and serves one model in one process (a tensor-parallel rank's shard is not
captured: docs/gpu.md).
"""

from __future__ import annotations

import logging
from collections.abc import Sequence
from typing import Any

import torch
from transformers.cache_utils import Cache, DummyLayer

from specserve.core.attention.windows import FULL, SLIDING
from specserve.core.kv.pool import KVPool, StepLayer
from specserve.core.model.buckets import VerifyBuckets
from specserve.core.model.causal_lm import BatchBlock, CausalLM, FeatureCapture, select_features
from specserve.core.static.graphs import CudaGraphs, GraphBackend, GraphCache
from specserve.core.static.options import StaticOptions

logger = logging.getLogger(__name__)

ROW_BUCKETS = VerifyBuckets((1, 2, 4, 8, 16, 32, 64, 128, 256))
"""Rows a captured step pads to: powers of two (a dummy row costs a row of the forward, no attention of note)."""

MIN_SPAN = 64
"""The shortest span bucket; spans pad to the next power of two at or above it."""

BATCH_GRAPH_LIMIT = 256
"""Shapes captured at most per model and pool: rows × widths × spans buckets of a serving mix, the rest eagerly."""

_HEAD = 4  # the table's first columns per row: start, length, size, last; then the tokens, then their offsets


def span_bucket(span: int) -> int:
    """The span a step whose longest row holds ``span`` positions runs at: the next power of two, at least
    :data:`MIN_SPAN`."""
    return max(MIN_SPAN, 1 << max(span - 1, 0).bit_length())


class BatchGraphs:
    """Captured batched steps of one model over one KV pool (module docstring)."""

    def __init__(
        self,
        model: CausalLM,
        pool: KVPool,
        widths: VerifyBuckets,
        backend: GraphBackend | None,
        rows: VerifyBuckets = ROW_BUCKETS,
        max_span: int | None = None,
        limit: int = BATCH_GRAPH_LIMIT,
    ) -> None:
        """``widths``: the block widths a step pads to (a width past the largest runs eagerly); ``backend``: how graphs
        are captured (``None``: every step runs the captured function eagerly, as the tests compare); ``max_span``:
        the longest span bucket (default: the pool's capacity, rounded up)."""
        if not widths.widths or not rows.widths:
            raise ValueError("captured batched steps need at least one width bucket and one row bucket")
        self.model = model
        self.pool = pool
        self.widths = widths
        self.rows = rows
        self.max_span = span_bucket(pool.capacity) if max_span is None else max_span
        self.graphs = GraphCache(backend, limit=limit)
        self.steps = 0  # steps run here (graphed or through the captured function eagerly)
        self.refused = refusal(model, pool)  # why no step of this model and pool is captured, or None
        if self.refused is not None:
            logger.info("batched steps of %s run uncaptured: %s", model.info.architecture, self.refused)
        self._low = torch.finfo(model.dtype).min

    def fits(self, blocks: Sequence[BatchBlock]) -> bool:
        """Whether a step over ``blocks`` runs here rather than through the ordinary batched forward."""
        if self.refused is not None or not blocks:
            return False
        if self.rows.bucket(len(blocks)) is None or self.widths.bucket(max(b.size for b in blocks)) is None:
            return False
        longest = max(self.pool.length(b.seq_id) + b.size for b in blocks)
        return span_bucket(longest) <= self.max_span

    @torch.inference_mode()
    def forward(
        self, blocks: Sequence[BatchBlock], last_only: bool, captures: Sequence[FeatureCapture | None]
    ) -> list[torch.Tensor]:
        """:meth:`~specserve.core.model.causal_lm.CausalLM.forward_batch` of ``blocks`` (which :meth:`fits`), from the
        shape's graph: per block, its ``[k, vocab]`` logits (``[1, vocab]`` with ``last_only``), its features into its
        capture; the pool's sequences then hold the blocks."""
        sizes = [block.size for block in blocks]
        rows = self.rows.width(len(blocks))
        width = self.widths.width(max(sizes))
        starts, lengths = self.pool.extend([block.seq_id for block in blocks], sizes)
        span = span_bucket(max(n + k for n, k in zip(lengths, sizes, strict=True)))
        table = torch.zeros(rows, _HEAD + 2 * width, dtype=torch.long)
        sees = torch.zeros(rows, width, width, dtype=torch.bool)
        table[len(blocks) :, 0] = self.pool.capacity  # dummy rows: their (empty) span in the scratch columns
        for r, (block, start, length) in enumerate(zip(blocks, starts, lengths, strict=True)):
            k = block.size
            table[r, :_HEAD] = torch.tensor([start, length, k, k - 1])
            table[r, _HEAD : _HEAD + k] = block.tokens.to("cpu", torch.long)
            table[r, _HEAD + width : _HEAD + width + k] = torch.tensor(block.offsets)
            sees[r, :k, :k] = block.attends()
        hidden = any(capture is not None for capture in captures)

        def step(tensors: Sequence[torch.Tensor]) -> tuple[torch.Tensor, ...]:
            return self._step(tensors[0], tensors[1], span, last_only, hidden)

        device = self.model.device
        outputs = self.graphs.run((rows, width, span, last_only, hidden), step, [table.to(device), sees.to(device)])
        self.steps += 1
        logits = outputs[0]
        if hidden:
            for r, (capture, k) in enumerate(zip(captures, sizes, strict=True)):
                if capture is not None:
                    capture.value = select_features([h[r, :k] for h in outputs[1:]], capture.layers).clone()
        if last_only:
            return [logits[r, :1].clone() for r in range(len(blocks))]
        return [logits[r, :k].clone() for r, k in enumerate(sizes)]

    def _step(
        self, table: torch.Tensor, sees: torch.Tensor, span: int, last_only: bool, hidden: bool
    ) -> tuple[torch.Tensor, ...]:
        """The step as a function of its two input tensors (module docstring); ``span`` and the flags are the key's."""
        rows, width = sees.shape[0], sees.shape[1]
        device = table.device
        start, length, size, last = (table[:, c] for c in range(_HEAD))
        ids = table[:, _HEAD : _HEAD + width]
        offsets = table[:, _HEAD + width :]
        i = torch.arange(width, device=device)
        j = torch.arange(span, device=device)
        real = i[None, :] < size[:, None]  # [rows, width]: a real query
        scratch = self.pool.capacity
        columns = torch.where(real, start[:, None] + length[:, None] + i[None, :], scratch)
        gather = torch.where(j[None, :] < (length + size)[:, None], start[:, None] + j[None, :], scratch)
        relative = j[None, :] - length[:, None]  # [rows, span]: a column's place in the block
        in_block = (relative >= 0) & (relative < size[:, None])
        block_sees = sees.gather(2, relative.clamp(0, width - 1)[:, None, :].expand(rows, width, span))
        allowed = real[:, :, None] & ((relative < 0)[:, None, :] | (in_block[:, None, :] & block_sees))
        pad_sees = ~real[:, :, None] & (j == 0)[None, None, :]  # a padding query: its row's first column only
        positions = length[:, None] + offsets  # [rows, width]
        key_positions = torch.where(in_block, length[:, None] + offsets.gather(1, relative.clamp(0, width - 1)), j)
        mask_argument = self._masks(allowed, pad_sees, positions, key_positions)
        cache = _GatheredView(self.pool, columns.flatten(), gather.flatten(), rows, span)
        kwargs: dict[str, Any] = {
            self.model._cache_kwarg: cache,
            "attention_mask": mask_argument,
            "position_ids": positions,
            "use_cache": True,
        }
        if last_only:
            kwargs["logits_to_keep"] = last[:, None]
        if hidden:
            kwargs["output_hidden_states"] = True
        out = self.model.model(input_ids=ids, **kwargs)
        if hidden:
            return (out.logits, *out.hidden_states)
        return (out.logits,)

    def _masks(
        self, allowed: torch.Tensor, pads: torch.Tensor, positions: torch.Tensor, key_positions: torch.Tensor
    ) -> torch.Tensor | dict[str, torch.Tensor]:
        """The additive ``[rows, 1, width, span]`` mask, or one per layer type for a model whose layers mix full and
        sliding-window attention (:meth:`~specserve.core.attention.windows.LayerWindows.mask_argument`)."""
        windows = self.model.windows

        def additive(sees: torch.Tensor) -> torch.Tensor:
            mask = torch.zeros(sees.shape, dtype=self.model.dtype, device=sees.device)
            return mask.masked_fill_(~(sees | pads), self._low)[:, None]

        if not windows.active:
            return additive(allowed)
        behind = positions[:, :, None] - key_positions[:, None, :]  # [rows, width, span]

        def windowed(window: int) -> torch.Tensor:
            return additive(allowed & (behind < window))

        uniform = windows.uniform
        if uniform is not None:
            return windowed(uniform)
        (window,) = {window for window in windows.windows if window is not None}
        return {FULL: additive(allowed), SLIDING: windowed(window)}


def refusal(model: CausalLM, pool: KVPool) -> str | None:
    """Why a model's batched steps over ``pool`` cannot be captured at all, or ``None``."""
    if pool.states is not None:
        return "its recurrent layers keep per-sequence states on the host (core/kv/pool_states.py)"
    if pool.gathers:
        return "its multi-head latent attention gathers its rows' positions itself"
    eager_experts = getattr(model.model.config, "_experts_implementation", None) == "eager"
    if eager_experts and any(hasattr(module, "_is_expert_parallel") for module in model.model.modules()):
        return (
            "its experts run one by one (transformers' eager experts, the one float64 takes), which reads on the host "
            "which experts each step hits; load it with experts_implementation batched_mm or grouped_mm to capture it"
        )
    return None


class _GatheredLayer(StepLayer):
    """One model layer's share of a :class:`_GatheredView`."""

    def __init__(self, view: _GatheredView, arena: int) -> None:
        super().__init__()
        self.view = view
        self.arena = arena

    def update(
        self, key_states: torch.Tensor, value_states: torch.Tensor, *args: Any, **kwargs: Any
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """``key_states`` ``[rows, kv_heads, width, d]`` into the arena at the step's columns; every row's span,
        gathered and padded: ``[rows, kv_heads, span, d]``."""
        view = self.view
        out = []
        for store, new in ((view.pool.keys[self.arena], key_states), (view.pool.values[self.arena], value_states)):
            heads = store.shape[0]
            store.index_copy_(1, view.columns, new.transpose(0, 1).reshape(heads, view.columns.numel(), -1))
            gathered = store.index_select(1, view.gather).reshape(heads, view.rows, view.span, -1)
            out.append(gathered.transpose(0, 1))
        return out[0], out[1]

    def get_mask_sizes(self, query_length: int) -> tuple[int, int]:
        return self.view.span, 0

    def get_seq_length(self) -> int:
        return 0  # positions and masks are given explicitly


class _GatheredView(Cache):
    """The transformers ``Cache`` of a captured step: writes at tensor columns, reads each row's span gathered."""

    def __init__(self, pool: KVPool, columns: torch.Tensor, gather: torch.Tensor, rows: int, span: int) -> None:
        self.pool = pool
        self.columns = columns  # [rows · width]
        self.gather = gather  # [rows · span]
        self.rows = rows
        self.span = span
        layers: list[Any] = []
        for layer in range(pool.num_layers):
            arena = pool.arena_of.get(layer)
            layers.append(_GatheredLayer(self, arena) if arena is not None else DummyLayer())
        super().__init__(layers=layers)


def batch_graphs(
    model: CausalLM, pool: KVPool, static: StaticOptions | None, backend: GraphBackend | None = None
) -> BatchGraphs | None:
    """The captured steps a batched runtime with ``static`` options runs over ``pool``: with ``backend``, or CUDA
    graphs on a CUDA device when the options allow them, padded to the options' row buckets; ``None`` without static
    shapes, without width or row buckets (a CPU's default widths, ``--row-buckets none``), or without a backend (every
    step then runs the ordinary batched forward)."""
    if static is None:
        return None
    widths = static.buckets_for(model.device.type)
    if backend is None and static.cuda_graphs and model.device.type == "cuda":
        backend = CudaGraphs(model.device)
    rows = ROW_BUCKETS if static.row_buckets is None else static.row_buckets
    if backend is None or not widths.widths or not rows.widths:
        return None
    return BatchGraphs(model, pool, widths, backend, rows=rows)
