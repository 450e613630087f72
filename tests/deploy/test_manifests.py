"""The deployment manifests in ``deploy/``, checked without starting anything.

* ``deploy/serve.yaml`` (Ray Serve's config format) loads with specserve's loader, and its ``args``
  are :class:`ServeConfig` one to one; a ServeConfig survives a trip through such a YAML file;
  bad files are refused with :class:`DeployFileError` naming the problem.
* ``deploy/rayservice.yaml`` (KubeRay) embeds a Serve config that Ray's schema and ServeConfig
  accept, and its worker groups provide what :mod:`specserve.cluster.placement` will ask for.
* ``deploy/cluster.yaml`` (``ray up``) passes Ray's own launcher schema and its node types can
  hold ``deploy/serve.yaml`` at its maximum replica count.

The resource arithmetic uses the placement module itself (``ReplicaConfig.spec()``,
``replica_placement``): a replica's target group is STRICT_PACKed, so its summed bundles must fit
on one node; the drafter group (``separate``) on one cheap node.
"""

from __future__ import annotations

import json
import math
import re
from collections import Counter
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import jsonschema
import pytest
import ray
import ray.autoscaler
import yaml
from ray.serve.schema import ServeDeploySchema

from specserve.cluster.placement import ClusterSpec, GroupPlan, replica_placement
from specserve.serve.app import DEPLOYMENTS, MODEL
from specserve.serve.config import ServeConfig
from specserve.serve.deploy_file import IMPORT_PATH, DeployFileError, load_serve_file

ROOT = Path(__file__).resolve().parents[2]
DEPLOY = ROOT / "deploy"
SERVE_YAML = DEPLOY / "serve.yaml"
CLUSTER_YAML = DEPLOY / "cluster.yaml"
RAYSERVICE_YAML = DEPLOY / "rayservice.yaml"

NO_TELEMETRY = {"RAY_USAGE_STATS_ENABLED": "0", "HF_HUB_OFFLINE": "1", "HF_HUB_DISABLE_TELEMETRY": "1"}
LARGE = ClusterSpec().large_resource
CHEAP = ClusterSpec().cheap_resource


# ---------------------------------------------------------------------------------------------
# Helpers


def read_yaml(path: Path) -> Any:
    return yaml.safe_load(path.read_text())


def specserve_app(serve_config: Mapping[str, Any]) -> dict[str, Any]:
    """The one application of a Serve config dict whose import_path is specserve's builder."""
    apps = [app for app in serve_config["applications"] if app["import_path"] == IMPORT_PATH]
    assert len(apps) == 1, f"expected one application with import_path {IMPORT_PATH}, found {len(apps)}"
    return dict(apps[0])


def deployment(app: Mapping[str, Any], name: str) -> dict[str, Any]:
    found = [d for d in app.get("deployments", []) if d["name"] == name]
    assert len(found) == 1, f"deployment {name} appears {len(found)} times"
    return dict(found[0])


def max_model_replicas(app: Mapping[str, Any]) -> int:
    """The most ModelServer replicas Serve will run: autoscaling's max_replicas, else num_replicas."""
    model = deployment(app, MODEL)
    if "autoscaling_config" in model:
        return int(model["autoscaling_config"]["max_replicas"])
    return int(model.get("num_replicas", 1))


def summed(group: GroupPlan) -> Counter[str]:
    total: Counter[str] = Counter()
    for bundle in group.bundles:
        total.update(bundle)
    return total


def groups_per_node(node: Mapping[str, float], group: GroupPlan) -> int:
    """How many copies of a placement group (all its bundles on this one node) a node can hold."""
    return min(math.floor(node.get(name, 0.0) / need + 1e-9) for name, need in summed(group).items() if need > 0)


@dataclass(frozen=True)
class NodeType:
    name: str
    resources: dict[str, float]  # what one node of this type offers Ray (CPU, GPU, custom)
    max_count: int


