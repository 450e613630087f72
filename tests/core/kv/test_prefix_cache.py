"""Prefix caching in the batched engine: requests served from the cache emit what they emit from a cold start.

The index (:class:`~specserve.core.kv.prefix_index.PrefixIndex`) against a brute-force longest prefix. Then a
:class:`~specserve.core.batch_engine.BatchedEngine` with the cache on serves requests that share prefixes of every
length — none, part of a prompt, a whole prompt, a previous request's answer — with a draft model, n-gram, suffix, no
drafter and an EAGLE head, chains and trees, greedy, seeded T = 1 and a grammar, some arriving while the request
whose prefix they share is still prefilling it (a prefill of 8 positions per step). Every output, cycle count and
accepted-token count equals :class:`~specserve.core.engine.SpeculativeEngine` on that request alone (float64, both
tiny architectures), the hits happened where they should and nowhere else (the reused positions are counted exactly),
and after every mix the pool holds only the cache's entries, which clearing gives back. A small pool evicts entries
while requests run, never one a request reads; two namespaces never hit each other's entries. The law of sampled
requests on cache hits is the chi-square test of ``test_batch_sampling.py`` (its requests share one prompt).
"""

from __future__ import annotations

import random
from collections.abc import Callable
from typing import Any

import pytest
import torch
from conftest import TinyPair, assert_pool_empty, finish_all, hf_greedy_ids
from head_helpers import random_heads, trained_head

from specserve.core.batch_engine import BatchedEngine
from specserve.core.draft.drafter import Drafter
from specserve.core.engine import SpeculativeEngine
from specserve.core.kv.prefix_index import PrefixIndex, common_prefix
from specserve.core.request import GenerationConfig, GenerationResult
from specserve.core.sampling.params import GrammarSpec, SamplingParams
from specserve.core.tree.shapes import TreeBudget, TreeSpec
from specserve.drafters.eagle import EagleDrafter
from specserve.drafters.medusa import MedusaDrafter
from specserve.drafters.model import DraftModelDrafter
from specserve.drafters.ngram import NgramDrafter
from specserve.drafters.none import NoDrafter
from specserve.drafters.registry import request_drafters
from specserve.drafters.suffix import SuffixDrafter

DYNAMIC = TreeSpec("dynamic", budget=TreeBudget(depth=3, width=2, nodes=5))
MAX_SEQ_LEN = 100


# ---------------------------------------------------------------------------------------------
# The index


def test_the_index_finds_the_longest_shared_prefix_as_brute_force_does() -> None:
    rng = random.Random(0)
    index = PrefixIndex()
    stored: dict[int, tuple[str, list[int]]] = {}
    stem = [rng.randrange(4) for _ in range(12)]
    for item in range(300):
        namespace = rng.choice(("a", "b"))
        if stored and rng.random() < 0.25:  # forget one
            victim = rng.choice(list(stored))
            index.remove(victim)
            del stored[victim]
        tokens = stem[: rng.randrange(13)] + [rng.randrange(4) for _ in range(rng.randrange(10))]
        index.insert(item, namespace, tokens)
        stored[item] = (namespace, tokens)
        query = stem[: rng.randrange(13)] + [rng.randrange(4) for _ in range(rng.randrange(10))]
        for space in ("a", "b", "c"):
            found, length = index.longest(space, query)
            best = max((common_prefix(t, query) for s, t in stored.values() if s == space), default=0)
            assert length == best
            if best:
                assert found is not None and stored[found][0] == space
                assert common_prefix(stored[found][1], query) == best
            else:
                assert found is None
    for item, (namespace, tokens) in stored.items():  # extensions and prefixes, against brute force
        others = [(o, t) for o, (s, t) in stored.items() if s == namespace and o != item]
        extension = index.extension_of(item)
        if extension is None:
            assert not any(t[: len(tokens)] == tokens for _, t in others)
        else:
            assert stored[extension][1][: len(tokens)] == tokens
        want = {o for o, t in others if tokens[: len(t)] == t}
        assert set(index.prefixes_of(item)) == want


