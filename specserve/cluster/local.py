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
* ``status`` connects a short-lived driver in a subprocess (so the caller's own ``ray.init``
  state is untouched) and reads nodes, per-node resources and actors straight from the GCS.
  ``ray.util.state.list_actors`` is not used: it needs the dashboard's HTTP API server, which
  this cluster does not start (``--include-dashboard=false``).
* Logs: ``<state dir>/logs/<node>.log`` holds each ``ray start``'s output, Ray's own logs are in
  ``<node temp dir>/session_latest/logs``. ``down`` keeps both; the next ``up`` on the same port
  clears the Ray temp dirs.

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
import fcntl
import importlib.util
import json
import logging
import os
import shutil
import signal
import socket
import subprocess
import sys
import time
from collections.abc import Iterator, Mapping
from dataclasses import asdict, dataclass, field, replace
from pathlib import Path
from typing import Any

from specserve.cluster.placement import ClusterSpec, InvalidClusterSpec
from specserve.core.errors import UserError

logger = logging.getLogger(__name__)

STATE_DIR_ENV = "SPECSERVE_CLUSTER_DIR"
STATE_FILE = "cluster.json"
STATE_FORMAT = 1
DEFAULT_PORT = 6390  # not Ray's 6379, so a default `ray start` or `ray.init()` can run beside us
MAX_WORKERS = 8  # every node is a raylet plus agents (~0.3 GB) on this one machine
MIN_OBJECT_STORE_MB = 80  # Ray refuses less than ~75 MB

HEAD_READY_TIMEOUT_S = 90.0
WORKER_READY_TIMEOUT_S = 90.0
NODES_REGISTERED_TIMEOUT_S = 45.0
STATUS_TIMEOUT_S = 60.0
STOP_GRACE_S = 20.0  # SIGTERM -> SIGKILL
KILL_WAIT_S = 5.0


class ClusterNotRunning(UserError):
    """No local cluster is up (or nothing answers at the given address)."""


class ClusterAlreadyRunning(UserError):
    """``up`` found this cluster already running."""


class ClusterStartError(UserError):
    """A ``ray start`` failed; the message names its log."""


class ClusterStopError(RuntimeError):
    """Processes of the cluster survived SIGKILL (should not happen; the message lists them)."""


def default_state_dir() -> Path:
    """``$SPECSERVE_CLUSTER_DIR`` if set, else ``~/.specserve/cluster``."""
    override = os.environ.get(STATE_DIR_ENV)
    return Path(override).expanduser() if override else Path.home() / ".specserve" / "cluster"


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
# Processes (Linux /proc)


@dataclass(frozen=True)
class NodeProcess:
    """One ``ray start --block`` process, leader of its own session."""

    name: str  # "head", "worker1", ...
    pid: int  # also the session id of every Ray process of this node
    start_ticks: int  # /proc/<pid>/stat starttime: tells our leader from a later process that reused the pid
    temp_dir: str  # Ray temp dir of this node (session dirs and Ray's logs live here)
    log: str  # stdout/stderr of `ray start`


@dataclass(frozen=True)
class _ProcInfo:
    pid: int
    state: str
    session: int
    start_ticks: int


def _proc_info(pid: int) -> _ProcInfo | None:
    try:
        raw = Path(f"/proc/{pid}/stat").read_text()
    except (FileNotFoundError, ProcessLookupError, PermissionError):
        return None
    fields = raw[raw.rindex(")") + 2 :].split()  # comm may contain spaces and parentheses
    return _ProcInfo(pid=pid, state=fields[0], session=int(fields[3]), start_ticks=int(fields[19]))


def _all_procs() -> list[_ProcInfo]:
    infos = []
    for entry in os.listdir("/proc"):
        if entry.isdigit() and (info := _proc_info(int(entry))) is not None:
            infos.append(info)
    return infos


def _is_live(info: _ProcInfo | None) -> bool:
    return info is not None and info.state not in ("Z", "X")


def _leader_is_ours(node: NodeProcess) -> bool:
    info = _proc_info(node.pid)
    return _is_live(info) and info is not None and info.start_ticks == node.start_ticks


