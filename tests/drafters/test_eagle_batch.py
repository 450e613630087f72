"""EAGLE chains drafted for many requests at once (specserve.drafters.eagle_batch): per request, exactly what its
drafter drafts alone — tokens, q and generator draws — in one head forward per drafted position for the whole batch."""

from __future__ import annotations

from collections.abc import Sequence

import pytest
import torch
from conftest import TinyPair
from head_helpers import trained_head

from specserve.core.draft.drafter import BatchedDrafter, Draft
from specserve.core.model.causal_lm import select_features
from specserve.core.sampling.params import SamplingParams
from specserve.drafters.eagle import EagleDrafter, HeadSlots
from specserve.drafters.eagle_batch import SHORT_CATCH_UP, EagleChains

PARAMS = [
    SamplingParams(),
    SamplingParams(temperature=1.0, top_k=20, seed=1),
    SamplingParams(temperature=0.7, seed=2, drafter_invariant=True),
    SamplingParams(temperature=1.0, seed=3),
    SamplingParams(),
]


def features_of(pair: TinyPair, drafter: EagleDrafter, ids: Sequence[int]) -> torch.Tensor:
    with torch.inference_mode():
        out = pair.target.model(input_ids=torch.tensor([list(ids)]), output_hidden_states=True)
    return select_features(out.hidden_states, drafter.feature_layers)[0]


def started(pair: TinyPair, root: EagleDrafter, prompts: Sequence[list[int]]) -> list[EagleDrafter]:
    """A fresh drafter per prompt, started with its request's parameters and given its prompt's features."""
    drafters = []
    for prompt, params in zip(prompts, PARAMS, strict=False):
        drafter = root.fresh()
        seed = params.seed if params.seed is not None else 0
        drafter.start(prompt, params, torch.Generator().manual_seed(seed))
        drafter.add_features(0, features_of(pair, drafter, prompt)[: len(prompt) - 1])
        drafters.append(drafter)
    return drafters


def commit(pair: TinyPair, drafter: EagleDrafter, draft: Draft, accepted: int, bonus: int) -> None:
    """A verdict: the first ``accepted`` draft tokens and a bonus token join the text, with their features."""
    start = len(drafter.context) - 1
    drafter.accept([*draft.tokens[:accepted].tolist(), bonus])
    drafter.add_features(start, features_of(pair, drafter, drafter.context)[start : len(drafter.context) - 1])


def same(alone: Sequence[Draft], together: Sequence[Draft]) -> None:
    for a, b in zip(alone, together, strict=True):
        assert a.tokens.tolist() == b.tokens.tolist()
        assert (a.draft_probs is None) == (b.draft_probs is None)
        if a.draft_probs is not None and b.draft_probs is not None:
            torch.testing.assert_close(a.draft_probs, b.draft_probs, rtol=1e-9, atol=1e-12)


@pytest.mark.timeout(120)
def test_chains_drafted_together_equal_each_drafters_own(pair: TinyPair) -> None:
    """Greedy, sampled (own generators), drafter-invariant; a long prompt (its own catch-up forward), a 1-token one
    (nothing to draft yet), a budget of 0; then a verdict each and a second round (short catch-ups)."""
    root = EagleDrafter.for_target(trained_head(pair), pair.target)
    generator = torch.Generator().manual_seed(0)
    prompts = [torch.randint(3, 60, (n,), generator=generator).tolist() for n in (6, 40, 9, 1, 3)]
    alone, together = started(pair, root, prompts), started(pair, root, prompts)
    assert all(isinstance(d, BatchedDrafter) and d.batcher is root.batcher for d in together)
    batcher = root.batcher
    assert isinstance(batcher, EagleChains)
    budgets = [4, 3, 5, 4, 0]
    for round_ in range(3):
        want = [drafter.propose(budget) for drafter, budget in zip(alone, budgets, strict=True)]
        got = batcher.propose_chains(together, budgets)
        same(want, got)
        if round_ == 0:  # the 40-token prompt caught up in a forward of its own
            assert batcher.catch_up_seconds[1] > 0 and batcher.catch_up_seconds[0] == 0
        for a, b, draft in zip(alone, together, want, strict=True):
            accepted = len(draft.tokens) // 2
            bonus = 7 + round_
            commit(pair, a, draft, accepted, bonus)
            commit(pair, b, draft, accepted, bonus)
    for a, b in zip(alone, together, strict=True):  # the heads' caches hold the same committed positions
        assert a.head_cache is not None and b.head_cache is not None
        assert a.head_cache.length == b.head_cache.length
        for (ka, va), (kb, vb) in zip(a.head_cache.snapshot(), b.head_cache.snapshot(), strict=True):
            torch.testing.assert_close(ka, kb, rtol=1e-9, atol=1e-12)
            torch.testing.assert_close(va, vb, rtol=1e-9, atol=1e-12)


def test_one_head_forward_per_drafted_position(pair: TinyPair, monkeypatch: pytest.MonkeyPatch) -> None:
    root = EagleDrafter.for_target(trained_head(pair), pair.target)
    prompts = [[5, 9, 11, 3, 4], [7, 8, 9], [20, 21, 22, 23, 24, 25]]
    drafters = started(pair, root, prompts)
    widths: list[list[int]] = []
    run_rows = HeadSlots.run_rows

    def counted(self: HeadSlots, caches: object, tokens: Sequence[torch.Tensor], features: object) -> object:
        widths.append([len(t) for t in tokens])
        return run_rows(self, caches, tokens, features)  # type: ignore[arg-type]

    monkeypatch.setattr(HeadSlots, "run_rows", counted)
    root.batcher.propose_chains(drafters, [3, 2, 3])
    assert widths == [[4, 2, 5], [1, 1, 1], [1, 1]]  # the catch-ups, then one token per row still drafting
    assert max(4, 2, 5) <= SHORT_CATCH_UP


def test_requests_sharing_a_generator_draft_one_after_another(pair: TinyPair) -> None:
    root = EagleDrafter.for_target(trained_head(pair), pair.target)
    prompts = [[5, 9, 11, 3, 4], [7, 8, 9, 10]]
    shared = torch.Generator().manual_seed(5)
    params = SamplingParams(temperature=1.0, seed=5)
    drafters, alone = [], []
    for prompt in prompts:
        for into, generator in ((drafters, shared), (alone, None)):
            drafter = root.fresh()
            drafter.start(prompt, params, generator or shared)
            drafter.add_features(0, features_of(pair, drafter, prompt)[: len(prompt) - 1])
            into.append(drafter)
    got = root.batcher.propose_chains(drafters, [3, 3])
    shared.manual_seed(5)
    same([drafter.propose(3) for drafter in alone], got)


def test_bad_input_is_refused(pair: TinyPair) -> None:
    root = EagleDrafter.for_target(trained_head(pair), pair.target)
    other = EagleDrafter.for_target(trained_head(pair), pair.target)
    [mine] = started(pair, root, [[5, 6, 7]])
    with pytest.raises(ValueError, match="not an EAGLE drafter of this batcher"):
        root.batcher.propose_chains([other.fresh()], [2])
    with pytest.raises(ValueError, match="more than once"):
        root.batcher.propose_chains([mine, mine], [2, 2])
    mine.release()
    with pytest.raises(RuntimeError, match="start"):
        root.batcher.propose_chains([mine], [2])
