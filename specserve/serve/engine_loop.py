"""``EngineLoop``: a batched engine driven on one dedicated thread, its requests streamed to asyncio callers.

A batched engine (:class:`~specserve.core.batch_engine.BatchedEngine`, or anything with its
``submit`` / ``step`` / ``cancel`` / ``has_work`` / ``num_running``) is not thread-safe, so one
thread owns it and is the only one that touches it. Callers on an event loop call
:meth:`EngineLoop.stream`; their submissions and cancellations go into a thread-safe inbox that the
engine thread empties between steps. Per step, each request's new chunk is handed to that request's
own ``asyncio.Queue`` on its caller's loop; chunks that piled up while the caller was busy are
merged (:func:`merge_chunks`), so a slow consumer costs one message, not many.

* **Accepted, or refused.** A request's stream first yields an empty chunk once the engine has
  accepted it (queued for a KV slot or running); a request the engine refuses raises its
  :class:`~specserve.core.prompts.InvalidRequest` (any :class:`~specserve.core.errors.UserError`)
  from the stream instead, so a caller knows before any text whether the request will run.
* **Cancelled.** Closing a stream early (the client went away) cancels the request at the next
  step boundary: the engine drops it and frees its KV slot.
* **Idle.** With nothing to do the thread sleeps on a condition variable until a request arrives
  (no busy spin).
* **One request's failure.** A request the engine ended alone in a step (its id came with an exception: its
  grammar gave up, its drafter or processors raised, its logits were not finite) fails with that exception, a
  :class:`~specserve.core.errors.UserError` the caller can fix or a
  :class:`~specserve.core.errors.RequestFailed`; the others' chunks of that step are delivered as usual.
* **Failures.** An exception from ``engine.step()`` (a shared forward failed) affects every request in that step.
  Requests that had already streamed tokens fail with :class:`EngineFailure` (the message names the cause);
  requests that had streamed nothing yet (waiting for a slot, or prefilling) are resubmitted once,
  which is exact since nothing of theirs was seen. The loop keeps serving; :meth:`check_health`
  raises after :data:`UNHEALTHY_AFTER` failed steps in a row, or when the thread died, so Serve can
  replace the replica.
* **Shutdown.** :meth:`shutdown` stops and joins the thread; requests still in flight fail with
  :class:`EngineStopped`, and later submissions are refused with it.

:attr:`EngineLoop.prompts` is the codec the ingress validates requests with: the engine's, plus the
KV slot's length when the engine's pool has a shorter slot than the target's context.
:meth:`EngineLoop.status` is a snapshot the engine thread publishes after every iteration
(requests, running, KV slots in use, steps by batch size). Does not: bound the queue (the
:class:`~specserve.serve.model_server.ModelServer` does), build the engine, or talk to Ray.
"""

from __future__ import annotations

import asyncio
import itertools
import logging
import threading
from collections import Counter
from collections.abc import AsyncGenerator, Callable, Sequence
from dataclasses import dataclass, field
from typing import Any, Protocol, runtime_checkable

from specserve.core.errors import InvalidRequest, UserError
from specserve.core.kv.prefix_cache import PrefixCache
from specserve.core.prompts import PromptCodec
from specserve.core.request import GenerationConfig, StreamChunk
from specserve.core.sampling.params import SamplingParams

logger = logging.getLogger(__name__)

UNHEALTHY_AFTER = 3  # failed steps in a row after which check_health raises


@runtime_checkable
class BatchEngine(Protocol):
    """What the loop drives: :class:`~specserve.core.batch_engine.BatchedEngine`'s request API."""

    prompts: PromptCodec

    def submit(
        self, prompt: str | Sequence[int], params: SamplingParams | None = None, config: GenerationConfig | None = None
    ) -> int: ...

    def step(self) -> list[tuple[int, StreamChunk | Exception]]: ...

    def cancel(self, request_id: int) -> None: ...

    @property
    def has_work(self) -> bool: ...

    @property
    def num_running(self) -> int: ...


class EngineFailure(RuntimeError):
    """The engine raised while it was generating this request; the replica serves on."""


class EngineStopped(RuntimeError):
    """The loop was shut down (or its thread died): the request did not complete."""


