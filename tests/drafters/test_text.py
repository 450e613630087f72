"""Drafting through text (``text:DIR``): a draft model with another tokenizer, exact like any point-mass drafter.

The draft here is the tiny pair's draft model moved to the *reversed* char tokenizer (every character at another
id, its embedding and head rows permuted to match), so it predicts the same text through different ids: its
proposals must equal the same-vocabulary draft's, greedy output must equal transformers', and sampled output the
target's two-token law.
"""

from __future__ import annotations

import copy
from pathlib import Path

import pytest
import torch
from conftest import CHARS, EOS_ID, VOCAB, TinyPair, char_tokenizer
from stats_helpers import batched_runs, check_single_engine_agrees, two_token_fit

from specserve.core.batch_engine import BatchedEngine
from specserve.core.engine import SpeculativeEngine
from specserve.core.model.causal_lm import CausalLM
from specserve.core.request import GenerationConfig
from specserve.core.sampling.params import SamplingParams
from specserve.core.sampling.warps import make_generators
from specserve.drafters import DraftModelDrafter, build_drafter
from specserve.drafters.text import TextDrafter
from specserve.drafters.vocabulary import VocabularyMismatch

ALPHA = 1e-3


def reversed_draft(pair: TinyPair) -> CausalLM:
    """The pair's draft model over the reversed char tokenizer: row j holds what row perm[j] held."""
    specials = VOCAB - len(CHARS)
    perm = [*range(specials), *(specials + len(CHARS) - 1 - k for k in range(len(CHARS)))]
    model = copy.deepcopy(pair.draft.model)
    index = torch.tensor(perm)
    embeddings = model.get_input_embeddings().weight
    head = model.get_output_embeddings().weight
    with torch.no_grad():
        tied = head.data_ptr() == embeddings.data_ptr()
        embeddings.copy_(embeddings[index].clone())
        if not tied:
            head.copy_(head[index].clone())
    return CausalLM(model, char_tokenizer(reverse=True), path=f"<{pair.family}-draft-reversed>")


@pytest.fixture(scope="module")
def drafts(tiny_pairs: dict[str, TinyPair]) -> dict[str, CausalLM]:
    return {family: reversed_draft(pair) for family, pair in tiny_pairs.items()}


def test_proposals_equal_the_same_vocabulary_drafts(pair: TinyPair, drafts: dict[str, CausalLM]) -> None:
    through_text = TextDrafter(drafts[pair.family], pair.target)
    direct = DraftModelDrafter(pair.draft, pair.target)
    for prompt in pair.prompts[:4]:
        for drafter in (through_text, direct):
            drafter.start(list(prompt), SamplingParams(), make_generators(0).draft)
        for step in range(3):
            ours, theirs = through_text.propose(4).tokens.tolist(), direct.propose(4).tokens.tolist()
            if EOS_ID in theirs:  # the text ends there: through text, nothing follows the end
                theirs = theirs[: theirs.index(EOS_ID) + 1]
            assert ours == theirs, (prompt, step)
            for drafter in (through_text, direct):
                drafter.accept(theirs[:2])  # as if two were accepted


@pytest.mark.parametrize("gamma", [1, 4])
def test_greedy_output_equals_transformers(
    pair: TinyPair, drafts: dict[str, CausalLM], hf_greedy: object, gamma: int
) -> None:
    engine = SpeculativeEngine(pair.target, TextDrafter(drafts[pair.family], pair.target))
    accepted = 0
    for prompt in pair.prompts:
        result = engine.generate(list(prompt), SamplingParams(), GenerationConfig(max_new_tokens=24, gamma=gamma))
        assert result.output_ids == hf_greedy(pair.target, prompt, 24)[: len(result.output_ids)], prompt  # type: ignore[operator]
        accepted += result.stats.accepted_tokens
    assert accepted > 0, "no draft through text was ever accepted: the test proves little"


def test_sampled_output_follows_the_target_law(tiny_pairs: dict[str, TinyPair], drafts: dict[str, CausalLM]) -> None:
    """Two tokens at T = 1 through a draft of another vocabulary: their joint law is the target's. 1,500 seeds as
    requests of one batched engine, whose first seeds the single-request engine emits alike."""
    pair = tiny_pairs["qwen2"]
    batched = BatchedEngine(pair.target, lambda name: TextDrafter(drafts["qwen2"], pair.target), max_num_seqs=32)
    base = SamplingParams(temperature=1.0, top_k=10)
    prompt = [40, 41, 40, 41, 40]
    config = GenerationConfig(max_new_tokens=2, gamma=3, ignore_eos=True)
    runs = batched_runs(batched, prompt, base, config, 1500)
    assert two_token_fit([run.output_ids for run in runs], pair.target, prompt, base) > ALPHA
    single = SpeculativeEngine(pair.target, TextDrafter(drafts["qwen2"], pair.target))
    check_single_engine_agrees(single, runs, prompt, base, config)


def test_text_dir_builds_it_and_a_plain_dir_says_to(
    pair: TinyPair, drafts: dict[str, CausalLM], tmp_path: Path
) -> None:
    draft = drafts[pair.family]
    draft.model.save_pretrained(tmp_path)
    draft.tokenizer.save_pretrained(tmp_path)
    assert isinstance(build_drafter(f"text:{tmp_path}", pair.target, dtype="float64"), TextDrafter)
    with pytest.raises(VocabularyMismatch, match=f"or draft through text: --draft text:{tmp_path}"):
        build_drafter(str(tmp_path), pair.target, dtype="float64")


def test_a_batched_engine_gives_each_request_its_own_text_drafter_over_one_model(
    tiny_pairs: dict[str, TinyPair], drafts: dict[str, CausalLM], tmp_path: Path
) -> None:
    """``text:DIR`` configured for a batched engine: the draft model is loaded once, each request drafts with its
    own fresh drafter over it, and greedy outputs equal transformers' (before, the spec was read as a draft model
    directory named ``text:DIR``, which does not exist)."""
    from conftest import hf_greedy_ids

    from specserve.drafters.registry import request_drafters

    pair = tiny_pairs["llama"]
    draft = drafts["llama"]
    draft.model.save_pretrained(tmp_path)
    draft.tokenizer.save_pretrained(tmp_path)
    new_drafter = request_drafters(f"text:{tmp_path}", pair.target, max_num_seqs=2, max_seq_len=64)
    first, second = new_drafter("default"), new_drafter("default")
    assert isinstance(first, TextDrafter) and isinstance(second, TextDrafter) and first is not second
    assert first.inner.model is second.inner.model
    engine = BatchedEngine(pair.target, new_drafter, max_num_seqs=2, max_seq_len=64)
    config = GenerationConfig(max_new_tokens=10, gamma=3)
    prompts = [list(pair.prompts[0]), list(pair.prompts[1])]
    results = [engine.generate(prompt, SamplingParams(), config) for prompt in prompts]
    for prompt, result in zip(prompts, results, strict=True):
        assert result.output_ids == hf_greedy_ids(pair.target.model, prompt, 10)
    assert sum(r.stats.accepted_tokens for r in results) > 0
