"""One replica configuration: every setting reachable from the command line, the Serve YAML and Python alike.

:class:`ReplicaConfig` is the source; for each of its fields this sets a non-default value through
a ``specserve generate`` flag, through the key of ``deploy/serve.yaml``'s ``args`` (loaded as
``specserve serve --config`` does) and as a Python keyword, and checks all three arrive. A field
added to the config without a sample here fails :func:`test_every_setting_has_a_sample`. Also
the drift the one configuration fixed: drafter directories made absolute, the n-gram and timeout
settings in the Serve config, the draft description, limits from one constant. Starts nothing.
"""

from __future__ import annotations

import ast
import importlib.util
import re
from pathlib import Path
from typing import Any

import pytest
import yaml

from specserve import cli, defaults
from specserve.cluster.placement import InvalidClusterSpec
from specserve.cluster.replica_config import (
    DISTRIBUTED_SETTINGS,
    EDGE_DEFAULTS,
    MODEL_SETTINGS,
    InvalidSetting,
    ReplicaConfig,
    resolve_model_path,
)
from specserve.core.draft.schedule import MAX_GAMMA
from specserve.core.kv.pool import DEFAULT_MEMORY_FRACTION
from specserve.serve.config import SERVE_MAX_NUM_SEQS, ServeConfig
from specserve.serve.deploy_file import DeployFileError, load_serve_file

ROOT = Path(__file__).resolve().parents[2]
SERVE_YAML = ROOT / "deploy" / "serve.yaml"
TARGET = "/srv/models/target"  # absolute: stays as written

# field -> (a valid value other than the default, the other settings that value needs)
SAMPLES: dict[str, tuple[Any, dict[str, Any]]] = {
    "target": ("/srv/other/target", {}),
    "draft": ("medusa:/srv/heads", {}),
    "dtype": ("bfloat16", {}),
    "device": ("cuda", {}),
    "static_shapes": ("on", {}),
    "buckets": ("1,2,4,8", {}),
    "row_buckets": ("1,8,64", {}),
    "no_cuda_graphs": (True, {}),
    "compile": (True, {}),
    "max_ngram": (5, {}),
    "min_ngram": (2, {}),
    "suffix_store": ("cluster", {}),
    "tp_degree": (4, {}),
    "drafter_placement": ("separate", {}),
    "pool_ratio": (4, {}),
    "pool_min_members": (2, {}),
    "pool_max_members": (3, {}),
    "pool_upscale_delay_s": (0.5, {}),
    "pool_downscale_delay_s": (5.0, {}),
    "overlap": (True, {}),
    "threads_per_shard": (3, {}),
    "threads_per_drafter": (2, {}),
    "verifier_host": ("0.0.0.0", {}),
    "collective_timeout_s": (6.5, {}),
    "ready_timeout_s": (30.0, {}),
    "stall_timeout_s": (2.5, {}),
    "large_resource": ("a100", {}),
    "cheap_resource": ("t4", {}),
    "cpus_per_shard": (2.0, {}),
    "cpus_per_drafter": (0.5, {}),
    "gpus_per_drafter": (0.5, {"device": "cuda"}),
    "max_num_seqs": (4, {}),
    "max_batch_tokens": (64, {}),
    "max_seq_len": (512, {}),
    "kv_pool_tokens": (4096, {}),
    "kv_cache_memory": (0.25, {}),
    "no_prefix_cache": (True, {}),
    "batch_wait_ms": (50.0, {}),
    "max_queue": (2, {}),
}


def generate_args(settings: dict[str, Any]) -> list[str]:
    argv = ["generate", "--prompt", "x"]
    for name, value in settings.items():
        flag = ReplicaConfig.flag(name)
        if isinstance(value, bool):
            argv += [flag] if value else []
        else:
            argv += [flag, str(value)]
    return argv


def from_cli(settings: dict[str, Any]) -> ReplicaConfig:
    args = cli.build_parser(["generate"]).parse_args(generate_args(settings))
    return ReplicaConfig.from_args(args)


def from_serve_yaml(settings: dict[str, Any], tmp_path: Path) -> ReplicaConfig:
    """deploy/serve.yaml with these ``args`` changed, read as ``specserve serve --config`` reads it."""
    raw = yaml.safe_load(SERVE_YAML.read_text())
    (app,) = raw["applications"]
    app["args"].update(settings)
    path = tmp_path / "serve.yaml"
    path.write_text(yaml.safe_dump(raw, sort_keys=False))
    return load_serve_file(path).config.replica()


