"""`specserve generate --distributed` on the tiny llama pair: the same JSON, the same tokens as in process.

(The shipped pair's command line, in process, is tests/test_cli.py's and test_shipped_pair.py's; here the tiny pair
keeps each replica's three processes quick to load.)"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest

from specserve.cli import main

pytestmark = pytest.mark.timeout(300)


@pytest.fixture
def llama(saved_pairs: dict[str, Path]) -> Path:
    return saved_pairs["llama"]


def _generate(capsys: pytest.CaptureFixture[str], pair: Path, *extra: str) -> dict[str, Any]:
    argv = ["generate", "--prompt", "def fib(n):", "--max-new-tokens", "24", "--json", "--dtype", "float64"]
    argv += ["--target", str(pair / "target"), "--draft", str(pair / "draft"), "--gamma", "3", *extra]
    code = main(argv)
    out, err = capsys.readouterr()
    assert code == 0, err
    return dict(json.loads(out))


def test_distributed_generate_prints_the_same_json(
    capsys: pytest.CaptureFixture[str], ray_cluster: Any, llama: Path
) -> None:
    local = _generate(capsys, llama)
    for extra in (("--tp", "2"), ("--drafter-placement", "separate", "--overlap")):
        remote = _generate(capsys, llama, "--distributed", *extra)
        assert set(remote) == set(local)
        assert remote["output_ids"] == local["output_ids"], extra
        assert remote["text"] == local["text"]
        assert set(remote["stats"]) == set(local["stats"])
        assert remote["stats"]["cycles"] > 0


def test_distributed_trees_print_the_same_json(
    capsys: pytest.CaptureFixture[str], ray_cluster: Any, llama: Path
) -> None:
    """`--tree dynamic --distributed --tp 2`: the in-process tokens and the same tree shape per cycle."""
    tree = ("--tree", "dynamic", "--tree-depth", "4", "--tree-width", "2", "--tree-nodes", "8")
    local = _generate(capsys, llama, *tree)
    remote = _generate(capsys, llama, *tree, "--distributed", "--tp", "2")
    assert remote["output_ids"] == local["output_ids"]
    assert remote["stats"]["tree_shapes"] == local["stats"]["tree_shapes"] != []


def test_distributed_flags_need_distributed(capsys: pytest.CaptureFixture[str]) -> None:
    code = main(["generate", "--prompt", "x", "--tp", "2"])
    _, err = capsys.readouterr()
    assert code == 2 and "need --distributed" in err