def check_capacity(config: ServeConfig, max_replicas: int, large: NodeType, cheap: NodeType | None) -> None:
    """The cluster can place ``max_replicas`` replicas of ``config``, and its torch threads fit the CPUs."""
    spec = config.replica().spec()
    plan = replica_placement(spec)
    tp = config.tp_degree

    # A replica's shards are STRICT_PACKed: one large node holds all tp_degree of them.
    assert large.resources.get(LARGE, 0) >= tp, (
        f"{large.name}: {large.resources.get(LARGE, 0)} units of {LARGE!r} per node < tp_degree {tp}"
    )
    per_large = groups_per_node(large.resources, plan.target)
    assert per_large >= 1, (
        f"{large.name} {large.resources} cannot hold one replica's target group {summed(plan.target)}"
    )
    assert max_replicas * tp <= large.max_count * large.resources[LARGE], (
        f"{max_replicas} replicas x tp {tp} > {large.max_count} {large.name} nodes x {large.resources[LARGE]} units"
    )
    assert per_large * large.max_count >= max_replicas, (
        f"{large.name}: {per_large} replica(s) per node x {large.max_count} nodes < max_replicas {max_replicas}"
    )
    colocated_threads = config.threads_per_drafter if config.drafter_placement == "colocated" else 0
    threads = per_large * (tp * config.threads_per_shard + colocated_threads)
    assert threads <= large.resources.get("CPU", 0), (
        f"{large.name}: {per_large} replica(s) run {threads} torch threads on {large.resources.get('CPU')} CPUs"
    )

    if config.drafter_placement == "separate":
        assert cheap is not None, "drafter_placement: separate needs a node type with the cheap resource"
        assert plan.drafter is not None
        per_cheap = groups_per_node(cheap.resources, plan.drafter)
        assert per_cheap * cheap.max_count >= max_replicas, (
            f"{cheap.name}: {per_cheap} drafter(s) per node x {cheap.max_count} nodes < max_replicas {max_replicas}"
        )
        assert per_cheap * config.threads_per_drafter <= cheap.resources.get("CPU", 0), (
            f"{cheap.name}: drafter threads exceed the node's CPUs"
        )


# ---------------------------------------------------------------------------------------------
# deploy/serve.yaml


def test_serve_yaml_loads_with_the_specserve_loader() -> None:
    file = load_serve_file(SERVE_YAML)
    assert file.app_name == specserve_app(read_yaml(SERVE_YAML))["name"]
    assert set(file.deployment_options) == set(DEPLOYMENTS)


def test_serve_yaml_args_are_serve_config_fields_one_to_one() -> None:
    args = specserve_app(read_yaml(SERVE_YAML))["args"]
    fields = set(ServeConfig.model_fields)
    assert not fields - set(args), f"ServeConfig fields missing from deploy/serve.yaml args: {fields - set(args)}"
    assert not set(args) - fields, f"deploy/serve.yaml args that are not ServeConfig fields: {set(args) - fields}"


def test_serve_yaml_args_round_trip_through_serve_config() -> None:
    args = specserve_app(read_yaml(SERVE_YAML))["args"]
    config = ServeConfig.model_validate(args)
    assert ServeConfig.model_validate(config.model_dump()) == config
    assert ServeConfig.model_validate(json.loads(config.model_dump_json())) == config
    assert load_serve_file(SERVE_YAML).config == config


def test_serve_yaml_deployments_are_exactly_the_applications_deployments() -> None:
    names = [d["name"] for d in specserve_app(read_yaml(SERVE_YAML))["deployments"]]
    assert sorted(names) == sorted(DEPLOYMENTS)


def test_serve_yaml_model_server_autoscales_with_min_at_most_max() -> None:
    app = specserve_app(read_yaml(SERVE_YAML))
    autoscaling = deployment(app, MODEL)["autoscaling_config"]
    assert 1 <= autoscaling["min_replicas"] <= autoscaling["max_replicas"]
    assert autoscaling.get("target_ongoing_requests") is not None
    # and Serve reads it the same way
    options = load_serve_file(SERVE_YAML).deployment_options[MODEL]["autoscaling_config"]
    assert options["max_replicas"] == autoscaling["max_replicas"]


@pytest.mark.parametrize("path", [SERVE_YAML, RAYSERVICE_YAML], ids=["serve.yaml", "rayservice.yaml"])
def test_model_server_queue_bound_agrees_with_args(path: Path, tmp_path: Path) -> None:
    """A ``max_ongoing_requests`` override in ``deployments`` equals the args' (the queue the model server expects)."""
    config_path = path if path == SERVE_YAML else write_rayservice_serve_config(tmp_path)
    file = load_serve_file(config_path)
    bound = file.deployment_options[MODEL].get("max_ongoing_requests", file.config.ongoing_requests)
    assert bound == file.config.ongoing_requests


