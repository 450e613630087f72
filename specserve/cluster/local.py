"""A local multi-node Ray cluster on this one machine: ``specserve cluster up | down | status``.

``up`` starts one Ray head node and N worker nodes as separate ``ray start --block`` processes
on this machine, so that code written for a real cluster (placement groups asking for the "large"
resource for target shards and the "cheap" resource for separate drafters, see
:mod:`specserve.cluster.placement`) runs unchanged on a laptop. The head declares ``large``
(default 4 units), each worker declares ``cheap`` (default 1 unit). CPU counts are *logical*:
Ray only uses them for scheduling, so a head with 4 "CPUs" and two workers with 1 each on a
2-core machine is fine — the nodes simply share the real cores.

What it does:

* Each node is ``ray start --block`` run in a session of its own (``start_new_session``). Every
  Ray process of that node (GCS, raylet, agents, and the worker processes the raylet forks, which
  sit in process groups of their own but keep the session) carries that session id. The state
  file (``<state dir>/cluster.json``) records each node's session-leader pid and its start time.
* ``down`` sends SIGTERM to exactly those leaders (``ray start --block`` then stops its own
  node's processes; drain-on-SIGTERM is switched off with ``RAY_GRACEFUL_SHUTDOWN_DRAIN_TIMEOUT_S=0``),
  waits, SIGKILLs whatever is still in those sessions or still names a node's temp dir on its
  command line, and checks that none is left. It never runs ``ray stop``, which would kill every
  Ray process of the user — including a test suite's ``ray.init()`` cluster.
* ``status`` (:mod:`specserve.cluster.cluster_status`) connects a short-lived driver in a subprocess
  (so the caller's own ``ray.init`` state is untouched) and reads nodes, per-node resources and
  actors straight from the GCS.
  ``ray.util.state.list_actors`` is not used: it needs the dashboard's HTTP API server, which
  this cluster does not start (``--include-dashboard=false``).
* Logs: ``<state dir>/logs/<node>.log`` holds each ``ray start``'s output, Ray's own logs are in
  ``<node temp dir>/session_latest/logs``. ``down`` keeps both; the next ``up`` on the same port
  clears the Ray temp dirs.

Where: this module holds the spec (:class:`LocalClusterSpec`), the nodes' ``ray start`` command lines, ``up``
and ``down``; the process toolkit they stand on (reading ``/proc``, stopping a node's session, the state file,
ports, the environment of the processes started) is :mod:`specserve.cluster.processes`, and reading and rendering
the status is :mod:`specserve.cluster.cluster_status`.

What it does not do: run anything across machines (use ``ray up`` with ``deploy/`` for that),
restart crashed nodes, or work outside Linux (it reads ``/proc``).

Ray 2.60 facts this relies on, checked by hand:

* ``--temp-dir`` may be given per node. Ray puts AF_UNIX sockets under it and their paths must
  stay under 108 bytes, so the temp dirs live in ``/tmp/specserve-<uid>-<port>/<node>`` rather
  than under the state dir (a pytest tmp dir or a deep home would be too long). Keeping them out
  of ``/tmp/ray`` also keeps ``ray.init(address="auto")`` of other sessions from finding us.
* ``--node-ip-address 127.0.0.1`` is accepted but Ray rewrites loopback to this machine's
  routable address, and several Ray processes listen on all interfaces; Ray has no switch to
  confine a multi-node cluster to loopback.
* Ray token auth is switched off explicitly (``RAY_AUTH_MODE=disabled``) on every node, so that
  any driver joins with a plain ``ray.init(address=connect_address())``. Left unset,
  ``ray start --head`` turns token auth on by itself whenever ``~/.ray/auth_token`` exists (any
  local ``ray.init()`` creates that file) while ``ray start --address`` does not, and the workers
  then fail with ``InvalidAuthToken``. Token auth for drivers given an explicit address is only
  switched on by ``RAY_AUTH_MODE=token`` read when ray is imported, and a per-process token cache
  makes it fragile to switch in a process that already uses another Ray cluster (a test suite's);
  so, as with a plain ``ray start``: anyone who can reach this machine's ports can use the
  cluster. Keep it to trusted networks.
* The head's Ray-client server would take port 10001 (clashing with a default ``ray start``);
  it is moved to ``port + 1``.
"""

from __future__ import annotations

import contextlib
import json
import os
import shutil
import subprocess
import sys
import time
from dataclasses import asdict, dataclass, field, replace
from pathlib import Path

from specserve.cluster.cluster_status import status
from specserve.cluster.placement import ClusterSpec, InvalidClusterSpec
from specserve.cluster.processes import (
    STATE_FILE,
    ClusterNotRunning,
    LocalCluster,
    NodeProcess,
    child_env,
    default_state_dir,
    is_live,
    locked,
    port_free,
    proc_info,
    reap,
    require_linux,
    stop_nodes,
)
from specserve.core.errors import UserError

DEFAULT_PORT = 6390  # not Ray's 6379, so a default `ray start` or `ray.init()` can run beside us
MAX_WORKERS = 8  # every node is a raylet plus agents (~0.3 GB) on this one machine
MIN_OBJECT_STORE_MB = 80  # Ray refuses less than ~75 MB

