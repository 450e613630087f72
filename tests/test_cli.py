"""The command line: the --json contract on the shipped pair, and one clear error line for bad input."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from transformers import LlamaConfig, LlamaForCausalLM

from specserve import cli, defaults
from specserve.cli import main

TARGET = str(defaults.DEFAULT_TARGET)
DRAFT = str(defaults.DEFAULT_DRAFT)


def run_cli(capsys: pytest.CaptureFixture[str], *argv: str) -> tuple[int, str, str]:
    code = main(list(argv))
    out, err = capsys.readouterr()
    return code, out, err


def test_shipped_models_are_present() -> None:
    for d in (defaults.DEFAULT_TARGET, defaults.DEFAULT_DRAFT):
        assert (d / "config.json").is_file(), f"{d} is missing: run `specserve train` (see models/README.md)"


def test_generate_json_contract(capsys: pytest.CaptureFixture[str]) -> None:
    code, out, err = run_cli(capsys, "generate", "--prompt", "def main(", "--max-new-tokens", "20", "--json")
    assert code == 0, err
    obj = json.loads(out)
    assert set(obj) >= {"prompt_ids", "output_ids", "text", "stats"}
    assert len(obj["output_ids"]) <= 20 and obj["prompt_ids"]
    stats = obj["stats"]
    for key in ("cycles", "mean_accepted", "acceptance_by_position", "draft_seconds", "verify_seconds"):
        assert key in stats
    assert stats["tokens_per_second"] > 0


def test_generate_json_with_penalties_and_logprobs(capsys: pytest.CaptureFixture[str]) -> None:
    """Penalties, a bias and logprobs from the command line: one logprob per output token, with 2 alternatives,
    and the same greedy output whoever drafts."""
    outputs = []
    for draft in ("ngram", "none"):
        code, out, err = run_cli(
            capsys, "generate", "--prompt", "import os\n", "--max-new-tokens", "16", "--json", "--draft", draft,
            "--dtype", "float64", "--presence-penalty", "1", "--repetition-penalty", "1.2", "--logit-bias", "10=2",
            "--logprobs", "2",
        )  # fmt: skip
        assert code == 0, err
        obj = json.loads(out)
        assert [entry["token"] for entry in obj["logprobs"]] == obj["output_ids"]
        assert all(len(entry["top"]) == 2 and entry["logprob"] <= 0 for entry in obj["logprobs"])
        outputs.append(obj["output_ids"])
    assert outputs[0] == outputs[1]


def test_generate_json_schema_gives_json_that_follows_it(capsys: pytest.CaptureFixture[str], tmp_path: Path) -> None:
    """The shipped pair, a schema with bounded strings: the output parses and validates, whoever drafts."""
    import jsonschema

    schema = {
        "type": "object",
        "properties": {"name": {"type": "string", "maxLength": 12}, "size": {"type": "integer", "maximum": 999}},
        "required": ["name", "size"],
        "additionalProperties": False,
    }
    path = tmp_path / "schema.json"
    path.write_text(json.dumps(schema))
    outputs = []
    for draft in ("ngram", DRAFT):
        code, out, err = run_cli(
            capsys, "generate", "--prompt", "def main(", "--max-new-tokens", "64", "--json", "--draft", draft,
            "--dtype", "float64", "--json-schema", str(path),
        )  # fmt: skip
        assert code == 0, err
        obj = json.loads(out)
        assert obj["finish_reason"] == "eos", obj["text"]
        jsonschema.validate(json.loads(obj["text"]), schema)
        outputs.append(obj["output_ids"])
    assert outputs[0] == outputs[1]


def test_generate_greedy_is_draft_independent(capsys: pytest.CaptureFixture[str]) -> None:
    """Greedy output of the shipped pair (float64, so no near-ties flip) is the same for every drafter."""
    outputs = []
    for draft in (DRAFT, "ngram", "none"):
        code, out, err = run_cli(
            capsys, "generate", "--prompt", "import os\n", "--max-new-tokens", "24", "--json",
            "--draft", draft, "--dtype", "float64", "--gamma", "3",
        )  # fmt: skip
        assert code == 0, err
        outputs.append(json.loads(out)["output_ids"])
    assert outputs[0] == outputs[1] == outputs[2]


def test_generate_on_static_shapes_equals_growing_caches(capsys: pytest.CaptureFixture[str]) -> None:
    """The shipped pair in float64, on the static-shape engine with buckets that pad γ 3's block of 4 and γ 5's of 6
    (and no CUDA graphs on a CPU), gives the greedy tokens of the growing-cache engine."""
    outputs = []
    for extra in (
        ["--static-shapes", "off"],
        ["--static-shapes", "on", "--buckets", "1,2,8"],
        ["--static-shapes", "on"],
    ):
        for gamma in ("3", "5"):
            code, out, err = run_cli(
                capsys, "generate", "--prompt", "import os\n", "--max-new-tokens", "24", "--json",
                "--dtype", "float64", "--gamma", gamma, *extra,
            )  # fmt: skip
            assert code == 0, err
            outputs.append(json.loads(out)["output_ids"])
    assert all(out == outputs[0] for out in outputs)


@pytest.mark.skipif(torch.cuda.is_available(), reason="this machine has CUDA")
def test_cuda_without_a_gpu_is_one_clear_line(capsys: pytest.CaptureFixture[str]) -> None:
    code, _out, err = run_cli(capsys, "generate", "--prompt", "x", "--device", "cuda", "--static-shapes", "on")
    assert code == 2 and "Traceback" not in err
    assert err.strip() == "error: --device cuda was requested but no CUDA device is available; use --device cpu"


def test_generate_with_trees_equals_chains(capsys: pytest.CaptureFixture[str], tmp_path: Path) -> None:
    """Greedy output with static and dynamic draft trees equals the chain run's; the JSON lists tree shapes."""
    topology = tmp_path / "tree.json"
    topology.write_text(json.dumps([[0], [1], [0, 0], [0, 1], [0, 0, 0]]))
    common = ["generate", "--prompt", "import os\n", "--max-new-tokens", "24", "--json", "--dtype", "float64"]
    runs = {}
    for name, extra in {
        "chain": [],
        "static": ["--tree", "static", "--tree-topology", str(topology)],
        "dynamic": ["--tree", "dynamic", "--tree-depth", "3", "--tree-width", "2", "--tree-nodes", "6"],
    }.items():
        code, out, err = run_cli(capsys, *common, *extra)
        assert code == 0, err
        runs[name] = json.loads(out)
    assert runs["chain"]["output_ids"] == runs["static"]["output_ids"] == runs["dynamic"]["output_ids"]
    assert runs["chain"]["stats"]["tree_shapes"] == []
    shapes = runs["dynamic"]["stats"]["tree_shapes"]
    assert shapes and all(nodes <= 6 and depth <= 3 for nodes, depth in shapes)
    assert all(nodes <= 5 for nodes, _ in runs["static"]["stats"]["tree_shapes"])


