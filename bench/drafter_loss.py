"""What a client sees when its request's drafter dies: the longest pause in its stream, and whether a token changed.

    python bench/drafter_loss.py [--max-new-tokens 400] [--kill-after 5] [--rounds 3] [--batched]

A private local Ray (127.0.0.1), one replica of the shipped pair (TP 1, draft model, γ 3, greedy). Each round
streams one request undisturbed, then the same request again, killing the drafter actor (Ray restarts it)
after ``--kill-after`` chunks, and records the chunk arrival times. Prints one JSON object: per round the
longest gap between chunks undisturbed and killed, the time from the kill to the next chunk, tokens/s of
both runs and whether the killed run's tokens equal the undisturbed run's. The decode speed after the kill
is plain decoding's (the coordinator verifies empty drafts), so the killed run is slower overall; the
gap is what a client waits for. Decides nothing; BENCHMARKS.md records a run.
"""

from __future__ import annotations

import argparse
import itertools
import json
import os
import time

os.environ.setdefault("RAY_USAGE_STATS_ENABLED", "0")


def stream(coordinator, prompt, params, config, kill_after=None):  # type: ignore[no-untyped-def]
    import ray

    times, tokens, killed_at = [], [], None
    start = time.perf_counter()
    for index, chunk in enumerate(coordinator.stream(prompt, params, config)):
        times.append(time.perf_counter())
        tokens.extend(chunk.token_ids)
        if kill_after is not None and index == kill_after:
            killed_at = time.perf_counter()
            ray.kill(coordinator.replica.drafter, no_restart=False)
    gaps = [b - a for a, b in itertools.pairwise(times)]
    after = [t - killed_at for t in times if killed_at is not None and t > killed_at]
    return {
        "tokens": tokens,
        "seconds": times[-1] - start,
        "longest_gap_s": max(gaps, default=0.0),
        "kill_to_next_chunk_s": after[0] if after else None,
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--max-new-tokens", type=int, default=400)
    parser.add_argument("--kill-after", type=int, default=5)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--batched", action="store_true", help="a batched replica (max_num_seqs 4)")
    args = parser.parse_args()

    import ray

    from specserve import defaults
    from specserve.actors.coordinator import Coordinator
    from specserve.cluster.connect import connect_ray
    from specserve.cluster.replica_config import ReplicaConfig
    from specserve.core.request import GenerationConfig
    from specserve.core.sampling.params import SamplingParams

    config = ReplicaConfig(
        target=str(defaults.DEFAULT_TARGET), draft=str(defaults.DEFAULT_DRAFT), max_num_seqs=4 if args.batched else 1
    )
    prompt = "import os\nimport sys\n\n\ndef main(argv):\n"
    generation = GenerationConfig(max_new_tokens=args.max_new_tokens, gamma=3, ignore_eos=True)
    rounds = []
    with connect_ray(None, spec=config.spec()):
        coordinator = Coordinator.spawn(config)
        try:
            coordinator.generate(prompt, SamplingParams(), GenerationConfig(max_new_tokens=8))  # warm-up
            for _ in range(args.rounds):
                calm = stream(coordinator, prompt, SamplingParams(), generation)
                hit = stream(coordinator, prompt, SamplingParams(), generation, kill_after=args.kill_after)
                rounds.append(
                    {
                        "undisturbed_longest_gap_s": round(calm["longest_gap_s"], 4),
                        "killed_longest_gap_s": round(hit["longest_gap_s"], 4),
                        "kill_to_next_chunk_s": hit["kill_to_next_chunk_s"] and round(hit["kill_to_next_chunk_s"], 4),
                        "undisturbed_tok_s": round(len(calm["tokens"]) / calm["seconds"], 1),
                        "killed_tok_s": round(len(hit["tokens"]) / hit["seconds"], 1),
                        "same_tokens": hit["tokens"] == calm["tokens"],
                    }
                )
                while True:  # Ray restarts the drafter; the next round starts with it back
                    try:
                        ray.get(coordinator.replica.drafter.node_id.remote(), timeout=5)
                        break
                    except ray.exceptions.RayActorError:
                        time.sleep(0.5)
        finally:
            coordinator.shutdown()
    print(json.dumps({"threads_per_shard": config.threads_per_shard, "batched": args.batched, "rounds": rounds}))


if __name__ == "__main__":
    main()
