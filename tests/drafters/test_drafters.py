"""Tests of the drafters: n-gram lookup, the draft-model drafter's rollback, vocabulary checks, the registry."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from conftest import VOCAB, TinyPair, build_draft, build_model, char_tokenizer

from specserve.core.draft.drafter import Draft, Drafter
from specserve.core.model.causal_lm import CausalLM
from specserve.core.model.checkpoint_dir import ModelLoadError
from specserve.core.sampling.params import SamplingParams
from specserve.core.sampling.warps import make_generators, warp_probs
from specserve.drafters import DraftModelDrafter, NgramDrafter, NoDrafter, VocabularyMismatch, build_drafter
from specserve.drafters.ngram import lookup

GREEDY = SamplingParams()

# ---------------------------------------------------------------------------------------------
# n-gram lookup


def test_lookup_copies_what_followed_the_match() -> None:
    assert lookup([1, 2, 3, 4, 1, 2], budget=2, max_ngram=3, min_ngram=1) == [3, 4]
    assert lookup([1, 2, 3, 4, 1, 2], budget=10, max_ngram=3, min_ngram=1) == [3, 4, 1, 2]


def test_lookup_prefers_the_longest_ngram() -> None:
    # suffix (7, 8, 9): its 3-gram occurs at the start (followed by 1); the 1-gram "9" occurs
    # more recently (followed by 5), but the longer match wins.
    history = [7, 8, 9, 1, 0, 9, 5, 7, 8, 9]
    assert lookup(history, budget=1, max_ngram=3, min_ngram=1) == [1]
    assert lookup(history, budget=1, max_ngram=1, min_ngram=1) == [5]
    # 2-gram (8, 9) occurs only at the start too
    assert lookup(history, budget=2, max_ngram=2, min_ngram=2) == [1, 0]


def test_lookup_takes_the_most_recent_match() -> None:
    history = [4, 5, 1, 4, 5, 2, 4, 5, 3, 4, 5]
    assert lookup(history, budget=1, max_ngram=2, min_ngram=1) == [3]
    assert lookup(history, budget=4, max_ngram=2, min_ngram=1) == [3, 4, 5]  # runs up to the end


def test_lookup_no_match_is_empty() -> None:
    assert lookup([1, 2, 3, 4, 5], budget=4, max_ngram=3, min_ngram=1) == []
    assert lookup([1, 2, 3, 1, 9], budget=4, max_ngram=3, min_ngram=2) == []  # only a 1-gram would match
    assert lookup([], budget=4, max_ngram=3, min_ngram=1) == []
    assert lookup([3], budget=4, max_ngram=3, min_ngram=1) == []


def test_lookup_respects_the_budget() -> None:
    history = [1, 2, 3, 4, 5, 6, 7, 8, 1]
    for budget in range(0, 10):
        got = lookup(history, budget=budget, max_ngram=3, min_ngram=1)
        assert got == [2, 3, 4, 5, 6, 7, 8, 1][:budget]
    assert lookup(history, budget=-1, max_ngram=3, min_ngram=1) == []


def test_lookup_overlapping_match() -> None:
    # a run of one token: the latest earlier occurrence of (7, 7) starts one position back
    assert lookup([7, 7, 7, 7], budget=3, max_ngram=2, min_ngram=1) == [7]
    assert lookup([7, 7, 7, 7], budget=3, max_ngram=1, min_ngram=1) == [7]


def test_ngram_drafter_tracks_history() -> None:
    drafter = NgramDrafter(max_ngram=2, min_ngram=1)
    assert isinstance(drafter, Drafter)
    generator = make_generators(0).draft
    drafter.start([10, 11, 12, 13], GREEDY, generator)
    draft = drafter.propose(3)
    assert draft.tokens.tolist() == [] and draft.draft_probs is None and draft.tokens.dtype == torch.long
    drafter.accept([10, 11])
    assert drafter.propose(3).tokens.tolist() == [12, 13, 10]
    drafter.accept([12, 99])
    assert drafter.propose(3).tokens.tolist() == []
    drafter.start([1, 2, 1], GREEDY, generator)  # start resets the history
    assert drafter.propose(5).tokens.tolist() == [2, 1]


def test_ngram_drafter_rejects_bad_sizes() -> None:
    with pytest.raises(ValueError, match="1 <= min_ngram <= max_ngram"):
        NgramDrafter(max_ngram=2, min_ngram=3)
    with pytest.raises(ValueError, match="1 <= min_ngram <= max_ngram"):
        NgramDrafter(max_ngram=2, min_ngram=0)


def test_no_drafter_proposes_nothing() -> None:
    drafter = NoDrafter()
    assert isinstance(drafter, Drafter)
    drafter.start([1, 2, 3], GREEDY, make_generators(0).draft)
    draft = drafter.propose(8)
    assert draft.gamma == 0 and draft.draft_probs is None
    drafter.accept([4])
    assert drafter.propose(8).gamma == 0


# ---------------------------------------------------------------------------------------------
# Draft model drafter


def fresh_proposal(pair: TinyPair, context: list[int], budget: int, params: SamplingParams = GREEDY) -> Draft:
    drafter = DraftModelDrafter(pair.draft, pair.target)
    drafter.start(context, params, make_generators(0).draft)
    return drafter.propose(budget)


def test_draft_model_greedy_proposal_is_the_draft_argmax_chain(pair: TinyPair) -> None:
    prompt = [5, 6, 7, 8]
    draft = fresh_proposal(pair, prompt, 5)
    assert draft.gamma == 5 and draft.draft_probs is None
    ids = list(prompt)
    for token in draft.tokens.tolist():
        logits = pair.draft.model(input_ids=torch.tensor([ids])).logits[0, -1]
        assert token == int(logits.argmax())
        ids.append(token)


@pytest.mark.parametrize("accepted", [0, 1, 3, 5])
def test_draft_model_rollback_after_partial_rejection(pair: TinyPair, accepted: int) -> None:
    """After accept(), the next proposal equals a fresh drafter's on the committed text."""
    prompt = [5, 6, 7, 8, 9, 10]
    drafter = DraftModelDrafter(pair.draft, pair.target)
    drafter.start(prompt, GREEDY, make_generators(0).draft)
    committed = list(prompt)
    for cycle in range(4):
        proposal = drafter.propose(5).tokens.tolist()
        assert proposal == fresh_proposal(pair, committed, 5).tokens.tolist()
        if accepted < 5:
            wrong = (proposal[accepted] + 1 + cycle) % VOCAB  # a recovered token that differs from the draft
            assert wrong != proposal[accepted]
            new = [*proposal[:accepted], wrong]
        else:
            new = [*proposal, (proposal[-1] + 7) % VOCAB]  # all accepted + a bonus token
        drafter.accept(new)
        committed += new
    after = drafter.propose(4)
    assert after.tokens.tolist() == fresh_proposal(pair, committed, 4).tokens.tolist()
    # the drafter's own cache holds exactly the committed text plus the draft tokens it fed
    assert drafter._cache is not None
    assert drafter._cache.length == len(committed) + 3


