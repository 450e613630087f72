"""`specserve train eagle|medusa|exit-head|pard`: each trains a head (or adapts the draft model) for a tiny saved target
on a user's folder,
writes a loadable HF-style directory with a card and a summary, resumes from its checkpoints, and the
result drafts through `specserve generate --draft ...` without changing the output. An EAGLE-3 head is saved in
both published layouts (SafeAILab's, and vLLM's speculators format)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from conftest import TinyPair, build_model

from specserve.cli import main

SPECS = {"eagle": "eagle:", "medusa": "medusa:", "exit-head": "layerskip:", "pard": "pard:"}


def run_cli(capsys: pytest.CaptureFixture[str], *argv: str) -> tuple[int, str, str]:
    code = main(list(argv))
    out, err = capsys.readouterr()
    return code, out, err


@pytest.fixture(scope="module")
def data_folder(tmp_path_factory: pytest.TempPathFactory) -> Path:
    root = tmp_path_factory.mktemp("data")
    for i in range(12):
        body = "".join(f"def f{j}(x):\n    return x + {j * i}\n\n" for j in range(20))
        (root / f"module_{i}.py").write_text(body)
    (root / "notes.bin").write_bytes(b"\x00\x01")  # not text: ignored
    return root


@pytest.mark.parametrize("what", ["eagle", "medusa", "exit-head", "pard"])
def test_train_a_head_then_draft_with_it(
    what: str, capsys: pytest.CaptureFixture[str], saved_pair_dirs: dict[str, Path], data_folder: Path, tmp_path: Path
) -> None:
    target, out = str(saved_pair_dirs["target"]), tmp_path / what
    argv = ["train", what, "--target", target, "--data", str(data_folder), "--out", str(out), "--steps", "4"]
    argv += ["--batch-size", "2", "--seq-len", "16", "--max-tokens", "3000"]
    argv += ["--layers", "1"] if what == "exit-head" else []
    argv += ["--init-from", str(saved_pair_dirs["draft"])] if what == "pard" else []  # the tiny pair's draft model
    code, _, stderr = run_cli(capsys, *argv)
    assert code == 0, stderr
    assert f"--draft {SPECS[what]}{out}" in stderr
    for name in ("config.json", "model.safetensors", "README.md", "training_summary.json"):
        assert (out / name).is_file(), name
    assert (out / "checkpoints" / "checkpoint.pt").is_file()
    summary = json.loads((out / "training_summary.json").read_text())
    assert summary["train"]["resumed_from_step"] == 0

    code, _, stderr = run_cli(capsys, *argv)  # a rerun resumes at the last step: nothing left to train
    assert code == 0, stderr
    assert json.loads((out / "training_summary.json").read_text())["train"]["resumed_from_step"] == 4

    common = ["generate", "--target", target, "--prompt", "def f(x):", "--max-new-tokens", "12", "--json"]
    code, drafted, stderr = run_cli(capsys, *common, "--draft", f"{SPECS[what]}{out}")
    assert code == 0, stderr
    code, plain, stderr = run_cli(capsys, *common, "--draft", "none")
    assert json.loads(drafted)["output_ids"] == json.loads(plain)["output_ids"]


def test_an_eagle3_head_is_trained_and_saved_in_both_published_layouts(
    capsys: pytest.CaptureFixture[str],
    tiny_pairs: dict[str, TinyPair],
    data_folder: Path,
    tmp_path: Path,
) -> None:
    """`train eagle --layout eagle3`: SafeAILab's layout in OUT, the speculators format in OUT/speculators; both load
    through --draft eagle:DIR and decode exactly the target's greedy text."""
    target = tmp_path / "deep-target"  # EAGLE-3 reads the inputs of layers 2, L/2, L-3: a deeper tiny target
    build_model("llama", num_layers=8).save_pretrained(target)
    assert tiny_pairs["llama"].target.tokenizer is not None
    tiny_pairs["llama"].target.tokenizer.save_pretrained(target)
    out = tmp_path / "eagle3"
    argv = ["train", "eagle", "--layout", "eagle3", "--draft-vocab", "40", "--target", str(target), "--out", str(out)]
    argv += ["--data", str(data_folder), "--steps", "3", "--batch-size", "2", "--seq-len", "16", "--max-tokens", "3000"]
    code, _, stderr = run_cli(capsys, *argv)
    assert code == 0, stderr
    config = json.loads((out / "config.json").read_text())
    assert config["architectures"] == ["LlamaForCausalLMEagle3"] and config["draft_vocab_size"] == 40
    speculators = json.loads((out / "speculators" / "config.json").read_text())
    assert speculators["speculators_config"]["verifier"]["name_or_path"] == str(target)
    common = ["generate", "--target", str(target), "--prompt", "def f(x):", "--max-new-tokens", "12", "--json"]
    code, plain, stderr = run_cli(capsys, *common, "--draft", "none")
    assert code == 0, stderr
    for head in (out, out / "speculators"):
        code, drafted, stderr = run_cli(capsys, *common, "--draft", f"eagle:{head}")
        assert code == 0, stderr
        assert json.loads(drafted)["output_ids"] == json.loads(plain)["output_ids"]
    assert "--layout eagle3 --draft-vocab 40 --speculative-tokens 4 --steps 3" in (out / "README.md").read_text()
    # a published-layout head continues training (its config does not record the target's depth)
    code, _, stderr = run_cli(
        capsys, *[a if a != str(out) else str(tmp_path / "next") for a in argv], "--init-from", str(out)
    )
    assert code == 0, stderr
    assert json.loads((tmp_path / "next" / "training_summary.json").read_text())["init_from"]["path"] == str(out)


def test_bad_train_arguments_get_one_clear_line(capsys: pytest.CaptureFixture[str], tmp_path: Path) -> None:
    code, _, err = run_cli(capsys, "train", "eagle", "--target", str(tmp_path / "nowhere"), "--out", str(tmp_path))
    assert code == 2 and "no config.json" in err
    code, _, err = run_cli(capsys, "train", "medusa", "--steps", "0", "--out", str(tmp_path))
    assert code == 2 and "--steps must be >= 1" in err
    code, _, err = run_cli(capsys, "train", "eagle", "--feature-layers", "a,b", "--out", str(tmp_path))
    assert code == 2 and "--feature-layers" in err


def test_an_eagle_head_can_continue_from_a_trained_one(
    capsys: pytest.CaptureFixture[str], saved_pair_dirs: dict[str, Path], data_folder: Path, tmp_path: Path
) -> None:
    target = str(saved_pair_dirs["target"])
    common = ["--target", target, "--data", str(data_folder), "--steps", "3", "--batch-size", "2", "--seq-len", "16"]
    code, _, stderr = run_cli(capsys, "train", "eagle", *common, "--out", str(tmp_path / "first"))
    assert code == 0, stderr
    code, _, stderr = run_cli(
        capsys, "train", "eagle", *common, "--out", str(tmp_path / "next"), "--init-from", str(tmp_path / "first")
    )
    assert code == 0, stderr
    summary = json.loads((tmp_path / "next" / "training_summary.json").read_text())
    assert summary["init_from"]["path"] == str(tmp_path / "first") and summary["init_from"]["recipe"]["steps"] == 3
    assert "Continued from" in (tmp_path / "next" / "README.md").read_text()
    code, _, stderr = run_cli(capsys, "train", "eagle", *common, "--out", str(tmp_path / "x"), "--init-from", target)
    assert code == 2 and "not an EAGLE head" in stderr
