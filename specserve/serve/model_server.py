"""``ModelServer``: one target replica as Serve sees it — a runner, one generation at a time, streamed.

A plain class. Serve wraps it as the autoscaled deployment (:mod:`specserve.serve.app`); each
Serve replica builds its runner through the injected ``runner_factory``: by default
:func:`spawn_coordinator`, which places the replica's target shards and its drafter
(:class:`~specserve.actors.coordinator.Coordinator`), so drafters scale with their replicas.
Tests inject the in-process engine instead.

The runner is synchronous and serves one request at a time, so requests wait their turn on an
``asyncio.Lock`` (the queue that the ``specserve_queue_length`` metric shows) and the chosen one
runs on a dedicated worker thread. Chunks cross to the event loop through a queue; chunks that
piled up while the consumer was busy are merged, so a slow client costs one message, not many.
When the consumer goes away (the client disconnected, the ingress cancelled), the generation is
closed on its own thread: the coordinator cancels the drafter and frees the request's KV on
every shard before the next request is admitted.

Does not: parse HTTP or OpenAI requests (the ingress does), or batch requests together.
"""

from __future__ import annotations

import asyncio
import threading
import time
from collections import Counter
from collections.abc import AsyncGenerator, AsyncIterator, Callable, Mapping
from concurrent.futures import ThreadPoolExecutor
from contextlib import aclosing
from typing import Any

from specserve.core.engine import GenerationConfig, GenerationFrontend, StreamChunk
from specserve.core.prompts import PromptCodec
from specserve.core.sampling import SamplingParams
from specserve.serve.config import ServeConfig
from specserve.serve.metrics import ServeMetrics

RunnerFactory = Callable[[ServeConfig], GenerationFrontend]


def spawn_coordinator(config: ServeConfig) -> GenerationFrontend:
    """The default runner: a distributed replica (target shards + drafter) placed on the cluster."""
    from specserve.actors.coordinator import Coordinator

    return Coordinator.spawn(config.replica())


class _End:
    pass


class _Failure:
    def __init__(self, error: BaseException) -> None:
        self.error = error


def merge_chunks(chunks: list[StreamChunk]) -> StreamChunk:
    """Several consecutive chunks as one (text and tokens concatenated, the last one's result)."""
    if len(chunks) == 1:
        return chunks[0]
    return StreamChunk("".join(c.text for c in chunks), [t for c in chunks for t in c.token_ids], chunks[-1].result)


class ModelServer:
    def __init__(
        self,
        config: ServeConfig | Mapping[str, Any],
        runner_factory: RunnerFactory = spawn_coordinator,
        record_metrics: bool = False,
    ) -> None:
        self.config = ServeConfig.model_validate(config)
        self.runner = runner_factory(self.config)
        self.metrics = ServeMetrics(self.config.model_name) if record_metrics else None
        self._slot = asyncio.Lock()
        self._worker = ThreadPoolExecutor(max_workers=1, thread_name_prefix="specserve-generation")
        self._waiting = 0
        self._running = 0
        self._finished: Counter[str] = Counter()  # finish reason (stop, length, eos, cancelled, error) -> requests

    def describe(self) -> PromptCodec:
        """How prompts are encoded and checked for this model (the ingress validates requests with it)."""
        return self.runner.prompts

    def status(self) -> dict[str, Any]:
        out: dict[str, Any] = {"waiting": self._waiting, "running": self._running, "finished": dict(self._finished)}
        active = getattr(self.runner, "active_requests", None)
        if active is not None:
            out["active_requests"] = active()
        return out

    def check_health(self) -> None:
        """Serve's periodic health check: raises when the replica's actors are gone."""
        check = getattr(self.runner, "check_health", None)
        if check is not None:
            check()

    def shutdown(self) -> None:
        self._worker.shutdown(wait=False, cancel_futures=True)
        shutdown = getattr(self.runner, "shutdown", None)
        if shutdown is not None:
            shutdown()

    def __del__(self) -> None:  # Serve calls it when it stops a replica (downscaling, redeploy)
        if hasattr(self, "runner"):
            self.shutdown()

    # -----------------------------------------------------------------------------------------

    async def generate(
        self, prompt_ids: list[int], params: SamplingParams, generation: GenerationConfig
    ) -> AsyncIterator[StreamChunk]:
        """Stream one request's chunks; the last carries the result. Stops (and frees KV) if closed early."""
        arrived = time.perf_counter()
        self._waiting += 1
        self._report_queue()
        try:
            await self._slot.acquire()
        finally:
            self._waiting -= 1
        self._running += 1
        self._report_queue()
        finish = "cancelled"
        first = True
        try:
            async with aclosing(self._run_on_worker(prompt_ids, params, generation)) as chunks:
                async for chunk in chunks:
                    if first and chunk.token_ids and self.metrics is not None:
                        self.metrics.first_token(time.perf_counter() - arrived, params.lossy_acceptance)
                        first = False
                    if chunk.result is not None:
                        finish = chunk.result.finish_reason
                        if self.metrics is not None:
                            self.metrics.finished(finish, chunk.result.stats, params.lossy_acceptance)
                    yield chunk
        except Exception:
            finish = "error"
            raise
        finally:
            if finish in ("cancelled", "error") and self.metrics is not None:
                self.metrics.finished(finish, None, params.lossy_acceptance)
            self._running -= 1
            self._finished[finish] += 1
            self._slot.release()
            self._report_queue()

    async def _run_on_worker(
        self, prompt_ids: list[int], params: SamplingParams, generation: GenerationConfig
    ) -> AsyncGenerator[StreamChunk, None]:
        loop = asyncio.get_running_loop()
        queue: asyncio.Queue[StreamChunk | _End | _Failure] = asyncio.Queue()
        stop = threading.Event()

        def put(item: StreamChunk | _End | _Failure) -> None:
            loop.call_soon_threadsafe(queue.put_nowait, item)

        def produce() -> None:
            chunks = None
            try:
                chunks = self.runner.stream(prompt_ids, params, generation)
                for chunk in chunks:
                    put(chunk)
                    if stop.is_set():
                        break
            except BaseException as exc:  # handed to the consumer, which raises it
                put(_Failure(exc))
            finally:
                try:
                    if chunks is not None:
                        chunks.close()  # on this thread: the runner's cleanup (cancel drafting, free KV)
                finally:
                    put(_End())

        worker = loop.run_in_executor(self._worker, produce)
        try:
            while True:
                items = [await queue.get()]
                while not queue.empty():
                    items.append(queue.get_nowait())
                chunks = [item for item in items if isinstance(item, StreamChunk)]
                if chunks:
                    yield merge_chunks(chunks)
                for item in items:
                    if isinstance(item, _Failure):
                        raise item.error
                if isinstance(items[-1], _End):
                    return
        finally:
            stop.set()
            await asyncio.shield(worker)  # the next request starts only after this one's cleanup

    def _report_queue(self) -> None:
        if self.metrics is not None:
            self.metrics.queue(self._waiting, self._running)
