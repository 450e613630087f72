"""Penalties, logit bias, min-p and logprobs under speculation: exact against plain decoding with the same processors.

The references are independent of the code under test: transformers' own ``generate`` with its own processors
(``repetition_penalty``, ``sequence_bias``) and, for OpenAI's presence and frequency penalties, which transformers
lacks, a plain-Python processor written here from OpenAI's formula and passed to ``generate``. Sampled output is
checked by chi-square against the two-token law that the same plain-Python processors give over full forwards.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Sequence

import pytest
import torch
from conftest import EOS_ID, PAD_ID, VOCAB, TinyPair, finish_all
from hypothesis import given, settings
from hypothesis import strategies as st
from stats_helpers import batched_runs, check_single_engine_agrees, two_token_fit
from transformers import LogitsProcessor, LogitsProcessorList

from specserve.core.batch_engine import BatchedEngine
from specserve.core.engine import SpeculativeEngine
from specserve.core.errors import InvalidRequest
from specserve.core.request import GenerationConfig
from specserve.core.resume import Resume, continuation
from specserve.core.sampling.params import InvalidSamplingParams, SamplingParams
from specserve.core.sampling.warps import warp_probs
from specserve.core.tree.shapes import ROOT, TreeBudget, TreeSpec
from specserve.core.verify.processors import PenaltyState, path_counts
from specserve.drafters import build_drafter_set
from specserve.drafters.registry import request_drafters

# Each chi-square test fails a correct engine with probability ALPHA; with the two cases, at most 2e-3 per run.
ALPHA = 1e-3
DYNAMIC = TreeSpec("dynamic", budget=TreeBudget(depth=3, width=2, nodes=6))
DRAFTS = {  # request drafter, tree
    "draft-chain": ("default", None),
    "draft-tree": ("default", DYNAMIC),
    "ngram": ("ngram", None),
    "none": ("none", None),
}
REPETITION_AND_BIAS = SamplingParams(repetition_penalty=1.6, logit_bias={5: 4.0, 6: -100.0, 41: 2.5, 17: 1.0})
PRESENCE_AND_FREQUENCY = SamplingParams(presence_penalty=1.2, frequency_penalty=0.8)
EVERYTHING = SamplingParams(
    repetition_penalty=1.3, presence_penalty=0.6, frequency_penalty=-0.4, logit_bias={5: 2.0, 9: -3.0}
)


def reference_process(
    ids: Sequence[int], prompt_length: int, logits: torch.Tensor, params: SamplingParams
) -> torch.Tensor:
    """The processors as written in the docs, one token at a time: bias, repetition (prompt and output), then
    frequency and presence (output only)."""
    out = logits.double().clone()
    for token, bias in params.logit_bias:
        out[token] += bias
    for token in set(ids):
        value = float(out[token])
        out[token] = value / params.repetition_penalty if value > 0 else value * params.repetition_penalty
    for token, count in Counter(ids[prompt_length:]).items():
        out[token] -= params.frequency_penalty * count + params.presence_penalty
    return out


class OpenAIPenalties(LogitsProcessor):
    """Presence and frequency penalties over the generated tokens, for transformers' ``generate``."""

    def __init__(self, prompt_length: int, presence: float, frequency: float) -> None:
        self.prompt_length, self.presence, self.frequency = prompt_length, presence, frequency

    def __call__(self, input_ids: torch.LongTensor, scores: torch.FloatTensor) -> torch.FloatTensor:
        scores = scores.clone()
        for token, count in Counter(input_ids[0, self.prompt_length :].tolist()).items():
            scores[0, token] -= self.frequency * count + self.presence
        return scores


def hf_processed_greedy(pair: TinyPair, prompt: Sequence[int], params: SamplingParams, new: int) -> list[int]:
    """transformers' greedy decoding with its own repetition penalty and sequence bias, and OpenAIPenalties."""
    extra = {}
    if params.repetition_penalty != 1.0:
        extra["repetition_penalty"] = params.repetition_penalty
    if params.logit_bias:
        extra["sequence_bias"] = {(token,): bias for token, bias in params.logit_bias}
    processors = LogitsProcessorList()
    if params.presence_penalty or params.frequency_penalty:
        processors.append(OpenAIPenalties(len(prompt), params.presence_penalty, params.frequency_penalty))
    out = pair.target.model.generate(
        torch.tensor([list(prompt)]),
        do_sample=False,
        max_new_tokens=new,
        eos_token_id=EOS_ID,
        pad_token_id=PAD_ID,
        logits_processor=processors,
        **extra,
    )
    return out[0, len(prompt) :].tolist()


