"""Batched draft-model chains equal the one-row drafter's, request by request.

Several requests — prompts of 1 to 120 tokens (one near the draft's ``max_positions``), greedy, seeded
sampling (temperature, top-k, top-p) and drafter-invariant sampling — are driven through
:class:`~specserve.drafters.batched_model.BatchedDraftModel` and, call for call, through independent
:class:`~specserve.drafters.model.DraftModelDrafter` instances with identically seeded generators: budgets
from 0 up, verdicts committing 0 to all draft tokens plus one more, rewinds. Every chain's tokens are equal,
its q allclose (float64), and the generators end in the same state. Slots are reused after release and the
pool is empty at the end. Long catch-ups are fed whole or in chunks. Also: the forwards a call makes (long
catch-ups apart, then one per drafted position), shared generators, trees, the registry and bad input.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

import pytest
import torch
from conftest import MAX_POSITIONS, VOCAB, TinyPair

from specserve.core.draft.drafter import BatchedDrafter, ChainBatcher, Draft
from specserve.core.kv.pool import PoolFull
from specserve.core.sampling.params import SamplingParams
from specserve.core.tree.shapes import TreeBudget, TreeSpec
from specserve.drafters.batched_model import BatchedDraftModel, PooledDraftModelDrafter
from specserve.drafters.model import DraftModelDrafter
from specserve.drafters.ngram import NgramDrafter
from specserve.drafters.registry import request_drafters

PARAMS = (
    SamplingParams(),
    SamplingParams(temperature=1.0, seed=5),
    SamplingParams(temperature=0.8, top_k=12, seed=9),
    SamplingParams(temperature=0.9, top_p=0.8, seed=3),
    SamplingParams(temperature=1.0, seed=2, drafter_invariant=True),
    SamplingParams(temperature=0.7, top_k=20, top_p=0.9, seed=11),
    SamplingParams(),
)


def prompts(pair: TinyPair) -> list[list[int]]:
    """Seven prompts of different lengths: a 1-token one, the fixture's, a 40-token one and a 120-token one
    whose context soon reaches the draft's max_positions (128)."""
    generator = torch.Generator().manual_seed(77)
    long = torch.randint(3, VOCAB, (40,), generator=generator).tolist()
    longest = torch.randint(3, VOCAB, (MAX_POSITIONS - 8,), generator=generator).tolist()
    return [[17], list(pair.prompts[0]), long, list(pair.prompts[1]), list(pair.length_prompts[0]), longest,
            list(pair.prompts[2])]  # fmt: skip


def seeded(params: SamplingParams) -> torch.Generator:
    return torch.Generator().manual_seed(1000 + params.seed)


def assert_same(got: Draft, want: Draft) -> None:
    assert got.tokens.tolist() == want.tokens.tolist()
    assert got.tokens.dtype == want.tokens.dtype == torch.long
    if want.draft_probs is None:
        assert got.draft_probs is None
    else:
        assert got.draft_probs is not None
        torch.testing.assert_close(got.draft_probs, want.draft_probs, rtol=1e-9, atol=1e-12)


def verdict(draft: Draft, accepted: int, extra: int) -> list[int]:
    """What a verdict commits: the first ``accepted`` draft tokens and one more (recovered or bonus)."""
    return [*draft.tokens[:accepted].tolist(), extra]


def run_cycles(
    batcher: BatchedDraftModel,
    pooled: Sequence[PooledDraftModelDrafter],
    alone: Sequence[DraftModelDrafter],
    cycles: int,
    budget_of: Callable[[int, int], int],
) -> None:
    """``cycles`` proposals of every request (budget_of(cycle, request)), checked equal, then verdicts and
    some rewinds, given to both."""
    for cycle in range(cycles):
        budgets = [budget_of(cycle, i) for i in range(len(pooled))]
        got = batcher.propose_chains(pooled, budgets)
        want = [drafter.propose(budget) for drafter, budget in zip(alone, budgets, strict=True)]
        assert len(got) == len(want)
        for got_draft, want_draft in zip(got, want, strict=True):
            assert_same(got_draft, want_draft)
        for i, (mine, theirs, draft) in enumerate(zip(pooled, alone, want, strict=True)):
            accepted = (cycle + i) % (draft.gamma + 1)  # 0 .. all of the chain
            committed = verdict(draft, accepted, extra=3 + (7 * cycle + 5 * i) % (VOCAB - 3))
            mine.accept(committed)
            theirs.accept(committed)
            if (cycle + i) % 4 == 3 and len(theirs._context) > 3:  # an overlap-mode rewind past the verdict
                length = len(theirs._context) - 2
                mine.rewind(length)
                theirs.rewind(length)


