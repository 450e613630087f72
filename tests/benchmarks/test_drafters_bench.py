"""bench-drafters: every drafter kind on a tiny saved target, the headline, and the report files."""

from __future__ import annotations

import json
from pathlib import Path

from conftest import TinyPair
from head_helpers import trained_head

from specserve.benchmarks import learned
from specserve.drafters.layerskip import ExitHead, save_exit_head
from specserve.training.medusa import heads_for


def test_small_run_covers_every_drafter_and_writes_the_report(
    tmp_path: Path, saved_pairs: dict[str, Path], tiny_pairs: dict[str, TinyPair]
) -> None:
    pair, models = tiny_pairs["llama"], saved_pairs["llama"]
    trained_head(pair).save(tmp_path / "eagle")
    heads_for(pair.target.model, num_heads=2).save(tmp_path / "medusa")
    save_exit_head(tmp_path / "exit", ExitHead(pair.target.model.config.hidden_size).double(), pair.target, 1)
    prompts = tmp_path / "prompts.json"
    prompts.write_text(json.dumps(["def f(x):\n    return", "for i in range(10):"]))
    cfg = learned.DrafterBenchConfig(
        target=str(models / "target"),
        draft=str(models / "draft"),
        eagle=str(tmp_path / "eagle"),
        medusa=str(tmp_path / "medusa"),
        exit_head=str(tmp_path / "exit"),
        dtype="float64",
        prompts_file=str(prompts),
        num_prompts=2,
        max_new_tokens=6,
        rounds=2,
        layerskip_layers=1,
        out_dir=tmp_path / "out",
    )
    report = learned.run(cfg)
    for name in ("drafters.json", "drafters.md", "drafters.png"):
        assert (tmp_path / "out" / name).is_file()
    names = {row["name"] for row in report["rows"]}
    for kind in ("plain", "draft chain", "draft tree", "eagle chain", "eagle tree", "medusa tree", "layerskip"):
        assert any(name.startswith(kind) for name in names), kind
    assert "hf assisted 4" in names and "ngram chain 4" in names
    for row in report["rows"]:
        assert 0 < row["new_tokens"] <= 2 * 2 * 6, row  # 2 rounds x 2 prompts x at most 6 tokens
        assert row["speedup"] is not None and row["tokens_per_second"] > 0
    assert set(report["headline"]) >= {"eagle_greedy_speedup", "speedup_met", "eagle_longest"}


def test_missing_heads_are_left_out(tmp_path: Path) -> None:
    cfg = learned.DrafterBenchConfig(
        target="t", draft=str(tmp_path), eagle=str(tmp_path / "no"), medusa=str(tmp_path), exit_head=str(tmp_path)
    )
    names = {cell.name for cell in learned.cells(cfg)}
    assert not any(name.startswith(("eagle", "medusa", "layerskip +", "draft", "hf")) for name in names)
    assert "plain" in names and any(name.startswith("ngram") for name in names)
