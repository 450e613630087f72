"""What a paged KV pool would cost a batched step on this CPU: gathering pages into contiguous rows.

    python bench/kv_paging.py [--threads 1] [--requests 16] [--context 280] [--page 16] [--repeats 21]

The batched engine's :class:`~specserve.core.kv.pool.KVPool` gives every request one contiguous span of
the positions it may hold, reserved when it starts, so a step reads each request's keys and values as a
view, with no copy; the price is that a request that stops early held room for its whole ``max_tokens``.
(Until commit e6cf010 the spans were slots of ``max_seq_len`` positions each; this script measured that
layout, read as one view.) A pool of pages (vLLM's layout) reserves only what a request holds, but SDPA
needs each row's keys and values contiguous, so every step must
first gather each running request's pages into rows, in every layer, for keys and values (unless an
attention kernel reads pages, which SDPA on a CPU does not). This script times that gather for the
shipped target's KV shape (its layers, KV heads and head size), B requests of ragged lengths around
``--context``, pages of ``--page`` positions scattered over an arena, against reading the slot pool's
view. Measures cost only; it decides nothing and changes no code path.
"""

from __future__ import annotations

import argparse
import json
import statistics
import time

import torch
from transformers import AutoConfig

from specserve import defaults


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--requests", type=int, default=16)
    parser.add_argument("--context", type=int, default=280, help="mean cached positions per request")
    parser.add_argument("--page", type=int, default=16, help="positions per page")
    parser.add_argument("--repeats", type=int, default=21)
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    config = AutoConfig.from_pretrained(str(defaults.DEFAULT_TARGET), local_files_only=True)
    layers, heads = config.num_hidden_layers, config.num_key_value_heads
    head_dim = getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads
    generator = torch.Generator().manual_seed(0)
    lengths = [args.context - 16 + int(x) for x in torch.randint(0, 33, (args.requests,), generator=generator)]
    width = max(lengths)
    pages_per_row = -(-width // args.page)
    # slots: [B, heads, capacity, d] per layer and for keys and values, read as a view of the first `width` positions
    slots = [torch.randn(args.requests, heads, width + 64, head_dim) for _ in range(2 * layers)]
    # pages: an arena of [pages, heads, page, d] per layer, each request's pages scattered over it
    arena_pages = 2 * args.requests * pages_per_row
    arenas = [torch.randn(arena_pages, heads, args.page, head_dim) for _ in range(2 * layers)]
    table = torch.randperm(arena_pages, generator=generator)[: args.requests * pages_per_row]

    def read_slots() -> None:
        for tensor in slots:
            tensor[:, :, :width]  # a view: what forward_batch hands the attention

    def gather_pages() -> None:
        for arena in arenas:  # [B·P, heads, page, d] -> [B, heads, P·page, d], contiguous (a copy)
            rows = arena.index_select(0, table).view(args.requests, pages_per_row, heads, args.page, head_dim)
            rows.permute(0, 2, 1, 3, 4).reshape(args.requests, heads, pages_per_row * args.page, head_dim)

    results = {}
    for name, fn in (("slot view", read_slots), ("page gather", gather_pages)):
        times = []
        for _ in range(args.repeats + 2):
            start = time.perf_counter()
            fn()
            times.append(time.perf_counter() - start)
        results[name] = statistics.median(times[2:])
    megabytes = 2 * layers * args.requests * heads * pages_per_row * args.page * head_dim * 4 / 1e6
    print(
        f"{args.threads} thread(s); {args.requests} requests, {min(lengths)}-{max(lengths)} cached positions, "
        f"pages of {args.page}; {layers} layers x keys and values of [{heads} heads, {head_dim}]\n"
    )
    print("| layout | per step, ms | copied per step, MB |")
    print("|---|---|---|")
    print(f"| slots (a view per layer) | {1000 * results['slot view']:.3f} | 0 |")
    print(f"| pages gathered into rows | {1000 * results['page gather']:.2f} | {megabytes:.1f} |")
    print(json.dumps({"threads": args.threads, "requests": args.requests, "page": args.page, "megabytes": megabytes,
                      **{k: v for k, v in results.items()}}))  # fmt: skip


if __name__ == "__main__":
    main()
