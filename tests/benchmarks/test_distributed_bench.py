"""The distributed benchmark runs end to end on tiny models and checks its own outputs against the engine."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest

from specserve.benchmarks import distributed


@pytest.mark.timeout(300)
def test_distributed_bench_smoke(tmp_path: Path, saved_pairs: dict[str, Path], ray_cluster: Any) -> None:
    models = saved_pairs["llama"]
    cfg = distributed.DistributedBenchConfig(
        target=str(models / "target"),
        draft=str(models / "draft"),
        max_new_tokens=12,
        gamma=3,
        tp_degrees=(1,),
        threads=1,
        out_dir=tmp_path,
        prompts=("abcabcabc", "hello wor"),
    )
    report = distributed.run(cfg)
    names = [row["method"] for row in report["rows"]]
    assert names == ["in-process", "colocated/tp1", "separate+overlap/tp1"]
    for row in report["rows"][1:]:
        assert row["identical_to_in_process"] is True
        assert row["cycles"] > 0 and row["tokens"] > 0
        assert row["cycle_ms"] >= row["verify_ms"] >= row["allreduce_ms"] >= 0
    assert json.loads((tmp_path / "distributed.json").read_text())["rows"] == report["rows"]
    assert (tmp_path / "distributed.md").read_text().startswith("| method |")
    assert (tmp_path / "distributed.png").stat().st_size > 0
