"""A drafter pool (:mod:`specserve.actors.drafter_pool`): two target replicas drafting on one pool member.

On the session's local Ray cluster (one node declaring ``large`` and ``cheap``): a pool of ratio 2 and two batched
replicas (TP 1, the draft model, float64) spawned with it share one member, placed on the ``cheap`` resource, which
runs both replicas' request loops.

* Exactness through the pool: requests of both replicas at once, greedy, equal transformers' greedy decoding; seeded
  T = 1 requests on both at once equal the single-request engine with the same seed; a third replica gets a member of
  its own (the ratio), and the member goes back when a replica shuts down.
* Fault: the shared member killed mid-stream: the requests of both replicas complete with the undisturbed tokens,
  without speculation after the kill; Ray restarts the member, and the next requests draft again.
"""

from __future__ import annotations

import time
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import pytest
from conftest import TinyPair
from replicas import Case, config_for, greedy_reference

from specserve.actors.coordinator import Coordinator
from specserve.actors.drafter_pool import DrafterPool
from specserve.core.engine import GenerationConfig, GenerationResult, SpeculativeEngine
from specserve.core.sampling import SamplingParams
from specserve.drafters import DraftModelDrafter

pytestmark = pytest.mark.timeout(300)
TOKENS = 24


@pytest.fixture(scope="module")
def pooled(ray_cluster: Any, saved_pairs: dict[str, Path]) -> Iterator[tuple[DrafterPool, list[Coordinator]]]:
    config = config_for(Case("llama", 1, "model", "separate", False), saved_pairs["llama"], max_num_seqs=2)
    pool = DrafterPool(config, ratio=2)
    with ThreadPoolExecutor(2) as spawn:
        coordinators = list(spawn.map(lambda _: Coordinator.spawn(config, pool), range(2)))
    try:
        yield pool, coordinators
    finally:
        for coordinator in coordinators:
            coordinator.shutdown()
        pool.shutdown()


def in_parallel(jobs: list[Any]) -> list[GenerationResult]:
    with ThreadPoolExecutor(len(jobs)) as run:
        return list(run.map(lambda job: job(), jobs))


def test_two_replicas_draft_on_one_member_and_stay_exact(
    pooled: tuple[DrafterPool, list[Coordinator]], tiny_pairs: dict[str, TinyPair]
) -> None:
    import ray

    pool, (first, second) = pooled
    pair = tiny_pairs["llama"]
    assert len(pool.members) == 1 and pool.assignments() == [2]
    assert first.replica.drafter is second.replica.drafter is pool.members[0]
    member_pid = first.processes()["drafter"]
    assert second.processes()["drafter"] == member_pid and first.processes()["shards"] != second.processes()["shards"]
    node = ray.get(pool.members[0].node_id.remote(), timeout=30)
    assert node in {n["NodeID"] for n in ray.nodes() if n["Resources"].get("cheap")}

    config = GenerationConfig(max_new_tokens=TOKENS, gamma=3)
    prompts = [pair.prompts[i] for i in range(4)]
    jobs = [
        (lambda c=coordinator, p=prompt: c.generate(p, SamplingParams(), config))
        for coordinator, prompt in zip([first, second, first, second], prompts, strict=True)
    ]
    results = in_parallel(jobs)
    for prompt, result in zip(prompts, results, strict=True):
        assert result.output_ids == greedy_reference(pair, prompt, TOKENS), f"prompt {prompt}"
        assert result.stats.drafted_tokens > 0  # it speculated, on the shared member
    assert sum(result.stats.accepted_tokens for result in results) > 0

    sampled = GenerationConfig(max_new_tokens=TOKENS, gamma=3, ignore_eos=True)
    seeds = [SamplingParams(temperature=1.0, top_k=20, seed=seed) for seed in (3, 4)]
    jobs = [
        (lambda c=coordinator, s=params: c.generate(pair.prompts[1], s, sampled))
        for coordinator, params in zip([first, second], seeds, strict=True)
    ]
    for params, result in zip(seeds, in_parallel(jobs), strict=True):
        alone = SpeculativeEngine(pair.target, DraftModelDrafter(pair.draft, pair.target))
        assert result.output_ids == alone.generate(list(pair.prompts[1]), params, sampled).output_ids


def test_the_ratio_gives_a_third_replica_a_member_of_its_own(pooled: tuple[DrafterPool, list[Coordinator]]) -> None:
    pool, (first, _) = pooled
    third = Coordinator.spawn(first.replica.config, pool)
    try:
        assert len(pool.members) == 2 and pool.assignments() == [2, 1]
        assert third.replica.drafter is pool.members[1]
    finally:
        third.shutdown()
    assert pool.assignments() == [2, 0]  # its member stays in the pool for later replicas
    again = Coordinator.spawn(first.replica.config, pool)
    try:
        assert again.replica.drafter is pool.members[1] and pool.assignments() == [2, 1]
    finally:
        again.shutdown()


def test_a_killed_member_costs_both_replicas_speed_never_tokens(
    pooled: tuple[DrafterPool, list[Coordinator]], tiny_pairs: dict[str, TinyPair]
) -> None:
    import ray

    pool, (first, second) = pooled
    pair = tiny_pairs["llama"]
    prompt = pair.prompts[0]
    config = GenerationConfig(max_new_tokens=pair.target.info.max_positions - len(prompt), gamma=3, ignore_eos=True)
    undisturbed = first.generate(prompt, SamplingParams(), config)
    streams = [coordinator.stream(prompt, SamplingParams(), config) for coordinator in (first, second)]
    firsts = [next(stream) for stream in streams]  # both requests are running on the member
    assert all(chunk.result is None for chunk in firsts)
    ray.kill(pool.members[0], no_restart=False)
    results = in_parallel([lambda s=stream: _finish(s) for stream in streams])
    for result in results:
        assert result.output_ids == undisturbed.output_ids and result.finish_reason == "length"
        assert result.stats.draft_length_histogram.get(0, 0) > undisturbed.stats.draft_length_histogram.get(0, 0)
    deadline = time.monotonic() + 60
    while True:  # Ray restarts the member; requests after it speculate again
        try:
            ray.get(pool.members[0].node_id.remote(), timeout=5)
            break
        except ray.exceptions.RayActorError:
            assert time.monotonic() < deadline, "the pool member did not come back"
            time.sleep(0.5)
    again = second.generate(prompt, SamplingParams(), config)
    assert again.output_ids == undisturbed.output_ids and again.stats.accepted_tokens > 0


def _finish(stream: Iterator[Any]) -> GenerationResult:
    result = None
    for chunk in stream:
        result = chunk.result or result
    assert result is not None
    return result
