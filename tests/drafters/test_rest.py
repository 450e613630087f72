"""Tests of REST retrieval drafting: the datastore (suffix array, file format, lookups), the ``rest:FILE`` drafter,
exactness in the engine (in process, batched, distributed), its errors, and ``specserve datastore build``.

The suffix array and the lookups are checked against brute force on random token arrays (hypothesis); the
engine runs over a datastore built from the tiny targets' own greedy continuations and perturbed copies of
them (so drafts are often but not always right) and must give exactly transformers' greedy output.
"""

from __future__ import annotations

import struct
import tempfile
from collections import Counter
from collections.abc import Callable, Iterator, Sequence
from pathlib import Path
from typing import Any

import numpy as np
import pytest
from conftest import EOS_ID, REF_TOKENS, VOCAB, TinyPair, assert_pool_empty, char_tokenizer, finish_all, hf_greedy_ids
from hypothesis import given, settings
from hypothesis import strategies as st
from stats_helpers import batched_runs, check_single_engine_agrees, two_token_fit

from specserve.cli import main
from specserve.core.batch_engine import BatchedEngine
from specserve.core.draft.drafter import Drafter, TreeDrafter
from specserve.core.draft.spec_strings import InvalidDrafterSpec, absolute_spec, check_drafter_spec
from specserve.core.engine import SpeculativeEngine
from specserve.core.errors import UserError
from specserve.core.model.causal_lm import CausalLM
from specserve.core.request import GenerationConfig
from specserve.core.sampling.params import SamplingParams
from specserve.core.sampling.warps import make_generators
from specserve.core.tree.draft_tree import DraftTree
from specserve.core.tree.shapes import ROOT, TreeBudget, TreeSpec, TreeTopology
from specserve.drafters.datastore import (
    HEADER_SIZE,
    Datastore,
    DatastoreError,
    build_datastore,
    suffix_array,
    tokenizer_fingerprint,
)
from specserve.drafters.registry import build_drafter, request_drafters
from specserve.drafters.rest import CountTrie, RestDrafter

HfGreedy = Callable[[CausalLM, Sequence[int], int], list[int]]
GREEDY = SamplingParams()
ALPHA = 1e-3  # each chi-square test fails a correct drafter with probability 1e-3 (seeds are fixed)
FINGERPRINT = tokenizer_fingerprint(char_tokenizer())
SEP = VOCAB  # the separator build_datastore's callers use: the id past the vocabulary
TREES = {
    "dynamic": TreeSpec("dynamic", budget=TreeBudget(depth=4, width=3, nodes=10)),
    "static": TreeSpec("static", topology=TreeTopology.from_lists([[0], [1], [0, 0], [1, 0], [0, 1], [0, 0, 0]])),
}


def write(tokens: Sequence[int], path: Path, vocab_size: int = VOCAB, fingerprint: bytes = FINGERPRINT) -> Datastore:
    build_datastore(np.asarray(tokens, dtype=np.uint32), path, vocab_size=vocab_size, fingerprint=fingerprint)
    return Datastore.open(path)


def joined(texts: Sequence[Sequence[int]], separator: int = SEP) -> list[int]:
    return [token for text in texts for token in (*text, separator)]


# ---------------------------------------------------------------------------------------------
# The suffix array and lookups, against brute force


def brute_suffix_array(tokens: Sequence[int]) -> list[int]:
    return sorted(range(len(tokens)), key=lambda i: list(tokens[i:]))


@settings(max_examples=200, deadline=None)
@given(st.lists(st.integers(0, 3), max_size=80) | st.lists(st.integers(0, 200), max_size=40))
def test_suffix_array_equals_a_brute_force_sort(tokens: list[int]) -> None:
    assert suffix_array(np.asarray(tokens, dtype=np.uint32)).tolist() == brute_suffix_array(tokens)


def test_suffix_array_of_long_repeats() -> None:
    tokens = [1] * 300 + [2, 1] * 100 + [0]  # many doubling rounds
    assert suffix_array(np.asarray(tokens)).tolist() == brute_suffix_array(tokens)