@pytest.mark.parametrize(("a", "b", "n"), [((), (1,), 0), ((1, 2, 3), (1, 2, 3), 3), ((1, 2, 3, 4, 5), (1, 2, 9), 2)])
def test_common_prefix(a: tuple[int, ...], b: tuple[int, ...], n: int) -> None:
    assert common_prefix(a, b) == common_prefix(b, a) == n


# ---------------------------------------------------------------------------------------------
# The engine


class Drafters:
    """``new_drafter`` for the mix: the registry's (a draft model drafting for every request in shared forwards,
    ``ngram``, ``suffix``, ``none``), or, for a ``default`` request submitted while :attr:`eagle` is set, an EAGLE
    drafter over one trained head (Medusa heads while :attr:`medusa` is set)."""

    def __init__(self, pair: TinyPair) -> None:
        self.registry = request_drafters(pair.draft, pair.target, max_num_seqs=8, max_seq_len=MAX_SEQ_LEN)
        self.head = EagleDrafter.for_target(trained_head(pair), pair.target)
        self.medusa_heads = MedusaDrafter.for_target(random_heads(pair.target), pair.target)
        self.eagle = self.medusa = False

    def __call__(self, name: str) -> Drafter:
        if name == "default" and (self.eagle or self.medusa):
            return self.head.fresh() if self.eagle else self.medusa_heads.fresh()
        return self.registry(name)


def alone(pair: TinyPair, kind: str, prompt: list[int], params: SamplingParams, config: GenerationConfig) -> Any:
    """The request on a fresh single-request engine with a fresh drafter of its kind."""
    build: dict[str, Callable[[], Drafter]] = {
        "model": lambda: DraftModelDrafter(pair.draft, pair.target),
        "ngram": lambda: NgramDrafter(max_ngram=3, min_ngram=1),
        "suffix": lambda: SuffixDrafter(device=pair.target.device),
        "none": NoDrafter,
        "eagle": lambda: EagleDrafter.for_target(trained_head(pair), pair.target),
        "medusa": lambda: MedusaDrafter.for_target(random_heads(pair.target), pair.target),
    }
    engine = SpeculativeEngine(pair.target, build[kind]())
    return engine.generate(prompt, params, GenerationConfig(**{**config.__dict__, "drafter": "default"}))


def tokens(seed: int, n: int) -> list[int]:
    generator = torch.Generator().manual_seed(seed)
    return torch.randint(3, 60, (n,), generator=generator).tolist()


GRAMMAR = SamplingParams(grammar=GrammarSpec("regex", "[a-h][a-h0-5]+"))
SAMPLED = SamplingParams(temperature=1.0, seed=11)
GREEDY = SamplingParams()
NGRAM = GenerationConfig(max_new_tokens=12, gamma=2, drafter="ngram")
SUFFIX = GenerationConfig(max_new_tokens=12, gamma=3, drafter="suffix")


