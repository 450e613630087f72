"""The local cluster's process toolkit: finding, signalling and stopping its Ray processes, its state file, ports.

Linux only (it reads ``/proc``). A node is a ``ray start --block`` process leading a session of its own
(:class:`NodeProcess`: its pid, which is the session id of every Ray process of that node, and its start time,
which tells it from a later process that reused the pid). :func:`stop_nodes` stops exactly such nodes: SIGTERM to
their leaders, SIGKILL to whatever is still in their sessions or still names a node's temp dir, then a check that
none is left (:class:`ClusterStopError` otherwise); it never runs ``ray stop``. The state file
(``<state dir>/cluster.json``, :class:`LocalCluster`) records the nodes; :func:`locked` serialises ``up`` and ``down``
on one state dir, and :func:`connect_address` is the recorded cluster's address while its head still runs. Also:
whether a port is free or answers, the environment of the processes the cluster starts (:func:`child_env`), and
:class:`ClusterNotRunning`, what a caller is told when no cluster is up.
Does not: decide what to start or when (the spec, the ``ray start`` command lines, ``up`` and ``down``:
:mod:`specserve.cluster.local`), or read what runs on a cluster (:mod:`specserve.cluster.cluster_status`).
"""

from __future__ import annotations

import contextlib
import fcntl
import importlib.util
import json
import logging
import os
import signal
import socket
import sys
import time
from collections.abc import Iterator
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

from specserve.core.errors import UserError

logger = logging.getLogger(__name__)

STATE_DIR_ENV = "SPECSERVE_CLUSTER_DIR"
STATE_FILE = "cluster.json"
STATE_FORMAT = 1
STOP_GRACE_S = 20.0  # SIGTERM -> SIGKILL
LEADERS_FIRST_S = 3.0  # SIGTERM to the node leaders, then (after this) to every member of their sessions still up
KILL_WAIT_S = 5.0


class ClusterNotRunning(UserError):
    """No local cluster is up (or nothing answers at the given address)."""


class ClusterStopError(RuntimeError):
    """Processes of the cluster survived SIGKILL (should not happen; the message lists them)."""


def default_state_dir() -> Path:
    """``$SPECSERVE_CLUSTER_DIR`` if set, else ``~/.specserve/cluster``."""
    override = os.environ.get(STATE_DIR_ENV)
    return Path(override).expanduser() if override else Path.home() / ".specserve" / "cluster"


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
class ProcInfo:
    pid: int
    state: str
    session: int
    start_ticks: int


def proc_info(pid: int) -> ProcInfo | None:
    try:
        raw = Path(f"/proc/{pid}/stat").read_text()
    except (FileNotFoundError, ProcessLookupError, PermissionError):
        return None
    fields = raw[raw.rindex(")") + 2 :].split()  # comm may contain spaces and parentheses
    return ProcInfo(pid=pid, state=fields[0], session=int(fields[3]), start_ticks=int(fields[19]))


def _all_procs() -> list[ProcInfo]:
    infos = []
    for entry in os.listdir("/proc"):
        if entry.isdigit() and (info := proc_info(int(entry))) is not None:
            infos.append(info)
    return infos


def is_live(info: ProcInfo | None) -> bool:
    return info is not None and info.state not in ("Z", "X")


def _leader_is_ours(node: NodeProcess) -> bool:
    info = proc_info(node.pid)
    return is_live(info) and info is not None and info.start_ticks == node.start_ticks


def _session_members(nodes: list[NodeProcess]) -> list[int]:
    """Live pids in the sessions our node leaders opened.

    A session id is the pid of its leader, and Linux does not reuse a pid while a session with
    that id has members, so members are ours unless the pid now belongs to a different process.
    """
    sessions = set()
    for node in nodes:
        info = proc_info(node.pid)
        if info is None or not is_live(info) or info.start_ticks == node.start_ticks:
            sessions.add(node.pid)
    return [info.pid for info in _all_procs() if info.session in sessions and is_live(info)]


