"""Tests of the suffix drafter (suffix decoding): its matcher against a brute-force reference, the counted
continuations, the global store's eviction, the drafts it builds, and exactness in the engines.

Exactness: greedy output equals transformers' (chains and trees, llama and qwen2) in process, in the batched
engine and through one distributed replica; a sampled run passes a chi-square test of the emitted law.
"""

from __future__ import annotations

import gc
import math
from collections.abc import Callable, Sequence
from typing import Any

import numpy as np
import pytest
import torch
from conftest import REF_TOKENS, TinyPair, finish_all
from hypothesis import given, settings
from hypothesis import strategies as st
from stats_helpers import batched_runs, check_single_engine_agrees, two_token_fit

from specserve.core.batch_engine import BatchedEngine
from specserve.core.draft.drafter import Drafter, TreeDrafter
from specserve.core.draft.spec_strings import check_drafter_spec
from specserve.core.engine import SpeculativeEngine
from specserve.core.model.causal_lm import CausalLM
from specserve.core.request import GenerationConfig
from specserve.core.sampling.params import SamplingParams
from specserve.core.sampling.warps import make_generators
from specserve.core.tree.draft_tree import DraftTree
from specserve.core.tree.shapes import ROOT, TreeBudget, TreeSpec, TreeTopology
from specserve.drafters import build_drafter
from specserve.drafters.registry import build_drafter_set, request_drafters
from specserve.drafters.suffix import (
    SEPARATOR,
    CountTrie,
    SuffixCache,
    SuffixDrafter,
    continuation,
    match_occurrences,
)

HfGreedy = Callable[[CausalLM, Sequence[int], int], list[int]]
GREEDY = SamplingParams()
# Each chi-square test below fails a correct drafter with probability ALPHA (its seeds are fixed, so a run is
# reproducible); with the two of them, the file's chance of a false failure is at most 2e-3.
ALPHA = 1e-3
DYNAMIC = TreeSpec("dynamic", budget=TreeBudget(depth=4, width=3, nodes=10))
STATIC = TreeSpec("static", topology=TreeTopology.from_lists([[0], [1], [2], [0, 0], [1, 0], [0, 1], [0, 0, 0]]))
REPETITIVE = (5, 6, 7, 8, 5, 6, 9, 5, 6, 7, 10, 5, 6, 7, 8, 5, 6)


def drafter_for(history: Sequence[int], **options: Any) -> SuffixDrafter:
    drafter = SuffixDrafter(**options)
    drafter.start(list(history), GREEDY, make_generators(0).draft)
    return drafter


def paths_of(tree: DraftTree) -> list[tuple[int, ...]]:
    return [tuple(tree.path_tokens(i)) for i in range(tree.size)]


# ---------------------------------------------------------------------------------------------
# The matcher against a brute-force reference


def brute_match(text: Sequence[int], context: Sequence[int], max_depth: int) -> tuple[int, list[int]]:
    """The longest suffix of ``context`` (<= max_depth) occurring in ``text`` with a token after it, and every
    end j of such an occurrence (most recent first), by trying every position."""
    best, ends = 0, []
    for j in range(1, len(text)):
        if text[j] == SEPARATOR:
            continue
        k = 0
        while k < min(max_depth, len(context)) and j - k - 1 >= 0 and text[j - k - 1] == context[-k - 1]:
            k += 1
        if k and k > best:
            best, ends = k, [j]
        elif k and k == best:
            ends.append(j)
    return best, ends[::-1]


tokens = st.lists(st.integers(0, 3), max_size=60)


@settings(max_examples=300, deadline=None)
@given(tokens, st.integers(1, 8))
def test_the_match_is_the_longest_and_every_occurrence_is_found(history: list[int], max_depth: int) -> None:
    ids = np.asarray(history, dtype=np.int64)
    length, ends = match_occurrences(ids, ids, max_depth)
    assert (length, ends.tolist()) == brute_match(history, history, max_depth)
    for end in ends.tolist():  # each occurrence is real, earlier than the suffix itself, and has a continuation
        assert end < len(history) and history[end - length : end] == history[len(history) - length :]


