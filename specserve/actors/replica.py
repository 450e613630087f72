"""Spawning one target replica: its placement groups, its tensor-parallel shard actors and its drafter.

What a replica is — every setting — is :class:`~specserve.cluster.replica_config.ReplicaConfig` (re-exported here); the
placement math is :mod:`specserve.cluster.placement` (pure); this module turns a plan into Ray objects: a
``STRICT_PACK`` group with one bundle per TP rank on the "large" resource (plus the drafter's bundle when co-located),
or a separate group on the "cheap" resource for the drafter. The shard actors join one ``torch.distributed`` group —
every rank's ``init_tensor_parallel`` is submitted before any is awaited, since each blocks until all have joined — and
rank 0 starts the gRPC verifier the drafter streams to. A batched replica (``max_num_seqs`` > 1) gives every rank a KV
pool of ``kv_pool_tokens`` positions (by default room for that many requests of ``max_seq_len``) and the drafter as many
concurrent request loops; rank 0 then verifies its running requests' drafts together. Ray restarts a drafter that dies
(:data:`DRAFTER_MAX_RESTARTS` times), and one the coordinator kills because it froze; the shards are not restarted: a
dead or frozen shard loses the replica (its coordinator raises :class:`~specserve.core.errors.ReplicaLost` from then on,
and its health check fails).

Needs a connected Ray (``ray.init``) whose nodes declare the custom resources the spec names;
a cluster that lacks them gets a clear error after ``ready_timeout_s`` instead of a hang.
"""

from __future__ import annotations

import contextlib
import dataclasses
import os
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any, Protocol

from specserve.actors.drafter import DrafterActor
from specserve.actors.target_shard import TargetShardActor
from specserve.cluster.placement import replica_placement
from specserve.cluster.replica_config import ReplicaConfig
from specserve.core.errors import UserError
from specserve.core.model.causal_lm import ModelInfo

# Times Ray restarts a replica's drafter actor after it dies (or its coordinator kills it, frozen); its requests
# meanwhile finish without speculation (specserve.actors.coordinator), later ones draft again.
DRAFTER_MAX_RESTARTS = 3


class ReplicaStartError(UserError):
    """A replica could not be placed or started; the message says what the cluster lacks."""


@dataclass
class Replica:
    config: ReplicaConfig
    shards: list[Any]  # actor handles, rank order
    drafter: Any
    groups: list[Any]  # placement groups
    verifier_address: str
    target_info: ModelInfo
    verifier_token: str = ""  # what the replica's drafters present to rank 0's verifier
    feature_layers: tuple[int, ...] = ()  # the configured drafter reads these target features (EAGLE, Medusa)
    # the pool the replica joined, if any: each request drafts on a member it picks; ``drafter`` is the pool's first
    pool: DrafterSource | None = None

    @property
    def rank0(self) -> Any:
        return self.shards[0]

    def placement(self, timeout_s: float = 30.0) -> dict[str, Any]:
        """Which node each actor of this replica runs on (a ``GetTimeoutError`` when one does not answer in time)."""
        import ray

        refs = [shard.node_id.remote() for shard in self.shards] + [self.drafter.node_id.remote()]
        nodes = ray.get(refs, timeout=timeout_s)
        return {"shards": nodes[:-1], "drafter": nodes[-1], "verifier": self.verifier_address}

    def processes(self, timeout_s: float = 30.0) -> dict[str, Any]:
        """The process id of each actor of this replica (operators and chaos tests signal them)."""
        import os

        import ray

        refs = [actor.__ray_call__.remote(lambda actor: os.getpid()) for actor in [*self.shards, self.drafter]]
        pids = ray.get(refs, timeout=timeout_s)
        return {"shards": pids[:-1], "drafter": pids[-1]}

    def shutdown(self) -> None:
        import ray
        from ray.util.placement_group import remove_placement_group

        with contextlib.suppress(Exception):  # best effort: the actors are killed below either way
            ray.get([shard.shutdown.remote() for shard in self.shards], timeout=30)
        for actor in self.shards:
            ray.kill(actor)
        if self.pool is None:
            ray.kill(self.drafter)
        else:  # the members draft for other replicas too: the pool keeps them
            self.pool.leave(self.rank0)
        for group in self.groups:
            remove_placement_group(group)


