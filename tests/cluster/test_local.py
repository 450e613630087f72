"""The local multi-node cluster: spec validation, the start command and the status table without Ray;
one end-to-end ``up`` / ``status`` / actor placement / ``down`` that must leave another Ray instance alive;
the CLI's one-line errors when no cluster is up.
"""

from __future__ import annotations

import json
import os
import random
import shutil
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import pytest

from specserve.cli import main
from specserve.cluster import cluster_status, local, processes
from specserve.cluster.cluster_status import ActorStatus, ClusterStatus, NodeStatus
from specserve.cluster.local import ClusterAlreadyRunning, LocalClusterSpec
from specserve.cluster.placement import ClusterSpec, InvalidClusterSpec
from specserve.cluster.processes import ClusterNotRunning, LocalCluster, NodeProcess


@pytest.fixture
def state_dir(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    directory = tmp_path / "state"
    monkeypatch.setenv(processes.STATE_DIR_ENV, str(directory))
    return directory


def free_port_pair() -> int:
    """A port P with P and P + 1 both free (the GCS and the Ray-client server), below the kernel's ephemeral range and
    above Ray's worker ports (10002-19999 by default): a port the kernel or another Ray hands out at random (to a
    worker's gRPC server of the test session's own cluster) could otherwise be listening on P + 1 after ``down``."""
    low, high = 20000, min(32000, ephemeral_ports()[0]) - 2
    for port in random.Random().sample(range(low, high), 50):
        if processes.port_free(port) and processes.port_free(port + 1):
            return port
    raise RuntimeError("no free port pair found")


def ephemeral_ports() -> tuple[int, int]:
    """The kernel's range of ports it binds at random (Linux; the usual default elsewhere)."""
    try:
        low, high = Path("/proc/sys/net/ipv4/ip_local_port_range").read_text().split()
        return int(low), int(high)
    except (OSError, ValueError):
        return 32768, 60999


# ---------------------------------------------------------------------------------------------
# Without Ray


def test_spec_defaults_match_the_placement_spec(state_dir: Path) -> None:
    spec = LocalClusterSpec()
    assert (spec.workers, spec.large, spec.cheap, spec.head_cpus, spec.worker_cpus) == (2, 4, 1, 4, 1)
    assert (spec.large_resource, spec.cheap_resource) == (ClusterSpec().large_resource, ClusterSpec().cheap_resource)
    assert spec.port == 6390 and spec.client_port == 6391
    assert spec.state_dir == state_dir  # SPECSERVE_CLUSTER_DIR
    assert spec.node_names() == ["head", "worker1", "worker2"]


def test_state_dir_defaults_to_home(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv(processes.STATE_DIR_ENV, raising=False)
    assert processes.default_state_dir() == Path.home() / ".specserve" / "cluster"


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        ({"workers": -1}, "workers must be between 0 and 8"),
        ({"workers": 9}, "workers must be between 0 and 8"),
        ({"large": 0}, "large must be >= 1"),
        ({"cheap": 0}, "cheap must be >= 1"),
        ({"cheap_resource": "large"}, "two different non-empty names"),
        ({"large_resource": ""}, "two different non-empty names"),
        ({"large_resource": "CPU"}, "must not shadow"),
        ({"head_cpus": 0}, "head_cpus and worker_cpus must be >= 1"),
        ({"worker_cpus": 0}, "head_cpus and worker_cpus must be >= 1"),
        ({"port": 80}, "port must be between 1024 and 65534"),
        ({"port": 65535}, r"port \+ 1 is used too"),
        ({"object_store_mb": 10}, "object_store_mb must be >="),
    ],
)
def test_bad_specs_say_what_to_fix(kwargs: dict[str, object], message: str, state_dir: Path) -> None:
    with pytest.raises(InvalidClusterSpec, match=message):
        LocalClusterSpec(**kwargs)  # type: ignore[arg-type]


