"""One request's failure is its own: the batched engine ends it alone, and everyone else's tokens are unchanged.

A mixed batch (greedy and seeded requests, draft-model chains drafted in shared forwards, n-gram, a dynamic tree, a
grammar, drafter-invariant sampling: test_batch_engine.py's mix) runs beside one more request that fails partway
through, at each place a request can fail on its own:

* **grammar** — its grammar gives up at run time: llguidance's matcher reports an error after a few masks, as its
  lexer does when a grammar exhausts its budget mid-text (the matcher is wrapped to do so on cue; a grammar that
  fails within the first tokens is refused before it runs: test_openai_api.py). The draft model's matcher gives up
  first, in the forwards its row shares with the others' (its chain just ends), then the target verifier's;
* **drafter** — its drafter raises on its third proposal;
* **processor** — its repetition penalty raises on the third cycle;
* **nan** — the target's logits for its rows turn to NaN from the third verify step on (the batched forward's output
  is patched for that row alone).

Every other request's output equals the same request run alone (:class:`~specserve.core.engine.SpeculativeEngine`),
token for token, with the same cycles; the failing one ends with its error — the caller's
:class:`~specserve.core.errors.GrammarFailed` (a 400 at the HTTP edge) or a
:class:`~specserve.core.errors.RequestFailed` naming nothing internal — after some tokens; its KV and its span of
the draft model's pool are freed. The same through :class:`~specserve.serve.engine_loop.EngineLoop`, streamed: the
failing stream raises, the others stream their solo text.
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable, Iterator
from typing import Any

import pytest
import torch
from conftest import TinyPair, assert_pool_empty
from test_batch_engine import alone, mixed_requests, pooled_drafter_factory

from specserve.core.batch_engine import BatchedEngine
from specserve.core.draft.drafter import Drafter
from specserve.core.errors import GrammarFailed, RequestFailed
from specserve.core.request import GenerationConfig, GenerationResult
from specserve.core.sampling.params import GrammarSpec, SamplingParams
from specserve.core.verify.grammar import GrammarCompiler
from specserve.core.verify.processors import PenaltyState
from specserve.drafters.ngram import NgramDrafter
from specserve.serve.engine_loop import EngineLoop

pytestmark = pytest.mark.timeout(300)

KINDS = ("grammar", "drafter", "processor", "nan")
AFTER = 2  # the doomed request's part works this many times, then fails
DOOMED_GRAMMAR = GrammarSpec("regex", "[a-k]{30,40}")  # longer than the request may run: no early end


class GivesUp:
    """llguidance's matcher, which gives up on its grammar after ``after`` masks, as its lexer does when a grammar
    exhausts a budget mid-text: from then on ``is_error()`` and the lexer's own words."""

    def __init__(self, matcher: Any, after: int) -> None:
        self._matcher = matcher
        self._left = after

    def compute_logit_bias(self) -> Any:
        self._left -= 1
        return self._matcher.compute_logit_bias()

    def is_error(self) -> bool:
        return self._left < 0 or bool(self._matcher.is_error())

    def get_error(self) -> str:
        return "lexer error: too many expressions constructed" if self._left < 0 else str(self._matcher.get_error())

    def __getattr__(self, name: str) -> Any:
        return getattr(self._matcher, name)


class FailingNgram(NgramDrafter):
    """An n-gram drafter that raises on its ``AFTER + 1``-th proposal."""

    def __init__(self) -> None:
        super().__init__(max_ngram=3, min_ngram=1)
        self.proposals = 0

    def propose(self, *args: Any, **kwargs: Any) -> Any:
        self.proposals += 1
        if self.proposals > AFTER:
            raise RuntimeError("the drafter broke")
        return super().propose(*args, **kwargs)


def doomed_request(pair: TinyPair, kind: str) -> tuple[list[int], SamplingParams, GenerationConfig]:
    prompt = list(pair.prompts[0])
    config = GenerationConfig(max_new_tokens=24, gamma=3)
    if kind == "grammar":
        return prompt, SamplingParams(grammar=DOOMED_GRAMMAR), config
    if kind == "drafter":
        return prompt, SamplingParams(temperature=1.0, seed=11), GenerationConfig(max_new_tokens=24, drafter="ngram")
    if kind == "processor":
        return prompt, SamplingParams(repetition_penalty=1.3), config
    return prompt, SamplingParams(temperature=0.9, seed=4), config


def expected_error(kind: str) -> type[Exception]:
    return GrammarFailed if kind == "grammar" else RequestFailed


@pytest.fixture
def failing(
    request: pytest.FixtureRequest, monkeypatch: pytest.MonkeyPatch
) -> Iterator[Callable[[BatchedEngine], None]]:
    """The failure of ``request.param`` armed (process-wide patches that touch the doomed request only); call the
    yielded function with the engine once the doomed request is submitted (the NaN patch needs its KV sequence)."""
    kind = request.param
    if kind == "grammar":
        compile_ = GrammarCompiler.compile
        compiled = [0]

        def compile(self: GrammarCompiler, spec: GrammarSpec) -> Any:
            grammar = compile_(self, spec)
            if spec == DOOMED_GRAMMAR:  # the verifier's matcher first, then the draft model's, which gives up first
                compiled[0] += 1
                grammar.matcher = GivesUp(grammar.matcher, after=3 * AFTER if compiled[0] == 1 else 1)
            return grammar

        monkeypatch.setattr(GrammarCompiler, "compile", compile)
    if kind == "processor":
        apply = PenaltyState.apply
        calls = [0]

        def failing_apply(self: PenaltyState, *args: Any, **kwargs: Any) -> Any:
            calls[0] += 1
            if calls[0] > AFTER:
                raise RuntimeError("the processor broke")
            return apply(self, *args, **kwargs)

        monkeypatch.setattr(PenaltyState, "apply", failing_apply)

    def arm(engine: BatchedEngine) -> None:
        if kind != "nan":
            return
        forward = engine.ops.forward_batch
        steps = [0]

        def poisoned(blocks: Any, last_only: bool = False, capture: Any = None) -> Any:
            logits = forward(blocks, last_only=last_only, capture=capture)
            doomed = [r.seq_id for r in engine._running.values() if r.params.temperature == 0.9]
            if not last_only and doomed:
                steps[0] += 1
                if steps[0] > AFTER:
                    nan = float("nan")
                    return [
                        torch.full_like(rows, nan) if block.seq_id in doomed else rows
                        for block, rows in zip(blocks, logits, strict=True)
                    ]
            return logits

        monkeypatch.setattr(engine.ops, "forward_batch", poisoned)

    yield arm


