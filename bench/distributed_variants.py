"""A/B runs of replica settings against the in-process engine on a few prompts (development measurements).

    python bench/distributed_variants.py '[{"threads_per_shard": 2}, {"threads_per_shard": 1, "overlap": true,
                                            "drafter_placement": "separate"}]' [num_prompts]

Each JSON object is a set of ReplicaConfig overrides; prints tokens/s and the per-cycle split.
"""

import json
import sys

import torch

from specserve.actors import Coordinator, ReplicaConfig
from specserve.benchmarks import distributed as bench
from specserve.benchmarks.prompts import heldout_prompts
from specserve.cluster.connect import connect_ray
from specserve.core.engine import SpeculativeEngine
from specserve.core.model.causal_lm import CausalLM
from specserve.drafters import build_drafter


def main() -> None:
    variants = json.loads(sys.argv[1])
    cfg = bench.DistributedBenchConfig(
        target="models/target", draft="models/draft", num_prompts=int(sys.argv[2]) if len(sys.argv) > 2 else 6
    )
    torch.set_num_threads(cfg.threads)
    target = CausalLM.load(cfg.target)
    engine = SpeculativeEngine(target, build_drafter(cfg.draft, target))
    prompts = [engine.encode(p) for p in heldout_prompts(cfg.num_prompts)]
    row = bench.summarise_run(bench.Method("in-process"), bench.generate_all(engine, prompts, cfg, "in-process"), None)
    print(
        "in-process",
        f"{row['tokens_per_second']:.1f} tok/s",
        {k: round(v, 2) for k, v in row.items() if k.endswith("_ms")},
    )
    with connect_ray(tp_degree=2):
        for overrides in variants:
            coordinator = Coordinator.spawn(ReplicaConfig(target=cfg.target, draft=cfg.draft, **overrides))
            try:
                method = bench.Method("variant", 1, overlap=overrides.get("overlap", False))
                row = bench.summarise_run(method, bench.generate_all(coordinator, prompts, cfg, "variant"), None)
            finally:
                coordinator.shutdown()
            print(overrides, f"{row['tokens_per_second']:.1f} tok/s",
                  {k: round(v, 2) for k, v in row.items() if k.endswith("_ms")}, row["overlap_hit_rate"])  # fmt: skip


if __name__ == "__main__":
    main()
