"""``OpenAIIngress``: the HTTP front of the application — FastAPI routes, API key, errors, SSE.

A plain class. In Serve it is the ingress deployment (:mod:`specserve.serve.app`) and reaches
the model replicas through a ``DeploymentHandle``; in tests and tools it can hold a
:class:`~specserve.serve.model_server.ModelServer` (or any object with its ``describe``,
``started_at``, ``check_health`` and ``generate``) directly. Either way it is given a *backend*
and talks to it through :class:`ReplicaClient`.

Routes: ``POST /v1/completions``, ``POST /v1/chat/completions`` (whole JSON or, with
``stream: true``, server-sent events), ``GET /v1/models`` (``created``: the Unix time the model
replica that first answered the ingress started), ``GET /health`` (liveness: the ingress answers),
``GET /ready`` (readiness: a model replica passes its health check *now*, within
:data:`READY_TIMEOUT_S`; nothing is remembered between probes) and, as ``api_docs`` says,
``/docs``, ``/redoc`` and ``/openapi.json`` (behind the API key when one is set). Every refusal —
bad JSON, a body that is not ``application/json`` (415), wrong types, unknown model, over-long
prompt, oversize body, missing or wrong API key, unknown route — is OpenAI's error JSON with a 4xx
status.

A failure inside generation (or anywhere the ingress did not expect one) is a 500 — or an error
event once a stream has started — whose message is only ``internal error (request id req-…); see
the server log``: no exception text, traceback, path, address or process id reaches the client.
The exception goes to the server log (the ``ray.serve`` logger: the replica's log in Serve) under
the same request id, an unguessable random token (:func:`new_request_id`). The server keeps serving.

Before answering, the ingress waits for the replica's first chunk (an empty one, sent as soon as
the replica took the request), so the replica's own refusals still get a status of their own: a
full replica (:class:`~specserve.serve.model_server.QueueFull`) is a 429 with ``Retry-After``, a
request it cannot hold (an :class:`~specserve.core.errors.UserError`, e.g. longer than its KV
slot) a 400. Errors that crossed Ray arrive wrapped; their cause is what is reported.

When the client disconnects, Starlette cancels the response; the cancellation reaches the
backend's stream, which stops the generation and frees its KV.

When the replica generating a request is lost (it lost a target shard, died, or is shutting down:
:func:`replica_lost`), :class:`ReplicaClient` sends the request again with what the client already
has (:class:`~specserve.core.resume.Resume`), backing off, until a healthy replica continues it or
``resume_timeout_s`` passes (then a 503 with ``Retry-After``, or an error event): the client sees
one stream with a pause, no token lost or repeated (``docs/faults.md``).

Bounded at the edge: a body is read as it streams (:mod:`specserve.serve.body`): more than
``max_body_bytes`` is a 413 as soon as the count passes it, a body not whole within
``body_timeout_s`` a 408, both with ``Connection: close``. JSON parsing and tokenisation run on the
ingress's one worker thread, so a big prompt does not stall ``/health``, ``/ready`` or other
streams. A request still unfinished ``request_timeout_s`` after it arrived is stopped (its stream
closed: the replica frees its KV) and answered 504, or, once streaming, with an error event and
``[DONE]``.

Does not: authenticate anything but the HTTP API (Serve's own ``/-/routes`` and ``/-/healthz``
are answered by Serve's proxy before a request reaches this app; see ``docs/security.md``), or
limit request rates.
"""

from __future__ import annotations

import asyncio
import hashlib
import hmac
import logging
import secrets
import time
from collections.abc import AsyncGenerator, AsyncIterator, Awaitable, Mapping
from concurrent.futures import ThreadPoolExecutor
from typing import Any, TypeVar

from fastapi import FastAPI, Request
from fastapi.openapi.docs import get_redoc_html, get_swagger_ui_html
from fastapi.responses import HTMLResponse, JSONResponse, StreamingResponse
from ray.exceptions import RayTaskError
from ray.serve.handle import DeploymentHandle
from starlette.exceptions import HTTPException

