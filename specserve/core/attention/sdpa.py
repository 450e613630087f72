"""Grouped-query attention over a masked block without copying the keys and values per query head.

transformers' ``sdpa`` attention handles grouped-query attention (several query heads per key/value head) in
three ways: with no mask, through SDPA's own ``enable_gqa``; for one query token, by folding the query heads
of a group into the query dimension; otherwise — a verify block of k > 1 tokens under an explicit 4-D mask,
which is every batched step that drafts and every tree — by ``repeat_kv``, a copy of every cached key and
value once per query head of its group, in every layer. On the shipped target at 16 requests that copy costs
more than the attention itself.

:func:`grouped_sdpa_attention` folds the group's query heads into the query dimension for blocks of any
length: queries ``[batch, heads, q, d]`` become ``[batch, kv_heads, group · q, d]``, the mask is repeated
``group`` times along its query dimension (it is shared by all heads), and one SDPA call attends over the
keys and values as cached. Every query row still attends over exactly the keys and mask row it did, so the
result is the same attention (up to float summation order). Anything else — no grouping, no mask, one
query token, a position bias or a non-broadcast mask — goes to transformers' own ``sdpa`` function
unchanged.

:data:`ATTENTION` is the name it is registered under (with transformers' ``sdpa`` mask builder),
:func:`use_grouped_attention` switches a loaded model to it, and :func:`native_attention` switches it back
for a while — for transformers' own generation loops (baselines in benchmarks, continuous batching, which
accepts only its own implementations). Does not change which positions attend to which: that is the
caller's mask.

**Ragged batches.** A batched forward over a token-sized KV pool (:mod:`specserve.core.kv.pool`) keeps each
sequence's keys and values in its own span of one arena per layer. Inside :func:`ragged_batch` the function
attends row by row: row b's real queries (the first ``queries`` of its block; padding queries get zeros) over
the arena's columns ``start .. stop`` — a view, no copy — under the row's own mask (its cached prefix and the
causal or tree part of its block; none for one query, which sees the whole span). Measured on the shipped
target (``bench/ragged_attention.py``) this costs about what one padded SDPA call over per-sequence slots
did: within 25 % either way from 1 to 32 rows, cheaper for wide blocks, since no row attends over another's
padding. With ``one_call`` (on CUDA: :mod:`specserve.core.attention.flex`) the whole batch attends in one FlexAttention
call per layer instead, under one block mask built from the same rows.

**Soft-capped logits and sinks.** Gemma 2 caps its attention logits (``tanh(s / cap) · cap``) and gpt-oss gives
every head a sink logit; SDPA can express neither, so transformers runs those models eagerly. They run
:func:`grouped_sdpa_attention` too (:func:`use_grouped_attention`), which computes their attention as transformers'
eager functions do (:func:`eager_attention`), with the mask, or row by row in a ragged batch.
"""

from __future__ import annotations

from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from contextvars import ContextVar
from dataclasses import dataclass, field
from functools import cache
from typing import TYPE_CHECKING, Any

import torch

from specserve.core.attention.flex import block_mask, flex_attend, forced_attention, give_up

if TYPE_CHECKING:
    from transformers import PreTrainedModel

ATTENTION = "specserve_grouped_sdpa"
EAGER_ATTENTION = "specserve_grouped_eager"  # the same function, for models transformers runs eagerly (eager masks)


