"""Placement math without Ray: bundles, strategies, totals, the docstring's worked example, bad specs."""

from __future__ import annotations

import doctest

import pytest

from specserve.cluster import placement
from specserve.cluster.placement import ClusterSpec, InvalidClusterSpec, cluster_demand, replica_placement


def test_docstring_worked_example() -> None:
    assert doctest.testmod(placement).failed == 0


@pytest.mark.parametrize("tp", [1, 2, 4])
def test_colocated_drafter_joins_the_strict_pack_group(tp: int) -> None:
    plan = replica_placement(ClusterSpec(tp_degree=tp))
    assert plan.target.strategy == "STRICT_PACK" and plan.drafter is None
    assert len(plan.target.bundles) == tp + 1
    assert plan.shard_bundles == tuple(range(tp)) and plan.drafter_bundle == tp
    assert all(b == {"CPU": 1.0, "large": 1.0} for b in plan.target.bundles[:tp])
    assert plan.target.bundles[tp] == {"CPU": 1.0}


def test_separate_drafter_on_cheap_resource_gpu() -> None:
    spec = ClusterSpec(tp_degree=4, drafter_placement="separate", accelerator="gpu", cheap_resource="t4")
    plan = replica_placement(spec)
    assert plan.target.bundles == [{"CPU": 1.0, "large": 1.0, "GPU": 1.0}] * 4
    assert plan.drafter is not None and plan.drafter.bundles == [{"CPU": 1.0, "t4": 1.0}]
    assert plan.drafter_bundle is None


def test_cluster_demand_scales_with_replicas() -> None:
    assert cluster_demand(ClusterSpec(target_replicas=3, tp_degree=2)) == {"CPU": 9.0, "large": 6.0}


@pytest.mark.parametrize(
    ("kwargs", "needle"),
    [
        ({"target_replicas": 0}, "target_replicas"),
        ({"tp_degree": 3}, "tp_degree"),
        ({"tp_degree": 0}, "tp_degree"),
        ({"drafter_placement": "nearby"}, "drafter_placement"),
        ({"accelerator": "tpu"}, "accelerator"),
        ({"large_resource": "x", "cheap_resource": "x"}, "different"),
        ({"large_resource": "GPU"}, "shadow"),
        ({"cpus_per_shard": 0}, "cpus_per_shard"),
        ({"gpus_per_drafter": 1.0}, "gpus_per_drafter"),
    ],
)
def test_bad_specs_say_what_to_change(kwargs: dict[str, object], needle: str) -> None:
    with pytest.raises(InvalidClusterSpec, match=needle):
        ClusterSpec(**kwargs)  # type: ignore[arg-type]


def test_a_pool_replica_has_no_drafter_of_its_own_and_the_pool_members_are_counted() -> None:
    spec = ClusterSpec(target_replicas=5, tp_degree=2, drafter_placement="pool", pool_ratio=2)
    plan = replica_placement(spec)
    assert plan.drafter is None and plan.drafter_bundle is None
    assert plan.target.bundles == [{"CPU": 1.0, "large": 1.0}] * 2
    # 5 replicas of 2 shards, and ceil(5 / 2) = 3 members on the cheap resource
    assert cluster_demand(spec) == {"CPU": 13.0, "large": 10.0, "cheap": 3.0}
    with pytest.raises(InvalidClusterSpec, match="pool_ratio"):
        ClusterSpec(drafter_placement="pool", pool_ratio=0)
