"""Two target replicas drafting on one pool member, against two replicas with a drafter each, on this machine.

    python bench/drafter_pool.py [--requests 16] [--max-new-tokens 64] [--rounds 2] [--out bench/results/drafter_pool]

The shipped pair, float32, the distributed runtime at TP 1, each replica batched (``max_num_seqs`` 4), greedy, γ 3.
Two layouts, alternating over ``--rounds`` (a fresh set of replicas each time):

* ``per-replica`` — two replicas, each with its own drafter actor on the ``cheap`` resource
  (``drafter_placement: separate``);
* ``pool`` — two replicas spawned with one :class:`~specserve.actors.drafter_pool.DrafterPool` of ratio 2: one member
  drafts both replicas' requests, in shared forwards.

``--requests`` held-out prompts go to the two replicas in turn, 4 at a time per replica. Per layout: tokens/s over the
wall time, the mean cycle's draft, verify and wire milliseconds (wire: send-to-verdict time the target did not spend),
and whether every output equals the in-process engine's. On this 2-core machine every actor shares the same cores:
the pool saves a process, not a device. Writes ``drafter_pool.json`` and ``drafter_pool.md``.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

from specserve import defaults
from specserve.cluster.replica_config import ReplicaConfig


def layout_run(name: str, config: ReplicaConfig, prompts: list[list[int]], max_new_tokens: int) -> dict[str, Any]:
    from specserve.actors.coordinator import Coordinator
    from specserve.actors.drafter_pool import DrafterPool
    from specserve.core.engine import GenerationConfig

    pool = DrafterPool(config, ratio=2) if name == "pool" else None
    with ThreadPoolExecutor(2) as spawn:
        coordinators = list(spawn.map(lambda _: Coordinator.spawn(config, pool), range(2)))
    generation = GenerationConfig(max_new_tokens=max_new_tokens, gamma=3, ignore_eos=True)
    try:
        for coordinator in coordinators:  # warm: the first request of a replica loads kernels
            coordinator.generate(prompts[0], None, GenerationConfig(max_new_tokens=8, gamma=3, ignore_eos=True))
        start = time.perf_counter()
        with ThreadPoolExecutor(8) as run:
            results = list(
                run.map(lambda i: coordinators[i % 2].generate(prompts[i], None, generation), range(len(prompts)))
            )
        wall = time.perf_counter() - start
    finally:
        for coordinator in coordinators:
            coordinator.shutdown()
        if pool is not None:
            pool.shutdown()
    cycles = [o for r in results for o in r.stats.observations]
    tokens = sum(len(r.output_ids) for r in results)
    return {
        "layout": name,
        "tokens": tokens,
        "seconds": round(wall, 3),
        "tokens_per_second": round(tokens / wall, 2),
        "cycles": len(cycles),
        "draft_ms": round(1000 * statistics.mean(o.draft_seconds for o in cycles), 3),
        "verify_ms": round(1000 * statistics.mean(o.verify_seconds for o in cycles), 3),
        "wire_ms": round(1000 * statistics.mean(o.wire_seconds for o in cycles), 3),
        "outputs": [r.output_ids for r in results],
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--requests", type=int, default=16)
    parser.add_argument("--max-new-tokens", type=int, default=64)
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument("--out", type=Path, default=Path("bench/results/drafter_pool"))
    args = parser.parse_args()

    from specserve.cluster.connect import connect_ray
    from specserve.core.engine import GenerationConfig, SpeculativeEngine
    from specserve.core.model import CausalLM
    from specserve.drafters.registry import build_drafter_set
    from specserve.training.corpus import heldout_prompts

    target = CausalLM.load(str(defaults.DEFAULT_TARGET), dtype="float32", device="cpu")
    assert target.tokenizer is not None
    prompts = [list(target.tokenizer(t, add_special_tokens=False)["input_ids"])[-200:]
               for t in heldout_prompts(args.requests)]  # fmt: skip
    engine = SpeculativeEngine(target, build_drafter_set(str(defaults.DEFAULT_DRAFT), target))
    generation = GenerationConfig(max_new_tokens=args.max_new_tokens, gamma=3, ignore_eos=True)
    reference = [engine.generate(p, None, generation).output_ids for p in prompts]
    config = ReplicaConfig(
        target=str(defaults.DEFAULT_TARGET),
        draft=str(defaults.DEFAULT_DRAFT),
        drafter_placement="separate",
        max_num_seqs=4,
        threads_per_shard=1,
        threads_per_drafter=1,
    )
    rows: list[dict[str, Any]] = []
    with connect_ray(replicas=3) as where:
        for round_index in range(args.rounds):
            order = ["per-replica", "pool"] if round_index % 2 == 0 else ["pool", "per-replica"]
            for name in order:
                row = layout_run(name, config, prompts, args.max_new_tokens)
                row["round"] = round_index
                row["equal_to_in_process"] = sum(o == r for o, r in zip(row.pop("outputs"), reference, strict=True))
                rows.append(row)
                print(json.dumps(row), file=sys.stderr, flush=True)
    command = " ".join(["python", *sys.argv])
    lines = [
        "# Two replicas on one pool member against a drafter each",
        "",
        f"`{command}` ({where}; 1 thread per shard and drafter, 2-core CPU shared by every actor)",
        "",
        "| round | layout | tok/s | cycles | draft ms | verify ms | wire ms | equal to in-process |",
        "|---|---|---|---|---|---|---|---|",
    ]
    for r in rows:
        lines.append(f"| {r['round']} | {r['layout']} | {r['tokens_per_second']:.1f} | {r['cycles']} | "
                     f"{r['draft_ms']:.2f} | {r['verify_ms']:.2f} | {r['wire_ms']:.2f} | "
                     f"{r['equal_to_in_process']}/{args.requests} |")  # fmt: skip
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / "drafter_pool.json").write_text(json.dumps({"command": command, "rows": rows}, indent=1) + "\n")
    (args.out / "drafter_pool.md").write_text("\n".join(lines) + "\n")
    print("\n".join(lines))


if __name__ == "__main__":
    main()
