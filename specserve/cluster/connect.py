"""Joining a Ray cluster for a command that spawns replicas: an explicit address, the local cluster, or a private one.

Order: ``--ray-address`` if given; else the cluster ``specserve cluster up`` started (found
through its state file); else a private single-node Ray on 127.0.0.1 that declares enough of the
"large" and "cheap" resources for the replicas asked for, shut down again on exit. Ray never reports usage
statistics and binds to loopback when started here.
"""

from __future__ import annotations

import contextlib
import math
import os
from collections.abc import Iterator

from specserve.cluster.placement import ClusterSpec


@contextlib.contextmanager
def connect_ray(
    address: str | None = None, tp_degree: int = 1, spec: ClusterSpec | None = None, replicas: int = 1
) -> Iterator[str]:
    """Connected Ray for the duration of the block; yields a description of where it runs.

    A private Ray declares room for ``replicas`` replicas of ``tp_degree`` shards (and their drafters).
    """
    import ray

    from specserve.cluster.local import connect_address

    os.environ.setdefault("RAY_USAGE_STATS_ENABLED", "0")
    spec = spec or ClusterSpec()
    if ray.is_initialized():  # the caller already connected (tests, notebooks): use that
        yield "existing Ray session"
        return
    address = address or connect_address()
    if address:
        ray.init(address=address, log_to_driver=False)
        where = f"Ray cluster at {address}"
    else:
        ray.init(
            # logical CPUs: what the replicas' actors reserve, and room for the caller's
            num_cpus=max(4, math.ceil(replicas * (tp_degree * spec.cpus_per_shard + spec.cpus_per_drafter)) + 2),
            resources={spec.large_resource: float(tp_degree * replicas), spec.cheap_resource: float(replicas)},
            include_dashboard=False,
            _node_ip_address="127.0.0.1",
            log_to_driver=False,
        )
        where = "private local Ray (127.0.0.1)"
    try:
        yield where
    finally:
        ray.shutdown()
