"""What every benchmark command does the same way: where results go by default (``runs/<command>/`` under the
current directory, never ``bench/results``), what stdout carries (the table and a ``results:`` line, or with
``--json`` exactly one JSON document), and what ``--quick`` changes (defaults only: flags the user gives win)."""

from __future__ import annotations

import argparse
import importlib
import json
from pathlib import Path
from typing import Any

import pytest

from specserve import cli
from specserve.benchmarks import arguments, batch, learned, speculative, trees

# command -> (its module, the stem of its report files)
COMMANDS = {
    "bench": ("specserve.benchmarks.speculative", "speculative"),
    "bench-trees": ("specserve.benchmarks.trees", "trees"),
    "bench-drafters": ("specserve.benchmarks.learned", "drafters"),
    "bench-distributed": ("specserve.benchmarks.distributed", "distributed"),
    "bench-serve": ("specserve.benchmarks.serve_load", "serve_load"),
    "bench-batch": ("specserve.benchmarks.batch", "batch"),
    "experiment": ("specserve.benchmarks.experiment", "experiment"),
}
FAKE_REPORT: dict[str, Any] = {"rows": [{"method": "plain", "tokens_per_second": 1.5}], "summary": {"best": None}}
FAKE_TABLE = "| method | tok/s |\n|---|---|\n| plain | 1.5 |\n"


def parse(*argv: str) -> argparse.Namespace:
    return cli.build_parser([argv[0]]).parse_args(list(argv))


def tiny_flags(models: Path, prompts: Path) -> list[str]:
    return ["--target", str(models / "target"), "--draft", str(models / "draft"), "--dtype", "float64",
            "--prompts", str(prompts)]  # fmt: skip


@pytest.fixture
def prompts(tmp_path: Path) -> Path:
    path = tmp_path / "prompts.json"
    path.write_text(json.dumps(["def f(x):\n    return", "for i in range(10):", "import os\nimport sys\n"]))
    return path


# ---------------------------------------------------------------------------------------------
# Defaults


@pytest.mark.parametrize("command", COMMANDS)
def test_default_out_is_a_scratch_directory_named_after_the_command(command: str) -> None:
    module = importlib.import_module(COMMANDS[command][0])
    cfg = module.config_from_args(parse(command))
    out = cfg.out if command == "bench-batch" else cfg.out_dir
    expected = Path("runs", command)
    assert out == (expected / "batch.json" if command == "bench-batch" else expected)
    assert not out.is_absolute() and "bench/results" not in str(out)
    assert parse(command).json is False and parse(command, "--json").json is True


def test_bench_batch_plot_sits_beside_its_report_unless_named() -> None:
    assert batch.config_from_args(parse("bench-batch")).plot == Path("runs/bench-batch/batch.png")
    assert batch.config_from_args(parse("bench-batch", "--out", "x/b.json")).plot == Path("x/b.png")
    assert batch.config_from_args(parse("bench-batch", "--plot", "")).plot is None
    assert batch.config_from_args(parse("bench-batch", "--plot", "p.png")).plot == Path("p.png")


def test_results_line_names_the_first_file_in_full_and_its_neighbours_by_name() -> None:
    paths = [Path("runs/bench/speculative.json"), Path("runs/bench/speculative.md"), Path("elsewhere/p.png")]
    assert arguments.results_line(paths) == "results: runs/bench/speculative.json, speculative.md, elsewhere/p.png"


# ---------------------------------------------------------------------------------------------
# What stdout carries, for every command (its run replaced: no models, no Ray)


