"""The OpenAI API's semantics: validated requests in, OpenAI-shaped JSON and server-sent events out.

:meth:`OpenAIHandler.prepare` turns a validated request (:mod:`specserve.serve.schemas`) into a
:class:`PreparedRequest`: the served model is checked, chat messages are rendered (the
tokenizer's own chat template when it has one, a plain ``<|role|>`` template otherwise — the
shipped default models have none), the prompt is tokenised and checked against the context, and
the sampling parameters and generation config are fixed. Every refusal is a
:class:`~specserve.serve.errors.RequestError` raised here, before anything runs.

A :class:`PreparedRequest` then shapes whatever streams of
:class:`~specserve.core.engine.StreamChunk` a runner produced: as one ``text_completion`` /
``chat.completion`` object, or as ``text_completion`` / ``chat.completion.chunk`` events ending
in ``data: [DONE]``. Every answer carries ``usage`` and a ``speculation`` summary (counters, the tree
shape of every cycle, how tokens were sampled).

A request for ``n`` choices (``best_of`` completions) is that many generations (:meth:`PreparedRequest.choices`),
each with its own seed derived from the request's (choice 0 keeps it), which a batching replica runs together.
``best_of`` > ``n`` keeps the ``n`` with the highest mean log-probability per token. ``usage`` counts every
generated token and ``speculation`` pools every generation's counters; with ``n`` > 1 a stream sends them in a
last event of its own, with no choices, once every choice has finished. Logprobs take the API's shapes in
:mod:`specserve.serve.logprob_shapes`.

Pure: no HTTP, no threads, no Ray. The ingress (:mod:`specserve.serve.ingress`) drives it
asynchronously; :meth:`OpenAIHandler.run` drives it synchronously over a local runner (tests and
tools).
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import time
import uuid
from collections.abc import Iterable, Iterator, Sequence
from dataclasses import dataclass, field
from typing import Any

from specserve.core.engine import GenerationFrontend
from specserve.core.errors import UserError
from specserve.core.prompts import PromptCodec
from specserve.core.request import GenerationConfig, GenerationResult, StreamChunk
from specserve.core.sampling.params import SamplingParams
from specserve.core.stats import RequestStats
from specserve.core.verify.processors import check_logit_bias
from specserve.serve.config import ServeConfig
from specserve.serve.errors import RequestError
from specserve.serve.logprob_shapes import TokenText, chat_logprobs, completion_logprobs, mean_logprob
from specserve.serve.schemas import ChatCompletionRequest, ChatMessage, CompletionRequest

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


def choice_seed(seed: int, index: int) -> int:
    """Choice ``index``'s seed: the request's for choice 0, a hash of both for the others, in [0, 2**63)."""
    if index == 0:
        return seed
    digest = hashlib.blake2b(f"{seed}:{index}".encode(), digest_size=8).digest()
    return int.from_bytes(digest, "big") >> 1


@dataclass
class ChoiceStream:
    """One choice of a streamed answer: its index and the characters of text sent so far (for ``text_offset``)."""

    index: int
    chars: int = 0


@dataclass(frozen=True)
class PreparedRequest:
    """One admitted request: what to run, and how to shape what comes back.

    ``n`` choices are returned of ``best_of`` generations (:meth:`choices`); ``index`` is the generation this
    object runs (0 for the request itself)."""

    prompt_ids: list[int]
    params: SamplingParams
    generation: GenerationConfig
    chat: bool
    stream: bool
    model: str
    request_id: str = field(default_factory=lambda: uuid.uuid4().hex)
    created: int = field(default_factory=lambda: int(time.time()))
    n: int = 1
    best_of: int = 1
    token_text: TokenText | None = None  # for logprobs: one token's text
    index: int = 0

    @property
    def kind(self) -> str:
        if self.chat:
            return "chat.completion.chunk" if self.stream else "chat.completion"
        return "text_completion"

    @property
    def wants_logprobs(self) -> bool:
        return self.params.logprobs is not None

    def choices(self) -> list[PreparedRequest]:
        """The generations to run: ``best_of`` of them, each with its own seed; ``best_of`` > ``n`` computes logprobs
        to rank them (the answer shows them only when asked for)."""
        if self.best_of == 1:
            return [self]
        ranked = self.best_of > self.n and self.params.logprobs is None
        return [
            dataclasses.replace(
                self,
                params=dataclasses.replace(
                    self.params, seed=choice_seed(self.params.seed, i), logprobs=0 if ranked else self.params.logprobs
                ),
                index=i,
            )
            for i in range(self.best_of)
        ]

    def _meta(self) -> dict[str, Any]:
        prefix = "chatcmpl" if self.chat else "cmpl"
        return {"id": f"{prefix}-{self.request_id}", "object": self.kind, "created": self.created, "model": self.model}

    def _logprobs(self, entries: Sequence[Any], offset: int = 0) -> dict[str, Any] | None:
        if not self.wants_logprobs or self.token_text is None:
            return None
        if self.chat:
            return chat_logprobs(entries, self.token_text)
        return completion_logprobs(entries, self.token_text, offset)

    # Whole answers ------------------------------------------------------------------------------

    def response(self, *results: GenerationResult) -> dict[str, Any]:
        """The whole answer from every generation's result (:meth:`choices` order)."""
        kept = list(results)
        if len(kept) > self.n:  # best_of: the n likeliest per token, in the order generated
            order = sorted(range(len(kept)), key=lambda i: -mean_logprob(kept[i].logprobs or []))[: self.n]
            kept = [kept[i] for i in sorted(order)]
        choices = []
        for index, result in enumerate(kept):
            choice: dict[str, Any] = {"index": index, "finish_reason": FINISH_REASONS[result.finish_reason]}
            logprobs = self._logprobs(result.logprobs or [])
            if self.chat:
                choice["message"] = {"role": "assistant", "content": result.text}
                if logprobs is not None:
                    choice["logprobs"] = logprobs
            else:
                choice["text"] = result.text
                choice["logprobs"] = logprobs
            choices.append(choice)
        return {
            **self._meta(),
            "choices": choices,
            "usage": usage(*results),
            "speculation": speculation_summary(pooled_stats(results), self.params),
        }

    def collect(self, chunks: Iterable[StreamChunk]) -> GenerationResult:
        """One generation's result: the last of its chunks."""
        for chunk in chunks:
            if chunk.result is not None:
                return chunk.result
        raise RuntimeError("the generation ended without a result")

    # Streamed answers ---------------------------------------------------------------------------

    def opening_events(self) -> list[str]:
        """Events sent before any text: chat streams announce the assistant's role first, for every choice."""
        if not self.chat:
            return []
        deltas = [{"index": i, "delta": {"role": "assistant"}} for i in range(self.n)]
        return [sse({**self._meta(), "choices": deltas})]

    def chunk_event(self, chunk: StreamChunk, choice: ChoiceStream | None = None) -> str | None:
        """The event for one chunk of new text of ``choice`` (default: the only one); ``None`` when it carries
        nothing to send. With one choice the finishing chunk carries ``usage`` and ``speculation``."""
        choice = choice or ChoiceStream(0)
        result = chunk.result
        finish = FINISH_REASONS[result.finish_reason] if result is not None else None
        if not chunk.text and finish is None and not chunk.token_ids:
            return None
        logprobs = self._logprobs(chunk.logprobs, choice.chars) if chunk.token_ids else None
        if not chunk.text and finish is None and logprobs is None:
            return None
        body_choice: dict[str, Any] = (
            {"index": choice.index, "delta": {"content": chunk.text} if chunk.text else {}, "finish_reason": finish}
            if self.chat
            else {"index": choice.index, "text": chunk.text, "logprobs": logprobs, "finish_reason": finish}
        )
        if self.chat and logprobs is not None:
            body_choice["logprobs"] = logprobs
        choice.chars += len(chunk.text)
        body: dict[str, Any] = {**self._meta(), "choices": [body_choice]}
        if result is not None and self.n == 1:
            body["usage"] = usage(result)
            body["speculation"] = speculation_summary(result.stats, self.params)
        return sse(body)

    def closing_events(self, results: Sequence[GenerationResult]) -> list[str]:
        """After every choice finished: with ``n`` > 1, one event with no choices that carries ``usage`` and
        ``speculation`` over all of them (a single choice sent them with its last chunk)."""
        if self.n == 1:
            return []
        speculation = speculation_summary(pooled_stats(results), self.params)
        return [sse({**self._meta(), "choices": [], "usage": usage(*results), "speculation": speculation})]

    def events(self, streams: Sequence[Iterable[StreamChunk]]) -> Iterator[str]:
        """Every choice's stream, one after the other (in process; the ingress interleaves them)."""
        yield from self.opening_events()
        results = []
        for index, chunks in enumerate(streams):
            choice = ChoiceStream(index)
            for chunk in chunks:
                event = self.chunk_event(chunk, choice)
                if event is not None:
                    yield event
                if chunk.result is not None:
                    results.append(chunk.result)
        yield from self.closing_events(results)
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

    def prepare(self, request: CompletionRequest | ChatCompletionRequest, tenant: str = "") -> PreparedRequest:
        """Check, tokenise and configure a request from ``tenant`` (a digest of its API key: its prefix-cache
        namespace, with its ``cache_salt``)."""
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
            params = request.sampling(self.config.drafter_invariant)
            generation = request.generation(
                self.config.default_max_tokens, self.config.gamma, self.config.policy, tenant
            )
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
        try:
            check_logit_bias(params, self.prompts.info.vocab_size)
        except UserError as exc:
            raise RequestError(f"logit_bias: {exc}", param="logit_bias") from exc
        try:  # the grammar compiles for this tokenizer (and comes without ignore_eos)
            self.prompts.check_grammar(params, generation.ignore_eos)
        except UserError as exc:
            param = "structured_outputs" if request.structured_outputs is not None else "response_format"
            raise RequestError(f"{param}: {exc}", param=param) from exc
        return PreparedRequest(
            ids,
            params,
            generation,
            chat,
            request.stream,
            self.config.model_name,
            n=request.n,
            best_of=request.choices(),
            token_text=self.token_text,
        )

    def token_text(self, token: int) -> str:
        """One token's text, special tokens included (for logprobs)."""
        tokenizer = self.prompts.tokenizer
        return "" if tokenizer is None else str(tokenizer.decode([token], skip_special_tokens=False))

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
        streams = [runner.stream(c.prompt_ids, c.params, c.generation) for c in prepared.choices()]
        if prepared.stream:
            return prepared.events(streams)
        return prepared.response(*(prepared.collect(chunks) for chunks in streams))


def usage(*results: GenerationResult) -> dict[str, Any]:
    """The prompt once, and every generation's output tokens; of the prompt, the tokens the prefix cache served
    (OpenAI's ``prompt_tokens_details.cached_tokens``: the most any generation reused)."""
    prompt, completion = len(results[0].prompt_ids), sum(len(result.output_ids) for result in results)
    cached = max(result.stats.cached_tokens for result in results)
    return {
        "prompt_tokens": prompt,
        "completion_tokens": completion,
        "total_tokens": prompt + completion,
        "prompt_tokens_details": {"cached_tokens": cached},
    }


def pooled_stats(results: Sequence[GenerationResult]) -> RequestStats:
    """One generation's stats, or every generation's pooled (n > 1)."""
    if len(results) == 1:
        return results[0].stats
    pooled = RequestStats()
    for result in results:
        pooled.merge(result.stats)
    return pooled