@pytest.fixture(scope="module")
def engines(tiny_pairs: dict[str, TinyPair]) -> dict[str, SpeculativeEngine]:
    return {
        family: SpeculativeEngine(p.target, build_drafter_set(p.draft, p.target)) for family, p in tiny_pairs.items()
    }


@pytest.mark.parametrize("penalties", ["repetition_and_bias", "presence_and_frequency"])
@pytest.mark.parametrize("draft", DRAFTS)
def test_greedy_output_equals_transformers_with_the_same_processors(
    pair: TinyPair, engines: dict[str, SpeculativeEngine], draft: str, penalties: str
) -> None:
    params = REPETITION_AND_BIAS if penalties == "repetition_and_bias" else PRESENCE_AND_FREQUENCY
    drafter, tree = DRAFTS[draft]
    config = GenerationConfig(max_new_tokens=24, gamma=4, drafter=drafter, tree=tree)
    changed = 0
    for prompt in pair.prompts[:3]:
        expected = hf_processed_greedy(pair, prompt, params, 24)
        changed += expected != hf_processed_greedy(pair, prompt, SamplingParams(), 24)
        result = engines[pair.family].generate(list(prompt), params, config)
        assert result.output_ids == expected, f"{draft}, prompt {prompt}"
    assert changed, "the processors must change some output, or the test proves nothing"


def test_a_batch_mixes_processed_and_plain_requests(pair: TinyPair) -> None:
    """Each request of one batch is decoded with its own processors; none changes another's output."""
    drafters = request_drafters(pair.draft, pair.target, max_num_seqs=4, max_seq_len=128)
    engine = BatchedEngine(pair.target, drafters, max_num_seqs=4, max_seq_len=96)
    config = GenerationConfig(max_new_tokens=20, gamma=3)
    cases = [
        (pair.prompts[0], REPETITION_AND_BIAS),
        (pair.prompts[0], SamplingParams()),
        (pair.prompts[1], PRESENCE_AND_FREQUENCY),
        (pair.prompts[2], EVERYTHING),
    ]
    ids = [engine.submit(list(prompt), params, config) for prompt, params in cases]
    results = finish_all(engine)
    for request_id, (prompt, params) in zip(ids, cases, strict=True):
        assert results[request_id].output_ids == hf_processed_greedy(pair, prompt, params, 20)


@pytest.mark.parametrize("tree", [None, DYNAMIC], ids=["chain", "tree"])
def test_sampled_output_follows_the_processed_target_law(
    tiny_pairs: dict[str, TinyPair], tree: TreeSpec | None
) -> None:
    """Chi-square on the first two tokens (the second is penalised by the first), with every processor and min-p:
    1,500 seeds as requests of one batched engine, whose first seeds the single-request engine emits alike."""
    pair = tiny_pairs["llama"]
    batched = BatchedEngine(pair.target, request_drafters(pair.draft, pair.target, max_num_seqs=32), max_num_seqs=32)
    prompt = [5, 6, 7, 5, 6]
    base = SamplingParams(
        temperature=1.0,
        top_k=12,
        min_p=0.05,
        repetition_penalty=1.4,
        presence_penalty=1.0,
        frequency_penalty=0.5,
        logit_bias={7: 1.5, 8: 1.0},
    )
    config = GenerationConfig(max_new_tokens=2, gamma=2, tree=tree, ignore_eos=True)

    def process(ids: list[int], logits: torch.Tensor) -> torch.Tensor:
        return reference_process(ids, len(prompt), logits, base)

    runs = batched_runs(batched, prompt, base, config, 1500)
    assert two_token_fit([run.output_ids for run in runs], pair.target, prompt, base, process) > ALPHA
    single = SpeculativeEngine(pair.target, build_drafter_set(pair.draft, pair.target))
    check_single_engine_agrees(single, runs, prompt, base, config)


def test_min_p_drops_what_transformers_drops() -> None:
    """min-p after top-p, as transformers' MinPLogitsWarper: the same tokens survive and the law renormalises."""
    from transformers import MinPLogitsWarper

    logits = torch.randn(4, 50, generator=torch.Generator().manual_seed(0), dtype=torch.float64) * 3
    params = SamplingParams(temperature=0.7, min_p=0.1)
    ours = warp_probs(logits, params)
    theirs = MinPLogitsWarper(0.1)(torch.zeros(4, 1, dtype=torch.long), logits / 0.7).softmax(-1)
    torch.testing.assert_close(ours, theirs)


