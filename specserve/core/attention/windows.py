"""Sliding-window attention: which layers see only their last W positions, and the masks that apply the window.

Mistral v0.1, Phi-3-mini-4k, Qwen2 with ``use_sliding_window``, Gemma 3, Cohere 2 and gpt-oss attend, in some or all
of their layers, only over a window: the query at position q sees the key at position p when ``q - p < W``
(transformers' convention, ``sliding_window_overlay``). transformers keeps such a layer's cache trimmed to its window
(``DynamicSlidingWindowLayer``), which cannot be rolled back once full. specserve keeps every layer's keys and values
for the whole sequence instead — a windowed layer's are never trimmed — so rollback, tree compaction, the batched pool
and prefix reuse work as for full attention (at the memory of full KV: a windowed layer holds ``max_seq_len``
positions, not W), and applies the window in the masks, by position:

* a chain forward leaves its mask to transformers, whose sliding-window mask over a cache of full layers is exactly
  the window (:func:`full_cache` builds that cache);
* an explicit mask — a verify or draft tree — gets the window added for the windowed layers (:func:`window_mask`;
  :meth:`LayerWindows.mask_argument` hands the model one mask when every layer shares a window, or a mapping by
  layer type when full and windowed layers alternate);
* the batched engine's ragged attention applies the layer's ``sliding_window`` (which transformers passes to the
  attention function) per row, from the row's query and key positions (:mod:`specserve.core.attention.sdpa`).

Tree nodes sit at their depth's position, so a node sees an ancestor, or a cached position, exactly as the last token
of its root-to-node path would in a chain. Does not trim KV.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch
from transformers.cache_utils import DynamicCache, DynamicLayer, get_layer_types_and_kwargs

SLIDING = "sliding_attention"
FULL = "full_attention"
# Layers that keep a recurrent state rather than keys and values (Gated DeltaNet, Mamba-2): no window, no mask of their
# own; :mod:`specserve.core.kv.recurrent` rolls them back
RECURRENT = "linear_attention"
# Layers that run attention and a recurrent mixer side by side (Falcon-H1): full attention's KV and a state
PARALLEL = "hybrid"


@dataclass(frozen=True)
class LayerWindows:
    """Each decoder layer's window (``None``: full attention) and layer type, as transformers reads the config."""

    windows: tuple[int | None, ...]
    types: tuple[str, ...]

    @property
    def active(self) -> bool:
        return any(window is not None for window in self.windows)

    @property
    def recurrent(self) -> bool:
        """Whether some layer keeps a recurrent state (a hybrid model: :mod:`specserve.core.kv.recurrent`)."""
        return RECURRENT in self.types or PARALLEL in self.types

    @property
    def uniform(self) -> int | None:
        """The one window every layer shares (``None`` if some layer attends fully, or the windows differ)."""
        windows = set(self.windows)
        if len(windows) != 1:
            return None
        (window,) = windows
        return window

    def mask_argument(
        self, mask: torch.Tensor, query_positions: torch.Tensor, key_positions: torch.Tensor | None = None
    ) -> torch.Tensor | dict[str, torch.Tensor]:
        """What a forward with the explicit additive ``mask`` (``[1, 1, q, kv]``; its keys' positions as
        :func:`window_mask` takes them) passes as ``attention_mask``: the mask with the window applied, one per layer
        type when full and windowed layers alternate (the models that mix them take a mapping by layer type)."""
        if not self.active:
            return mask
        uniform = self.uniform
        if uniform is not None:
            return window_mask(mask, query_positions, uniform, key_positions)
        (window,) = {window for window in self.windows if window is not None}  # one width: layer_windows checks
        return {FULL: mask, SLIDING: window_mask(mask, query_positions, window, key_positions)}


def layer_windows(config: Any, max_positions: int) -> LayerWindows:
    """The windows of a model's decoder layers from its ``config`` (a window of at least ``max_positions`` never acts:
    ``None``). Raises ``ValueError`` for a layer type that is neither full nor sliding-window attention nor
    recurrent."""
    text = config.get_text_config(decoder=True)
    types, kwargs = get_layer_types_and_kwargs(text)
    windows: list[int | None] = []
    for layer_type, options in zip(types, kwargs, strict=True):
        # a dummy layer keeps no cache of its own (an MLP-only or KV-sharing one); a recurrent one keeps a state
        if layer_type in (FULL, "dummy", RECURRENT, PARALLEL):
            windows.append(None)
        elif layer_type == SLIDING:
            window = int(options["sliding_window"])
            windows.append(window if window < max_positions else None)
        else:
            raise ValueError(f"layers of type {layer_type!r}")
    widths = {window for window in windows if window is not None}
    if len(widths) > 1:
        raise ValueError(f"sliding windows of different widths ({sorted(widths)})")
    return LayerWindows(tuple(windows), tuple(types))


def full_cache(config: Any) -> DynamicCache:
    """transformers' ``DynamicCache`` for ``config`` with every sliding-window layer replaced by a full one (it keeps
    every position; the masks apply the window). A recurrent layer keeps transformers' own
    (``LinearAttentionLayer``)."""
    cache = DynamicCache(config=config)
    cache.layers = [DynamicLayer() if getattr(layer, "is_sliding", False) else layer for layer in cache.layers]
    return cache


def window_mask(
    mask: torch.Tensor, query_positions: torch.Tensor, window: int, key_positions: torch.Tensor | None = None
) -> torch.Tensor:
    """``mask`` (additive, ``[..., q, kv]``) with every key ``window`` or more positions behind its query masked.
    ``key_positions`` (``[kv]``) by default: the cached keys at positions ``0 .. kv - q - 1``, then the queries' own."""
    q, kv = mask.shape[-2], mask.shape[-1]
    positions = query_positions.to(mask.device).reshape(-1)
    if key_positions is None:
        key_positions = torch.cat([torch.arange(kv - q, device=mask.device), positions])
    far = positions[:, None] - key_positions.to(mask.device)[None, :] >= window
    return mask.masked_fill(far, torch.finfo(mask.dtype).min)
