"""Tests of Lookahead decoding: the probe leaves the verified rows alone, the Jacobi window and its n-gram pool
against a reference target, the wire, the spec, and exactness in every runtime.

Exactness: greedy output equals transformers' (chains and trees, llama and qwen2) in process, in the batched
engine and through one distributed replica; a sampled run passes a chi-square test of the emitted law.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

import pytest
import torch
from conftest import REF_TOKENS, TinyPair, assert_pool_empty, finish_all
from hypothesis import given, settings
from hypothesis import strategies as st
from stats_helpers import batched_runs, check_single_engine_agrees, two_token_fit

from specserve.core.batch_engine import BatchedEngine
from specserve.core.draft.drafter import Draft, ProbingDrafter
from specserve.core.draft.spec_strings import InvalidDrafterSpec, check_drafter_spec, is_model_free, probe_nodes_of
from specserve.core.engine import SpeculativeEngine
from specserve.core.model.causal_lm import CausalLM
from specserve.core.request import GenerationConfig
from specserve.core.sampling.params import SamplingParams
from specserve.core.sampling.warps import make_generators
from specserve.core.target import CycleOutcome, LocalSequence, TargetVerifier
from specserve.core.tree.draft_tree import DraftTree, block_nodes
from specserve.core.tree.shapes import ROOT, InvalidTree, TreeBudget, TreeSpec, TreeTopology
from specserve.core.verify.chain import ChainVerdict, TokenKind
from specserve.drafters import build_drafter
from specserve.drafters.lookahead import LookaheadDrafter, LookaheadSettings, NgramPool
from specserve.drafters.registry import build_drafter_set, request_drafters
from specserve.policies.schedules import schedules
from specserve.rpc import codec

HfGreedy = Callable[[CausalLM, Sequence[int], int], list[int]]
GREEDY = SamplingParams()
# The chi-square test below fails a correct drafter with probability ALPHA (fixed seeds: a run is reproducible).
ALPHA = 1e-3
DYNAMIC = TreeSpec("dynamic", budget=TreeBudget(depth=3, width=3, nodes=8))
STATIC = TreeSpec("static", topology=TreeTopology.from_lists([[0], [1], [0, 0], [1, 0], [0, 0, 0]]))
REPETITIVE = (5, 6, 7, 8, 5, 6, 9, 5, 6, 7, 10, 5, 6, 7, 8, 5, 6)


def started(settings: LookaheadSettings, history: Sequence[int]) -> LookaheadDrafter:
    drafter = LookaheadDrafter(settings)
    drafter.start(list(history), GREEDY, make_generators(0).draft)
    return drafter


# ---------------------------------------------------------------------------------------------
# The probe does not touch the verified rows


@pytest.mark.parametrize("kind", ["chain", "tree"])
def test_probe_rows_do_not_change_the_verified_rows_logits(pair: TinyPair, kind: str) -> None:
    """The draft's rows of a forward with a probe equal those of the same forward without it."""
    prompt = list(pair.prompts[1])
    draft = torch.tensor([11, 12, 13])
    parents = (ROOT, 0, 1) if kind == "chain" else (ROOT, 0, ROOT)
    probe = started(LookaheadSettings(3, 3, 2), prompt)._probe()
    logits = []
    for with_probe in (False, True):
        sequence = LocalSequence(pair.target)
        sequence.forward(torch.tensor(prompt[:-1]))
        tokens, all_parents = block_nodes(draft, parents, probe if with_probe else None)
        logits.append(sequence.forward_tree(prompt[-1], DraftTree(tokens, all_parents)))
    assert logits[1].shape[0] == 1 + draft.numel() + probe.size
    torch.testing.assert_close(logits[1][: 1 + draft.numel()], logits[0], rtol=1e-6, atol=1e-6)


def test_the_verdict_and_the_kv_do_not_depend_on_the_probe(pair: TinyPair) -> None:
    """Verifying a chain with and without a probe commits the same tokens and leaves the same KV length; the probe
    comes back as the target's greedy token after each of its nodes."""
    prompt = list(pair.prompts[0])
    probe = started(LookaheadSettings(2, 3, 2), prompt)._probe()
    outcomes = []
    for with_probe in (False, True):
        sequence = LocalSequence(pair.target)
        verifier = TargetVerifier(sequence, prompt, GREEDY, make_generators(0).verify, 16)
        verifier.prefill()
        greedy = pair.target.forward(pair.target.new_cache(), torch.tensor(prompt), last_only=True).argmax(-1)
        draft = Draft(torch.tensor([int(greedy), 7]), None, probe if with_probe else None)
        outcomes.append((verifier.verify(draft), sequence.length))
    (plain, plain_kv), (probed, probed_kv) = outcomes
    assert probed.new_tokens == plain.new_tokens and probed_kv == plain_kv == len(prompt) - 1 + len(plain.new_tokens)
    assert len(probed.probe_argmax) == probe.size and plain.probe_argmax == ()
    expected = [
        int(pair.target.forward(pair.target.new_cache(), torch.tensor([*prompt, *probe.path_tokens(i)]))[-1].argmax())
        for i in range(probe.size)
    ]
    assert list(probed.probe_argmax) == expected