# ---------------------------------------------------------------------------------------------
# YAML <-> ServeConfig


ROUND_TRIP_CONFIGS = [
    ServeConfig(),
    ServeConfig(
        model_name="big",
        target="/srv/models/target",
        draft="ngram",
        dtype="bfloat16",
        device="cuda",
        tp_degree=4,
        drafter_placement="separate",
        overlap=True,
        gamma=7,
        default_max_tokens=300,
        max_num_seqs=2,
        max_ongoing_requests=3,
        max_body_bytes=4096,
        api_key="sk-test",
        verifier_host="0.0.0.0",
        threads_per_shard=3,
        threads_per_drafter=2,
    ),
]


@pytest.mark.parametrize("config", ROUND_TRIP_CONFIGS, ids=["defaults", "everything-set"])
def test_serve_config_round_trips_through_a_serve_yaml_file(config: ServeConfig, tmp_path: Path) -> None:
    autoscaling = {"min_replicas": 2, "max_replicas": 5, "target_ongoing_requests": 1}
    raw = {
        "http_options": {"host": "0.0.0.0", "port": 8123},
        "applications": [
            {
                "name": "llm",
                "route_prefix": "/v1x",
                "import_path": IMPORT_PATH,
                "args": config.model_dump(mode="json"),
                "deployments": [{"name": MODEL, "autoscaling_config": autoscaling}],
            }
        ],
    }
    path = tmp_path / "serve.yaml"
    path.write_text(yaml.safe_dump(raw, sort_keys=False))
    file = load_serve_file(path)
    assert file.config == config
    assert (file.app_name, file.route_prefix, file.host, file.port) == ("llm", "/v1x", "0.0.0.0", 8123)
    assert file.deployment_options == {MODEL: {"autoscaling_config": autoscaling}}


# ---------------------------------------------------------------------------------------------
# Bad files


def serve_yaml_with(**app_changes: Any) -> str:
    raw = read_yaml(SERVE_YAML)
    specserve_app(raw)  # there is one
    raw["applications"][0].update(app_changes)
    return yaml.safe_dump(raw, sort_keys=False)


def args_with(**changes: Any) -> dict[str, Any]:
    return {**specserve_app(read_yaml(SERVE_YAML))["args"], **changes}


BAD_FILES = {
    "unknown-args-field": (lambda: serve_yaml_with(args=args_with(temperature=0.5)), ["args", "temperature"]),
    "wrong-args-type": (lambda: serve_yaml_with(args=args_with(tp_degree="two")), ["args", "tp_degree"]),
    "tp-not-a-power-of-two": (lambda: serve_yaml_with(args=args_with(tp_degree=3)), ["args", "tp_degree", "power"]),
    "wrong-import-path": (lambda: serve_yaml_with(import_path="specserve.serve.app:nope"), [IMPORT_PATH]),
    "unknown-deployment": (
        lambda: serve_yaml_with(deployments=[{"name": "Drafter", "num_replicas": 1}]),
        ["'Drafter'", "does not exist", MODEL],
    ),
    "two-specserve-apps": (
        lambda: yaml.safe_dump(
            {
                "applications": [
                    {"name": "a", "route_prefix": "/a", "import_path": IMPORT_PATH},
                    {"name": "b", "route_prefix": "/b", "import_path": IMPORT_PATH},
                ]
            }
        ),
        ["exactly one", IMPORT_PATH],
    ),
    "invalid-yaml": (lambda: "applications:\n  - name: specserve\n   import_path: [unclosed\n", ["not valid YAML"]),
    "not-a-serve-config": (lambda: "- just\n- a list\n", ["not a valid Serve config"]),
    "empty-file": (lambda: "", ["not a valid Serve config"]),
}


@pytest.mark.parametrize("case", sorted(BAD_FILES))
def test_bad_serve_file_is_refused_with_a_message_naming_the_problem(case: str, tmp_path: Path) -> None:
    make, expected = BAD_FILES[case]
    path = tmp_path / "serve.yaml"
    path.write_text(make())
    with pytest.raises(DeployFileError) as info:
        load_serve_file(path)
    message = str(info.value)
    for part in [str(path), *expected]:
        assert part in message, f"{part!r} not in {message!r}"


