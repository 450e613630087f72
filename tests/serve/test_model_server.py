"""ModelServer without Serve: in-process engines behind it, driven by asyncio as Serve would drive it.

One at a time (the in-process engine): the streamed chunks add up to the engine's own answer,
requests queue and all complete, closing a stream early stops its generation (finish reason
``cancelled``), a runner failure reaches the consumer while the server keeps serving, and the queue
is bounded (``QueueFull``). Batched (a real ``BatchedEngine`` on the tiny llama pair): concurrent
requests each equal the request alone, the replica holds at most ``max_num_seqs + max_queue``
requests and refuses one more with ``QueueFull`` and a retry delay, cancelled requests free their
KV slots, and a batched configuration refuses a runner that cannot batch.
"""

from __future__ import annotations

import asyncio
import queue
from collections.abc import AsyncIterator, Iterator

import pytest
from conftest import TinyPair

from specserve.core.batch_engine import BatchedEngine
from specserve.core.engine import GenerationFrontend, SpeculativeEngine
from specserve.core.kv.prefix_cache import CacheStats
from specserve.core.request import GenerationConfig, StreamChunk
from specserve.core.sampling.params import SamplingParams
from specserve.drafters.registry import build_drafter_set, request_drafters
from specserve.serve.config import ServeConfig
from specserve.serve.model_server import ModelServer, QueueFull, merge_chunks

CONFIG = ServeConfig(model_name="tiny", gamma=3, max_num_seqs=1)  # the runner path (engines below)
GREEDY = SamplingParams()


LONG = GenerationConfig(max_new_tokens=100, gamma=3, ignore_eos=True)


def server_for(runner: GenerationFrontend, config: ServeConfig = CONFIG) -> ModelServer:
    return ModelServer(config, lambda config: runner)


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
        taken = await anext(stream)  # the replica took it: an empty chunk
        assert (taken.text, taken.token_ids, taken.result) == ("", [], None)
        first = await anext(stream)
        assert first.token_ids and first.result is None  # generating
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


class CachingRunner(SpeculativeEngine):
    """An engine standing in for the distributed runtime, whose prefix cache lives on rank 0."""

    def prefix_cache_stats(self) -> dict[str, int]:
        return CacheStats(lookups=3, hits=2, hit_tokens=40).as_dict()


def test_a_runner_with_a_prefix_cache_elsewhere_reports_it_in_status(pair: TinyPair) -> None:
    runner = CachingRunner(pair.target, build_drafter_set(pair.draft, pair.target))
    server = server_for(runner)
    asyncio.run(collect(server, runner.encode("abcab"), GenerationConfig(max_new_tokens=4, gamma=2)))
    assert server.status()["prefix_cache"] == runner.prefix_cache_stats()


def test_merge_chunks() -> None:
    chunks = [StreamChunk("ab", [1, 2]), StreamChunk("", []), StreamChunk("c", [3])]
    merged = merge_chunks(chunks)
    assert (merged.text, merged.token_ids, merged.result) == ("abc", [1, 2, 3], None)
    assert merge_chunks(chunks[:1]) is chunks[0]


async def generating(stream: AsyncIterator[StreamChunk]) -> StreamChunk:
    """Read a stream until its first tokens."""
    chunk = await anext(stream)
    while not chunk.token_ids:
        chunk = await anext(stream)
    return chunk


def test_one_at_a_time_the_queue_is_bounded(engine: SpeculativeEngine) -> None:
    server = server_for(engine, ServeConfig(model_name="tiny", gamma=3, max_queue=1, max_num_seqs=1))
    prompt = engine.encode("abcab")

    async def main() -> None:
        running = server.generate(prompt, GREEDY, LONG)
        await generating(running)
        waiting = server.generate(prompt, GREEDY, LONG)
        await anext(waiting)  # taken, waiting for the one generation slot
        assert (server.status()["running"], server.status()["waiting"]) == (1, 1)
        with pytest.raises(QueueFull, match=r"\(1 at once \+ max_queue 1\)") as refused:
            await anext(server.generate(prompt, GREEDY, LONG))
        assert refused.value.retry_after_s >= 1
        await running.aclose()
        await waiting.aclose()
        assert (await collect(server, prompt, GenerationConfig(max_new_tokens=6, gamma=3)))[-1].result is not None

    asyncio.run(main())
    assert server.status()["finished"] == {"queue_full": 1, "cancelled": 2, "length": 1}


class EnginePool(GenerationFrontend):
    """In-process engines behind one runner that takes as many requests at once, as a batching distributed runtime
    does (logic under test: the server runs up to a runner's ``max_concurrency`` requests, never more)."""

    def __init__(self, engines: list[SpeculativeEngine]) -> None:
        self.prompts = engines[0].prompts
        self.max_concurrency = len(engines)
        self._free: queue.SimpleQueue[SpeculativeEngine] = queue.SimpleQueue()
        for engine in engines:
            self._free.put(engine)

    def _run(self, prompt_ids: list[int], params: SamplingParams, config: GenerationConfig) -> Iterator[StreamChunk]:
        engine = self._free.get_nowait()  # raises if the server ran more requests at once than declared
        try:
            yield from engine.stream(prompt_ids, params, config)
        finally:
            self._free.put(engine)


