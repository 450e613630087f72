"""Joining a Ray cluster for a command that spawns replicas: an explicit address, the local cluster, or a private one.

Order: ``--ray-address`` if given; else the cluster ``specserve cluster up`` started (found
through its state file); else a private single-node Ray on 127.0.0.1 that declares enough of the
"large" and "cheap" resources for the replicas asked for, shut down again on exit. Ray never reports usage
statistics and binds to loopback when started here. A private Ray uses Ray's token authentication, chosen
explicitly (``RAY_AUTH_MODE=token``, the setting Ray documents) so that Ray does not warn on every start that it
chose it by itself; a mode the user set is kept.
"""

from __future__ import annotations

import contextlib
import math
import os
from collections.abc import Iterator

from specserve.cluster.placement import ClusterSpec

PRIVATE_RAY = "private local Ray (127.0.0.1)"  # what connect_ray yields when it started Ray itself
AUTH_MODE_ENV = "RAY_AUTH_MODE"


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
        choose_token_auth()
        ray.init(
            # logical CPUs: what the replicas' actors reserve, and room for the caller's
            num_cpus=max(4, math.ceil(replicas * (tp_degree * spec.cpus_per_shard + spec.cpus_per_drafter)) + 2),
            resources={spec.large_resource: float(tp_degree * replicas), spec.cheap_resource: float(replicas)},
            include_dashboard=False,
            _node_ip_address="127.0.0.1",
            log_to_driver=False,
        )
        where = PRIVATE_RAY
    try:
        yield where
    finally:
        ray.shutdown()


def choose_token_auth() -> None:
    """Token authentication for the Ray about to start here, unless the user chose a mode (``RAY_AUTH_MODE``).

    Ray reads the mode when it is imported (ours is imported long before a private Ray starts), so the mode is set
    the way ``ray.init`` sets its own default: in the environment, for the Ray processes it starts, and in the
    configuration this process has cached (Ray's helper for exactly that). Were that helper to move, Ray keeps
    choosing token authentication by itself, and says so."""
    if AUTH_MODE_ENV in os.environ:
        return
    try:
        from ray._private.authentication.authentication_token_setup import _enable_token_auth
    except ImportError:
        return
    _enable_token_auth()
