"""A drafter pool (:mod:`specserve.actors.drafter_pool`): requests of two target replicas drafting on shared members.

On the session's local Ray cluster (one node declaring ``large`` and ``cheap``): two batched replicas (TP 1, the draft
model, float64, two requests each) of ``drafter_placement: pool`` join the model's shared pool — a named Ray actor
another process finds too — with ``pool_ratio`` 1 (a member drafts for two requests at once), one member at least,
two at most, placed on the ``cheap`` resource.

* Exactness and affinity through the pool: one request of each replica at once on the one member, greedy chains and
  trees, equal transformers' greedy decoding; seeded T = 1 requests equal the single-request engine with the same seed
  and drafted and accepted exactly as many tokens — a request's drafts are what it drafts alone, with the other
  replica's request beside it on the member.
* Scaling on the pool's own load: four requests at once want two members; the pool grows to two, later requests draft
  on both, and once idle it drains back to one; the target replicas neither change nor restart.
* Faults: a member killed while both draft: its requests move to the other member, rebuilding their draft state from
  the committed text, and finish with plain decoding's tokens (greedy, and drafter-invariant sampling), none of them
  going without speculation.
* Members the cluster cannot place wait as pending placement groups on the ``cheap`` resource (what the cluster
  autoscaler reads as demand for a cheap node) until the pool withdraws them.
* The scaling rule and the pool's bookkeeping with stand-ins (no Ray): want from demand within the limits, the delays,
  packing picks, burst room, overflow, draining the newest, never the first member, forgetting requests whose caller
  died, letting replicas that died unsaid go, releasing a shared pool's members once idle.

The fault — a shared member's node killed mid-stream — is test_pool_multinode.py's, on a multi-node cluster.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import pytest
from conftest import TinyPair
from replicas import Case, config_for, greedy_reference, replicas_at_once

from specserve.actors.coordinator import Coordinator
from specserve.actors.drafter_pool import DrafterPool, SharedPool, pool_name
from specserve.actors.pool_scaling import PoolScaling, ScaleDecider
from specserve.core.engine import SpeculativeEngine
from specserve.core.errors import UserError
from specserve.core.request import GenerationConfig, GenerationResult
from specserve.core.sampling.params import SamplingParams
from specserve.core.tree.shapes import TreeBudget, TreeSpec
from specserve.drafters import DraftModelDrafter
from specserve.drafters.none import NoDrafter

pytestmark = pytest.mark.timeout(300)
TOKENS = 24
TREE = TreeSpec("dynamic", budget=TreeBudget(depth=3, width=2, nodes=5))


@pytest.fixture(scope="module")
def pooled(ray_cluster: Any, saved_pairs: dict[str, Path]) -> Iterator[tuple[SharedPool, list[Coordinator]]]:
    """Two replicas of ``drafter_placement: pool`` (two requests each; a member drafts for two at once, 1 to 2
    members, quick to scale): the model's shared pool starts one member for both."""
    config = config_for(
        Case("llama", 1, "model", "pool", False),
        saved_pairs["llama"],
        max_num_seqs=2,
        pool_ratio=1,
        pool_max_members=2,
        pool_upscale_delay_s=0.0,
        pool_downscale_delay_s=2.0,
    )
    pool = SharedPool(config)
    try:
        with replicas_at_once(config) as coordinators:
            yield pool, coordinators
        deadline = time.monotonic() + 60
        while pool.load()["members"] and time.monotonic() < deadline:
            time.sleep(0.2)
        assert pool.load()["members"] == []  # the last replica gone for the downscale delay: the members stopped
    finally:
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
    assert len(pool.members) == 1 and pool.load()["replicas"] == 2
    assert first.replica.drafter == second.replica.drafter == pool.members[0]

    @ray.remote(num_cpus=0)
    def seen_elsewhere(config: Any) -> int:  # another process of the cluster finds the same pool by its name
        return int(SharedPool(config).load()["replicas"])

    assert ray.get(seen_elsewhere.remote(first.replica.config), timeout=60) == 2
    member_pid = first.processes()["drafter"]
    assert second.processes()["drafter"] == member_pid and first.processes()["shards"] != second.processes()["shards"]
    node = ray.get(pool.members[0].node_id.remote(), timeout=30)
    assert node in {n["NodeID"] for n in ray.nodes() if n["Resources"].get("cheap")}

    drafted = 0
    for config in (
        GenerationConfig(max_new_tokens=TOKENS, gamma=3),
        GenerationConfig(max_new_tokens=TOKENS, tree=TREE),
    ):
        for prompts in (pair.prompts[0:2], pair.prompts[2:4]):  # one request of each replica at once: one member
            jobs = [
                (lambda c=coordinator, p=prompt, g=config: c.generate(p, SamplingParams(), g))
                for coordinator, prompt in zip([first, second], prompts, strict=True)
            ]
            for prompt, result in zip(prompts, in_parallel(jobs), strict=True):
                assert result.output_ids == greedy_reference(pair, prompt, TOKENS), f"prompt {prompt}, {config}"
                drafted += result.stats.drafted_tokens
    assert drafted > 0 and len(pool.members) == 1

    sampled = GenerationConfig(max_new_tokens=TOKENS, gamma=3, ignore_eos=True)
    seeds = [SamplingParams(temperature=1.0, top_k=20, seed=seed) for seed in (3, 4)]
    jobs = [
        (lambda c=coordinator, s=params: c.generate(pair.prompts[1], s, sampled))
        for coordinator, params in zip([first, second], seeds, strict=True)
    ]
    for params, result in zip(seeds, in_parallel(jobs), strict=True):
        alone = SpeculativeEngine(pair.target, DraftModelDrafter(pair.draft, pair.target))
        reference = alone.generate(list(pair.prompts[1]), params, sampled)
        assert result.output_ids == reference.output_ids
        # the same drafts as alone: as many drafted and accepted, the other replica's request beside it
        assert (result.stats.drafted_tokens, result.stats.accepted_tokens) == (
            reference.stats.drafted_tokens,
            reference.stats.accepted_tokens,
        )


