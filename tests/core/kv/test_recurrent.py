"""Hybrid models' recurrent layers under speculation: after every verify cycle the cache is what a fresh prefill of
the committed text leaves (specserve.core.kv.recurrent, and the batched pool's checkpoints:
specserve.core.kv.pool_states).

The tiny Qwen3-Next (Gated DeltaNet), Granite-4 (Mamba-2) and Falcon-H1 (attention and Mamba-2 side by side)
checkpoints of tests/family_checkpoints.py run through the
target verifier with scripted proposals: chains and trees whose first j tokens are the target's own greedy choice
(transformers' forward over the reloaded checkpoint decides it) and the rest wrong, for every j from none to all,
so cycles reject at every depth and accept whole blocks. After each cycle every recurrent layer's recurrent and
convolution states and every attention layer's keys and values equal those of a new cache that read the committed
text in one forward — to 1e-5: the models are float64, but transformers' Gated DeltaNet and Mamba-2 kernels compute
in float32 whatever the model's dtype — and the committed text is the target's greedy continuation. Also: a
rollback before the checkpoint (a stop string), which reads the kept text again. The batched engine (requests joining
and leaving, chunked prefills, drafters mixed): greedy output is the target's, and after every step every running
sequence's checkpoint equals a fresh prefill of the tokens it is after; seeded sampling equals the single-request
engine's. At T = 1 through dynamic trees the output follows the target's law (chi-square). And the one-line refusals:
trees in a batched replica, tensor parallelism, static shapes, layer-skip drafting.
"""

from __future__ import annotations

import itertools
from dataclasses import replace
from types import SimpleNamespace

import pytest
import torch
from conftest import assert_pool_empty, finish_all
from family_checkpoints import ALPHA, DYNAMIC, Checkpoint, make_checkpoint
from stats_helpers import batched_runs, check_single_engine_agrees, split_seeds, two_token_fit
from transformers.cache_utils import LinearAttentionCacheLayerMixin

from specserve.core.batch_engine import BatchedEngine
from specserve.core.draft.drafter import Draft
from specserve.core.engine import SpeculativeEngine
from specserve.core.errors import InvalidRequest, UserError
from specserve.core.kv.recurrent import RecurrentKVCache, recurrent_layers
from specserve.core.model.tensor_parallel import TensorParallelError, check_shardable
from specserve.core.request import GenerationConfig, GenerationResult
from specserve.core.sampling.params import SamplingParams
from specserve.core.static.options import StaticOptions
from specserve.core.static.slots import StaticTarget
from specserve.core.target import LocalSequence, TargetVerifier
from specserve.core.tree.draft_tree import DraftTree
from specserve.drafters.layerskip import early_exit_model

HYBRIDS = ["qwen3-next", "granite-4"]
PROMPT = [17, 33, 60, 9, 41, 40]
GAMMA = 3
# transformers' Gated DeltaNet and Mamba-2 kernels compute in float32 whatever the model's dtype, and a block read in
# one forward rounds differently from the same tokens read over several: states agree to float32's rounding (they are
# O(0.1-1)); an error in the rollback moves them by the size of a token's update
TOLERANCE = 1e-5
FAMILY_FOR_LAW = "qwen3-next"


@pytest.fixture(scope="module", params=HYBRIDS)
def hybrid(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory) -> Checkpoint:
    return make_checkpoint(request.param, tmp_path_factory)


# and Falcon-H1, whose every layer runs attention and Mamba-2 side by side (served one request at a time)
@pytest.fixture(scope="module", params=[*HYBRIDS, "falcon-h1"])
def any_hybrid(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory) -> Checkpoint:
    return make_checkpoint(request.param, tmp_path_factory)


def reference_greedy(checkpoint: Checkpoint, text: list[int], count: int) -> list[int]:
    """The target's next ``count`` greedy tokens after ``text``, by transformers' forward over the whole text each
    time (no cache; EOS does not stop it)."""
    text = list(text)
    for _ in range(count):
        with torch.no_grad():
            text.append(int(checkpoint.reference(torch.tensor([text])).logits[0, -1].argmax()))
    return text[-count:]