def _session_members(nodes: list[NodeProcess]) -> list[int]:
    """Live pids in the sessions our node leaders opened.

    A session id is the pid of its leader, and Linux does not reuse a pid while a session with
    that id has members, so members are ours unless the pid now belongs to a different process.
    """
    sessions = set()
    for node in nodes:
        info = _proc_info(node.pid)
        if info is None or not _is_live(info) or info.start_ticks == node.start_ticks:
            sessions.add(node.pid)
    return [info.pid for info in _all_procs() if info.session in sessions and _is_live(info)]


def _reap(pid: int) -> None:
    """Collect the exit status if ``pid`` is our child (``up`` and ``down`` in one process, as in tests)."""
    with contextlib.suppress(ChildProcessError, OSError):
        os.waitpid(pid, os.WNOHANG)


def _signal(pids: list[int], sig: signal.Signals) -> None:
    for pid in pids:
        with contextlib.suppress(ProcessLookupError, PermissionError):
            os.kill(pid, sig)


def _wait_gone(nodes: list[NodeProcess], timeout_s: float) -> list[int]:
    deadline = time.monotonic() + timeout_s
    while True:
        for node in nodes:
            _reap(node.pid)
        left = _session_members(nodes)
        if not left or time.monotonic() > deadline:
            return left
        time.sleep(0.2)


def _ray_processes_naming(paths: list[str]) -> list[int]:
    """Live Ray processes (run from Ray's package dir) whose command line names one of ``paths``.

    GCS, raylet, agents and monitors name their node's temp dir; a ``tail -f`` of a log there
    is not a Ray process and is left alone.
    """
    spec = importlib.util.find_spec("ray")
    ray_dir = str(Path(spec.origin).parent) + "/" if spec is not None and spec.origin else None
    found = []
    for info in _all_procs():
        try:
            argv = Path(f"/proc/{info.pid}/cmdline").read_bytes().decode(errors="replace").split("\0")
        except OSError:
            continue
        is_ray = (ray_dir is not None and any(arg.startswith(ray_dir) for arg in argv)) or "ray.scripts.scripts" in argv
        if _is_live(info) and is_ray and any(path in arg for arg in argv for path in paths):
            found.append(info.pid)
    return found


def _describe(pids: list[int]) -> str:
    described = []
    for pid in pids:
        try:
            cmdline = Path(f"/proc/{pid}/cmdline").read_bytes().replace(b"\0", b" ").decode(errors="replace")
        except OSError:
            cmdline = "?"
        described.append(f"{pid} ({cmdline[:80].strip()})")
    return ", ".join(described)


def _stop_nodes(nodes: list[NodeProcess]) -> list[int]:
    """Stop exactly these nodes and verify they are gone; returns the pids that needed SIGKILL. Idempotent."""
    _signal([node.pid for node in nodes if _leader_is_ours(node)], signal.SIGTERM)
    left = _wait_gone(nodes, STOP_GRACE_S)
    # Belt and braces: a GCS/raylet/agent of these nodes that left the session still names its temp dir.
    temp_dirs = [node.temp_dir for node in nodes]
    left += [pid for pid in _ray_processes_naming(temp_dirs) if pid not in left]
    if left:
        logger.warning("SIGKILL to processes still up %.0f s after SIGTERM: %s", STOP_GRACE_S, _describe(left))
        _signal(left, signal.SIGKILL)
        time.sleep(0.2)
        survivors = _wait_gone(nodes, KILL_WAIT_S) + _ray_processes_naming(temp_dirs)
        if survivors:
            raise ClusterStopError(f"processes of the local cluster survived SIGKILL: {sorted(set(survivors))}")
    return left


def _port_answers(host: str, port: int, timeout_s: float = 2.0) -> bool:
    try:
        with socket.create_connection((host, port), timeout=timeout_s):
            return True
    except OSError:
        return False