def test_missing_serve_file_is_refused_with_a_message_naming_it(tmp_path: Path) -> None:
    path = tmp_path / "nowhere.yaml"
    with pytest.raises(DeployFileError, match=r"cannot read .*nowhere\.yaml"):
        load_serve_file(path)


# ---------------------------------------------------------------------------------------------
# deploy/rayservice.yaml (KubeRay)


def rayservice() -> dict[str, Any]:
    docs = [doc for doc in yaml.safe_load_all(RAYSERVICE_YAML.read_text()) if doc]
    services = [doc for doc in docs if doc.get("kind") == "RayService"]
    assert len(services) == 1, f"expected one RayService in {RAYSERVICE_YAML}, found {len(services)}"
    return dict(services[0])


def rayservice_serve_config() -> dict[str, Any]:
    text = rayservice()["spec"]["serveConfigV2"]
    assert isinstance(text, str), "serveConfigV2 is a YAML string, not a mapping"
    return dict(yaml.safe_load(text))


def write_rayservice_serve_config(tmp_path: Path) -> Path:
    path = tmp_path / "serveConfigV2.yaml"
    path.write_text(rayservice()["spec"]["serveConfigV2"])
    return path


def worker_group(name: str) -> dict[str, Any]:
    groups = [g for g in rayservice()["spec"]["rayClusterConfig"]["workerGroupSpecs"] if g["groupName"] == name]
    assert len(groups) == 1, f"worker group {name!r} appears {len(groups)} times"
    return dict(groups[0])


def kuberay_custom_resources(start_params: Mapping[str, Any]) -> dict[str, float]:
    """``rayStartParams.resources``: KubeRay's JSON inside a quoted string (``'"{\\"large\\": 2}"'``) or plain JSON."""
    value = start_params.get("resources")
    if value is None:
        return {}
    parsed = json.loads(value)
    if isinstance(parsed, str):  # the quoted form: a JSON string holding the JSON object
        parsed = json.loads(parsed)
    assert isinstance(parsed, dict), f"rayStartParams.resources is not a JSON object: {value!r}"
    return {str(k): float(v) for k, v in parsed.items()}


def k8s_quantity(value: str | int | float) -> float:
    text = str(value)
    return float(text[:-1]) / 1000 if text.endswith("m") else float(text)


def pod_resources(group: Mapping[str, Any]) -> dict[str, float]:
    """What Ray on a pod of this group offers: KubeRay takes CPU/GPU from rayStartParams, else the container limits."""
    params = group.get("rayStartParams", {})
    container = group["template"]["spec"]["containers"][0]
    limits = {**container.get("resources", {}).get("requests", {}), **container.get("resources", {}).get("limits", {})}
    resources = kuberay_custom_resources(params)
    cpu = params.get("num-cpus", limits.get("cpu", 0))
    resources["CPU"] = k8s_quantity(cpu)
    gpu = params.get("num-gpus", limits.get("nvidia.com/gpu", 0))
    if k8s_quantity(gpu):
        resources["GPU"] = k8s_quantity(gpu)
    return resources


def all_groups() -> list[dict[str, Any]]:
    cluster = rayservice()["spec"]["rayClusterConfig"]
    return [cluster["headGroupSpec"], *cluster["workerGroupSpecs"]]


def test_rayservice_is_a_ray_io_v1_rayservice() -> None:
    service = rayservice()
    assert service["apiVersion"] == "ray.io/v1"
    assert service["metadata"]["name"]
    assert service["spec"]["rayClusterConfig"]["enableInTreeAutoscaling"] is True


def test_rayservice_ray_version_is_this_ray() -> None:
    """The manifest names the Ray this project is tested with (the image must carry the same)."""
    assert rayservice()["spec"]["rayClusterConfig"]["rayVersion"] == ray.__version__


