"""The device check (``bench/device_check.sh``): its CPU smoke run takes every path end to end (tiny random models,
both engine modes a CPU has, every drafter, transformers' baselines, T_verify(k), the random Llama) with every
output exact; asking for CUDA where there is none is one line, not a traceback; and its pieces (mismatch positions,
the budget guard, files-missing drafters, the targets' verdicts) behave on synthetic input. The GPU numbers
themselves come from a lent device, never from a test."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from collections.abc import Callable, Sequence
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch

from specserve.benchmarks import device_check
from specserve.benchmarks.device_check import (
    Budget,
    CheckConfig,
    DrafterPlan,
    Report,
    drafter_plans,
    evaluate_targets,
    first_difference,
    graph_counts,
    summarise,
)
from specserve.core.static.graphs import GraphCache

ROOT = Path(__file__).resolve().parents[2]
SECTIONS = {"load", "plain", "drafters", "verify_cost", "syncs", "batched_target", "llama_1b", "batched_llama_1b",
            "hf_static_target", "drafters_dynamic", "hf_static_llama_1b"}  # fmt: skip


def script_env() -> dict[str, str]:
    env = {**os.environ, "PYTHON": sys.executable, "OMP_NUM_THREADS": "1", "HF_HUB_OFFLINE": "1"}
    env["PYTHONPATH"] = str(ROOT)
    return env


@pytest.mark.slow
def test_quick_cpu_run_takes_every_section_and_every_output_is_exact(tmp_path: Path) -> None:
    out = tmp_path / "check"
    done = subprocess.run(
        ["bash", str(ROOT / "bench/device_check.sh"), "--quick", "--device", "cpu", "--out", str(out)],
        env=script_env(), capture_output=True, text=True, timeout=180, cwd=tmp_path,
    )  # fmt: skip
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    report = json.loads((out / "device_check.json").read_text())
    modes = ["static", "dynamic"]  # a CPU has no graphs: the static engine leads, the dynamic one follows
    assert set(report["sections"]) == SECTIONS
    assert all(entry["status"] == "ok" for entry in report["sections"].values()), report["sections"]
    runs = report["runs"]
    assert all(r.get("status", "ok") == "ok" for r in runs), [r for r in runs if r.get("status", "ok") != "ok"]
    drafters = {p.name for p in drafter_plans(Path("models"), quick=True)}
    for mode in (f"ours/{m}" for m in modes):
        ran = {r["drafter"] for r in runs if r["model"] == "target" and r["method"] == mode and r["drafter"]}
        assert ran == drafters, mode
        shapes = {r["shape"] for r in runs if r["method"] == mode and r["drafter"] == "draft model"}
        assert any(s.startswith("chain") for s in shapes) and any(s.startswith("tree") for s in shapes)
    methods = {(r["model"], r["method"]) for r in runs if r["drafter"] is None}
    for model in ("target", "llama_1b"):
        assert {(model, m) for m in ("hf/eager", "hf/static", *(f"ours/{m}" for m in modes))} <= methods
    checked = [r["exact"] for r in runs if "exact" in r]
    assert len(checked) >= len(modes) * (len(drafters) + 1) and all(e["exact"] == e["outputs"] == 2 for e in checked)
    for model in ("target", "llama_1b"):
        assert set(report["verify_cost"][model]["ms_by_k"]) == set(modes)
    targets = {t["target"]: t for t in report["targets"]}
    exactness = next(t for name, t in targets.items() if name.startswith("greedy exactness"))
    assert exactness["status"] == "PASS" and exactness["value"] == 100.0
    assert next(t for name, t in targets.items() if name.startswith("import closure"))["status"] == "PASS"
    graphed = next(t for name, t in targets.items() if "CUDA graphs" in name)
    assert graphed["status"] == "NOT EVALUATED"  # no graphs on a CPU: said, not guessed
    assert not {"ray", "llguidance", "pydantic"} & set(report["environment"]["loaded_packages"])
    last = json.loads(done.stdout.strip().splitlines()[-1])
    assert last["device_check"] == str(out / "device_check.json")
    assert "PASS" in done.stdout and (out / "device_check.png").is_file()
    # the batched section: every level, ours (plain, and γ 3 with the draft model) and transformers' batching
    batched = report["batched"]
    assert all(r["status"] == "ok" for r in batched), [r for r in batched if r["status"] != "ok"]
    for model, names in (("target", {"ours/batched-plain", "ours/batched-gamma-3", "hf/generate-batch"}),
                         ("llama_1b", {"ours/batched-plain", "hf/generate-batch"})):  # fmt: skip
        assert {(r["method"], r["concurrency"]) for r in batched if r["model"] == model} == {
            (m, c) for m in names for c in (1, 4)
        }
    for row in batched:
        assert row["tokens"] == row["requests"] * 16 and row["tokens_per_second"] > 0
        if row["model"] == "target" and row["method"].startswith("ours/"):  # greedy, float64: equal one at a time
            assert row["equal_to_one_at_a_time"] == row["requests"] and row["attention"] == "ragged", row
    counts = report["sections"]["batched_target"]["step_counts"]
    assert list(counts) == ["eager"] and counts["eager"]["status"].startswith("not counted")  # graphed on CUDA only
    costs = report["sections"]["batched_target"]["step_costs"]  # T(rows, width), rows 1..4, and the buckets it implies
    assert set(costs["ms"]) == {"ordinary", "captured"} and set(costs["ms"]["captured"]["4"]) == {"1", "2", "3", "4"}
    assert not costs["graphed"] and all(set(b) <= {1, 2, 3, 4} and 4 in b for b in costs["row_buckets"].values())
    equal = next(t for name, t in targets.items() if name.startswith("batched greedy outputs"))
    assert equal["status"] == "PASS" and equal["value"] == 100.0


@pytest.mark.skipif(torch.cuda.is_available(), reason="this machine has CUDA")
def test_asking_for_cuda_without_it_is_one_clear_line(tmp_path: Path) -> None:
    done = subprocess.run(
        [sys.executable, str(ROOT / "bench/device_check.py"), "--device", "cuda", "--out", str(tmp_path)],
        env=script_env(), capture_output=True, text=True, timeout=120, cwd=tmp_path,
    )  # fmt: skip
    assert done.returncode == 2
    lines = done.stderr.strip().splitlines()
    assert len(lines) == 1 and "CUDA" in lines[0] and "--device cpu" in lines[0], done.stderr
    assert "Traceback" not in done.stderr + done.stdout
    assert not (tmp_path / "device_check.json").exists()


# ---------------------------------------------------------------------------------------------
# Pieces


def test_first_difference_counts_a_shorter_output_as_a_difference() -> None:
    assert first_difference([1, 2, 3], [1, 2, 3]) is None
    assert first_difference([1, 5, 3], [1, 2, 3]) == 1
    assert first_difference([1, 2], [1, 2, 3]) == 2  # one stopped at EOS, the other did not
    assert first_difference([], []) is None


def test_the_budget_skips_what_does_not_fit_and_says_so() -> None:
    budget = Budget(60.0)
    assert budget.allows(10.0) and not budget.allows(55.0)
    assert budget.skip_reason(55.0).startswith("skipped: budget")
    report = Report(CheckConfig(out_dir=Path("unused")), Budget(0.0))
    report.save = lambda: Path("unused")  # type: ignore[method-assign]
    ran = []
    report.section("never", 1.0, lambda: ran.append(1) or {})  # type: ignore[func-returns-value]
    assert not ran and report.data["sections"]["never"]["status"].startswith("skipped: budget")


def test_a_failing_section_is_recorded_and_the_run_goes_on(tmp_path: Path) -> None:
    report = Report(CheckConfig(out_dir=tmp_path), Budget(600.0))

    def broken() -> dict[str, object]:
        raise RuntimeError("kernel exploded")

    report.section("broken", 1.0, broken)
    report.section("fine", 1.0, lambda: {"answer": 42})
    sections = json.loads((tmp_path / "device_check.json").read_text())["sections"]
    assert sections["broken"]["status"] == "error" and "kernel exploded" in sections["broken"]["error"]
    assert sections["fine"]["status"] == "ok" and sections["fine"]["answer"] == 42


def test_a_drafter_whose_files_are_missing_is_skipped_with_that_reason(tmp_path: Path) -> None:
    plans = {p.name: p for p in drafter_plans(tmp_path, quick=False)}
    assert plans["ngram"].missing() is None  # model-free
    assert plans["eagle"].missing() == f"skipped: files missing ({tmp_path / 'eagle'})"
    (tmp_path / "eagle").mkdir()
    (tmp_path / "eagle" / "config.json").write_text("{}")
    assert plans["eagle"].missing() is None
    assert DrafterPlan("x", "x").missing() is None


class FakeBackend:
    """Captures nothing: replaying does nothing and hands back what the step returned at capture."""

    def capture(self, run: Callable[[], Sequence[torch.Tensor]]) -> tuple[Callable[[], None], tuple[torch.Tensor, ...]]:
        outputs = tuple(run())
        return lambda: None, outputs


def test_graph_counts_say_whether_the_graphed_engine_replayed_graphs() -> None:
    graphs = GraphCache(FakeBackend())
    step = lambda tensors: (tensors[0] + 1,)  # noqa: E731
    for _ in range(3):
        graphs.run("k1", step, [torch.zeros(2)])
    graphs.run("k1", step, [torch.zeros(3)])  # another shape: eager
    engine = SimpleNamespace(static=SimpleNamespace(graphs=graphs))
    counts = graph_counts(engine)  # type: ignore[arg-type]
    assert counts == {"captured": 1, "replays": 3, "eager_runs": 1, "failures": {}}
    assert graph_counts(SimpleNamespace(static=None)) is None  # type: ignore[arg-type]
    assert graph_counts(SimpleNamespace(static=SimpleNamespace(graphs=GraphCache(None)))) is None  # type: ignore[arg-type]


def plain(method: str, rate: float) -> dict[str, object]:
    return {"model": "target", "method": method, "drafter": None, "shape": "plain", "tokens_per_second": rate}


def test_targets_pass_fail_and_not_evaluated() -> None:
    report = Report(CheckConfig(out_dir=Path("unused")), Budget(600.0))
    exact = {"outputs": 8, "exact": 8, "mismatches": []}
    report.runs.extend([
        plain("hf/eager", 100.0), plain("ours/graphs", 250.0), plain("ours/static", 90.0),
        {"model": "target", "method": "ours/graphs", "drafter": "ngram", "shape": "chain 8",
         "tokens_per_second": 700.0, "exact": exact},
        {"model": "target", "method": "ours/graphs", "drafter": "eagle", "shape": "chain 4",
         "tokens_per_second": 500.0, "exact": {**exact, "exact": 7}},
    ])  # fmt: skip
    summarise(report)
    verdicts = [(t["target"], t["status"], t["value"]) for t in evaluate_targets(report)]

    def verdict(words: str) -> tuple[str, float | None]:
        (found,) = [(status, value) for name, status, value in verdicts if words in name]
        return found

    assert verdict("with CUDA graphs") == ("PASS", 2.5)
    assert verdict("static shapes") == ("FAIL", 0.9)
    assert verdict("dynamic cache") == ("NOT EVALUATED", None)  # not measured
    assert verdict("best drafter") == ("PASS", 7.0 / 2.5)
    assert verdict("greedy exactness") == ("FAIL", 100.0 * 15 / 16)


def test_quick_settings_shrink_the_run_but_flags_win() -> None:
    cfg = device_check.parse_args(["--quick", "--device", "cpu", "--max-new-tokens", "5"])
    assert cfg.quick and cfg.num_prompts == 2 and cfg.max_new_tokens == 5 and cfg.dtype == "float64"
    assert cfg.llama == device_check.LLAMA_TINY
    full = device_check.parse_args([])
    assert full.device == "cuda" and full.num_prompts == 8 and full.max_new_tokens == 128
    assert full.llama == device_check.LLAMA_1B and full.dtype == "float32"


def test_batched_targets_take_the_faster_of_a_method_and_its_graphed_run() -> None:
    from specserve.benchmarks.device_batch import batched_targets
    from specserve.benchmarks.device_check import target_entry

    def row(model: str, method: str, concurrency: int, rate: float, equal: int = 4) -> dict[str, object]:
        return {"model": model, "method": method, "concurrency": concurrency, "status": "ok", "requests": 4,
                "tokens_per_second": rate, "equal_to_one_at_a_time": equal}  # fmt: skip

    rows = [
        row("llama_1b", "ours/batched-plain", 64, 300.0),
        row("llama_1b", "ours/batched-plain-graphed", 64, 900.0),
        row("llama_1b", "hf/generate-batch", 64, 500.0),
        row("target", "ours/batched-plain", 16, 1000.0),
        row("target", "ours/batched-plain-graphed", 16, 800.0),
        row("target", "ours/batched-gamma-3-graphed", 16, 1500.0, equal=3),
        {"model": "target", "method": "ours/batched-gamma-3", "concurrency": 16, "status": "error"},
    ]
    plain, speculative, equal = batched_targets(rows, target_entry)
    assert plain["value"] == pytest.approx(900.0 / 500.0) and plain["status"] == "PASS"
    assert speculative["value"] == pytest.approx(1500.0 / 1000.0) and speculative["status"] == "PASS"
    assert equal["value"] == pytest.approx(100.0 * 11 / 12) and equal["status"] == "FAIL"