def wrong(token: int) -> int:
    return (token + 1) % 90 + 3  # never the greedy token, never EOS (2)


def assert_cache_is_a_fresh_prefill(checkpoint: Checkpoint, cache: RecurrentKVCache, text: list[int]) -> None:
    tolerance = TOLERANCE
    fresh = checkpoint.target.new_cache()
    assert isinstance(fresh, RecurrentKVCache)
    checkpoint.target.forward(fresh, torch.tensor(text))
    assert cache.length == len(text) and not cache.pending
    assert recurrent_layers(cache.inner), "a hybrid checkpoint must have recurrent layers"
    for index, (ours, theirs) in enumerate(zip(cache.inner.layers, fresh.inner.layers, strict=True)):
        if isinstance(ours, LinearAttentionCacheLayerMixin):
            assert isinstance(theirs, LinearAttentionCacheLayerMixin)
            for name in ("recurrent_states", "conv_states"):
                got, want = getattr(ours, name)[0], getattr(theirs, name)[0]
                assert torch.allclose(got, want, atol=tolerance, rtol=0), f"layer {index} {name} after {len(text)}"
        if getattr(ours, "keys", None) is not None:  # an attention layer, or one with attention beside its mixer
            assert torch.allclose(ours.keys, theirs.keys, atol=tolerance, rtol=0), f"layer {index} keys"
            assert torch.allclose(ours.values, theirs.values, atol=tolerance, rtol=0), f"layer {index} values"


def scripted_cycles(
    checkpoint: Checkpoint,
    make_proposal: callable,
    cycles: int,  # type: ignore[valid-type]
) -> tuple[TargetVerifier, list[int]]:
    """Runs ``cycles`` verify cycles whose proposal ``make_proposal(greedy, j)`` builds from the target's next greedy
    tokens, with j of them kept right; checks the cache after the prefill and every cycle."""
    sequence = LocalSequence(checkpoint.target)
    verifier = TargetVerifier(sequence, PROMPT, SamplingParams(), torch.Generator(), max_new_tokens=64)
    verifier.prefill()
    cache = sequence.cache
    assert isinstance(cache, RecurrentKVCache)
    assert_cache_is_a_fresh_prefill(checkpoint, cache, PROMPT[:-1])
    accepted = []
    for cycle, right in zip(range(cycles), itertools.cycle(range(GAMMA + 1)), strict=False):
        greedy = reference_greedy(checkpoint, verifier.committed, GAMMA + 1)
        outcome = verifier.verify(make_proposal(greedy, right))
        accepted.append(len(outcome.new_tokens) - 1)
        assert outcome.new_tokens == greedy[: len(outcome.new_tokens)], f"cycle {cycle}"
        assert_cache_is_a_fresh_prefill(checkpoint, cache, verifier.committed[:-1])
    return verifier, accepted


def test_chain_cycles_leave_the_states_of_a_fresh_prefill(any_hybrid: Checkpoint) -> None:
    def chain(greedy: list[int], right: int) -> Draft:
        tokens = greedy[:right] + [wrong(token) for token in greedy[right:GAMMA]]
        return Draft(torch.tensor(tokens), None)

    _, accepted = scripted_cycles(any_hybrid, chain, cycles=8)
    assert set(accepted) == set(range(GAMMA + 1)), "every depth of rejection, and whole blocks accepted"


def test_tree_cycles_leave_the_states_of_a_fresh_prefill(any_hybrid: Checkpoint) -> None:
    """A tree of two branches from the root, each three deep: the right one first or second, and as deep as j."""

    def tree(greedy: list[int], right: int) -> DraftTree:
        good = greedy[:right] + [wrong(token) for token in greedy[right:GAMMA]]
        bad = [wrong(greedy[0]) + 1, *greedy[1:GAMMA]]  # wrong at its first node
        first, second = (good, bad) if right % 2 else (bad, good)
        tokens = torch.tensor(first + second)
        return DraftTree(tokens, (-1, 0, 1, -1, 3, 4))

    _, accepted = scripted_cycles(any_hybrid, tree, cycles=8)
    assert set(accepted) == set(range(GAMMA + 1))