def grouped_sdpa_attention(
    module: torch.nn.Module,
    query: torch.Tensor,  # [batch, heads, q, d]
    key: torch.Tensor,  # [batch, kv_heads, kv, d]
    value: torch.Tensor,
    attention_mask: torch.Tensor | None,
    dropout: float = 0.0,
    scaling: float | None = None,
    is_causal: bool | None = None,
    **kwargs: Any,
) -> tuple[torch.Tensor, None]:
    """transformers' attention-function contract; see the module docstring."""
    softcap, sinks = kwargs.get("softcap"), kwargs.get("s_aux")
    ragged = _RAGGED.get()
    if ragged is not None:
        return ragged.attend(query, key, value, scaling, kwargs.get("sliding_window"), softcap, sinks), None
    if softcap is not None or sinks is not None:
        return eager_attention(query, key, value, attention_mask, scaling, softcap, sinks), None
    group = int(getattr(module, "num_key_value_groups", 1))
    batch, heads, q_length, head_dim = query.shape
    if (
        group == 1
        or attention_mask is None
        or q_length == 1
        or kwargs.get("position_bias") is not None
        or attention_mask.dim() != 4
        or attention_mask.shape[1] != 1
        or kwargs.get("output_attentions", False)
    ):
        from transformers.integrations.sdpa_attention import sdpa_attention_forward  # loaded with the model

        return sdpa_attention_forward(
            module, query, key, value, attention_mask, dropout=dropout, scaling=scaling, is_causal=is_causal, **kwargs
        )
    kv_heads = heads // group
    folded = query.reshape(batch, kv_heads, group * q_length, head_dim)  # head h = kv head h // group, member h % group
    mask = attention_mask.expand(batch, 1, q_length, attention_mask.shape[-1]).repeat(1, 1, group, 1)
    out = torch.nn.functional.scaled_dot_product_attention(
        folded, key, value, attn_mask=mask, dropout_p=dropout, scale=scaling, is_causal=False
    )
    out = out.reshape(batch, heads, q_length, value.shape[-1]).transpose(1, 2).contiguous()
    return out, None


def eager_attention(
    query: torch.Tensor,  # [batch, heads, q, d]
    key: torch.Tensor,  # [batch, kv_heads, kv, d]
    value: torch.Tensor,
    attention_mask: torch.Tensor | None,  # [batch or 1, 1, q, >= kv], additive or boolean (True: attend); None: causal
    scaling: float | None,
    softcap: float | None = None,
    sinks: torch.Tensor | None = None,  # [heads]
) -> torch.Tensor:  # [batch, q, heads, d]
    """Attention as transformers' eager functions compute it for what SDPA cannot express: soft-capped logits (Gemma
    2: ``tanh(s / cap) · cap`` before the mask, the softmax in float32) and attention sinks (gpt-oss: a per-head logit
    that joins each query's softmax and takes a share of it, with no value)."""
    batch, heads, q_length, head_dim = query.shape
    group = heads // key.shape[1]
    keys, values = key.repeat_interleave(group, dim=1), value.repeat_interleave(group, dim=1)
    scores = torch.matmul(query, keys.transpose(2, 3)) * (head_dim**-0.5 if scaling is None else scaling)
    if softcap is not None:
        scores = torch.tanh(scores / softcap) * softcap
    kv_length = keys.shape[2]
    if attention_mask is None:  # transformers leaves a causal block's mask out: its last query sees every key
        if q_length > 1:
            allowed = torch.ones(q_length, kv_length, dtype=torch.bool, device=query.device).tril(kv_length - q_length)
            scores = scores.masked_fill(~allowed, torch.finfo(scores.dtype).min)
    else:
        mask = attention_mask[..., :kv_length]
        low = torch.finfo(scores.dtype).min
        scores = scores.masked_fill(~mask, low) if mask.dtype == torch.bool else scores + mask
    if sinks is not None:
        sink = sinks.reshape(1, -1, 1, 1).expand(batch, -1, q_length, -1).to(scores.dtype)
        combined = torch.cat([scores, sink], dim=-1)
        combined = combined - combined.max(dim=-1, keepdim=True).values
        probs = torch.nn.functional.softmax(combined, dim=-1, dtype=combined.dtype)[..., :-1]
    else:
        probs = torch.nn.functional.softmax(scores, dim=-1, dtype=torch.float32).to(query.dtype)
    return torch.matmul(probs.to(values.dtype), values).transpose(1, 2).contiguous()


def needs_eager_attention(model: torch.nn.Module) -> bool:
    """Whether the model's attention has soft-capped logits or sinks (:func:`eager_attention`)."""
    config: Any = getattr(model, "config", None)
    text: Any = config.get_text_config(decoder=True) if config is not None else None
    if getattr(text, "attn_logit_softcapping", None):
        return True
    return any(isinstance(getattr(module, "sinks", None), torch.nn.Parameter) for module in model.modules())


