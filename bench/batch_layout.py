"""Ragged batch layouts for one target forward over many requests' verify blocks: padded rows vs one flat sequence.

    python bench/batch_layout.py [--threads 1] [--context 256] [--repeats 15]

Batched serving (issue 15) scores every running request's block — request i has k_i tokens after
its own L_i cached positions — in one forward. Two ways to lay that out (docs/architecture.md and
the issue ask to measure both on this CPU before choosing):

* **padded rows**: a [B, k_max] batch; each row's KV padded to L_max; a 4-D mask hides the padding
  (and, for trees, holds each row's ancestry). Attention costs B * k_max * (L_max + k_max); the
  MLP runs B * k_max rows, padding included.
* **flat**: one [1, Σk_i] sequence over the concatenated KV of all requests (Σ L_i positions) with
  a block-diagonal 4-D mask. The MLP runs exactly Σ k_i rows; attention costs Σk_i * (Σ L_i + Σ k_i).

Times the shipped target's forward (median of ``--repeats``, after two warm-ups) for each layout,
batch size and block mix, with random KV standing in for real prefixes (the cost does not depend
on the values), and the rows/s each achieves. Prints a Markdown table and one JSON line.
Measures cost only; it decides nothing and changes no code path.
"""

from __future__ import annotations

import argparse
import json
import statistics
import time

import torch
from transformers import DynamicCache

from specserve import defaults
from specserve.core.model.causal_lm import CausalLM


def filled_cache(target: CausalLM, batch: int, length: int) -> DynamicCache:
    """A cache of ``batch`` rows and ``length`` positions of random keys and values."""
    config = target.model.config
    heads = getattr(config, "num_key_value_heads", config.num_attention_heads)
    head_dim = getattr(config, "head_dim", config.hidden_size // config.num_attention_heads)
    cache = DynamicCache(config=config)
    generator = torch.Generator().manual_seed(0)
    for layer in range(config.num_hidden_layers):
        keys = torch.randn(batch, heads, length, head_dim, generator=generator, dtype=target.dtype)
        cache.update(keys, torch.randn_like(keys), layer)
    return cache


def time_forward(target: CausalLM, lengths: list[int], blocks: list[int], layout: str, repeats: int) -> float:
    """Median seconds of one forward over requests with cached ``lengths`` and verify ``blocks``."""
    dtype, low = target.dtype, torch.finfo(target.dtype).min
    if layout == "padded":
        batch, width, context = len(lengths), max(blocks), max(lengths)
        mask = torch.full((batch, 1, width, context + width), low, dtype=dtype)
        positions = torch.zeros(batch, width, dtype=torch.long)
        for row, (length, k) in enumerate(zip(lengths, blocks, strict=True)):
            mask[row, 0, :k, :length] = 0  # the row's own prefix; the padding beyond it stays hidden
            mask[row, 0, :k, context : context + k] = torch.triu(torch.full((k, k), low, dtype=dtype), 1)
            mask[row, 0, k:, context] = 0  # padded query rows see one position (their output is discarded)
            positions[row, :k] = torch.arange(length, length + k)
        ids = torch.zeros(batch, width, dtype=torch.long)
        cache_rows, cache_length = batch, context
    else:
        total, context = sum(blocks), sum(lengths)
        mask = torch.full((1, 1, total, context + total), low, dtype=dtype)
        positions = torch.zeros(1, total, dtype=torch.long)
        row = start = 0
        for length, k in zip(lengths, blocks, strict=True):
            mask[0, 0, row : row + k, start : start + length] = 0
            block = torch.triu(torch.full((k, k), low, dtype=dtype), 1)
            mask[0, 0, row : row + k, context + row : context + row + k] = block
            positions[0, row : row + k] = torch.arange(length, length + k)
            row, start = row + k, start + length
        ids = torch.zeros(1, total, dtype=torch.long)
        cache_rows, cache_length = 1, context
    times = []
    for i in range(repeats + 2):
        cache = filled_cache(target, cache_rows, cache_length)
        with torch.inference_mode():
            start_time = time.perf_counter()
            target.model(input_ids=ids, attention_mask=mask, position_ids=positions, **{target._cache_kwarg: cache})
            if i >= 2:
                times.append(time.perf_counter() - start_time)
    return statistics.median(times)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--context", type=int, default=256, help="cached positions per request")
    parser.add_argument("--repeats", type=int, default=15)
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    target = CausalLM.load(defaults.DEFAULT_TARGET)
    cases = []
    for batch in (1, 4, 16):
        for name, blocks in (
            ("k=1 each", [1] * batch),
            ("k=5 each", [5] * batch),
            ("mixed k in 1..9", [1 + (5 * i) % 9 for i in range(batch)]),
        ):
            if batch == 1 and name.startswith("mixed"):
                continue
            lengths = [args.context - 8 * (i % 4) for i in range(batch)]  # ragged prefixes, as in serving
            row = {"batch": batch, "blocks": name, "rows": sum(blocks)}
            for layout in ("padded", "flat"):
                seconds = time_forward(target, lengths, blocks, layout, args.repeats)
                row[f"{layout}_ms"] = round(seconds * 1e3, 2)
                row[f"{layout}_rows_per_s"] = round(sum(blocks) / seconds, 1)
            cases.append(row)
    print(f"| batch | blocks | rows | padded ms | flat ms | padded rows/s | flat rows/s |  ({args.threads} thread(s), "
          f"context {args.context})")  # fmt: skip
    print("|---|---|---|---|---|---|---|")
    for row in cases:
        print(f"| {row['batch']} | {row['blocks']} | {row['rows']} | {row['padded_ms']} | {row['flat_ms']} | "
              f"{row['padded_rows_per_s']} | {row['flat_rows_per_s']} |")  # fmt: skip
    print(json.dumps({"threads": args.threads, "context": args.context, "cases": cases}))


if __name__ == "__main__":
    main()