def test_the_pool_grows_under_load_moves_requests_off_a_dead_member_and_drains_back(
    pooled: tuple[SharedPool, list[Coordinator]], tiny_pairs: dict[str, TinyPair], caplog: pytest.LogCaptureFixture
) -> None:
    """Four requests at once (two per replica) want two members of two requests each: the pool grows to its
    maximum. Then, while four long requests (greedy, and drafter-invariant sampling) draft on both members, the second
    member is killed: its requests move to the first (its burst room), rebuilding their draft state from the committed
    text, and finish exactly, drafting all the way. Idle, the pool drains back to one member. The replicas stay as
    they were."""
    import ray

    pool, coordinators = pooled
    pair = tiny_pairs["llama"]
    shards = [c.processes()["shards"] for c in coordinators]
    config = GenerationConfig(max_new_tokens=TOKENS, gamma=3)
    prompts = pair.prompts[:4]
    grown: dict[str, Any] | None = None
    deadline = time.monotonic() + 120
    while grown is None and time.monotonic() < deadline:  # waves of four until one drafts on two ready members
        seen: list[dict[str, Any]] = []
        with ThreadPoolExecutor(len(prompts)) as run:
            futures = [
                run.submit(coordinators[i % 2].generate, prompt, SamplingParams(), config)
                for i, prompt in enumerate(prompts)
            ]
            while not all(future.done() for future in futures):  # the pool's load while the wave runs
                seen.append(pool.load())
                time.sleep(0.05)
        for prompt, future in zip(prompts, futures, strict=True):
            assert future.result().output_ids == greedy_reference(pair, prompt, TOKENS), f"prompt {prompt}"
        grown = next((load for load in seen if busy_ready_members(load) == 2), None)
    assert grown is not None, f"the pool did not grow to 2 members drafting at once: {pool.load()}"
    assert len(pool.members) == 2

    long = GenerationConfig(max_new_tokens=80, gamma=3, ignore_eos=True)
    plain = GenerationConfig(max_new_tokens=80, gamma=0, ignore_eos=True)
    engine = SpeculativeEngine(pair.target, NoDrafter())
    victim = pool.members[1]
    # greedy, and drafter-invariant sampling (the same tokens whatever was drafted, moved or not)
    samplings = [SamplingParams(), SamplingParams(temperature=0.8, seed=7, drafter_invariant=True)] * 2
    with caplog.at_level(logging.INFO, logger="specserve.actors.coordinator"), ThreadPoolExecutor(4) as run:
        futures = [
            run.submit(coordinators[i % 2].generate, prompt, sampling, long)
            for i, (prompt, sampling) in enumerate(zip(prompts, samplings, strict=True))
        ]
        killed = False
        while not all(future.done() for future in futures):
            if not killed and busy_ready_members(pool.load()) == 2:  # both members drafting: kill the second
                ray.kill(victim, no_restart=False)
                killed = True
            time.sleep(0.02)
        results = [future.result() for future in futures]
    assert killed
    for prompt, sampling, result in zip(prompts, samplings, results, strict=True):
        assert result.output_ids == engine.generate(list(prompt), sampling, plain).output_ids, (prompt, sampling)
    messages = [record.getMessage() for record in caplog.records]
    assert any("moves to another pool member" in message for message in messages), messages
    assert not any("without speculation" in message for message in messages), messages

    deadline = time.monotonic() + 60
    while len(pool.members) > 1 and time.monotonic() < deadline:  # idle: drains after the 2 s delay
        time.sleep(0.2)
    assert pool.load()["members"] == [("ready", 0)]
    assert [c.processes()["shards"] for c in coordinators] == shards  # the targets: the same processes
    for coordinator in coordinators:
        coordinator.check_health()
    result = coordinators[0].generate(prompts[0], SamplingParams(), config)
    assert result.output_ids == greedy_reference(pair, prompts[0], TOKENS) and result.stats.drafted_tokens > 0


