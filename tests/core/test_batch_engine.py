"""Batch invariance of the batched engine: each request's tokens equal the same request run alone.

A mix of requests — draft model, n-gram and no drafter; chains and dynamic trees; greedy, seeded
sampling (T = 1, top-k) and drafter-invariant sampling; different prompts and lengths; some ending
at EOS, one at a stop string; some joining steps later or waiting for room; prompts prefilled
in chunks over several steps — runs through
:class:`~specserve.core.batch_engine.BatchedEngine`. Every request's output (tokens, finish reason)
equals :class:`~specserve.core.engine.SpeculativeEngine` on that request alone, and greedy ones
equal transformers' ``generate``; float64, both tiny architectures. The pool is empty afterwards.

The same holds with hidden-state drafters (EAGLE with a trained head, Medusa with random heads) and
layer-skip in the mix; underneath, a batched forward captures each row's features as a forward of that
row alone does, and a verifier over a pool sequence hands over the features one over a cache of its own does.
"""

from __future__ import annotations

from collections.abc import Callable
from functools import partial
from typing import Any

import pytest
import torch
from conftest import EOS_ID, VOCAB, TinyPair, assert_pool_empty, finish_all, hf_greedy_ids
from head_helpers import random_heads, trained_head

from specserve.core.batch_engine import BatchedEngine
from specserve.core.batch_step import LocalPool
from specserve.core.draft.drafter import Draft, Drafter
from specserve.core.engine import SpeculativeEngine
from specserve.core.errors import InvalidRequest
from specserve.core.kv.pool import KVPool
from specserve.core.model.causal_lm import BatchBlock, FeatureCapture
from specserve.core.request import GenerationConfig, GenerationResult
from specserve.core.sampling.params import SamplingParams
from specserve.core.target import LocalSequence, PooledSequence, TargetVerifier
from specserve.core.tree.draft_tree import DraftTree
from specserve.core.tree.shapes import TreeBudget, TreeSpec, TreeTopology
from specserve.drafters.eagle import EagleDrafter
from specserve.drafters.layerskip import LayerSkipDrafter
from specserve.drafters.medusa import MedusaDrafter
from specserve.drafters.model import DraftModelDrafter
from specserve.drafters.ngram import NgramDrafter
from specserve.drafters.none import NoDrafter
from specserve.drafters.registry import request_drafters

DYNAMIC = TreeSpec("dynamic", budget=TreeBudget(depth=3, width=2, nodes=5))


def drafter_factory(pair: TinyPair) -> Callable[[str], Drafter]:
    def build(name: str) -> Drafter:
        if name == "ngram":
            return NgramDrafter(max_ngram=3, min_ngram=1)
        if name == "none":
            return NoDrafter()
        return DraftModelDrafter(pair.draft, pair.target)

    return build


def alone(pair: TinyPair, prompt: list[int], params: SamplingParams, config: GenerationConfig) -> GenerationResult:
    engine = SpeculativeEngine(pair.target, drafter_factory(pair)(config.drafter))
    return engine.generate(prompt, params, GenerationConfig(**{**config.__dict__, "drafter": "default"}))


def mixed_requests(pair: TinyPair) -> list[tuple[list[int], SamplingParams, GenerationConfig]]:
    sampled = SamplingParams(temperature=1.0, seed=5)
    top_k = SamplingParams(temperature=0.8, top_k=12, seed=9)
    invariant = SamplingParams(temperature=1.0, seed=2, drafter_invariant=True)
    # a stop string the greedy continuation of some prompt reaches a few tokens in (before any EOS)
    stop_prompt, stop = next(
        (list(prompt), pair.target.tokenizer.decode(ids[2:4]))
        for prompt in (*pair.prompts, *pair.length_prompts)
        if len(ids := hf_greedy_ids(pair.target.model, prompt, 6)) == 6 and EOS_ID not in ids
    )
    return [
        (list(pair.prompts[0]), SamplingParams(), GenerationConfig(max_new_tokens=14, gamma=3)),
        (list(pair.eos_prompts[0]), SamplingParams(), GenerationConfig(max_new_tokens=20, gamma=2, drafter="ngram")),
        (list(pair.prompts[1]), sampled, GenerationConfig(max_new_tokens=12, gamma=4)),
        (list(pair.prompts[2]), SamplingParams(), GenerationConfig(max_new_tokens=10, tree=DYNAMIC)),
        (list(pair.prompts[4]), top_k, GenerationConfig(max_new_tokens=9, tree=DYNAMIC)),
        (list(pair.length_prompts[0]), SamplingParams(), GenerationConfig(max_new_tokens=8, drafter="none")),
        (stop_prompt, SamplingParams(), GenerationConfig(max_new_tokens=16, gamma=2, stop=(stop,))),
        (list(pair.eos_prompts[1]), invariant, GenerationConfig(max_new_tokens=11, gamma=3)),
    ]