@settings(max_examples=60, deadline=None)
@given(st.data())
def test_every_row_is_processed_with_its_own_path(data: st.DataObject) -> None:
    """PenaltyState.apply on a random tree equals the reference processor run on committed text + each root path."""
    vocab = 12
    prompt = data.draw(st.lists(st.integers(0, vocab - 1), min_size=1, max_size=6))
    output = data.draw(st.lists(st.integers(0, vocab - 1), max_size=6))
    n = data.draw(st.integers(0, 7))
    parents = [data.draw(st.integers(ROOT, i - 1)) for i in range(n)]
    tokens = data.draw(st.lists(st.integers(0, vocab - 1), min_size=n, max_size=n))
    params = SamplingParams(
        repetition_penalty=data.draw(st.sampled_from([1.0, 0.7, 1.8])),
        presence_penalty=data.draw(st.sampled_from([0.0, 1.5, -0.5])),
        frequency_penalty=data.draw(st.sampled_from([0.0, 0.3, -2.0])),
        logit_bias={data.draw(st.integers(0, vocab - 1)): data.draw(st.floats(-100, 100))},
    )
    state = PenaltyState(params, prompt, vocab)
    state.commit(output)
    logits = torch.randn(n + 1, vocab, generator=torch.Generator().manual_seed(n), dtype=torch.float64)
    got = state.apply(logits, torch.tensor(tokens, dtype=torch.long), parents)
    for row in range(n + 1):
        path: list[int] = []
        node = row - 1
        while node != ROOT:
            path.insert(0, tokens[node])
            node = parents[node]
        expected = reference_process([*prompt, *output, *path], len(prompt), logits[row], params)
        torch.testing.assert_close(got[row], expected, msg=f"row {row}, path {path}")
    counts = path_counts(torch.tensor(tokens, dtype=torch.long), parents, vocab, torch.float64)
    assert counts.sum().item() == sum(len(tree_path(parents, i)) for i in range(n))


def tree_path(parents: Sequence[int], node: int) -> list[int]:
    path = []
    while node != ROOT:
        path.append(node)
        node = parents[node]
    return path


# ---------------------------------------------------------------------------------------------
# Logprobs


def full_forward_log_probs(pair: TinyPair, prompt: Sequence[int], output: Sequence[int]) -> torch.Tensor:
    """[len(output), vocab]: log_softmax of a plain full forward over prompt + output (no cache, no speculation)."""
    ids = torch.tensor([[*prompt, *output]])
    with torch.inference_mode():
        logits = pair.target.model(input_ids=ids, use_cache=False).logits[0].double()
    return torch.log_softmax(logits[len(prompt) - 1 : len(prompt) - 1 + len(output)], dim=-1)


@pytest.mark.parametrize("draft", DRAFTS)
@pytest.mark.parametrize("temperature", [0.0, 0.8])
def test_raw_logprobs_equal_a_plain_forward(
    pair: TinyPair, engines: dict[str, SpeculativeEngine], draft: str, temperature: float
) -> None:
    drafter, tree = DRAFTS[draft]
    params = SamplingParams(temperature=temperature, top_k=20, seed=3, logprobs=5)
    config = GenerationConfig(max_new_tokens=20, gamma=3, drafter=drafter, tree=tree)
    for prompt in pair.prompts[:2]:
        result = engines[pair.family].generate(list(prompt), params, config)
        assert result.logprobs is not None and len(result.logprobs) == len(result.output_ids)
        reference = full_forward_log_probs(pair, prompt, result.output_ids)
        for i, (token, entry) in enumerate(zip(result.output_ids, result.logprobs, strict=True)):
            assert entry.token == token
            assert entry.logprob == pytest.approx(float(reference[i, token]), abs=1e-6)
            top_values, top_ids = reference[i].topk(5)
            assert [t for t, _ in entry.top] == top_ids.tolist()
            assert [v for _, v in entry.top] == pytest.approx(top_values.tolist(), abs=1e-6)