def test_draft_model_sampled_proposal_after_rollback(pair: TinyPair) -> None:
    """At temperature 1 the q sent is the warped distribution of the rolled-back context, exactly."""
    params = SamplingParams(temperature=1.0, top_k=20, seed=3)
    prompt = [5, 6, 7, 8, 9, 10]
    drafter = DraftModelDrafter(pair.draft, pair.target)
    generator = make_generators(3).draft
    drafter.start(prompt, params, generator)
    first = drafter.propose(4)
    assert first.draft_probs is not None and first.draft_probs.shape == (4, VOCAB)
    committed = [*prompt, first.tokens[0].item(), (first.tokens[1].item() + 1) % VOCAB]
    drafter.accept(committed[len(prompt) :])

    twin_generator = torch.Generator().set_state(generator.get_state())
    second = drafter.propose(3)
    twin = DraftModelDrafter(pair.draft, pair.target)
    twin.start(committed, params, twin_generator)
    expected = twin.propose(3)
    assert second.tokens.tolist() == expected.tokens.tolist()
    assert expected.draft_probs is not None and second.draft_probs is not None
    assert torch.allclose(second.draft_probs, expected.draft_probs, rtol=0, atol=1e-12)
    # and each q row is the warped draft distribution given the context so far
    ids = list(committed)
    for i, token in enumerate(second.tokens.tolist()):
        logits = pair.draft.model(input_ids=torch.tensor([ids])).logits[0, -1]
        assert torch.allclose(second.draft_probs[i], warp_probs(logits, params), rtol=0, atol=1e-10)
        assert second.draft_probs[i, token] > 0
        ids.append(token)