def _port_free(port: int) -> bool:
    """Whether nothing listens on ``port`` (SO_REUSEADDR: TIME_WAIT leftovers of our last run do not count)."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as probe:
        probe.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            probe.bind(("0.0.0.0", port))
        except OSError:
            return False
    return True


# ---------------------------------------------------------------------------------------------
# State file


@dataclass(frozen=True)
class LocalCluster:
    """A running local cluster, as recorded in its state file."""

    address: str  # GCS address as Ray registered it ("<ip>:<port>"); pass to ray.init(address=...)
    port: int
    nodes: tuple[NodeProcess, ...]  # head first
    spec: dict[str, Any]  # the LocalClusterSpec it was started with (state_dir as a string)
    state_file: Path

    def to_json(self) -> str:
        body = {
            "format": STATE_FORMAT,
            "address": self.address,
            "port": self.port,
            "nodes": [asdict(node) for node in self.nodes],
            "spec": self.spec,
        }
        return json.dumps(body, indent=2)

    @classmethod
    def load(cls, state_dir: Path | None = None) -> LocalCluster | None:
        """The recorded cluster (running or not), or None when there is no state file."""
        path = (state_dir or default_state_dir()) / STATE_FILE
        try:
            body = json.loads(path.read_text())
        except FileNotFoundError:
            return None
        except (OSError, ValueError) as exc:
            raise UserError(f"cannot read the cluster state file {path}: {exc}; delete it if no cluster runs") from exc
        if not isinstance(body, dict) or body.get("format") != STATE_FORMAT:
            raise UserError(f"{path} was not written by this specserve version; stop that cluster with it or delete")
        try:
            return cls(
                address=body["address"],
                port=int(body["port"]),
                nodes=tuple(NodeProcess(**node) for node in body["nodes"]),
                spec=body["spec"],
                state_file=path,
            )
        except (KeyError, TypeError, ValueError) as exc:
            raise UserError(
                f"the cluster state file {path} is damaged ({exc!r}); delete it if no cluster runs"
            ) from exc

    def running(self) -> bool:
        """Whether the head's ``ray start`` process is still the one we started."""
        return bool(self.nodes) and _leader_is_ours(self.nodes[0])

    def save(self) -> None:
        self.state_file.parent.mkdir(parents=True, exist_ok=True)
        tmp = self.state_file.with_suffix(".tmp")
        tmp.write_text(self.to_json())
        tmp.replace(self.state_file)


@contextlib.contextmanager
def _locked(state_dir: Path) -> Iterator[None]:
    """Serialise ``up``/``down`` on one state dir (two concurrent ``up`` would both pass the checks)."""
    state_dir.mkdir(parents=True, exist_ok=True)
    with open(state_dir / ".lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(lock, fcntl.LOCK_UN)


def connect_address(state_dir: Path | None = None) -> str | None:
    """Address of the running local cluster, for ``ray.init(address=...)``; None if none is up."""
    cluster = LocalCluster.load(state_dir)
    return cluster.address if cluster is not None and cluster.running() else None


# ---------------------------------------------------------------------------------------------
# up / down


def _require_linux() -> None:
    if not sys.platform.startswith("linux"):
        raise UserError(f"the local cluster needs Linux (it tracks Ray processes through /proc), not {sys.platform}")


def _child_env() -> dict[str, str]:
    """Environment of our `ray start` and status processes: never a driver's address from the caller."""
    env = {k: v for k, v in os.environ.items() if k != "RAY_ADDRESS"}
    env["RAY_USAGE_STATS_ENABLED"] = "0"
    env["RAY_GRACEFUL_SHUTDOWN_DRAIN_TIMEOUT_S"] = "0"  # SIGTERM stops the node at once (default: drain up to 30 s)
    env["RAY_AUTH_MODE"] = "disabled"  # the same on every node, whatever ~/.ray holds (module docstring)
    return env


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
            env=_child_env(),
            start_new_session=True,  # own session: Ctrl-C/hang-up of the caller does not reach it; `down` finds it
        )
    info = _proc_info(proc.pid)
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
        _reap(node.pid)
        if not _is_live(_proc_info(node.pid)):
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
    _require_linux()
    with _locked(spec.state_dir):
        previous = LocalCluster.load(spec.state_dir)
        if previous is not None:
            if previous.running():
                raise ClusterAlreadyRunning(
                    f"the local cluster is already up at {previous.address} (state: {previous.state_file}); "
                    "stop it first with `specserve cluster down`"
                )
            _stop_nodes(list(previous.nodes))  # leftovers of a cluster whose head died
            previous.state_file.unlink(missing_ok=True)
        for port in (spec.port, spec.client_port):
            if not _port_free(port):
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
            _stop_nodes(nodes)
            cluster.state_file.unlink(missing_ok=True)
            raise
        return cluster