def test_start_commands(state_dir: Path) -> None:
    spec = LocalClusterSpec(workers=1, large=2, cheap=3, port=7000)
    head = local._ray_start_command(spec, "head")
    worker = local._ray_start_command(spec, "worker1")

    def value(command: list[str], flag: str) -> str:
        return command[command.index(flag) + 1]

    for command in (head, worker):
        assert "--block" in command and "--disable-usage-stats" in command
        assert value(command, "--node-ip-address") == "127.0.0.1"
    assert "--head" in head and "--head" not in worker
    assert value(head, "--port") == "7000" and value(head, "--ray-client-server-port") == "7001"
    assert value(head, "--include-dashboard") == "false"
    assert json.loads(value(head, "--resources")) == {"large": 2} and value(head, "--num-cpus") == "4"
    assert value(worker, "--address") == "127.0.0.1:7000"
    assert json.loads(value(worker, "--resources")) == {"cheap": 3} and value(worker, "--num-cpus") == "1"
    assert value(head, "--temp-dir") != value(worker, "--temp-dir")
    assert value(worker, "--temp-dir").startswith(str(local.ray_temp_root(7000)))


def test_format_status_table() -> None:
    status = ClusterStatus(
        address="10.0.0.1:6390",
        nodes=(
            NodeStatus(
                "a" * 56, "head", "10.0.0.1", True, True, {"CPU": 4.0, "large": 4.0}, {"CPU": 3.0, "large": 2.0}
            ),
            NodeStatus("b" * 56, "worker1", "10.0.0.1", False, False, {"CPU": 1.0, "cheap": 1.0}, {}),
        ),
        actors=(ActorStatus("c" * 32, "DrafterActor", "", "ALIVE", "b" * 56, 4242),),
    )
    text = cluster_status.format_status(status)
    assert "2 nodes (1 alive)" in text
    header, head_row, worker_row = text.splitlines()[2:5]
    assert header.split() == ["NODE", "ID", "IP", "ALIVE", "CPU", "cheap", "large"]
    assert head_row.split() == ["head", "aaaaaaaa", "10.0.0.1", "yes", "3/4", "-", "2/4"]
    assert worker_row.split() == ["worker1", "bbbbbbbb", "10.0.0.1", "no", "0/1", "0/1", "-"]
    assert "DrafterActor  -     ALIVE  worker1 (bbbbbbbb)  4242" in text
    assert ClusterStatus.from_dict(json.loads(json.dumps(status.to_dict()))) == status


def test_stale_state_file_is_not_a_running_cluster(state_dir: Path) -> None:
    dead = subprocess.Popen([sys.executable, "-c", "pass"])
    dead.wait()
    node = NodeProcess("head", dead.pid, 1, str(local.node_temp_dir(7002, "head")), str(state_dir / "head.log"))
    LocalCluster("127.0.0.1:7002", 7002, (node,), {}, state_dir / processes.STATE_FILE).save()
    assert processes.connect_address() is None
    with pytest.raises(ClusterNotRunning, match="start one with `specserve cluster up`"):
        cluster_status.status()
    report = local.down()  # cleans up the state of a cluster that died by itself
    assert not report.was_running and not (state_dir / processes.STATE_FILE).exists()


def test_cli_without_a_cluster_exits_2(state_dir: Path, capsys: pytest.CaptureFixture[str]) -> None:
    for command in ("status", "down"):
        assert main(["cluster", command]) == 2
        out, err = capsys.readouterr()
        assert out == "" and err.startswith("error: no local cluster is up") and err.count("\n") == 1
    assert main(["cluster", "up", "--workers", "9"]) == 2
    assert capsys.readouterr().err.startswith("error: workers must be between 0 and 8")


# ---------------------------------------------------------------------------------------------
# End to end

# Ray's per-node agents, as processes.describe names them
AGENT_TITLES = ("(ray::DashboardAgent)", "(ray::RuntimeEnvAgent)")

