"""Why a draft-tree level with 2-3 rows costs about twice a one-row draft step on this CPU.

Times the draft model's largest matmul (its LM head: [rows, hidden] x [hidden, vocab]) and one whole draft
forward for rows = 1, 2, 3, 4, 8, 16 (median of 200, after warm-up). Prints a table and one JSON line.

    python bench/matmul_rows.py [--model models/draft]
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from collections.abc import Callable

import torch

from specserve import defaults
from specserve.core.model.causal_lm import CausalLM

ROWS = (1, 2, 3, 4, 8, 16)


def median_ms(fn: Callable[[], object], repeats: int = 200) -> float:
    for _ in range(10):
        fn()
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        fn()
        times.append(time.perf_counter() - start)
    return 1000 * statistics.median(times)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default=str(defaults.DEFAULT_DRAFT))
    args = parser.parse_args()
    torch.set_num_threads(2)
    model = CausalLM.load(args.model)
    head = model.model.get_output_embeddings().weight.detach()
    cache = model.new_cache()
    model.forward(cache, torch.randint(0, model.info.vocab_size, (300,)), last_only=True)
    length = cache.length
    out: dict[str, dict[int, float]] = {"lm_head_ms": {}, "forward_ms": {}}
    with torch.inference_mode():
        for rows in ROWS:
            x = torch.randn(rows, head.shape[1])
            ids = torch.randint(0, model.info.vocab_size, (rows,))

            def forward(ids: torch.Tensor = ids) -> None:
                model.forward(cache, ids)
                cache.rollback(length)

            out["lm_head_ms"][rows] = median_ms(lambda x=x: x @ head.T)
            out["forward_ms"][rows] = median_ms(forward, repeats=100)
            print(f"rows {rows:2d}: LM head {out['lm_head_ms'][rows]:.3f} ms, forward {out['forward_ms'][rows]:.2f} ms")
    print(json.dumps({"model": args.model, **out}))


if __name__ == "__main__":
    main()