@pytest.mark.parametrize("catch_up_tokens", [128, 3])  # long catch-ups whole, or in chunks
def test_chains_equal_one_drafter_per_request(pair: TinyPair, catch_up_tokens: int) -> None:
    batcher = BatchedDraftModel(pair.draft, pair.target, max_num_seqs=8, max_seq_len=MAX_POSITIONS,
                                catch_up_tokens=catch_up_tokens)  # fmt: skip
    pooled, alone = [], []
    mine_generators, their_generators = [], []
    for prompt, params in zip(prompts(pair), PARAMS, strict=True):
        mine, theirs = batcher.new_drafter(), DraftModelDrafter(pair.draft, pair.target)
        mine_generators.append(seeded(params))
        their_generators.append(seeded(params))
        mine.start(prompt, params, mine_generators[-1])
        theirs.start(prompt, params, their_generators[-1])
        pooled.append(mine)
        alone.append(theirs)
    assert batcher.pool.num_sequences == 7

    run_cycles(batcher, pooled, alone, cycles=7, budget_of=lambda cycle, i: (cycle + 2 * i) % 6)  # 0 .. 5

    for mine_generator, their_generator in zip(mine_generators, their_generators, strict=True):
        assert torch.equal(mine_generator.get_state(), their_generator.get_state())
    # the longest request at the draft's max_positions: its chains are cut, then empty
    length = len(pooled[5].context)
    for drafter in (pooled[5], alone[5]):
        drafter.rewind(min(length, MAX_POSITIONS - 2))
        drafter.accept([9] * (MAX_POSITIONS - 2 - length))
    for length in (2, 0):
        got, want = batcher.propose_chains([pooled[5]], [5])[0], alone[5].propose(5)
        assert_same(got, want)
        assert got.gamma == length
        pooled[5].accept([7, 8])
        alone[5].accept([7, 8])

    # released spans are reused by new requests, which again draft as they would alone
    released = [pooled[1].seq_id, pooled[4].seq_id]
    for i in (1, 4):
        pooled[i].release()
        pooled[i].release()  # idempotent
    assert batcher.pool.num_sequences == 5
    for i, prompt in ((1, list(pair.eos_prompts[0])), (4, list(pair.prompts[3]))):
        params = SamplingParams(temperature=1.0, seed=40 + i)
        pooled[i].start(prompt, params, seeded(params))
        alone[i].start(prompt, params, seeded(params))
    assert sorted(d.seq_id for d in (pooled[1], pooled[4])) == sorted(released)  # type: ignore[type-var]
    pooled[2].start(list(pair.prompts[4]), PARAMS[0], seeded(PARAMS[0]))  # started again: its old span is freed
    alone[2].start(list(pair.prompts[4]), PARAMS[0], seeded(PARAMS[0]))
    assert batcher.pool.num_sequences == 7
    run_cycles(batcher, pooled, alone, cycles=3, budget_of=lambda cycle, i: 1 + (cycle + i) % 4)

    for drafter in pooled:
        drafter.release()
    assert batcher.pool.num_sequences == 0 and batcher.pool.free_tokens == batcher.pool.capacity


def test_one_forward_per_drafted_position(pair: TinyPair, monkeypatch: pytest.MonkeyPatch) -> None:
    """Short catch-ups and the first draft tokens go in one forward together (long catch-ups are fed before, in
    rows of their own), then one forward per further token of the longest chain."""
    batcher = BatchedDraftModel(pair.draft, pair.target, max_num_seqs=4, max_seq_len=64)
    drafters = [batcher.new_drafter() for _ in range(4)]
    for i, drafter in enumerate(drafters):
        drafter.start(list(pair.prompts[i]), PARAMS[i], seeded(PARAMS[i]))
    calls: list[list[int]] = []
    forward_batch = pair.draft.forward_batch

    def counted(pool: Any, blocks: Any, last_only: bool = False, graphs: Any = None) -> list[torch.Tensor]:
        calls.append([block.size for block in blocks])
        return forward_batch(pool, blocks, last_only=last_only, graphs=graphs)

    monkeypatch.setattr(pair.draft, "forward_batch", counted)
    drafts = batcher.propose_chains(drafters, [3, 0, 5, 1])
    assert [d.gamma for d in drafts] == [3, 0, 5, 1]
    assert [len(pair.prompts[i]) for i in (0, 2, 3)] == [11, 6, 1]
    assert calls[0] == [10, 5]  # the long catch-ups but their last tokens, in a forward of their own
    assert calls[1] == [1, 1, 1]  # then every row's last committed token, in one forward
    assert calls[2:] == [[1, 1], [1, 1], [1], [1]]  # then the rows still drafting, one token each
    # the next catch-ups feed only what the spans lack: drafts that were accepted stay cached
    for drafter, draft, accepted in zip(drafters, drafts, [1, 0, 5, 1], strict=True):
        drafter.accept(verdict(draft, accepted, extra=30))
    calls.clear()
    batcher.propose_chains(drafters, [1, 1, 1, 1])
    assert calls == [[len(pair.prompts[1])], [1, 1, 2, 2]]
    for drafter in drafters:
        drafter.release()