def test_a_rollback_before_the_checkpoint_reads_the_kept_text_again(any_hybrid: Checkpoint) -> None:
    def chain(greedy: list[int], right: int) -> Draft:
        return Draft(torch.tensor(greedy[:GAMMA]), None)  # all accepted

    verifier, _ = scripted_cycles(any_hybrid, chain, cycles=3)
    cache = verifier.sequence.cache  # type: ignore[attr-defined]
    verifier.stop_at(2)  # a stop string matched early in the output: back past the last cycle's checkpoint
    assert_cache_is_a_fresh_prefill(any_hybrid, cache, verifier.committed[:-1])


def run_checking_checkpoints(hybrid: Checkpoint, engine: BatchedEngine) -> dict[int, GenerationResult]:
    """Runs the engine's requests to the end; after every step, each sequence's recurrent checkpoint in the pool (the
    states of its first tokens) equals a fresh prefill of those tokens. The results by request."""
    states = engine.pool.states
    assert states is not None
    checked = []

    def check() -> None:
        for sequence in engine.pool.sequences:  # running, or kept by the prefix cache
            tokens, saved = states.checkpoint(sequence)
            if not tokens:
                continue
            fresh = hybrid.target.new_cache()
            hybrid.target.forward(fresh, torch.tensor(tokens))
            for index, (conv, state) in saved.items():
                layer = fresh.inner.layers[index]
                assert torch.allclose(conv, layer.conv_states[0], atol=TOLERANCE, rtol=0), f"conv {index}"
                assert torch.allclose(state, layer.recurrent_states[0], atol=TOLERANCE, rtol=0), f"state {index}"
            checked.append(sequence)

    results = finish_all(engine, check)
    assert checked
    return results


def test_the_batched_engine_keeps_every_checkpoint_a_fresh_prefills_and_decodes_greedily(hybrid: Checkpoint) -> None:
    """Eight requests through three slots, prompts prefilled in chunks of 4, draft-model and n-gram chains and plain
    decoding mixed: output equals the target's greedy continuation, and every checkpoint is a fresh prefill's."""
    engine = BatchedEngine(hybrid.target, hybrid.new_drafter, max_num_seqs=3, max_seq_len=64, prefill_tokens=4)
    drafters = ["default", "ngram", "none"]
    prompts = [[(7 * i + 3 * j) % 90 + 3 for j in range(5 + i)] for i in range(8)]
    ids = {
        engine.submit(
            prompt, SamplingParams(), GenerationConfig(max_new_tokens=12, gamma=3, drafter=drafters[i % 3])
        ): prompt
        for i, prompt in enumerate(prompts)
    }
    results = run_checking_checkpoints(hybrid, engine)
    for request_id, prompt in ids.items():
        output = results[request_id].output_ids
        assert output == reference_greedy(hybrid, prompt, 12)[: len(output)]
        assert len(output) == 12 or output[-1] == 2
    assert_pool_empty(engine)