@pytest.mark.parametrize("temperature", [0.0, 0.8])
def test_processed_logprobs_are_the_law_each_token_was_chosen_from(
    pair: TinyPair, engines: dict[str, SpeculativeEngine], temperature: float
) -> None:
    params = SamplingParams(
        temperature=temperature, top_k=8, seed=5, logprobs=3, logprobs_mode="processed", **_penalties(EVERYTHING)
    )
    config = GenerationConfig(max_new_tokens=16, gamma=3, tree=DYNAMIC)
    prompt = list(pair.prompts[0])
    result = engines[pair.family].generate(prompt, params, config)
    assert result.logprobs is not None
    with torch.inference_mode():
        logits = pair.target.model(input_ids=torch.tensor([[*prompt, *result.output_ids]])).logits[0].double()
    for i, (token, entry) in enumerate(zip(result.output_ids, result.logprobs, strict=True)):
        history = [*prompt, *result.output_ids[:i]]
        processed = reference_process(history, len(prompt), logits[len(prompt) - 1 + i], params)
        law = processed.log_softmax(-1) if temperature == 0.0 else warp_probs(processed, params).log()
        assert entry.logprob == pytest.approx(float(law[token]), abs=1e-6)
        assert entry.logprob > float("-inf")
        finite = [v for v in law.topk(3).values.tolist() if v > float("-inf")]
        assert [v for _, v in entry.top] == pytest.approx(finite, abs=1e-6)


def test_no_logprobs_unless_asked(pair: TinyPair, engines: dict[str, SpeculativeEngine]) -> None:
    result = engines[pair.family].generate(list(pair.prompts[0]), SamplingParams(), GenerationConfig(8, 2))
    assert result.logprobs is None
    chunks = list(engines[pair.family].stream(list(pair.prompts[0]), SamplingParams(logprobs=0), GenerationConfig(8)))
    assert all(len(chunk.logprobs) == len(chunk.token_ids) for chunk in chunks)
    assert all(entry.top == () for chunk in chunks for entry in chunk.logprobs)


def _penalties(params: SamplingParams) -> dict[str, object]:
    names = ("repetition_penalty", "presence_penalty", "frequency_penalty", "logit_bias")
    return {name: getattr(params, name) for name in names}


# ---------------------------------------------------------------------------------------------
# Resumption, bad values


def test_a_resumed_request_counts_its_earlier_output_as_output(
    pair: TinyPair, engines: dict[str, SpeculativeEngine]
) -> None:
    """Greedy with presence and frequency penalties: the continuation after 7 tokens equals the undisturbed rest."""
    engine = engines[pair.family]
    prompt = list(pair.prompts[0])
    config = GenerationConfig(max_new_tokens=20, gamma=3, ignore_eos=True)
    whole = engine.generate(prompt, PRESENCE_AND_FREQUENCY, config).output_ids
    ids, params, rest = continuation(prompt, PRESENCE_AND_FREQUENCY, config, Resume.of(whole[:7], ""))
    assert params.prior_output_tokens == 7
    assert engine.generate(ids, params, rest).output_ids == whole[7:]


@pytest.mark.parametrize(
    ("fields", "words"),
    [
        ({"presence_penalty": 2.5}, "presence_penalty must be in [-2, 2]"),
        ({"frequency_penalty": -3.0}, "frequency_penalty must be in [-2, 2]"),
        ({"repetition_penalty": 0.0}, "repetition_penalty must be in (0, 10]"),
        ({"min_p": 1.5}, "min_p must be in [0, 1]"),
        ({"logit_bias": {3: 101.0}}, "logit_bias values must be in [-100, 100]"),
        ({"logit_bias": {-1: 1.0}}, "logit_bias keys must be token ids >= 0"),
        ({"logprobs": 21}, "logprobs must be between 0"),
        ({"logprobs_mode": "logits"}, "logprobs_mode must be 'raw' or 'processed'"),
    ],
)
def test_bad_values_are_refused_with_what_is_allowed(fields: dict[str, object], words: str) -> None:
    with pytest.raises(InvalidSamplingParams, match=words.replace("[", r"\[").replace("(", r"\(")):
        SamplingParams(**fields)  # type: ignore[arg-type]


def test_a_bias_outside_the_vocabulary_is_refused(pair: TinyPair, engines: dict[str, SpeculativeEngine]) -> None:
    with pytest.raises(InvalidRequest, match=rf"outside the vocabulary \[0, {VOCAB}\): \[{VOCAB}\]"):
        engines[pair.family].generate([5, 6], SamplingParams(logit_bias={VOCAB: 1.0}), GenerationConfig(4))