@dataclass(frozen=True)
class StopReport:
    address: str
    nodes: int  # nodes recorded in the state file
    was_running: bool  # False: the head had already died; only leftovers were cleaned up
    killed: tuple[int, ...]  # pids that ignored SIGTERM and needed SIGKILL


def down(state_dir: Path | None = None) -> StopReport:
    """Stop exactly the cluster recorded in the state dir, and nothing else; remove its state file."""
    state_dir = state_dir or default_state_dir()
    _require_linux()
    with _locked(state_dir):
        cluster = LocalCluster.load(state_dir)
        if cluster is None:
            raise ClusterNotRunning(f"no local cluster is up (no {STATE_FILE} in {state_dir})")
        was_running = cluster.running()
        killed = _stop_nodes(list(cluster.nodes))
        cluster.state_file.unlink(missing_ok=True)
        return StopReport(cluster.address, len(cluster.nodes), was_running, tuple(killed))


# ---------------------------------------------------------------------------------------------
# status


@dataclass(frozen=True)
class NodeStatus:
    node_id: str  # hex
    name: str  # base name of the node's Ray temp dir: "head", "worker1", ... here; "ray" on a default node
    ip: str
    alive: bool
    is_head: bool
    resources_total: dict[str, float]  # without Ray's per-node "node:<ip>" markers
    resources_available: dict[str, float]  # same keys as resources_total; empty for a dead node


@dataclass(frozen=True)
class ActorStatus:
    actor_id: str  # hex
    class_name: str
    name: str  # "" for an unnamed actor
    state: str  # ALIVE, PENDING_CREATION, RESTARTING, DEAD, ...
    node_id: str  # hex; "" while not placed
    pid: int  # 0 while not placed


@dataclass(frozen=True)
class ClusterStatus:
    address: str
    nodes: tuple[NodeStatus, ...]
    actors: tuple[ActorStatus, ...]

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)

    @classmethod
    def from_dict(cls, body: Mapping[str, Any]) -> ClusterStatus:
        return cls(
            address=body["address"],
            nodes=tuple(NodeStatus(**node) for node in body["nodes"]),
            actors=tuple(ActorStatus(**actor) for actor in body["actors"]),
        )

    def node(self, node_id: str) -> NodeStatus | None:
        return next((node for node in self.nodes if node.node_id == node_id), None)


_STATUS_MARK = "SPECSERVE_STATUS "


def status(address: str | None = None, state_dir: Path | None = None) -> ClusterStatus:
    """Nodes and actors of the Ray cluster at ``address`` (default: the local cluster's).

    The driver runs in a subprocess, so this works whether or not the caller is itself connected
    to some Ray cluster, and leaves no Ray state behind in the caller.
    """
    if address is None:
        address = connect_address(state_dir)
        if address is None:
            where = state_dir or default_state_dir()
            raise ClusterNotRunning(
                f"no local cluster is up (state dir {where}); start one with `specserve cluster up`"
            )
    host, _, port = address.rpartition(":")
    if not port.isdigit() or not _port_answers(host, int(port)):
        raise ClusterNotRunning(f"no Ray cluster answers at {address}")
    try:
        done = subprocess.run(
            [sys.executable, "-m", "specserve.cluster.local", "status", address],
            capture_output=True,
            text=True,
            env=_child_env(),
            timeout=STATUS_TIMEOUT_S,
            check=False,
        )
    except subprocess.TimeoutExpired as exc:
        raise ClusterNotRunning(f"the Ray cluster at {address} did not answer within {STATUS_TIMEOUT_S:.0f} s") from exc
    lines = [line for line in done.stdout.splitlines() if line.startswith(_STATUS_MARK)]
    if done.returncode != 0 or not lines:
        tail = " | ".join(done.stderr.strip().splitlines()[-3:])
        raise ClusterNotRunning(f"could not read the status of the Ray cluster at {address}: {tail}")
    return ClusterStatus.from_dict(json.loads(lines[-1][len(_STATUS_MARK) :]))


