"""bench-drafters: every drafter kind on a tiny saved target, the headline, the report files, and the workloads
(repetitive and multi-turn prompts); model-free drafter specs are never loaded as model directories."""

from __future__ import annotations

import ast
import json
from pathlib import Path

import pytest
from conftest import TinyPair
from head_helpers import save_pard, trained_head

from specserve import cli
from specserve.benchmarks import batch, learned
from specserve.benchmarks.prompts import (
    FOLLOW_UPS,
    MULTITURN_TURNS,
    excerpt,
    heldout_files,
    multiturn_prompts,
    prose_prompts,
    renamed_identifier,
    repetitive_prompts,
)
from specserve.core.draft.spec_strings import is_model_free
from specserve.core.errors import UserError
from specserve.drafters.layerskip import ExitHead, save_exit_head
from specserve.training.corpus import load_corpus
from specserve.training.datastore import build as build_datastore
from specserve.training.medusa import heads_for

PROMPTS = ["def f(x):\n    return", "for i in range(10):", "import os\nimport sys\n"]


def datastore(models: Path, tmp_path: Path) -> Path:
    """A small REST datastore over a few lines of code, in the tiny target's tokenizer."""
    data = tmp_path / "data"
    data.mkdir()
    (data / "a.py").write_text("def f(x):\n    return x + 1\n\nfor i in range(10):\n    print(f(i))\n" * 3)
    return build_datastore(data, models / "target", tmp_path / "store.rest").path


def test_small_run_covers_every_drafter_and_writes_the_report(
    tmp_path: Path, saved_pairs: dict[str, Path], tiny_pairs: dict[str, TinyPair]
) -> None:
    pair, models = tiny_pairs["llama"], saved_pairs["llama"]
    trained_head(pair).save(tmp_path / "eagle")
    heads_for(pair.target.model, num_heads=2).save(tmp_path / "medusa")
    save_exit_head(tmp_path / "exit", ExitHead(pair.target.model.config.hidden_size).double(), pair.target, 1)
    save_pard(models / "draft", tmp_path / "pard", pard_token=0, spd_type="pard")
    prompts = tmp_path / "prompts.json"
    prompts.write_text(json.dumps(PROMPTS[:2]))
    cfg = learned.DrafterBenchConfig(
        target=str(models / "target"),
        draft=str(models / "draft"),
        eagle=str(tmp_path / "eagle"),
        medusa=str(tmp_path / "medusa"),
        exit_head=str(tmp_path / "exit"),
        pard=str(tmp_path / "pard"),
        dtype="float64",
        prompts_file=str(prompts),
        num_prompts=2,
        max_new_tokens=6,
        rounds=2,
        layerskip_layers=1,
        out_dir=tmp_path / "out",
        datastore=str(datastore(models, tmp_path)),
    )
    report = learned.run(cfg)
    for name in ("drafters.json", "drafters.md", "drafters.png"):
        assert (tmp_path / "out" / name).is_file()
    names = {row["name"] for row in report["rows"]}
    for kind in ("plain", "draft chain", "draft tree", "eagle chain", "eagle tree", "medusa tree", "pard", "layerskip"):
        assert any(name.startswith(kind) for name in names), kind
    assert "hf assisted 4" in names and "ngram chain 4" in names and "hf prompt lookup 4" in names
    for kind in (
        "ngram tree",
        "suffix chain",
        "suffix tree",
        "rest chain",
        "rest tree",
        "lookahead chain",
        "lookahead:",
    ):
        assert any(name.startswith(kind) for name in names), kind
    assert report["skipped"] == [] and report["workload"]["name"] == "code"
    for row in report["rows"]:
        assert 0 < row["new_tokens"] <= 2 * 2 * 6, row  # 2 rounds x 2 prompts x at most 6 tokens
        assert row["speedup"] is not None and row["tokens_per_second"] > 0
    assert set(report["headline"]) >= {"eagle_greedy_speedup", "speedup_met", "eagle_longest"}
    for row in report["rows"]:  # the model-free drafters' own counters reach the report
        if row["drafter"] in ("suffix", "lookahead") or row["drafter"].startswith("rest:"):
            assert row["drafter_counters"]["proposals"] > 0, row
    ratios = report["model_free"]["0"]
    assert all(ratios[key] is not None and ratios[key] > 0 for key in ratios), ratios


def test_missing_heads_are_left_out(tmp_path: Path) -> None:
    cfg = learned.DrafterBenchConfig(
        target="t", draft=str(tmp_path), eagle=str(tmp_path / "no"), medusa=str(tmp_path), exit_head=str(tmp_path),
        pard=str(tmp_path / "no"),
    )  # fmt: skip
    names = {cell.name for cell in learned.cells(cfg)}
    left_out = ("eagle", "medusa", "pard", "layerskip +", "draft", "hf assisted")
    assert not any(name.startswith(left_out) for name in names)
    assert "plain" in names and any(name.startswith("ngram") for name in names)