def drafters_with_a_failing_ngram(pair: TinyPair, kind: str) -> Callable[[str], Drafter]:
    """The pooled factory; for the drafter failure, the doomed request's n-gram drafter (the only n-gram request
    with a seed of 11 is built last) fails."""
    pooled = pooled_drafter_factory(pair, 6)
    built = [0]

    def build(name: str) -> Drafter:
        if kind == "drafter" and name == "ngram":
            built[0] += 1
            if built[0] == 2:  # the mix has one n-gram request, submitted first; the doomed one is second
                return FailingNgram()
        return pooled(name)

    return build


@pytest.mark.parametrize("failing", KINDS, indirect=True)
def test_a_request_that_fails_on_its_own_leaves_its_batch_exact(
    pair: TinyPair, failing: Callable[[BatchedEngine], None], request: pytest.FixtureRequest
) -> None:
    kind = request.node.callspec.params["failing"]
    requests = mixed_requests(pair)
    engine = BatchedEngine(pair.target, drafters_with_a_failing_ngram(pair, kind), max_num_seqs=6, max_seq_len=96)
    ids = {engine.submit(*r): i for i, r in enumerate(requests)}
    doomed = engine.submit(*doomed_request(pair, kind))
    failing(engine)
    results: dict[int, GenerationResult] = {}
    error: Exception | None = None
    doomed_tokens = 0
    steps = 0
    while engine.has_work:
        for request_id, chunk in engine.step():
            if request_id == doomed:
                if isinstance(chunk, Exception):
                    assert error is None, "a request ends once"
                    error = chunk
                else:
                    doomed_tokens += len(chunk.token_ids)
                    assert chunk.result is None, f"the doomed request finished ({chunk.result.finish_reason})"
            else:
                assert not isinstance(chunk, Exception), f"request {ids[request_id]} failed: {chunk!r}"
                if chunk.result is not None:
                    results[ids[request_id]] = chunk.result
        steps += 1
        assert steps < 300, "the batch never finished"
    assert isinstance(error, expected_error(kind)), repr(error)
    assert doomed_tokens > 0, "the failure came partway through, after some tokens"
    if kind == "grammar":
        assert "too many expressions constructed" in str(error) and "simplify" in str(error)
    else:
        assert "broke" not in str(error) and "NaN" not in type(error).__name__  # nothing internal in the message
    for index, (prompt, params, config) in enumerate(requests):
        got, want = results[index], alone(pair, prompt, params, config)
        assert got.output_ids == want.output_ids, f"request {index}"
        assert got.finish_reason == want.finish_reason and got.stats.cycles == want.stats.cycles
    assert_pool_empty(engine)
    draft_pool = engine.new_drafter("default").batcher.pool  # type: ignore[attr-defined]
    assert draft_pool.num_sequences == 0


@pytest.mark.parametrize("failing", ["grammar", "nan"], indirect=True)
def test_through_the_engine_loop_the_failing_stream_raises_and_the_others_stream_their_solo_text(
    pair: TinyPair, failing: Callable[[BatchedEngine], None], request: pytest.FixtureRequest
) -> None:
    kind = request.node.callspec.params["failing"]
    requests = mixed_requests(pair)[:5]
    engine = BatchedEngine(pair.target, pooled_drafter_factory(pair, 6), max_num_seqs=6, max_seq_len=96)
    failing(engine)
    loop = EngineLoop(engine)

    async def run(prompt: list[int], params: SamplingParams, config: GenerationConfig) -> list[Any]:
        chunks: list[Any] = []
        try:
            async for chunk in loop.stream(prompt, params, config):
                chunks.append(chunk)
        except Exception as exc:
            chunks.append(exc)
        return chunks

    async def main() -> list[list[Any]]:
        return await asyncio.gather(*(run(*r) for r in [*requests, doomed_request(pair, kind)]))

    try:
        *streams, doomed = asyncio.run(main())
        assert isinstance(doomed[-1], expected_error(kind)), repr(doomed[-1])
        assert sum(len(chunk.token_ids) for chunk in doomed[:-1]) > 0  # it had streamed when it failed
        for (prompt, params, config), chunks in zip(requests, streams, strict=True):
            want = alone(pair, prompt, params, config)
            assert [t for chunk in chunks for t in chunk.token_ids] == want.output_ids
            assert "".join(chunk.text for chunk in chunks) == want.text
            assert chunks[-1].result.output_ids == want.output_ids
        status = loop.status()
        assert status["failed_requests"] == 1 and status["failed_steps"] == 0
    finally:
        loop.shutdown()
