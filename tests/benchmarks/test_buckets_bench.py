"""bench/buckets.py (issue 20): its quick run writes the report with every cache's T_verify(k) and every engine's row,
outputs equal across engines; and its pieces (width lists, buckets chosen among measured widths, where two bucket
sets part, which cells run) behave on synthetic input. The CPU numbers themselves come from a full run."""

from __future__ import annotations

import json
from dataclasses import replace
from pathlib import Path

import pytest

from specserve.benchmarks import buckets
from specserve.benchmarks.buckets import BucketBenchConfig, Cell
from specserve.core.errors import UserError
from specserve.core.model.buckets import CPU_BUCKETS, VerifyBuckets


def test_quick_run_writes_every_cache_and_engine_and_outputs_match(
    tmp_path: Path, saved_pairs: dict[str, Path], capsys: pytest.CaptureFixture[str]
) -> None:
    models, out = saved_pairs["llama"], tmp_path / "out"
    argv = ["--quick", "--target", str(models / "target"), "--draft", str(models / "draft"), "--dtype", "float64",
            "--out", str(out)]  # fmt: skip
    assert buckets.main(argv) == 0
    report = json.loads((out / "buckets.json").read_text())
    assert all((out / f"buckets{suffix}").stat().st_size > 0 for suffix in (".md", ".png"))
    verify = report["verify"]
    ks = ["1", "2", "3", "4", "8"]
    assert verify["ks"] == [1, 2, 3, 4, 8] and verify["repeats"] == 3
    for cache in buckets.CACHES:
        assert list(verify["median_ms"][cache]) == ks and all(ms > 0 for ms in verify["median_ms"][cache].values())
    assert set(verify["chosen_buckets"]) <= {1, 2, 3, 4, 8} and verify["chosen_buckets"][-1] == 8
    assert verify["default_buckets"] == list(CPU_BUCKETS.widths)
    engine = report["engine"]
    chosen = VerifyBuckets(tuple(verify["chosen_buckets"]))
    expected = {(c.drafter, c.gamma, c.engine) for c in buckets.engine_cells(BucketBenchConfig(gammas=(1, 4)),
                                                                              engine["engines"], chosen)}  # fmt: skip
    assert {(r["drafter"], r["gamma"], r["engine"]) for r in engine["rows"]} == expected
    assert {("draft", 1, "dynamic"), ("ngram", 4, "bucketed")} <= expected
    assert all(r["new_tokens"] == 2 * 8 and r["tokens_per_second"] > 0 for r in engine["rows"])  # 2 rounds x 8
    assert len(engine["speedups"]) == len(engine["rows"]) - 4  # every row but the 4 dynamic ones
    assert report["outputs_match"] is True and not engine["unrepeatable"]
    assert report["environment"]["threads"] == 1
    lines = capsys.readouterr().out.strip().splitlines()
    last = json.loads(lines[-1])
    assert last["outputs_match"] is True and last["threads"] == 1 and last["buckets"] == str(out / "buckets.json")
    assert any(line.startswith("| k | dynamic | static | bucketed") for line in lines)


def test_widths_parse_as_lists_and_ranges() -> None:
    assert buckets.parse_ks("1-4,8,3", "--ks") == (1, 2, 3, 4, 8)
    assert buckets.parse_ks("64", "--ks") == (64,)
    for bad in ("", "0-3", "a", "4-x"):
        with pytest.raises(UserError, match="--ks"):
            buckets.parse_ks(bad, "--ks")


def test_buckets_are_chosen_among_the_measured_widths() -> None:
    costs = {1: 10.0, 2: 14.0, 3: 20.0, 4: 15.0, 8: 18.0}  # 5-7 unmeasured: nothing pads to them
    assert buckets.choose_among_measured(costs, 0.05).widths == (1, 2, 4, 8)
    assert buckets.choose_among_measured({**costs, 6: 12.0}, 0.05).widths == (1, 6, 8)  # 2-5 pad to a cheaper 6


def test_padding_differences_price_both_widths() -> None:
    costs = {1: 10.0, 2: 14.0, 3: 20.0, 4: 15.0, 5: 16.0, 8: 18.0}
    rows = buckets.padding_differences(costs, VerifyBuckets((1, 2, 3, 4, 8)), VerifyBuckets((1, 2, 4, 5, 8)))
    assert [(r["k"], r["default_width"], r["chosen_width"]) for r in rows] == [(3, 3, 4), (5, 8, 5)]
    assert rows[0]["default_over_chosen"] == pytest.approx(20.0 / 15.0)
    assert rows[1]["default_ms"] == 18.0 and rows[1]["chosen_ms"] == 16.0


def test_the_chosen_engine_runs_only_where_it_pads_otherwise() -> None:
    default, chosen = VerifyBuckets((1, 2, 3, 4, 8)), VerifyBuckets((1, 2, 4, 8))
    assert not buckets.pads_differently(default, chosen, 1)  # blocks of 1-2 tokens
    assert buckets.pads_differently(default, chosen, 2)  # a block of 3 runs at 3 or at 4
    cfg = BucketBenchConfig(drafters=("ngram",), gammas=(1, 2), buckets=default)
    engines = list(buckets.engine_options(cfg, chosen))
    assert engines == ["dynamic", "bucketed", "chosen"]
    assert buckets.engine_cells(cfg, engines, chosen) == [
        Cell("ngram", 1, "dynamic"),
        Cell("ngram", 1, "bucketed"),
        Cell("ngram", 2, "dynamic"),
        Cell("ngram", 2, "bucketed"),
        Cell("ngram", 2, "chosen"),
    ]
    assert list(buckets.engine_options(cfg, default)) == ["dynamic", "bucketed"]
    assert list(buckets.engine_options(replace(cfg, gammas=(1,)), chosen)) == ["dynamic", "bucketed"]


def test_speedups_divide_by_the_dynamic_engine_of_the_same_cell() -> None:
    same = {"outputs": 2, "exact": 2}
    rows = [
        {"drafter": "draft", "gamma": 4, "engine": "dynamic", "tokens_per_second": 20.0,
         "decode_tokens_per_second": 25.0, "same_as_dynamic": same},
        {"drafter": "draft", "gamma": 4, "engine": "bucketed", "tokens_per_second": 22.0,
         "decode_tokens_per_second": None, "same_as_dynamic": {"outputs": 2, "exact": 1}},
    ]  # fmt: skip
    (speedup,) = buckets.speedups(rows)
    assert speedup["speedup"] == pytest.approx(1.1) and speedup["decode_speedup"] is None
    assert speedup["outputs_equal"] is False
