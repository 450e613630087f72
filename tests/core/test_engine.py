"""End-to-end tests of the single-process speculative engine on random-initialised tiny models.

* Greedy exactness: the engine's ids equal transformers' ``generate(do_sample=False)`` token for
  token, in float64, for every drafter (none, n-gram, a 1-layer draft model, and the target used
  as its own drafter, which is accepted every time), gamma in {1, 3, 8}, both architectures.
* After every request (and after every streamed cycle) the target's KV cache holds exactly the
  committed text minus its last token: the engine creates its cache through
  ``target.new_cache()``, so the tests hand it a :class:`RecordingLM` — a ``CausalLM`` subclass
  that remembers the caches it made — and compare that cache, layer by layer, with a fresh
  prefill of the same tokens.
* A request may name its drafter (``GenerationConfig.drafter``: the configured one, ``ngram`` or
  ``none``): the greedy output is the same whichever runs, the built-ins are built once and kept.
* Seeded determinism, streaming text, stop strings, input validation, and one chi-square test that
  tokens sampled through the whole engine (draft model + rejection sampling + bonus) follow the
  target's warped distribution.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Callable, Sequence

import pytest
import scipy.stats
import torch
from conftest import EOS_ID, MAX_POSITIONS, REF_TOKENS, TinyPair, no_cache_greedy_ids
from stats_helpers import draws_over_seeds

from specserve.core.draft.drafter import REQUEST_DRAFTERS, Draft, Drafter, DrafterSet
from specserve.core.draft.schedule import MAX_GAMMA
from specserve.core.engine import SpeculativeEngine
from specserve.core.errors import InvalidRequest
from specserve.core.kv.cache import KVCache
from specserve.core.model.causal_lm import CausalLM
from specserve.core.request import GenerationConfig, GenerationResult
from specserve.core.sampling.params import SamplingParams
from specserve.core.sampling.warps import warp_probs
from specserve.drafters import DraftModelDrafter, NgramDrafter, NoDrafter, build_drafter_set

HfGreedy = Callable[[CausalLM, Sequence[int], int], list[int]]
DRAFTERS = ("none", "ngram", "model", "self")


class RecordingLM(CausalLM):
    """The same model, but every cache the engine creates is kept for inspection."""

    def __init__(self, inner: CausalLM) -> None:
        super().__init__(inner.model, inner.tokenizer, path=inner.info.path)
        self.caches: list[KVCache] = []

    def new_cache(self) -> KVCache:
        cache = super().new_cache()
        self.caches.append(cache)
        return cache


def make_drafter(kind: str, pair: TinyPair) -> Drafter:
    if kind == "none":
        return NoDrafter()
    if kind == "ngram":
        return NgramDrafter()
    if kind == "model":
        return DraftModelDrafter(pair.draft, pair.target)
    if kind == "self":  # the target drafting for itself: a perfect drafter, every greedy draft is accepted
        return DraftModelDrafter(pair.target, pair.target)
    raise ValueError(kind)


def assert_cache_holds(lm: CausalLM, cache: KVCache, ids: Sequence[int]) -> None:
    """``cache`` holds exactly the keys/values of a fresh prefill of ``ids``, on every layer."""
    assert cache.length == len(ids), f"cache holds {cache.length} positions, expected {len(ids)}"
    fresh = CausalLM.new_cache(lm)
    lm.forward(fresh, torch.tensor(list(ids), dtype=torch.long))
    assert len(cache.inner.layers) == len(fresh.inner.layers) == lm.model.config.num_hidden_layers
    for i, (got, want) in enumerate(zip(cache.inner.layers, fresh.inner.layers, strict=True)):
        assert got.keys.shape == want.keys.shape, f"layer {i} keys"
        assert torch.allclose(got.keys, want.keys, rtol=0, atol=1e-10), f"layer {i} keys differ"
        assert torch.allclose(got.values, want.values, rtol=0, atol=1e-10), f"layer {i} values differ"


def run(
    pair: TinyPair,
    drafter: Drafter,
    prompt: Sequence[int],
    max_new_tokens: int,
    gamma: int,
    params: SamplingParams | None = None,
    **config: object,
) -> tuple[GenerationResult, RecordingLM]:
    target = RecordingLM(pair.target)
    engine = SpeculativeEngine(target, drafter)
    result = engine.generate(
        list(prompt), params or SamplingParams(), GenerationConfig(max_new_tokens, gamma, **config)
    )
    assert len(target.caches) == 1
    return result, target


def check_committed_cache(target: RecordingLM, result: GenerationResult) -> None:
    check_committed_cache_of(target, target.caches[0], result)


def check_committed_cache_of(lm: CausalLM, cache: KVCache, result: GenerationResult) -> None:
    committed = result.prompt_ids + result.output_ids
    assert_cache_holds(lm, cache, committed[:-1])


# ---------------------------------------------------------------------------------------------
# Greedy exactness


@pytest.mark.parametrize("gamma", [1, 3, 8])
@pytest.mark.parametrize("kind", DRAFTERS)
def test_greedy_matches_transformers_generate(pair: TinyPair, hf_greedy: HfGreedy, kind: str, gamma: int) -> None:
    accepted_on_repetitive = 0
    for index, prompt in enumerate(pair.prompts):
        ref = hf_greedy(pair.target, prompt, REF_TOKENS)
        result, target = run(pair, make_drafter(kind, pair), prompt, REF_TOKENS, gamma)
        assert result.output_ids == ref, f"{pair.family} {kind} gamma={gamma} prompt={prompt}"
        assert result.prompt_ids == list(prompt)
        if ref[-1] == EOS_ID and len(ref) < REF_TOKENS:
            assert result.finish_reason == "eos"
        else:
            assert result.finish_reason == "length"
            assert len(result.output_ids) == REF_TOKENS
        check_committed_cache(target, result)
        stats = result.stats
        assert stats.new_tokens == len(result.output_ids)
        assert stats.drafted_tokens <= gamma * stats.cycles
        if kind == "none":
            assert stats.drafted_tokens == 0 and stats.cycles == len(ref)
        if kind == "self":
            assert stats.accepted_tokens == stats.drafted_tokens > 0, "the target drafting for itself must be accepted"
        if index < 3:  # the repetitive prompts come first
            accepted_on_repetitive += stats.accepted_tokens
    if kind in ("ngram", "model", "self"):
        assert accepted_on_repetitive > 0, f"{kind} never had a draft token accepted: the test would be vacuous"


def test_gamma_zero_is_plain_decoding(pair: TinyPair, hf_greedy: HfGreedy) -> None:
    prompt = pair.prompts[0]
    result, target = run(pair, make_drafter("self", pair), prompt, 12, gamma=0)
    assert result.output_ids == hf_greedy(pair.target, prompt, 12)
    assert result.stats.drafted_tokens == 0 and result.stats.cycles == len(result.output_ids)
    check_committed_cache(target, result)


def test_request_chooses_its_drafter(pair: TinyPair, hf_greedy: HfGreedy) -> None:
    """``ngram`` and ``none`` per request on an engine configured with the draft model: same greedy output."""
    drafters = build_drafter_set(pair.draft, pair.target)
    engine = SpeculativeEngine(pair.target, drafters)
    assert engine.drafter is drafters.get("default") and isinstance(engine.drafter, DraftModelDrafter)
    drafted = {"default": 0, "ngram": 0, "none": 0}
    for prompt in pair.prompts:
        ref = hf_greedy(pair.target, prompt, 20)
        for name in drafted:
            result = engine.generate(
                prompt, SamplingParams(), GenerationConfig(max_new_tokens=20, gamma=4, drafter=name)
            )
            assert result.output_ids == ref, (pair.family, name, prompt)
            drafted[name] += result.stats.drafted_tokens
    assert drafted["default"] > 0 and drafted["ngram"] > 0 and drafted["none"] == 0
    # built on first use, then the same object for every later request
    ngram, none = drafters.get("ngram"), drafters.get("none")
    assert isinstance(ngram, NgramDrafter) and isinstance(none, NoDrafter)
    engine.generate(pair.prompts[0], SamplingParams(), GenerationConfig(max_new_tokens=4, drafter="ngram"))
    assert drafters.get("ngram") is ngram and drafters.get("none") is none


def test_drafter_set_builds_lazily_once(pair: TinyPair) -> None:
    built: list[str] = []

    def build(name: str) -> Drafter:
        built.append(name)
        return NgramDrafter() if name == "ngram" else NoDrafter()

    drafters = DrafterSet(DraftModelDrafter(pair.draft, pair.target), build)
    assert built == []
    assert drafters.get("ngram") is drafters.get("ngram") and built == ["ngram"]
    assert drafters.get("none") is drafters.get("none") and built == ["ngram", "none"]
    # a configured built-in is the default and its own name: nothing is built for it
    configured = NgramDrafter()
    only_ngram = DrafterSet(configured, build)
    assert only_ngram.get("default") is only_ngram.get("ngram") is configured and built == ["ngram", "none"]


def test_unknown_or_unavailable_drafter_is_refused(pair: TinyPair) -> None:
    allowed = ", ".join(repr(name) for name in REQUEST_DRAFTERS)
    assert REQUEST_DRAFTERS == ("default", "ngram", "suffix", "lookahead", "none")
    with pytest.raises(InvalidRequest, match=rf"drafter must be one of {allowed}.*got 'eagle'"):
        GenerationConfig(drafter="eagle")
    drafters = build_drafter_set("ngram", pair.target)
    with pytest.raises(InvalidRequest, match=rf"drafter must be one of {allowed}"):
        drafters.get("model")
    # an engine given a bare drafter can serve only that one, and says so before generating
    engine = SpeculativeEngine(pair.target, DraftModelDrafter(pair.draft, pair.target))
    with pytest.raises(InvalidRequest, match="'ngram' is not available here"):
        engine.stream([5, 6], SamplingParams(), GenerationConfig(max_new_tokens=4, drafter="ngram"))
    assert len(engine.generate([5, 6], SamplingParams(), GenerationConfig(max_new_tokens=4)).output_ids) >= 1
    bare_ngram = SpeculativeEngine(pair.target, NgramDrafter())
    assert len(bare_ngram.generate([5, 6], config=GenerationConfig(max_new_tokens=4, drafter="ngram")).output_ids) >= 1


@pytest.mark.parametrize(("kind", "gamma"), [("self", 8), ("self", 3), ("model", 3), ("ngram", 8)])
def test_eos_mid_cycle(pair: TinyPair, hf_greedy: HfGreedy, kind: str, gamma: int) -> None:
    cut_after_eos = []
    for prompt in pair.eos_prompts:
        ref = hf_greedy(pair.target, prompt, REF_TOKENS)
        assert ref[-1] == EOS_ID and len(ref) < REF_TOKENS
        result, target = run(pair, make_drafter(kind, pair), prompt, REF_TOKENS, gamma)
        assert result.output_ids == ref
        assert result.finish_reason == "eos"
        assert result.output_ids.count(EOS_ID) == 1
        check_committed_cache(target, result)
        # tokens the verifier committed in total vs. delivered: the surplus was cut after EOS
        cut_after_eos.append(result.stats.accepted_tokens + result.stats.cycles - len(result.output_ids))
    assert all(cut >= 0 for cut in cut_after_eos)
    if kind == "self" and gamma == 8:
        assert any(cut > 0 for cut in cut_after_eos), "no case had EOS in the middle of a verified block"


def test_eos_inside_the_prompt_does_not_stop(pair: TinyPair, hf_greedy: HfGreedy) -> None:
    prompt = (7, EOS_ID, 8, 9)
    ref = hf_greedy(pair.target, prompt, 10)
    result, _ = run(pair, make_drafter("self", pair), prompt, 10, 3)
    assert result.output_ids == ref and len(ref) >= 1


def test_ignore_eos_continues_past_eos(pair: TinyPair) -> None:
    prompt = pair.eos_prompts[0]
    n = 24
    ref = no_cache_greedy_ids(pair.target.model, prompt, n)
    assert EOS_ID in ref[:-1], "the reference must pass through EOS for this test to mean anything"
    for kind in ("self", "model"):
        result, target = run(pair, make_drafter(kind, pair), prompt, n, 4, ignore_eos=True)
        assert result.output_ids == ref
        assert result.finish_reason == "length"
        check_committed_cache(target, result)


@pytest.mark.parametrize("gamma", [3, 8])
@pytest.mark.parametrize("kind", ["self", "model", "ngram"])
def test_max_new_tokens_mid_cycle(pair: TinyPair, hf_greedy: HfGreedy, kind: str, gamma: int) -> None:
    for prompt in (pair.length_prompts[0], pair.prompts[1]):
        for n in (1, 2, 5, 11):
            ref = hf_greedy(pair.target, prompt, n)
            if len(ref) < n:
                continue  # reached EOS before n
            result, target = run(pair, make_drafter(kind, pair), prompt, n, gamma)
            assert result.output_ids == ref
            assert len(result.output_ids) == n
            assert result.finish_reason == "length"
            assert result.stats.new_tokens == n
            check_committed_cache(target, result)


class OverrunningDrafter:
    """A misbehaving drafter that proposes more tokens than its budget."""

    name = "overrun"

    def __init__(self, inner: DraftModelDrafter) -> None:
        self.inner = inner
        self.budgets: list[int] = []

    def start(self, prompt_ids: Sequence[int], params: SamplingParams, generator: torch.Generator) -> None:
        self.inner.start(prompt_ids, params, generator)

    def propose(self, budget: int) -> Draft:
        self.budgets.append(budget)
        return self.inner.propose(budget + 3)

    def accept(self, committed: Sequence[int]) -> None:
        self.inner.accept(committed)


def test_overrunning_drafter_is_trimmed_to_its_budget(pair: TinyPair, hf_greedy: HfGreedy) -> None:
    prompt = pair.length_prompts[0]
    drafter = OverrunningDrafter(DraftModelDrafter(pair.target, pair.target))
    result, target = run(pair, drafter, prompt, 7, 2)
    assert result.output_ids == hf_greedy(pair.target, prompt, 7)
    assert len(result.output_ids) == 7 and result.finish_reason == "length"
    assert result.stats.drafted_tokens == sum(drafter.budgets)
    check_committed_cache(target, result)


def test_prompt_filling_the_context_exactly(pair: TinyPair, hf_greedy: HfGreedy) -> None:
    n = 6
    prompt = [int(t) for t in torch.arange(MAX_POSITIONS - n) % 90 + 3]
    ref = hf_greedy(pair.target, prompt, n)
    result, target = run(pair, make_drafter("self", pair), prompt, n, 8)
    assert result.output_ids == ref
    check_committed_cache(target, result)


def test_cache_matches_committed_text_after_every_streamed_cycle(pair: TinyPair, hf_greedy: HfGreedy) -> None:
    prompt = pair.prompts[1]
    target = RecordingLM(pair.target)
    engine = SpeculativeEngine(target, make_drafter("model", pair))
    emitted: list[int] = []
    for chunk in engine.stream(list(prompt), SamplingParams(), GenerationConfig(max_new_tokens=20, gamma=3)):
        emitted.extend(chunk.token_ids)
        assert_cache_holds(target, target.caches[0], [*prompt, *emitted][:-1])
    assert emitted == hf_greedy(pair.target, prompt, 20)


def test_text_prompt_equals_token_prompt(pair: TinyPair) -> None:
    tokenizer = pair.target.tokenizer
    assert tokenizer is not None
    text = "speculate, then verify"
    ids = tokenizer(text, add_special_tokens=False)["input_ids"]
    engine = SpeculativeEngine(pair.target, make_drafter("model", pair))
    config = GenerationConfig(max_new_tokens=10, gamma=3)
    by_text = engine.generate(text, SamplingParams(), config)
    by_ids = engine.generate(ids, SamplingParams(), config)
    assert by_text.prompt_ids == ids
    assert by_text.output_ids == by_ids.output_ids


# ---------------------------------------------------------------------------------------------
# Sampling


@pytest.mark.parametrize("kind", ["none", "ngram", "model"])
def test_seeded_sampling_is_reproducible(pair: TinyPair, kind: str) -> None:
    prompt = pair.prompts[0]

    def sample_ids(seed: int, **warps: float) -> list[int]:
        params = SamplingParams(temperature=1.0, seed=seed, **warps)  # type: ignore[arg-type]
        result, target = run(pair, make_drafter(kind, pair), prompt, 30, 4, params)
        assert len(result.output_ids) == 30 or result.finish_reason == "eos"
        check_committed_cache(target, result)
        return result.output_ids

    first = sample_ids(7)
    assert sample_ids(7) == first
    assert sample_ids(8) != first
    assert sample_ids(9) != first
    warped = sample_ids(7, top_k=5, top_p=0.9)
    assert sample_ids(7, top_k=5, top_p=0.9) == warped


def test_sampled_tokens_follow_the_target_distribution(tiny_pairs: dict[str, TinyPair]) -> None:
    """Chi-square test of the two tokens an engine run emits, against exact enumeration.

    The 1-layer draft proposes one token from its own top-k-warped q (gamma=1); the target accepts
    it with min(1, p/q) and then adds a bonus token, or rejects it and resamples from the residual
    (the second token then comes from a second cycle with an empty draft). Whatever path is taken,
    token 1 must follow p(.|prompt) and token 2 must follow sum_t p(t|prompt) p(.|prompt, t).
    Significance 1e-4 per test (two tests: false-failure probability < 2e-4; seeds fixed).
    """
    pair = tiny_pairs["llama"]
    prompt = [5, 6, 7, 8, 9]
    params = SamplingParams(temperature=1.0, top_k=6)
    with torch.no_grad():
        logits = pair.target.model(input_ids=torch.tensor([prompt])).logits[0, -1]
        p1 = warp_probs(logits, params)
        support = torch.nonzero(p1).flatten().tolist()
        p2 = torch.zeros_like(p1)
        for t in support:
            next_logits = pair.target.model(input_ids=torch.tensor([[*prompt, t]])).logits[0, -1]
            p2 += p1[t] * warp_probs(next_logits, params)
        draft_logits = pair.draft.model(input_ids=torch.tensor([prompt])).logits[0, -1]
        q1 = warp_probs(draft_logits, params)
    overlap = float(torch.minimum(p1, q1).sum())
    assert 0.05 < overlap < 0.95, f"p and q should overlap partially (got {overlap:.3f}) so both paths are taken"

    engine = SpeculativeEngine(pair.target, DraftModelDrafter(pair.draft, pair.target))
    n = 1200

    def run(seed: int) -> tuple[list[int], int]:
        result = engine.generate(prompt, SamplingParams(temperature=1.0, top_k=6, seed=seed), GenerationConfig(2, 1))
        return result.output_ids, result.stats.accepted_tokens

    runs = draws_over_seeds(run, n)
    first = [output[0] for output, _ in runs]
    second = [output[1] for output, _ in runs]
    accepted = sum(count for _, count in runs)
    assert 0 < accepted < n, "both the accept and the reject path must occur"

    for tokens, probs in ((first, p1), (second, p2)):
        counts = Counter(tokens)
        assert all(probs[t] > 0 for t in counts), "a zero-probability token was emitted"
        expected = probs * n
        big = (expected >= 5).nonzero().flatten().tolist()
        observed = [counts.get(t, 0) for t in big]
        wanted = [float(expected[t]) for t in big]
        rest_obs, rest_exp = n - sum(observed), n - sum(wanted)
        if rest_exp > 1e-9:
            observed.append(rest_obs)
            wanted.append(rest_exp)
        pvalue = scipy.stats.chisquare(observed, wanted).pvalue
        assert pvalue > 1e-4, f"emitted tokens do not follow the target distribution (p={pvalue:.2e})"


# ---------------------------------------------------------------------------------------------
# Streaming and stop strings


def test_stream_deltas_concatenate_to_the_text(pair: TinyPair) -> None:
    tokenizer = pair.target.tokenizer
    assert tokenizer is not None
    engine = SpeculativeEngine(pair.target, make_drafter("model", pair))
    for prompt in pair.prompts[:4]:
        chunks = list(engine.stream(list(prompt), SamplingParams(), GenerationConfig(max_new_tokens=30, gamma=3)))
        result = chunks[-1].result
        assert result is not None
        assert all(chunk.result is None for chunk in chunks[:-1])
        assert "".join(chunk.text for chunk in chunks) == result.text
        assert [t for chunk in chunks for t in chunk.token_ids] == result.output_ids
        assert result.text == tokenizer.decode(result.output_ids, skip_special_tokens=True)
        assert len(chunks) == result.stats.cycles


def test_stop_string_cuts_the_text(pair: TinyPair) -> None:
    tokenizer = pair.target.tokenizer
    assert tokenizer is not None
    prompt = list(pair.length_prompts[0])
    config = GenerationConfig(max_new_tokens=30, gamma=3)
    for kind in ("self", "model"):
        target = RecordingLM(pair.target)
        engine = SpeculativeEngine(target, make_drafter(kind, pair))
        full = engine.generate(prompt, SamplingParams(), config)
        assert full.finish_reason == "length"
        checked = 0
        for start in (2, 5, 9, 13, 20):
            for width in (1, 2, 3):
                stop = full.text[start : start + width]
                cut = full.text.find(stop)
                chunks = list(engine.stream(prompt, SamplingParams(), GenerationConfig(30, 3, stop=(stop, "never~~"))))
                result = chunks[-1].result
                assert result is not None
                assert result.finish_reason == "stop"
                assert result.text == full.text[:cut]
                assert "".join(chunk.text for chunk in chunks) == result.text
                # the tokens kept end with the token that completed the stop string
                ids = result.output_ids
                assert ids == full.output_ids[: len(ids)]
                assert stop in tokenizer.decode(ids)
                assert stop not in tokenizer.decode(ids[:-1])
                assert result.stats.new_tokens == len(ids)
                check_committed_cache_of(target, target.caches[-1], result)
                checked += 1
        assert checked == 15


# ---------------------------------------------------------------------------------------------
# Bad input


def test_bad_requests_raise_invalid_request(pair: TinyPair) -> None:
    engine = SpeculativeEngine(pair.target, NoDrafter())
    with pytest.raises(InvalidRequest, match="prompt is empty"):
        engine.stream([], SamplingParams(), GenerationConfig(max_new_tokens=4))  # raised eagerly, not on iteration
    with pytest.raises(InvalidRequest, match="exceeds the target's context"):
        engine.stream([5] * MAX_POSITIONS, SamplingParams(), GenerationConfig(max_new_tokens=1))
    with pytest.raises(InvalidRequest, match="prompt is empty"):
        engine.generate([], SamplingParams(), GenerationConfig(max_new_tokens=4))
    with pytest.raises(InvalidRequest, match="prompt is empty"):
        engine.generate("", SamplingParams(), GenerationConfig(max_new_tokens=4))
    with pytest.raises(InvalidRequest, match=rf"exceeds the target's context of {MAX_POSITIONS} tokens"):
        engine.generate([5] * 100, SamplingParams(), GenerationConfig(max_new_tokens=MAX_POSITIONS - 99))
    with pytest.raises(InvalidRequest, match=r"prompt token ids must be in \[0, 96\)"):
        engine.generate([5, 96], SamplingParams(), GenerationConfig(max_new_tokens=4))
    with pytest.raises(InvalidRequest, match=r"prompt token ids must be in"):
        engine.generate([-1, 5], SamplingParams(), GenerationConfig(max_new_tokens=4))
    with pytest.raises(InvalidRequest, match=f"gamma must be between .* and {MAX_GAMMA}.*got -1"):
        GenerationConfig(gamma=-1)
    with pytest.raises(InvalidRequest, match=f"gamma must be between .* and {MAX_GAMMA}.*got {MAX_GAMMA + 1}"):
        GenerationConfig(gamma=MAX_GAMMA + 1)
    with pytest.raises(InvalidRequest, match="max_new_tokens must be >= 1, got 0"):
        GenerationConfig(max_new_tokens=0)
    with pytest.raises(InvalidRequest, match="stop strings must be non-empty"):
        GenerationConfig(stop=("",))
    GenerationConfig(gamma=MAX_GAMMA)  # the bounds themselves are fine


def test_text_prompt_without_tokenizer_is_rejected(pair: TinyPair) -> None:
    bare = CausalLM(pair.target.model, tokenizer=None)
    engine = SpeculativeEngine(bare, NoDrafter())
    with pytest.raises(InvalidRequest, match="no tokenizer"):
        engine.generate("hello", SamplingParams(), GenerationConfig(max_new_tokens=2))
    result = engine.generate([5, 6], SamplingParams(), GenerationConfig(max_new_tokens=2))
    assert len(result.output_ids) == 2 and result.text == ""