def pooled_drafter_factory(pair: TinyPair, max_num_seqs: int) -> Callable[[str], Drafter]:
    """The draft model drafts every request's chain in shared forwards over one KV pool (ngram and none as above)."""
    return request_drafters(pair.draft, pair.target, max_num_seqs=max_num_seqs, max_seq_len=128)


@pytest.mark.timeout(300)
@pytest.mark.parametrize("drafting", ["per-request", "pooled"])
def test_every_request_in_a_mixed_batch_equals_itself_alone(pair: TinyPair, drafting: str) -> None:
    requests = mixed_requests(pair)
    # prompts are prefilled in chunks of at most 5 tokens per step, over all newcomers
    factory = drafter_factory(pair) if drafting == "per-request" else pooled_drafter_factory(pair, 5)
    engine = BatchedEngine(pair.target, factory, max_num_seqs=5, max_seq_len=96, prefill_tokens=5)
    joins = [0, 0, 0, 1, 1, 3, 3, 6]  # step at which each request is submitted; some wait their turn
    ids: dict[int, int] = {}
    results: dict[int, GenerationResult] = {}
    batch_sizes = set()
    step = 0
    while len(results) < len(requests):
        for index, join in enumerate(joins):
            if join == step:
                prompt, params, config = requests[index]
                ids[engine.submit(prompt, params, config)] = index
        for request_id, chunk in engine.step():
            if chunk.result is not None:
                results[ids[request_id]] = chunk.result
        batch_sizes.add(engine.num_running)
        step += 1
        assert step < 200, "the batch never finished"
    assert max(batch_sizes) == 5  # the batch filled up; later requests waited
    finishes = set()
    for index, (prompt, params, config) in enumerate(requests):
        got, want = results[index], alone(pair, prompt, params, config)
        assert got.output_ids == want.output_ids, f"request {index}"
        assert got.finish_reason == want.finish_reason and got.text == want.text
        assert got.stats.cycles == want.stats.cycles and got.stats.accepted_tokens == want.stats.accepted_tokens
        finishes.add(got.finish_reason)
        if params.greedy and got.finish_reason != "stop":
            assert got.output_ids == hf_greedy_ids(pair.target.model, prompt, config.max_new_tokens)
    assert finishes == {"eos", "length", "stop"}  # not vacuous: every way of ending happened inside the batch
    assert_pool_empty(engine)
    assert not engine.has_work
    if drafting == "pooled":  # every request gave its span of the draft model's pool back
        draft_pool = engine.new_drafter("default").batcher.pool  # type: ignore[attr-defined]
        assert draft_pool.num_sequences == 0


def test_one_request_streams_through_the_batch_and_cancellation_frees_its_kv(pair: TinyPair) -> None:
    engine = BatchedEngine(pair.target, drafter_factory(pair), max_num_seqs=2, max_seq_len=96)
    prompt, params, config = mixed_requests(pair)[0]
    assert engine.generate(prompt, params, config).output_ids == alone(pair, prompt, params, config).output_ids
    assert engine.cache is not None and engine.pool.num_sequences == engine.cache.stats.retained_entries == 1
    engine.cache.clear()
    stream = engine.stream(prompt, params, config)
    next(stream)
    assert engine.num_running == 1 and engine.pool.num_sequences == 1
    stream.close()  # the caller went away: the request leaves the batch; the prefix cache keeps its committed KV
    assert engine.num_running == 0
    assert_pool_empty(engine)
    waiting = engine.submit(prompt, params, config)
    engine.cancel(waiting)
    assert not engine.has_work


