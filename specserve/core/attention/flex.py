"""One attention call per layer for a whole ragged batch: FlexAttention over the KV arena under one block mask.

A batched forward over the KV pool (:mod:`specserve.core.kv.pool`) keeps each sequence's keys and values in its own
span of one arena per layer; :class:`~specserve.core.attention.sdpa.RaggedBatch` attends row by row, one SDPA call per
request per layer. On a GPU that is launch overhead — 64 requests on a 32-layer model launch about 2,000 attention
kernels a step — which vLLM and SGLang avoid with varlen and paged kernels. Here the whole batch attends in one
``flex_attention`` call per layer (torch's own, no extra package): the rows' queries are packed into one sequence
``[1, heads, rows · width, d]`` and attend over the arena ``[1, kv_heads, arena, d]`` as it is (grouped-query
attention by ``enable_gqa``), under one :class:`~torch.nn.attention.flex_attention.BlockMask` built once per forward
(and per sliding window) from the rows: query ``(r, i)`` sees key ``j`` only inside row r's span, where row r's own
mask (its cached prefix, the causal or tree part of its block, its window) allows it. Padding queries see nothing and
come out zero, as the row-by-row path leaves them. Blocks of 128 × 128 that no row touches are skipped, so the work
is what the rows attend to, not rows × arena.

Soft-capped logits (Gemma 2) go in as a score modification; attention sinks (gpt-oss) as a rescaling of the output by
the share of each query's softmax the sink would take, ``sigmoid(lse − sink)``, from the log-sum-exp flex returns.

Which path runs is :func:`batch_attention`: ``flex`` on CUDA (compiled there, as FlexAttention is meant to run),
``ragged`` elsewhere, since on this project's CPU the row-by-row SDPA calls are faster (BENCHMARKS.md §21); the
environment variable :data:`ENV` forces either (tests run the batched suites with ``flex`` forced on the CPU, where
flex runs its eager reference). Unforced, a one-call forward that fails (a compile this device cannot do) is finished
row by row and the process stays on the row-by-row path (:func:`give_up`, logged once). Does not choose which
positions attend to which beyond the rows' own masks.
"""

from __future__ import annotations

import logging
import os
from collections.abc import Callable, Sequence
from functools import cache
from typing import TYPE_CHECKING, Any, Protocol

import torch

if TYPE_CHECKING:
    from torch.nn.attention.flex_attention import BlockMask

logger = logging.getLogger(__name__)

ENV = "SPECSERVE_BATCH_ATTENTION"  # "ragged" or "flex"; unset: flex on CUDA, ragged elsewhere
BACKENDS = ("ragged", "flex")


class Span(Protocol):
    """A row's span of the arena and its real queries (:class:`~specserve.core.attention.sdpa.RaggedRow`)."""

    @property
    def start(self) -> int: ...
    @property
    def stop(self) -> int: ...
    @property
    def queries(self) -> int: ...


_failed: list[str] = []  # why the one-call path failed in this process, once it has (it is then not chosen again)


def batch_attention(device: torch.device | str) -> str:
    """The batched forward's attention path on ``device``: :data:`ENV` when set, else ``flex`` on CUDA and ``ragged``
    elsewhere (the faster path measured on each: module docstring), or ``ragged`` once ``flex`` failed here
    (:func:`give_up`)."""
    forced = forced_attention()
    if forced is not None:
        return forced
    return "flex" if torch.device(device).type == "cuda" and not _failed else "ragged"


def forced_attention() -> str | None:
    """The path :data:`ENV` forces, or ``None``."""
    forced = os.environ.get(ENV, "").strip().lower()
    if forced and forced not in BACKENDS:
        raise ValueError(f"{ENV} must be one of {', '.join(BACKENDS)}, got {forced!r}")
    return forced or None