def test_a_runner_that_takes_several_requests_gets_that_many_at_once(pair: TinyPair) -> None:
    engines = [SpeculativeEngine(pair.target, build_drafter_set(pair.draft, pair.target)) for _ in range(2)]
    server = server_for(EnginePool(engines), ServeConfig(model_name="tiny", gamma=3, max_queue=1, max_num_seqs=1))
    assert (server.path, server.at_once, server.capacity) == ("concurrent", 2, 3)
    prompts = [engines[0].encode(text) for text in ("abcab", "hello", "xyzxyz")]
    config = GenerationConfig(max_new_tokens=14, gamma=3)

    async def main() -> list[list[StreamChunk]]:
        streams = [server.generate(p, GREEDY, LONG) for p in prompts]
        for stream in streams[:2]:
            await generating(stream)  # both generate at once
        await anext(streams[2])  # taken, waiting
        assert (server.status()["running"], server.status()["waiting"]) == (2, 1)
        with pytest.raises(QueueFull, match=r"\(2 at once \+ max_queue 1\)"):
            await anext(server.generate(prompts[0], GREEDY, LONG))
        for stream in streams:
            await stream.aclose()
        return list(await asyncio.gather(*(collect(server, p, config) for p in prompts)))

    for prompt, chunks in zip(prompts, asyncio.run(main()), strict=True):
        assert [t for c in chunks for t in c.token_ids] == engines[0].generate(prompt, GREEDY, config).output_ids
    assert server.status()["finished"]["cancelled"] == 3


@pytest.fixture()
def batched_server(tiny_pairs: dict[str, TinyPair]) -> Iterator[tuple[ModelServer, TinyPair]]:
    llama = tiny_pairs["llama"]
    config = ServeConfig(model_name="tiny", gamma=3, max_num_seqs=2, max_queue=1, max_seq_len=120)
    drafters = request_drafters(llama.draft, llama.target, max_num_seqs=2, max_seq_len=120)  # drafting together
    engine = BatchedEngine(llama.target, drafters, max_num_seqs=2, max_seq_len=120)
    server = server_for(engine, config)
    yield server, llama
    server.shutdown()


def test_batched_requests_equal_themselves_alone_and_the_queue_is_bounded(
    batched_server: tuple[ModelServer, TinyPair],
) -> None:
    server, llama = batched_server
    assert server.status()["path"] == "batched" and "batched" in server.path_description()
    alone = SpeculativeEngine(llama.target, build_drafter_set(llama.draft, llama.target))
    prompts = [list(p) for p in (llama.prompts[0], llama.length_prompts[0], llama.eos_prompts[0])]
    config = GenerationConfig(max_new_tokens=20, gamma=3)

    async def main() -> list[list[StreamChunk]]:
        # three concurrent requests: two generate, one waits its turn (max_queue 1)
        answers = await asyncio.gather(*(collect(server, p, config) for p in prompts))
        long = [server.generate(p, GREEDY, LONG) for p in prompts]
        for stream in long[:2]:
            await generating(stream)
        await anext(long[2])  # taken: waiting
        status = server.status()
        reserved = sum(len(p) + LONG.max_new_tokens for p in prompts[:2])  # the two generating: prompt + output
        assert (status["running"], status["waiting"]) == (2, 1)
        # free: not held by a running request (the prefix cache's entries of the first three are free to evict)
        assert (status["kv"]["tokens"], status["kv"]["free"]) == (240, 240 - reserved)
        full = r"it holds 3 requests.*\(max_num_seqs 2 \+ max_queue 1\): 2 generating, 1 waiting"
        with pytest.raises(QueueFull, match=full):
            await anext(server.generate(prompts[0], GREEDY, LONG))
        for stream in long:
            await stream.aclose()
        deadline = asyncio.get_running_loop().time() + 20
        while server.status()["kv"]["free"] != 240 or server.status()["active_requests"]:
            assert asyncio.get_running_loop().time() < deadline, server.status()
            await asyncio.sleep(0.01)
        return list(answers)

    for prompt, chunks in zip(prompts, asyncio.run(main()), strict=True):
        want = alone.generate(prompt, GREEDY, config)
        assert [t for c in chunks for t in c.token_ids] == want.output_ids
        assert "".join(c.text for c in chunks) == want.text
    status = server.status()
    assert max(status["batch_sizes"]) == 2 and (status["running"], status["waiting"]) == (0, 0)
    assert status["finished"]["cancelled"] == 3 and status["finished"]["queue_full"] == 1


def test_a_batched_config_needs_a_runner_that_batches(engine: SpeculativeEngine) -> None:
    with pytest.raises(TypeError, match="max_num_seqs 2 needs a batched engine"):
        server_for(engine, ServeConfig(model_name="tiny", max_num_seqs=2))