def brute_lookup(
    corpus: Sequence[int], context: Sequence[int], depth: int, max_length: int, min_occurrences: int
) -> tuple[int, int, Counter[tuple[int, ...]]]:
    """(matched length, occurrences, continuation counts) by scanning every position."""
    for length in range(min(max_length, len(context)), 0, -1):
        pattern = list(context[len(context) - length :])
        starts = [i for i in range(len(corpus) - length + 1) if list(corpus[i : i + length]) == pattern]
        if len(starts) >= min_occurrences:
            counts: Counter[tuple[int, ...]] = Counter()
            for start in starts:
                after = list(corpus[start + length : start + length + depth])
                cut = after.index(SEP) if SEP in after else len(after)
                if cut:
                    counts[tuple(after[:cut])] += 1
            return length, len(starts), counts
    return 0, 0, Counter()


@settings(max_examples=150, deadline=None)
@given(
    texts=st.lists(st.lists(st.integers(3, 6), max_size=30), min_size=1, max_size=4),
    context=st.lists(st.integers(3, 6), min_size=1, max_size=10),
    depth=st.integers(1, 5),
    max_length=st.integers(1, 6),
    min_occurrences=st.integers(1, 3),
)
def test_lookup_equals_brute_force(
    texts: list[list[int]], context: list[int], depth: int, max_length: int, min_occurrences: int
) -> None:
    corpus = joined(texts)
    with tempfile.TemporaryDirectory() as directory:
        datastore = write(corpus, Path(directory) / "d.rest")
        match = datastore.lookup(context, depth, max_length, min_occurrences, max_occurrences=10_000)
        length, occurrences, counts = brute_lookup(corpus, context, depth, max_length, min_occurrences)
        assert (match.length, match.occurrences) == (length, occurrences)
        assert dict(match.continuations) == dict(counts)
        # a capped lookup counts only real continuations of the matched suffix, at most the cap of them
        capped = datastore.lookup(context, depth, max_length, min_occurrences, max_occurrences=2)
        assert capped.length == length and capped.sampled <= 2
        assert all(counts[tokens] >= count for tokens, count in capped.continuations)


def test_lookup_prefers_the_longest_suffix_and_counts_continuations(tmp_path: Path) -> None:
    corpus = joined([[10, 11, 12, 13], [10, 11, 12, 14], [9, 11, 12, 14, 15], [11, 12]])
    datastore = write(corpus, tmp_path / "d.rest")
    match = datastore.lookup([10, 11, 12], depth=2)
    assert (match.length, match.occurrences) == (3, 2)
    assert dict(match.continuations) == {(13,): 1, (14,): 1}  # cut at the separator
    match = datastore.lookup([8, 11, 12], depth=2)  # [8, 11, 12] never occurs; [11, 12] four times
    assert (match.length, match.occurrences) == (2, 4)
    assert dict(match.continuations) == {(13,): 1, (14,): 1, (14, 15): 1}  # the last occurrence ends its file
    assert datastore.lookup([10, 11, 12], depth=2, min_occurrences=3).length == 2  # shorter, seen often enough
    assert datastore.lookup([50], depth=2).continuations == ()


# ---------------------------------------------------------------------------------------------
# The count trie and the drafter's proposals


def test_count_trie_ranks_children_by_frequency() -> None:
    trie = CountTrie.build([((1, 2, 3), 2), ((1, 4), 3), ((5,), 4), ((1, 2, 6), 1)])
    # root: 1 (6 = 2 + 3 + 1) before 5 (4); under 1: 4 (3) before 2 (3 = 2 + 1): ties by token
    assert trie.trie.tokens[:2] == (1, 5) and trie.counts[:2] == (6, 4)
    assert [trie.trie.tokens[n] for n in trie.trie.children[1]] == [2, 4]  # node 0's children
    assert trie.chain() == [1, 2, 3]
    # the most frequent nodes first: 1 (6), 5 (4), 2 (3), 4 (3), 3 (2), 6 (1)
    assert [trie.trie.tokens[n] for n in trie.select_budget(TreeBudget(3, 3, 10))] == [1, 5, 2, 4, 3, 6]
    assert [trie.trie.tokens[n] for n in trie.select_budget(TreeBudget(3, 1, 10))] == [1, 2, 3]
    assert [trie.trie.tokens[n] for n in trie.select_budget(TreeBudget(2, 3, 3))] == [1, 5, 2]
    assert CountTrie.build([]).chain() == []