def test_draft_model_budget_capped_by_context(pair: TinyPair) -> None:
    limit = pair.draft.info.max_positions
    drafter = DraftModelDrafter(pair.draft, pair.target)
    drafter.start([5] * (limit - 2), GREEDY, make_generators(0).draft)
    assert drafter.propose(8).gamma == 2
    drafter.accept([6, 7])
    assert drafter.propose(8).gamma == 0


# ---------------------------------------------------------------------------------------------
# Vocabulary checks


def test_vocabulary_size_mismatch(pair: TinyPair) -> None:
    small = CausalLM(build_model(pair.family, num_layers=1, seed=5, vocab=80), tokenizer=None, path="<small>")
    with pytest.raises(VocabularyMismatch, match=r"vocabulary of 80 tokens but the target .* has 96"):
        DraftModelDrafter(small, pair.target)
    with pytest.raises(VocabularyMismatch):
        build_drafter(small, pair.target)


def test_tokenizer_mismatch_with_equal_sizes(pair: TinyPair) -> None:
    other = CausalLM(pair.draft.model, tokenizer=char_tokenizer(reverse=True), path="<reversed>")
    assert len(other.tokenizer) == len(pair.target.tokenizer)  # type: ignore[arg-type]
    with pytest.raises(VocabularyMismatch, match="different tokenizers"):
        DraftModelDrafter(other, pair.target)
    # an equal (but distinct) tokenizer object is fine, and so is a model without a tokenizer
    DraftModelDrafter(CausalLM(pair.draft.model, tokenizer=char_tokenizer()), pair.target)
    DraftModelDrafter(CausalLM(pair.draft.model, tokenizer=None), pair.target)


# ---------------------------------------------------------------------------------------------
# Registry


def test_build_drafter_by_name(pair: TinyPair) -> None:
    assert isinstance(build_drafter("none", pair.target), NoDrafter)
    ngram = build_drafter("ngram", pair.target, max_ngram=4, min_ngram=2)
    assert isinstance(ngram, NgramDrafter) and (ngram.max_ngram, ngram.min_ngram) == (4, 2)
    loaded = build_drafter(pair.draft, pair.target)
    assert isinstance(loaded, DraftModelDrafter) and loaded.model is pair.draft
    for drafter in (build_drafter("none", pair.target), ngram, loaded):
        assert isinstance(drafter, Drafter)


def test_build_drafter_from_a_directory(saved_pair_dirs: dict[str, Path], tiny_pairs: dict[str, TinyPair]) -> None:
    pair = tiny_pairs["llama"]
    drafter = build_drafter(str(saved_pair_dirs["draft"]), pair.target, dtype="float64")
    assert isinstance(drafter, DraftModelDrafter)
    assert drafter.model.info.path == str(saved_pair_dirs["draft"])
    assert drafter.model.dtype == torch.float64
    prompt = [5, 6, 7, 8]
    drafter.start(prompt, GREEDY, make_generators(0).draft)
    assert drafter.propose(4).tokens.tolist() == fresh_proposal(pair, prompt, 4).tokens.tolist()


def test_build_drafter_unknown_name_is_a_load_error(tiny_pairs: dict[str, TinyPair], tmp_path: Path) -> None:
    with pytest.raises(ModelLoadError, match="does not exist"):
        build_drafter(str(tmp_path / "ngramm"), tiny_pairs["llama"].target)


def test_build_drafter_directory_with_other_vocabulary(
    tmp_path: Path, tiny_pairs: dict[str, TinyPair], saved_pair_dirs: dict[str, Path]
) -> None:
    target = tiny_pairs["llama"].target
    directory = tmp_path / "reversed-draft"
    build_draft(target.model, "llama").save_pretrained(directory)
    char_tokenizer(reverse=True).save_pretrained(directory)
    with pytest.raises(VocabularyMismatch, match="different tokenizers"):
        build_drafter(str(directory), target, dtype="float64")