def test_members_the_cluster_cannot_place_are_pending_demand_on_the_cheap_resource(
    pooled: tuple[SharedPool, list[Coordinator]], saved_pairs: dict[str, Path]
) -> None:
    """A pool that wants more members than the cluster has ``cheap`` room for asks Ray for their placement groups at
    once: they wait PENDING — the resource demand Ray's cluster autoscaler adds a cheap node for — and the pool's
    shutdown withdraws them. (A local pool beside the shared one; its requests are bookkeeping only.)"""
    import ray

    def pending_cheap_groups() -> set[str]:
        return {
            group_id
            for group_id, group in ray.util.placement_group_table().items()
            if group["state"] == "PENDING" and any("cheap" in bundle for bundle in group["bundles"].values())
        }

    config = config_for(Case("llama", 1, "model", "pool", False), saved_pairs["llama"], max_num_seqs=1)
    scaling = PoolScaling(target_requests=1, max_members=4, upscale_delay_s=0.0)
    pool = DrafterPool(config, scaling, interval_s=None)
    before = pending_cheap_groups()
    try:
        replica = pooled[1][0].replica
        first = pool.join(replica.target_info, replica.rank0)
        assert [pool.pick(request) for request in "abcd"] == [first, first, None, None]  # they want four members
        pool.scale()
        states = [state for state, _ in pool.load()["members"]]
        assert len(states) == 4 and states.count("pending") >= 2  # the session's cluster has 2 cheap units
        asked = pending_cheap_groups() - before
        assert len(asked) == states.count("pending")
    finally:
        pool.shutdown()
    deadline = time.monotonic() + 30
    while pending_cheap_groups() & asked and time.monotonic() < deadline:
        time.sleep(0.1)
    assert not pending_cheap_groups() & asked  # withdrawn