def test_rayservice_serve_config_passes_rays_schema_and_serve_config(tmp_path: Path) -> None:
    raw = rayservice_serve_config()
    schema = ServeDeploySchema.model_validate(raw)
    assert [app.import_path for app in schema.applications].count(IMPORT_PATH) == 1
    file = load_serve_file(write_rayservice_serve_config(tmp_path))
    args = specserve_app(raw)["args"]
    assert set(args) == set(ServeConfig.model_fields), "serveConfigV2 args are ServeConfig one to one"
    assert file.config == ServeConfig.model_validate(args)
    assert sorted(d["name"] for d in specserve_app(raw)["deployments"]) == sorted(DEPLOYMENTS)


def test_rayservice_runs_drafters_separately_and_proxy_on_the_pod_network() -> None:
    raw = rayservice_serve_config()
    config = ServeConfig.model_validate(specserve_app(raw)["args"])
    assert config.drafter_placement == "separate"
    assert raw["http_options"]["host"] == "0.0.0.0", "KubeRay's serve Service must reach the proxy"


@pytest.mark.parametrize("which", ["serve.yaml", "rayservice.yaml"])
def test_separate_drafters_imply_a_verifier_reachable_from_other_nodes(which: str) -> None:
    raw = read_yaml(SERVE_YAML) if which == "serve.yaml" else rayservice_serve_config()
    config = ServeConfig.model_validate(specserve_app(raw)["args"])
    if config.drafter_placement == "separate":
        assert config.verifier_host == "0.0.0.0"


def test_rayservice_model_paths_are_mounted_on_every_pod() -> None:
    config = ServeConfig.model_validate(specserve_app(rayservice_serve_config())["args"])
    paths = [config.target] + ([config.draft] if config.draft not in ("ngram", "none") else [])
    for group in all_groups():
        mounts = [m["mountPath"] for c in group["template"]["spec"]["containers"] for m in c.get("volumeMounts", [])]
        for path in paths:
            assert Path(path).is_absolute()
            assert any(Path(path).is_relative_to(mount) for mount in mounts), (
                f"{path} is not under a volume mounted in group {group.get('groupName', 'head')}: {mounts}"
            )


def test_rayservice_start_params_are_strings() -> None:
    """KubeRay's rayStartParams is a map of strings (a bare number or boolean is refused by the CRD)."""
    for group in all_groups():
        for key, value in group.get("rayStartParams", {}).items():
            assert isinstance(value, str), f"rayStartParams.{key} = {value!r} is not a string"


def test_rayservice_head_hosts_no_shard_or_drafter() -> None:
    head = rayservice()["spec"]["rayClusterConfig"]["headGroupSpec"]
    assert head["rayStartParams"]["num-cpus"] == "0"
    resources = kuberay_custom_resources(head["rayStartParams"])
    assert LARGE not in resources and CHEAP not in resources


def test_rayservice_worker_groups_declare_the_placement_resources() -> None:
    """The large group offers ClusterSpec's large resource, the cheap group its cheap one (names from ClusterSpec)."""
    large = kuberay_custom_resources(worker_group("large")["rayStartParams"])
    cheap = kuberay_custom_resources(worker_group("cheap")["rayStartParams"])
    assert large.get(LARGE, 0) >= 1 and CHEAP not in large
    assert cheap.get(CHEAP, 0) >= 1 and LARGE not in cheap
    for name in ("large", "cheap"):
        group = worker_group(name)
        assert 0 <= group["minReplicas"] <= group.get("replicas", group["minReplicas"]) <= group["maxReplicas"]


def test_rayservice_cluster_holds_the_maximum_replica_count() -> None:
    """Units of large per pod >= tp_degree, and max_replicas x tp_degree fit in maxReplicas large pods (cheap alike)."""
    raw = rayservice_serve_config()
    app = specserve_app(raw)
    config = ServeConfig.model_validate(app["args"])
    large, cheap = worker_group("large"), worker_group("cheap")
    check_capacity(
        config,
        max_model_replicas(app),
        NodeType("large", pod_resources(large), large["maxReplicas"]),
        NodeType("cheap", pod_resources(cheap), cheap["maxReplicas"]),
    )


def test_rayservice_every_container_disables_telemetry() -> None:
    for group in all_groups():
        for container in group["template"]["spec"]["containers"]:
            env = {e["name"]: e.get("value") for e in container.get("env", [])}
            for name, value in NO_TELEMETRY.items():
                assert env.get(name) == value, f"{container['name']} in {group.get('groupName', 'head')}: {name}"


