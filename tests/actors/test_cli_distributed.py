"""`specserve generate --distributed` on the shipped pair: the same JSON, the same tokens as in process."""

from __future__ import annotations

import json
from typing import Any

import pytest

from specserve import defaults
from specserve.cli import main

pytestmark = pytest.mark.timeout(300)


def _generate(capsys: pytest.CaptureFixture[str], *extra: str) -> dict[str, Any]:
    argv = ["generate", "--prompt", "import os\n", "--max-new-tokens", "24", "--json", "--dtype", "float64"]
    argv += ["--draft", str(defaults.DEFAULT_DRAFT), "--gamma", "3", *extra]
    code = main(argv)
    out, err = capsys.readouterr()
    assert code == 0, err
    return dict(json.loads(out))


def test_distributed_generate_prints_the_same_json(capsys: pytest.CaptureFixture[str], ray_cluster: Any) -> None:
    local = _generate(capsys)
    for extra in (("--tp", "2"), ("--drafter-placement", "separate", "--overlap")):
        remote = _generate(capsys, "--distributed", *extra)
        assert set(remote) == set(local)
        assert remote["output_ids"] == local["output_ids"], extra
        assert remote["text"] == local["text"]
        assert set(remote["stats"]) == set(local["stats"])
        assert remote["stats"]["cycles"] > 0


def test_distributed_trees_print_the_same_json(capsys: pytest.CaptureFixture[str], ray_cluster: Any) -> None:
    """`--tree dynamic --distributed --tp 2`: the in-process tokens and the same tree shape per cycle."""
    tree = ("--tree", "dynamic", "--tree-depth", "4", "--tree-width", "2", "--tree-nodes", "8")
    local = _generate(capsys, *tree)
    remote = _generate(capsys, *tree, "--distributed", "--tp", "2")
    assert remote["output_ids"] == local["output_ids"]
    assert remote["stats"]["tree_shapes"] == local["stats"]["tree_shapes"] != []


def test_distributed_flags_need_distributed(capsys: pytest.CaptureFixture[str]) -> None:
    code = main(["generate", "--prompt", "x", "--tp", "2"])
    _, err = capsys.readouterr()
    assert code == 2 and "need --distributed" in err
