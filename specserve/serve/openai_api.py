"""The OpenAI API's semantics over a generation runner: completions and chat, whole or streamed, with usage.

:class:`OpenAIHandler` turns validated requests (:mod:`specserve.serve.schemas`) into calls on a
:class:`~specserve.core.engine.GenerationFrontend`: the distributed
:class:`~specserve.actors.coordinator.Coordinator` when served, the in-process
:class:`~specserve.core.engine.SpeculativeEngine` in tests and tools — and shapes the answers as
OpenAI's JSON (``text_completion`` / ``chat.completion`` objects, and server-sent-event chunks
ending in ``data: [DONE]``). Every answer carries ``usage`` and a ``speculation`` summary.

Chat prompts use the tokenizer's own chat template when it has one and a plain
``<|role|>`` template otherwise (the shipped default models have none). Does not: speak HTTP,
check API keys or body sizes (the ingress does), or batch requests.
"""

from __future__ import annotations

import json
import time
import uuid
from collections.abc import Iterator, Sequence
from typing import Any

from specserve.core.engine import GenerationConfig, GenerationFrontend, GenerationResult
from specserve.core.errors import UserError
from specserve.core.sampling import SamplingParams
from specserve.core.stats import RequestStats
from specserve.serve.config import ServeConfig
from specserve.serve.schemas import ChatCompletionRequest, ChatMessage, CompletionRequest, RequestError

FINISH_REASONS = {"eos": "stop", "stop": "stop", "length": "length"}


def speculation_summary(stats: RequestStats) -> dict[str, Any]:
    return {
        "cycles": stats.cycles,
        "drafted_tokens": stats.drafted_tokens,
        "accepted_tokens": stats.accepted_tokens,
        "mean_accepted_length": stats.mean_accepted,
        "acceptance_by_position": stats.acceptance_by_position,
        "lossy": False,
    }


def plain_chat_prompt(messages: Sequence[ChatMessage]) -> str:
    """The fallback chat template: one ``<|role|>`` line per message, then the assistant's turn."""
    return "".join(f"<|{m.role}|>\n{m.content}\n" for m in messages) + "<|assistant|>\n"


class OpenAIHandler:
    def __init__(self, runner: GenerationFrontend, config: ServeConfig) -> None:
        self.runner = runner
        self.config = config

    def models(self) -> dict[str, Any]:
        return {
            "object": "list",
            "data": [{"id": self.config.model_name, "object": "model", "created": 0, "owned_by": "specserve"}],
        }

    # -----------------------------------------------------------------------------------------

    def completion(self, request: CompletionRequest) -> dict[str, Any] | Iterator[str]:
        prompt = request.prompt
        return self._answer(request, prompt, chat=False)

    def chat(self, request: ChatCompletionRequest) -> dict[str, Any] | Iterator[str]:
        return self._answer(request, self.chat_prompt(request.messages), chat=True)

    def chat_prompt(self, messages: Sequence[ChatMessage]) -> str:
        tokenizer = self.runner.prompts.tokenizer
        if tokenizer is not None and getattr(tokenizer, "chat_template", None):
            turns = [{"role": m.role, "content": m.content} for m in messages]
            return str(tokenizer.apply_chat_template(turns, tokenize=False, add_generation_prompt=True))
        return plain_chat_prompt(messages)

    # -----------------------------------------------------------------------------------------

    def _answer(
        self, request: CompletionRequest | ChatCompletionRequest, prompt: str | list[int], chat: bool
    ) -> dict[str, Any] | Iterator[str]:
        if request.model != self.config.model_name:
            raise RequestError(
                f"model {request.model!r} is not served here; use {self.config.model_name!r} (see GET /v1/models)",
                status=404,
                param="model",
                code="model_not_found",
            )
        params = request.sampling()
        generation = request.generation(self.config.default_max_tokens, self.config.gamma)
        try:
            ids = self.runner.prompts.encode(prompt)
            self.runner.prompts.check_length(ids, generation.max_new_tokens)
        except UserError as exc:
            raise RequestError(str(exc), param="max_tokens" if "context" in str(exc) else "prompt") from exc
        meta = {
            "id": f"{'chatcmpl' if chat else 'cmpl'}-{uuid.uuid4().hex}",
            "created": int(time.time()),
            "model": self.config.model_name,
        }
        if request.stream:
            return self._stream(ids, params, generation, meta, chat)
        result = self.runner.generate(ids, params, generation)
        choice: dict[str, Any] = {"index": 0, "finish_reason": FINISH_REASONS[result.finish_reason]}
        if chat:
            choice["message"] = {"role": "assistant", "content": result.text}
        else:
            choice["text"] = result.text
            choice["logprobs"] = None
        return {
            **meta,
            "object": "chat.completion" if chat else "text_completion",
            "choices": [choice],
            "usage": _usage(result),
            "speculation": speculation_summary(result.stats),
        }

    def _stream(
        self, ids: list[int], params: SamplingParams, generation: GenerationConfig, meta: dict[str, Any], chat: bool
    ) -> Iterator[str]:
        kind = "chat.completion.chunk" if chat else "text_completion"
        if chat:
            yield _sse({**meta, "object": kind, "choices": [{"index": 0, "delta": {"role": "assistant"}}]})
        for chunk in self.runner.stream(ids, params, generation):
            result = chunk.result
            finish = FINISH_REASONS[result.finish_reason] if result is not None else None
            if chunk.text or finish is not None:
                delta: dict[str, Any] = (
                    {"index": 0, "delta": {"content": chunk.text} if chunk.text else {}, "finish_reason": finish}
                    if chat
                    else {"index": 0, "text": chunk.text, "logprobs": None, "finish_reason": finish}
                )
                body: dict[str, Any] = {**meta, "object": kind, "choices": [delta]}
                if result is not None:
                    body["usage"] = _usage(result)
                    body["speculation"] = speculation_summary(result.stats)
                yield _sse(body)
        yield "data: [DONE]\n\n"


def _usage(result: GenerationResult) -> dict[str, int]:
    prompt, completion = len(result.prompt_ids), len(result.output_ids)
    return {"prompt_tokens": prompt, "completion_tokens": completion, "total_tokens": prompt + completion}


def _sse(body: dict[str, Any]) -> str:
    return f"data: {json.dumps(body)}\n\n"