from specserve.core.errors import ReplicaLost, UserError
from specserve.core.request import GenerationResult, StreamChunk
from specserve.core.resume import Resume
from specserve.core.verify.logprobs import TokenLogprob
from specserve.serve.body import read_body
from specserve.serve.config import ServeConfig
from specserve.serve.engine_loop import EngineStopped
from specserve.serve.errors import RequestError
from specserve.serve.model_server import QueueFull
from specserve.serve.openai_api import DONE_EVENT, ChoiceStream, OpenAIHandler, PreparedRequest, error_event
from specserve.serve.schemas import ChatCompletionRequest, CompletionRequest, parse_request

logger = logging.getLogger("ray.serve")  # Serve writes this logger to the replica's log

READY_TIMEOUT_S = 5.0  # GET /ready: how long a model replica may take to pass its health check
RESUME_FIRST_PAUSE_S = 0.1  # before sending a lost request again; doubles per try up to RESUME_MAX_PAUSE_S
RESUME_MAX_PAUSE_S = 2.0
LOST_RETRY_AFTER_S = 10  # Retry-After of a request no replica could resume (Serve replaces a broken one meanwhile)
JSON_MEDIA_TYPE = "application/json"
T = TypeVar("T")


def new_request_id() -> str:
    """An id for one request, named in its 500 and in the server log: 128 random bits, unguessable."""
    return f"req-{secrets.token_hex(16)}"


def internal_error(request_id: str, what: str, exc: BaseException | None = None) -> RequestError:
    """A failure the client cannot fix: logged in full under ``request_id``; the client is told only the id."""
    logger.error("request %s: %s", request_id, what, exc_info=exc)
    return RequestError(
        f"internal error (request id {request_id}); see the server log", status=500, code="internal_error"
    )


def generation_error(exc: BaseException, request_id: str) -> RequestError:
    """What a client is told about an exception from a replica's stream: its cause, with a status of its own, or, for
    a failure, only the request id (the exception is logged under it)."""
    if isinstance(exc, RequestError):  # the ingress's own verdict (the request ran out of time): as it is
        return exc
    cause = exc.cause if isinstance(exc, RayTaskError) and isinstance(exc.cause, BaseException) else exc
    if isinstance(cause, QueueFull):
        headers = {"Retry-After": str(cause.retry_after_s)}
        return RequestError(cause.message, status=429, code="queue_full", headers=headers)
    if isinstance(cause, UserError):
        return RequestError.from_user_error(cause, code="invalid_request")
    if replica_lost(exc):  # and no replica resumed it in time: the service is degraded, not the request bad
        logger.error("request %s: no replica could finish it", request_id, exc_info=exc)
        return RequestError(
            f"no healthy model replica could finish the request (request id {request_id}); retry later",
            status=503,
            code="replica_unavailable",
            headers={"Retry-After": str(LOST_RETRY_AFTER_S)},
        )
    return internal_error(request_id, "generation failed", exc)


def request_timeout(limit_s: float) -> RequestError:
    """A request that outlived ``request_timeout_s``: stopped, and told so (504, or an error event in a stream)."""
    return RequestError(
        f"the request did not finish within {limit_s:g} s and was stopped; ask for fewer max_tokens, or raise the "
        "server's `request_timeout_s`",
        status=504,
        code="timeout",
    )


async def within(deadline: float, awaitable: Awaitable[T], limit_s: float) -> T:
    """What ``awaitable`` gives, awaited in this task; past ``deadline`` (the event loop's clock) it is cancelled —
    a stream's generator is closed on the way, which stops its generation — and :func:`request_timeout` raised."""
    timeout = asyncio.timeout_at(deadline)
    try:
        async with timeout:
            return await awaitable
    except TimeoutError:
        if not timeout.expired():  # not ours: something below timed out
            raise
        raise request_timeout(limit_s) from None


async def drain(chunks: AsyncIterator[StreamChunk]) -> list[StreamChunk]:
    return [chunk async for chunk in chunks]


