"""A drafter pool on a multi-node Ray cluster on this machine; run by tests/actors/test_pool_multinode.py.

    python tests/actors/multinode_pool.py MODELS_DIR OUT.json

Starts a local cluster of four nodes, every process on 127.0.0.1 (``ray.cluster_utils.Cluster``): a head with no
custom resource, a ``large`` node and two ``cheap`` nodes. Two batched replicas of the tiny llama pair in
``MODELS_DIR`` (TP 1) draft on one member of a drafter pool. Streams one long greedy request on each replica, removes
the member's cheap node after the first chunks — its raylet killed, and the member's process with it, as a machine
lost takes every process on it — and lets both requests finish; then waits for Ray to restart the member on the other
cheap node and sends one more request. Writes what the test checks: where each actor ran, every output against plain
greedy decoding, the longest gap between two chunks after the kill (the stall the kill cost), and whether the request
after the restart drafted. A separate process because the test session holds a single-node Ray of its own.
"""

from __future__ import annotations

import json
import os
import signal
import sys
import threading
import time
from pathlib import Path
from typing import Any


def main(models: Path, out: Path) -> None:
    os.environ.setdefault("RAY_USAGE_STATS_ENABLED", "0")
    import ray
    from ray.cluster_utils import Cluster

    from specserve.actors.coordinator import Coordinator
    from specserve.actors.drafter_pool import DrafterPool
    from specserve.cluster.connect import loopback_only
    from specserve.cluster.replica_config import ReplicaConfig
    from specserve.core.engine import SpeculativeEngine
    from specserve.core.model.causal_lm import CausalLM
    from specserve.core.request import GenerationConfig
    from specserve.core.sampling.params import SamplingParams
    from specserve.drafters.none import NoDrafter

    local = {"node_ip_address": "127.0.0.1"}
    with loopback_only():
        cluster = Cluster(initialize_head=True, head_node_args={"num_cpus": 1, "include_dashboard": False, **local})
        large = cluster.add_node(num_cpus=4, resources={"large": 2}, **local)
        cheap = [cluster.add_node(num_cpus=2, resources={"cheap": 1}, **local) for _ in range(2)]
        ray.init(address=cluster.address, log_to_driver=False)
    report: dict[str, Any] = {"nodes": {"large": large.node_id, "cheap": [node.node_id for node in cheap]}}
    config = ReplicaConfig(
        target=str(models / "target"),
        draft=str(models / "draft"),
        dtype="float64",
        drafter_placement="separate",
        max_num_seqs=2,
        stall_timeout_s=5.0,
    )
    pool = DrafterPool(config)
    coordinators = [Coordinator.spawn(config, pool) for _ in range(2)]
    try:
        member = pool.members[0]
        placement = [c.placement() for c in coordinators]
        report["shard_nodes"] = [p["shards"] for p in placement]
        report["member_node"] = ray.get(member.node_id.remote(), timeout=30)
        report["drafter_nodes"] = [p["drafter"] for p in placement]

        target = CausalLM.load(models / "target", dtype="float64")
        prompts = [(5, 6, 7, 8, 5, 6, 7, 8, 5, 6, 7), (40, 41, 40, 41, 40, 41, 40)]
        generation = GenerationConfig(max_new_tokens=target.info.max_positions - 12, gamma=3, ignore_eos=True)

        def greedy(prompt: tuple[int, ...]) -> list[int]:
            """Plain greedy decoding in this process (the engine's, equal to transformers' where the suite checks)."""
            plain = GenerationConfig(max_new_tokens=generation.max_new_tokens, gamma=0, ignore_eos=True)
            return SpeculativeEngine(target, NoDrafter()).generate(list(prompt), None, plain).output_ids

        killed = threading.Event()
        gaps: list[float] = []
        results: list[Any] = [None, None]

        def consume(index: int, stream: Any, first: Any) -> None:
            last, result = time.monotonic(), first.result
            for chunk in stream:
                now = time.monotonic()
                if killed.is_set():
                    gaps.append(now - last)
                last, result = now, chunk.result or result
            results[index] = result

        streams = [c.stream(p, SamplingParams(), generation) for c, p in zip(coordinators, prompts, strict=True)]
        firsts = [next(stream) for stream in streams]
        threads = [
            threading.Thread(target=consume, args=(i, s, f))
            for i, (s, f) in enumerate(zip(streams, firsts, strict=True))
        ]
        for thread in threads:
            thread.start()
        victim = next(node for node in cheap if node.node_id == report["member_node"])
        member_pid = ray.get(member.__ray_call__.remote(lambda actor: os.getpid()), timeout=30)
        cluster.remove_node(victim, allow_graceful=False)
        # the machine is gone: its workers with it (a worker left without its raylet may answer for a second or more)
        os.kill(member_pid, signal.SIGKILL)
        killed.set()
        for thread in threads:
            thread.join(timeout=240)
        report["outputs_equal"] = [
            r is not None and r.output_ids == greedy(p) for r, p in zip(results, prompts, strict=True)
        ]
        report["plain_cycles"] = [r.stats.draft_length_histogram.get(0, 0) if r else None for r in results]
        report["max_stall_s"] = round(max(gaps, default=0.0), 3)

        deadline = time.monotonic() + 120
        while True:  # Ray restarts the member where the resource is left: the other cheap node
            try:
                report["member_node_after"] = ray.get(member.node_id.remote(), timeout=5)
                break
            except ray.exceptions.RayActorError:
                if time.monotonic() > deadline:
                    report["member_node_after"] = None
                    break
                time.sleep(0.5)
        coordinators[1].check_health()  # as Serve's health checks do: the coordinator sees the member back
        again = coordinators[1].generate(prompts[0], SamplingParams(), GenerationConfig(max_new_tokens=16, gamma=3))
        report["after_equal"] = again.output_ids == greedy(prompts[0])[: len(again.output_ids)]
        report["after_drafted"] = again.stats.drafted_tokens
    finally:
        for coordinator in coordinators:
            coordinator.shutdown()
        pool.shutdown()
        out.write_text(json.dumps(report, indent=1))
        ray.shutdown()
        cluster.shutdown()


if __name__ == "__main__":
    main(Path(sys.argv[1]), Path(sys.argv[2]))
