"""A drafter pool (:mod:`specserve.actors.drafter_pool`): two target replicas drafting on one pool member.

On the session's local Ray cluster (one node declaring ``large`` and ``cheap``): two batched replicas (TP 1, the draft
model, float64) of ``drafter_placement: pool`` with ``pool_ratio`` 2 share one member of the model's shared pool (a
named Ray actor another process finds too), placed on the ``cheap`` resource, which runs both replicas' loops; the
last replica's shutdown stops the member.

* Exactness through the pool: requests of both replicas at once, greedy, equal transformers' greedy decoding; seeded
  T = 1 requests on both at once equal the single-request engine with the same seed.
* The assignment rule (stand-ins, no Ray): the least-assigned member with room, a new member past the ratio, the
  least-assigned one at the member limit; a replica's shutdown hands its member back.

The fault — the shared member's node killed mid-stream — is test_pool_multinode.py's, on a multi-node cluster.
"""

from __future__ import annotations

from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import pytest
from conftest import TinyPair
from replicas import Case, config_for, greedy_reference

from specserve.actors.coordinator import Coordinator
from specserve.actors.drafter_pool import DrafterPool, SharedPool, _Member, pool_name
from specserve.core.engine import GenerationConfig, GenerationResult, SpeculativeEngine
from specserve.core.errors import UserError
from specserve.core.sampling import SamplingParams
from specserve.drafters import DraftModelDrafter

pytestmark = pytest.mark.timeout(300)
TOKENS = 24


@pytest.fixture(scope="module")
def pooled(ray_cluster: Any, saved_pairs: dict[str, Path]) -> Iterator[tuple[SharedPool, list[Coordinator]]]:
    """Two replicas of ``drafter_placement: pool`` (ratio 2): the model's shared pool gives both one member."""
    config = config_for(Case("llama", 1, "model", "pool", False), saved_pairs["llama"], max_num_seqs=2, pool_ratio=2)
    pool = SharedPool(config)
    with ThreadPoolExecutor(2) as spawn:
        coordinators = list(spawn.map(lambda _: Coordinator.spawn(config), range(2)))
    try:
        yield pool, coordinators
    finally:
        for coordinator in coordinators:
            coordinator.shutdown()
        assert pool.assignments() == []  # the last replica's leaving stopped the members
        pool.shutdown()


def in_parallel(jobs: list[Any]) -> list[GenerationResult]:
    with ThreadPoolExecutor(len(jobs)) as run:
        return list(run.map(lambda job: job(), jobs))


def test_two_replicas_draft_on_one_member_and_stay_exact(
    pooled: tuple[SharedPool, list[Coordinator]], tiny_pairs: dict[str, TinyPair]
) -> None:
    import ray

    pool, (first, second) = pooled
    pair = tiny_pairs["llama"]
    assert len(pool.members) == 1 and pool.assignments() == [2]
    assert first.replica.drafter == second.replica.drafter == pool.members[0]

    @ray.remote(num_cpus=0)
    def seen_elsewhere(config: Any) -> list[int]:  # another process of the cluster finds the same pool by its name
        return SharedPool(config).assignments()

    assert ray.get(seen_elsewhere.remote(first.replica.config), timeout=60) == [2]
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


def test_replicas_take_the_least_assigned_member_with_room_then_a_new_one(
    monkeypatch: pytest.MonkeyPatch, saved_pairs: dict[str, Path]
) -> None:
    """The assignment rule alone (stand-ins for the members: no Ray)."""
    config = config_for(Case("llama", 1, "model", "separate", False), saved_pairs["llama"], max_num_seqs=2)
    pool = DrafterPool(config, ratio=2, max_members=2)
    started: list[object] = []

    def start(info: object) -> _Member:
        started.append(object())
        return _Member(started[-1], group=None)

    monkeypatch.setattr(pool, "_start", start)
    info: Any = object()
    assert [pool.assign(info) for _ in range(3)] == [started[0], started[0], started[1]]
    assert pool.assignments() == [2, 1]
    pool.unassign(started[0])  # a replica of the first member shut down
    assert pool.assign(info) is started[0]  # room again: no new member
    assert pool.assign(info) is started[1] and pool.assignments() == [2, 2]
    assert pool.assign(info) is started[0] and len(started) == 2  # at the member limit: the least assigned
    pool.unassign(object())  # a drafter not in the pool changes nothing
    assert pool.assignments() == [3, 2] and pool.members == started
    with pytest.raises(UserError, match="ratio and a member limit"):
        DrafterPool(config, ratio=0)


def test_the_shared_pool_is_named_by_the_model_and_its_drafter(saved_pairs: dict[str, Path]) -> None:
    base = config_for(Case("llama", 1, "model", "pool", False), saved_pairs["llama"], max_num_seqs=2)
    assert pool_name(base) == pool_name(base.model_copy(update={"tp_degree": 2, "stall_timeout_s": 3.0}))
    for change in ({"pool_ratio": 4}, {"draft": "ngram"}, {"max_num_seqs": 4}, {"dtype": "float32"}):
        assert pool_name(base.model_copy(update=change)) != pool_name(base), change