def require_json(request: Request) -> None:
    """POST bodies are JSON: ``Content-Type: application/json`` (any parameters, e.g. a charset), else a 415."""
    declared = request.headers.get("content-type", "")
    if declared.partition(";")[0].strip().lower() != JSON_MEDIA_TYPE:
        shown = f"`{declared[:80]}`" if declared else "none"
        raise RequestError(
            f"the request body must be JSON sent as `Content-Type: {JSON_MEDIA_TYPE}`; got {shown}",
            status=415,
            code="unsupported_media_type",
        )


class ReplicaClient:
    """The ingress's view of the model replicas: describe the model, check one, stream one request.

    ``backend`` is a Serve ``DeploymentHandle`` or, in process, the backend object itself."""

    def __init__(self, backend: Any) -> None:
        self.backend = backend
        self.local = not isinstance(backend, DeploymentHandle)

    async def describe(self) -> Any:
        if self.local:
            return self.backend.describe()
        return await self.backend.describe.remote()

    async def started_at(self) -> int:
        if self.local:
            return int(self.backend.started_at())
        return int(await self.backend.started_at.remote())

    async def check(self) -> None:
        """One model replica's health check, run now; raises what it raises."""
        if self.local:  # on a thread: a check may block (a distributed runner pings its actors)
            await asyncio.to_thread(self.backend.check_health)
            return
        await self.backend.check_health.remote()

    async def generate(
        self, prepared: PreparedRequest, resume_timeout_s: float = 60.0
    ) -> AsyncGenerator[StreamChunk, None]:
        """Stream one request; when its replica is lost (:func:`replica_lost`), resume it — on a healthy replica
        once Serve routes there — from what was streamed (:mod:`specserve.core.resume`), for up to
        ``resume_timeout_s`` after the loss. The caller sees one stream: at most a pause, no token twice."""
        tokens: list[int] = []
        text: list[str] = []
        logprobs: list[TokenLogprob] = []
        resume: Resume | None = None
        lost_at: float | None = None
        pause = RESUME_FIRST_PAUSE_S
        while True:
            try:
                async for chunk in self._attempt(prepared, resume):
                    if lost_at is not None:  # a replica took the continuation
                        logger.info("a request resumed after %.2f s", time.monotonic() - lost_at)
                        lost_at, pause = None, RESUME_FIRST_PAUSE_S
                    tokens.extend(chunk.token_ids)
                    text.append(chunk.text)
                    logprobs.extend(chunk.logprobs)
                    yield chunk
                return
            except Exception as exc:
                if not resumable(exc, answered=resume is not None):
                    raise
                now = time.monotonic()
                lost_at = lost_at or now
                if now - lost_at > resume_timeout_s:
                    raise ReplicaLost(
                        f"no replica could resume the request within {resume_timeout_s:g} s (resume_timeout_s)"
                    ) from exc
                logger.warning("a request's replica was lost after %d tokens; resuming: %r", len(tokens), exc)
                # nothing out yet: send it afresh
                resume = Resume.of(tokens, "".join(text), logprobs) if tokens else None
                await asyncio.sleep(pause)
                pause = min(2 * pause, RESUME_MAX_PAUSE_S)

    async def _attempt(self, prepared: PreparedRequest, resume: Resume | None) -> AsyncGenerator[StreamChunk, None]:
        args = (prepared.prompt_ids, prepared.params, prepared.generation)
        kwargs = {} if resume is None else {"resume": resume}
        if self.local:
            chunks = self.backend.generate(*args, **kwargs)
            try:
                async for chunk in chunks:
                    yield chunk
            finally:
                await chunks.aclose()
            return
        response = self.backend.options(stream=True).generate.remote(*args, **kwargs)
        finished = False
        try:
            async for chunk in response:
                finished = chunk.result is not None
                yield chunk
        finally:
            if not finished:
                response.cancel()  # the replica closes the generation: drafting stops, KV is freed


def replica_lost(exc: BaseException) -> bool:
    """The replica generating a request is gone, not the request at fault: its target lost a shard
    (:class:`~specserve.core.errors.ReplicaLost`), its engine loop was stopped, or the replica actor died."""
    from ray.exceptions import RayActorError

    cause = exc.cause if isinstance(exc, RayTaskError) and isinstance(exc.cause, BaseException) else exc
    return isinstance(cause, ReplicaLost | EngineStopped | RayActorError) or isinstance(exc, RayActorError)


