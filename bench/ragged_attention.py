"""What attending row by row over a token arena costs a batched step, against one padded SDPA call over slots and
against one FlexAttention call over the arena.

    python bench/ragged_attention.py [--threads 1] [--requests 1,4,16,32] [--blocks 1,3,6] [--context 280]
                                     [--flex none|eager|compiled|both]

The batched engine's KV pool is sized in tokens: per layer one arena ``[kv_heads, tokens, head_dim]`` in
which every request holds a contiguous span (:mod:`specserve.core.kv.pool`). Its rows can no longer be read
as one ``[B, kv_heads, width, head_dim]`` view, so :class:`specserve.core.attention.sdpa.RaggedBatch` runs one SDPA
call per row over the row's own span (a view), its grouped query heads folded into the query dimension.
The layout it replaced gave every request a slot of equal length and ran one SDPA call over all rows,
padded to the longest context under a 4-D mask. This script times both, for the shipped target's shapes
(its layers, query and KV heads, head size), B requests with contexts spread around ``--context`` and
blocks of k tokens (1: plain decoding; k > 1: a verify chain under its causal mask), all layers of one
step. ``--flex`` adds the one-call path of :mod:`specserve.core.attention.flex` (its block mask built once per step,
counted in): ``eager``, FlexAttention's reference implementation, and ``compiled``, through ``torch.compile`` (its
fast path; the first call per shape compiles and is not counted). Measures attention only (the projections and MLPs
are the same in all); decides nothing.
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
import warnings
from collections.abc import Callable
from dataclasses import dataclass

import torch
from torch.nn.attention.flex_attention import flex_attention
from transformers import AutoConfig

from specserve import defaults
from specserve.core.attention.flex import block_mask
from specserve.core.attention.sdpa import RaggedBatch, RaggedRow


def timed(fn: Callable[[], object], repeats: int) -> float:
    times = []
    for _ in range(repeats + 2):
        start = time.perf_counter()
        fn()
        times.append(time.perf_counter() - start)
    return statistics.median(times[2:])


@dataclass(frozen=True)
class Shapes:
    layers: int
    heads: int
    kv_heads: int
    head_dim: int


def measure(
    shapes: Shapes, lengths: list[int], k: int, repeats: int, generator: torch.Generator, flex: list[str]
) -> dict[str, float]:
    """Seconds per step (all layers) of the slot layout's one padded call, the arena's row-by-row calls and, for each
    of ``flex`` (``eager``, ``compiled``), the arena's one call per layer."""
    batch, low = len(lengths), torch.finfo(torch.float32).min
    heads, kv_heads, head_dim = shapes.heads, shapes.kv_heads, shapes.head_dim
    group, width = heads // kv_heads, max(lengths) + k
    query = torch.randn(batch, heads, k, head_dim, generator=generator)
    # slots: [B, kv_heads, width, d], one SDPA call with the group folded in and a padded 4-D mask
    slot_keys = torch.randn(batch, kv_heads, width, head_dim, generator=generator)
    slot_values = torch.randn_like(slot_keys)
    mask = torch.zeros(batch, 1, k, width)
    causal = torch.zeros(k, k).masked_fill(~torch.ones(k, k, dtype=torch.bool).tril(), low)
    for b, length in enumerate(lengths):
        mask[b, 0, :, length + k :] = low
        mask[b, 0, :, length : length + k] = causal
    folded_mask = mask.repeat(1, 1, group, 1)

    def slots() -> None:
        for _ in range(shapes.layers):
            folded = query.reshape(batch, kv_heads, group * k, head_dim)
            torch.nn.functional.scaled_dot_product_attention(folded, slot_keys, slot_values, attn_mask=folded_mask)

    # arena: [1, kv_heads, tokens, d], one span per row, row masks (none for one query)
    starts = [sum(length + k for length in lengths[:b]) for b in range(batch)]
    arena_keys = torch.randn(1, kv_heads, starts[-1] + lengths[-1] + k, head_dim, generator=generator)
    arena_values = torch.randn_like(arena_keys)
    masks = [None if k == 1 else mask[b, 0, :, : length + k] for b, length in enumerate(lengths)]
    spans = [RaggedRow(s, s + n + k, k, m) for s, n, m in zip(starts, lengths, masks, strict=True)]

    def arena() -> None:
        ragged = RaggedBatch(spans)
        for _ in range(shapes.layers):
            ragged.attend(query, arena_keys, arena_values, None)

    out = {"slots_s": timed(slots, repeats), "arena_s": timed(arena, repeats)}
    for mode in flex:
        attend = flex_attention if mode == "eager" else torch.compile(flex_attention, dynamic=False)

        def one_call(attend: Callable[..., object] = attend) -> None:
            mask = block_mask(spans, masks, k, arena_keys.shape[2], arena_keys.device)
            packed = query.transpose(0, 1).reshape(1, heads, batch * k, head_dim)
            for _ in range(shapes.layers):
                attend(packed, arena_keys, arena_values, block_mask=mask, enable_gqa=True)

        one_call()  # compiles, once per shape
        out[f"flex_{mode}_s"] = timed(one_call, repeats)
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--requests", default="1,4,16,32")
    parser.add_argument("--blocks", default="1,3,6", help="tokens per row of the step")
    parser.add_argument("--context", type=int, default=280, help="mean cached positions per request")
    parser.add_argument("--repeats", type=int, default=21)
    parser.add_argument("--flex", choices=["none", "eager", "compiled", "both"], default="none")
    args = parser.parse_args()
    flex = {"none": [], "eager": ["eager"], "compiled": ["compiled"], "both": ["eager", "compiled"]}[args.flex]
    warnings.filterwarnings("ignore", module="torch.nn.attention.flex_attention")
    torch.set_num_threads(args.threads)
    config = AutoConfig.from_pretrained(str(defaults.DEFAULT_TARGET), local_files_only=True)
    heads = config.num_attention_heads
    shapes = Shapes(
        config.num_hidden_layers,
        heads,
        config.num_key_value_heads,
        getattr(config, "head_dim", None) or config.hidden_size // heads,
    )
    generator = torch.Generator().manual_seed(0)
    rows = []
    print(f"{args.threads} thread(s); {shapes.layers} layers, {heads} query / {shapes.kv_heads} KV heads of "
          f"{shapes.head_dim}; contexts {args.context} ± 120; ms per step (all layers)\n")  # fmt: skip
    flex_columns = "".join(f" arena, one flex call ({mode}) |" for mode in flex)
    print(f"| requests | block | slots, one padded call | arena, row by row | arena / slots |{flex_columns}")
    print("|---|---|---|---|---|" + "---|" * len(flex))
    for batch in (int(x) for x in args.requests.split(",")):
        lengths = [args.context - 120 + int(x) for x in torch.randint(0, 241, (batch,), generator=generator)]
        for k in (int(x) for x in args.blocks.split(",")):
            row = measure(shapes, lengths, k, args.repeats, generator, flex)
            slot_s, arena_s = row["slots_s"], row["arena_s"]
            cells = "".join(f" {1000 * row[f'flex_{mode}_s']:.2f} |" for mode in flex)
            print(f"| {batch} | {k} | {1000 * slot_s:.2f} | {1000 * arena_s:.2f} | {arena_s / slot_s:.2f} |{cells}")
            rows.append({"requests": batch, "block": k, **row})
    print(json.dumps({"threads": args.threads, "context": args.context, "rows": rows}))


if __name__ == "__main__":
    main()
