"""Resuming a request from what its client has (specserve.core.resume), on the in-process engine.

A run is broken after k tokens (the client's stream so far, exactly as streamed: tokens and text) and
continued from them; the client's whole stream — the chunks before the break, then the continuation's
chunks mapped onto the request — must equal an undisturbed run: the same tokens and text for greedy and for
drafter-invariant sampling, a stop string that spans the break cutting where it would have cut, the result
covering the whole output. A sampled request without position-keyed noise continues with a fresh seed.
"""

from __future__ import annotations

import dataclasses

import pytest
from conftest import TinyPair

from specserve.core.engine import SpeculativeEngine
from specserve.core.request import GenerationConfig, GenerationResult
from specserve.core.resume import Resume, ResumedOutput, continuation, resumed_seed
from specserve.core.sampling.params import SamplingParams
from specserve.drafters.registry import build_drafter_set

GREEDY = SamplingParams()
INVARIANT = SamplingParams(temperature=0.9, top_p=0.95, seed=11, drafter_invariant=True)
LONG = GenerationConfig(max_new_tokens=40, gamma=3, ignore_eos=True)


@pytest.fixture()
def engine(pair: TinyPair) -> SpeculativeEngine:
    return SpeculativeEngine(pair.target, build_drafter_set(pair.draft, pair.target))


def broken_run(
    engine: SpeculativeEngine, prompt: list[int], params: SamplingParams, config: GenerationConfig, k: int
) -> tuple[list[int], str, GenerationResult]:
    """What the client sees when the run breaks after ``k`` tokens and is resumed: tokens, text and the result. Before
    the break it decodes plainly (one token per chunk, so the break falls exactly there; the same tokens)."""
    tokens: list[int] = []
    text = ""
    stream = engine.stream(prompt, params, dataclasses.replace(config, drafter="none"))
    for chunk in stream:
        assert chunk.result is None, "the break must come before the end"
        tokens += chunk.token_ids
        text += chunk.text
        if len(tokens) >= k:
            break
    stream.close()  # the lost replica

    resume = Resume.of(tokens, text)
    output = ResumedOutput(prompt, resume, engine.decode, config.stop)
    result = None
    for chunk in engine.stream(*continuation(prompt, params, config, resume)):
        mapped = output.map(chunk)
        tokens += mapped.token_ids
        text += mapped.text
        result = mapped.result
        if output.finished:
            break
    assert result is not None
    return tokens, text, result


@pytest.mark.parametrize("params", [GREEDY, INVARIANT], ids=["greedy", "drafter-invariant"])
@pytest.mark.parametrize("k", [1, 7, 39])
def test_a_resumed_stream_equals_an_undisturbed_one(
    engine: SpeculativeEngine, pair: TinyPair, params: SamplingParams, k: int
) -> None:
    prompt = list(pair.prompts[0])
    want = engine.generate(prompt, params, LONG)
    tokens, text, result = broken_run(engine, prompt, params, LONG, k)
    assert tokens == want.output_ids == result.output_ids
    assert text == want.text == result.text
    assert result.finish_reason == want.finish_reason == "length"
    assert result.stats.new_tokens == len(want.output_ids)


def test_a_stop_string_across_the_break_cuts_where_it_would_have(engine: SpeculativeEngine, pair: TinyPair) -> None:
    prompt = list(pair.prompts[0])
    whole = engine.generate(prompt, GREEDY, LONG).text
    # a two-character stop string first found at some j >= 5: the break falls between its characters
    j = next(j for j in range(5, len(whole) - 1) if whole.find(whole[j : j + 2]) == j)
    config = dataclasses.replace(LONG, stop=(whole[j : j + 2],))
    want = engine.generate(prompt, GREEDY, config)
    assert want.finish_reason == "stop" and want.text == whole[:j]
    for k in (j - 2, j + 1):  # before it, and with its first character out (held back from the client)
        tokens, text, result = broken_run(engine, prompt, GREEDY, config, k)
        assert (tokens, text) == (want.output_ids, want.text)
        assert (result.output_ids, result.text, result.finish_reason) == (want.output_ids, want.text, "stop")


def test_eos_after_the_break(engine: SpeculativeEngine, pair: TinyPair) -> None:
    prompt = list(pair.eos_prompts[0])
    config = GenerationConfig(max_new_tokens=pair.target.info.max_positions - len(prompt), gamma=3)
    want = engine.generate(prompt, GREEDY, config)
    assert want.finish_reason == "eos" and len(want.output_ids) >= 2
    tokens, text, result = broken_run(engine, prompt, GREEDY, config, 1)
    assert (tokens, text, result.finish_reason) == (want.output_ids, want.text, "eos")


def test_the_continuation_request() -> None:
    config = GenerationConfig(max_new_tokens=10, stop=("x",))
    resume = Resume((7, 8, 9), 3)
    prefix, params, rest = continuation([1, 2], GREEDY, config, resume)
    assert prefix == [1, 2, 7, 8, 9] and rest.max_new_tokens == 7 and rest.stop == ()
    assert params == dataclasses.replace(GREEDY, prior_output_tokens=3)  # the penalties count them as output
    # noise keyed by absolute position: the seed stays
    assert continuation([1, 2], INVARIANT, config, resume)[1] == dataclasses.replace(INVARIANT, prior_output_tokens=3)
    sampled = SamplingParams(temperature=1.0, seed=5)
    fresh = continuation([1, 2], sampled, config, resume)[1]
    assert fresh.seed == resumed_seed(5, 5) and fresh.seed != 5 and 0 <= fresh.seed < 2**63
    assert dataclasses.replace(fresh, seed=5, prior_output_tokens=0) == sampled  # only the seed and the count change
    with pytest.raises(ValueError, match="nothing to resume"):
        continuation([1, 2], GREEDY, GenerationConfig(max_new_tokens=3), resume)