def test_the_next_turn_reuses_the_last_checkpoint_from_the_prefix_cache(hybrid: Checkpoint) -> None:
    """A conversation's second turn (the first turn's prompt and answer, then more) takes the first turn's keys and
    values up to its recurrent checkpoint, and its states there, from the prefix cache; a prompt that shares less than
    the checkpoint reuses nothing; outputs are the target's greedy ones, and every checkpoint a fresh prefill's."""
    engine = BatchedEngine(hybrid.target, hybrid.new_drafter, max_num_seqs=2, max_seq_len=64, prefill_tokens=8)
    config = GenerationConfig(max_new_tokens=10, gamma=3, ignore_eos=True)
    first = [11, 12, 13, 14, 15, 16, 17, 18, 19]
    request = engine.submit(first, SamplingParams(), config)
    answer = run_checking_checkpoints(hybrid, engine)[request].output_ids
    turn = [*first, *answer, 40, 41, 42]
    short = [*first[:3], 50, 51]  # shares 3 tokens: less than any checkpoint
    ids = {engine.submit(prompt, SamplingParams(), config): prompt for prompt in (turn, short)}
    results = run_checking_checkpoints(hybrid, engine)
    for request_id, prompt in ids.items():
        assert results[request_id].output_ids == reference_greedy(hybrid, prompt, 10)
    reused = {tuple(prompt): results[request_id].stats.cached_tokens for request_id, prompt in ids.items()}
    assert reused[tuple(short)] == 0
    assert len(first) <= reused[tuple(turn)] < len(turn) - 1, reused


def test_seeded_sampling_in_a_batch_equals_the_single_request_engine(hybrid: Checkpoint) -> None:
    prompt = [5 + (7 * i) % 60 for i in range(9)]
    params = SamplingParams(temperature=1.0, top_k=24)
    config = GenerationConfig(max_new_tokens=6, gamma=3, ignore_eos=True)
    engine = BatchedEngine(hybrid.target, hybrid.new_drafter, max_num_seqs=4, max_seq_len=32)
    runs = batched_runs(engine, prompt, params, config, 16)
    check_single_engine_agrees(
        SpeculativeEngine(hybrid.target, hybrid.new_drafter("default")), runs, prompt, params, config
    )


def test_draft_trees_and_probes_are_refused_by_a_batched_hybrid_replica(hybrid: Checkpoint) -> None:
    engine = BatchedEngine(hybrid.target, hybrid.new_drafter, max_num_seqs=2, max_seq_len=48)
    with pytest.raises(InvalidRequest, match=r"verifies chains only.*--max-num-seqs 1"):
        engine.submit([5, 6, 7], SamplingParams(), GenerationConfig(max_new_tokens=4, tree=DYNAMIC))


def test_tensor_parallelism_refuses_recurrent_layers(hybrid: Checkpoint) -> None:
    with pytest.raises(TensorParallelError, match="tensor parallel size 1"):
        check_shardable(hybrid.target.model, 2)


def test_sampled_output_through_trees_follows_the_targets_law(tmp_path_factory: pytest.TempPathFactory) -> None:
    """T = 1 with the draft model's dynamic trees, drafted and verified path by path (Qwen3-Next: Gated DeltaNet, and
    experts): the joint law of the two emitted tokens is transformers' own (chi-square over 2,500 seeds, error
    probability 1e-3)."""
    checkpoint = make_checkpoint(FAMILY_FOR_LAW, tmp_path_factory)
    prompt = [5 + (7 * i) % 60 for i in range(12)]
    params = SamplingParams(temperature=1.0, top_k=24)
    config = GenerationConfig(max_new_tokens=2, tree=DYNAMIC, ignore_eos=True)

    def draw(seeds: range) -> list[list[int]]:
        engine = SpeculativeEngine(checkpoint.target, checkpoint.new_drafter("model"))
        return [engine.generate(prompt, replace(params, seed=seed), config).output_ids for seed in seeds]

    outputs = split_seeds(draw, 2500)
    reference = SimpleNamespace(model=checkpoint.reference)
    assert two_token_fit(outputs, reference, prompt, params) > ALPHA


def test_layer_skip_drafting_is_refused_for_a_hybrid(hybrid: Checkpoint) -> None:
    with pytest.raises(UserError, match="recurrent layers cannot share"):
        early_exit_model(hybrid.target, 1)


def test_static_shapes_are_refused_for_a_hybrid(hybrid: Checkpoint) -> None:
    with pytest.raises(UserError, match=r"recurrent .* layers.*without --static-shapes"):
        StaticTarget(hybrid.target, StaticOptions(cuda_graphs=False))
