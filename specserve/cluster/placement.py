"""Placement math: a typed cluster spec -> Ray placement-group bundles and strategies. Pure, no Ray.

One target replica is ``tp_degree`` shard actors that must sit on one node (their all-reduces
are on the critical path), so they form one placement group with strategy ``STRICT_PACK``, one
bundle per shard asking for one unit of the "large" custom resource. The drafter either joins
that group as one more bundle (``colocated``: same node, no extra resource) or gets a group of
its own on a "cheap" node (``separate``: one bundle asking for one unit of the cheap resource). With ``pool`` a replica
has no drafter of its own: a member of a drafter pool, which places its members as ``separate`` drafters, drafts for it
and for other replicas (``specserve.actors.drafter_pool``).

Worked example — 2 replicas at TP 2, drafters on cheap nodes, CPU::

    >>> spec = ClusterSpec(target_replicas=2, tp_degree=2, drafter_placement="separate")
    >>> plan = replica_placement(spec)
    >>> plan.target.strategy, plan.target.bundles
    ('STRICT_PACK', [{'CPU': 1.0, 'large': 1.0}, {'CPU': 1.0, 'large': 1.0}])
    >>> plan.drafter.strategy, plan.drafter.bundles
    ('PACK', [{'CPU': 1.0, 'cheap': 1.0}])
    >>> cluster_demand(spec)
    {'CPU': 6.0, 'large': 4.0, 'cheap': 2.0}

This module only computes; creating the groups and actors is the runtime's job.
"""

from __future__ import annotations

from collections import Counter
from dataclasses import dataclass
from typing import Literal

from specserve.core.errors import UserError

DrafterPlacement = Literal["colocated", "separate", "pool"]
Accelerator = Literal["cpu", "gpu"]
MAX_TP = 64


class InvalidClusterSpec(UserError):
    """The cluster spec cannot be placed as written; the message says which field to change."""


@dataclass(frozen=True)
class ClusterSpec:
    target_replicas: int = 1
    tp_degree: int = 1
    drafter_placement: DrafterPlacement = "colocated"
    accelerator: Accelerator = "cpu"
    large_resource: str = "large"  # custom resource on nodes that host target shards
    cheap_resource: str = "cheap"  # custom resource on nodes that host separate drafters
    cpus_per_shard: float = 1.0
    cpus_per_drafter: float = 1.0
    gpus_per_drafter: float = 0.0  # only with accelerator="gpu"; 0 = the drafter actor reserves none (runs on CPU)
    pool_ratio: int = 2  # drafter_placement "pool": replicas one pool member drafts for

    def __post_init__(self) -> None:
        if self.pool_ratio < 1:
            raise InvalidClusterSpec(f"pool_ratio must be >= 1, got {self.pool_ratio}")
        if self.target_replicas < 1:
            raise InvalidClusterSpec(f"target_replicas must be >= 1, got {self.target_replicas}")
        if not 1 <= self.tp_degree <= MAX_TP or self.tp_degree & (self.tp_degree - 1):
            raise InvalidClusterSpec(f"tp_degree must be a power of two between 1 and {MAX_TP}, got {self.tp_degree}")
        if self.drafter_placement not in ("colocated", "separate", "pool"):
            raise InvalidClusterSpec(
                f"drafter_placement must be 'colocated', 'separate' or 'pool', got {self.drafter_placement!r}"
            )
        if self.accelerator not in ("cpu", "gpu"):
            raise InvalidClusterSpec(f"accelerator must be 'cpu' or 'gpu', got {self.accelerator!r}")
        if not self.large_resource or not self.cheap_resource or self.large_resource == self.cheap_resource:
            raise InvalidClusterSpec("large_resource and cheap_resource must be two different non-empty names")
        if self.large_resource in ("CPU", "GPU", "memory") or self.cheap_resource in ("CPU", "GPU", "memory"):
            raise InvalidClusterSpec("custom resource names must not shadow Ray's CPU, GPU or memory")
        if self.cpus_per_shard <= 0 or self.cpus_per_drafter <= 0:
            raise InvalidClusterSpec("cpus_per_shard and cpus_per_drafter must be > 0")
        if self.gpus_per_drafter < 0 or (self.gpus_per_drafter > 0 and self.accelerator != "gpu"):
            raise InvalidClusterSpec("gpus_per_drafter must be 0 unless accelerator is 'gpu'")


Bundle = dict[str, float]


@dataclass(frozen=True)
class GroupPlan:
    bundles: list[Bundle]
    strategy: Literal["STRICT_PACK", "PACK"]


@dataclass(frozen=True)
class ReplicaPlan:
    target: GroupPlan  # bundles[0 .. tp_degree-1] are the shards (rank order); a colocated drafter is last
    drafter: GroupPlan | None  # the drafter's own group when placement is "separate" (none of its own: "pool")
    shard_bundles: tuple[int, ...]  # bundle index of each TP rank in ``target``
    drafter_bundle: int | None  # bundle index of the colocated drafter in ``target``


def shard_bundle(spec: ClusterSpec) -> Bundle:
    bundle: Bundle = {"CPU": float(spec.cpus_per_shard), spec.large_resource: 1.0}
    if spec.accelerator == "gpu":
        bundle["GPU"] = 1.0
    return bundle


def drafter_bundle(spec: ClusterSpec) -> Bundle:
    bundle: Bundle = {"CPU": float(spec.cpus_per_drafter)}
    if spec.gpus_per_drafter > 0:
        bundle["GPU"] = float(spec.gpus_per_drafter)
    if spec.drafter_placement in ("separate", "pool"):
        bundle[spec.cheap_resource] = 1.0
    return bundle


def replica_placement(spec: ClusterSpec) -> ReplicaPlan:
    """The placement groups one target replica (its shards and its drafter) needs."""
    shards = [shard_bundle(spec) for _ in range(spec.tp_degree)]
    if spec.drafter_placement == "colocated":
        return ReplicaPlan(
            target=GroupPlan([*shards, drafter_bundle(spec)], "STRICT_PACK"),
            drafter=None,
            shard_bundles=tuple(range(spec.tp_degree)),
            drafter_bundle=spec.tp_degree,
        )
    if spec.drafter_placement == "pool":  # the pool places its members (one separate drafter's group each)
        return ReplicaPlan(GroupPlan(shards, "STRICT_PACK"), None, tuple(range(spec.tp_degree)), None)
    return ReplicaPlan(
        target=GroupPlan(shards, "STRICT_PACK"),
        drafter=GroupPlan([drafter_bundle(spec)], "PACK"),
        shard_bundles=tuple(range(spec.tp_degree)),
        drafter_bundle=None,
    )


def cluster_demand(spec: ClusterSpec) -> dict[str, float]:
    """Total resources all replicas ask for (what the autoscaler must provide): with ``pool``, the shards' and
    ``⌈target_replicas / pool_ratio⌉`` pool members' (each a separate drafter's bundle)."""
    plan = replica_placement(spec)
    total: Counter[str] = Counter()
    groups = [plan.target] + ([plan.drafter] if plan.drafter else [])
    for group in groups:
        for bundle in group.bundles:
            total.update({k: v * spec.target_replicas for k, v in bundle.items()})
    if spec.drafter_placement == "pool":
        members = -(-spec.target_replicas // spec.pool_ratio)
        total.update({k: v * members for k, v in drafter_bundle(spec).items()})
    return {k: float(v) for k, v in total.items()}