@settings(max_examples=200, deadline=None)
@given(st.lists(tokens, max_size=5), tokens, st.integers(1, 6))
def test_matches_in_the_global_store_never_cross_documents(
    documents: list[list[int]], context: list[int], max_depth: int
) -> None:
    cache = SuffixCache()
    for document in documents:
        cache.publish(document)
    text = cache.text()
    length, ends = match_occurrences(text, np.asarray(context, dtype=np.int64), max_depth)
    assert (length, ends.tolist()) == brute_match(text.tolist(), context, max_depth)
    for end in ends.tolist():
        assert SEPARATOR not in text[end - length : end + 1].tolist()  # within one document, a token after it
        assert SEPARATOR not in continuation(text, end, 5)


@settings(max_examples=200, deadline=None)
@given(tokens, st.integers(1, 6), st.integers(0, 5))
def test_counts_are_the_occurrences_each_continuation_follows(history: list[int], max_depth: int, depth: int) -> None:
    ids = np.asarray(history, dtype=np.int64)
    _, ends = match_occurrences(ids, ids, max_depth)
    followed = [history[end : end + depth] for end in ends.tolist()]  # what followed each occurrence
    trie = CountTrie.build([continuation(ids, end, depth) for end in ends.tolist()])
    assert trie.total == len(ends)
    seen = set()
    for node in range(trie.size):
        path = []
        at = node
        while at != ROOT:
            path.append(trie.tokens[at])
            at = trie.parents[at]
        path.reverse()
        assert trie.counts[node] == sum(f[: len(path)] == path for f in followed) > 0
        seen.add(tuple(path))
    # every prefix of every continuation is a node (nothing was lost)
    assert seen == {tuple(f[:i]) for f in followed for i in range(1, len(f) + 1)}


@settings(max_examples=200, deadline=None)
@given(st.lists(st.lists(st.integers(0, 9), max_size=12), max_size=12), st.integers(1, 20))
def test_eviction_keeps_the_global_store_within_its_budget(documents: list[list[int]], max_tokens: int) -> None:
    cache = SuffixCache(max_tokens=max_tokens)
    published: list[list[int]] = []
    for document in documents:
        cache.publish(document)
        if document:
            published.append(document[-max_tokens:])
        assert cache.tokens <= max_tokens
        assert cache.tokens == sum(len(d) for d in cache.documents)
        # what is kept is the newest documents that fit, oldest evicted first
        kept = cache.documents
        assert kept == published[len(published) - len(kept) :]
        if published:
            assert kept and kept[-1] == published[-1]
            if len(kept) < len(published):
                assert sum(map(len, kept)) + len(published[-len(kept) - 1]) > max_tokens
        assert cache.text().tolist() == [t for d in kept for t in (*d, SEPARATOR)]


@settings(max_examples=200, deadline=None)
@given(tokens, st.lists(tokens, max_size=3), st.integers(0, 6))
def test_chain_drafts_follow_the_longest_match_in_either_store(
    history: list[int], documents: list[list[int]], budget: int
) -> None:
    cache = SuffixCache()
    for document in documents:
        cache.publish(document)
    drafter = drafter_for(history, cache=cache, max_depth=6)
    draft = drafter.propose(budget).tokens.tolist()
    local, local_ends = brute_match(history, history, 6)
    shared, shared_ends = brute_match(cache.text().tolist(), history, 6)
    length = max(local, shared)
    assert drafter.match_lengths == ([length] if budget > 0 else [])
    assert len(draft) <= min(budget, math.ceil(length))  # size_factor 1: no more tokens than matched
    if draft:  # it is what followed some occurrence of the longest match
        sources = ([history] * (local == length)) + ([cache.text().tolist()] * (shared == length))
        ends = ([local_ends] * (local == length)) + ([shared_ends] * (shared == length))
        assert any(src[j : j + len(draft)] == draft for src, js in zip(sources, ends, strict=True) for j in js)


# ---------------------------------------------------------------------------------------------
# Hand-made drafts


