"""The status of a Ray cluster: its nodes, their resources and its actors, read from the GCS and shown as a table.

:func:`status` runs a short-lived driver in a subprocess (``python -m specserve.cluster.cluster_status status
ADDRESS``), so the caller's own ``ray.init`` state is untouched, and returns a :class:`ClusterStatus`; the address
defaults to the local cluster's (from its state file), and :class:`~specserve.cluster.processes.ClusterNotRunning`
says that none is up or nothing answers there. The driver reads Ray's GCS tables directly:
``ray.util.state.list_actors`` would need the dashboard's HTTP API server, which the local cluster does not start.
:func:`format_status` renders a status as plain text (one row per node, resources as available/total; one per
actor). Does not: start, stop or change anything on a cluster (:mod:`specserve.cluster.local`), or stay connected
to it.
"""

from __future__ import annotations

import json
import logging
import subprocess
import sys
from collections.abc import Mapping
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

from specserve.cluster.processes import ClusterNotRunning, child_env, connect_address, default_state_dir, port_answers

STATUS_TIMEOUT_S = 60.0


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
    if not port.isdigit() or not port_answers(host, int(port)):
        raise ClusterNotRunning(f"no Ray cluster answers at {address}")
    try:
        done = subprocess.run(
            [sys.executable, "-m", "specserve.cluster.cluster_status", "status", address],
            capture_output=True,
            text=True,
            env=child_env(),
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
    """``python -m specserve.cluster.cluster_status status ADDRESS``: the status subprocess."""
    if len(argv) != 2 or argv[0] != "status":
        print("usage: python -m specserve.cluster.cluster_status status ADDRESS", file=sys.stderr)
        return 2
    print(_STATUS_MARK + json.dumps(_collect_status(argv[1]).to_dict()), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(_main(sys.argv[1:]))