def test_requests_that_cannot_run_in_a_batch_are_refused(pair: TinyPair) -> None:
    engine = BatchedEngine(pair.target, drafter_factory(pair), max_num_seqs=2, max_seq_len=32, kv_pool_tokens=40)
    prompt = list(pair.prompts[0])
    with pytest.raises(InvalidRequest, match="exceed the 32 tokens a request may hold here"):
        engine.submit(prompt, SamplingParams(), GenerationConfig(max_new_tokens=40))
    big = GenerationConfig(max_new_tokens=4, tree=TreeSpec("dynamic", budget=TreeBudget(depth=8, width=4, nodes=32)))
    need = len(prompt) + 4 + 32  # prompt, output, and a tree of 32 drafts after the last committed token
    with pytest.raises(InvalidRequest, match=f"need {need} KV positions, more than this replica's whole pool \\(40"):
        engine.submit(prompt, SamplingParams(), big)
    assert not engine.has_work


def test_requests_wait_for_the_kv_tokens_they_reserve(pair: TinyPair) -> None:
    """The pool is sized in tokens, not requests: a newcomer starts once the tokens it reserves (prompt, output,
    widest draft) are free, and every request still decodes exactly as alone."""
    config = GenerationConfig(max_new_tokens=10, gamma=2)
    prompts = [list(p) for p in pair.prompts[:4]]
    needs = [len(prompt) + 10 for prompt in prompts]  # chains need no room beyond the output
    room = needs[0] + needs[1]  # two at a time, whatever max_num_seqs allows
    engine = BatchedEngine(pair.target, drafter_factory(pair), max_num_seqs=4, max_seq_len=96, kv_pool_tokens=room)
    ids = {engine.submit(prompt, SamplingParams(), config): prompt for prompt in prompts}
    results: dict[int, GenerationResult] = {}
    running = set()
    while engine.has_work:
        for request_id, chunk in engine.step():
            if chunk.result is not None:
                results[request_id] = chunk.result
        running.add(engine.num_running)
        assert engine.pool.capacity - engine.pool.free_tokens <= room
    assert max(running) == 2
    assert_pool_empty(engine)
    for request_id, prompt in ids.items():
        assert results[request_id].output_ids == alone(pair, prompt, SamplingParams(), config).output_ids


def test_a_long_prompt_is_prefilled_in_chunks_while_the_others_keep_decoding(pair: TinyPair) -> None:
    engine = BatchedEngine(pair.target, drafter_factory(pair), max_num_seqs=2, max_seq_len=96, prefill_tokens=4)
    short, params, config = mixed_requests(pair)[0]
    first = engine.submit(short, params, config)
    while not engine.step():  # the short prompt's chunks, then its first cycle
        pass
    long_prompt = [int(t) for t in (list(pair.prompts[1]) * 6)[:30]]
    long_config = GenerationConfig(max_new_tokens=6, gamma=2)
    second = engine.submit(long_prompt, SamplingParams(), long_config)
    steps_while_prefilling = 0
    results = {}
    while engine.has_work:
        chunks = dict(engine.step())
        if second not in chunks and second not in results:
            steps_while_prefilling += 1
            assert first in chunks or first in results, "the running request stalled during the long prefill"
        for request_id, chunk in chunks.items():
            if chunk.result is not None:
                results[request_id] = chunk.result
    assert steps_while_prefilling >= 29 // 4 - 1  # 29 prompt tokens to cache, 4 per step
    assert results[second].output_ids == alone(pair, long_prompt, SamplingParams(), long_config).output_ids
    assert results[first].output_ids == alone(pair, short, params, config).output_ids
    assert results[second].stats.prefill_seconds > 0