@pytest.mark.timeout(300)
def test_requests_served_from_the_cache_equal_themselves_cold(pair: TinyPair) -> None:
    system = tokens(1, 26)
    a = [*system, *tokens(2, 6)]
    drafters = Drafters(pair)
    engine = BatchedEngine(pair.target, drafters, max_num_seqs=8, max_seq_len=MAX_SEQ_LEN, prefill_tokens=8)
    chain, tree = GenerationConfig(max_new_tokens=12, gamma=3), GenerationConfig(max_new_tokens=10, tree=DYNAMIC)
    # (kind, prompt, params, config, positions it must reuse: an exact count, or None for "some")
    first_wave: list[tuple[str, list[int], SamplingParams, GenerationConfig, int | None]] = [
        ("model", a, GREEDY, chain, 0),  # the first: nothing cached
        ("model", [*system, *tokens(3, 5)], SAMPLED, chain, None),  # shares the system prompt, arrives mid-prefill
        ("ngram", [*system[:13], *tokens(4, 9)], GREEDY, NGRAM, None),
        ("model", list(a), GREEDY, tree, None),  # the whole prompt again: all but its last token
        ("suffix", [*system, *tokens(5, 3)], GREEDY, SUFFIX, None),
        ("none", tokens(6, 20), GREEDY, GenerationConfig(max_new_tokens=8, drafter="none"), 0),  # shares nothing
        ("model", [*system, *tokens(7, 4)], GRAMMAR, chain, None),
        ("eagle", [*system, *tokens(8, 7)], GREEDY, chain, 0),  # a feature reader: no request before had an EAGLE head
        ("eagle", [*system, *tokens(11, 5)], SAMPLED, tree, None),  # the features of the one before, mid-prefill
        ("medusa", list(a), GREEDY, chain, len(a) - 2),  # all but the two whose features its heads read first
        ("medusa", [*system, *tokens(12, 6)], SAMPLED, tree, None),
    ]  # fmt: skip
    results = run_waves(engine, drafters, [first_wave])
    answer = results[0].output_ids
    # a's text and answer, then a new turn: reuses everything a cached (its prompt and answer but the last token)
    follow = [*a, *answer, *tokens(9, 5)]
    eagle = [*first_wave[-2][1], *results[-2].output_ids, *tokens(10, 3)]  # the first EAGLE request's next turn
    second_wave = [
        ("model", follow, GREEDY, chain, len(a) + len(answer) - 1),
        ("ngram", follow, SAMPLED, NGRAM, None),
        ("eagle", eagle, GREEDY, tree, None),  # its features come from the head's store, its KV from the cache
    ]
    results += run_waves(engine, drafters, [second_wave])
    reused = 0
    for (kind, prompt, params, config, expected), got in zip(first_wave + second_wave, results, strict=True):
        want = alone(pair, kind, prompt, params, config)
        assert got.output_ids == want.output_ids, (kind, prompt)
        assert got.finish_reason == want.finish_reason
        assert (got.stats.cycles, got.stats.accepted_tokens) == (want.stats.cycles, want.stats.accepted_tokens)
        if params.greedy and params.grammar is None:
            assert (
                got.output_ids == hf_greedy_ids(pair.target.model, prompt, config.max_new_tokens)[: len(got.output_ids)]
            )
        if expected is None:
            assert got.stats.cached_tokens > 0, (kind, prompt)
        else:
            assert got.stats.cached_tokens == expected, (kind, prompt)
        reused += got.stats.cached_tokens
    assert engine.cache is not None and engine.cache.stats.hit_tokens == reused
    assert_pool_empty(engine)


def run_waves(
    engine: BatchedEngine,
    drafters: Drafters,
    waves: list[list[tuple[str, list[int], SamplingParams, GenerationConfig, int | None]]],
) -> list[GenerationResult]:
    """Submit each wave's requests one step apart (the later ones find the first mid-prefill), finish it; results in
    submission order."""
    results: list[GenerationResult] = []
    for wave in waves:
        ids = []
        finished: dict[int, GenerationResult] = {}
        for kind, prompt, params, config, _ in wave:
            drafters.eagle, drafters.medusa = kind == "eagle", kind == "medusa"
            ids.append(engine.submit(prompt, params, config))
            drafters.eagle = drafters.medusa = False
            for request_id, chunk in engine.step():
                assert not isinstance(chunk, Exception), chunk
                if chunk.result is not None:
                    finished[request_id] = chunk.result
        finished.update(finish_all(engine))
        results += [finished[request_id] for request_id in ids]
    return results


