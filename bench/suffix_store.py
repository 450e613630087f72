"""What sharing the suffix drafter's store across replicas costs (``suffix_store: cluster``).

    RAY_USAGE_STATS_ENABLED=0 python bench/suffix_store.py [--outputs 1000] [--tokens 128]

On a private local Ray (127.0.0.1), one store actor and two mirrors (two replicas):

* **publish** — what a replica's drafting path spends sending one finished output (not waited for);
* **pull** — the round trip of one mirror fetching the outputs another published since its last pull,
  for batches of 1, 10 and 100 outputs of ``--tokens`` tokens (in the background on the drafting path:
  a query only checks whether the pull has arrived);
* **query** — a suffix drafter's proposal (``text()`` + the longest-match scan) against a mirror holding
  ``--outputs`` outputs, beside the same against a replica-local store of the same content;
* **delay** — from a publish on one mirror until the other's queries see it, at the default refresh.

Medians of repeated runs, one thread. Prints one JSON document.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import time

import numpy as np
import ray
import torch

from specserve.actors.suffix_store import DEFAULT_REFRESH_S, SharedSuffixCache
from specserve.cluster.connect import loopback_only
from specserve.core.sampling.params import SamplingParams
from specserve.core.sampling.warps import make_generators
from specserve.drafters.suffix import SuffixCache, SuffixDrafter


def median_ms(samples: list[float]) -> float:
    return 1e3 * statistics.median(samples)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--outputs", type=int, default=1000, help="outputs in the store for the query timing")
    parser.add_argument("--tokens", type=int, default=128, help="tokens per output")
    parser.add_argument("--repeats", type=int, default=50)
    args = parser.parse_args()
    os.environ.setdefault("RAY_USAGE_STATS_ENABLED", "0")
    torch.set_num_threads(1)
    with loopback_only():
        ray.init(num_cpus=2, include_dashboard=False, _node_ip_address="127.0.0.1", log_to_driver=False)
    rng = np.random.default_rng(0)

    def output() -> np.ndarray:
        return rng.integers(0, 8000, size=args.tokens)

    first, second = SharedSuffixCache("bench-store"), SharedSuffixCache("bench-store")
    report: dict[str, object] = {"tokens_per_output": args.tokens, "refresh_s": DEFAULT_REFRESH_S}

    publish = []
    for _ in range(args.repeats):
        document = output()
        start = time.perf_counter()
        first.publish(document)
        publish.append(time.perf_counter() - start)
    second.refresh(wait=True)  # drain
    report["publish_ms"] = median_ms(publish)

    pulls: dict[str, float] = {}
    for batch in (1, 10, 100):
        samples = []
        for _ in range(max(args.repeats // batch, 5)):
            for _ in range(batch):
                first.publish(output())
            ray.get(first._actor.stats.remote())  # the publishes have landed
            start = time.perf_counter()
            second.refresh(wait=True)
            samples.append(time.perf_counter() - start)
        pulls[str(batch)] = median_ms(samples)
    report["pull_ms_by_outputs"] = pulls

    for i in range(args.outputs):  # fill the store, then mirror the same outputs into a replica-local one
        first.publish(output())
        if i % 100 == 99:
            second.refresh(wait=True)
    second.refresh(wait=True)
    local = SuffixCache()
    for document in second.documents:
        local.publish(document)
    queries: dict[str, float] = {}
    prompt = rng.integers(0, 8000, size=256).tolist()
    for name, cache in (("replica_local", local), ("cluster_mirror", second)):
        drafter = SuffixDrafter(cache)
        drafter.start(prompt, SamplingParams(), make_generators(0).draft)
        samples = []
        for _ in range(args.repeats):
            start = time.perf_counter()
            drafter.propose(4)
            samples.append(time.perf_counter() - start)
        queries[name] = median_ms(samples)
    report["store_tokens"] = second.tokens
    report["query_ms"] = queries

    delays = []
    for _ in range(5):
        marker = output()
        first.publish(marker)
        start = time.perf_counter()
        while not any(len(d) == len(marker) and d[-1] == int(marker[-1]) for d in second.documents[-3:]):
            second.text()
            time.sleep(0.01)
        delays.append(time.perf_counter() - start)
    report["visible_after_s"] = statistics.median(delays)
    print(json.dumps(report, indent=2))
    ray.shutdown()


if __name__ == "__main__":
    main()