def test_prefill_forwards_compute_at_most_the_budget_padding_included(pair: TinyPair) -> None:
    """Newcomers of very different prompt lengths: every prefill forward computes at most ``prefill_tokens``
    positions, rows × widest chunk (a short chunk never rides along, padded, beside a long one), and every request
    still decodes exactly as alone."""
    engine = BatchedEngine(pair.target, drafter_factory(pair), max_num_seqs=4, max_seq_len=96, prefill_tokens=12)
    computed: list[int] = []
    forward = engine.ops.forward_batch

    def counting(blocks: Any, last_only: bool = False, capture: Any = None) -> Any:
        if last_only:  # prefill chunks
            computed.append(len(blocks) * max(block.size for block in blocks))
        return forward(blocks, last_only=last_only, capture=capture)

    engine.ops.forward_batch = counting  # type: ignore[method-assign]
    prompts = [[int(t) for t in (list(pair.prompts[1]) * 6)[:30]], [5, 6, 7], list(pair.prompts[0]), [9, 8]]
    config = GenerationConfig(max_new_tokens=6, gamma=2)
    ids = {engine.submit(prompt, SamplingParams(), config): prompt for prompt in prompts}
    results = finish_all(engine)
    assert max(computed) == 12  # never more; the 30-token prompt's chunks use the whole budget
    for request_id, prompt in ids.items():
        assert results[request_id].output_ids == alone(pair, prompt, SamplingParams(), config).output_ids


def test_goodput_aware_adaptive_requests_in_a_batch_stay_exact(pair: TinyPair) -> None:
    """Adaptive requests share the replica's step-cost estimate and get their chains aligned in each step: the
    budgets change with the batch, never the tokens (greedy: transformers' own ``generate``)."""
    from specserve.policies.schedules import schedules

    engine = BatchedEngine(pair.target, drafter_factory(pair), schedules=schedules(), max_num_seqs=4, max_seq_len=96)
    prompts = [list(p) for p in pair.prompts[:4]]
    config = GenerationConfig(max_new_tokens=16, gamma=3, policy="adaptive")
    ids = {engine.submit(prompt, SamplingParams(), config): prompt for prompt in prompts}
    results = finish_all(engine)
    for request_id, prompt in ids.items():
        result = results[request_id]
        assert result.output_ids == hf_greedy_ids(pair.target.model, prompt, 16)
        observations = result.stats.observations
        assert max(o.batch_size for o in observations) == 4
        assert all(o.step_positions >= o.batch_size * (o.drafted + 1) for o in observations)
        # each row waited its whole step (planning, drafting, the forward, verdicts): the ceiling charges it that
        assert all(o.step_seconds >= o.verify_seconds > 0 and o.cycle_seconds == o.step_seconds for o in observations)
        assert all(o.step_seconds >= o.draft_seconds for o in observations)
    assert_pool_empty(engine)


# ---------------------------------------------------------------------------------------------
# Hidden-state drafters (EAGLE, Medusa) and layer-skip in a batch

FEATURE_ATOL = 1e-10  # float64: a row's features differ from its sequence alone only by the batch's summation order
STATIC = TreeSpec("static", topology=TreeTopology.from_lists([[0], [1], [0, 0], [0, 1], [1, 0], [0, 0, 0]]))


