"""The OpenAI API's semantics: validated requests in, OpenAI-shaped JSON and server-sent events out.

:meth:`OpenAIHandler.prepare` turns a validated request (:mod:`specserve.serve.schemas`) into a
:class:`PreparedRequest`: the served model is checked, chat messages are rendered (the
tokenizer's own chat template when it has one, a plain ``<|role|>`` template otherwise — the
shipped default models have none), the prompt is tokenised and checked against the context, and
the sampling parameters and generation config are fixed. Every refusal is a
:class:`~specserve.serve.schemas.RequestError` raised here, before anything runs.

A :class:`PreparedRequest` then shapes whatever stream of
:class:`~specserve.core.engine.StreamChunk` a runner produced: as one ``text_completion`` /
``chat.completion`` object, or as ``text_completion`` / ``chat.completion.chunk`` events ending
in ``data: [DONE]``. Every answer carries ``usage`` and a ``speculation`` summary (counters, the tree
shape of every cycle, how tokens were sampled).

Pure: no HTTP, no threads, no Ray. The ingress (:mod:`specserve.serve.ingress`) drives it
asynchronously; :meth:`OpenAIHandler.run` drives it synchronously over a local runner (tests and
tools).
"""

from __future__ import annotations

import json
import time
import uuid
from collections.abc import Iterable, Iterator, Sequence
from dataclasses import dataclass, field
from typing import Any

from specserve.core.engine import GenerationConfig, GenerationFrontend, GenerationResult, StreamChunk
from specserve.core.errors import UserError
from specserve.core.prompts import PromptCodec
from specserve.core.sampling import SamplingParams
from specserve.core.stats import RequestStats
from specserve.serve.config import ServeConfig
from specserve.serve.schemas import ChatCompletionRequest, ChatMessage, CompletionRequest, RequestError

FINISH_REASONS = {"eos": "stop", "stop": "stop", "length": "length"}
DONE_EVENT = "data: [DONE]\n\n"


def speculation_summary(stats: RequestStats, params: SamplingParams) -> dict[str, Any]:
    return {
        "cycles": stats.cycles,
        "drafted_tokens": stats.drafted_tokens,
        "accepted_tokens": stats.accepted_tokens,
        "mean_accepted_length": stats.mean_accepted,
        "acceptance_by_position": stats.acceptance_by_position,
        "tree_shapes": [[nodes, depth] for nodes, depth in stats.tree_shapes],  # per cycle; empty for chains
        "budgets": list(stats.budgets),  # the budget the policy chose per cycle (γ, or tree nodes)
        "batch_sizes": [o.batch_size for o in stats.observations],  # requests verified together, per cycle
        "sampling": params.mode,
        "lossy": params.lossy_acceptance,  # true: typical acceptance ran; the output is not the target's law
    }


def plain_chat_prompt(messages: Sequence[ChatMessage]) -> str:
    """The fallback chat template: one ``<|role|>`` line per message, then the assistant's turn."""
    return "".join(f"<|{m.role}|>\n{m.content}\n" for m in messages) + "<|assistant|>\n"


def sse(body: dict[str, Any]) -> str:
    return f"data: {json.dumps(body)}\n\n"


def error_event(error: RequestError) -> str:
    """A failure after the stream started (the status line is already sent): an event with OpenAI's error body."""
    return sse(error.body())