# Joins the way `generate --distributed` does (specserve.cluster.connect).
PROBE = """
import ray
from specserve.cluster.processes import connect_address
ray.init(address=connect_address(), log_to_driver=False)

@ray.remote(num_cpus=1, resources={"cheap": 1})
class Probe:
    def node(self):
        return ray.get_runtime_context().get_node_id()

probe = Probe.options(name="probe", namespace="specserve-test", lifetime="detached").remote()
print("NODE", ray.get(probe.node.remote(), timeout=60))
"""


@pytest.mark.slow
@pytest.mark.timeout(180)
def test_up_status_place_down_leaves_other_ray_alive(state_dir: Path, ray_cluster: Any) -> None:
    import ray  # the "other" Ray instance: the test session's shared cluster

    @ray.remote(num_cpus=0)
    def ping() -> int:
        return os.getpid()

    port = free_port_pair()
    spec = LocalClusterSpec(workers=2, port=port)
    started = time.monotonic()
    try:
        ray.get(ping.remote(), timeout=60)
        cluster = local.up(spec)
        up_s = time.monotonic() - started
        assert processes.connect_address() == cluster.address and cluster.address.endswith(f":{port}")
        with pytest.raises(ClusterAlreadyRunning, match="specserve cluster down"):
            local.up(spec)

        status = cluster_status.status()
        assert [node.name for node in status.nodes] == ["head", "worker1", "worker2"]
        assert all(node.alive for node in status.nodes)
        head, *workers = status.nodes
        assert head.is_head and head.resources_total["large"] == 4 and head.resources_total["CPU"] == 4
        assert "cheap" not in head.resources_total
        for worker in workers:
            assert worker.resources_total["cheap"] == 1 and "large" not in worker.resources_total

        probe = subprocess.run(
            [sys.executable, "-c", PROBE],
            capture_output=True,
            text=True,
            timeout=90,
            check=False,
        )
        assert probe.returncode == 0, probe.stderr[-2000:]
        probe_node = next(line.split()[1] for line in probe.stdout.splitlines() if line.startswith("NODE "))
        status = cluster_status.status()
        (actor,) = [a for a in status.actors if a.class_name == "Probe"]
        assert actor.state == "ALIVE" and actor.node_id == probe_node and actor.pid > 0
        placed_on = status.node(probe_node)
        assert placed_on is not None and placed_on.name in ("worker1", "worker2")
        assert placed_on.resources_available["cheap"] == 0
        assert f"{placed_on.name} ({probe_node[:8]})" in cluster_status.format_status(status)

        stopping = time.monotonic()
        report = local.down()
        down_s = time.monotonic() - stopping
        assert report.was_running and report.nodes == 3
        # Every node leader, GCS, raylet and worker went on SIGTERM. Only one of Ray's agents may have needed SIGKILL:
        # its SIGTERM handler (os._exit, it has nothing to save) runs on its event loop, which a loaded machine can
        # keep from running for longer than the grace (seen: at 90 % load of both cores, 2 agents of 9 processes).
        assert all(title.endswith(AGENT_TITLES) for title in report.killed), report.killed
        # Our cluster is gone: no state, no process of its sessions or naming its temp dirs, GCS port closed.
        assert processes.connect_address() is None and not (state_dir / processes.STATE_FILE).exists()
        assert processes._session_members(list(cluster.nodes)) == []
        assert processes._ray_processes_naming([str(local.ray_temp_root(port))]) == []
        assert not processes.port_answers("127.0.0.1", port, timeout_s=1.0)
        assert not processes.port_answers("127.0.0.1", port + 1, timeout_s=1.0)
        # ... and the other Ray instance is still alive.
        assert ray.get(ping.remote(), timeout=30) > 0
        assert all(node["Alive"] for node in ray.nodes())
        print(f"\nup {up_s:.1f} s, down {down_s:.1f} s")
    finally:
        if processes.LocalCluster.load(state_dir) is not None:
            local.down(state_dir)
        shutil.rmtree(local.ray_temp_root(port), ignore_errors=True)  # Ray's session logs of this run