def test_a_batched_forward_captures_each_rows_features_as_its_forward_alone(pair: TinyPair) -> None:
    """Prefill chunks (last token's logits only), then a chain, a tree and a single token, each row with its own
    feature layers (or none): every capture holds its block's features, as a forward of the block alone does."""
    target = pair.target
    pool = KVPool(target.model, capacity=96)
    seqs = [pool.allocate(32) for _ in range(3)]
    caches = [target.new_cache() for _ in seqs]  # the same sequences alone
    generator = torch.Generator().manual_seed(0)
    prompts = [torch.randint(3, VOCAB, (n,), generator=generator) for n in (7, 2, 12)]
    tree = DraftTree(torch.tensor([5, 6, 7]), (-1, -1, 0))
    prefill = [
        (BatchBlock.chain(seq_id, p), partial(target.forward, input_ids=p, last_only=True))
        for seq_id, p in zip(seqs, prompts, strict=True)
    ]
    verify = [
        (BatchBlock.chain(seqs[0], prompts[1]), partial(target.forward, input_ids=prompts[1])),
        (BatchBlock.tree(seqs[1], 11, tree), partial(target.forward_tree, root=11, tree=tree)),
        (BatchBlock.chain(seqs[2], prompts[1][:1]), partial(target.forward, input_ids=prompts[1][:1])),
    ]
    for rows, layers, last_only in ((prefill, [(2,), None, (0, 1, 2)], True), (verify, [(1,), (2, 0), (2,)], False)):
        captures = [FeatureCapture(wanted) if wanted else None for wanted in layers]
        target.forward_batch(pool, [block for block, _ in rows], last_only=last_only, capture=captures)
        for (block, alone), cache, capture, wanted in zip(rows, caches, captures, layers, strict=True):
            reference = FeatureCapture(wanted or (2,))
            alone(cache, capture=reference)
            if capture is not None:
                assert wanted is not None
                got = capture.take()
                assert got.shape == (block.size, len(wanted) * 32)
                torch.testing.assert_close(got, reference.take(), rtol=0, atol=FEATURE_ATOL)
    with pytest.raises(ValueError, match="2 feature captures for 3 blocks"):
        target.forward_batch(pool, [block for block, _ in verify], capture=[None, None])


def test_a_pooled_verifier_hands_over_the_features_a_local_one_does(pair: TinyPair) -> None:
    """The single-request path through a pool sequence: prefill and cycles (chain, tree) give the features a verifier
    over a cache of its own gives."""
    target = pair.target
    pool = KVPool(target.model, capacity=128)
    ops = LocalPool(target, pool)
    prompt = list(pair.prompts[0])
    verifiers = [
        TargetVerifier(sequence, prompt, SamplingParams(), torch.Generator(), 12, feature_layers=(0, 2))
        for sequence in (LocalSequence(target), PooledSequence(ops, pool.allocate(64)))
    ]
    local, pooled = (verifier.prefill() for verifier in verifiers)
    assert local is not None and pooled is not None and pooled.shape == (len(prompt) - 1, 64)
    torch.testing.assert_close(pooled, local, rtol=0, atol=FEATURE_ATOL)
    for proposal in (Draft(torch.tensor([5, 6, 7]), None), DraftTree(torch.tensor([8, 5, 6]), (-1, -1, 1))):
        local_outcome, pooled_outcome = (verifier.verify(proposal) for verifier in verifiers)
        assert pooled_outcome.new_tokens == local_outcome.new_tokens
        assert pooled_outcome.features is not None and local_outcome.features is not None
        torch.testing.assert_close(pooled_outcome.features, local_outcome.features, rtol=0, atol=FEATURE_ATOL)


def build_drafter(pair: TinyPair, kind: str) -> Drafter:
    """A fresh drafter of ``kind``: a draft model (``model``), ``ngram``, ``none``, ``eagle`` (a trained head),
    ``medusa`` (random heads) or ``layerskip`` (the target's first layer)."""
    if kind == "eagle":
        return EagleDrafter.for_target(trained_head(pair), pair.target)
    if kind == "medusa":
        return MedusaDrafter.for_target(random_heads(pair.target), pair.target)
    if kind == "layerskip":
        return LayerSkipDrafter(pair.target, 1)
    return drafter_factory(pair)("default" if kind == "model" else kind)


class ChosenDrafters:
    """``new_drafter`` for a batch whose requests draft with different drafters: a request's ``default`` drafter
    is of the kind chosen (``kind``) before it was submitted. EAGLE, Medusa and layer-skip requests share one
    set of weights (``fresh`` drafters of one prototype per kind), as the serving registry gives them."""

    def __init__(self, pair: TinyPair) -> None:
        self.pair = pair
        self.kind = "model"
        self.prototypes: dict[str, EagleDrafter | MedusaDrafter | LayerSkipDrafter] = {}

    def __call__(self, name: str) -> Drafter:
        assert name == "default"
        if self.kind not in ("eagle", "medusa", "layerskip"):
            return build_drafter(self.pair, self.kind)
        if self.kind not in self.prototypes:
            prototype = build_drafter(self.pair, self.kind)
            assert isinstance(prototype, EagleDrafter | MedusaDrafter | LayerSkipDrafter)
            self.prototypes[self.kind] = prototype
        return self.prototypes[self.kind].fresh()


