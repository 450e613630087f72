"""bench-trees: its configurations, the rank calibration, and a small end-to-end run writing the report."""

from __future__ import annotations

import json
from pathlib import Path

from conftest import TinyPair

from specserve.benchmarks import trees
from specserve.core.engine import SpeculativeEngine
from specserve.drafters.registry import build_drafter_set


def test_configurations_verify_k_nodes_in_every_shape() -> None:
    cfg = trees.TreeBenchConfig(target="t", draft="d", ks=(4, 8))
    configs = trees.configurations(cfg, [0.7, 0.2, 0.05])
    assert configs[0][:3] == ("plain", "plain", 0) and configs[0][3].gamma == 0
    for k in (4, 8):
        at = [(shape, config) for _, shape, kk, config in configs if kk == k]
        assert {shape for shape, _ in at} == {"chain", "static", "dynamic"}
        for shape, config in at:
            if shape == "chain":
                assert config.gamma == k and config.tree is None
            elif shape == "static":
                assert config.tree is not None and config.tree.topology is not None
                assert config.tree.topology.size == k
            else:
                assert config.tree is not None and config.tree.budget is not None
                assert config.tree.budget.nodes == k


def test_a_drafter_that_is_the_target_always_ranks_its_token_first(tiny_pairs: dict[str, TinyPair]) -> None:
    pair = tiny_pairs["llama"]
    engine = SpeculativeEngine(pair.target, build_drafter_set("none", pair.target))
    prompts = [engine.encode(p) for p in pair.prompts[:2]]
    same = trees.calibrate_rank_probs(pair.target, pair.target, prompts, new_tokens=8, ranks=4)
    assert same[0] == 1.0 and all(p <= 1e-6 for p in same[1:])
    other = trees.calibrate_rank_probs(pair.target, pair.draft, prompts, new_tokens=8, ranks=4)
    assert sum(other) <= 1.0 + 1e-6 and all(p > 0 for p in other)


def test_small_run_writes_json_markdown_and_plot(tmp_path: Path, saved_pairs: dict[str, Path]) -> None:
    models = saved_pairs["llama"]
    prompts = tmp_path / "prompts.json"
    prompts.write_text(json.dumps(["def f(x):\n    return", "for i in range(10):", "import os\nimport sys\n"]))
    cfg = trees.TreeBenchConfig(
        target=str(models / "target"),
        draft=str(models / "draft"),
        dtype="float64",
        prompts_file=str(prompts),
        num_prompts=2,
        max_new_tokens=6,
        ks=(2,),
        temperatures=(0.0, 1.0),
        rounds=2,
        out_dir=tmp_path / "out",
    )
    report = trees.run(cfg)
    for name in ("trees.json", "trees.md", "trees.png"):
        assert (tmp_path / "out" / name).stat().st_size > 0
    rows = report["rows"]
    assert {r["shape"] for r in rows} == {"plain", "chain", "static", "dynamic"}
    greedy = {r["new_tokens"] for r in rows if r["temperature"] == 0.0}
    assert len(greedy) == 1 and 0 < greedy.pop() <= 2 * 2 * 6  # exact: every shape emits the same greedy text
    assert all(r["mean_accepted"] >= 1.0 for r in rows if r["shape"] != "plain")
    assert set(report["headline"]) == {"T=0", "T=1"}
    assert "dynamic_over_best_chain" in report["headline"]["T=0"]
    assert json.loads((tmp_path / "out" / "trees.json").read_text())["rank_probs"] == report["rank_probs"]