@pytest.mark.timeout(300)
def test_an_eagle_head_runs_only_over_what_its_store_lacks(pair: TinyPair, monkeypatch: pytest.MonkeyPatch) -> None:
    """The next turn of an EAGLE request takes the head's keys and values over the last turn's text from the store: its
    head's first forward covers the new text (and the last turn's final positions) only, and it drafts exactly as
    cold."""
    drafters = Drafters(pair)
    engine = BatchedEngine(pair.target, drafters, max_num_seqs=4, max_seq_len=MAX_SEQ_LEN)
    config = GenerationConfig(max_new_tokens=12, gamma=3, ignore_eos=True)
    blocks: list[int] = []  # per proposal, the committed positions the head had not cached
    unfed = EagleDrafter.unfed

    def recorded(self: EagleDrafter) -> tuple[torch.Tensor, torch.Tensor]:
        tokens, features = unfed(self)
        blocks.append(len(tokens))
        return tokens, features

    monkeypatch.setattr(EagleDrafter, "unfed", recorded)
    first = [*tokens(40, 30)]
    drafters.eagle = True
    request_id = engine.submit(first, GREEDY, config)
    drafters.eagle = False
    answer = finish_all(engine)[request_id].output_ids
    assert blocks[0] == len(first) - 1  # cold: the whole prompt
    blocks.clear()
    follow = [*first, *answer, *tokens(41, 4)]
    drafters.eagle = True
    request_id = engine.submit(follow, GREEDY, config)
    drafters.eagle = False
    got = finish_all(engine)[request_id]
    assert got.stats.cached_tokens > len(first)
    assert blocks[0] <= len(answer) + 4, blocks  # not over the first turn's prompt again
    want = alone(pair, "eagle", follow, GREEDY, config)
    assert got.output_ids == want.output_ids
    assert (got.stats.cycles, got.stats.accepted_tokens) == (want.stats.cycles, want.stats.accepted_tokens)
    assert_pool_empty(engine)


def test_namespaces_never_share_entries(tiny_pairs: dict[str, TinyPair]) -> None:
    pair = tiny_pairs["llama"]
    engine = BatchedEngine(pair.target, Drafters(pair), max_num_seqs=4, max_seq_len=MAX_SEQ_LEN)
    prompt = tokens(12, 30)
    config = GenerationConfig(max_new_tokens=6, gamma=2)
    tenants = [GenerationConfig(**{**config.__dict__, "cache_namespace": space}) for space in ("", "t1", "t2", "t1")]
    outputs = []
    for tenant in tenants:
        request_id = engine.submit(prompt, GREEDY, tenant)
        outputs.append(finish_all(engine)[request_id])
    assert [o.stats.cached_tokens for o in outputs] == [0, 0, 0, len(prompt) - 1]  # only t1's second hits
    assert len({tuple(o.output_ids) for o in outputs}) == 1
    assert_pool_empty(engine)


@pytest.mark.timeout(300)
def test_a_small_pool_evicts_entries_while_requests_run(tiny_pairs: dict[str, TinyPair]) -> None:
    """A pool with room for two requests: entries are evicted least recently used as newcomers need room, none that a
    running request reads, and every request still decodes exactly; the recently used entry survives."""
    pair = tiny_pairs["llama"]
    config = GenerationConfig(max_new_tokens=10, gamma=3)
    prompts = [tokens(20 + i, 30) for i in range(5)]
    room = 2 * (30 + 10)
    engine = BatchedEngine(pair.target, Drafters(pair), max_num_seqs=4, max_seq_len=60, kv_pool_tokens=room)
    ids = {engine.submit(prompt, GREEDY, config): prompt for prompt in prompts}
    results = finish_all(engine)
    assert engine.cache is not None and engine.cache.stats.evictions >= 2
    again = engine.submit(prompts[-1], GREEDY, config)  # the most recent entry is still there
    results[again] = finish_all(engine)[again]
    assert results[again].stats.cached_tokens == len(prompts[-1]) - 1
    ids[again] = prompts[-1]
    for request_id, prompt in ids.items():
        assert results[request_id].output_ids == hf_greedy_ids(pair.target.model, prompt, 10)
    assert engine.pool.capacity - engine.pool.free_tokens <= room
    assert_pool_empty(engine)


def test_the_cache_can_be_turned_off(tiny_pairs: dict[str, TinyPair]) -> None:
    pair = tiny_pairs["llama"]
    engine = BatchedEngine(pair.target, Drafters(pair), max_num_seqs=2, max_seq_len=MAX_SEQ_LEN, prefix_caching=False)
    prompt, config = tokens(30, 20), GenerationConfig(max_new_tokens=4, gamma=2)
    for _ in range(2):
        request_id = engine.submit(prompt, GREEDY, config)
        assert finish_all(engine)[request_id].stats.cached_tokens == 0
    assert engine.cache is None and engine.pool.num_sequences == 0