def busy_ready_members(load: dict[str, Any]) -> int:
    return sum(1 for state, requests in load["members"] if state == "ready" and requests > 0)


# ---------------------------------------------------------------------------------------------
# The rule and the bookkeeping, with stand-ins (no Ray)


def test_the_scaling_rule_wants_members_for_the_demand_after_its_delays() -> None:
    scaling = PoolScaling(target_requests=4, min_members=1, max_members=3, upscale_delay_s=1.0, downscale_delay_s=5.0)
    assert [scaling.wanted(demand) for demand in (0, 1, 4, 5, 8, 9, 100)] == [1, 1, 1, 2, 2, 3, 3]
    decide = ScaleDecider(scaling).decide
    assert decide(0.0, 9, 1) == 1  # wants 3: not yet
    assert decide(0.5, 9, 1) == 1
    assert decide(1.0, 9, 1) == 3  # held for the upscale delay
    assert decide(1.5, 0, 3) == 3  # wants 1: not yet
    assert decide(4.0, 5, 3) == 3  # a busier moment within the delay
    assert decide(6.5, 0, 3) == 2  # held for 5 s: down to the highest want seen meanwhile
    assert decide(7.0, 8, 2) == 2 and decide(7.5, 2, 2) == 2  # at the want: nothing
    assert decide(8.0, 9, 2) == 2 and decide(8.5, 2, 2) == 2 and decide(9.0, 9, 2) == 2  # a run broken: restarts
    assert decide(10.0, 9, 2) == 3
    with pytest.raises(UserError, match="pool_min_members <= pool_max_members"):
        PoolScaling(target_requests=4, min_members=3, max_members=2)


class StandIns:
    """Members as plain objects: placed when the test says, built when the test says, running what picks gave."""

    def __init__(self) -> None:
        self.groups: list[object] = []
        self.placed_groups: set[int] = set()
        self.built: set[int] = set()
        self.actors: list[object] = []
        self.stopped: list[object] = []
        self.runs: dict[int, list[str]] = {}
        self.dead: list[object] = []  # replicas' rank 0 actors that died

    def place(self) -> object:
        self.groups.append(object())
        return self.groups[-1]

    def placed(self, group: object, timeout_s: float) -> bool:
        return timeout_s > 0 or id(group) in self.placed_groups  # a join's start is placed at once

    def launch(self, group: object, info: object) -> tuple[object, object]:
        self.actors.append(object())
        return self.actors[-1], self.actors[-1]

    def answered(self, ref: object) -> bool:
        return id(ref) in self.built

    def running(self, actor: object, timeout_s: float) -> list[str] | None:
        return self.runs.get(id(actor))

    def stop(self, actor: object, group: object) -> None:
        self.stopped.append(actor)

    def gone(self, actor: object, timeout_s: float) -> bool:
        return actor in self.dead


