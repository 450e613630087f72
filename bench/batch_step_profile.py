"""Where a batched workload's time goes, step by step, per mode: prefill, drafting, verify forwards by width.

    python bench/batch_step_profile.py [--threads 1] [--concurrency 16] [--modes plain,gamma-2,adaptive]

``specserve bench-batch`` says how fast each mode is; this script says why. It runs the same closed loop
(``c`` requests in flight, ``2c`` held-out requests, 128 new tokens, greedy, a fresh adaptive prior) through
a :class:`~specserve.core.batch_engine.BatchedEngine` per mode and times, over the whole level: the prefill
forwards, the drafting (``propose_batch``), and the verify forwards grouped by the step's width (its widest
block, 1 = plain decoding) with how many rows drafted in them. Prints a Markdown table per mode and one JSON
line; asserts nothing.
"""

from __future__ import annotations

import argparse
import json
import time
from collections import defaultdict
from collections.abc import Sequence
from typing import Any

import torch

from specserve.benchmarks import batch as bench
from specserve.core import batch_engine
from specserve.core.batch_engine import BatchedEngine
from specserve.core.model.causal_lm import BatchBlock
from specserve.core.sampling.params import SamplingParams

MODES = {
    "plain": bench.Mode(bench.PLAIN, "batched", drafter="none"),
    "gamma-2": bench.Mode(f"{bench.GAMMA_PREFIX}2", "batched", drafter="default", gamma=2),
    "adaptive": bench.Mode(bench.ADAPTIVE, "batched", drafter="default", gamma=3, policy="adaptive"),
}


def profile(mode: bench.Mode, concurrency: int, models: bench.Models, prompt_ids: list[list[int]]) -> dict[str, Any]:
    cfg = bench.BatchBenchConfig(concurrency=(concurrency,), temperatures=(0.0,))
    engine = bench.engine_for(mode, models, cfg, concurrency)
    assert isinstance(engine, BatchedEngine)
    totals: dict[str, float] = defaultdict(float)
    widths: dict[int, list[float]] = defaultdict(lambda: [0, 0.0, 0, 0])  # steps, seconds, rows, drafting rows
    forward = engine.ops.forward_batch

    def timed_forward(blocks: Sequence[BatchBlock], last_only: bool = False, capture: Any = None) -> Any:
        start = time.perf_counter()
        try:
            return forward(blocks, last_only=last_only, capture=capture)
        finally:
            seconds = time.perf_counter() - start
            if last_only:  # prefill chunks
                totals["prefill_s"] += seconds
            else:
                row = widths[max(block.size for block in blocks)]
                row[0] += 1
                row[1] += seconds
                row[2] += len(blocks)
                row[3] += sum(block.size > 1 for block in blocks)

    propose = batch_engine.propose_batch

    def timed_propose(*args: Any, **kwargs: Any) -> Any:
        start = time.perf_counter()
        try:
            return propose(*args, **kwargs)
        finally:
            totals["draft_s"] += time.perf_counter() - start

    engine.ops.forward_batch = timed_forward  # type: ignore[method-assign]
    batch_engine.propose_batch = timed_propose
    try:
        generation = mode.generation(128)
        requests, submitted, finished, tokens = 2 * concurrency, 0, 0, 0
        start = time.perf_counter()
        while finished < requests:
            while submitted < requests and submitted - finished < concurrency:
                engine.submit(prompt_ids[submitted % len(prompt_ids)], SamplingParams(), generation)
                submitted += 1
            for _, chunk in engine.step():
                tokens += len(chunk.token_ids)
                finished += chunk.result is not None
        wall = time.perf_counter() - start
    finally:
        batch_engine.propose_batch = propose
    verify_s = sum(row[1] for row in widths.values())
    return {
        "mode": mode.name,
        "concurrency": concurrency,
        "tok_s": tokens / wall,
        "wall_s": wall,
        "prefill_s": totals["prefill_s"],
        "draft_s": totals["draft_s"],
        "verify_s": verify_s,
        "other_s": wall - totals["prefill_s"] - totals["draft_s"] - verify_s,
        "widths": {
            str(w): {"steps": r[0], "seconds": r[1], "mean_rows": r[2] / r[0], "drafting_rows": r[3] / r[0]}
            for w, r in sorted(widths.items())
        },
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--concurrency", type=int, default=16)
    parser.add_argument("--modes", default="plain,gamma-2,adaptive", help=f"among {', '.join(MODES)}")
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    models, prompt_ids = bench.load(bench.BatchBenchConfig())
    rows = [profile(MODES[name], args.concurrency, models, prompt_ids) for name in args.modes.split(",")]
    print(f"{args.threads} torch thread(s); {args.concurrency} requests in flight, {2 * args.concurrency} in all\n")
    for r in rows:
        print(f"**{r['mode']}**: {r['tok_s']:.1f} tok/s in {r['wall_s']:.1f} s: prefill {r['prefill_s']:.1f} s, "
              f"drafting {r['draft_s']:.1f} s, verify {r['verify_s']:.1f} s, other {r['other_s']:.1f} s\n")  # fmt: skip
        print("| width | steps | seconds | ms/step | mean rows | drafting rows |")
        print("|---|---|---|---|---|---|")
        for width, w in r["widths"].items():
            ms = 1000 * w["seconds"] / w["steps"]
            rows_ = f"{w['mean_rows']:.1f} | {w['drafting_rows']:.1f}"
            print(f"| {width} | {w['steps']} | {w['seconds']:.2f} | {ms:.1f} | {rows_} |")
        print()
    print(json.dumps({"threads": args.threads, "rows": rows}))


if __name__ == "__main__":
    main()