# ---------------------------------------------------------------------------------------------
# The window and its pool against a reference target


def test_the_probe_is_the_papers_window() -> None:
    """Level 0 is a chain after the root; a later level's token hangs under its column's earlier level."""
    drafter = started(LookaheadSettings(3, 4, 2, pool_from_text=False), [1, 2, 3, 4])
    drafter._levels = [[10, 11, 12], [20, 21, 22], [30, 31, 32]]
    probe = drafter._probe()
    assert probe.tokens.tolist() == [10, 11, 12, 20, 21, 22, 30, 31, 32]
    assert probe.path_tokens(5) == [10, 11, 12, 22]  # level 1, column 2: level 0 up to column 2, then itself
    assert probe.path_tokens(6) == [10, 20, 30]
    assert probe.path_tokens(8) == [10, 11, 12, 22, 32]


@settings(max_examples=40, deadline=None)
@given(
    st.lists(st.integers(0, 30), min_size=31, max_size=31),
    st.integers(1, 5),
    st.integers(2, 5),
    st.lists(st.integers(0, 30), min_size=1, max_size=8),
    st.integers(3, 12),
)
def test_pooled_ngrams_follow_the_target_token_after_token(
    table: list[int], window: int, ngram: int, prompt: list[int], steps: int
) -> None:
    """With a target whose greedy next token depends on the last token only (``table``), every n-gram the window
    pools is one that target would write token after token, and the window never holds more than N - 1 levels."""
    drafter = started(LookaheadSettings(window, ngram, 3, pool_from_text=False), prompt)
    for _ in range(steps):
        proposal = drafter.propose(2)
        assert proposal.probe is not None and proposal.probe.size <= drafter.probe_nodes
        drafter.accept([table[drafter.history[-1]]])  # the target commits one token
        drafter.observe_probe(proposal.probe, [table[int(t)] for t in proposal.probe.tokens])
        assert 1 <= len(drafter._levels) <= ngram - 1
    for key, grams in drafter._pool._grams.items():
        for gram in grams:
            chain = [key, *gram]
            assert all(chain[i + 1] == table[chain[i]] for i in range(len(gram))), chain
    filled = max(steps - (ngram - 2), 0)
    assert drafter.request_counters()["window_ngrams"] == window * max(filled, 0)


def test_pool_keeps_the_most_recent_distinct_continuations() -> None:
    pool = NgramPool(2, per_key=2)
    pool.add(1, [2, 3])
    pool.add(1, [4, 5])
    pool.add(1, [2, 3])  # again: most recent
    pool.add(1, [6, 7])  # evicts [4, 5]
    assert pool.get(1) == [(6, 7), (2, 3)] and len(pool) == 2
    with pytest.raises(ValueError, match="2 tokens"):
        pool.add(1, [1])
    pool.add_text([9, 8, 7, 6])
    assert pool.get(9) == [(8, 7)] and pool.get(8) == [(7, 6)] and pool.get(7) == []


def test_text_ngrams_draft_before_the_window_warms_up() -> None:
    drafter = started(LookaheadSettings(2, 3, 2), [5, 6, 7, 1, 5])
    assert drafter.propose(4).tokens.tolist() == [6, 7]  # the prompt's n-gram after the root 5
    tree = drafter.propose_tree(DYNAMIC)
    assert tree.tokens.tolist() == [6, 7] and tree.probe is not None
    drafter.accept([6])
    drafter.rewind(5)
    assert drafter.history == [5, 6, 7, 1, 5]
    assert drafter.request_counters() == {"proposals": 2, "pool_hits": 2, "window_ngrams": 0}