def test_drafts_are_scored_by_frequency() -> None:
    # "4 5" occurred three times before the end: followed by 1 2 9, 1 3 8 and 2 7 4
    history = [4, 5, 1, 2, 9, 4, 5, 1, 3, 8, 4, 5, 2, 7, 4, 5]
    drafter = drafter_for(history, size_factor=4.0)
    assert isinstance(drafter, Drafter) and isinstance(drafter, TreeDrafter)
    draft = drafter.propose(3)
    # 1 (2 of 3), then 3 or 2 (1 each): the tie goes to the most recent occurrence's
    assert draft.tokens.tolist() == [1, 3, 8] and draft.draft_probs is None
    tree = drafter.propose_tree(TreeSpec("dynamic", budget=TreeBudget(depth=3, width=2, nodes=4)))
    assert tree.child_probs is None
    # 1 scores 2/3, the others 1/3: shallow first, then the most recent occurrence's (2 7 came last)
    assert paths_of(tree) == [(1,), (2,), (2, 7), (1, 3)]
    static = drafter.propose_tree(TreeSpec("static", topology=TreeTopology.from_lists([[0], [1], [0, 0], [1, 0]])))
    assert paths_of(static) == [(1,), (2,), (1, 3), (2, 7)]
    assert drafter.match_lengths == [2, 2, 2]


def test_draft_size_adapts_to_the_match() -> None:
    history = [1, 2, 3, 4, 5, 6, 7, 8, 9, 1, 2, 3]
    long = drafter_for(history)
    assert long.propose(8).tokens.tolist() == [4, 5, 6]  # a 3-token match drafts up to 3 tokens
    short = drafter_for([1, 2, 3, 4, 5, 6, 7, 8, 9, 3])
    assert short.propose(8).tokens.tolist() == [4]  # a 1-token match: 1 token
    assert drafter_for([1, 2, 3, 4]).propose(8).gamma == 0  # no match: nothing
    # rare continuations are not drafted: after "7" came 8 once and nine different tokens, each scoring 0.1
    rare = drafter_for([t for i in range(10) for t in (7, 20 + i)] + [7], min_score=0.15, size_factor=4)
    assert rare.propose(4).gamma == 0
    assert rare.propose_tree(DYNAMIC).size == 0
    assert rare.match_lengths == [1, 1]


def test_accept_rewind_and_the_global_store() -> None:
    cache = SuffixCache()
    drafter = SuffixDrafter(cache)
    drafter.start([50, 51, 52], GREEDY, make_generators(0).draft)
    assert drafter.propose(3).gamma == 0
    drafter.accept([53, 54, 50, 51])
    assert drafter.propose(3).tokens.tolist() == [52, 53]  # "50 51" matched: 2 tokens
    drafter.rewind(5)
    assert drafter.history == [50, 51, 52, 53, 54]
    drafter.accept([60])
    # the next request publishes this one's output (not its prompt) to the global store
    drafter.start([9, 53, 54], GREEDY, make_generators(0).draft)
    assert cache.documents == [[53, 54, 60]]
    assert drafter.propose(2).tokens.tolist() == [60]  # learnt from the previous request
    assert drafter.counters["global_matches"] == 1 and drafter.match_lengths == [2]
    assert drafter.request_counters() == {"proposals": 1, "matched": 1, "match_tokens": 2, "global_matches": 1}
    drafter.finish()
    drafter.finish()  # once only
    assert cache.documents == [[53, 54, 60]]  # nothing was committed in the second request


def test_requests_of_a_batched_engine_share_the_global_store(pair: TinyPair) -> None:
    new_drafter = request_drafters("suffix", pair.target)
    first, second = new_drafter("default"), new_drafter("suffix")
    assert isinstance(first, SuffixDrafter) and isinstance(second, SuffixDrafter)
    assert first.cache is second.cache
    first.start([1, 2], GREEDY, make_generators(0).draft)
    first.accept([3, 4, 5])
    del first
    gc.collect()
    assert second.cache.documents == [[3, 4, 5]]  # published when the request's drafter was dropped


def test_the_registry_builds_it(pair: TinyPair) -> None:
    check_drafter_spec("suffix")
    assert isinstance(build_drafter("suffix", pair.target), SuffixDrafter)
    drafters = build_drafter_set("suffix", pair.target)
    assert drafters.get("default") is drafters.get("suffix")
    assert isinstance(build_drafter_set("ngram", pair.target).get("suffix"), SuffixDrafter)
    with pytest.raises(ValueError, match="max_depth"):
        SuffixDrafter(max_depth=0)


