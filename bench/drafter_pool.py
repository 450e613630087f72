"""Two target replicas drafting on a shared drafter pool, against two replicas with a drafter each, on this machine.

    python bench/drafter_pool.py [--requests 16] [--waves 3] [--max-new-tokens 64] [--rounds 2] [--out DIR]

The shipped pair, float32, the distributed runtime at TP 1, each replica batched (``max_num_seqs`` 4), greedy, γ 3.
Three layouts, alternating over ``--rounds`` (a fresh set of replicas each time):

* ``per-replica`` — two replicas, each with its own drafter actor on the ``cheap`` resource
  (``drafter_placement: separate``);
* ``pool`` — two replicas of ``drafter_placement: pool`` with ``pool_ratio`` 2: the model's shared pool (a named Ray
  actor each request picks its member from) holds one member, which drafts both replicas' requests in shared forwards;
* ``pool-scaling`` — the same with ``pool_ratio`` 1 and up to two members, scaling at once and draining after 5 s:
  the run's eight requests at once want two members (the first drafts them in its burst room meanwhile), so the pool
  grows while it runs, and drains back after.

``--requests`` held-out prompts, sent ``--waves`` times (a run that outlasts a member's start), go to the two replicas
in turn, 4 at a time per replica. Per layout: tokens/s over the
wall time, the mean cycle's draft, verify and wire milliseconds (wire: send-to-verdict time the target did not spend),
whether every output equals the in-process engine's; for the pools, what a pick and a done cost a request (the shared
pool's round trip, timed apart from the run) and the members over the run — when the second was ready and when, idle,
it was stopped. On this 2-core machine every actor shares the same cores: the pool saves a process, not a device.
Writes ``drafter_pool.json`` and ``drafter_pool.md``.
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
from specserve.benchmarks.tables import write_report
from specserve.cluster.replica_config import ReplicaConfig

LAYOUTS: dict[str, dict[str, Any]] = {  # the settings each layout changes
    "per-replica": {"drafter_placement": "separate"},
    "pool": {"drafter_placement": "pool", "pool_ratio": 2, "pool_max_members": 1},
    "pool-scaling": {
        "drafter_placement": "pool",
        "pool_ratio": 1,
        "pool_max_members": 2,
        "pool_upscale_delay_s": 0.0,
        "pool_downscale_delay_s": 5.0,
    },
}


def layout_run(name: str, config: ReplicaConfig, prompts: list[list[int]], max_new_tokens: int) -> dict[str, Any]:
    from specserve.actors.coordinator import Coordinator
    from specserve.actors.drafter_pool import SharedPool
    from specserve.core.request import GenerationConfig

    config = config.model_copy(update=LAYOUTS[name])
    pool = SharedPool(config) if config.drafter_placement == "pool" else None
    with ThreadPoolExecutor(2) as spawn:
        coordinators = list(spawn.map(lambda _: Coordinator.spawn(config), range(2)))
    generation = GenerationConfig(max_new_tokens=max_new_tokens, gamma=3, ignore_eos=True)
    members: list[tuple[float, int]] = []  # (seconds since the start, members ready)
    row: dict[str, Any] = {"layout": name}
    try:
        for coordinator in coordinators:  # warm: the first request of a replica loads kernels
            coordinator.generate(prompts[0], None, GenerationConfig(max_new_tokens=8, gamma=3, ignore_eos=True))
        start = time.perf_counter()
        with ThreadPoolExecutor(8) as run:
            futures = [
                run.submit(coordinators[i % 2].generate, prompts[i], None, generation) for i in range(len(prompts))
            ]
            while pool is not None and not all(f.done() for f in futures):
                members.append((time.perf_counter() - start, ready_members(pool)))
                time.sleep(0.1)
            results = [f.result() for f in futures]
        wall = time.perf_counter() - start
        if pool is not None:
            row.update(pick_cost(pool))
            if name == "pool-scaling":  # idle now: until it has drained back to one member
                while ready_members(pool) > 1 and time.perf_counter() - start < wall + 60:
                    time.sleep(0.1)
                members.append((time.perf_counter() - start, ready_members(pool)))
    finally:
        for coordinator in coordinators:
            coordinator.shutdown()
        if pool is not None:
            pool.shutdown()
    cycles = [o for r in results for o in r.stats.observations]
    tokens = sum(len(r.output_ids) for r in results)
    row.update(
        tokens=tokens,
        seconds=round(wall, 3),
        tokens_per_second=round(tokens / wall, 2),
        cycles=len(cycles),
        draft_ms=round(1000 * statistics.mean(o.draft_seconds for o in cycles), 3),
        verify_ms=round(1000 * statistics.mean(o.verify_seconds for o in cycles), 3),
        wire_ms=round(1000 * statistics.mean(o.wire_seconds for o in cycles), 3),
        speculated=sum(1 for r in results if r.stats.drafted_tokens > 0),
        outputs=[r.output_ids for r in results],
    )
    if members:
        row["most_members"] = max(count for _, count in members)
        row["second_ready_s"] = next((round(t, 2) for t, count in members if count > 1), None)
        row["members_at_end"] = members[-1][1]
        row["end_s"] = round(members[-1][0], 2)
    return row


def ready_members(pool: Any) -> int:
    return sum(1 for state, _ in pool.load()["members"] if state == "ready")


def pick_cost(pool: Any, picks: int = 50) -> dict[str, float]:
    """Mean milliseconds of a request's pick (a round trip to the shared pool actor) and of its done (sent, not
    awaited), timed apart from the run."""
    start = time.perf_counter()
    for i in range(picks):
        pool.pick(f"bench-{i}")
    picked = time.perf_counter()
    for i in range(picks):
        pool.done(f"bench-{i}")
    done = time.perf_counter()
    return {
        "pick_ms": round(1000 * (picked - start) / picks, 3),
        "done_ms": round(1000 * (done - picked) / picks, 3),
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--requests", type=int, default=16)
    parser.add_argument("--max-new-tokens", type=int, default=64)
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument(
        "--waves", type=int, default=3, help="times the prompts are sent (a run outlasting a member's start)"
    )
    parser.add_argument("--out", type=Path, default=Path("bench/results/drafter_pool"))
    args = parser.parse_args()

    from specserve.benchmarks.buckets import prompt_ids
    from specserve.cluster.connect import connect_ray
    from specserve.core.engine import SpeculativeEngine
    from specserve.core.model.causal_lm import CausalLM
    from specserve.core.request import GenerationConfig
    from specserve.drafters.registry import build_drafter_set

    target = CausalLM.load(str(defaults.DEFAULT_TARGET), dtype="float32", device="cpu")
    prompts = prompt_ids(target, args.requests, limit=200)
    engine = SpeculativeEngine(target, build_drafter_set(str(defaults.DEFAULT_DRAFT), target))
    generation = GenerationConfig(max_new_tokens=args.max_new_tokens, gamma=3, ignore_eos=True)
    reference = [engine.generate(p, None, generation).output_ids for p in prompts]
    config = ReplicaConfig(
        target=str(defaults.DEFAULT_TARGET),
        draft=str(defaults.DEFAULT_DRAFT),
        max_num_seqs=4,
        threads_per_shard=1,
        threads_per_drafter=1,
    )
    rows: list[dict[str, Any]] = []
    with connect_ray(replicas=3) as where:
        for round_index in range(args.rounds):
            order = list(LAYOUTS) if round_index % 2 == 0 else list(reversed(LAYOUTS))
            for name in order:
                row = layout_run(name, config, prompts * args.waves, args.max_new_tokens)
                row["round"] = round_index
                outputs = row.pop("outputs")
                row["equal_to_in_process"] = sum(o == r for o, r in zip(outputs, reference * args.waves, strict=True))
                rows.append(row)
                print(json.dumps(row), file=sys.stderr, flush=True)
    command = " ".join(["python", *sys.argv])
    lines = [
        "# Two replicas on a shared drafter pool against a drafter each",
        "",
        f"`{command}` ({where}; 1 thread per shard and drafter, 2-core CPU shared by every actor)",
        "",
        "| round | layout | tok/s | cycles | draft ms | verify ms | wire ms | pick ms | members | speculated | equal |",
        "|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    total = args.requests * args.waves
    for r in rows:
        members = (
            ""
            if "most_members" not in r
            else (
                f"{r['most_members']}"
                + (
                    f" (2nd ready at {r['second_ready_s']} s; {r['members_at_end']} at {r['end_s']} s)"
                    if r["layout"] == "pool-scaling"
                    else ""
                )
            )
        )
        lines.append(f"| {r['round']} | {r['layout']} | {r['tokens_per_second']:.1f} | {r['cycles']} | "
                     f"{r['draft_ms']:.2f} | {r['verify_ms']:.2f} | {r['wire_ms']:.2f} | "
                     f"{r.get('pick_ms', '')} | {members} | {r['speculated']}/{total} | "
                     f"{r['equal_to_in_process']}/{total} |")  # fmt: skip
    write_report(args.out, "drafter_pool", command, rows, lines)


if __name__ == "__main__":
    main()