def test_every_setting_has_a_sample() -> None:
    assert set(SAMPLES) == set(ReplicaConfig.model_fields)
    for name, (value, needs) in SAMPLES.items():
        assert value != ReplicaConfig.model_fields[name].default, f"{name}: the sample must differ from the default"
        ReplicaConfig(**{"target": TARGET, **needs, name: value})


@pytest.mark.parametrize("name", list(SAMPLES))
def test_every_setting_is_reachable_from_cli_yaml_and_python(name: str, tmp_path: Path) -> None:
    value, needs = SAMPLES[name]
    # the edges' other defaults as Python's (but serve's max_num_seqs: it batches by default, the library does not)
    settings = {"target": TARGET, "draft": "ngram", "max_num_seqs": 1, **needs, name: value}
    python = ReplicaConfig(**settings)
    cli_config = from_cli(settings)
    yaml_config = from_serve_yaml(settings, tmp_path)
    assert getattr(python, name) == getattr(cli_config, name) == getattr(yaml_config, name) == value
    assert python == cli_config == yaml_config


def test_the_serve_config_is_the_replica_config_plus_serving() -> None:
    assert issubclass(ServeConfig, ReplicaConfig)
    replica_fields = set(ReplicaConfig.model_fields)
    assert replica_fields <= set(ServeConfig.model_fields)
    args = yaml.safe_load(SERVE_YAML.read_text())["applications"][0]["args"]
    assert replica_fields <= set(args), f"deploy/serve.yaml lacks {replica_fields - set(args)}"
    config = ServeConfig(max_ngram=6, min_ngram=2, collective_timeout_s=7.0, ready_timeout_s=9.0)
    replica = config.replica()
    assert type(replica) is ReplicaConfig
    assert (replica.max_ngram, replica.min_ngram, replica.collective_timeout_s, replica.ready_timeout_s) == (
        6,
        2,
        7.0,
        9.0,
    )


def test_cli_flags_carry_the_fields_description_default_and_choices() -> None:
    parser = cli.build_parser(["generate"])
    (generate,) = [a for a in parser._actions if a.dest == "command"]
    actions = {a.dest: a for a in generate.choices["generate"]._actions}
    assert set(MODEL_SETTINGS) | set(DISTRIBUTED_SETTINGS) == set(ReplicaConfig.model_fields)
    for name, field in ReplicaConfig.model_fields.items():
        action = actions[name]
        assert action.option_strings == [ReplicaConfig.flag(name)]
        assert field.description and action.help == field.description
        assert action.default == EDGE_DEFAULTS.get(name, field.default)
    assert actions["dtype"].choices == ["float32", "float64", "bfloat16", "float16"]
    assert actions["drafter_placement"].choices == ["colocated", "separate", "pool"]
    # the flags that predate the config keep their names
    flags = [ReplicaConfig.flag(name) for name in ("tp_degree", "max_ngram", "min_ngram")]
    assert flags == ["--tp", "--ngram-max", "--ngram-min"]


def test_the_edges_default_to_the_shipped_pair_and_python_to_ngram() -> None:
    assert (ServeConfig().target, ServeConfig().draft) == (EDGE_DEFAULTS["target"], EDGE_DEFAULTS["draft"])
    assert from_cli({}).draft == EDGE_DEFAULTS["draft"]
    assert ReplicaConfig(target=TARGET).draft == "ngram"


# ---------------------------------------------------------------------------------------------
# Drafter directories are made absolute in one place