HEAD_READY_TIMEOUT_S = 90.0
WORKER_READY_TIMEOUT_S = 90.0
NODES_REGISTERED_TIMEOUT_S = 45.0


class ClusterAlreadyRunning(UserError):
    """``up`` found this cluster already running."""


class ClusterStartError(UserError):
    """A ``ray start`` failed; the message names its log."""


# ---------------------------------------------------------------------------------------------
# Spec


@dataclass(frozen=True)
class LocalClusterSpec:
    """What ``up`` starts. Defaults: a head with ``large: 4`` and 4 logical CPUs, 2 workers with ``cheap: 1``, 1 CPU."""

    workers: int = 2
    large: int = 4  # units of the large resource on the head (one per target shard)
    cheap: int = 1  # units of the cheap resource on each worker (one per separate drafter)
    large_resource: str = "large"  # same names as ClusterSpec's defaults
    cheap_resource: str = "cheap"
    head_cpus: int = 4  # logical CPUs; may exceed the machine's cores
    worker_cpus: int = 1
    port: int = DEFAULT_PORT  # GCS port; the Ray-client server takes port + 1
    object_store_mb: int = 512  # per node; Ray's default (30% of RAM each) over-commits /dev/shm with several nodes
    state_dir: Path = field(default_factory=default_state_dir)

    def __post_init__(self) -> None:
        if not 0 <= self.workers <= MAX_WORKERS:
            raise InvalidClusterSpec(
                f"workers must be between 0 and {MAX_WORKERS} (each node is a raylet on this one machine), "
                f"got {self.workers}"
            )
        if self.large < 1:
            raise InvalidClusterSpec(
                f"large must be >= 1 (units of '{self.large_resource}' on the head), got {self.large}"
            )
        if self.cheap < 1:
            raise InvalidClusterSpec(
                f"cheap must be >= 1 (units of '{self.cheap_resource}' on each worker), got {self.cheap}"
            )
        # The same naming rules as the placement spec that will ask for these resources.
        ClusterSpec(large_resource=self.large_resource, cheap_resource=self.cheap_resource)
        if self.head_cpus < 1 or self.worker_cpus < 1:
            raise InvalidClusterSpec(
                f"head_cpus and worker_cpus must be >= 1, got {self.head_cpus} and {self.worker_cpus}"
            )
        if not 1024 <= self.port <= 65534:
            raise InvalidClusterSpec(f"port must be between 1024 and 65534 (port + 1 is used too), got {self.port}")
        if self.object_store_mb < MIN_OBJECT_STORE_MB:
            raise InvalidClusterSpec(f"object_store_mb must be >= {MIN_OBJECT_STORE_MB}, got {self.object_store_mb}")

    @property
    def client_port(self) -> int:
        return self.port + 1

    def node_names(self) -> list[str]:
        return ["head", *(worker_name(i) for i in range(1, self.workers + 1))]


def worker_name(index: int) -> str:
    return f"worker{index}"


def ray_temp_root(port: int) -> Path:
    """Short, per-user, per-port root for the nodes' Ray temp dirs (see the module docstring).

    Length budget: Ray's longest socket path below a node temp dir is
    ``/session_<date>_<time>_<usec>_<pid>/sockets/plasma_store`` (at most 64 bytes), and
    ``/tmp/specserve-<uid>-<port>/worker8`` is at most 39, within the 107 bytes AF_UNIX allows.
    """
    return Path("/tmp") / f"specserve-{os.getuid()}-{port}"


def node_temp_dir(port: int, name: str) -> Path:
    return ray_temp_root(port) / name


# ---------------------------------------------------------------------------------------------
# up / down


def _ray_start_command(spec: LocalClusterSpec, name: str) -> list[str]:
    command = [sys.executable, "-m", "ray.scripts.scripts", "start", "--block", "--disable-usage-stats"]
    command += ["--node-ip-address", "127.0.0.1", "--temp-dir", str(node_temp_dir(spec.port, name))]
    command += ["--object-store-memory", str(spec.object_store_mb * 1024 * 1024)]
    if name == "head":
        command += ["--head", "--port", str(spec.port), "--ray-client-server-port", str(spec.client_port)]
        command += ["--include-dashboard", "false", "--num-cpus", str(spec.head_cpus)]
        command += ["--resources", json.dumps({spec.large_resource: spec.large})]
    else:
        command += ["--address", f"127.0.0.1:{spec.port}", "--num-cpus", str(spec.worker_cpus)]
        command += ["--resources", json.dumps({spec.cheap_resource: spec.cheap})]
    return command


