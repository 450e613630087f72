"""``ModelServer``: one target replica as Serve sees it — requests admitted up to a bound, generated, streamed.

A plain class. Serve wraps it as the autoscaled deployment (:mod:`specserve.serve.app`); each
Serve replica builds its runner through the injected ``runner_factory`` (by default
:func:`build_runner`). Tests inject an in-process engine instead. A replica takes one of two paths,
chosen by its configuration, logged when it starts and reported by :meth:`ModelServer.status`:

* **batched in process** (``max_num_seqs > 1``, serve's default, and nothing only the distributed runtime does:
  ``tp_degree`` 1, no overlap, drafter colocated —
  :attr:`~specserve.cluster.replica_config.ReplicaConfig.batches_in_process`): the runner is a
  :class:`~specserve.core.batch_engine.BatchedEngine` built in this process
  (:func:`load_batched_engine`: the target, every request's own drafter, the policies' schedules),
  driven by an :class:`~specserve.serve.engine_loop.EngineLoop` on one dedicated thread. Up to
  ``max_num_seqs`` requests generate together, one target forward per step; there is no lock, and
  each request streams as its tokens are committed. A request whose prompt and output cannot fit
  the KV slot is refused (the ingress refuses it first, with the loop's codec). Closing a stream
  cancels the request at the next step and frees its KV slot.
* **a runner** (otherwise; with ``max_num_seqs`` 1 this is the one-at-a-time baseline): by default a
  :class:`~specserve.actors.coordinator.Coordinator` (:func:`spawn_coordinator`) over the replica's
  target shards and drafter placed as Ray actors, so drafters scale with their replicas. The runner
  is synchronous; it generates one request at a time unless it says it takes more
  (``max_concurrency``, as a distributed runtime that batches does). Requests wait their turn on
  :class:`~specserve.serve.slots.PrioritySlots` of that size (a request resumed from a lost replica,
  whose client is mid-stream, first), and each chosen one runs on a worker thread; chunks cross to
  the event loop through a queue (piled-up chunks are merged). When the consumer goes away, the
  generation is closed on its own thread: the coordinator cancels the drafter and frees the
  request's KV on every shard before the next request is admitted.

Either way the replica holds at most ``at_once + max_queue`` requests (generating + waiting;
``at_once`` is ``max_num_seqs`` on the batched path, the runner's concurrency otherwise); one more
is refused at once with :class:`QueueFull`, which the ingress answers with HTTP 429 and
``Retry-After``. Every stream first yields an empty chunk once the replica has taken the request
(on the batched path: once the engine accepted it), so the ingress knows before answering whether
the request was refused.

A replica whose runner loses its target (:class:`~specserve.core.errors.ReplicaLost`: a shard died or
froze) remembers it: its health check fails from then on, so Serve replaces it, and it refuses every
new request at once with ``ReplicaLost``, which the ingress resumes on a healthy replica. It shuts the
runner down at once (its live actors and their resources), so that the replacement can be placed
without waiting for Serve to stop this replica; a Serve replica (``exit_when_lost``) then ends its own
actor, which Serve replaces at its next health check (a failing check must fail three times in a row). Given a
:class:`~specserve.core.resume.Resume`, :meth:`ModelServer.generate` continues a request another replica
lost, streaming only what its client lacks. Metrics (:class:`~specserve.serve.metrics.ServeMetrics`): per request, per
chunk (time to first token, inter-token latency), and on the batched path per engine step (batch size, tokens
committed). Every finished request also feeds the drift monitor (:mod:`specserve.policies.drift`) and is offered to
the shadow checks (:mod:`specserve.serve.shadow`), which re-decode a sample plainly while the replica is idle.

Does not: parse HTTP or OpenAI requests (the ingress does), place actors itself (the coordinator
does), or decide how a distributed runtime batches (its coordinator does).
"""

from __future__ import annotations

import asyncio
import logging
import math
import os
import threading
import time
from collections import Counter
from collections.abc import AsyncGenerator, AsyncIterator, Callable, Mapping
from concurrent.futures import ThreadPoolExecutor
from contextlib import aclosing
from dataclasses import asdict
from typing import Any