@dataclass(frozen=True)
class PreparedRequest:
    """One admitted request: what to run, and how to shape what comes back."""

    prompt_ids: list[int]
    params: SamplingParams
    generation: GenerationConfig
    chat: bool
    stream: bool
    model: str
    request_id: str = field(default_factory=lambda: uuid.uuid4().hex)
    created: int = field(default_factory=lambda: int(time.time()))

    @property
    def kind(self) -> str:
        if self.chat:
            return "chat.completion.chunk" if self.stream else "chat.completion"
        return "text_completion"

    def _meta(self) -> dict[str, Any]:
        prefix = "chatcmpl" if self.chat else "cmpl"
        return {"id": f"{prefix}-{self.request_id}", "object": self.kind, "created": self.created, "model": self.model}

    # Whole answers ------------------------------------------------------------------------------

    def response(self, result: GenerationResult) -> dict[str, Any]:
        choice: dict[str, Any] = {"index": 0, "finish_reason": FINISH_REASONS[result.finish_reason]}
        if self.chat:
            choice["message"] = {"role": "assistant", "content": result.text}
        else:
            choice["text"] = result.text
            choice["logprobs"] = None
        return {
            **self._meta(),
            "choices": [choice],
            "usage": usage(result),
            "speculation": speculation_summary(result.stats, self.params),
        }

    def collect(self, chunks: Iterable[StreamChunk]) -> dict[str, Any]:
        for chunk in chunks:
            if chunk.result is not None:
                return self.response(chunk.result)
        raise RuntimeError("the generation ended without a result")

    # Streamed answers ---------------------------------------------------------------------------

    def opening_events(self) -> list[str]:
        """Events sent before any text: chat streams announce the assistant's role first."""
        if not self.chat:
            return []
        return [sse({**self._meta(), "choices": [{"index": 0, "delta": {"role": "assistant"}}]})]

    def chunk_event(self, chunk: StreamChunk) -> str | None:
        """The event for one chunk of new text; ``None`` when it carries nothing to send."""
        result = chunk.result
        finish = FINISH_REASONS[result.finish_reason] if result is not None else None
        if not chunk.text and finish is None:
            return None
        choice: dict[str, Any] = (
            {"index": 0, "delta": {"content": chunk.text} if chunk.text else {}, "finish_reason": finish}
            if self.chat
            else {"index": 0, "text": chunk.text, "logprobs": None, "finish_reason": finish}
        )
        body: dict[str, Any] = {**self._meta(), "choices": [choice]}
        if result is not None:
            body["usage"] = usage(result)
            body["speculation"] = speculation_summary(result.stats, self.params)
        return sse(body)

    def events(self, chunks: Iterable[StreamChunk]) -> Iterator[str]:
        yield from self.opening_events()
        for chunk in chunks:
            event = self.chunk_event(chunk)
            if event is not None:
                yield event
        yield DONE_EVENT


class OpenAIHandler:
    """Admits OpenAI requests for one served model whose prompts ``prompts`` encodes; ``created`` is the Unix time
    the model's deployment started (default: now)."""

    def __init__(self, prompts: PromptCodec, config: ServeConfig, created: int | None = None) -> None:
        self.prompts = prompts
        self.config = config
        self.created = int(time.time()) if created is None else created

    def models(self) -> dict[str, Any]:
        model = {"id": self.config.model_name, "object": "model", "created": self.created, "owned_by": "specserve"}
        return {"object": "list", "data": [model]}

    def prepare(self, request: CompletionRequest | ChatCompletionRequest) -> PreparedRequest:
        if request.model != self.config.model_name:
            raise RequestError(
                f"model {request.model!r} is not served here; use {self.config.model_name!r} (see GET /v1/models)",
                status=404,
                param="model",
                code="model_not_found",
            )
        chat = isinstance(request, ChatCompletionRequest)
        prompt = self.chat_prompt(request.messages) if isinstance(request, ChatCompletionRequest) else request.prompt
        try:  # the schema's bounds imply the engine's checks; should one still fail, it is the client's 400
            params = request.sampling()
            generation = request.generation(self.config.default_max_tokens, self.config.gamma)
        except UserError as exc:
            raise RequestError.from_user_error(exc) from exc
        try:
            ids = self.prompts.encode(prompt)
        except UserError as exc:
            raise RequestError.from_user_error(exc, param="messages" if chat else "prompt") from exc
        try:
            self.prompts.check_length(ids, generation.max_new_tokens)
        except UserError as exc:
            raise RequestError.from_user_error(exc, param="max_tokens", code="context_length_exceeded") from exc
        return PreparedRequest(ids, params, generation, chat, request.stream, self.config.model_name)

    def chat_prompt(self, messages: Sequence[ChatMessage]) -> str:
        tokenizer = self.prompts.tokenizer
        if tokenizer is not None and getattr(tokenizer, "chat_template", None):
            turns = [{"role": m.role, "content": m.content} for m in messages]
            return str(tokenizer.apply_chat_template(turns, tokenize=False, add_generation_prompt=True))
        return plain_chat_prompt(messages)

    def run(
        self, runner: GenerationFrontend, request: CompletionRequest | ChatCompletionRequest
    ) -> dict[str, Any] | Iterator[str]:
        """Synchronously, in this process: the whole answer, or the stream of events when ``stream`` is set."""
        prepared = self.prepare(request)
        chunks = runner.stream(prepared.prompt_ids, prepared.params, prepared.generation)
        return prepared.events(chunks) if prepared.stream else prepared.collect(chunks)


def usage(result: GenerationResult) -> dict[str, int]:
    prompt, completion = len(result.prompt_ids), len(result.output_ids)
    return {"prompt_tokens": prompt, "completion_tokens": completion, "total_tokens": prompt + completion}