def test_model_free_cells_and_the_rest_cells_need_a_datastore(tmp_path: Path) -> None:
    missing = tmp_path / "missing.rest"
    cfg = learned.DrafterBenchConfig(
        target="t", draft="d", eagle="e", medusa="m", exit_head="x", pard="p", temperatures=(0.0,),
        datastore=str(missing),
    )  # fmt: skip
    names = [cell.name for cell in learned.cells(cfg)]
    assert {"suffix chain 4", "suffix tree 16 (d8 w3)", "hf prompt lookup 4", "ngram tree 16 (d8 w3)"} <= set(names)
    assert not any(name.startswith("rest") for name in names)
    notes = learned.skipped(cfg)
    assert any(note.startswith("rest chain 4: no datastore") and str(missing) in note for note in notes), notes
    assert any(note.startswith("eagle chain 4: no model directory e") for note in notes), notes
    missing.write_bytes(b"")  # the cells only check that the file is there; the drafter checks what it holds
    assert {"rest chain 4", "rest tree 16 (d8 w3)"} <= {cell.name for cell in learned.cells(cfg)}


# ---------------------------------------------------------------------------------------------
# Workloads


def test_repetitive_prompts_hold_their_source_and_ask_for_it_renamed() -> None:
    sources = heldout_files(3)
    assert len(sources) == 3
    for source, prompt in zip(sources, repetitive_prompts(sources), strict=True):
        text = excerpt(source)
        old, new = renamed_identifier(text)
        assert 200 < len(text) <= 1000 and text in source and text.endswith("\n")
        assert text.startswith(("def ", "class ", "async def ")) or source.startswith(text)
        assert prompt == f"{text}\n# The same code, with {old} renamed to {new}:\n"
        assert old in text and new == f"new_{old}"


def test_prose_prompts_stop_inside_a_module_docstring() -> None:
    """The prose workload's prompts: a held-out file's opening, cut at a line end inside its module docstring, so
    the model continues English text."""
    prompts = prose_prompts(4)
    assert len(prompts) == 4 and len(set(prompts)) == 4
    sources = [s.text for s in load_corpus("heldout")]
    for prompt in prompts:
        source = next(text for text in sources if text.startswith(prompt))
        docstring = ast.get_docstring(ast.parse(source), clean=False)
        assert docstring is not None and len(docstring) >= 400
        quote = min(i for i in (prompt.find('"""'), prompt.find("'''")) if i >= 0)
        opened = prompt[quote + 3 :]
        assert 0 < len(opened) <= len(docstring) // 2 + 1 and docstring.startswith(opened)
        assert prompt.endswith("\n") and len(prompt) <= 1000


def test_renamed_identifier_is_the_most_frequent_name() -> None:
    assert renamed_identifier("def get(self, key):\n    return self.table[key] or key") == ("key", "new_key")
    assert renamed_identifier("if x:\n    pass") == ("x", "new_x")  # keywords and short names are never renamed
    assert renamed_identifier("a = b") == ("x", "new_x")


def test_multiturn_prompts_repeat_earlier_prompts_and_outputs() -> None:
    calls: list[str] = []

    def respond(prompt: str) -> str:
        calls.append(prompt)
        return f"<output {len(calls)} of {prompt[:5]}>"

    prompts = multiturn_prompts(["opening A\n", "opening B\n"], 5, respond)
    assert len(prompts) == 5 and MULTITURN_TURNS == 3
    assert prompts[0] == "opening A\n" and prompts[3] == "opening B\n"
    assert prompts[1] == "opening A\n<output 1 of openi>" + FOLLOW_UPS[0]
    assert prompts[2].startswith(prompts[1] + "<output 2 of openi>") and "renamed to" in prompts[2]
    assert prompts[4] == prompts[3] + "<output 3 of openi>" + FOLLOW_UPS[0]
    assert calls == [prompts[0], prompts[1], prompts[3]]  # no output asked for a conversation's last turn
    assert len(multiturn_prompts(["x"], 7, respond)) == MULTITURN_TURNS  # the openings ran out