# ---------------------------------------------------------------------------------------------
# Exactness in the engines


@pytest.mark.parametrize("shape", ["chain1", "chain4", "dynamic", "static"])
def test_greedy_output_equals_transformers(pair: TinyPair, hf_greedy: HfGreedy, shape: str) -> None:
    engine = SpeculativeEngine(pair.target, build_drafter_set("suffix", pair.target))  # one global store
    tree = {"dynamic": DYNAMIC, "static": STATIC}.get(shape)
    config = GenerationConfig(REF_TOKENS, gamma=int(shape[-1]) if tree is None else 4, tree=tree)
    accepted = 0
    for prompt in (*pair.prompts, REPETITIVE):
        result = engine.generate(list(prompt), GREEDY, config)
        assert result.output_ids == hf_greedy(pair.target, prompt, REF_TOKENS), prompt
        accepted += result.stats.accepted_tokens
    assert accepted > 0, "no draft was ever accepted: the test would not exercise verification"


def test_a_request_chooses_suffix(pair: TinyPair, hf_greedy: HfGreedy) -> None:
    engine = SpeculativeEngine(pair.target, build_drafter_set(pair.draft, pair.target))  # a draft model configured
    drafted = 0
    for prompt in pair.prompts[:3]:
        result = engine.generate(list(prompt), GREEDY, GenerationConfig(20, gamma=3, drafter="suffix"))
        assert result.output_ids == hf_greedy(pair.target, prompt, 20)
        drafted += result.stats.drafted_tokens
    assert drafted > 0


def test_batched_greedy_output_equals_transformers(pair: TinyPair, hf_greedy: HfGreedy) -> None:
    engine = BatchedEngine(pair.target, request_drafters("suffix", pair.target), max_num_seqs=4, max_seq_len=96)
    configs = [
        GenerationConfig(24, gamma=3),
        GenerationConfig(24, tree=DYNAMIC),
        GenerationConfig(24, tree=STATIC),
        GenerationConfig(24, gamma=5, drafter="suffix"),
        GenerationConfig(24, gamma=2, drafter="ngram"),
    ]
    prompts = [list(REPETITIVE), *[list(p) for p in pair.prompts[:4]]]
    ids = [engine.submit(prompt, GREEDY, config) for prompt, config in zip(prompts, configs, strict=True)]
    results = finish_all(engine)
    for request_id, prompt in zip(ids, prompts, strict=True):
        assert results[request_id].output_ids == hf_greedy(pair.target, prompt, 24), prompt
    assert sum(results[i].stats.accepted_tokens for i in ids[:4]) > 0


@pytest.mark.parametrize("tree", [None, DYNAMIC], ids=["chain", "tree"])
def test_sampled_output_follows_the_target(tiny_pairs: dict[str, TinyPair], tree: TreeSpec | None) -> None:
    """Two tokens at T = 1 through the engine: their joint law is the target's (point-mass drafts). The prompt
    repeats: after "30 31" came 32, 33 and 34, so the drafter drafts the first token (all a two-token request
    lets it: the verdict adds the second), as a chain of the most frequent one or a tree of all three. 2,000 seeds
    as requests of one batched engine, whose first seeds the single-request engine emits alike."""
    pair = tiny_pairs["llama"]
    batched = BatchedEngine(pair.target, lambda name: SuffixDrafter(size_factor=4.0, min_score=0.0), max_num_seqs=32)
    prompt = [7, 30, 31, 32, 8, 30, 31, 33, 9, 30, 31, 34, 6, 30, 31]
    params = SamplingParams(temperature=1.0, top_k=24)
    config = GenerationConfig(max_new_tokens=2, gamma=3, tree=tree, ignore_eos=True)
    runs = batched_runs(batched, prompt, params, config, 2000)
    assert two_token_fit([run.output_ids for run in runs], pair.target, prompt, params) > ALPHA
    assert sum(run.stats.drafted_tokens for run in runs) == (2000 if tree is None else 3 * 2000)
    single = SpeculativeEngine(pair.target, SuffixDrafter(size_factor=4.0, min_score=0.0))
    check_single_engine_agrees(single, runs, prompt, params, config)