class DrafterSource(Protocol):
    """Where a replica's requests find drafters when it does not start its own (a drafter pool,
    :mod:`specserve.actors.drafter_pool`)."""

    def join(self, info: ModelInfo, replica: Any) -> Any:
        """One more replica of the pool's model (``info``: the target's; ``replica``: its rank 0 actor); a member's
        drafter actor."""
        ...

    def leave(self, replica: Any) -> None:
        """The replica that joined with rank 0 ``replica`` is gone."""
        ...

    def pick(self, request_id: str, avoid: Sequence[Any] = ()) -> Any | None:
        """The drafter actor a starting request drafts on (not one in ``avoid``), or ``None``: none has room."""
        ...

    def done(self, request_id: str) -> None:
        """A request that picked has ended."""
        ...

    def load(self) -> dict[str, Any]:
        """Replicas joined; per member its state and requests; requests that found no member."""
        ...


def spawn_replica(config: ReplicaConfig, pool: DrafterSource | None = None) -> Replica:
    """Place and start one replica; returns once rank 0's verifier is listening. With ``pool``, a member of that
    drafter pool drafts for it (``specserve.actors.drafter_pool``) instead of a drafter of its own."""
    import ray
    from ray.util.placement_group import placement_group
    from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy

    spec = config.spec()
    if pool is None and spec.drafter_placement == "pool":
        raise ReplicaStartError(
            "drafter_placement pool needs the pool its drafter comes from: spawn it through Coordinator.spawn"
        )
    plan = replica_placement(spec)
    if pool is not None:  # the shards alone: the pool places its members itself
        plan = replica_placement(dataclasses.replace(spec, drafter_placement="pool"))
    groups = [placement_group(plan.target.bundles, strategy=plan.target.strategy)]
    actors: list[Any] = []
    shards: list[Any] = []
    joined = False  # whether it joined the pool, once it has
    if plan.drafter is not None and pool is None:
        groups.append(placement_group(plan.drafter.bundles, strategy=plan.drafter.strategy))
    try:
        ready = [group.ready() for group in groups]
        _, pending = ray.wait(ready, num_returns=len(ready), timeout=config.ready_timeout_s)
        if pending:
            raise ReplicaStartError(
                f"the cluster cannot place a replica within {config.ready_timeout_s:.0f}s: it needs "
                f"{_describe(plan.target.bundles)} on one node"
                + (f" and {_describe(plan.drafter.bundles)}" if plan.drafter else "")
                + f"; available: {ray.available_resources()}. Start a cluster that declares these resources "
                "(`specserve cluster up`) or lower --tp."
            )

        # a batched replica (max_num_seqs > 1): KV pools on every rank, rank 0 verifies its requests' drafts
        # together, and the drafter runs that many requests' loops at once
        batched = config.max_num_seqs if config.max_num_seqs > 1 else 0
        concurrency = 4 + config.max_num_seqs
        shard_cls: Any = ray.remote(TargetShardActor)
        for rank, bundle in enumerate(plan.shard_bundles):
            resources = dict(plan.target.bundles[bundle])
            shards.append(
                shard_cls.options(
                    num_cpus=resources.pop("CPU", 0.0),
                    num_gpus=resources.pop("GPU", 0.0),
                    resources=resources,
                    max_concurrency=concurrency,
                    runtime_env={"env_vars": _actor_env(config.threads_per_shard)},
                    scheduling_strategy=PlacementGroupSchedulingStrategy(groups[0], bundle),
                ).remote(
                    config.target,
                    rank=rank,
                    world_size=config.tp_degree,
                    dtype=config.dtype,
                    device=config.device,
                    num_threads=config.threads_per_shard,
                    max_num_seqs=batched,
                    max_seq_len=config.max_seq_len,
                    batch_wait_s=config.batch_wait_ms / 1000,
                    prefill_tokens=config.max_batch_tokens,
                    kv_pool_tokens=config.kv_pool_tokens,
                    kv_memory_fraction=config.kv_cache_memory,
                    prefix_caching=not config.no_prefix_cache,
                )
            )
        actors.extend(shards)
        host, port = ray.get(shards[0].rendezvous.remote())
        ray.get([shard.init_tensor_parallel.remote(host, port, config.collective_timeout_s) for shard in shards])
        address: str = ray.get(shards[0].start_server.remote(config.verifier_host))
        token: str = ray.get(shards[0].verifier_token.remote())
        info: ModelInfo = ray.get(shards[0].describe.remote())

        if pool is not None:  # a member of the pool drafts for this replica (and others)
            drafter = pool.join(info, shards[0])
            joined = True
        else:
            if plan.drafter is None:
                assert plan.drafter_bundle is not None
                group, bundle = groups[0], plan.drafter_bundle
                resources = dict(plan.target.bundles[bundle])
            else:
                group, bundle = groups[1], 0
                resources = dict(plan.drafter.bundles[0])
            drafter = start_drafter(config, info, group, bundle, resources, config.max_num_seqs)
            actors.append(drafter)
        # surfaces a drafter that cannot load (bad path, vocabulary); hidden-state drafters name their features
        feature_layers = tuple(ray.get(drafter.feature_layers.remote()))
    except ray.exceptions.ActorDiedError as exc:
        _clean_up(actors, groups, pool if joined else None, shards)
        raise ReplicaStartError(f"a replica actor failed to start: {_root_cause(exc)}") from exc
    except BaseException:
        _clean_up(actors, groups, pool if joined else None, shards)
        raise
    return Replica(
        config,
        shards,
        drafter,
        groups,
        address,
        info,
        verifier_token=token,
        feature_layers=feature_layers,
        pool=pool,
    )