def test_settings_and_specs_are_checked(pair: TinyPair) -> None:
    for spec in ("lookahead", "lookahead:5,4,3"):
        check_drafter_spec(spec)
        assert is_model_free(spec)
        drafter = build_drafter(spec, pair.target)
        assert isinstance(drafter, ProbingDrafter) and drafter.probe_nodes == probe_nodes_of(spec)
    assert probe_nodes_of("lookahead:5,4,3") == 15 and probe_nodes_of("ngram") == 0
    for bad, needle in (
        ("lookahead:5,1,3", "N >= 2"),
        ("lookahead:5", "three integers"),
        ("lookahead:x,y,z", "three integers"),
        ("lookahead:200,3,2", "too many"),
        ("lookahed", "Did you mean 'lookahead'"),
    ):
        with pytest.raises(InvalidDrafterSpec, match=needle):
            check_drafter_spec(bad)
    with pytest.raises(InvalidTree, match="deterministic"):
        Draft(torch.tensor([1]), None, DraftTree.chain(torch.tensor([1]), torch.ones(1, 4) / 4))


# ---------------------------------------------------------------------------------------------
# The wire


def test_probe_and_its_answer_cross_the_wire() -> None:
    probe = DraftTree(torch.tensor([3, 4, 5]), (ROOT, 0, 1))
    sent = DraftTree(torch.tensor([1, 2]), (ROOT, ROOT), probe=probe)
    back = codec.decode_draft(codec.encode_draft("r", 0, sent), 64)
    assert isinstance(back, DraftTree) and back.probe is not None
    assert back.probe.tokens.tolist() == [3, 4, 5] and back.probe.parents == (ROOT, 0, 1)
    chain = codec.decode_draft(codec.encode_draft("r", 0, Draft(torch.tensor([1]), None, probe)), 64)
    assert isinstance(chain, Draft) and chain.probe is not None and chain.probe.size == 3

    outcome = CycleOutcome(ChainVerdict(1, 9, TokenKind.BONUS), [1, 9], None, 0.0, 12, probe_argmax=(7, 8, 6))
    info = codec.parse_verdict(codec.encode_verdict("r", 0, outcome).SerializeToString())
    assert info.probe_argmax == (7, 8, 6)
    assert info.outcome(Draft(torch.tensor([1]), None, probe), 10).probe_argmax == (7, 8, 6)
    with pytest.raises(codec.WireError, match="3 probe tokens for a probe of 0 nodes"):
        info.outcome(Draft(torch.tensor([1]), None), 10)

    message = codec.encode_draft("r", 0, sent)
    message.probe_parents.append(0)
    with pytest.raises(codec.WireError, match="probe has 3 tokens but 4 parents"):
        codec.decode_draft(message, 64)
    message = codec.encode_draft("r", 0, sent)
    message.probe_token_ids[0] = 99
    with pytest.raises(codec.WireError, match="outside the vocabulary"):
        codec.decode_draft(message, 64)
    message = codec.encode_draft("r", 0, sent)
    message.probe_parents[0] = 2
    with pytest.raises(codec.WireError, match="malformed draft tree"):
        codec.decode_draft(message, 64)


# ---------------------------------------------------------------------------------------------
# Exactness in the engines


@pytest.mark.parametrize("shape", ["chain1", "chain4", "dynamic", "static", "adaptive"])
def test_greedy_output_equals_transformers(pair: TinyPair, hf_greedy: HfGreedy, shape: str) -> None:
    drafter = LookaheadDrafter()
    engine = SpeculativeEngine(pair.target, drafter, schedules())
    tree = {"dynamic": DYNAMIC, "static": STATIC}.get(shape)
    if shape == "adaptive":  # the adaptive policy picks each cycle's γ
        config = GenerationConfig(REF_TOKENS, gamma=3, policy="adaptive")
    else:
        config = GenerationConfig(REF_TOKENS, gamma=int(shape[-1]) if tree is None else 4, tree=tree)
    accepted = pooled = 0
    for prompt in (*pair.prompts, REPETITIVE):
        result = engine.generate(list(prompt), GREEDY, config)
        assert result.output_ids == hf_greedy(pair.target, prompt, REF_TOKENS), prompt
        accepted += result.stats.accepted_tokens
        pooled += result.stats.drafter_counters["window_ngrams"]  # the drafter's counters reach the stats
        assert result.stats.drafter_counters == drafter.request_counters()
    assert accepted > 0 and pooled > 0, "no draft accepted or no window n-gram: the test would exercise nothing"


def test_a_request_chooses_lookahead(pair: TinyPair, hf_greedy: HfGreedy) -> None:
    """With a draft model configured, a request names ``lookahead`` (built on first use, its window's KV reserved
    in a batched engine too)."""
    engine = SpeculativeEngine(pair.target, build_drafter_set(pair.draft, pair.target))
    batched = BatchedEngine(pair.target, request_drafters(pair.draft, pair.target), max_num_seqs=2, max_seq_len=96)
    config = GenerationConfig(20, gamma=3, drafter="lookahead")
    for prompt in (REPETITIVE, pair.prompts[0]):
        expected = hf_greedy(pair.target, prompt, 20)
        alone = engine.generate(list(prompt), GREEDY, config)
        assert alone.output_ids == expected and alone.stats.drafter_counters["proposals"] > 0
        assert batched.generate(list(prompt), GREEDY, config).output_ids == expected


