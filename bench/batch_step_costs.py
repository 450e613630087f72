"""What one batched step costs once every request is decoding: forward, drafting and the rest, per mode.

    python bench/batch_step_costs.py [--threads 1] [--requests 1,4,16] [--gammas 0,1,2,3,4] [--steps 30]

``specserve bench-batch`` measures whole workloads, prefill included. This script isolates the decode
phase the issue's ceiling speaks of: B held-out requests are submitted to a :class:`BatchedEngine`, every
prompt is prefilled, a few steps warm up, and then ``--steps`` steps are timed. Per (B, γ): milliseconds
per step and how they split between the target's verify forward (``forward_batch``), drafting (the draft
model's shared forwards) and everything else (verdicts, streaming, bookkeeping), tokens per step, and
decode-only tokens per second. γ = 0 is plain decoding; γ > 0 a fixed chain from the shipped draft model.
Greedy, 1 thread by default. Prints a Markdown table and one JSON line; asserts nothing.
"""

from __future__ import annotations

import argparse
import json
import time
from collections.abc import Callable
from typing import Any

import torch

from specserve.benchmarks import batch as bench
from specserve.core.batch_engine import BatchedEngine
from specserve.core.sampling.params import SamplingParams

MAX_NEW_TOKENS = 256  # each request's budget: the warm-up and timed steps must not finish it
WARMUP_STEPS = 5


def timed(owner: Any, name: str, totals: dict[str, float], key: str) -> None:
    """Wrap ``owner.name`` so that its seconds accumulate in ``totals[key]``."""
    inner: Callable[..., Any] = getattr(owner, name)

    def wrapper(*args: Any, **kwargs: Any) -> Any:
        start = time.perf_counter()
        try:
            return inner(*args, **kwargs)
        finally:
            totals[key] += time.perf_counter() - start

    setattr(owner, name, wrapper)


def measure(requests: int, gamma: int, steps: int, models: bench.Models, prompt_ids: list[list[int]]) -> dict[str, Any]:
    cfg = bench.BatchBenchConfig(concurrency=(requests,), temperatures=(0.0,))
    mode = bench.Mode(
        bench.PLAIN if gamma == 0 else f"{bench.GAMMA_PREFIX}{gamma}",
        "batched",
        drafter="none" if gamma == 0 else "default",
        gamma=gamma,
    )
    engine = bench.engine_for(mode, models, cfg, requests)
    assert isinstance(engine, BatchedEngine)
    totals = {"forward": 0.0, "draft": 0.0}
    timed(engine.ops, "forward_batch", totals, "forward")
    generation = mode.generation(MAX_NEW_TOKENS)  # more than the timed steps can emit: no request finishes
    for index in range(requests):
        engine.submit(prompt_ids[index % len(prompt_ids)], SamplingParams(), generation)
    started: set[int] = set()
    while len(started) < requests:  # until every prompt is prefilled and has its first token
        started.update(request_id for request_id, chunk in engine.step() if chunk.token_ids)
    for _ in range(WARMUP_STEPS):  # every prompt prefilled: warm up the decode steps
        engine.step()
    if gamma:
        batcher = engine.new_drafter("default").batcher  # type: ignore[attr-defined]
        timed(batcher, "propose_chains", totals, "draft")
    totals["forward"] = 0.0
    tokens, start = 0, time.perf_counter()
    for _ in range(steps):
        tokens += sum(len(chunk.token_ids) for _, chunk in engine.step())
    wall = time.perf_counter() - start
    per_step = {key: 1000 * value / steps for key, value in totals.items()}
    return {
        "requests": requests,
        "gamma": gamma,
        "ms_per_step": 1000 * wall / steps,
        "forward_ms": per_step["forward"],
        "draft_ms": per_step["draft"],
        "other_ms": 1000 * wall / steps - per_step["forward"] - per_step["draft"],
        "tokens_per_step": tokens / steps,
        "tok_s": tokens / wall,
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--requests", default="1,4,16")
    parser.add_argument("--gammas", default="0,1,2,3,4")
    parser.add_argument("--steps", type=int, default=30)
    args = parser.parse_args()
    widest = 1 + max(int(g) for g in args.gammas.split(","))
    if (args.steps + WARMUP_STEPS + 1) * widest > MAX_NEW_TOKENS:
        parser.error(f"--steps {args.steps} at γ {widest - 1} could finish requests while timed; use fewer steps")
    torch.set_num_threads(args.threads)
    models, prompt_ids = bench.load(bench.BatchBenchConfig(max_new_tokens=MAX_NEW_TOKENS))
    rows = [
        measure(int(b), int(g), args.steps, models, prompt_ids)
        for b in args.requests.split(",")
        for g in args.gammas.split(",")
    ]
    print(f"{args.threads} torch thread(s); greedy; every prompt prefilled; {args.steps} steps timed\n")
    print("| requests | γ | ms/step | forward ms | draft ms | other ms | tokens/step | decode tok/s |")
    print("|---|---|---|---|---|---|---|---|")
    for r in rows:
        print(
            f"| {r['requests']} | {r['gamma']} | {r['ms_per_step']:.1f} | {r['forward_ms']:.1f} | {r['draft_ms']:.1f} "
            f"| {r['other_ms']:.1f} | {r['tokens_per_step']:.2f} | {r['tok_s']:.1f} |"
        )
    print(json.dumps({"threads": args.threads, "rows": rows}))


if __name__ == "__main__":
    main()
