"""bench/never_slower.py's table: built from the drafters' experiment reports (``--from-reports`` runs nothing), each
cell's ratios to plain decoding and to the best fixed γ, and the cells below the issue's 0.97 named."""

from __future__ import annotations

import importlib.util
import json
from pathlib import Path
from types import ModuleType

import pytest

SCRIPT = Path(__file__).resolve().parents[2] / "bench" / "never_slower.py"


def load() -> ModuleType:
    spec = importlib.util.spec_from_file_location("never_slower", SCRIPT)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def report(plain: float, fixed: float, adaptive: float) -> dict[str, object]:
    rows = [
        {"workload": "code-t0", "policy": "none", "tokens_per_second": plain},
        {"workload": "code-t0", "policy": "fixed:3", "tokens_per_second": fixed},
        {"workload": "code-t0", "policy": "adaptive", "tokens_per_second": adaptive, "mean_gamma": 2.5,
         "plain_share": 0.25, "fallbacks": 1},
    ]  # fmt: skip
    best = {"policy": "fixed:3", "tokens_per_second": fixed}
    return {"rows": rows, "workloads": {"code-t0": {"best_fixed": best, "greedy_outputs_identical": True}}}


def test_the_table_is_rebuilt_from_the_reports(tmp_path: Path) -> None:
    never_slower = load()
    for name, numbers in (("ngram", (50.0, 60.0, 63.0)), ("medusa", (50.0, 40.0, 47.0))):
        (tmp_path / name).mkdir()
        (tmp_path / name / "experiment.json").write_text(json.dumps(report(*numbers)))
    assert never_slower.main(["--drafters", "ngram,medusa", "--from-reports", "--out", str(tmp_path)]) == 0
    rows = json.loads((tmp_path / "never_slower.json").read_text())["rows"]
    assert [(r["drafter"], r["adaptive_over_plain"], r["adaptive_over_best_fixed"]) for r in rows] == [
        ("ngram", pytest.approx(1.26), pytest.approx(1.05)),
        ("medusa", pytest.approx(0.94), pytest.approx(1.175)),
    ]
    table = (tmp_path / "never_slower.md").read_text()
    assert "Cells below 0.97× plain or the best fixed γ: medusa/code-t0." in table


def test_a_missing_report_is_named(tmp_path: Path) -> None:
    with pytest.raises(SystemExit):
        load().main(["--drafters", "eagle", "--from-reports", "--out", str(tmp_path)])


def batch_report(rates: dict[str, float], concurrency: int, budgets: dict[str, int]) -> dict[str, object]:
    rows = [
        {"mode": mode, "temperature": 0.0, "concurrency": concurrency, "throughput_tok_s": rate,
         "mean_gamma": 1.5 if mode == "batched-adaptive" else None,
         "gamma_histogram": budgets if mode == "batched-adaptive" else None}
        for mode, rate in rates.items()
    ]  # fmt: skip
    return {"rows": rows, "exact": True}


def test_the_batched_runs_are_tabulated_per_level(tmp_path: Path) -> None:
    """``--batch-from``: each bench-batch report (DRAFTER-WORKLOAD.json) gives one row per temperature and level:
    adaptive over plain and over the best of the fixed γ, its share of plain rows, the cells below 0.97 named."""
    never_slower = load()
    (tmp_path / "ngram").mkdir()
    (tmp_path / "ngram" / "experiment.json").write_text(json.dumps(report(50.0, 60.0, 63.0)))
    batch = tmp_path / "batch"
    batch.mkdir()
    rates = {"sequential": 40.0, "batched-plain": 100.0, "batched-gamma-2": 120.0, "batched-gamma-3": 110.0,
             "batched-adaptive": 114.0}  # fmt: skip
    (batch / "ngram-code.json").write_text(json.dumps(batch_report(rates, 8, {"0": 1, "2": 3})))
    argv = ["--drafters", "ngram", "--from-reports", "--out", str(tmp_path), "--batch-from", str(batch)]
    assert never_slower.main(argv) == 0
    (row,) = json.loads((tmp_path / "never_slower_batch.json").read_text())["rows"]
    assert (row["workload"], row["concurrency"], row["best_fixed"], row["fixed"]) == (
        "code-t0",
        8,
        "gamma-2",
        {"2": 120.0, "3": 110.0},
    )
    assert row["adaptive_over_plain"] == pytest.approx(1.14) and row["adaptive_over_best_fixed"] == pytest.approx(0.95)
    assert row["adaptive_plain_share"] == pytest.approx(0.25)
    table = (tmp_path / "never_slower_batch.md").read_text()
    assert "| ngram | code-t0 | 8 | 100.0 | 120.0 | 110.0 | 114.0 |" in table
    assert "Cells below 0.97× plain or the best fixed γ: ngram/code-t0/8." in table