class LengthPromptCodec(PromptCodec):
    """The target's codec, checking prompt + ``max_new_tokens`` against a replica's ``max_seq_len`` when that is
    shorter than the context."""

    def __init__(self, codec: PromptCodec, max_seq_len: int) -> None:
        super().__init__(codec.info, codec.tokenizer)
        self.max_seq_len = max_seq_len

    def check_length(self, prompt_ids: Sequence[int], max_new_tokens: int) -> None:
        super().check_length(prompt_ids, max_new_tokens)
        if len(prompt_ids) + max_new_tokens > self.max_seq_len:
            raise InvalidRequest(
                f"prompt ({len(prompt_ids)} tokens) + max_new_tokens ({max_new_tokens}) exceed the "
                f"{self.max_seq_len} tokens one request may hold on this replica (max_seq_len); "
                "shorten the prompt or lower max_tokens"
            )


def merge_chunks(chunks: list[StreamChunk]) -> StreamChunk:
    """Several consecutive chunks as one (text and tokens concatenated, the last one's result)."""
    if len(chunks) == 1:
        return chunks[0]
    tokens = [t for c in chunks for t in c.token_ids]
    logprobs = tuple(lp for c in chunks for lp in c.logprobs)
    return StreamChunk("".join(c.text for c in chunks), tokens, chunks[-1].result, logprobs)


class _Accepted:
    pass


class _Failed:
    def __init__(self, error: BaseException) -> None:
        self.error = error


Item = StreamChunk | _Accepted | _Failed
ACCEPTED = _Accepted()


@dataclass
class _Request:
    """One request as the engine thread tracks it."""

    key: int  # the loop's id (the engine's id changes if the request is resubmitted)
    prompt_ids: list[int]
    params: SamplingParams
    config: GenerationConfig
    put: Callable[[Item], None]  # hands an item to the caller's queue, from any thread
    engine_id: int = -1
    streamed: bool = False  # tokens reached the caller: the request can no longer be restarted
    resubmitted: bool = False


@dataclass
class _Command:
    kind: str  # "submit" or "cancel"
    key: int
    request: _Request | None = None


@dataclass(frozen=True)
class LoopStatus:
    """What the engine thread last published."""

    requests: int = 0  # accepted and not finished (waiting for room, prefilling or decoding)
    running: int = 0  # holding KV
    kv_tokens: int | None = None  # the engine's pool, when it has one: its positions
    kv_tokens_free: int | None = None  # not reserved by a running request (the prefix cache's are free to evict)
    kv_tokens_cached: int | None = None  # held by the prefix cache's retained entries
    prefix_cache: dict[str, int] | None = None  # the prefix cache's counters (PrefixCache.stats), when it is on
    steps: int = 0  # steps that verified at least one request
    failed_steps: int = 0
    failed_requests: int = 0  # ended alone by their own failure (grammar, drafter, processors, non-finite logits)
    batch_sizes: dict[int, int] = field(default_factory=dict)  # requests verified together -> steps
    active_requests: tuple[int, ...] = ()  # the engine's ids of the requests in flight

    def to_dict(self) -> dict[str, Any]:
        return {
            "requests": self.requests,
            "running": self.running,
            "kv": {"tokens": self.kv_tokens, "free": self.kv_tokens_free, "cached": self.kv_tokens_cached},
            "prefix_cache": dict(self.prefix_cache) if self.prefix_cache is not None else None,
            "steps": self.steps,
            "failed_steps": self.failed_steps,
            "failed_requests": self.failed_requests,
            "batch_sizes": dict(self.batch_sizes),
            "active_requests": list(self.active_requests),
        }


StepHook = Callable[[int, int], None]  # (requests verified together, tokens committed) after each step