from specserve.cluster.replica_config import InvalidSetting
from specserve.core.draft.spec_strings import drafter_kind
from specserve.core.engine import GenerationFrontend
from specserve.core.errors import ReplicaLost, UserError
from specserve.core.kv.prefix_cache import CacheStats
from specserve.core.prompts import PromptCodec
from specserve.core.request import GenerationConfig, StreamChunk
from specserve.core.resume import Resume, ResumedOutput, continuation
from specserve.core.sampling.params import SamplingParams
from specserve.core.shadow import ShadowJob
from specserve.core.stats import RequestStats
from specserve.policies.drift import DriftMonitor
from specserve.serve.config import ServeConfig
from specserve.serve.engine_loop import BatchEngine, EngineLoop, merge_chunks
from specserve.serve.metrics import ServeMetrics
from specserve.serve.shadow import ShadowChecks
from specserve.serve.slots import PrioritySlots

__all__ = ["ModelServer", "QueueFull", "build_runner", "load_batched_engine", "merge_chunks", "spawn_coordinator"]

logger = logging.getLogger("ray.serve")  # Serve writes this logger to the replica's log

RunnerFactory = Callable[[ServeConfig], GenerationFrontend]
MAX_RETRY_AFTER_S = 60
EXIT_GRACE_S = 0.5  # a lost Serve replica ends its actor this long after releasing its runner
# who takes a freed generation slot first: a resumed request's client is mid-stream; a shadow check goes last
RESUMED, FRESH, SHADOW = 0, 1, 2


class QueueFull(Exception):
    """The replica holds as many requests as it may (``at_once + max_queue``); retry after ``retry_after_s``."""

    def __init__(self, message: str, retry_after_s: int) -> None:
        super().__init__(message)
        self.message = message
        self.retry_after_s = retry_after_s

    def __reduce__(self) -> tuple[Any, ...]:  # crosses Ray by pickle: keep both arguments
        return (type(self), (self.message, self.retry_after_s))


def spawn_coordinator(config: ServeConfig) -> GenerationFrontend:
    """The distributed runner: a :class:`~specserve.actors.coordinator.Coordinator` over a replica (target shards +
    drafter) it places on the cluster; it generates up to ``max_num_seqs`` requests at once (its ``max_concurrency``),
    batching their verification when that is more than one."""
    from specserve.actors.coordinator import Coordinator

    return Coordinator.spawn(config.replica())


def load_batched_engine(config: ServeConfig) -> GenerationFrontend:
    """The batched runner, in this process: the target loaded here (``threads_per_shard`` torch threads), a drafter
    per request (:func:`~specserve.drafters.registry.request_drafters`: a draft model loaded once, drafting for all
    requests in shared forwards), the policies' schedules (adaptive budgets priced per step)."""
    import torch

    from specserve.core.batch_engine import BatchedEngine
    from specserve.core.model.causal_lm import CausalLM
    from specserve.drafters.registry import request_drafters
    from specserve.policies.schedules import schedules

    torch.set_num_threads(config.threads_per_shard)
    target = CausalLM.load(config.target, dtype=config.dtype, device=config.device)
    context = target.info.max_positions
    if config.max_seq_len > context:
        raise InvalidSetting(
            f"max_seq_len {config.max_seq_len} exceeds the target's context of {context} tokens; "
            f"set at most {context}, or 0 for the whole context"
        )
    seqs, length = config.max_num_seqs, config.max_seq_len or context
    # a draft model drafts for all requests in shared forwards, from a KV pool that holds max_num_seqs requests
    suffix_cache = None
    if config.suffix_store == "cluster":  # the suffix drafters' outputs shared with the other replicas
        from specserve.actors.suffix_store import SharedSuffixCache

        suffix_cache = SharedSuffixCache()
    static = config.static_options()
    new_drafter = request_drafters(
        config.draft,
        target,
        **config.drafter_options(),
        max_num_seqs=seqs,
        max_seq_len=length,
        suffix_cache=suffix_cache,
        static=static,
    )
    buckets = None if static is None else static.buckets_for(target.device.type)
    return BatchedEngine(
        target,
        new_drafter,
        schedules=schedules(buckets=buckets),
        max_num_seqs=seqs,
        max_seq_len=length,
        prefill_tokens=config.max_batch_tokens,
        kv_pool_tokens=config.kv_pool_tokens or None,
        static=static,
        kv_memory_fraction=config.kv_cache_memory,
        prefix_caching=not config.no_prefix_cache,
    )