def test_generate_with_policies_lists_the_budget_of_every_cycle(capsys: pytest.CaptureFixture[str]) -> None:
    common = ["generate", "--prompt", "import os\n", "--max-new-tokens", "24", "--json", "--dtype", "float64"]
    runs = {}
    for policy in ("fixed", "heuristic", "adaptive"):
        code, out, err = run_cli(capsys, *common, "--policy", policy)
        assert code == 0, err
        runs[policy] = json.loads(out)
    assert runs["fixed"]["output_ids"] == runs["heuristic"]["output_ids"] == runs["adaptive"]["output_ids"]
    for run in runs.values():
        assert len(run["stats"]["budgets"]) == run["stats"]["cycles"] > 0
    assert set(runs["fixed"]["stats"]["budgets"][:-1]) <= {3}  # the default γ until the request's end cuts it


def test_generate_with_layerskip_self_speculation(capsys: pytest.CaptureFixture[str]) -> None:
    common = ["generate", "--prompt", "import os\n", "--max-new-tokens", "16", "--json", "--dtype", "float64"]
    code, out, err = run_cli(capsys, *common, "--draft", "layerskip:3")
    assert code == 0, err
    code, plain_out, err = run_cli(capsys, *common, "--draft", "none")
    assert code == 0, err
    assert json.loads(out)["output_ids"] == json.loads(plain_out)["output_ids"]
    assert json.loads(out)["stats"]["drafted_tokens"] > 0
    code, _, err = run_cli(capsys, *common, "--draft", "layerskip:99")
    assert code == 2 and "layers <" in err


