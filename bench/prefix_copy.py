"""What a prefix-cache hit costs on the span pool, against what it saves, on this CPU; and what a lookup costs.

    python bench/prefix_copy.py [--threads 1] [--lengths 100,300,600,900] [--entries 64] [--repeats 11]

The prefix cache (:mod:`specserve.core.kv.prefix_cache`) keeps the span layout of the KV pool: a hit copies the cached
prefix's keys and values into the newcomer's own span (every layer, keys and values), so every batched step still
reads each request's KV as one view (a paged pool would share pages without a copy, but pay a gather of every page
into rows at every step on this CPU: bench/kv_paging.py). This script times, on the shipped target with a pool of
its real KV shape:

* the copy of ``L`` cached positions (:meth:`~specserve.core.kv.pool.KVPool.copy`), against
* the prefill of the same ``L`` positions (the target's forward over them, in one chunk), which the hit replaces;
* the index's longest-prefix lookup (:class:`~specserve.core.kv.prefix_index.PrefixIndex`) of a 700-token prompt among
  ``--entries`` cached sequences that share a 600-token prefix, against the chained block hashes vLLM uses
  (a dict of 16-token block hashes, walked block by block), timed the same way.

Median of ``--repeats`` after a warm-up. Prints one JSON line. Measures only; changes no code path.
"""

from __future__ import annotations

import argparse
import json
import random
import statistics
import time
from collections.abc import Callable

import torch

from specserve import defaults
from specserve.core.kv.pool import KVPool
from specserve.core.kv.prefix_index import PrefixIndex
from specserve.core.model.causal_lm import BatchBlock, CausalLM


def median_ms(run: Callable[[], object], repeats: int) -> float:
    run()
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        run()
        times.append(time.perf_counter() - start)
    return 1000 * statistics.median(times)


def block_hash_lookup(table: dict[int, int], query: list[int], block: int = 16) -> int:
    """vLLM-style: hash each full block chained on its parent's hash; the hit is the blocks found in a row."""
    parent, matched = 0, 0
    for start in range(0, len(query) - block + 1, block):
        parent = hash((parent, tuple(query[start : start + block])))
        if parent not in table:
            break
        matched += block
    return matched


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--lengths", default="100,300,600,900")
    parser.add_argument("--entries", type=int, default=64)
    parser.add_argument("--repeats", type=int, default=11)
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    target = CausalLM.load(str(defaults.DEFAULT_TARGET))
    lengths = [int(n) for n in args.lengths.split(",")]
    pool = KVPool(target.model, 2 * max(lengths) + 2)
    vocab = target.info.vocab_size
    rows = []
    for length in lengths:
        source = pool.allocate(length)
        ids = torch.randint(3, vocab, (length,))
        target.forward_batch(pool, [BatchBlock.chain(source, ids)], last_only=True)
        newcomer = pool.allocate(length)

        def copy(source: int = source, newcomer: int = newcomer, length: int = length) -> None:
            pool.rollback(newcomer, 0)
            pool.copy(source, newcomer, 0, length)

        def prefill(newcomer: int = newcomer, ids: torch.Tensor = ids) -> None:
            pool.rollback(newcomer, 0)
            target.forward_batch(pool, [BatchBlock.chain(newcomer, ids)], last_only=True)

        with torch.inference_mode():
            rows.append(
                {
                    "positions": length,
                    "copy_ms": median_ms(copy, args.repeats),
                    "prefill_ms": median_ms(prefill, max(3, args.repeats // 3)),
                }
            )
        pool.free(source)
        pool.free(newcomer)

    rng = random.Random(0)
    shared = [rng.randrange(vocab) for _ in range(600)]
    index, table = PrefixIndex(), {}
    for item in range(args.entries):
        tokens = shared + [rng.randrange(vocab) for _ in range(100)]
        index.insert(item, "", tokens)
        parent = 0
        for start in range(0, len(tokens) - 15, 16):
            parent = hash((parent, tuple(tokens[start : start + 16])))
            table[parent] = item
    query = shared + [rng.randrange(vocab) for _ in range(100)]
    lookups = {
        "sorted_index_lookup_ms": median_ms(lambda: index.longest("", query), 101),
        "block_hash_lookup_ms": median_ms(lambda: block_hash_lookup(table, query), 101),
        "sorted_index_hit": index.longest("", query)[1],
        "block_hash_hit": block_hash_lookup(table, query),
    }
    kv_bytes = sum(t[:, :1].numel() * t.element_size() for t in (*pool.keys, *pool.values))
    print(json.dumps({"threads": args.threads, "kv_bytes_per_position": kv_bytes, "rows": rows, **lookups}))


if __name__ == "__main__":
    main()