def give_up(exc: Exception) -> None:
    """The one-call path failed (a FlexAttention compile this device or torch build cannot do): the batched forwards
    of this process attend row by row from now on, and the reason is logged once. Attention writes nothing, so the
    forward that failed goes on row by row, exactly."""
    if not _failed:
        _failed.append(f"{type(exc).__name__}: {exc}")
        logger.warning("one attention call per layer failed; batched forwards attend row by row: %s", _failed[0])


def block_mask(
    rows: Sequence[Span],
    row_masks: Sequence[torch.Tensor | None],  # per row: [queries, span] additive (its window applied), or None
    width: int,
    arena: int,
    device: torch.device,
) -> BlockMask:
    """The block mask of one forward (and one window): query ``r · width + i`` sees key ``j`` of the arena when ``j``
    is in row r's span, ``i`` is one of its real queries, and its mask allows it."""
    from torch.nn.attention.flex_attention import create_block_mask

    longest = max(row.stop - row.start for row in rows)
    allowed = torch.zeros(len(rows), width, longest, dtype=torch.bool, device=device)
    for r, (row, mask) in enumerate(zip(rows, row_masks, strict=True)):
        span = row.stop - row.start
        if mask is None:
            allowed[r, : row.queries, :span] = True
        else:
            allowed[r, : row.queries, :span] = mask.to(device) > torch.finfo(mask.dtype).min
    starts = torch.tensor([row.start for row in rows], device=device)
    spans = torch.tensor([row.stop - row.start for row in rows], device=device)
    queries = torch.tensor([row.queries for row in rows], device=device)

    def attends(b: Any, h: Any, q_idx: torch.Tensor, kv_idx: torch.Tensor) -> torch.Tensor:
        r, i = q_idx // width, q_idx % width
        j = kv_idx - starts[r]
        inside = (j >= 0) & (j < spans[r]) & (i < queries[r])
        return inside & allowed[r, i, j.clamp(0, longest - 1)]

    return create_block_mask(attends, None, None, len(rows) * width, arena, device=device)


def flex_attend(
    query: torch.Tensor,  # [batch, heads, width, d]
    key: torch.Tensor,  # [1, kv_heads, arena, d]
    value: torch.Tensor,
    mask: BlockMask,
    scaling: float | None,
    softcap: float | None = None,
    sinks: torch.Tensor | None = None,  # [heads]
) -> torch.Tensor:  # [batch, width, heads, d]
    """One layer's attention for the whole batch in one call (module docstring)."""
    batch, heads, width, head_dim = query.shape
    packed = query.transpose(0, 1).reshape(1, heads, batch * width, head_dim)
    score_mod = _softcap(softcap) if softcap is not None else None
    from torch.nn.attention.flex_attention import AuxRequest

    aux = AuxRequest(lse=True) if sinks is not None else None
    result = _flex(query.device.type)(
        packed, key, value, score_mod=score_mod, block_mask=mask, scale=scaling, enable_gqa=True, return_aux=aux
    )
    if sinks is None:
        out = result
    else:  # the sink's share of each query's softmax, taken from the keys' (it has no value)
        out, extra = result
        lse = extra.lse
        out = out * torch.sigmoid(lse - sinks.to(lse.dtype).reshape(1, heads, 1))[..., None].to(out.dtype)
    return out.reshape(heads, batch, width, -1).permute(1, 2, 0, 3)


def _softcap(cap: float) -> Callable[..., torch.Tensor]:
    def capped(score: torch.Tensor, b: Any, h: Any, q_idx: Any, kv_idx: Any) -> torch.Tensor:
        return torch.tanh(score / cap) * cap

    return capped


@cache
def _flex(device_type: str) -> Callable[..., Any]:
    """``flex_attention``, compiled on CUDA (its fast path); as it is elsewhere (its eager reference: exact, slow)."""
    import warnings

    from torch.nn.attention.flex_attention import flex_attention

    if device_type == "cuda":
        return torch.compile(flex_attention, dynamic=True)
    warnings.filterwarnings("ignore", message=".*flex_attention called without torch.compile.*")
    return flex_attention
