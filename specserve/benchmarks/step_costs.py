"""T(rows, width): what one batched step costs by its rows and block width, and the row buckets that table implies.

A batched step over ``rows`` sequences, each holding ``prefix`` cached positions, appends a block of ``width`` tokens to
every row (:meth:`~specserve.core.model.causal_lm.CausalLM.forward_batch`), and is rolled back after. :func:`step_costs`
times it (median ms over ``repeats``, after one untimed run that warms up or captures the shape) for every ``rows`` in
``1 .. max_rows`` (or the levels given) at each width, two ways:

* ``ordinary`` — the eager batched forward (row by row on a CPU, FlexAttention on CUDA:
  :mod:`specserve.core.attention.flex`);
* ``captured`` — the captured step of :mod:`specserve.core.static.batch_graphs`, at exactly that many rows (one row
bucket
  per count), replayed as a CUDA graph on CUDA and run eagerly elsewhere.

:func:`~specserve.core.model.buckets.choose_buckets` on the captured costs of one width gives the row counts worth a
graph of their own: every other count pads up to the next one (``row_buckets``). Used by the device check's batched
sections and ``bench/batch_graphs.py``. Decides nothing on its own.
"""

from __future__ import annotations

import statistics
import time
from collections.abc import Sequence
from typing import Any

import torch

from specserve.benchmarks.timing import synchronize
from specserve.core.kv.pool import KVPool
from specserve.core.model.buckets import VerifyBuckets, choose_buckets
from specserve.core.model.causal_lm import BatchBlock, CausalLM
from specserve.core.static.batch_graphs import BatchGraphs
from specserve.core.static.graphs import CudaGraphs

MODES = ("ordinary", "captured")


def step_costs(
    model: CausalLM,
    rows: Sequence[int],
    widths: Sequence[int] = (1, 4),
    prefix: int = 64,
    repeats: int = 5,
    modes: Sequence[str] = MODES,
) -> dict[str, Any]:
    """Median ms per step by mode, width and rows (module docstring); with every ``rows`` from 1 to its largest, the
    row buckets ``choose_buckets`` picks from the captured costs of each width."""
    unknown = set(modes) - set(MODES)
    if unknown or not rows or min(rows) < 1 or not widths or min(widths) < 1:
        raise ValueError(f"modes among {MODES}, rows and widths >= 1; got {list(modes)}, {list(rows)}, {list(widths)}")
    device = model.device
    most = max(rows)
    pool = KVPool(model.model, most * (prefix + max(widths)))
    backend = CudaGraphs(device) if device.type == "cuda" else None
    owner = BatchGraphs(
        model,
        pool,
        VerifyBuckets(tuple(sorted(set(widths)))),
        backend,
        rows=VerifyBuckets(tuple(sorted(set(rows)))),
        limit=len(rows) * len(widths),
    )
    sequences = [pool.allocate(prefix + max(widths)) for _ in range(most)]
    generator = torch.Generator().manual_seed(0)
    vocab = model.info.vocab_size
    with torch.inference_mode():
        for sequence in sequences:  # every row's cached prefix (one row at a time: no padding)
            model.forward_batch(
                pool, [BatchBlock.chain(sequence, torch.randint(0, vocab, (prefix,), generator=generator))]
            )
    table: dict[str, dict[int, dict[int, float]]] = {mode: {w: {} for w in widths} for mode in modes}
    for width in widths:
        block = torch.randint(0, vocab, (width,), generator=generator)
        for count in rows:
            blocks = [BatchBlock.chain(sequence, block) for sequence in sequences[:count]]
            for mode in modes:
                graphs = owner if mode == "captured" else None
                times = []
                for _ in range(repeats + 1):
                    synchronize(device)
                    start = time.perf_counter()
                    model.forward_batch(pool, blocks, graphs=graphs)
                    synchronize(device)
                    times.append(time.perf_counter() - start)
                    for sequence in sequences[:count]:
                        pool.rollback(sequence, prefix)
                table[mode][width][count] = round(1000 * statistics.median(times[1:]), 4)
    report: dict[str, Any] = {
        "prefix_tokens": prefix,
        "repeats": repeats,
        "graphed": backend is not None,
        "ms": {
            mode: {str(w): {str(r): ms for r, ms in by_rows.items()} for w, by_rows in t.items()}
            for mode, t in table.items()
        },
        "capture_failures": {str(key): why for key, why in owner.graphs.failures.items()},
    }
    if "captured" in modes and sorted(rows) == list(range(1, most + 1)):
        report["row_buckets"] = {str(w): list(choose_buckets(t).widths) for w, t in table["captured"].items()}
    return report