@pytest.mark.parametrize("prefix", ["", "eagle:", "medusa:", "layerskip:"])
def test_relative_drafter_directories_become_absolute_everywhere(
    prefix: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    (tmp_path / "heads").mkdir()
    monkeypatch.chdir(tmp_path)
    expected = f"{prefix}{tmp_path / 'heads'}"
    assert resolve_model_path(f"{prefix}heads") == expected
    settings = {"target": TARGET, "draft": f"{prefix}heads"}
    assert ReplicaConfig(**settings).draft == expected
    assert from_cli(settings).draft == expected
    assert from_serve_yaml(settings, tmp_path).draft == expected
    assert ServeConfig(draft=f"{prefix}heads").replica().draft == expected


@pytest.mark.parametrize("spec", ["ngram", "none", "layerskip:3", "eagle:missing", "missing", "/abs/path", "eagle:"])
def test_specs_without_an_existing_relative_directory_stay_as_written(
    spec: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    (tmp_path / "3").mkdir()  # layerskip:3 is a layer count even where a directory "3" exists
    monkeypatch.chdir(tmp_path)
    assert resolve_model_path(spec) == spec


def test_a_relative_target_becomes_absolute(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    (tmp_path / "target").mkdir()
    monkeypatch.chdir(tmp_path)
    assert ReplicaConfig(target="target").target == str(tmp_path / "target")
    assert ServeConfig(target="target").target == str(tmp_path / "target")


def test_the_draft_description_names_every_drafter_form() -> None:
    for config in (ReplicaConfig, ServeConfig):
        description = config.model_fields["draft"].description or ""
        for form in ("ngram", "none", "layerskip:L", "layerskip:DIR", "eagle:DIR", "medusa:DIR", "directory"):
            assert form in description, f"{config.__name__}.draft does not mention {form}"


# ---------------------------------------------------------------------------------------------
# Bad settings say what to change


def test_our_checks_raise_their_own_errors_from_python() -> None:
    with pytest.raises(ValueError, match=r"tp_degree\n.*must be a power of two from 1 to 64"):
        ReplicaConfig(target=TARGET, tp_degree=3)  # a field's own check: pydantic names the field
    with pytest.raises(InvalidSetting, match=r"n-gram sizes need 1 <= min_ngram <= max_ngram, got 3\.\.2"):
        ReplicaConfig(target=TARGET, min_ngram=3, max_ngram=2)
    with pytest.raises(InvalidSetting, match=r"kv_pool_tokens 100 cannot hold one request of max_seq_len 512"):
        ReplicaConfig(target=TARGET, kv_pool_tokens=100, max_seq_len=512)
    with pytest.raises(InvalidClusterSpec, match="gpus_per_drafter"):
        ReplicaConfig(target=TARGET, gpus_per_drafter=1.0)
    with pytest.raises(ValueError, match="threads_per_shard"):
        ReplicaConfig(target=TARGET, threads_per_shard=0)
    with pytest.raises(ValueError, match="collective_timeout_s"):
        ReplicaConfig(target=TARGET, collective_timeout_s=0)
    with pytest.raises(ValueError, match="Extra inputs"):
        ReplicaConfig(target=TARGET, tp=2)


def test_a_bad_flag_is_named_on_the_command_line(capsys: pytest.CaptureFixture[str]) -> None:
    code = cli.main(["generate", "--prompt", "x", "--draft", "ngram", "--threads-per-shard", "0"])
    err = capsys.readouterr().err
    assert code == 2 and err.startswith("error: --threads-per-shard: ") and len(err.strip().splitlines()) == 1
    with pytest.raises(InvalidSetting, match=r"--threads-per-drafter: .*greater than or equal to 1.*; --ready-time"):
        from_cli({"threads_per_drafter": 0, "ready_timeout_s": -1})


@pytest.mark.parametrize(
    ("settings", "needles"),
    [
        ({"min_ngram": 4, "max_ngram": 2}, ["args", "n-gram"]),
        ({"collective_timeout_s": 0}, ["args", "collective_timeout_s"]),
        ({"large_resource": "GPU"}, ["args", "shadow"]),
    ],
)
def test_a_bad_yaml_setting_names_the_file_and_the_key(
    settings: dict[str, Any], needles: list[str], tmp_path: Path
) -> None:
    with pytest.raises(DeployFileError) as info:
        from_serve_yaml(settings, tmp_path)
    for needle in [str(tmp_path / "serve.yaml"), *needles]:
        assert needle in str(info.value)


# ---------------------------------------------------------------------------------------------
# Limits from one constant


def test_no_command_writes_the_largest_gamma_as_a_literal() -> None:
    """Every subcommand module (and the config) compares with MAX_GAMMA and prints it, never a written 64."""
    modules = [command.module for command in cli.COMMANDS.values()]
    modules += ["specserve.cli", "specserve.cluster.replica_config", "specserve.serve.config"]
    for module in modules:
        spec = importlib.util.find_spec(module)
        assert spec is not None and spec.origin, module
        path = Path(spec.origin)
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.Compare):
                bounds = [c.value for c in [node.left, *node.comparators] if isinstance(c, ast.Constant)]
                assert MAX_GAMMA not in bounds, f"{path.name}:{node.lineno}: a limit written as {MAX_GAMMA}"
            if isinstance(node, ast.Constant) and isinstance(node.value, str):
                assert not re.search(rf"\b{MAX_GAMMA}\b", node.value), f"{path.name}:{node.lineno}: {node.value!r}"


def test_gamma_limits_in_help_and_errors_follow_max_gamma(capsys: pytest.CaptureFixture[str]) -> None:
    parser = cli.build_parser(["generate"])
    (generate,) = [a for a in parser._actions if a.dest == "command"]
    help_text = generate.choices["generate"].format_help()
    assert f"(1..{MAX_GAMMA})" in " ".join(help_text.split())
    assert cli.main(["generate", "--prompt", "x", "--gamma", str(MAX_GAMMA + 1)]) == 2
    assert f"--gamma must be between 1 and {MAX_GAMMA}" in capsys.readouterr().err


def test_a_drafter_actor_without_gpus_drafts_on_the_cpu() -> None:
    """Ray shows GPUs only to an actor that reserves them: a cuda replica's drafter runs on cuda only with GPUs."""
    assert ReplicaConfig(target="t", device="cuda").drafter_actor_device == "cpu"
    assert ReplicaConfig(target="t", device="cuda", gpus_per_drafter=0.25).drafter_actor_device == "cuda"
    assert ReplicaConfig(target="t").drafter_actor_device == "cpu"
    assert ReplicaConfig(target="t", device="cuda").drafter_options()["device"] == "cuda"  # in process: the device


# ---------------------------------------------------------------------------------------------
# Which batched replicas run the in-process engine


@pytest.mark.parametrize(
    "settings",
    [
        {"tp_degree": 2},
        {"overlap": True},
        {"drafter_placement": "separate"},
        {"device": "cuda", "gpus_per_drafter": 0.5},
    ],
)
def test_a_batched_replica_that_needs_the_distributed_runtime_stays_on_it(settings: dict[str, Any]) -> None:
    batched = ReplicaConfig(target=TARGET, max_num_seqs=4, **settings)
    assert batched.batched and not batched.batches_in_process


@pytest.mark.parametrize("draft", ["/srv/draft", "ngram", "none", "eagle:/srv/heads", "layerskip:2"])
def test_a_batched_replica_on_one_process_runs_the_in_process_engine(draft: str) -> None:
    assert ReplicaConfig(target=TARGET, draft=draft, max_num_seqs=4).batches_in_process
    assert not ReplicaConfig(target=TARGET, draft=draft).batches_in_process  # max_num_seqs 1: one at a time


def test_serve_sends_a_batched_replica_enough_requests_to_fill_its_batch() -> None:
    with pytest.raises(InvalidSetting, match=r"max_ongoing_requests 8 < max_num_seqs 16.*raise max_ongoing_requests"):
        ServeConfig(max_num_seqs=16, max_ongoing_requests=8)
    assert ServeConfig(max_num_seqs=16, max_ongoing_requests=32).ongoing_requests == 32


def test_a_default_server_batches_and_lets_overload_reach_its_bound() -> None:
    """Serve batches by default (in process, with the shipped pair), and Serve sends a replica more requests than its
    bound (max_num_seqs + max_queue) allows, so that the excess is refused with 429 rather than held in the router."""
    config = ServeConfig()
    assert config.batched and config.batches_in_process and config.max_num_seqs == SERVE_MAX_NUM_SEQS > 1
    assert config.ongoing_requests > config.max_num_seqs + config.max_queue
    small = ServeConfig(max_num_seqs=2, max_queue=0)
    assert small.ongoing_requests > 2 and ServeConfig(max_num_seqs=2, max_ongoing_requests=2).ongoing_requests == 2
    assert not ReplicaConfig(target=TARGET).batched  # the library (generate, Coordinator.spawn): one at a time
    assert ReplicaConfig.model_fields["kv_cache_memory"].default == DEFAULT_MEMORY_FRACTION


def test_the_sample_files_serve_with_the_command_lines_defaults() -> None:
    """deploy/serve.yaml and deploy/rayservice.yaml write the serving settings out; they are the defaults
    `specserve serve` and `generate` use (a sample with γ 4 while the CLI drafts 3 would measure another server)."""
    serve_args = yaml.safe_load(SERVE_YAML.read_text())["applications"][0]["args"]
    manifest = yaml.safe_load((ROOT / "deploy" / "rayservice.yaml").read_text())
    (rayservice_app,) = yaml.safe_load(manifest["spec"]["serveConfigV2"])["applications"]
    serving = set(ServeConfig.model_fields) - set(ReplicaConfig.model_fields) - {"api_key"}
    for args in (serve_args, rayservice_app["args"]):
        assert {name: args[name] for name in serving} == {
            name: ServeConfig.model_fields[name].default for name in serving
        }
    assert serve_args["gamma"] == defaults.DEFAULT_GAMMA