@pytest.fixture
def fake_run(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> list[Any]:
    """Replace every command's ``run`` (which prints noise, as libraries do) and table; collect the configs."""
    monkeypatch.chdir(tmp_path)
    configs: list[Any] = []
    for name, _ in COMMANDS.values():
        module = importlib.import_module(name)

        def run(cfg: Any, module_name: str = name) -> Any:
            configs.append(cfg)
            print("noise from a library")
            return (FAKE_REPORT, 0) if module_name.endswith(".batch") else FAKE_REPORT

        monkeypatch.setattr(module, "run", run)
        monkeypatch.setattr(module, "markdown", lambda report: FAKE_TABLE)
    return configs


@pytest.mark.parametrize("command", COMMANDS)
def test_json_prints_exactly_one_document(
    command: str, fake_run: list[Any], capsys: pytest.CaptureFixture[str]
) -> None:
    assert cli.main([command, "--json"]) == 0
    captured = capsys.readouterr()
    assert json.loads(captured.out) == FAKE_REPORT and captured.out.count("\n") == 1
    assert "noise from a library" in captured.err and f"results: runs/{command}/" in captured.err


@pytest.mark.parametrize("command", COMMANDS)
def test_without_json_the_table_then_where_the_files_went(
    command: str, fake_run: list[Any], capsys: pytest.CaptureFixture[str]
) -> None:
    assert cli.main([command]) == 0
    captured = capsys.readouterr()
    lines = captured.out.splitlines()
    assert captured.out.startswith(FAKE_TABLE) and len(lines) == FAKE_TABLE.count("\n") + 1
    stem = COMMANDS[command][1]
    assert lines[-1].startswith(f"results: runs/{command}/{stem}.json, {stem}.md, ")
    assert "noise from a library" in captured.err


# ---------------------------------------------------------------------------------------------
# --quick


def test_quick_bench_shrinks_the_plan_and_respects_explicit_flags() -> None:
    full = speculative.config_from_args(parse("bench"))
    quick = speculative.config_from_args(parse("bench", "--quick"))
    assert (full.num_prompts, full.max_new_tokens, full.temperatures) == (20, 128, (0.0, 1.0))
    assert (quick.num_prompts, quick.max_new_tokens, quick.temperatures, quick.gammas) == (4, 32, (0.0,), (2, 4))
    assert [(m.name, m.gamma) for m in speculative.methods(quick, has_draft=True)] == [
        ("specserve/plain", None),
        ("specserve/draft", 2),
        ("specserve/draft", 4),
        ("specserve/ngram", 4),
        ("hf/generate", None),
        ("hf/prompt_lookup", 4),
    ]
    assert len(speculative.methods(full, has_draft=True)) == 2 * (1 + 8 + 3 + 1 + 1 + 2) + 3  # + assisted γ at T=0
    mine = speculative.config_from_args(
        parse("bench", "--quick", "--num-prompts", "7", "--temperatures", "0,1", "--gammas", "3")
    )
    assert (mine.num_prompts, mine.max_new_tokens, mine.temperatures, mine.gammas) == (7, 32, (0.0, 1.0), (3,))
    assert speculative.config_from_args(parse("bench", "--quick", "--max-new-tokens", "9")).max_new_tokens == 9


def test_quick_of_the_other_benchmarks_changes_only_unset_flags() -> None:
    tree = trees.config_from_args(parse("bench-trees", "--quick", "--rounds", "3"))
    assert (tree.num_prompts, tree.max_new_tokens, tree.ks, tree.temperatures, tree.rounds) == (2, 32, (4,), (0.0,), 3)
    assert tree.calibration_prompts < trees.config_from_args(parse("bench-trees")).calibration_prompts
    drafters = learned.config_from_args(parse("bench-drafters", "--quick", "--temperatures", "1"))
    assert (drafters.num_prompts, drafters.max_new_tokens, drafters.temperatures, drafters.rounds) == (2, 32, (1.0,), 1)
    assert learned.config_from_args(parse("bench-drafters")).rounds == 2
    smoke = batch.config_from_args(parse("bench-batch", "--quick", "--concurrency", "2"))
    assert (smoke.concurrency, smoke.requests, smoke.max_new_tokens, smoke.temperatures) == ((2,), 4, 32, (0.0,))
    everything = batch.config_from_args(parse("bench-batch"))
    assert everything.concurrency == (1, 2, 4, 8, 16, 32) and everything.requests is None
    for module in (speculative, trees, learned, batch):
        parser = argparse.ArgumentParser()
        module.add_arguments(parser)
        assert "a smoke run in about a minute" in " ".join(parser.format_help().split())


# ---------------------------------------------------------------------------------------------
# End to end on tiny models, from a fresh working directory


@pytest.mark.timeout(180)
def test_bench_quick_writes_under_runs_and_prints_the_table(
    tmp_path: Path,
    saved_pairs: dict[str, Path],
    prompts: Path,
    monkeypatch: pytest.MonkeyPatch,
    capsys: pytest.CaptureFixture[str],
) -> None:
    monkeypatch.chdir(tmp_path)
    flags = [*tiny_flags(saved_pairs["llama"], prompts), "--num-prompts", "2", "--max-new-tokens", "4"]
    assert cli.main(["bench", "--quick", *flags]) == 0
    out = capsys.readouterr().out
    files = [tmp_path / "runs" / "bench" / f"speculative{suffix}" for suffix in (".json", ".md", ".png")]
    assert all(f.stat().st_size > 0 for f in files)
    assert out == files[1].read_text() + "results: runs/bench/speculative.json, speculative.md, speculative.png\n"
    report = json.loads(files[0].read_text())
    assert report["num_prompts"] == 2 and [r["method"] for r in report["rows"]] == [
        "specserve/plain", "specserve/draft", "specserve/draft", "specserve/ngram", "hf/generate", "hf/prompt_lookup"
    ]  # fmt: skip

    assert cli.main(["bench", "--quick", *flags, "--json", "--gammas", "1"]) == 0
    captured = capsys.readouterr()
    printed = json.loads(captured.out)
    assert printed == json.loads(files[0].read_text()) and captured.out.count("\n") == 1
    assert [r["gamma"] for r in printed["rows"] if r["method"] == "specserve/draft"] == [1]
    assert "results: runs/bench/speculative.json" in captured.err


@pytest.mark.timeout(180)
def test_bench_trees_quick_json(
    tmp_path: Path,
    saved_pairs: dict[str, Path],
    prompts: Path,
    monkeypatch: pytest.MonkeyPatch,
    capsys: pytest.CaptureFixture[str],
) -> None:
    monkeypatch.chdir(tmp_path)
    flags = [*tiny_flags(saved_pairs["llama"], prompts), "--max-new-tokens", "4", "--ks", "2"]
    assert cli.main(["bench-trees", "--quick", "--json", *flags]) == 0
    printed = json.loads(capsys.readouterr().out)
    assert printed == json.loads((tmp_path / "runs" / "bench-trees" / "trees.json").read_text())
    assert {r["temperature"] for r in printed["rows"]} == {0.0} and {r["k"] for r in printed["rows"]} == {0, 2}


def test_bench_serve_compares_each_modes_texts_with_the_baselines_for_the_same_requests() -> None:
    from specserve.benchmarks.serve_load import compare

    def row(concurrency: int, mode: str, texts: dict[str, str]) -> dict[str, Any]:
        return {"concurrency": concurrency, "mode": mode, "throughput_tok_s": 10.0, "itl_p50_s": 0.1,
                "ttft_p50_s": 0.2, "texts": texts}  # fmt: skip

    rows = [
        row(1, "off", {"a": "x", "b": "y"}),
        row(1, "fast", {"a": "x", "b": "z"}),  # b differs
        row(2, "off", {"c": "w"}),
        row(2, "fast", {"a": "x", "c": "w", "d": "v"}),  # a: the baseline's at level 1; d: never sent plainly
    ]
    assert [(c["same_texts"], c["compared_texts"]) for c in compare(rows)] == [(1, 2), (2, 2)]