def test_console_script_streams_text() -> None:
    exe = Path(sys.executable).parent / "specserve"
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    proc = subprocess.run(
        [str(exe), "generate", "--prompt", "class Foo:", "--max-new-tokens", "12", "--draft", "ngram"],
        capture_output=True, text=True, timeout=300, env=env, check=False,
    )  # fmt: skip
    assert proc.returncode == 0, proc.stderr
    assert "tokens" in proc.stderr and "Traceback" not in proc.stderr


def _mismatched_draft(tmp_path: Path) -> str:
    cfg = LlamaConfig(
        vocab_size=100, hidden_size=16, intermediate_size=32, num_hidden_layers=1, num_attention_heads=2,
        num_key_value_heads=1, max_position_embeddings=64,
    )  # fmt: skip
    torch.manual_seed(0)
    out = tmp_path / "small_vocab"
    LlamaForCausalLM(cfg).save_pretrained(str(out))
    return str(out)


def _bad_dirs(tmp_path: Path) -> dict[str, str]:
    no_config = tmp_path / "no_config"
    no_config.mkdir()
    bad_json = tmp_path / "bad_json"
    bad_json.mkdir()
    (bad_json / "config.json").write_text("{not json")
    no_weights = tmp_path / "no_weights"
    shutil.copytree(TARGET, no_weights)
    for f in no_weights.glob("*.safetensors"):
        f.unlink()
    corrupt = tmp_path / "corrupt"
    shutil.copytree(TARGET, corrupt)
    for f in corrupt.glob("*.safetensors"):
        f.write_bytes(b"garbage")
    a_file = tmp_path / "a_file"
    a_file.write_text("x")
    return {
        "missing": str(tmp_path / "does_not_exist"),
        "file": str(a_file),
        "no_config": str(no_config),
        "bad_json": str(bad_json),
        "no_weights": str(no_weights),
        "corrupt": str(corrupt),
    }


BAD_ARGS = {
    "empty prompt": (["--prompt", ""], "prompt is empty"),
    "prompt past context": (["--prompt", "x = 1\n" * 400, "--max-new-tokens", "1000"], "context"),
    "gamma 0": (["--gamma", "0"], "--gamma"),
    "gamma absurd": (["--gamma", "100000"], "--gamma"),
    "negative temperature": (["--temperature", "-1"], "temperature"),
    "top-p zero": (["--top-p", "0"], "top_p"),
    "top-p above one": (["--top-p", "1.5"], "top_p"),
    "negative top-k": (["--top-k", "-1"], "top_k"),
    "zero max-new-tokens": (["--max-new-tokens", "0"], "max-new-tokens"),
    "bad ngram sizes": (["--draft", "ngram", "--ngram-min", "3", "--ngram-max", "2"], "n-gram"),
    "missing prompt file": (["--prompt-file", "/nonexistent/prompt.txt"], "does not exist"),
    "static tree without topology": (["--tree", "static"], "--tree-topology"),
    "topology without a static tree": (["--tree-topology", "paths.json"], "--tree static"),
    "zero tree depth": (["--tree", "dynamic", "--tree-depth", "0"], "budget"),
    "unreadable topology": (["--tree", "static", "--tree-topology", "/nonexistent.json"], "cannot read"),
    "malformed logit bias": (["--logit-bias", "x"], "--logit-bias takes ID=BIAS"),
    "logit bias outside the vocabulary": (["--logit-bias", "99999999=1"], "outside the vocabulary"),
    "presence penalty too large": (["--presence-penalty", "3"], "presence_penalty must be in [-2, 2]"),
    "too many logprobs": (["--logprobs", "21"], "logprobs must be between 0"),
    "bad regex": (["--regex", "[a-"], "the regex grammar is not valid"),
    "missing schema": (["--json-schema", "/nonexistent.json"], "cannot read --json-schema"),
    "unordered buckets": (["--buckets", "4,2"], "strictly increasing"),
    "malformed buckets": (["--buckets", "1;2"], "comma-separated widths"),
    "static shapes distributed": (["--static-shapes", "on", "--distributed"], "runs in process only"),
}