def build_runner(config: ServeConfig) -> GenerationFrontend:
    """The runner of a Serve replica: the in-process batched engine when the configuration batches and needs nothing
    only the distributed runtime does (:attr:`~specserve.cluster.replica_config.ReplicaConfig.batches_in_process`),
    else the distributed runtime."""
    return load_batched_engine(config) if config.batches_in_process else spawn_coordinator(config)


class _End:
    pass


class _Failure:
    def __init__(self, error: BaseException) -> None:
        self.error = error


class ModelServer:
    def __init__(
        self,
        config: ServeConfig | Mapping[str, Any],
        runner_factory: RunnerFactory = build_runner,
        record_metrics: bool = False,
        exit_when_lost: bool = False,
    ) -> None:
        self.started = int(time.time())  # Unix time: GET /v1/models reports it as the model's `created`
        self.config = ServeConfig.model_validate(config)
        self.runner = runner_factory(self.config)
        self.metrics = ServeMetrics(self.config.model_name) if record_metrics else None
        self.loop: EngineLoop | None = None
        if self.config.batches_in_process:
            if not isinstance(self.runner, BatchEngine):
                raise TypeError(
                    f"max_num_seqs {self.config.max_num_seqs} needs a batched engine (submit/step/cancel), "
                    f"got a {type(self.runner).__name__}"
                )
            self.loop = EngineLoop(self.runner, on_step=self._on_step)
            self.at_once = self.config.max_num_seqs
        else:  # a runner that is not the in-process batched engine says how many requests it takes at once
            self.at_once = max(1, int(getattr(self.runner, "max_concurrency", 1)))
        self.capacity = self.at_once + self.config.max_queue
        self._slot = PrioritySlots(self.at_once)  # a resumed request (its client mid-stream) goes first
        self._worker = ThreadPoolExecutor(max_workers=self.at_once, thread_name_prefix="specserve-generation")
        self._held = 0  # requests taken and not finished (generating or waiting)
        self._running = 0  # runner path: generating
        self._finished: Counter[str] = Counter()  # stop, length, eos, cancelled, error, invalid, queue_full
        self._seconds_per_request = 0.0  # moving average of a finished request's time here (for Retry-After)
        self.lost: ReplicaLost | None = None  # set when the runner lost its target: every request fails fast after
        self._release_lock = threading.Lock()
        self._released = False  # the runner was shut down
        self.exit_when_lost = exit_when_lost  # a Serve replica: end its actor once the lost runner is released
        self.shadow = self._shadow_checks()
        self.drift = DriftMonitor()  # acceptance by drafter and position, change points, measured speedup
        logger.info("ModelServer %r: %s", self.config.model_name, self.path_description())

    def _shadow_checks(self) -> ShadowChecks | None:
        c = self.config
        if c.shadow_fraction <= 0:
            return None
        import tempfile

        import torch

        context = {
            "model": c.model_name,
            "target": c.target,
            "draft": c.draft,
            "dtype": c.dtype,
            "device": c.device,
            "path": self.path,
            "replica": c.replica().model_dump(mode="json"),
        }
        return ShadowChecks(
            c.shadow_fraction,
            run=lambda prompt, params, generation: self._chunks(prompt, params, generation, SHADOW),
            busy=lambda: self._held > 0,
            directory=c.shadow_dir or os.path.join(tempfile.gettempdir(), "specserve-shadow"),
            context=context,
            vocab=self.describe().info.vocab_size,
            dtype=getattr(torch, c.dtype),
            metrics=self.metrics,
            on_plain=lambda stats: self._watch("none", stats),  # the drift monitor learns plain steps' cost
        )

    def drafter_tag(self, generation: GenerationConfig) -> str:
        """Who drafted a request, as the metrics name it: ``none`` (speculation off), the request's own drafter, or
        the kind of the replica's configured one (:func:`~specserve.core.draft.spec_strings.drafter_kind`)."""
        if generation.gamma == 0 and generation.tree is None:
            return "none"
        return generation.drafter if generation.drafter != "default" else drafter_kind(self.config.draft)

    @property
    def path(self) -> str:
        """``batched`` (the in-process batched engine), ``one_at_a_time``, or ``concurrent`` (a runner taking more)."""
        if self.loop is not None:
            return "batched"
        return "one_at_a_time" if self.at_once == 1 else "concurrent"

    def path_description(self) -> str:
        c, runner = self.config, type(self.runner).__name__
        if self.loop is not None:
            return (
                f"batched: up to {c.max_num_seqs} requests at once in this process (one target forward per step, "
                f"{c.max_batch_tokens} prefill tokens per step), {c.max_queue} more may wait"
            )
        if self.at_once == 1:
            return f"one request at a time on a {runner}, {c.max_queue} more may wait"
        return f"up to {self.at_once} requests at once on a {runner}, {c.max_queue} more may wait"

    def describe(self) -> PromptCodec:
        """How prompts are encoded and checked for this model (the ingress validates requests with it)."""
        return self.loop.prompts if self.loop is not None else self.runner.prompts

    def started_at(self) -> int:
        """The Unix time this replica started (the ``created`` of the model in ``GET /v1/models``)."""
        return self.started

    def status(self) -> dict[str, Any]:
        out: dict[str, Any] = {
            "path": self.path,
            "waiting": self.waiting,
            "running": self.running,
            "at_once": self.at_once,
            "capacity": self.capacity,
            "finished": dict(self._finished),
        }
        if self.shadow is not None:
            out["shadow"] = self.shadow.status()
        out["drafters"] = {name: asdict(self.drift.view(name)) for name in self.drift.drafters}
        if self.loop is not None:
            loop = self.loop.status()
            keys = ("kv", "prefix_cache", "steps", "failed_steps", "failed_requests", "batch_sizes", "active_requests")
            for key in keys:
                out[key] = loop[key]
        else:
            active = getattr(self.runner, "active_requests", None)
            if active is not None:
                out["active_requests"] = active()
            cache_stats = getattr(self.runner, "prefix_cache_stats", None)  # the distributed runtime's rank 0
            if cache_stats is not None:
                out["prefix_cache"] = cache_stats()
            pool_load = getattr(self.runner, "drafter_pool_load", None)  # the runtime's drafter pool, if it joined one
            if pool_load is not None and (load := pool_load()) is not None:
                out["drafter_pool"] = load
        processes = getattr(self.runner, "processes", None)  # the distributed runtime's actors
        out["processes"] = processes() if processes is not None else {"engine": os.getpid()}
        return out

    @property
    def running(self) -> int:
        return min(self.loop.running, self._held) if self.loop is not None else self._running

    @property
    def waiting(self) -> int:
        """Taken and not generating yet (waiting for the lock, or for a KV slot)."""
        return max(0, self._held - self.running)

    def check_health(self) -> None:
        """Serve's periodic health check: raises when the replica's actors are gone, or its engine loop is broken."""
        if self.lost is not None:
            raise self.lost
        if self.loop is not None:
            self.loop.check_health()
        check = getattr(self.runner, "check_health", None)
        if check is not None:
            try:
                check()
            except ReplicaLost as exc:
                self._lose(exc)
                raise

    def _lose(self, exc: ReplicaLost) -> None:
        """The runner lost its target: fail fast from now on, and release what is left of it (its live actors and
        their resources) at once, on a thread, so that the replica Serve starts in its place can be placed."""
        with self._release_lock:
            if self.lost is not None:
                return
            self.lost = exc
        logger.error("the replica lost its target; it fails fast until Serve replaces it: %s", exc)
        threading.Thread(target=self._release_runner, name="specserve-release", daemon=True).start()

    def _release_runner(self) -> None:
        with self._release_lock:
            if self._released:
                return
            self._released = True
        shutdown = getattr(self.runner, "shutdown", None)
        if shutdown is not None:
            try:
                shutdown()
            except Exception:
                logger.exception("releasing the lost runner failed")
        if self.exit_when_lost and self.lost is not None:
            self._exit_actor()

    def _exit_actor(self) -> None:
        """End this Serve replica's actor: Serve sees a crashed replica at its next health check and replaces it at
        once (a failing check must fail three times in a row first). Its in-flight requests already failed."""
        import ray

        time.sleep(EXIT_GRACE_S)  # the in-flight requests' errors reach the ingress first
        logger.error("the replica lost its target: ending its actor so that Serve replaces it now")
        ray.kill(ray.get_runtime_context().current_actor, no_restart=True)

    def shutdown(self) -> None:
        if self.loop is not None:
            self.loop.shutdown()
        self._worker.shutdown(wait=False, cancel_futures=True)
        self._release_runner()

    def __del__(self) -> None:  # Serve calls it when it stops a replica (downscaling, redeploy)
        if hasattr(self, "_released"):  # built whole
            self.shutdown()

    # -----------------------------------------------------------------------------------------

    async def generate(
        self,
        prompt_ids: list[int],
        params: SamplingParams,
        generation: GenerationConfig,
        resume: Resume | None = None,
    ) -> AsyncIterator[StreamChunk]:
        """Stream one request's chunks: first an empty one once the replica took it, the last with the result.
        Raises :class:`QueueFull` when the replica is full; stops (and frees KV) if closed early. With ``resume``
        it continues a request another replica lost (:mod:`specserve.core.resume`): only what the client lacks
        is streamed. Raises :class:`~specserve.core.errors.ReplicaLost` once its target is gone."""
        arrived = time.perf_counter()
        if self.lost is not None:
            raise ReplicaLost(f"this replica lost its target earlier and serves no more requests: {self.lost}")
        if self._held >= self.capacity:
            self._count("queue_full", params)
            raise self._queue_full()
        self._held += 1
        self._report_queue()
        finish = "cancelled"
        first = True
        last_tokens = arrived  # when the previous chunk with tokens arrived
        chunks = (
            self._chunks(prompt_ids, params, generation)
            if resume is None
            else self._resumed(prompt_ids, params, generation, resume)
        )
        try:
            async with aclosing(chunks):
                async for chunk in chunks:
                    if chunk.token_ids and self.metrics is not None:
                        now = time.perf_counter()
                        if first:
                            self.metrics.first_token(now - arrived, params.lossy_acceptance)
                            first = False
                        else:
                            self.metrics.inter_token(now - last_tokens, len(chunk.token_ids), params.lossy_acceptance)
                        last_tokens = now
                    if chunk.result is not None:
                        finish = chunk.result.finish_reason
                        if self.metrics is not None:
                            self.metrics.finished(finish, chunk.result.stats, params.lossy_acceptance)
                        self._learn(time.perf_counter() - arrived)
                        self._watch(self.drafter_tag(generation), chunk.result.stats)
                        if self.shadow is not None and resume is None:  # a resumed output is two replicas' work
                            self.shadow.offer(
                                ShadowJob(prompt_ids, params, generation, chunk.result.output_ids, finish,
                                          self.drafter_tag(generation))
                            )  # fmt: skip
                    yield chunk
        except UserError:
            finish = "invalid"
            raise
        except ReplicaLost as exc:
            finish = "error"
            self._lose(exc)
            raise
        except Exception:
            finish = "error"
            raise
        finally:
            self._held -= 1
            if finish in ("cancelled", "error", "invalid"):
                self._count(finish, params)
            else:
                self._finished[finish] += 1
            self._report_queue()

    def _chunks(
        self, prompt_ids: list[int], params: SamplingParams, generation: GenerationConfig, priority: int = FRESH
    ) -> AsyncGenerator[StreamChunk, None]:
        if self.loop is not None:
            return self.loop.stream(prompt_ids, params, generation)
        return self._on_runner(prompt_ids, params, generation, priority)

    async def _resumed(
        self, prompt_ids: list[int], params: SamplingParams, generation: GenerationConfig, resume: Resume
    ) -> AsyncGenerator[StreamChunk, None]:
        """The continuation of ``resume``, mapped onto the original request; closed early when a stop string in the
        whole text ends the request first."""
        logprobs = params.logprobs is not None
        output = ResumedOutput(prompt_ids, resume, self.describe().decode, generation.stop, logprobs)
        if len(resume.output_ids) >= generation.max_new_tokens:  # every token is out; only the result was lost
            yield output.map(StreamChunk("", []))
            yield output.finish("length")
            return
        resumed = self._chunks(*continuation(prompt_ids, params, generation, resume), priority=RESUMED)
        async with aclosing(resumed) as chunks:
            async for chunk in chunks:
                yield output.map(chunk)
                if output.finished:
                    return

    async def _on_runner(
        self, prompt_ids: list[int], params: SamplingParams, generation: GenerationConfig, priority: int = FRESH
    ) -> AsyncGenerator[StreamChunk, None]:
        yield StreamChunk("", [])  # taken: it waits its turn here
        await self._slot.acquire(priority)
        live = priority != SHADOW  # a shadow check is not a request: the gauges do not count it
        try:
            self._running += live
            self._report_queue()
            async with aclosing(self._run_on_worker(prompt_ids, params, generation)) as chunks:
                async for chunk in chunks:
                    yield chunk
        finally:
            self._running -= live
            self._slot.release()

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
                    self._report_cache()
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

    # -----------------------------------------------------------------------------------------

    def _queue_full(self) -> QueueFull:
        c = self.config
        retry = self.retry_after_s()
        bound = f"max_num_seqs {self.at_once}" if self.loop is not None else f"{self.at_once} at once"
        return QueueFull(
            f"this replica is full: it holds {self.running + self.waiting} requests, the most it may ({bound} + "
            f"max_queue {c.max_queue}): {self.running} generating, {self.waiting} waiting for their turn; retry after "
            f"{retry} s",
            retry,
        )

    def retry_after_s(self) -> int:
        """Seconds until a place is likely free: a request's average time here over the requests generated at once."""
        if self._seconds_per_request <= 0:
            return 1
        return max(1, min(MAX_RETRY_AFTER_S, math.ceil(self._seconds_per_request / self.at_once)))

    def _learn(self, seconds: float) -> None:
        average = self._seconds_per_request
        self._seconds_per_request = seconds if average <= 0 else 0.8 * average + 0.2 * seconds

    def _count(self, finish: str, params: SamplingParams) -> None:
        """A request that ended without a result (cancelled, failed, refused)."""
        self._finished[finish] += 1
        if self.metrics is not None:
            self.metrics.finished(finish, None, params.lossy_acceptance)

    def _on_step(self, batch_size: int, tokens: int) -> None:  # on the engine thread
        if self.metrics is not None:
            self.metrics.step(batch_size, tokens)
            self._report_queue()
            cache = getattr(self.runner, "cache", None)
            if cache is not None:
                self.metrics.prefix_cache(cache.stats)

    def _report_cache(self) -> None:  # on a worker thread, after a request of a runner with a prefix cache elsewhere
        cache_stats = getattr(self.runner, "prefix_cache_stats", None)
        if self.metrics is None or cache_stats is None:
            return
        try:
            stats = cache_stats()
        except Exception:  # the metrics can wait for the next request; the request itself went fine
            logger.debug("could not read the prefix cache's counters", exc_info=True)
            return
        if stats is not None:
            self.metrics.prefix_cache(CacheStats(**stats))

    def _watch(self, drafter: str, stats: RequestStats) -> None:
        """A finished request's cycles into the drift monitor; its events and its drafter's state to the metrics."""
        try:
            events = self.drift.observe(drafter, stats.observations)
        except Exception:  # monitoring must never fail a request
            logger.exception("the drift monitor failed")
            return
        for event in events:
            logger.warning(
                "acceptance drift (%s) for drafter %s at draft position %d: per-request mean %.3f before, %.3f now "
                "(%d requests since the reference was set)",
                event.direction, drafter, event.position, event.reference, event.rate, event.requests,
            )  # fmt: skip
            if self.metrics is not None:
                self.metrics.drift(drafter, event.position, event.direction)
        if self.metrics is not None and drafter != "none":
            view = self.drift.view(drafter)
            self.metrics.acceptance(drafter, view.rates, view.budget, view.speedup)
            self.metrics.policy(drafter, stats.policy)

    def _report_queue(self) -> None:
        if self.metrics is not None:
            self.metrics.queue(self.waiting, self.running)