def simulate(text: Sequence[int], prompt_length: int, gamma: int) -> tuple[int, int, int]:
    """Greedy speculative decoding of ``text`` by an oracle target that always continues it: (drafted, accepted,
    cycles) with the suffix drafter proposing ``gamma`` tokens a cycle after the first ``prompt_length`` tokens."""
    drafter = drafter_for(text[:prompt_length])
    position, drafted, accepted, cycles = prompt_length, 0, 0, 0
    while position < len(text):
        draft = drafter.propose(gamma).tokens.tolist()
        truth = list(text[position : position + len(draft)])
        hits = next((i for i, (a, b) in enumerate(zip(draft, truth, strict=False)) if a != b), len(truth))
        committed = list(text[position : position + hits + 1])
        drafter.accept(committed)
        position += len(committed)
        drafted, accepted, cycles = drafted + len(draft), accepted + hits, cycles + 1
    return drafted, accepted, cycles


@settings(max_examples=50, deadline=None)
@given(st.lists(st.integers(3, 95), min_size=4, max_size=12, unique=True), st.integers(0, 2**32 - 1))
def test_a_repetitive_text_gets_longer_drafts_and_more_accepted(unit: list[int], seed: int) -> None:
    """A property of the drafts, not a time: decoding text that repeats a unit (with the target continuing it)
    drafts more tokens per cycle and accepts more than decoding random tokens of the same length."""
    repetitive = (unit * 12)[:96]
    random_text = np.random.default_rng(seed).integers(3, 96, size=len(repetitive)).tolist()
    drafted, accepted, cycles = simulate(repetitive, 2 * len(unit), 8)
    drafted_random, accepted_random, cycles_random = simulate(random_text, 2 * len(unit), 8)
    assert drafted / cycles > drafted_random / cycles_random
    assert accepted > accepted_random and accepted / drafted > 0.9


def test_a_repetitive_prompt_matches_longer_in_the_engine(pair: TinyPair, hf_greedy: HfGreedy) -> None:
    """Through the engine: the first proposal after a repeating prompt follows a max_depth match and drafts the
    whole budget; after random tokens it matches at most one token and drafts at most one."""
    repetitive = [40, 41, 42, 43, 44, 45, 46, 47] * 6
    random_prompt = torch.randint(3, 96, (len(repetitive),), generator=torch.Generator().manual_seed(0)).tolist()
    first: dict[str, tuple[int, int]] = {}
    for name, prompt in (("repetitive", repetitive), ("random", random_prompt)):
        drafter = SuffixDrafter()
        engine = SpeculativeEngine(pair.target, drafter)
        result = engine.generate(prompt, GREEDY, GenerationConfig(16, gamma=8))
        assert result.output_ids == hf_greedy(pair.target, prompt, 16)
        first[name] = (drafter.match_lengths[0], result.stats.observations[0].drafted)
    assert first["repetitive"] == (32, 8)
    assert first["random"][0] <= 1 and first["random"][1] <= 1


@pytest.mark.timeout(300)
def test_a_distributed_replica_drafts_with_suffix(
    ray_cluster: Any, saved_pairs: dict[str, Any], tiny_pairs: dict[str, TinyPair], hf_greedy: HfGreedy
) -> None:
    """One replica (TP 1, colocated) configured with ``suffix``: chains and trees give transformers' greedy text."""
    from specserve.actors.coordinator import Coordinator
    from specserve.actors.replica import ReplicaConfig

    pair = tiny_pairs["llama"]
    models = saved_pairs["llama"]
    config = ReplicaConfig(target=str(models / "target"), draft="suffix", dtype="float64", tp_degree=1)
    coordinator = Coordinator.spawn(config)
    try:
        drafted = 0
        for prompt, request in (
            (REPETITIVE, GenerationConfig(20, gamma=4)),
            (pair.prompts[0], GenerationConfig(20, tree=DYNAMIC)),
            (REPETITIVE, GenerationConfig(20, tree=STATIC)),
        ):
            got = coordinator.generate(prompt, GREEDY, request)
            assert got.output_ids == hf_greedy(pair.target, prompt, 20), prompt
            drafted += got.stats.drafted_tokens
        assert drafted > 0
    finally:
        coordinator.shutdown()