class EngineLoop:
    """Runs ``engine`` on its own thread; :meth:`stream` submits a request and streams its chunks."""

    def __init__(self, engine: BatchEngine, on_step: StepHook | None = None, name: str = "specserve-engine") -> None:
        self.engine = engine
        self.on_step = on_step
        self._pool = getattr(engine, "pool", None)  # a KVPool: its tokens are reported
        limit = getattr(engine, "max_seq_len", None)  # tokens one request may hold
        codec = engine.prompts
        self.prompts: PromptCodec = (
            LengthPromptCodec(codec, limit) if isinstance(limit, int) and limit < codec.info.max_positions else codec
        )
        self._keys = itertools.count()
        self._wake = threading.Condition()
        self._inbox: list[_Command] = []
        self._closing = False
        self._stopped: BaseException | None = None  # why the loop no longer serves
        # engine thread only
        self._by_key: dict[int, _Request] = {}
        self._by_engine_id: dict[int, _Request] = {}
        self._steps = 0
        self._failed_steps = 0
        self._failed_requests = 0  # ended alone by their own failure in a step
        self._failures_in_a_row = 0
        self._last_failure: BaseException | None = None
        self._batch_sizes: Counter[int] = Counter()
        self._status = LoopStatus()
        self._publish()
        self._thread = threading.Thread(target=self._serve, name=name, daemon=True)
        self._thread.start()

    # -----------------------------------------------------------------------------------------
    # The caller's side (any thread with a running event loop)

    async def stream(
        self, prompt_ids: list[int], params: SamplingParams, config: GenerationConfig
    ) -> AsyncGenerator[StreamChunk, None]:
        """Submit one request and stream it: first an empty chunk once the engine accepted it (or its refusal
        raised), then its chunks, the last one carrying the result. Closing the stream early cancels it."""
        loop = asyncio.get_running_loop()
        queue: asyncio.Queue[Item] = asyncio.Queue()
        key = next(self._keys)

        def put(item: Item) -> None:
            loop.call_soon_threadsafe(queue.put_nowait, item)

        self._post(_Command("submit", key, _Request(key, list(prompt_ids), params, config, put)))
        done = False
        try:
            while True:
                items = [await queue.get()]
                while not queue.empty():
                    items.append(queue.get_nowait())
                chunks = [
                    StreamChunk("", []) if isinstance(item, _Accepted) else item
                    for item in items
                    if not isinstance(item, _Failed)
                ]
                if chunks:
                    merged = merge_chunks(chunks)
                    done = merged.result is not None
                    yield merged
                    if done:
                        return
                for item in items:
                    if isinstance(item, _Failed):
                        done = True  # the engine thread already forgot the request
                        raise item.error
        finally:
            if not done:
                self._post(_Command("cancel", key), quiet=True)

    def status(self) -> dict[str, Any]:
        return self._status.to_dict()

    @property
    def running(self) -> int:
        return self._status.running

    def check_health(self) -> None:
        """Raises when the thread is gone or the engine failed its last :data:`UNHEALTHY_AFTER` steps."""
        if self._stopped is not None or not self._thread.is_alive():
            raise EngineStopped(f"the engine loop is not running: {self._stopped!r}")
        if self._failures_in_a_row >= UNHEALTHY_AFTER:
            raise EngineFailure(
                f"the batched engine failed its last {self._failures_in_a_row} steps; "
                f"last error: {self._last_failure!r}"
            )

    def shutdown(self, timeout_s: float = 30.0) -> None:
        """Stop the thread (requests in flight fail with :class:`EngineStopped`) and wait for it."""
        with self._wake:
            self._closing = True
            self._wake.notify()
        if threading.current_thread() is not self._thread:
            self._thread.join(timeout_s)

    def _post(self, command: _Command, quiet: bool = False) -> None:
        with self._wake:
            if self._closing or self._stopped is not None:
                if quiet:
                    return
                raise EngineStopped(f"the engine loop is not running ({self._stopped or 'shut down'}); retry elsewhere")
            self._inbox.append(command)
            self._wake.notify()

    # -----------------------------------------------------------------------------------------
    # The engine thread

    def _serve(self) -> None:
        reason: BaseException = EngineStopped("the replica is shutting down")
        try:
            while True:
                with self._wake:
                    while not self._inbox and not self._closing and not self.engine.has_work:
                        self._wake.wait()
                    if self._closing:
                        break
                    commands, self._inbox = self._inbox, []
                for command in commands:
                    if command.kind == "submit":
                        assert command.request is not None
                        self._submit(command.request, first=True)
                    else:
                        self._cancel(command.key)
                if self.engine.has_work:
                    self._step()
                self._publish()
        except BaseException as exc:  # a bug in this loop: fail everything rather than hang the callers
            logger.exception("the engine loop stopped")
            reason = EngineStopped(f"the engine loop stopped: {exc!r}")
        finally:
            with self._wake:
                self._stopped = reason
                pending, self._inbox = self._inbox, []
            for command in pending:
                if command.request is not None:
                    self._deliver(command.request, _Failed(reason))
            for request in list(self._by_key.values()):
                try:
                    self.engine.cancel(request.engine_id)  # free its KV
                except Exception:
                    logger.exception("cancelling a request at shutdown failed")
                self._deliver(request, _Failed(reason))
            self._by_key.clear()
            self._by_engine_id.clear()
            self._publish()

    def _submit(self, request: _Request, first: bool) -> None:
        try:
            request.engine_id = self.engine.submit(request.prompt_ids, request.params, request.config)
        except UserError as exc:  # InvalidRequest: the caller's to fix
            self._deliver(request, _Failed(exc))
            return
        except Exception as exc:
            logger.exception("the batched engine could not take a request")
            self._deliver(request, _Failed(EngineFailure(f"the batched engine could not take the request: {exc!r}")))
            return
        self._by_key[request.key] = request
        self._by_engine_id[request.engine_id] = request
        if first:
            self._deliver(request, ACCEPTED)

    def _cancel(self, key: int) -> None:
        request = self._by_key.pop(key, None)
        if request is None:
            return  # already finished (or refused)
        self._by_engine_id.pop(request.engine_id, None)
        try:
            self.engine.cancel(request.engine_id)
        except Exception:  # a broken engine: the next step says so to whoever is left
            logger.exception("cancelling a request failed")

    def _step(self) -> None:
        try:
            results = self.engine.step()
        except Exception as exc:
            self._step_failed(exc)
            return
        self._failures_in_a_row = 0
        tokens = 0
        deliveries: list[tuple[_Request, Item]] = []
        verified = 0
        for engine_id, chunk in results:
            request = self._by_engine_id.get(engine_id)
            if isinstance(chunk, Exception):  # that request's own failure; the engine freed its slot
                self._failed_requests += 1
                if request is not None:
                    self._by_engine_id.pop(engine_id, None)
                    self._by_key.pop(request.key, None)
                    deliveries.append((request, _Failed(chunk)))
                continue
            verified += 1
            tokens += len(chunk.token_ids)
            if request is None:
                continue
            if chunk.token_ids:
                request.streamed = True
            if chunk.result is not None:  # the engine freed its slot
                self._by_engine_id.pop(engine_id, None)
                self._by_key.pop(request.key, None)
            deliveries.append((request, chunk))
        if verified:
            self._steps += 1
            self._batch_sizes[verified] += 1
        self._publish()  # before the callers hear: a finished request is no longer counted when its result arrives
        for request, item in deliveries:
            self._deliver(request, item)
        if verified and self.on_step is not None:
            try:
                self.on_step(verified, tokens)
            except Exception:  # metrics must never stop generation
                logger.exception("the step hook failed")

    def _step_failed(self, exc: Exception) -> None:
        self._failed_steps += 1
        self._failures_in_a_row += 1
        self._last_failure = exc
        logger.error("a batched engine step failed", exc_info=exc)
        requests = list(self._by_key.values())
        self._by_key.clear()
        self._by_engine_id.clear()
        failed = []
        for request in requests:
            try:
                self.engine.cancel(request.engine_id)
            except Exception:
                logger.exception("cancelling a request after a failed step failed")
            if not request.streamed and not request.resubmitted:
                request.resubmitted = True  # nothing of it was seen: starting it again is exact
                self._submit(request, first=False)
            else:
                failed.append(request)
        self._publish()
        for request in failed:
            error = EngineFailure(
                f"the batched engine failed in a step this request was part of: {exc!r}; "
                "the replica keeps serving other requests"
            )
            error.__cause__ = exc
            self._deliver(request, _Failed(error))
        with self._wake:  # back off a little before the next step, so a broken engine does not spin
            if not self._closing:
                self._wake.wait(timeout=min(0.01 * 2**self._failures_in_a_row, 1.0))

    def _deliver(self, request: _Request, item: Item) -> None:
        try:
            request.put(item)
        except RuntimeError:  # the caller's event loop is closed: nobody is listening
            if request.key in self._by_key:
                self._cancel(request.key)

    def _publish(self) -> None:
        pool = self._pool
        cache: PrefixCache | None = getattr(self.engine, "cache", None)
        cached = cache.retained_tokens if cache is not None else 0
        self._status = LoopStatus(
            requests=len(self._by_key),
            running=self.engine.num_running,
            kv_tokens=getattr(pool, "capacity", None),
            kv_tokens_free=pool.free_tokens + cached if pool is not None else None,
            kv_tokens_cached=cached if pool is not None else None,
            prefix_cache=cache.stats.as_dict() if cache is not None else None,
            steps=self._steps,
            failed_steps=self._failed_steps,
            failed_requests=self._failed_requests,
            batch_sizes=dict(self._batch_sizes),
            active_requests=tuple(sorted(self._by_engine_id)),
        )