def _collect_status(address: str) -> ClusterStatus:
    """Runs in the status subprocess: one driver, GCS reads only (no dashboard needed)."""
    import ray
    from ray._private import state as ray_state  # GCS tables; ray.util.state would need the dashboard

    ray.init(address=address, log_to_driver=False, logging_level=logging.WARNING)
    try:
        available = ray_state.available_resources_per_node()
        nodes = []
        for raw in ray.nodes():
            node_id = raw["NodeID"]
            total = _public_resources(raw.get("Resources", {}))
            alive = bool(raw.get("Alive"))
            free = available.get(node_id, {})  # a fully used resource is missing here, not 0
            socket_path = Path(raw.get("RayletSocketName", ""))  # <temp dir>/session_.../sockets/raylet
            nodes.append(
                NodeStatus(
                    node_id=node_id,
                    name=socket_path.parents[2].name if len(socket_path.parents) > 2 else "",
                    ip=raw.get("NodeManagerAddress", ""),
                    alive=alive,
                    is_head="node:__internal_head__" in raw.get("Resources", {}),
                    resources_total=total,
                    resources_available={name: float(free.get(name, 0.0)) for name in total} if alive else {},
                )
            )
        actors = [
            ActorStatus(
                actor_id=actor_id,
                class_name=info["ActorClassName"],
                name=info.get("Name", ""),
                state=info["State"],
                node_id=info["Address"]["NodeID"] if info.get("Pid") else "",
                pid=int(info.get("Pid", 0)),
            )
            for actor_id, info in ray_state.actors().items()
        ]
    finally:
        ray.shutdown()
    nodes.sort(key=lambda node: (not node.is_head, node.name, node.node_id))
    return ClusterStatus(address=address, nodes=tuple(nodes), actors=tuple(actors))


def _public_resources(resources: Mapping[str, float]) -> dict[str, float]:
    return {name: float(amount) for name, amount in resources.items() if not name.startswith("node:")}


# ---------------------------------------------------------------------------------------------
# Formatting

_HIDDEN_RESOURCES = ("memory", "object_store_memory")


def _amount(value: float) -> str:
    return f"{value:g}"


def _table(rows: list[list[str]]) -> list[str]:
    widths = [max(len(row[i]) for row in rows) for i in range(len(rows[0]))]
    return ["  ".join(cell.ljust(width) for cell, width in zip(row, widths, strict=True)).rstrip() for row in rows]


def format_status(cluster_status: ClusterStatus) -> str:
    """A plain-text table: one row per node (resources as available/total), one per actor."""
    nodes = cluster_status.nodes
    names = {name for node in nodes for name in node.resources_total if name not in _HIDDEN_RESOURCES}
    columns = [name for name in ("CPU", "GPU") if name in names] + sorted(names - {"CPU", "GPU"})
    alive = sum(node.alive for node in nodes)
    lines = [f"Ray cluster at {cluster_status.address}: {len(nodes)} nodes ({alive} alive)", ""]
    rows = [["NODE", "ID", "IP", "ALIVE", *columns]]
    for node in nodes:
        cells = [
            f"{_amount(node.resources_available.get(name, 0.0))}/{_amount(node.resources_total[name])}"
            if name in node.resources_total
            else "-"
            for name in columns
        ]
        label = node.name + (" (head)" if node.is_head and node.name != "head" else "")
        rows.append([label or "?", node.node_id[:8], node.ip, "yes" if node.alive else "no", *cells])
    lines += _table(rows)
    lines += ["", f"{len(cluster_status.actors)} actors" + (":" if cluster_status.actors else "")]
    if cluster_status.actors:
        rows = [["ACTOR", "NAME", "STATE", "NODE", "PID"]]
        for actor in cluster_status.actors:
            host = cluster_status.node(actor.node_id)
            where = f"{host.name} ({actor.node_id[:8]})" if host is not None else actor.node_id[:8] or "-"
            rows.append([actor.class_name, actor.name or "-", actor.state, where, str(actor.pid or "-")])
        lines += _table(rows)
    return "\n".join(lines)


def _main(argv: list[str]) -> int:
    """``python -m specserve.cluster.local status ADDRESS``: the status subprocess."""
    if len(argv) != 2 or argv[0] != "status":
        print("usage: python -m specserve.cluster.local status ADDRESS", file=sys.stderr)
        return 2
    print(_STATUS_MARK + json.dumps(_collect_status(argv[1]).to_dict()), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(_main(sys.argv[1:]))