def test_the_drafter_proposes_the_most_frequent_continuations(tmp_path: Path) -> None:
    corpus = joined([[20, 21, 22, 23], [20, 21, 22, 23], [20, 21, 24, 25], [20, 26]])
    drafter = RestDrafter(write(corpus, tmp_path / "d.rest"))
    assert isinstance(drafter, Drafter) and isinstance(drafter, TreeDrafter)
    drafter.start([7, 20], GREEDY, make_generators(0).draft)
    draft = drafter.propose(3)
    assert draft.tokens.tolist() == [21, 22, 23] and draft.draft_probs is None
    tree = drafter.propose_tree(TreeSpec("dynamic", budget=TreeBudget(depth=3, width=2, nodes=5)))
    assert tree.child_probs is None
    # by count: 21 (3), 22 (2), 23 (2), then 26 (1) before 24 (1): shallower first
    assert tree.tokens.tolist() == [21, 22, 23, 26, 24] and tree.parents == (ROOT, 0, 1, ROOT, 0)
    static = drafter.propose_tree(TREES["static"])
    assert {tuple(static.path_tokens(i)) for i in range(static.size)} == {
        (21,), (26,), (21, 22), (21, 24), (21, 22, 23)
    }  # fmt: skip
    drafter.accept([21, 24])  # the history now ends ... 20 21 24: 25 followed once
    assert drafter.propose(3).tokens.tolist() == [25]
    drafter.rewind(1)  # back to [7]: never seen
    assert drafter.propose(3).gamma == 0 and drafter.propose_tree(TREES["dynamic"]).size == 0
    assert drafter.fresh().datastore is drafter.datastore


@pytest.mark.parametrize("seed", range(20))
def test_dynamic_trees_respect_the_budget_and_hold_seen_paths(seed: int, tmp_path: Path) -> None:
    rng = np.random.default_rng(seed)
    corpus = joined([rng.integers(3, 7, size=int(rng.integers(5, 40))).tolist() for _ in range(4)])
    datastore = write(corpus, tmp_path / "d.rest")
    drafter = RestDrafter(datastore)
    drafter.start(rng.integers(3, 7, size=5).tolist(), GREEDY, make_generators(0).draft)
    budget = TreeBudget(depth=int(rng.integers(1, 5)), width=int(rng.integers(1, 4)), nodes=int(rng.integers(1, 12)))
    tree = drafter.propose_tree(TreeSpec("dynamic", budget=budget))
    DraftTree(tree.tokens, tree.parents)  # valid: parents come first
    assert tree.size <= budget.nodes and tree.depth <= budget.depth
    assert all(len(children) <= budget.width for children in tree.children)
    seen = [list(tokens) for tokens, _ in drafter.lookup(budget.depth).continuations]
    assert all(any(tree.path_tokens(i) == s[: len(tree.path_tokens(i))] for s in seen) for i in range(tree.size))
    chain = drafter.propose(budget.depth).tokens.tolist()
    if tree.size:
        assert chain[0] == int(tree.tokens[0])  # the chain starts with the most frequent first token


# ---------------------------------------------------------------------------------------------
# Exactness in the engine


def engine_corpus(pair: TinyPair) -> list[int]:
    """The target's greedy continuations of its prompts, and two perturbed copies of each (every 5th token changed):
    drafts are right often, wrong sometimes, and a tree has branches."""
    rng = np.random.default_rng(0)
    texts = []
    for prompt in (*pair.prompts, *pair.length_prompts):
        text = [*prompt, *hf_greedy_ids(pair.target.model, prompt, REF_TOKENS)]
        texts.append(text)
        for _ in range(2):
            noisy = list(text)
            for i in range(len(prompt) + 2, len(noisy), 5):
                noisy[i] = int(rng.integers(3, VOCAB))
            texts.append(noisy)
    return joined(texts)