@pytest.mark.timeout(180)
def test_multiturn_run_feeds_earlier_outputs_into_later_prompts(saved_pairs: dict[str, Path], tmp_path: Path) -> None:
    models = saved_pairs["llama"]
    prompts = tmp_path / "prompts.json"
    prompts.write_text(json.dumps(PROMPTS))
    cfg = learned.DrafterBenchConfig(
        target=str(models / "target"),
        draft=str(tmp_path / "no-draft"),
        eagle=str(tmp_path / "no"),
        medusa=str(tmp_path / "no"),
        exit_head=str(tmp_path / "no"),
        pard=str(tmp_path / "no"),
        dtype="float64",
        prompts_file=str(prompts),
        num_prompts=3,
        max_new_tokens=6,
        temperatures=(0.0,),
        rounds=1,
        layerskip_layers=1,
        out_dir=tmp_path / "out",
        workload="multiturn",
        datastore=str(tmp_path / "none.rest"),
    )
    outputs: list[str] = []

    def respond(prompt: str) -> str:
        outputs.append(f"<{len(outputs)}>")
        return outputs[-1]

    texts = learned.workload_texts(cfg, respond)
    assert len(texts) == 3 and texts[0] == PROMPTS[0]  # one conversation of three turns
    assert outputs[0] in texts[1] and outputs[0] in texts[2] and outputs[1] in texts[2]
    report = learned.run(cfg)
    for name in ("drafters-multiturn.json", "drafters-multiturn.md", "drafters-multiturn.png"):
        assert (tmp_path / "out" / name).is_file()
    assert report["workload"]["name"] == "multiturn" and report["workload"]["prompts"] == 3
    names = {row["name"] for row in report["rows"]}
    assert {"plain", "suffix chain 4", "suffix tree 16 (d8 w3)", "hf prompt lookup 4"} <= names
    assert any(note.startswith("rest chain 4: no datastore") for note in report["skipped"])
    assert "skipped rest chain 4" in (tmp_path / "out" / "drafters-multiturn.md").read_text()
    for row in report["rows"]:
        assert 0 < row["new_tokens"] <= 3 * 6, row


def test_repetitive_workload_from_a_prompts_file(tmp_path: Path) -> None:
    prompts = tmp_path / "prompts.json"
    prompts.write_text(json.dumps(["import os\n\ndef walk(top):\n    return top + top\n"]))
    cfg = learned.DrafterBenchConfig(
        target="t", draft="d", eagle="e", medusa="m", exit_head="x", pard="p", prompts_file=str(prompts),
        workload="repetitive",
    )  # fmt: skip
    [text] = learned.workload_texts(cfg, lambda prompt: pytest.fail("no outputs needed"))
    assert text == "def walk(top):\n    return top + top\n\n# The same code, with top renamed to new_top:\n"


@pytest.mark.parametrize("bad", ["bogus", "Code", ""])
def test_a_bad_workload_is_a_clear_error(bad: str, capsys: pytest.CaptureFixture[str]) -> None:
    assert cli.main(["bench-drafters", "--workload", bad]) == 2
    err = capsys.readouterr().err
    assert err.startswith("error: ") and f"unknown workload {bad!r}" in err and "code, repetitive, multiturn" in err
    with pytest.raises(UserError, match="unknown workload"):
        learned.DrafterBenchConfig(target="t", draft="d", eagle="e", medusa="m", exit_head="x", pard="p", workload=bad)


def test_a_missing_datastore_flag_is_a_clear_error(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    assert cli.main(["bench-drafters", "--datastore", str(tmp_path / "nope.rest")]) == 2
    assert "nope.rest is not a file" in capsys.readouterr().err


# ---------------------------------------------------------------------------------------------
# Model-free specs


def test_model_free_specs() -> None:
    for spec in ("none", "ngram", "suffix", "rest:runs/datastore/stdlib.rest", "rest:missing.rest", "lookahead:4,3,4"):
        assert is_model_free(spec), spec
    for spec in ("models/draft", "eagle:models/eagle", "medusa:m", "layerskip:4", "layerskip:models/exit-head"):
        assert not is_model_free(spec), spec


@pytest.mark.parametrize("spec", ["suffix", "rest:store.rest", "lookahead:4,3,4"])
def test_batch_bench_does_not_load_a_model_free_drafter_as_a_model(
    spec: str, saved_pairs: dict[str, Path], tmp_path: Path
) -> None:
    prompts = tmp_path / "prompts.json"
    prompts.write_text(json.dumps(PROMPTS))
    cfg = batch.BatchBenchConfig(
        target=str(saved_pairs["llama"] / "target"), draft=spec, prompts_file=str(prompts), max_new_tokens=4
    )
    models, prompt_ids = batch.load(cfg)
    assert models.draft == spec and len(prompt_ids) == 3


def test_drafter_counters_in_words() -> None:
    assert learned.counters_summary({}) == "-"
    assert learned.counters_summary({"proposals": 4, "pool_hits": 1, "window_ngrams": 12}) == (
        "pool hits 25%, 12 window n-grams"
    )
    suffix = {"proposals": 10, "matched": 5, "match_tokens": 20, "global_matches": 1}
    assert learned.counters_summary(suffix) == "matched 50%, mean match 4.0 tokens, 20% global"
    assert learned.counters_summary({"proposals": 2, "matched": 0, "match_tokens": 0}) == "matched 0%"
