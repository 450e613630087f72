"""Ray actors of the distributed runtime: target shards, drafters and the per-replica coordinator."""

from specserve.actors.coordinator import Coordinator
from specserve.actors.drafter import DrafterActor
from specserve.actors.replica import Replica, ReplicaConfig, ReplicaStartError, spawn_replica
from specserve.actors.target_shard import TargetShardActor

__all__ = [
    "Coordinator",
    "DrafterActor",
    "Replica",
    "ReplicaConfig",
    "ReplicaStartError",
    "TargetShardActor",
    "spawn_replica",
]