def _launch(spec: LocalClusterSpec, name: str) -> NodeProcess:
    temp_dir = node_temp_dir(spec.port, name)
    temp_dir.mkdir(parents=True, exist_ok=True)
    (temp_dir / "ray_current_cluster").unlink(missing_ok=True)  # written again once this node is up
    log_path = spec.state_dir / "logs" / f"{name}.log"
    log_path.parent.mkdir(parents=True, exist_ok=True)
    with open(log_path, "w") as log:
        proc = subprocess.Popen(
            _ray_start_command(spec, name),
            stdin=subprocess.DEVNULL,
            stdout=log,
            stderr=subprocess.STDOUT,
            env=child_env(),
            start_new_session=True,  # own session: Ctrl-C/hang-up of the caller does not reach it; `down` finds it
        )
    info = proc_info(proc.pid)
    start_ticks = info.start_ticks if info is not None else -1
    return NodeProcess(name=name, pid=proc.pid, start_ticks=start_ticks, temp_dir=str(temp_dir), log=str(log_path))


def _log_tail(path: str, lines: int = 3) -> str:
    try:
        text = Path(path).read_text(errors="replace").strip().splitlines()
    except OSError:
        return ""
    return " | ".join(line.strip() for line in text[-lines:])


def _wait_ready(node: NodeProcess, timeout_s: float) -> str:
    """Wait until ``ray start`` has written its node's address file; returns the GCS address."""
    address_file = Path(node.temp_dir) / "ray_current_cluster"
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if address_file.is_file() and (address := address_file.read_text().strip()):
            return address
        reap(node.pid)
        if not is_live(proc_info(node.pid)):
            raise ClusterStartError(f"the {node.name} node failed to start; see {node.log}: {_log_tail(node.log)}")
        time.sleep(0.2)
    raise ClusterStartError(f"the {node.name} node did not come up within {timeout_s:.0f} s; see {node.log}")


def _wait_registered(address: str, expected: int, timeout_s: float) -> None:
    deadline = time.monotonic() + timeout_s
    alive = 0
    while time.monotonic() < deadline:
        with contextlib.suppress(ClusterNotRunning):  # a driver that could not join yet: try again
            alive = sum(node.alive for node in status(address).nodes)
            if alive >= expected:
                return
        time.sleep(1.0)
    raise ClusterStartError(f"only {alive} of {expected} nodes registered with the head within {timeout_s:.0f} s")


def up(spec: LocalClusterSpec | None = None) -> LocalCluster:
    """Start the head, then the workers; return once every node is registered and alive.

    Refuses (ClusterAlreadyRunning) if the cluster recorded in the state dir is still up. A state
    file left by a cluster that died is cleaned up first. On any failure the nodes started so far
    are stopped again.
    """
    spec = spec or LocalClusterSpec()
    require_linux()
    with locked(spec.state_dir):
        previous = LocalCluster.load(spec.state_dir)
        if previous is not None:
            if previous.running():
                raise ClusterAlreadyRunning(
                    f"the local cluster is already up at {previous.address} (state: {previous.state_file}); "
                    "stop it first with `specserve cluster down`"
                )
            stop_nodes(list(previous.nodes))  # leftovers of a cluster whose head died
            previous.state_file.unlink(missing_ok=True)
        for port in (spec.port, spec.client_port):
            if not port_free(port):
                raise ClusterStartError(f"port {port} is in use (another Ray cluster?); choose another with --port")
        # Ray's session dirs of the previous run on this port (kept by `down` for post-mortems) go now.
        shutil.rmtree(ray_temp_root(spec.port), ignore_errors=True)

        spec_record = {**asdict(spec), "state_dir": str(spec.state_dir)}
        cluster = LocalCluster(f"127.0.0.1:{spec.port}", spec.port, (), spec_record, spec.state_dir / STATE_FILE)
        nodes: list[NodeProcess] = []
        try:
            nodes.append(_launch(spec, "head"))
            cluster = replace(cluster, nodes=tuple(nodes))
            cluster.save()  # from here on `down` can clean up even if this process dies
            address = _wait_ready(nodes[0], HEAD_READY_TIMEOUT_S)
            nodes += [_launch(spec, name) for name in spec.node_names()[1:]]
            cluster = replace(cluster, address=address, nodes=tuple(nodes))
            cluster.save()
            for node in nodes[1:]:
                _wait_ready(node, WORKER_READY_TIMEOUT_S)
            _wait_registered(address, len(nodes), NODES_REGISTERED_TIMEOUT_S)
        except BaseException:
            stop_nodes(nodes)
            cluster.state_file.unlink(missing_ok=True)
            raise
        return cluster


@dataclass(frozen=True)
class StopReport:
    address: str
    nodes: int  # nodes recorded in the state file
    was_running: bool  # False: the head had already died; only leftovers were cleaned up
    killed: tuple[str, ...]  # "PID (title)" of each process that outlived SIGTERM's grace and needed SIGKILL


def down(state_dir: Path | None = None) -> StopReport:
    """Stop exactly the cluster recorded in the state dir, and nothing else; remove its state file."""
    state_dir = state_dir or default_state_dir()
    require_linux()
    with locked(state_dir):
        cluster = LocalCluster.load(state_dir)
        if cluster is None:
            raise ClusterNotRunning(f"no local cluster is up (no {STATE_FILE} in {state_dir})")
        was_running = cluster.running()
        killed = stop_nodes(list(cluster.nodes))
        cluster.state_file.unlink(missing_ok=True)
        return StopReport(cluster.address, len(cluster.nodes), was_running, tuple(killed))