def resumable(exc: BaseException, answered: bool) -> bool:
    """Whether to send the request again: its replica was lost, or — once tokens went out — the replica a
    continuation reached is full (the caller waits rather than losing the stream)."""
    cause = exc.cause if isinstance(exc, RayTaskError) and isinstance(exc.cause, BaseException) else exc
    return replica_lost(exc) or (answered and isinstance(cause, QueueFull))


class OpenAIIngress:
    def __init__(
        self, config: ServeConfig | Mapping[str, Any], backend: Any, ready_timeout_s: float = READY_TIMEOUT_S
    ) -> None:
        self.config = ServeConfig.model_validate(config)
        self.client = ReplicaClient(backend)
        self.api_key = self.config.resolved_api_key()
        self.ready_timeout_s = ready_timeout_s
        self._handler: OpenAIHandler | None = None
        # JSON parsing and tokenisation run here, off the event loop (which keeps answering /health, /ready and the
        # streams), on ONE thread: a Hugging Face fast tokenizer used from several threads at once may raise
        # "Already borrowed", and one at a time is how the event loop ran them before.
        self._prepare_pool = ThreadPoolExecutor(max_workers=1, thread_name_prefix="specserve-prepare")

    def __del__(self) -> None:  # Serve gives the ingress no shutdown hook: the thread goes with the ingress
        pool = getattr(self, "_prepare_pool", None)
        if pool is not None:
            pool.shutdown(wait=False, cancel_futures=True)

    def __serve_build_asgi_app__(self) -> FastAPI:  # Serve's late-bound ingress hook
        return self.asgi()

    async def handler(self) -> OpenAIHandler:
        """The request handler, built on first use from the codec a model replica describes (the codec does not
        change while the deployment lives; readiness is checked afresh on every probe, see :meth:`ready`)."""
        if self._handler is None:
            codec, started = await self.client.describe(), await self.client.started_at()
            self._handler = OpenAIHandler(codec, self.config, created=started)
        return self._handler

    @property
    def serves_docs(self) -> bool:
        """``api_docs``: ``on``, ``off``, or ``auto`` — served only when no API key is configured."""
        return self.config.api_docs == "on" or (self.config.api_docs == "auto" and self.api_key is None)

    async def ready(self) -> JSONResponse:
        """Readiness, checked now: a model replica passes its health check within ``ready_timeout_s``."""

        async def check() -> None:
            await self.client.check()
            await self.handler()

        try:
            await asyncio.wait_for(check(), self.ready_timeout_s)
        except TimeoutError:
            logger.warning("GET /ready: no model replica passed its health check within %s s", self.ready_timeout_s)
            reason = f"no model replica answered its health check within {self.ready_timeout_s:g} s"
            return JSONResponse({"status": "not ready", "reason": reason}, status_code=503)
        except Exception as exc:  # broken (or not started yet): the why goes to the log, not to the prober
            request_id = new_request_id()
            logger.warning("GET /ready (request id %s): a model replica failed its check", request_id, exc_info=exc)
            reason = f"a model replica failed its health check (request id {request_id}); see the server log"
            return JSONResponse({"status": "not ready", "reason": reason}, status_code=503)
        return JSONResponse({"status": "ready", "model": self.config.model_name})

    # -----------------------------------------------------------------------------------------

    def asgi(self) -> FastAPI:
        app = FastAPI(
            title="specserve",
            description="Exact speculative decoding, OpenAI-compatible API",
            docs_url=None,  # served below, behind the API key, when `api_docs` says so
            redoc_url=None,
            openapi_url=None,
        )

        @app.exception_handler(RequestError)
        async def _refused(request: Request, exc: RequestError) -> JSONResponse:
            headers = {**exc.headers, **({"WWW-Authenticate": "Bearer"} if exc.status == 401 else {})}
            return JSONResponse(exc.body(), status_code=exc.status, headers=headers or None)

        @app.exception_handler(HTTPException)
        async def _http(request: Request, exc: HTTPException) -> JSONResponse:
            error = RequestError(f"{request.method} {request.url.path}: {exc.detail}", status=exc.status_code)
            return JSONResponse(error.body(), status_code=exc.status_code)

        @app.exception_handler(Exception)
        async def _unexpected(request: Request, exc: Exception) -> JSONResponse:
            error = internal_error(new_request_id(), f"{request.method} {request.url.path} failed", exc)
            return JSONResponse(error.body(), status_code=error.status)

        @app.get("/health")
        async def health() -> dict[str, str]:
            return {"status": "ok"}

        @app.get("/ready")
        async def ready() -> JSONResponse:
            return await self.ready()

        @app.get("/v1/models")
        async def models(request: Request) -> dict[str, Any]:
            self._authorize(request)
            return (await self.handler()).models()

        @app.post("/v1/completions", response_model=None)
        async def completions(request: Request) -> JSONResponse | StreamingResponse:
            return await self._answer(request, CompletionRequest)

        @app.post("/v1/chat/completions", response_model=None)
        async def chat_completions(request: Request) -> JSONResponse | StreamingResponse:
            return await self._answer(request, ChatCompletionRequest)

        if self.serves_docs:
            self._add_docs(app)
        return app

    def _add_docs(self, app: FastAPI) -> None:
        """FastAPI's ``/openapi.json``, ``/docs`` and ``/redoc``, each behind the API key when one is set."""

        @app.get("/openapi.json", include_in_schema=False)
        async def openapi(request: Request) -> JSONResponse:
            self._authorize(request)
            return JSONResponse(app.openapi())

        def schema_url(request: Request) -> str:
            return f"{request.scope.get('root_path', '').rstrip('/')}/openapi.json"

        @app.get("/docs", include_in_schema=False)
        async def docs(request: Request) -> HTMLResponse:
            self._authorize(request)
            return get_swagger_ui_html(openapi_url=schema_url(request), title=f"{app.title} - docs")

        @app.get("/redoc", include_in_schema=False)
        async def redoc(request: Request) -> HTMLResponse:
            self._authorize(request)
            return get_redoc_html(openapi_url=schema_url(request), title=f"{app.title} - ReDoc")

    # -----------------------------------------------------------------------------------------

    def _authorize(self, request: Request) -> None:
        if self.api_key is None:
            return
        scheme, _, token = request.headers.get("authorization", "").partition(" ")
        if scheme.lower() != "bearer" or not hmac.compare_digest(token.strip().encode(), self.api_key.encode()):
            raise RequestError(
                "missing or wrong API key: send the header `Authorization: Bearer <key>`",
                status=401,
                code="invalid_api_key",
            )

    async def _answer(
        self, request: Request, kind: type[CompletionRequest] | type[ChatCompletionRequest]
    ) -> JSONResponse | StreamingResponse:
        loop = asyncio.get_running_loop()
        limit_s = self.config.request_timeout_s
        deadline = loop.time() + limit_s  # from its arrival to its last token
        self._authorize(request)
        require_json(request)
        body = await read_body(request, self.config.max_body_bytes, self.config.body_timeout_s)  # or 413, 408
        handler = await within(deadline, self.handler(), limit_s)
        tenant = self._tenant(request)
        preparing = loop.run_in_executor(self._prepare_pool, self._prepare, handler, kind, body, tenant)
        prepared = await within(deadline, preparing, limit_s)  # cancelled while it waits its turn: never runs
        request_id = new_request_id()
        # one generation per choice (n, or best_of): a batching replica runs them together
        runs = [self.client.generate(choice, self.config.resume_timeout_s) for choice in prepared.choices()]
        try:  # each replica took its generation, or refused it
            firsts = await within(deadline, gather_or_cancel(*(anext(chunks) for chunks in runs)), limit_s)
        except StopAsyncIteration:
            await close_all(runs)
            raise internal_error(request_id, "generation ended without a result") from None
        except Exception as exc:  # a full replica (429), a request it cannot hold (400), a failure (500), time (504)
            await close_all(runs)
            raise generation_error(exc, request_id) from exc
        if prepared.stream:
            events = self._events(prepared, firsts, runs, request_id, deadline)
            return StreamingResponse(events, media_type="text/event-stream")

        async def finish(first: StreamChunk, chunks: AsyncGenerator[StreamChunk, None]) -> GenerationResult:
            return prepared.collect([first, *await drain(chunks)])

        try:  # out of time, the generators are closed inside drain: the replicas stop the generations, free their KV
            finishing = gather_or_cancel(*(finish(first, chunks) for first, chunks in zip(firsts, runs, strict=True)))
            return JSONResponse(prepared.response(*await within(deadline, finishing, limit_s)))
        except Exception as exc:  # a replica failed mid-generation, or time ran out: a status that says so
            raise generation_error(exc, request_id) from exc
        finally:
            await close_all(runs)

    def _prepare(
        self,
        handler: OpenAIHandler,
        kind: type[CompletionRequest] | type[ChatCompletionRequest],
        body: bytes,
        tenant: str,
    ) -> PreparedRequest:
        """Parse, validate and tokenise, on the ingress's one worker thread."""
        return handler.prepare(parse_request(kind, body, self.config.max_body_bytes), tenant)

    def _tenant(self, request: Request) -> str:
        """Who sent an authorised request, for the prefix cache's namespaces: a digest of the API key it presented
        ("" on a server without one)."""
        if self.api_key is None:
            return ""
        token = request.headers.get("authorization", "").partition(" ")[2].strip()
        return hashlib.sha256(token.encode()).hexdigest()[:32]

    async def _events(
        self,
        prepared: PreparedRequest,
        firsts: list[StreamChunk],
        runs: list[AsyncGenerator[StreamChunk, None]],
        request_id: str,
        deadline: float,
    ) -> AsyncIterator[str]:
        """Every choice's chunks as events, in the order they come; one choice's failure ends the stream."""
        for opening in prepared.opening_events():
            yield opening
        queue: asyncio.Queue[tuple[int, StreamChunk | Exception | None]] = asyncio.Queue()

        async def pump(index: int, first: StreamChunk, chunks: AsyncGenerator[StreamChunk, None]) -> None:
            try:
                await queue.put((index, first))
                async for chunk in chunks:
                    await queue.put((index, chunk))
                await queue.put((index, None))
            except Exception as exc:  # reported in-band by the stream below
                await queue.put((index, exc))

        pairs = enumerate(zip(firsts, runs, strict=True))
        pumps = [asyncio.create_task(pump(i, first, chunks)) for i, (first, chunks) in pairs]
        choices = [ChoiceStream(i) for i in range(len(runs))]
        results: list[GenerationResult] = []
        try:
            running = len(runs)
            while running:
                index, item = await within(deadline, queue.get(), self.config.request_timeout_s)
                if item is None:
                    running -= 1
                    continue
                if isinstance(item, Exception):
                    raise item
                event = prepared.chunk_event(item, choices[index])
                if event is not None:
                    yield event
                if item.result is not None:
                    results.append(item.result)
            for closing in prepared.closing_events(results):
                yield closing
        except Exception as exc:  # the status line is sent: report in-band (time ran out too), then end properly
            yield error_event(generation_error(exc, request_id))
        finally:  # a client that left: the replicas stop the generations and free their KV
            for task in pumps:
                task.cancel()
            await asyncio.gather(*pumps, return_exceptions=True)
            await close_all(runs)
        yield DONE_EVENT


async def gather_or_cancel(*awaitables: Awaitable[T]) -> list[T]:
    """Every awaitable's result, run concurrently; when one fails (or this is cancelled) the others are cancelled
    and awaited before the error goes on."""
    tasks = [asyncio.ensure_future(awaitable) for awaitable in awaitables]
    try:
        return list(await asyncio.gather(*tasks))
    except BaseException:
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
        raise


async def close_all(runs: list[AsyncGenerator[StreamChunk, None]]) -> None:
    for chunks in runs:
        await chunks.aclose()