@dataclass(frozen=True)
class RaggedRow:
    """One row of a ragged batch: its keys and values are columns ``start .. stop`` of the arena, and its first
    ``queries`` query tokens are real."""

    start: int
    stop: int
    queries: int
    mask: torch.Tensor | None  # [queries, stop - start] additive; None: every query sees the whole span
    positions: torch.Tensor | None = None  # [queries]: the block's positions (its keys' too), for sliding windows


@dataclass
class RaggedBatch:
    """The rows of one batched forward over a KV arena (see the module docstring); counts the layers that
    attended through it, so the caller can check the model's attention went through this module."""

    rows: Sequence[RaggedRow]
    dtype: torch.dtype = torch.float32  # of a mask built here (a row's window, when the row has no mask of its own)
    one_call: bool = False  # the whole batch in one FlexAttention call per layer (specserve.core.attention.flex)
    calls: int = 0
    _folded: dict[tuple[int, int, int | None], torch.Tensor] = field(default_factory=dict)
    _block_masks: dict[int | None, Any] = field(default_factory=dict)  # one FlexAttention block mask per window

    def attend(
        self,
        query: torch.Tensor,  # [batch, heads, width, d]
        key: torch.Tensor,  # [1, kv_heads, arena, d]
        value: torch.Tensor,
        scaling: float | None,
        window: int | None = None,
        softcap: float | None = None,
        sinks: torch.Tensor | None = None,
    ) -> torch.Tensor:  # [batch, width, heads, d]
        """One layer's attention, row by row over each row's own span of the arena; a sliding-window layer's
        (``window``) sees, of each row, only the keys fewer than ``window`` positions behind each query
        (:mod:`specserve.core.attention.windows`).

        The query heads of a group are folded into the query dimension position-major — row ``pos · group +
        member`` — so a row's real queries are the first ``queries · group`` of its fold, and one copy folds the
        whole batch. Soft-capped logits and sinks (``softcap``, ``sinks``) go row by row through
        :func:`eager_attention` instead, unfolded."""
        self.calls += 1
        batch, heads, width, head_dim = query.shape
        if self.one_call:
            try:
                mask = self._block_masks.get(window)
                if mask is None:
                    row_masks = [self._row_mask(b, row, window) for b, row in enumerate(self.rows)]
                    mask = block_mask(self.rows, row_masks, width, key.shape[2], query.device)
                    self._block_masks[window] = mask
                return flex_attend(query, key, value, mask, scaling, softcap, sinks)
            except Exception as exc:
                if forced_attention() == "flex":
                    raise
                give_up(exc)  # this forward's other layers, and later forwards, attend row by row
                self.one_call = False
        if softcap is not None or sinks is not None:
            rows_out = query.new_zeros(batch, width, heads, value.shape[-1])
            for b, row in enumerate(self.rows):
                k = row.queries
                mask = self._row_mask(b, row, window)
                rows_out[b : b + 1, :k] = eager_attention(
                    query[b : b + 1, :, :k],
                    key[:, :, row.start : row.stop],
                    value[:, :, row.start : row.stop],
                    None if mask is None else mask[None, None],
                    scaling,
                    softcap,
                    sinks,
                )
            return rows_out
        kv_heads = key.shape[1]
        group = heads // kv_heads
        folded = (
            query.view(batch, kv_heads, group, width, head_dim)
            .transpose(2, 3)
            .reshape(batch, kv_heads, width * group, head_dim)
        )
        out = query.new_zeros(batch, kv_heads, width * group, value.shape[-1])
        for b, row in enumerate(self.rows):
            real = row.queries * group
            out[b : b + 1, :, :real] = torch.nn.functional.scaled_dot_product_attention(
                folded[b : b + 1, :, :real],
                key[:, :, row.start : row.stop],
                value[:, :, row.start : row.stop],
                attn_mask=self._mask(b, row, group, window),
                scale=scaling,
            )
        # [batch, kv_heads, width, group, d] -> [batch, width, heads, d], head h = kv head h // group, member h % group
        return out.view(batch, kv_heads, width, group, -1).permute(0, 2, 1, 3, 4).reshape(batch, width, heads, -1)

    def _mask(self, b: int, row: RaggedRow, group: int, window: int | None = None) -> torch.Tensor | None:
        """The row's mask (with the layer's ``window``) repeated for the ``group`` query heads folded into its query
        dimension (built once per forward and window, shared by the layers)."""
        mask = self._row_mask(b, row, window)
        if mask is None:
            return None
        folded = self._folded.get((b, group, window))
        if folded is None:
            folded = self._folded[(b, group, window)] = mask.repeat_interleave(group, dim=0)
        return folded

    def _row_mask(self, b: int, row: RaggedRow, window: int | None) -> torch.Tensor | None:
        """The row's additive mask ``[queries, span]`` with the layer's ``window`` applied (``None``: it sees its whole
        span); built once per forward and window."""
        span = row.stop - row.start
        if window is None or row.positions is None or span <= window:
            return row.mask
        windowed = self._folded.get((b, 0, window))
        if windowed is None:
            from specserve.core.attention.windows import window_mask

            mask = row.mask if row.mask is not None else torch.zeros(row.queries, span, dtype=self.dtype)
            windowed = self._folded[(b, 0, window)] = window_mask(mask.to(row.positions.device), row.positions, window)
        return windowed