def test_batched_greedy_output_equals_transformers(pair: TinyPair, hf_greedy: HfGreedy) -> None:
    engine = BatchedEngine(
        pair.target, request_drafters("lookahead:3,3,3", pair.target), max_num_seqs=4, max_seq_len=96
    )
    configs = [
        GenerationConfig(24, gamma=3),
        GenerationConfig(24, tree=DYNAMIC),
        GenerationConfig(24, tree=STATIC),
        GenerationConfig(24, gamma=2, drafter="ngram"),  # beside a request without a probe
    ]
    prompts = [list(REPETITIVE), *[list(p) for p in pair.prompts[:3]]]
    ids = [engine.submit(prompt, GREEDY, config) for prompt, config in zip(prompts, configs, strict=True)]
    results = finish_all(engine)
    for request_id, prompt in zip(ids, prompts, strict=True):
        assert results[request_id].output_ids == hf_greedy(pair.target, prompt, 24), prompt
    assert sum(results[i].stats.accepted_tokens for i in ids[:3]) > 0
    assert all(results[i].stats.drafter_counters["proposals"] > 0 for i in ids[:3])  # counted in a batch too
    assert_pool_empty(engine)  # every span, probe room included, given back


def test_sampled_output_follows_the_target(tiny_pairs: dict[str, TinyPair]) -> None:
    """Two tokens at T = 1 through the engine, a tree of pooled n-grams and the window in every forward: their
    joint law is the target's. The prompt repeats "30 31" with three continuations, so the pool drafts after 31.
    2,000 seeds as requests of one batched engine, whose first seeds the single-request engine emits alike."""
    pair = tiny_pairs["llama"]
    settings = LookaheadSettings(3, 2, 3)
    batched = BatchedEngine(pair.target, lambda name: LookaheadDrafter(settings), max_num_seqs=32)
    prompt = [7, 30, 31, 32, 8, 30, 31, 33, 9, 30, 31, 34, 6, 30, 31]
    params = SamplingParams(temperature=1.0, top_k=24)
    config = GenerationConfig(max_new_tokens=2, tree=DYNAMIC, ignore_eos=True)
    runs = batched_runs(batched, prompt, params, config, 2000)
    assert two_token_fit([run.output_ids for run in runs], pair.target, prompt, params) > ALPHA
    assert sum(run.stats.drafted_tokens for run in runs) == 3 * 2000  # the three pooled continuations of 31, every time
    single = SpeculativeEngine(pair.target, LookaheadDrafter(settings))
    check_single_engine_agrees(single, runs, prompt, params, config)


@pytest.mark.timeout(300)
def test_a_distributed_replica_drafts_with_lookahead(
    ray_cluster: Any, saved_pairs: dict[str, Any], tiny_pairs: dict[str, TinyPair], hf_greedy: HfGreedy
) -> None:
    """One replica (TP 2, batched) configured with ``lookahead``: chains and trees give transformers' greedy text;
    the probe crosses the gRPC stream, every shard mirrors its forward, and its answer comes back: each request
    drafts and accepts exactly what the in-process engine does."""
    from specserve.actors.coordinator import Coordinator
    from specserve.actors.replica import ReplicaConfig

    pair = tiny_pairs["llama"]
    models = saved_pairs["llama"]
    config = ReplicaConfig(
        target=str(models / "target"), draft="lookahead", dtype="float64", tp_degree=2, max_num_seqs=2
    )
    coordinator = Coordinator.spawn(config)
    try:
        local = SpeculativeEngine(pair.target, LookaheadDrafter())
        accepted = 0
        for prompt, request in (
            (REPETITIVE, GenerationConfig(20, gamma=3)),
            (pair.prompts[0], GenerationConfig(20, tree=DYNAMIC)),
            (pair.prompts[2], GenerationConfig(20, gamma=2)),
            (pair.prompts[3], GenerationConfig(20, gamma=3, drafter="lookahead")),  # named by the request
        ):
            got = coordinator.generate(prompt, GREEDY, request)
            assert got.output_ids == hf_greedy(pair.target, prompt, 20), prompt
            alone = local.generate(prompt, GREEDY, request).stats
            assert got.stats.draft_length_histogram == alone.draft_length_histogram, prompt
            assert got.stats.accepted_length_histogram == alone.accepted_length_histogram, prompt
            accepted += got.stats.accepted_tokens
        assert accepted > 0
    finally:
        coordinator.shutdown()
