"""What a drafter pool member's loss costs the requests drafting on it, when they move to another member.

    python bench/pool_member_loss.py [--requests 8] [--max-new-tokens 256] [--rounds 3] [--out DIR]

The shipped pair, float32, the distributed runtime at TP 1: two replicas (4 requests each) of ``drafter_placement:
pool`` whose shared pool keeps two members (``pool_ratio`` 1: a member's target is 4 requests), greedy, γ 3.
``--requests`` held-out prompts stream at once, half on each replica; once both members draft, the second member is
killed (``ray.kill``: Ray restarts it). Its requests move to the first member (its burst room), rebuilding their draft
state from the committed text. Per round: the longest gap between two chunks of any stream after the kill (the stall
the loss cost), the same before it (what a gap is anyway), how many requests moved, how many went on without
speculation, and whether every output equals plain greedy decoding. On this 2-core machine every actor shares the
same cores. Writes ``pool_member_loss.json`` and ``pool_member_loss.md``.
"""

from __future__ import annotations

import argparse
import json
import logging
import sys
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

from specserve import defaults
from specserve.benchmarks.tables import write_report
from specserve.cluster.replica_config import ReplicaConfig


class Moves(logging.Handler):
    """Counts the coordinator's log lines of requests that moved, and of those that went on without speculation."""

    def __init__(self) -> None:
        super().__init__(logging.INFO)
        self.moved = self.plain = 0

    def emit(self, record: logging.LogRecord) -> None:
        message = record.getMessage()
        self.moved += "moves to another pool member" in message
        self.plain += "without speculation" in message


def one_round(config: ReplicaConfig, prompts: list[list[int]], max_new_tokens: int) -> dict[str, Any]:
    import ray

    from specserve.actors.coordinator import Coordinator
    from specserve.actors.drafter_pool import SharedPool
    from specserve.core.request import GenerationConfig

    pool = SharedPool(config)
    with ThreadPoolExecutor(2) as spawn:
        coordinators = list(spawn.map(lambda _: Coordinator.spawn(config), range(2)))
    generation = GenerationConfig(max_new_tokens=max_new_tokens, gamma=3, ignore_eos=True)
    moves = Moves()
    logging.getLogger("specserve.actors.coordinator").addHandler(moves)
    logging.getLogger("specserve.actors.coordinator").setLevel(logging.INFO)
    killed_at: list[float] = []
    gaps: list[tuple[float, float]] = []  # (when a chunk came, the gap before it)
    lock = threading.Lock()

    def consume(index: int) -> list[int]:
        last, tokens = time.monotonic(), []
        for chunk in coordinators[index % 2].stream(prompts[index], None, generation):
            now = time.monotonic()
            with lock:
                gaps.append((now, now - last))
            last = now
            tokens.extend(chunk.token_ids)
        return tokens

    try:
        for coordinator in coordinators:  # warm: the first request of a replica loads kernels
            coordinator.generate(prompts[0], None, GenerationConfig(max_new_tokens=8, gamma=3, ignore_eos=True))
        deadline = time.monotonic() + 60
        while sum(state == "ready" for state, _ in pool.load()["members"]) < 2 and time.monotonic() < deadline:
            time.sleep(0.1)  # the second member (pool_min_members 2) is built
        victim = pool.members[1]
        with ThreadPoolExecutor(len(prompts)) as run:
            futures = [run.submit(consume, i) for i in range(len(prompts))]
            while not all(f.done() for f in futures):
                busy = [requests for state, requests in pool.load()["members"] if state == "ready"]
                if not killed_at and len(busy) == 2 and min(busy) > 0 and gaps:
                    time.sleep(0.5)  # well into the streams
                    ray.kill(victim, no_restart=False)
                    killed_at.append(time.monotonic())
                time.sleep(0.05)
            outputs = [f.result() for f in futures]
    finally:
        logging.getLogger("specserve.actors.coordinator").removeHandler(moves)
        for coordinator in coordinators:
            coordinator.shutdown()
        pool.shutdown()
    kill = killed_at[0] if killed_at else float("inf")
    return {
        "killed": bool(killed_at),
        "stall_after_s": round(max((gap for when, gap in gaps if when > kill), default=0.0), 3),
        "longest_gap_before_s": round(max((gap for when, gap in gaps if when <= kill), default=0.0), 3),
        "moved": moves.moved,
        "without_speculation": moves.plain,
        "outputs": outputs,
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--requests", type=int, default=8)
    parser.add_argument("--max-new-tokens", type=int, default=256)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--out", type=Path, default=Path("bench/results/drafter_pool"))
    args = parser.parse_args()

    from specserve.benchmarks.buckets import prompt_ids
    from specserve.cluster.connect import connect_ray
    from specserve.core.engine import SpeculativeEngine
    from specserve.core.model.causal_lm import CausalLM
    from specserve.core.request import GenerationConfig
    from specserve.drafters.none import NoDrafter

    target = CausalLM.load(str(defaults.DEFAULT_TARGET), dtype="float32", device="cpu")
    prompts = prompt_ids(target, args.requests, limit=200)
    plain = GenerationConfig(max_new_tokens=args.max_new_tokens, gamma=0, ignore_eos=True)
    reference = [SpeculativeEngine(target, NoDrafter()).generate(p, None, plain).output_ids for p in prompts]
    config = ReplicaConfig(
        target=str(defaults.DEFAULT_TARGET),
        draft=str(defaults.DEFAULT_DRAFT),
        drafter_placement="pool",
        max_num_seqs=4,
        pool_ratio=1,
        pool_min_members=2,
        pool_max_members=2,
        threads_per_shard=1,
        threads_per_drafter=1,
    )
    rows = []
    with connect_ray(replicas=3) as where:
        for index in range(args.rounds):
            row = one_round(config, prompts, args.max_new_tokens)
            row["round"] = index
            row["equal_to_plain"] = sum(o == r for o, r in zip(row.pop("outputs"), reference, strict=True))
            rows.append(row)
            print(json.dumps(row), file=sys.stderr, flush=True)
    command = " ".join(["python", *sys.argv])
    lines = [
        "# A drafter pool member lost: its requests move",
        "",
        f"`{command}` ({where}; 1 thread per shard and drafter, 2-core CPU shared by every actor)",
        "",
        "| round | stall after the kill (s) | longest gap before (s) | moved | without speculation | equal to plain |",
        "|---|---|---|---|---|---|",
    ]
    for r in rows:
        lines.append(f"| {r['round']} | {r['stall_after_s']:.3f} | {r['longest_gap_before_s']:.3f} | {r['moved']} | "
                     f"{r['without_speculation']} | {r['equal_to_plain']}/{args.requests} |")  # fmt: skip
    write_report(args.out, "pool_member_loss", command, rows, lines)


if __name__ == "__main__":
    main()