def test_shared_generator_sees_the_draws_of_requests_one_after_another(pair: TinyPair) -> None:
    batcher = BatchedDraftModel(pair.draft, pair.target, max_num_seqs=3, max_seq_len=64)
    params = [SamplingParams(temperature=1.0, seed=1), SamplingParams(), SamplingParams(temperature=0.9, top_k=8)]
    mine_generator, their_generator = torch.Generator().manual_seed(8), torch.Generator().manual_seed(8)
    pooled, alone = [], []
    for i, request_params in enumerate(params):
        pooled.append(batcher.new_drafter())
        alone.append(DraftModelDrafter(pair.draft, pair.target))
        pooled[-1].start(list(pair.prompts[i]), request_params, mine_generator)
        alone[-1].start(list(pair.prompts[i]), request_params, their_generator)
    run_cycles(batcher, pooled, alone, cycles=3, budget_of=lambda cycle, i: 2 + (cycle + i) % 3)
    assert torch.equal(mine_generator.get_state(), their_generator.get_state())
    for drafter in pooled:
        drafter.release()


def test_propose_alone_and_trees(pair: TinyPair) -> None:
    batcher = BatchedDraftModel(pair.draft, pair.target, max_num_seqs=1, max_seq_len=64)
    mine, theirs = batcher.new_drafter(), DraftModelDrafter(pair.draft, pair.target)
    params = SamplingParams(temperature=0.8, top_k=12, seed=4)
    mine.start(list(pair.prompts[0]), params, seeded(params))
    theirs.start(list(pair.prompts[0]), params, seeded(params))
    spec = TreeSpec("dynamic", budget=TreeBudget(depth=3, width=2, nodes=5))
    for cycle in range(3):
        chain = theirs.propose(3)
        assert_same(mine.propose(3), chain)
        tree, want = mine.propose_tree(spec), theirs.propose_tree(spec)
        assert tree.tokens.tolist() == want.tokens.tolist() and tree.parents == want.parents
        committed = verdict(chain, cycle % 4, extra=10 + cycle)
        mine.accept(committed)
        theirs.accept(committed)
    mine.release()


def test_protocols_and_registry(pair: TinyPair) -> None:
    new_drafter = request_drafters(pair.draft, pair.target, max_num_seqs=2, max_seq_len=64)
    first, second = new_drafter("default"), new_drafter("default")
    assert isinstance(first, PooledDraftModelDrafter) and isinstance(second, PooledDraftModelDrafter)
    assert isinstance(first, BatchedDrafter) and isinstance(first.batcher, ChainBatcher)
    assert first.batcher is second.batcher and first.name == "model"
    assert isinstance(new_drafter("ngram"), NgramDrafter)
    assert isinstance(request_drafters(pair.draft, pair.target)("default"), DraftModelDrafter)  # as before
    assert isinstance(request_drafters("ngram", pair.target, max_num_seqs=2)("default"), NgramDrafter)
    with pytest.raises(ValueError, match="give max_num_seqs"):
        request_drafters(pair.draft, pair.target, max_seq_len=64)


def test_bad_input_is_refused_before_any_forward(pair: TinyPair) -> None:
    batcher = BatchedDraftModel(pair.draft, pair.target, max_num_seqs=2, max_seq_len=16)
    drafter, other = batcher.new_drafter(), batcher.new_drafter()
    with pytest.raises(RuntimeError, match="start"):
        drafter.propose(2)
    drafter.start([5, 6, 7], SamplingParams(), seeded(SamplingParams()))
    with pytest.raises(ValueError, match="2 budgets"):
        batcher.propose_chains([drafter], [1, 2])
    with pytest.raises(ValueError, match="more than once"):
        batcher.propose_chains([drafter, drafter], [1, 2])
    foreign = BatchedDraftModel(pair.draft, pair.target, max_num_seqs=1, max_seq_len=16).new_drafter()
    for stranger in (DraftModelDrafter(pair.draft, pair.target), foreign):
        with pytest.raises(ValueError, match="not a drafter of this batcher"):
            batcher.propose_chains([drafter, stranger], [1, 1])
    with pytest.raises(PoolFull, match="positions"):
        drafter.propose(15)  # 3 committed + 15 drafted - 1 > 16
    assert drafter.propose(14).gamma == 14  # exactly fills its span
    with pytest.raises(PoolFull, match="does not fit"):
        other.start(list(range(3, 20)), SamplingParams(), seeded(SamplingParams()))
    other.start([4], SamplingParams(), seeded(SamplingParams()))
    with pytest.raises(PoolFull, match="16 tokens asked, 0 of the KV pool's 32 are free"):
        batcher.new_drafter().start([4], SamplingParams(), seeded(SamplingParams()))
    drafter.release()
    with pytest.raises(RuntimeError, match="start"):
        batcher.propose_chains([other, drafter], [1, 1])
    other.release()
    assert batcher.pool.num_sequences == 0