@pytest.mark.parametrize("case", sorted(BAD_ARGS))
def test_bad_arguments_give_one_clear_line(case: str, capsys: pytest.CaptureFixture[str]) -> None:
    extra, needle = BAD_ARGS[case]
    argv = ["generate", "--draft", "ngram", *extra]
    if "--prompt" not in extra and "--prompt-file" not in extra:
        argv += ["--prompt", "def f():"]
    code, _out, err = run_cli(capsys, *argv)
    assert code == 2
    lines = err.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("error: "), err
    assert needle in lines[0]
    assert "Traceback" not in err


@pytest.mark.parametrize("which", ["missing", "file", "no_config", "bad_json", "no_weights", "corrupt"])
@pytest.mark.parametrize("role", ["target", "draft"])
def test_bad_model_directories(which: str, role: str, tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    path = _bad_dirs(tmp_path)[which]
    argv = ["generate", "--prompt", "def f():", "--max-new-tokens", "4", f"--{role}", path]
    code, _, err = run_cli(capsys, *argv)
    assert code == 2
    lines = err.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("error: ") and path in lines[0], err


def test_mismatched_vocabularies(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    code, _, err = run_cli(capsys, "generate", "--prompt", "def f():", "--draft", _mismatched_draft(tmp_path))
    assert code == 2
    assert err.startswith("error: ") and "vocabulary" in err and len(err.strip().splitlines()) == 1


def test_bench_rejects_bad_prompts_file(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    bad = tmp_path / "p.json"
    bad.write_text('{"not": "a list"}')
    code, _, err = run_cli(capsys, "bench", "--prompts", str(bad), "--draft", "ngram")
    assert code == 2 and "JSON list" in err


@pytest.mark.parametrize("name", sorted(cli.COMMANDS))
def test_every_subcommand_lives_in_a_module_with_arguments_and_an_entry_point(
    name: str, capsys: pytest.CaptureFixture[str]
) -> None:
    module = cli.COMMANDS[name].load()
    assert callable(module.add_arguments) and callable(module.run_command)
    with pytest.raises(SystemExit) as exited:
        main([name, "--help"])
    assert exited.value.code == 0
    assert f"usage: specserve {name}" in capsys.readouterr().out


def test_an_unknown_subcommand_is_refused_by_the_parser(capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit) as exited:
        main(["genrate", "--prompt", "x"])
    assert exited.value.code == 2 and "invalid choice: 'genrate'" in capsys.readouterr().err


def test_only_the_chosen_subcommand_module_is_imported() -> None:
    """`specserve cluster ...` parses without importing torch (the benchmarks and the engine)."""
    code = (
        "import sys; from specserve.cli import build_parser; build_parser(['cluster']); print('torch' in sys.modules)"
    )
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120, check=True)
    assert proc.stdout.strip() == "False"


# Mistakes a newcomer makes, each refused before torch is imported (so at once), with what to do instead.
FAST_ERRORS = {
    "drafter typo": (["--draft", "ngrams"], "Did you mean 'ngram'?"),
    "drafter keyword without its argument": (["--draft", "eagle"], "Did you mean 'eagle:DIR'?"),
    "hub id as target": (["--target", "meta-llama/Llama-3.2-1B"], "hf download meta-llama/Llama-3.2-1B"),
    "hub id as draft": (["--draft", "Qwen/Qwen2.5-0.5B"], "--draft models/qwen2.5-0.5b"),
    "hub id as EAGLE head": (
        ["--draft", "eagle:yuhuili/EAGLE3-LLaMA3.1-Instruct-8B"],
        "--local-dir models/eagle3-llama3.1-instruct-8b`; gated models need `hf auth login` first) and pass --draft "
        "eagle:models/eagle3-llama3.1-instruct-8b",
    ),
    "missing head directory": (["--draft", "eagle:/nonexistent/head"], "/nonexistent/head does not exist"),
    "prompt file is a directory": (["--prompt-file", "/"], "is a directory"),
    "tp not a power of two": (["--distributed", "--tp", "3"], "--tp: must be a power of two"),
    "gamma 0": (["--gamma", "0"], "--gamma"),
    "top-p above one": (["--top-p", "2"], "top_p"),
    "zero tree depth": (["--tree", "dynamic", "--tree-depth", "0"], "budget"),
    "zero threads": (["--threads", "0"], "--threads"),
}


def test_argument_mistakes_are_refused_before_torch_loads() -> None:
    """Every case exits 2 with one line naming the fix, and the process never imported torch."""
    script = (
        "import json, sys\n"
        "from specserve.cli import main\n"
        "cases = json.loads(sys.argv[1])\n"
        "codes = {name: main(['generate', *argv]) for name, argv in cases.items()}\n"
        "print(json.dumps({'codes': codes, 'torch': 'torch' in sys.modules}))\n"
    )
    cases = {
        name: [*argv, *([] if "--prompt-file" in argv else ["--prompt", "x"])]
        for name, (argv, _) in FAST_ERRORS.items()
    }
    proc = subprocess.run(
        [sys.executable, "-c", script, json.dumps(cases)], capture_output=True, text=True, timeout=120, check=True
    )
    report = json.loads(proc.stdout.strip().splitlines()[-1])
    assert report["torch"] is False
    assert set(report["codes"].values()) == {2}
    lines = proc.stderr.strip().splitlines()
    assert len(lines) == len(FAST_ERRORS) and all(line.startswith("error: ") for line in lines), proc.stderr
    for (name, (_, needle)), line in zip(FAST_ERRORS.items(), lines, strict=True):
        assert needle in line, (name, line)


def test_an_unknown_device_is_refused_by_the_parser(capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit) as exited:
        main(["generate", "--device", "gpu", "--prompt", "x"])
    assert exited.value.code == 2 and "invalid choice: 'gpu'" in capsys.readouterr().err


def test_help_shows_every_default(capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit):
        main(["generate", "--help"])
    text = " ".join(capsys.readouterr().out.split("options:", 1)[1].split())  # after the usage; argparse wraps lines
    for flag, default in {
        "--gamma": defaults.DEFAULT_GAMMA,
        "--max-new-tokens": defaults.DEFAULT_MAX_NEW_TOKENS,
        "--target": defaults.DEFAULT_TARGET,
        "--temperature": 0.0,
        "--top-p": 1.0,
        "--seed": 0,
        "--threads": defaults.DEFAULT_THREADS,
    }.items():
        after = text.split(f"{flag} {flag.removeprefix('--').replace('-', '_').upper()}", 1)[1]
        assert after.split("(default: ", 1)[1].split(")", 1)[0] == str(default), flag
    assert "(default: None)" not in text and "(default: False)" not in text


def test_threads_sets_torch_threads_of_the_process() -> None:
    """One fresh process, three runs: 2 threads, then 1, then 2 again (each run changes what the previous one set,
    whatever the machine's default)."""
    script = (
        "import sys, torch\n"
        "from specserve.cli import main\n"
        "for threads in sys.argv[1:]:\n"
        "    code = main(['generate', '--draft', 'none', '--prompt', 'x', '--max-new-tokens', '2', '--json', "
        "'--threads', threads])\n"
        "    print('threads:', code, torch.get_num_threads())\n"
    )
    runs = ("2", "1", "2")
    proc = subprocess.run(
        [sys.executable, "-c", script, *runs], capture_output=True, text=True, timeout=300, check=True
    )
    printed = [line for line in proc.stdout.splitlines() if line.startswith("threads:")]
    assert printed == [f"threads: 0 {threads}" for threads in runs], proc.stderr


def test_serve_mistakes_are_refused_before_ray_or_torch_loads() -> None:
    script = (
        "import json, sys\n"
        "from specserve.cli import main\n"
        "codes = [main(['serve', *argv]) for argv in json.loads(sys.argv[1])]\n"
        "print(json.dumps({'codes': codes, 'loaded': [m for m in ('torch', 'ray') if m in sys.modules]}))\n"
    )
    cases = {
        "Did you mean 'ngram'?": ["--draft", "ngrams"],
        "hf download meta-llama/Llama-3.2-1B": ["--target", "meta-llama/Llama-3.2-1B"],
        "--tp: must be a power of two": ["--tp", "3"],
        "--port must be between 1 and 65535": ["--port", "0"],
    }
    proc = subprocess.run(
        [sys.executable, "-c", script, json.dumps(list(cases.values()))],
        capture_output=True, text=True, timeout=120, check=True,
    )  # fmt: skip
    report = json.loads(proc.stdout.strip().splitlines()[-1])
    assert report == {"codes": [2] * len(cases), "loaded": []}, proc.stderr
    lines = proc.stderr.strip().splitlines()
    assert len(lines) == len(cases), proc.stderr
    for needle, line in zip(cases, lines, strict=True):
        assert line.startswith("error: ") and needle in line, (needle, line)
