"""A batched replica on the distributed runtime: throughput by concurrency, and how the drafter shared its rounds.

    python bench/batch_distributed.py [--concurrency 1,4,8] [--gamma 3] [--max-new-tokens 64] [--threads 1]

For each level c: a private local Ray (127.0.0.1), one replica of the shipped pair on the distributed
runtime (TP 1, drafter co-located, no overlap, ``max_num_seqs = c``; the Serve path would run this
configuration in process, so the script spawns the replica itself), and a closed loop that keeps c
requests in flight until ``max(2c, 4)`` held-out requests (greedy, EOS ignored, the draft model at a fixed
γ) have finished. Reports generated tokens per second (prefill included), mean batch size of the verify
steps, and the drafter actor's rounds of shared drafting by size (``DrafterActor.draft_rounds``). Prints a
Markdown table and one JSON line; asserts nothing. Threads per actor: ``--threads``.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import time
from concurrent.futures import ThreadPoolExecutor
from typing import Any

from specserve import defaults
from specserve.benchmarks.prompts import heldout_prompts
from specserve.cluster.replica_config import ReplicaConfig
from specserve.core.request import GenerationConfig
from specserve.core.sampling.params import SamplingParams


def draft_rounds(coordinator: Any) -> dict[int, int]:
    """The drafter actor's shared rounds by size ({} for a drafter that does not gather: before commit c63818b)."""
    import ray

    try:
        method = coordinator.replica.drafter.draft_rounds
    except AttributeError:
        return {}
    return dict(ray.get(method.remote()))


def level(concurrency: int, args: argparse.Namespace, prompts: list[str]) -> dict[str, Any]:

    from specserve.actors.coordinator import Coordinator
    from specserve.cluster.connect import connect_ray

    config = ReplicaConfig(
        target=str(defaults.DEFAULT_TARGET),
        draft=str(defaults.DEFAULT_DRAFT),
        max_num_seqs=concurrency,
        threads_per_shard=args.threads,
        threads_per_drafter=args.threads,
        batch_wait_ms=args.batch_wait_ms,
    )
    generation = GenerationConfig(max_new_tokens=args.max_new_tokens, gamma=args.gamma, ignore_eos=True)
    requests = max(2 * concurrency, 4)
    with connect_ray(spec=config.spec()):
        coordinator = Coordinator.spawn(config)
        try:
            coordinator.generate(prompts[0], SamplingParams(), GenerationConfig(max_new_tokens=4))  # warm-up
            warm = draft_rounds(coordinator)
            start = time.perf_counter()
            with ThreadPoolExecutor(concurrency) as pool:
                results = list(
                    pool.map(
                        lambda i: coordinator.generate(prompts[i % len(prompts)], SamplingParams(), generation),
                        range(requests),
                    )
                )
            wall = time.perf_counter() - start
            rounds = draft_rounds(coordinator)
        finally:
            coordinator.shutdown()
    rounds = {size: count - warm.get(size, 0) for size, count in rounds.items() if count > warm.get(size, 0)}
    tokens = sum(len(r.output_ids) for r in results)
    batches = [o.batch_size for r in results for o in r.stats.observations]
    return {
        "concurrency": concurrency,
        "requests": requests,
        "tok_s": tokens / wall,
        "mean_batch": statistics.fmean(batches) if batches else 0.0,
        "draft_rounds": {str(size): rounds[size] for size in sorted(rounds)},
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--concurrency", default="1,4,8")
    parser.add_argument("--gamma", type=int, default=3)
    parser.add_argument("--max-new-tokens", type=int, default=64)
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--batch-wait-ms", type=float, default=20.0)
    parser.add_argument("--prompt-chars", type=int, default=600)
    args = parser.parse_args()
    os.environ.setdefault("RAY_USAGE_STATS_ENABLED", "0")
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    prompts = [p[: args.prompt_chars] for p in heldout_prompts(8)]
    rows = [level(int(c), args, prompts) for c in args.concurrency.split(",")]
    print(f"\n{args.threads} thread(s) per actor; γ {args.gamma}, {args.max_new_tokens} new tokens, greedy\n")
    print("| clients | requests | tok/s | mean verify batch | draft rounds by size |")
    print("|---|---|---|---|---|")
    for row in rows:
        shared = ", ".join(f"{size}: {count}" for size, count in row["draft_rounds"].items()) or "–"
        print(f"| {row['concurrency']} | {row['requests']} | {row['tok_s']:.1f} | {row['mean_batch']:.2f} | {shared} |")
    print(json.dumps({"threads": args.threads, "gamma": args.gamma, "rows": rows}))


if __name__ == "__main__":
    main()