def test_the_pool_packs_requests_grows_and_drains_the_newest(saved_pairs: dict[str, Path]) -> None:
    config = config_for(Case("llama", 1, "model", "pool", False), saved_pairs["llama"], max_num_seqs=2)
    scaling = PoolScaling(target_requests=2, min_members=1, max_members=2, upscale_delay_s=0, downscale_delay_s=0)
    members = StandIns()
    pool = DrafterPool(config, scaling, members=members, interval_s=None)  # the test steps scale itself
    info: Any = object()
    replicas = [object(), object()]  # their rank 0 actors
    first = pool.join(info, replicas[0])
    assert pool.join(info, replicas[1]) is first and members.actors == [first]  # the second: the same first member
    assert pool.slots == 4  # twice its target: burst room
    assert [pool.pick(r) for r in "ab"] == [first, first]  # packed onto the fullest below its target
    assert pool.pick("c") is first  # past every target: burst room

    pool.scale(0.0)  # 3 requests want 2 members: one asked for
    assert pool.load()["members"] == [("ready", 3), ("pending", 0)]
    assert pool.pick("d") is first and pool.pick("e") is None and pool.load()["waiting"] == 1  # full: counted still
    members.placed_groups.add(id(members.groups[-1]))
    pool.scale(0.1)  # placed: its drafter starts
    assert pool.load()["members"] == [("ready", 4), ("loading", 0)] and pool.pick("f") is None
    second = members.actors[-1]
    members.built.add(id(second))
    pool.scale(0.2)
    assert pool.load()["members"] == [("ready", 4), ("ready", 0)] and pool.load()["waiting"] == 2
    assert pool.pick("e") is second and pool.pick("f", avoid=[second]) is None  # avoided: the other is full
    assert pool.pick("f") is second and pool.load()["waiting"] == 0
    assert pool.pick("g") is second  # both at their target: the emptiest with burst room
    pool.done("a")
    assert pool.pick("h") is first  # both at 3: the oldest
    assert pool.members == [first, second]

    for request in "bcdefgh":
        pool.done(request)
    pool.scale(1.0)  # idle: wants 1; the second drains and, empty, stops; the first is never drained
    assert pool.load()["members"] == [("ready", 0)] and members.stopped == [second]

    # requests whose caller died without a done: forgotten once their member no longer runs them
    assert pool.pick("lost") is first and pool.pick("alive") is first
    members.runs[id(first)] = ["alive"]
    pool.scale(1.0 + DrafterPool.FORGET_AFTER_S / 2)
    assert pool.load()["members"] == [("ready", 2)]
    pool.scale(time.monotonic() + DrafterPool.FORGET_AFTER_S + 1)
    assert pool.load()["members"] == [("ready", 1)]

    pool.leave(replicas[0])
    pool.leave(replicas[0])  # twice: once
    assert pool.load()["replicas"] == 1
    members.dead.append(replicas[1])  # its process died without leaving: the next check lets it go
    pool.scale(time.monotonic() + DrafterPool.HOUSEKEEPING_S + 100)
    assert pool.load()["replicas"] == 0 and members.stopped == [second]  # a local pool keeps its members
    pool.shutdown()
    assert members.stopped == [second, first] and pool.members == []


def test_a_shared_pool_releases_its_members_once_its_last_replica_has_been_gone_a_while(
    saved_pairs: dict[str, Path],
) -> None:
    config = config_for(Case("llama", 1, "model", "pool", False), saved_pairs["llama"], max_num_seqs=2)
    delay = config.pool_downscale_delay_s
    members = StandIns()
    pool = DrafterPool(config, members=members, release_idle=True, interval_s=None)
    info: Any = object()
    lost, replacement = object(), object()
    first = pool.join(info, lost)
    pool.leave(lost)
    pool.scale(time.monotonic() + delay / 2)
    assert members.stopped == [] and pool.join(info, replacement) is first  # a replacement within the delay
    pool.leave(replacement)
    pool.scale(time.monotonic() + delay + 1)
    assert members.stopped == [first] and pool.members == []  # gone for the delay: released
    again = pool.join(info, replacement)
    assert again is not first and pool.members == [again]  # the next replica starts them again
    pool.shutdown()


def test_the_shared_pool_is_named_by_the_model_its_drafter_and_its_settings(saved_pairs: dict[str, Path]) -> None:
    base = config_for(Case("llama", 1, "model", "pool", False), saved_pairs["llama"], max_num_seqs=2)
    assert pool_name(base) == pool_name(base.model_copy(update={"tp_degree": 2, "stall_timeout_s": 3.0}))
    changes = (
        {"pool_ratio": 4},
        {"draft": "ngram"},
        {"max_num_seqs": 4},
        {"dtype": "float32"},
        {"pool_max_members": 3},
    )
    for change in changes:
        assert pool_name(base.model_copy(update=change)) != pool_name(base), change