# ---------------------------------------------------------------------------------------------
# deploy/cluster.yaml (ray up)


def cluster() -> dict[str, Any]:
    return dict(read_yaml(CLUSTER_YAML))


def node_types_offering(resource: str) -> list[NodeType]:
    raw = cluster()
    return [
        NodeType(name, {k: float(v) for k, v in spec["resources"].items()}, spec["max_workers"])
        for name, spec in raw["available_node_types"].items()
        if name != raw["head_node_type"] and spec["resources"].get(resource, 0) > 0
    ]


def test_cluster_yaml_passes_rays_launcher_schema() -> None:
    schema = json.loads((Path(ray.autoscaler.__file__).parent / "ray-schema.json").read_text())
    jsonschema.validate(cluster(), schema)


def test_cluster_yaml_head_type_exists_and_hosts_no_shard_or_drafter() -> None:
    raw = cluster()
    assert raw["head_node_type"] in raw["available_node_types"]
    head = raw["available_node_types"][raw["head_node_type"]]["resources"]
    assert LARGE not in head and CHEAP not in head


def test_cluster_yaml_has_a_large_type_and_a_separate_cheap_type() -> None:
    """Node types for ClusterSpec's large and cheap resources (names from ClusterSpec), each on a different type."""
    large, cheap = node_types_offering(LARGE), node_types_offering(CHEAP)
    assert len(large) == 1 and len(cheap) == 1
    assert large[0].name != cheap[0].name


def test_cluster_yaml_worker_counts_are_reachable() -> None:
    """min <= max per type, and the global max_workers lets every type reach its own max."""
    raw = cluster()
    workers = {n: s for n, s in raw["available_node_types"].items() if n != raw["head_node_type"]}
    for name, spec in workers.items():
        assert 0 <= spec.get("min_workers", 0) <= spec["max_workers"], name
    assert raw["max_workers"] >= sum(spec["max_workers"] for spec in workers.values())


@pytest.mark.parametrize("placement", ["as-written", "separate"])
def test_cluster_yaml_holds_serve_yaml_at_its_maximum_replica_count(placement: str) -> None:
    """deploy/serve.yaml's max_replicas x tp_degree fit the large type (and, with separate drafters, the cheap type)."""
    app = specserve_app(read_yaml(SERVE_YAML))
    config = ServeConfig.model_validate(app["args"])
    if placement == "separate":
        config = config.model_copy(update={"drafter_placement": "separate", "verifier_host": "0.0.0.0"})
    check_capacity(config, max_model_replicas(app), node_types_offering(LARGE)[0], node_types_offering(CHEAP)[0])


def start_commands() -> list[str]:
    raw = cluster()
    return [c for c in raw["head_start_ray_commands"] + raw["worker_start_ray_commands"] if "ray start" in c]


def test_cluster_yaml_every_ray_start_disables_telemetry() -> None:
    commands = start_commands()
    assert len(commands) == 2, "one ray start for the head, one for the workers"
    for command in commands:
        for name, value in NO_TELEMETRY.items():
            assignment = f"{name}={value}"
            assert assignment in command, f"{assignment} missing from {command!r}"
            assert command.index(assignment) < command.index("ray start"), f"{assignment} is set after ray start"


def test_cluster_yaml_setup_installs_pinned_torch_before_the_project() -> None:
    """torch is pinned as the Makefile pins it and installed before the project (and Ray pinned to this Ray)."""
    raw = cluster()
    makefile = (ROOT / "Makefile").read_text()
    match = re.search(r"^TORCH_SPEC \?= (\S+)$", makefile, re.MULTILINE)
    assert match, "Makefile has no TORCH_SPEC"
    torch_spec = match.group(1)
    commands: list[str] = raw["setup_commands"]
    project_dirs = [remote for remote, local in raw["file_mounts"].items() if local in (".", "./")]
    assert project_dirs, "the repository is not synced to the nodes (file_mounts: <remote>: .)"
    torch_at = next(i for i, c in enumerate(commands) if "pip install" in c and torch_spec in c)
    project_at = next(i for i, c in enumerate(commands) if "pip install" in c and project_dirs[0] in c)
    assert torch_at < project_at
    assert any(f"ray[serve]=={ray.__version__}" in c for c in commands), "nodes must run this Ray version"