@pytest.mark.timeout(300)
def test_hidden_state_and_layer_skip_drafters_in_a_mixed_batch_equal_themselves_alone(pair: TinyPair) -> None:
    """EAGLE, Medusa and layer-skip requests (chains and trees; greedy, seeded and drafter-invariant sampling; a
    1-token prompt; prompts prefilled 4 tokens per step) beside draft-model, n-gram and plain ones, joining at
    different steps: every request's output is its output alone, greedy ones transformers' ``generate``."""
    sampled = SamplingParams(temperature=1.0, seed=7)
    top_k = SamplingParams(temperature=0.8, top_k=12, seed=11)
    invariant = SamplingParams(temperature=1.0, seed=3, drafter_invariant=True)
    greedy = SamplingParams()
    requests = [  # (kind, prompt, params, config, step at which it is submitted)
        ("eagle", pair.prompts[0], greedy, GenerationConfig(max_new_tokens=14, gamma=3), 0),
        ("medusa", pair.prompts[1], greedy, GenerationConfig(max_new_tokens=20, gamma=3), 0),  # loops: accepts
        ("layerskip", pair.prompts[1], sampled, GenerationConfig(max_new_tokens=12, gamma=3), 0),
        ("eagle", pair.prompts[4], top_k, GenerationConfig(max_new_tokens=10, tree=DYNAMIC), 1),
        ("model", pair.length_prompts[0], greedy, GenerationConfig(max_new_tokens=10, gamma=2), 1),
        ("medusa", pair.eos_prompts[0], sampled, GenerationConfig(max_new_tokens=12, tree=STATIC), 2),
        ("eagle", pair.prompts[3], greedy, GenerationConfig(max_new_tokens=10, gamma=2), 3),  # a 1-token prompt
        ("layerskip", pair.eos_prompts[1], greedy, GenerationConfig(max_new_tokens=14, tree=DYNAMIC), 3),
        ("ngram", pair.prompts[0], greedy, GenerationConfig(max_new_tokens=8, gamma=2), 4),
        ("medusa", pair.prompts[1], invariant, GenerationConfig(max_new_tokens=9, gamma=2), 5),
        ("eagle", pair.eos_prompts[0], invariant, GenerationConfig(max_new_tokens=9, tree=DYNAMIC), 6),
        ("none", pair.prompts[2], top_k, GenerationConfig(max_new_tokens=8), 8),
    ]
    drafters = ChosenDrafters(pair)
    engine = BatchedEngine(pair.target, drafters, max_num_seqs=5, max_seq_len=96, prefill_tokens=4)
    ids: dict[int, int] = {}
    results: dict[int, GenerationResult] = {}
    step = 0
    while len(results) < len(requests):
        for index, (kind, prompt, params, config, join) in enumerate(requests):
            if join == step:
                drafters.kind = kind
                ids[engine.submit(list(prompt), params, config)] = index
        for request_id, chunk in engine.step():
            if chunk.result is not None:
                results[ids[request_id]] = chunk.result
        step += 1
        assert step < 200, "the batch never finished"
    accepted: dict[str, int] = {}
    for index, (kind, prompt, params, config, _) in enumerate(requests):
        got = results[index]
        want = SpeculativeEngine(pair.target, build_drafter(pair, kind)).generate(list(prompt), params, config)
        assert got.output_ids == want.output_ids, f"request {index} ({kind})"
        assert got.finish_reason == want.finish_reason
        assert got.stats.cycles == want.stats.cycles and got.stats.accepted_tokens == want.stats.accepted_tokens
        accepted[kind] = accepted.get(kind, 0) + got.stats.accepted_tokens
        if params.greedy:
            assert got.output_ids == hf_greedy_ids(pair.target.model, prompt, config.max_new_tokens)
    assert all(accepted[kind] > 0 for kind in ("eagle", "medusa", "layerskip")), accepted  # not vacuous
    assert not engine.has_work
    assert_pool_empty(engine)