_RAGGED: ContextVar[RaggedBatch | None] = ContextVar("specserve_ragged_batch", default=None)


@contextmanager
def ragged_batch(batch: RaggedBatch) -> Iterator[RaggedBatch]:
    """Within the block, :func:`grouped_sdpa_attention` attends row by row over ``batch``'s spans."""
    token = _RAGGED.set(batch)
    try:
        yield batch
    finally:
        _RAGGED.reset(token)


@cache
def register_attention() -> None:
    """Register :func:`grouped_sdpa_attention` with transformers as :data:`ATTENTION` (with transformers' ``sdpa``
    mask builder); once per process. Done on first use, not at import: transformers' modelling code costs a few
    seconds of CPU to import, and a process that serves no model (an HTTP edge, a model-free drafter) never needs
    it."""
    from transformers import AttentionInterface
    from transformers.masking_utils import ALL_MASK_ATTENTION_FUNCTIONS, eager_mask, sdpa_mask

    AttentionInterface.register(ATTENTION, grouped_sdpa_attention)
    ALL_MASK_ATTENTION_FUNCTIONS.register(ATTENTION, sdpa_mask)
    AttentionInterface.register(EAGER_ATTENTION, grouped_sdpa_attention)
    ALL_MASK_ATTENTION_FUNCTIONS.register(EAGER_ATTENTION, eager_mask)


def use_grouped_attention(model: PreTrainedModel) -> None:
    """Switch ``model`` to :func:`grouped_sdpa_attention` when it runs transformers' ``sdpa``, or ``eager`` for
    soft-capped logits or sinks (:func:`needs_eager_attention`); other implementations are left as they are."""
    implementation = getattr(model.config, "_attn_implementation", None)
    if implementation == "sdpa":
        register_attention()
        model.set_attn_implementation(ATTENTION)
    elif implementation == "eager" and needs_eager_attention(model):
        register_attention()
        model.set_attn_implementation(EAGER_ATTENTION)


@contextmanager
def native_attention(model: PreTrainedModel | None) -> Iterator[None]:
    """Within the block, ``model`` runs transformers' own ``sdpa`` (or ``eager``, for soft-capped logits or sinks)
    again (if it ran :data:`ATTENTION`; ``None``: nothing to switch)."""
    ours = getattr(model.config, "_attn_implementation", None) if model is not None else None
    if model is None or ours not in (ATTENTION, EAGER_ATTENTION):
        yield
        return
    model.set_attn_implementation("sdpa" if ours == ATTENTION else "eager")
    try:
        yield
    finally:
        model.set_attn_implementation(ours)