@pytest.fixture(scope="session")
def rest_files(tiny_pairs: dict[str, TinyPair], tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("rest")
    files = {}
    for family, pair in tiny_pairs.items():
        files[family] = root / f"{family}.rest"
        write(engine_corpus(pair), files[family])
    return files


CONFIGS = {
    "chain-1": GenerationConfig(REF_TOKENS, gamma=1),
    "chain-4": GenerationConfig(REF_TOKENS, gamma=4),
    **{f"tree-{name}": GenerationConfig(REF_TOKENS, tree=spec) for name, spec in TREES.items()},
}


@pytest.mark.parametrize("config", list(CONFIGS))
def test_greedy_output_equals_transformers(
    pair: TinyPair, rest_files: dict[str, Path], hf_greedy: HfGreedy, config: str
) -> None:
    drafter = build_drafter(f"rest:{rest_files[pair.family]}", pair.target)
    assert isinstance(drafter, RestDrafter)
    engine = SpeculativeEngine(pair.target, drafter)
    accepted = drafted = 0
    for prompt in (*pair.prompts, *pair.eos_prompts[:1]):
        result = engine.generate(list(prompt), GREEDY, CONFIGS[config])
        assert result.output_ids == hf_greedy(pair.target, prompt, REF_TOKENS), prompt
        accepted += result.stats.accepted_tokens
        drafted += result.stats.drafted_tokens
    assert 0 < accepted < drafted, "verification was not exercised both ways"


def test_batched_greedy_output_equals_transformers(pair: TinyPair, rest_files: dict[str, Path]) -> None:
    new_drafter = request_drafters(f"rest:{rest_files[pair.family]}", pair.target)
    first, second = new_drafter("default"), new_drafter("default")
    assert isinstance(first, RestDrafter) and isinstance(second, RestDrafter)
    assert first is not second and first.datastore is second.datastore  # loaded once, a drafter per request
    engine = BatchedEngine(pair.target, new_drafter, max_num_seqs=4, max_seq_len=96, prefill_tokens=8)
    requests = {}
    for index, prompt in enumerate((*pair.prompts[:5], *pair.eos_prompts[:1])):
        config = list(CONFIGS.values())[index % len(CONFIGS)]
        requests[engine.submit(list(prompt), GREEDY, config)] = prompt
    results = finish_all(engine)
    assert set(results) == set(requests)
    for request_id, prompt in requests.items():
        assert results[request_id].output_ids == hf_greedy_ids(pair.target.model, prompt, REF_TOKENS), prompt
    assert sum(result.stats.accepted_tokens for result in results.values()) > 0
    assert_pool_empty(engine)


@pytest.mark.parametrize("shape", ["chain", "dynamic"])
def test_sampled_output_follows_the_target(
    tiny_pairs: dict[str, TinyPair], rest_files: dict[str, Path], shape: str
) -> None:
    """Two tokens at T = 1 through the engine: their joint law is the target's (point-mass drafts, rule D). 2,500 seeds
    as requests of one batched engine, whose first seeds the single-request engine emits alike."""
    pair = tiny_pairs["llama"]
    spec = f"rest:{rest_files['llama']}"
    engine = SpeculativeEngine(pair.target, build_drafter(spec, pair.target))
    prompt = list(pair.prompts[0])  # in the datastore: its drafts are real (and often right)
    params = SamplingParams(temperature=1.0, top_k=24)
    tree = None if shape == "chain" else TREES["dynamic"]
    config = GenerationConfig(max_new_tokens=2, gamma=3, tree=tree, ignore_eos=True)
    assert engine.generate(prompt, SamplingParams(temperature=1.0, top_k=24, seed=0), config).stats.drafted_tokens
    batched = BatchedEngine(pair.target, request_drafters(spec, pair.target), max_num_seqs=32)
    runs = batched_runs(batched, prompt, params, config, 2500)
    assert two_token_fit([run.output_ids for run in runs], pair.target, prompt, params) > ALPHA
    check_single_engine_agrees(engine, runs, prompt, params, config)


# ---------------------------------------------------------------------------------------------
# Errors


@pytest.fixture()
def good_file(tmp_path: Path) -> Path:
    path = tmp_path / "good.rest"
    write(joined([[5, 6, 7, 8], [5, 6, 9]]), path)
    return path


def refused(path: Path, target: Any) -> str:
    with pytest.raises(DatastoreError) as error:
        build_drafter(f"rest:{path}", target)
    assert isinstance(error.value, UserError)
    return str(error.value)


def test_a_missing_file_or_a_directory_is_refused(tiny_pairs: dict[str, TinyPair], tmp_path: Path) -> None:
    target = tiny_pairs["llama"].target
    message = refused(tmp_path / "nope.rest", target)
    assert "does not exist" in message and "specserve datastore build" in message
    assert "not a file" in refused(tmp_path, target)
    with pytest.raises(InvalidDrafterSpec, match=r"does not exist.*specserve datastore build"):
        check_drafter_spec(f"rest:{tmp_path / 'nope.rest'}")
    with pytest.raises(InvalidDrafterSpec, match="is a directory"):
        check_drafter_spec(f"rest:{tmp_path}")
    with pytest.raises(InvalidDrafterSpec, match="names no file"):
        check_drafter_spec("rest:")
    with pytest.raises(UserError, match="rest:FILE"):
        build_drafter("rest:", target)


def test_a_file_that_is_not_a_datastore_is_refused(tiny_pairs: dict[str, TinyPair], good_file: Path) -> None:
    target = tiny_pairs["llama"].target
    good_file.write_bytes(b"PK\x03\x04 a zip file, say" + bytes(200))
    assert "is not a specserve datastore" in refused(good_file, target)
    good_file.write_bytes(b"")
    assert "is not a specserve datastore" in refused(good_file, target)


def test_another_format_version_is_refused(tiny_pairs: dict[str, TinyPair], good_file: Path) -> None:
    data = bytearray(good_file.read_bytes())
    data[8:12] = struct.pack("<I", 7)
    good_file.write_bytes(bytes(data))
    message = refused(good_file, tiny_pairs["llama"].target)
    assert "format version 7" in message and "reads version 1" in message and "rebuild" in message


def test_truncated_and_corrupt_files_are_refused(tiny_pairs: dict[str, TinyPair], good_file: Path) -> None:
    target = tiny_pairs["llama"].target
    data = good_file.read_bytes()
    good_file.write_bytes(data[:-5])
    assert "is truncated" in refused(good_file, target)
    good_file.write_bytes(data[: HEADER_SIZE // 2])
    assert "is truncated" in refused(good_file, target)
    good_file.write_bytes(data + b"extra")
    assert "bytes follow its arrays" in refused(good_file, target)
    damaged = bytearray(data)
    damaged[HEADER_SIZE + 4] ^= 0xFF  # a token changed
    good_file.write_bytes(bytes(damaged))
    assert "do not match its checksum" in refused(good_file, target)


def test_a_datastore_of_another_tokenizer_is_refused(tiny_pairs: dict[str, TinyPair], tmp_path: Path) -> None:
    target = tiny_pairs["llama"].target
    other = tmp_path / "reversed.rest"
    write(joined([[5, 6, 7]]), other, fingerprint=tokenizer_fingerprint(char_tokenizer(reverse=True)))
    message = refused(other, target)
    assert "another tokenizer" in message and "--tokenizer" in message
    bigger = tmp_path / "bigger.rest"
    write(joined([[5, 6, 200]]), bigger, vocab_size=300)  # same fingerprint, ids the target cannot score
    bare = CausalLM(target.model, None, path="<no tokenizer>")
    assert "scores 96 tokens" in refused(bigger, bare)


def test_absolute_spec_makes_the_file_absolute(good_file: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.chdir(good_file.parent)
    assert absolute_spec(f"rest:{good_file.name}") == f"rest:{good_file}"
    assert absolute_spec("rest:missing.rest") == "rest:missing.rest"
    check_drafter_spec(f"rest:{good_file.name}")


# ---------------------------------------------------------------------------------------------
# specserve datastore build


def test_the_cli_builds_a_datastore_that_loads(
    saved_pairs: dict[str, Path], tiny_pairs: dict[str, TinyPair], tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    data = tmp_path / "data"
    (data / "sub").mkdir(parents=True)
    texts = ["def f(x): return x + 1", "hello world, hello world; hello there"]  # the char tokenizer's characters
    (data / "a.py").write_text(texts[0])
    (data / "sub" / "b.txt").write_text(texts[1])
    (data / "image.png").write_bytes(b"\x89PNG")  # not a text file: skipped
    out = tmp_path / "out" / "store.rest"
    target_dir = saved_pairs["llama"] / "target"
    code = main(["datastore", "build", "--data", str(data), "--tokenizer", str(target_dir), "--out", str(out)])
    captured = capsys.readouterr()
    assert code == 0, captured.err
    last = captured.out.strip().splitlines()[-1]
    assert last.startswith(f"datastore {out}: ") and "tokens from 2 files" in last and " s; " in last
    datastore = Datastore.open(out)
    tokenizer = tiny_pairs["llama"].target.tokenizer
    assert datastore.tokens.tolist() == joined([tokenizer(t, add_special_tokens=False)["input_ids"] for t in texts])
    datastore.check_target(VOCAB, tokenizer, "<llama>")  # the saved tokenizer is the target's
    drafter = build_drafter(f"rest:{out}", tiny_pairs["llama"].target)
    drafter.start(tokenizer("hello", add_special_tokens=False)["input_ids"], GREEDY, make_generators(0).draft)
    assert tokenizer.decode(drafter.propose(6).tokens.tolist()) == " world"  # twice " world", once " there"
    assert main(["datastore", "build", "--data", str(tmp_path / "none"), "--out", str(out)]) == 2
    assert "--data" in capsys.readouterr().err


def test_generate_drafts_from_a_datastore(
    saved_pairs: dict[str, Path], rest_files: dict[str, Path], capsys: pytest.CaptureFixture[str]
) -> None:
    import json

    target = saved_pairs["llama"] / "target"
    argv = ["generate", "--target", str(target), "--draft", f"rest:{rest_files['llama']}", "--dtype", "float64"]
    prompt = '"#$%"#$%"#$'  # the first tiny prompt (5 6 7 8 ...) in the char tokenizer's characters
    assert main([*argv, "--prompt", prompt, "--max-new-tokens", "12", "--json"]) == 0
    report = json.loads(capsys.readouterr().out)
    assert report["stats"]["drafted_tokens"] > 0


# ---------------------------------------------------------------------------------------------
# The distributed runtime: the file path travels to the drafter actor


@pytest.fixture(scope="module")
def coordinator(ray_cluster: Any, saved_pairs: dict[str, Path], rest_files: dict[str, Path]) -> Iterator[Any]:
    from specserve.actors.coordinator import Coordinator
    from specserve.actors.replica import ReplicaConfig

    config = ReplicaConfig(
        target=str(saved_pairs["llama"] / "target"), draft=f"rest:{rest_files['llama']}", dtype="float64"
    )
    coordinator = Coordinator.spawn(config)
    try:
        yield coordinator
    finally:
        coordinator.shutdown()


@pytest.mark.timeout(300)
def test_distributed_greedy_equals_the_engine(coordinator: Any, tiny_pairs: dict[str, TinyPair]) -> None:
    pair = tiny_pairs["llama"]
    accepted = 0
    for config in (CONFIGS["chain-4"], CONFIGS["tree-dynamic"]):
        for prompt in pair.prompts[:4]:
            got = coordinator.generate(prompt, GREEDY, GenerationConfig(**{**config.__dict__, "max_new_tokens": 20}))
            want = hf_greedy_ids(pair.target.model, prompt, 20)
            assert got.output_ids == (want[: want.index(EOS_ID) + 1] if EOS_ID in want else want), (prompt, config)
            accepted += got.stats.accepted_tokens
    assert accepted > 0