def _clean_up(actors: list[Any], groups: list[Any], joined: DrafterSource | None, shards: list[Any]) -> None:
    """A replica that failed to start: its own actors killed, its groups removed, the pool it joined left."""
    import ray
    from ray.util.placement_group import remove_placement_group

    for actor in actors:
        ray.kill(actor)
    for group in groups:
        remove_placement_group(group)
    if joined is not None:
        joined.leave(shards[0])


def start_drafter(
    config: ReplicaConfig, info: ModelInfo, group: Any, bundle: int, resources: dict[str, float], max_requests: int
) -> Any:
    """A drafter actor for ``config``'s model in ``bundle`` of placement group ``group`` (whose ``resources`` it takes),
    running up to ``max_requests`` request loops at once; Ray restarts it :data:`DRAFTER_MAX_RESTARTS` times."""
    import ray
    from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy

    resources = dict(resources)
    drafter_cls: Any = ray.remote(DrafterActor)
    return drafter_cls.options(
        max_restarts=DRAFTER_MAX_RESTARTS,  # a lost drafter costs its requests speed; later ones get it back
        num_cpus=resources.pop("CPU", 0.0),
        num_gpus=resources.pop("GPU", 0.0),
        resources=resources,
        max_concurrency=4 + max_requests,
        runtime_env={"env_vars": _actor_env(config.threads_per_drafter)},
        scheduling_strategy=PlacementGroupSchedulingStrategy(group, bundle),
    ).remote(
        config.draft,
        config.target,
        info,
        num_threads=config.threads_per_drafter,
        max_requests=max_requests,
        suffix_store=config.suffix_store,
        **{**config.drafter_options(), "device": config.drafter_actor_device},
    )


def _actor_env(threads: int) -> dict[str, str]:
    """Environment of an actor process (importing ``specserve`` already keeps it off the model hub).
    Ray sets ``OMP_NUM_THREADS`` to the actor's CPU count; it is set to the thread count asked for."""
    env = {
        "TOKENIZERS_PARALLELISM": "false",
        "OMP_NUM_THREADS": str(threads),
        # libgomp's workers spin 300k iterations after each parallel region by default; the drafter and the
        # target alternate on the same cores, and a short spin stops one stealing the other's CPU
        # (BENCHMARKS.md §2: 77.9 -> 93.6 tok/s co-located at TP 1 on 2 cores).
        "GOMP_SPINCOUNT": os.environ.get("GOMP_SPINCOUNT", "10000"),
    }
    if "SPECSERVE_MODELS" in os.environ:
        env["SPECSERVE_MODELS"] = os.environ["SPECSERVE_MODELS"]
    return env


def _root_cause(exc: BaseException) -> str:
    """The last line of a remote traceback: the exception that killed the actor, with its message."""
    lines = [line.strip() for line in str(exc).splitlines() if line.strip()]
    return lines[-1] if lines else type(exc).__name__


def _describe(bundles: list[dict[str, float]]) -> str:
    return " + ".join("{" + ", ".join(f"{k}: {v:g}" for k, v in b.items()) + "}" for b in bundles)
