"""``OpenAIIngress``: the HTTP front of the application — FastAPI routes, API key, errors, SSE.

A plain class. In Serve it is the ingress deployment (:mod:`specserve.serve.app`) and reaches
the model replicas through a ``DeploymentHandle``; in tests and tools it can hold a
:class:`~specserve.serve.model_server.ModelServer` directly. Either way it is given a *backend*
and talks to it through :class:`ReplicaClient`.

Routes: ``POST /v1/completions``, ``POST /v1/chat/completions`` (whole JSON or, with
``stream: true``, server-sent events), ``GET /v1/models`` (``created``: the Unix time the model
replica that first answered the ingress started), ``GET /health`` (liveness: the ingress answers)
and ``GET /ready`` (readiness: a model replica answered). Every refusal —
bad JSON, wrong types, unknown model, over-long prompt, oversize body, missing or wrong API key,
unknown route — is OpenAI's error JSON with a 4xx status; a failure inside generation is a 500
(or an error event once a stream has started), and the server keeps serving.

Before answering, the ingress waits for the replica's first chunk (an empty one, sent as soon as
the replica took the request), so the replica's own refusals still get a status of their own: a
full replica (:class:`~specserve.serve.model_server.QueueFull`) is a 429 with ``Retry-After``, a
request it cannot hold (an :class:`~specserve.core.errors.UserError`, e.g. longer than its KV
slot) a 400. Errors that crossed Ray arrive wrapped; their cause is what is reported.

When the client disconnects, Starlette cancels the response; the cancellation reaches the
backend's stream, which stops the generation and frees its KV.
"""

from __future__ import annotations

import hmac
from collections.abc import AsyncGenerator, AsyncIterator, Mapping
from typing import Any

from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, StreamingResponse
from ray.exceptions import RayTaskError
from starlette.exceptions import HTTPException

from specserve.core.engine import StreamChunk
from specserve.core.errors import UserError
from specserve.serve.config import ServeConfig
from specserve.serve.model_server import ModelServer, QueueFull
from specserve.serve.openai_api import DONE_EVENT, OpenAIHandler, PreparedRequest, error_event
from specserve.serve.schemas import ChatCompletionRequest, CompletionRequest, RequestError, parse_request


def generation_error(exc: BaseException) -> RequestError:
    """What a client is told about an exception from a replica's stream: its cause, with a status of its own."""
    cause = exc.cause if isinstance(exc, RayTaskError) and isinstance(exc.cause, BaseException) else exc
    if isinstance(cause, QueueFull):
        headers = {"Retry-After": str(cause.retry_after_s)}
        return RequestError(cause.message, status=429, code="queue_full", headers=headers)
    if isinstance(cause, UserError):
        return RequestError.from_user_error(cause, code="invalid_request")
    return RequestError(f"generation failed: {cause}", status=500, code="internal_error")


class ReplicaClient:
    """The ingress's view of the model replicas: describe the model, stream one request."""

    def __init__(self, backend: Any) -> None:
        self.backend = backend
        self.local = isinstance(backend, ModelServer)

    async def describe(self) -> Any:
        if self.local:
            return self.backend.describe()
        return await self.backend.describe.remote()

    async def started_at(self) -> int:
        if self.local:
            return int(self.backend.started_at())
        return int(await self.backend.started_at.remote())

    async def generate(self, prepared: PreparedRequest) -> AsyncGenerator[StreamChunk, None]:
        args = (prepared.prompt_ids, prepared.params, prepared.generation)
        if self.local:
            chunks = self.backend.generate(*args)
            try:
                async for chunk in chunks:
                    yield chunk
            finally:
                await chunks.aclose()
            return
        response = self.backend.options(stream=True).generate.remote(*args)
        finished = False
        try:
            async for chunk in response:
                finished = chunk.result is not None
                yield chunk
        finally:
            if not finished:
                response.cancel()  # the replica closes the generation: drafting stops, KV is freed


class OpenAIIngress:
    def __init__(self, config: ServeConfig | Mapping[str, Any], backend: Any) -> None:
        self.config = ServeConfig.model_validate(config)
        self.client = ReplicaClient(backend)
        self.api_key = self.config.resolved_api_key()
        self._handler: OpenAIHandler | None = None

    def __serve_build_asgi_app__(self) -> FastAPI:  # Serve's late-bound ingress hook
        return self.asgi()

    async def handler(self) -> OpenAIHandler:
        """The request handler, built on first use from the codec a model replica describes."""
        if self._handler is None:
            codec, started = await self.client.describe(), await self.client.started_at()
            self._handler = OpenAIHandler(codec, self.config, created=started)
        return self._handler

    # -----------------------------------------------------------------------------------------

    def asgi(self) -> FastAPI:
        app = FastAPI(title="specserve", description="Exact speculative decoding, OpenAI-compatible API")

        @app.exception_handler(RequestError)
        async def _refused(request: Request, exc: RequestError) -> JSONResponse:
            headers = {**exc.headers, **({"WWW-Authenticate": "Bearer"} if exc.status == 401 else {})}
            return JSONResponse(exc.body(), status_code=exc.status, headers=headers or None)

        @app.exception_handler(HTTPException)
        async def _http(request: Request, exc: HTTPException) -> JSONResponse:
            error = RequestError(f"{request.method} {request.url.path}: {exc.detail}", status=exc.status_code)
            return JSONResponse(error.body(), status_code=exc.status_code)

        @app.get("/health")
        async def health() -> dict[str, str]:
            return {"status": "ok"}

        @app.get("/ready")
        async def ready() -> JSONResponse:
            try:
                await self.handler()
            except Exception as exc:  # not ready yet (or broken): say why
                return JSONResponse({"status": "not ready", "reason": str(exc)}, status_code=503)
            return JSONResponse({"status": "ready", "model": self.config.model_name})

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

        return app

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
        self._authorize(request)
        limit = self.config.max_body_bytes
        declared = request.headers.get("content-length")
        if declared is not None and declared.isdigit() and int(declared) > limit:
            raise RequestError(f"request body of {declared} bytes exceeds the limit of {limit}", status=413)
        body = await request.body()
        prepared = (await self.handler()).prepare(parse_request(kind, body, limit))
        chunks = self.client.generate(prepared)
        try:
            first = await anext(chunks)  # the replica took the request, or refused it
        except StopAsyncIteration:
            raise RequestError("generation ended without a result", status=500, code="internal_error") from None
        except Exception as exc:  # a full replica (429), a request it cannot hold (400), a failure (500)
            raise generation_error(exc) from exc
        if prepared.stream:
            return StreamingResponse(self._events(prepared, first, chunks), media_type="text/event-stream")
        try:
            return JSONResponse(prepared.collect([first, *[chunk async for chunk in chunks]]))
        except Exception as exc:  # a replica failed mid-generation: a status that says so; the server serves on
            raise generation_error(exc) from exc
        finally:
            await chunks.aclose()

    async def _events(
        self, prepared: PreparedRequest, first: StreamChunk, chunks: AsyncGenerator[StreamChunk, None]
    ) -> AsyncIterator[str]:
        for opening in prepared.opening_events():
            yield opening
        try:
            chunk: StreamChunk | None = first
            while chunk is not None:
                event = prepared.chunk_event(chunk)
                if event is not None:
                    yield event
                chunk = await anext(chunks, None)
        except Exception as exc:  # the status line is sent: report in-band, then end the stream properly
            yield error_event(generation_error(exc))
        finally:
            await chunks.aclose()  # a client that left: the replica stops the generation and frees its KV
        yield DONE_EVENT
