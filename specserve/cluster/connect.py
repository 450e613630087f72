"""Joining a Ray cluster for a command that spawns replicas: an explicit address, the local cluster, or a private one.

Order: ``--ray-address`` if given; else the cluster ``specserve cluster up`` started (found
through its state file); else a private single-node Ray on 127.0.0.1 that declares enough of the
"large" and "cheap" resources for the replicas asked for, shut down again on exit. Ray never reports usage
statistics. A private Ray uses Ray's token authentication, chosen explicitly (``RAY_AUTH_MODE=token``, the setting
Ray documents) so that Ray does not warn on every start that it chose it by itself; a mode the user set is kept.

A private Ray listens on loopback only (:func:`loopback_only`): GCS, raylet (node and object manager), the workers'
gRPC servers, the dashboard agent, the metrics export port and the runtime-env agent all bind 127.0.0.1 (checked
with ``ss -ltnp`` and by ``tests/serve/test_ingress_safety.py``). ``_node_ip_address="127.0.0.1"`` alone does not do
it: Ray 2.60 rewrites a loopback node address to this machine's routable one, and its processes then listen on
every interface. A cluster joined by address (``--ray-address``, ``specserve cluster up``) binds as it was
started; this module cannot change that.
"""

from __future__ import annotations

import contextlib
import math
import os
from collections.abc import Iterator

from specserve.cluster.placement import ClusterSpec

PRIVATE_RAY = "private local Ray (127.0.0.1)"  # what connect_ray yields when it started Ray itself
AUTH_MODE_ENV = "RAY_AUTH_MODE"
# Ray's single-machine mode, the default on macOS and Windows: the node's address is loopback, not rewritten
SINGLE_MACHINE_ENV = "RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER"


@contextlib.contextmanager
def connect_ray(
    address: str | None = None, tp_degree: int = 1, spec: ClusterSpec | None = None, replicas: int = 1
) -> Iterator[str]:
    """Connected Ray for the duration of the block; yields a description of where it runs.

    A private Ray declares room for ``replicas`` replicas of ``tp_degree`` shards (and their drafters).
    """
    import ray

    from specserve.cluster.processes import connect_address

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
        with loopback_only():
            ray.init(
                # logical CPUs: what the replicas' actors reserve, and room for the caller's
                num_cpus=max(4, math.ceil(replicas * (tp_degree * spec.cpus_per_shard + spec.cpus_per_drafter)) + 2),
                resources={spec.large_resource: float(tp_degree * replicas), spec.cheap_resource: float(replicas)},
                include_dashboard=False,
                dashboard_host="127.0.0.1",
                _node_ip_address="127.0.0.1",
                log_to_driver=False,
            )
        where = PRIVATE_RAY
    try:
        yield where
    finally:
        ray.shutdown()


@contextlib.contextmanager
def loopback_only() -> Iterator[None]:
    """A Ray started in the block takes 127.0.0.1 as its node address, so every process of it listens on loopback.

    Ray rewrites a loopback ``_node_ip_address`` to the machine's routable address unless it runs in its
    single-machine mode (``RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER`` false; Ray's default on macOS and Windows), which
    Ray reads when it is imported. So the mode is set in the environment, for the processes the block starts (they
    keep it), and in the constant this process already read (it is this process that picks the node's address);
    both are restored on leaving the block (a started Ray remembers its address). The constant is Ray-internal:
    were it to move, Ray would bind as before, and ``tests/serve/test_ingress_safety.py`` says so."""
    from ray._private import ray_constants

    saved_env = os.environ.get(SINGLE_MACHINE_ENV)
    saved_mode = getattr(ray_constants, "ENABLE_RAY_CLUSTER", None)
    os.environ[SINGLE_MACHINE_ENV] = "0"
    if saved_mode is not None:
        ray_constants.ENABLE_RAY_CLUSTER = False
    try:
        yield
    finally:
        if saved_env is None:
            os.environ.pop(SINGLE_MACHINE_ENV, None)
        else:
            os.environ[SINGLE_MACHINE_ENV] = saved_env
        if saved_mode is not None:
            ray_constants.ENABLE_RAY_CLUSTER = saved_mode


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
