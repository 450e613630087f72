"""ModelServer without Serve: the in-process engine behind it, driven by asyncio as Serve would drive it.

Checks that the streamed chunks add up to the engine's own answer, that requests queue and all
complete, that closing a stream early stops its generation (finish reason ``cancelled``), and that
a runner failure reaches the consumer while the server keeps serving.
"""

from __future__ import annotations

import asyncio
from collections.abc import Iterator

import pytest
from conftest import TinyPair

from specserve.core.engine import GenerationConfig, GenerationFrontend, SpeculativeEngine, StreamChunk
from specserve.core.sampling import SamplingParams
from specserve.drafters.registry import build_drafter_set
from specserve.serve.config import ServeConfig
from specserve.serve.model_server import ModelServer, merge_chunks

CONFIG = ServeConfig(model_name="tiny", gamma=3)
GREEDY = SamplingParams()


def server_for(runner: GenerationFrontend) -> ModelServer:
    return ModelServer(CONFIG, lambda config: runner)


@pytest.fixture()
def engine(pair: TinyPair) -> SpeculativeEngine:
    return SpeculativeEngine(pair.target, build_drafter_set(pair.draft, pair.target))


async def collect(server: ModelServer, prompt: list[int], config: GenerationConfig) -> list[StreamChunk]:
    return [chunk async for chunk in server.generate(prompt, GREEDY, config)]


def test_streams_the_engines_answer_and_queues_requests(engine: SpeculativeEngine) -> None:
    server = server_for(engine)
    prompts = [engine.encode(text) for text in ("abcab", "hello", "xyzxyz")]
    config = GenerationConfig(max_new_tokens=14, gamma=3)

    async def main() -> list[list[StreamChunk]]:
        return list(await asyncio.gather(*(collect(server, p, config) for p in prompts)))

    for prompt, chunks in zip(prompts, asyncio.run(main()), strict=True):
        want = engine.generate(prompt, GREEDY, config)
        result = chunks[-1].result
        assert result is not None and all(c.result is None for c in chunks[:-1])
        assert "".join(c.text for c in chunks) == want.text == result.text
        assert [t for c in chunks for t in c.token_ids] == want.output_ids == result.output_ids
    status = server.status()
    assert status["running"] == status["waiting"] == 0
    assert sum(status["finished"].values()) == 3 and "cancelled" not in status["finished"]


def test_closing_a_stream_early_cancels_it(engine: SpeculativeEngine) -> None:
    server = server_for(engine)
    prompt = engine.encode("abcab")

    async def main() -> None:
        stream = server.generate(prompt, GREEDY, GenerationConfig(max_new_tokens=100, gamma=3, ignore_eos=True))
        first = await anext(stream)
        assert first.result is None
        await stream.aclose()
        # the next request runs normally
        chunks = await collect(server, prompt, GenerationConfig(max_new_tokens=6, gamma=3))
        assert chunks[-1].result is not None

    asyncio.run(main())
    assert server.status()["finished"]["cancelled"] == 1 and server.status()["running"] == 0


class FailingRunner(GenerationFrontend):
    """A runner whose generation fails after one chunk (logic under test: the server's error path)."""

    def __init__(self, inner: SpeculativeEngine) -> None:
        self.prompts = inner.prompts
        self.closed = False

    def _run(self, prompt_ids: list[int], params: SamplingParams, config: GenerationConfig) -> Iterator[StreamChunk]:
        try:
            yield StreamChunk("a", [5])
            raise RuntimeError("shard died")
        finally:
            self.closed = True


def test_a_failing_runner_reaches_the_consumer_and_the_server_recovers(engine: SpeculativeEngine) -> None:
    runner = FailingRunner(engine)
    server = server_for(runner)

    async def main() -> None:
        with pytest.raises(RuntimeError, match="shard died"):
            await collect(server, [5, 6], GenerationConfig(max_new_tokens=4))
        with pytest.raises(RuntimeError, match="shard died"):  # the slot was released: the next one runs
            await collect(server, [5, 6], GenerationConfig(max_new_tokens=4))

    asyncio.run(main())
    assert runner.closed and server.status()["finished"] == {"error": 2}


def test_merge_chunks() -> None:
    chunks = [StreamChunk("ab", [1, 2]), StreamChunk("", []), StreamChunk("c", [3])]
    merged = merge_chunks(chunks)
    assert (merged.text, merged.token_ids, merged.result) == ("abc", [1, 2, 3], None)
    assert merge_chunks(chunks[:1]) is chunks[0]
