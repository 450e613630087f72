"""Starting a request (:mod:`specserve.core.request`): its grammar is compiled once, whoever uses it.

A request with a grammar is checked where it enters (the HTTP edge's or the engine's
:meth:`~specserve.core.prompts.PromptCodec.check_grammar`), then verified against it and drafted under it (a draft
model masks its proposals by it). :func:`~specserve.core.verify.grammar.compile_grammar` is the one function that
compiles a grammar; these tests count its calls per request on the single-request and the batched engine, with the draft
model drafting, and check the output is still the target's own greedy decoding (a grammar that allows every text the
target writes changes nothing).
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Callable, Iterator, Sequence
from typing import Any

import pytest
from conftest import BOS_ID, PAD_ID, VOCAB, TinyPair, char_tokenizer, finish_all

from specserve.core.batch_engine import BatchedEngine
from specserve.core.engine import SpeculativeEngine
from specserve.core.model.causal_lm import CausalLM
from specserve.core.request import GenerationConfig
from specserve.core.sampling.params import GrammarSpec, SamplingParams
from specserve.core.verify import grammar as grammar_module
from specserve.core.verify.grammar import compiler_for
from specserve.drafters import build_drafter_set
from specserve.drafters.registry import request_drafters

NEW_TOKENS = 12

# Any printable text (the char tokenizer's every non-special token), each spec different so each request compiles its
# own: the target's greedy text never leaves them, so constrained greedy decoding is its plain greedy decoding.
ANY_TEXT = [GrammarSpec("regex", f"[ -|]*|{'!' * (n + 1)}") for n in range(4)]


@pytest.fixture
def compilations(monkeypatch: pytest.MonkeyPatch) -> Iterator[list[GrammarSpec]]:
    """Every grammar compiled during the test, in order (an empty cache first, so earlier tests' grammars count)."""
    compiled: list[GrammarSpec] = []
    compile_grammar = grammar_module.compile_grammar

    def spy(tokenizer: Any, spec: GrammarSpec) -> Any:
        compiled.append(spec)
        return compile_grammar(tokenizer, spec)

    monkeypatch.setattr(grammar_module, "_GRAMMARS", OrderedDict())
    monkeypatch.setattr(grammar_module, "compile_grammar", spy)
    yield compiled


def text_prompts(
    hf_greedy: Callable[[CausalLM, Sequence[int], int], list[int]], pair: TinyPair, count: int
) -> list[tuple[list[int], list[int]]]:
    """``count`` of the pair's prompts whose greedy continuation writes no <pad> or <s> (tokens no grammar allows),
    each with that continuation."""
    cases = []
    for prompt in pair.prompts:
        expected = hf_greedy(pair.target, prompt, NEW_TOKENS)
        if not set(expected) & {PAD_ID, BOS_ID}:
            cases.append((list(prompt), expected))
    assert len(cases) >= count, f"only {len(cases)} prompts continue with text alone"
    return cases[:count]


def test_the_single_engine_compiles_each_request_grammar_once(
    pair: TinyPair,
    hf_greedy: Callable[[CausalLM, Sequence[int], int], list[int]],
    compilations: list[GrammarSpec],
) -> None:
    engine = SpeculativeEngine(pair.target, build_drafter_set(pair.draft, pair.target))
    config = GenerationConfig(max_new_tokens=NEW_TOKENS, gamma=3)  # the draft model drafts, under the grammar
    cases = text_prompts(hf_greedy, pair, 3)
    for (prompt, expected), spec in zip(cases, ANY_TEXT, strict=False):
        params = SamplingParams(grammar=spec)
        engine.prompts.check_grammar(params)  # the HTTP edge's check, in this process
        assert engine.generate(prompt, params, config).output_ids == expected
        assert compilations.count(spec) == 1, f"{spec} compiled {compilations.count(spec)} times for one request"
    assert compilations == ANY_TEXT[: len(cases)]


def test_the_batched_engine_compiles_each_request_grammar_once(
    pair: TinyPair,
    hf_greedy: Callable[[CausalLM, Sequence[int], int], list[int]],
    compilations: list[GrammarSpec],
) -> None:
    drafters = request_drafters(pair.draft, pair.target, max_num_seqs=4, max_seq_len=64)  # a pooled draft model
    engine = BatchedEngine(pair.target, drafters, max_num_seqs=4, max_seq_len=64)
    config = GenerationConfig(max_new_tokens=NEW_TOKENS, gamma=3)
    cases = text_prompts(hf_greedy, pair, len(ANY_TEXT))
    for spec in ANY_TEXT:
        engine.prompts.check_grammar(SamplingParams(grammar=spec))  # the HTTP edge's check
    ids = [
        engine.submit(prompt, SamplingParams(grammar=spec), config)
        for (prompt, _), spec in zip(cases, ANY_TEXT, strict=True)
    ]
    results = finish_all(engine)
    for request_id, (_, expected) in zip(ids, cases, strict=True):
        assert results[request_id].output_ids == expected
    assert sorted(compilations, key=ANY_TEXT.index) == ANY_TEXT, compilations


def test_requests_with_one_grammar_share_its_compilation(pair: TinyPair, compilations: list[GrammarSpec]) -> None:
    engine = SpeculativeEngine(pair.target, build_drafter_set(pair.draft, pair.target))
    config = GenerationConfig(max_new_tokens=6, gamma=3)
    params = SamplingParams(grammar=ANY_TEXT[0])
    first = engine.generate(list(pair.prompts[0]), params, config)
    assert engine.generate(list(pair.prompts[0]), params, config).output_ids == first.output_ids
    assert compilations == [ANY_TEXT[0]]


def test_tokenizers_of_equal_vocabularies_share_compiled_grammars(compilations: list[GrammarSpec]) -> None:
    """A target's and a draft model's tokenizers, loaded apart from the same files, compile a grammar once; another
    vocabulary compiles its own."""
    spec = GrammarSpec("regex", "[a-c]+x")
    target, draft, other = char_tokenizer(), char_tokenizer(), char_tokenizer(reverse=True)
    text = target("aa|", add_special_tokens=False)["input_ids"]
    for tokenizer in (target, draft):
        assert compiler_for(tokenizer, VOCAB).compile(spec).valid_prefix(text) == 2  # "a", "a", not "|"
    assert compilations == [spec]
    compiler_for(other, VOCAB).compile(spec)
    assert compilations == [spec, spec]