def reap(pid: int) -> None:
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
            reap(node.pid)
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
        if is_live(info) and is_ray and any(path in arg for arg in argv for path in paths):
            found.append(info.pid)
    return found


def describe(pid: int) -> str:
    """``"PID (command line)"``, the command line cut to 80 characters (a Ray process's is its title, e.g.
    ``ray::DashboardAgent``); ``"PID (?)"`` once it is gone."""
    try:
        cmdline = Path(f"/proc/{pid}/cmdline").read_bytes().replace(b"\0", b" ").decode(errors="replace")
    except OSError:
        cmdline = "?"
    return f"{pid} ({cmdline[:80].strip()})"


def stop_nodes(nodes: list[NodeProcess]) -> list[str]:
    """Stop exactly these nodes and verify they are gone; returns what needed SIGKILL (:func:`describe`). Idempotent.

    SIGTERM goes to the node leaders first; after :data:`LEADERS_FIRST_S`, to every process of theirs still up (their
    sessions' members, and Ray processes naming their temp dirs: an agent notices its raylet is gone by polling it,
    which under load, or while it still starts, can take longer than the grace). SIGKILL only to what outlives
    :data:`STOP_GRACE_S`: under heavy load that can be one of Ray's agents (DashboardAgent, RuntimeEnvAgent), whose
    SIGTERM handler runs on its event loop (and then only calls ``os._exit``: an agent has nothing to shut down
    gracefully), so a busy or blocked loop delays it past any grace."""
    temp_dirs = [node.temp_dir for node in nodes]
    deadline = time.monotonic() + STOP_GRACE_S
    _signal([node.pid for node in nodes if _leader_is_ours(node)], signal.SIGTERM)
    left = _left_over(nodes, temp_dirs, time.monotonic() + LEADERS_FIRST_S)
    if left:
        _signal(left, signal.SIGTERM)
        left = _left_over(nodes, temp_dirs, deadline)
    killed = [describe(pid) for pid in left]
    if left:
        logger.warning("SIGKILL to processes still up %.0f s after SIGTERM: %s", STOP_GRACE_S, ", ".join(killed))
        _signal(left, signal.SIGKILL)
        time.sleep(0.2)
        survivors = _wait_gone(nodes, KILL_WAIT_S) + _ray_processes_naming(temp_dirs)
        if survivors:
            raise ClusterStopError(f"processes of the local cluster survived SIGKILL: {sorted(set(survivors))}")
    return killed


def _left_over(nodes: list[NodeProcess], temp_dirs: list[str], deadline: float) -> list[int]:
    """Until ``deadline``, waits for the nodes' processes to go (their sessions' members, and Ray processes naming
    their temp dirs, which may have left the session); those still up then."""
    while True:
        left = _wait_gone(nodes, max(0.0, deadline - time.monotonic()))
        left += [pid for pid in _ray_processes_naming(temp_dirs) if pid not in left]
        if not left or time.monotonic() > deadline:
            return left
        time.sleep(0.2)


def port_answers(host: str, port: int, timeout_s: float = 2.0) -> bool:
    try:
        with socket.create_connection((host, port), timeout=timeout_s):
            return True
    except OSError:
        return False


def port_free(port: int) -> bool:
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
def locked(state_dir: Path) -> Iterator[None]:
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
# Platform and environment


def require_linux() -> None:
    if not sys.platform.startswith("linux"):
        raise UserError(f"the local cluster needs Linux (it tracks Ray processes through /proc), not {sys.platform}")


def child_env() -> dict[str, str]:
    """Environment of our `ray start` and status processes: never a driver's address from the caller."""
    env = {k: v for k, v in os.environ.items() if k != "RAY_ADDRESS"}
    env["RAY_USAGE_STATS_ENABLED"] = "0"
    env["RAY_GRACEFUL_SHUTDOWN_DRAIN_TIMEOUT_S"] = "0"  # SIGTERM stops the node at once (default: drain up to 30 s)
    env["RAY_AUTH_MODE"] = "disabled"  # the same on every node, whatever ~/.ray holds (cluster/local.py's docstring)
    return env
