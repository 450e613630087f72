"""The engine loop in isolation: a real batched engine on the tiny llama pair, driven from asyncio, no Ray.

Checks that concurrent streams each equal the request alone (greedy) while sharing steps; that a
stream starts with an empty chunk once accepted, and a request the engine refuses raises its
``InvalidRequest`` instead (the loop's codec refuses it first, naming max_seq_len); that closing a
stream cancels the request and frees its KV; that an idle loop sleeps; that a failing step
fails the requests that had streamed, restarts those that had not, and the loop serves on (and
reports itself unhealthy when every step fails); and that shutdown fails what is in flight and
refuses what comes after. Failures come from a ``BatchedEngine`` subclass whose ``step`` raises
(logic under test: the loop's error path).
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Callable
from typing import Any

import pytest
from conftest import TinyPair, assert_pool_empty

from specserve.core.batch_engine import BatchedEngine
from specserve.core.engine import SpeculativeEngine
from specserve.core.errors import InvalidRequest
from specserve.core.request import GenerationConfig, GenerationResult, StreamChunk
from specserve.core.sampling.params import SamplingParams
from specserve.drafters.registry import build_drafter_set, request_drafters
from specserve.serve.engine_loop import EngineFailure, EngineLoop, EngineStopped, LengthPromptCodec

pytestmark = pytest.mark.timeout(120)

GREEDY = SamplingParams()
LONG = GenerationConfig(max_new_tokens=100, gamma=3, ignore_eos=True)


@pytest.fixture(scope="module")
def llama(tiny_pairs: dict[str, TinyPair]) -> TinyPair:
    return tiny_pairs["llama"]


def batched(pair: TinyPair, cls: type[BatchedEngine] = BatchedEngine, **options: Any) -> BatchedEngine:
    """A batched engine whose draft model drafts for all its requests from a pool of as many requests."""
    options = {"max_num_seqs": 3, "max_seq_len": 120, "prefill_tokens": 16, **options}
    sizes = {"max_num_seqs": options["max_num_seqs"], "max_seq_len": options["max_seq_len"]}
    return cls(pair.target, request_drafters(pair.draft, pair.target, **sizes), **options)


def alone(pair: TinyPair, prompt: list[int], config: GenerationConfig) -> GenerationResult:
    return SpeculativeEngine(pair.target, build_drafter_set(pair.draft, pair.target)).generate(prompt, GREEDY, config)


async def collect(loop: EngineLoop, prompt: list[int], config: GenerationConfig) -> list[StreamChunk]:
    return [chunk async for chunk in loop.stream(prompt, GREEDY, config)]


async def eventually(condition: Callable[[], bool], what: str, timeout_s: float = 20.0) -> None:
    deadline = time.monotonic() + timeout_s
    while not condition():
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out waiting for {what}")
        await asyncio.sleep(0.01)


def check_stream(chunks: list[StreamChunk], want: GenerationResult) -> None:
    # the stream opens with its acceptance, an empty chunk, unless the caller was slow enough for it to be merged with
    # the first tokens (merge_chunks: chunks that piled up travel as one), which then open the output
    first = chunks[0]
    assert (first.text, first.token_ids) == ("", []) or first.token_ids == want.output_ids[: len(first.token_ids)]
    result = chunks[-1].result
    assert result is not None and all(c.result is None for c in chunks[:-1])
    assert [t for c in chunks for t in c.token_ids] == want.output_ids == result.output_ids
    assert "".join(c.text for c in chunks) == want.text == result.text
    assert result.finish_reason == want.finish_reason


def pool_empty(loop: EngineLoop) -> bool:
    status = loop.status()
    return status["requests"] == 0 and status["kv"]["free"] == status["kv"]["tokens"] and not status["active_requests"]


def test_concurrent_streams_equal_each_request_alone_and_share_steps(llama: TinyPair) -> None:
    requests = [
        (list(llama.prompts[0]), GenerationConfig(max_new_tokens=24, gamma=3)),
        (list(llama.eos_prompts[0]), GenerationConfig(max_new_tokens=20, gamma=2, drafter="ngram")),
        (list(llama.length_prompts[0]), GenerationConfig(max_new_tokens=16, drafter="none")),
        (list(llama.prompts[1]), GenerationConfig(max_new_tokens=18, gamma=4)),  # waits its turn
    ]
    loop = EngineLoop(batched(llama))
    try:

        async def main() -> list[list[StreamChunk]]:
            return list(await asyncio.gather(*(collect(loop, prompt, config) for prompt, config in requests)))

        for (prompt, config), chunks in zip(requests, asyncio.run(main()), strict=True):
            check_stream(chunks, alone(llama, prompt, config))
        status = loop.status()
        assert max(status["batch_sizes"]) == 3 and status["steps"] > 0  # three at once, all used together
        assert pool_empty(loop)
    finally:
        loop.shutdown()


def test_a_request_the_engine_refuses_raises_and_the_loop_serves_on(llama: TinyPair) -> None:
    loop = EngineLoop(batched(llama, max_seq_len=40))
    prompt = list(llama.prompts[0])
    try:
        assert isinstance(loop.prompts, LengthPromptCodec)  # the ingress refuses it first, naming the setting
        with pytest.raises(InvalidRequest, match=r"exceed the 40 tokens one request may hold .*max_seq_len"):
            loop.prompts.check_length(prompt, 60)

        async def main() -> list[StreamChunk]:
            with pytest.raises(InvalidRequest, match="40 tokens a request may hold"):
                await collect(loop, prompt, GenerationConfig(max_new_tokens=60))
            return await collect(loop, prompt, GenerationConfig(max_new_tokens=12, gamma=3))

        check_stream(asyncio.run(main()), alone(llama, prompt, GenerationConfig(max_new_tokens=12, gamma=3)))
        assert pool_empty(loop)
    finally:
        loop.shutdown()


def test_closing_a_stream_cancels_the_request_and_frees_its_kv(llama: TinyPair) -> None:
    loop = EngineLoop(batched(llama))
    prompt = list(llama.prompts[2])
    try:

        async def main() -> list[StreamChunk]:
            stream = loop.stream(prompt, GREEDY, LONG)
            chunk = await anext(stream)
            while not chunk.token_ids:
                chunk = await anext(stream)
            kv = loop.status()["kv"]
            assert chunk.result is None and kv["free"] == kv["tokens"] - len(prompt) - LONG.max_new_tokens
            await stream.aclose()
            await eventually(lambda: pool_empty(loop), "the cancelled request's KV to be freed")
            return await collect(loop, prompt, GenerationConfig(max_new_tokens=10, gamma=3))

        check_stream(asyncio.run(main()), alone(llama, prompt, GenerationConfig(max_new_tokens=10, gamma=3)))
    finally:
        loop.shutdown()


class CountingEngine(BatchedEngine):
    """Counts how often the loop looks at the engine (logic under test: the loop sleeps when idle)."""

    looks = 0

    @property
    def has_work(self) -> bool:
        CountingEngine.looks += 1
        return bool(super().has_work)


def test_an_idle_loop_sleeps(llama: TinyPair) -> None:
    loop = EngineLoop(batched(llama, CountingEngine))
    try:
        asyncio.run(collect(loop, list(llama.prompts[0]), GenerationConfig(max_new_tokens=6)))
        time.sleep(0.05)
        before = CountingEngine.looks
        time.sleep(0.5)
        assert CountingEngine.looks == before  # asleep on the condition, not polling
    finally:
        loop.shutdown()


class FailingEngine(BatchedEngine):
    """A batched engine whose step raises on the calls listed in ``fail`` (``None``: every call)."""

    def __init__(self, *args: Any, fail: set[int] | None = None, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.fail = fail
        self.calls = 0

    def step(self) -> list[tuple[int, StreamChunk]]:
        self.calls += 1
        if self.fail is None or self.calls in self.fail:
            raise RuntimeError("the accelerator fell off the bus")
        return super().step()


def test_a_failed_step_fails_streamed_requests_restarts_the_others_and_the_loop_serves_on(llama: TinyPair) -> None:
    engine = batched(llama, FailingEngine, max_num_seqs=1, fail={4})
    loop = EngineLoop(engine)
    first, second = list(llama.prompts[0]), list(llama.prompts[1])
    config = GenerationConfig(max_new_tokens=12, gamma=3)
    try:

        async def main() -> tuple[BaseException | list[StreamChunk], ...]:
            # one at a time: the first request streams; the second waits its turn when the fourth step fails
            return tuple(
                await asyncio.gather(collect(loop, first, LONG), collect(loop, second, config), return_exceptions=True)
            )

        failed, restarted = asyncio.run(main())
        assert isinstance(failed, EngineFailure) and "fell off the bus" in str(failed)
        assert "keeps serving" in str(failed)
        assert isinstance(restarted, list)
        check_stream(restarted, alone(llama, second, config))  # nothing of it had been seen: restarted, exact
        check_stream(asyncio.run(collect(loop, first, config)), alone(llama, first, config))
        loop.check_health()
        assert loop.status()["failed_steps"] == 1 and pool_empty(loop)
    finally:
        loop.shutdown()


def test_a_loop_whose_every_step_fails_says_so_and_reports_unhealthy(llama: TinyPair) -> None:
    engine = batched(llama, FailingEngine, max_num_seqs=2, fail=None)
    loop = EngineLoop(engine)
    try:
        for _ in range(2):  # each request is restarted once, then fails
            with pytest.raises(EngineFailure, match="fell off the bus"):
                asyncio.run(collect(loop, list(llama.prompts[0]), GenerationConfig(max_new_tokens=4)))
        with pytest.raises(EngineFailure, match="failed its last 4 steps"):
            loop.check_health()
        assert pool_empty(loop)
    finally:
        loop.shutdown()


def test_shutdown_fails_requests_in_flight_and_refuses_new_ones(llama: TinyPair) -> None:
    engine = batched(llama)
    loop = EngineLoop(engine)

    async def main() -> None:
        stream = loop.stream(list(llama.prompts[0]), GREEDY, LONG)
        chunk = await anext(stream)
        while not chunk.token_ids:
            chunk = await anext(stream)
        loop.shutdown()
        with pytest.raises(EngineStopped, match="shutting down"):
            async for _ in stream:
                pass
        with pytest.raises(EngineStopped, match="not running"):
            await collect(loop, list(llama.prompts[1]), GenerationConfig(max_new_tokens=4))

    asyncio.run(main())
    assert not loop._thread.is_alive()
    assert not engine.has_work
    assert_pool_empty(engine)  # its KV freed on the way out
    with pytest.raises(EngineStopped):
        loop.check_health()
