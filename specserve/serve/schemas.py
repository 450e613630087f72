"""OpenAI-compatible request bodies, validated at the HTTP edge, and their translation to engine settings.

Requests are pydantic models whose every field carries a description; a request that violates
one (missing prompt, ``max_tokens`` <= 0, ``temperature`` < 0, ``top_p`` outside (0, 1], ``n``
> 1, an unknown field type) becomes a :class:`RequestError` with the OpenAI error shape
(``{"error": {"message", "type", "param", "code"}}``) and a 4xx status. Extensions beyond the
OpenAI API: ``top_k``, ``ignore_eos`` and the ``speculation`` object (drafting on/off, γ, and
the drafter: the deployment's configured one, ``ngram`` or ``none``; a draft model cannot be
chosen per request).

What a validated request means for the engine — sampling parameters and the generation config —
is decided here once (:meth:`CompletionRequest.sampling` / :meth:`CompletionRequest.generation`),
so the HTTP layer, tests and tools agree. Does not tokenise, check the context length (that
needs the model: the coordinator's prompt codec does it), or talk to Ray.
"""

from __future__ import annotations

from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, ValidationError, field_validator

from specserve.core.engine import MAX_GAMMA, GenerationConfig
from specserve.core.sampling import SamplingParams

MAX_STOP_STRINGS = 4  # as OpenAI


class RequestError(Exception):
    """A request the server refuses; ``body()`` is the OpenAI-style error JSON."""

    def __init__(self, message: str, status: int = 400, param: str | None = None, code: str | None = None):
        super().__init__(message)
        self.message, self.status, self.param, self.code = message, status, param, code

    def body(self) -> dict[str, Any]:
        kind = {401: "authentication_error", 404: "not_found_error", 413: "invalid_request_error"}.get(
            self.status, "invalid_request_error" if self.status < 500 else "server_error"
        )
        return {"error": {"message": self.message, "type": kind, "param": self.param, "code": self.code}}

    @classmethod
    def from_validation(cls, exc: ValidationError) -> RequestError:
        """The first field pydantic found wrong, phrased as what to fix.

        A value that fits no member of a union (``prompt: 5``) fails once per member, at
        ``prompt.str``, ``prompt.list[int]``...: those are reported together, at the field.
        """
        errors = exc.errors()
        field = errors[0]["loc"][:1]
        same_field = [error for error in errors if error["loc"][:1] == field]
        loc = _common_prefix([tuple(error["loc"]) for error in same_field])
        param = ".".join(str(part) for part in loc) or None
        reasons = " or ".join(dict.fromkeys(str(error["msg"]) for error in same_field))
        message = f"{param}: {reasons}" if param else reasons
        return cls(message, status=400, param=param, code="invalid_value")


def _common_prefix(locs: list[tuple[Any, ...]]) -> tuple[Any, ...]:
    prefix = locs[0]
    for loc in locs[1:]:
        n = 0
        while n < min(len(prefix), len(loc)) and prefix[n] == loc[n]:
            n += 1
        prefix = prefix[:n]
    return prefix


class SpeculationOptions(BaseModel):
    """The ``speculation`` extension object: how this request drafts."""

    model_config = ConfigDict(extra="forbid")

    enabled: bool = Field(True, description="draft and verify (true) or decode plainly (false); output is the same")
    gamma: int | None = Field(
        None, ge=1, le=MAX_GAMMA, description="draft tokens per cycle; default: the deployment's configured gamma"
    )
    drafter: Literal["default", "ngram", "none"] = Field(
        "default",
        description=(
            "who drafts: the deployment's configured drafter (default), prompt-lookup n-grams (ngram), or"
            " nobody (none: plain decoding); output is the same, only speed differs"
        ),
    )


class _Request(BaseModel):
    model_config = ConfigDict(extra="ignore")  # OpenAI clients send fields we do not use (user, logprobs: null...)

    model: str = Field(..., min_length=1, description="the served model's name (see GET /v1/models)")
    max_tokens: int | None = Field(None, ge=1, description="new tokens to generate at most; default: the server's")
    temperature: float = Field(1.0, ge=0.0, le=100.0, description="0 = greedy; otherwise sampling temperature")
    top_p: float = Field(1.0, gt=0.0, le=1.0, description="nucleus sampling mass in (0, 1]")
    top_k: int = Field(0, ge=0, description="extension: keep the k most likely tokens (0 = off)")
    seed: int | None = Field(None, ge=0, description="makes sampling reproducible for the same request")
    stop: str | list[str] | None = Field(None, description="up to 4 strings; generation stops before them")
    n: int = Field(1, description="number of choices; only 1 is supported")
    stream: bool = Field(False, description="stream the answer as server-sent events")
    ignore_eos: bool = Field(False, description="extension: keep generating past the end-of-sequence token")
    speculation: SpeculationOptions = Field(default_factory=SpeculationOptions, description="extension")

    @field_validator("n")
    @classmethod
    def _one_choice(cls, n: int) -> int:
        if n != 1:
            raise ValueError(f"only n = 1 is supported, got {n}; send several requests instead")
        return n

    @field_validator("stop")
    @classmethod
    def _stops(cls, stop: str | list[str] | None) -> str | list[str] | None:
        stops = [stop] if isinstance(stop, str) else list(stop or [])
        if len(stops) > MAX_STOP_STRINGS or any(not s for s in stops):
            raise ValueError(f"stop takes at most {MAX_STOP_STRINGS} non-empty strings")
        return stop

    def stop_strings(self) -> tuple[str, ...]:
        return (self.stop,) if isinstance(self.stop, str) else tuple(self.stop or ())

    def sampling(self) -> SamplingParams:
        return SamplingParams(temperature=self.temperature, top_p=self.top_p, top_k=self.top_k, seed=self.seed or 0)

    def generation(self, default_max_tokens: int, default_gamma: int) -> GenerationConfig:
        gamma = (self.speculation.gamma or default_gamma) if self.speculation.enabled else 0
        return GenerationConfig(
            max_new_tokens=self.max_tokens or default_max_tokens,
            gamma=gamma,
            stop=self.stop_strings(),
            ignore_eos=self.ignore_eos,
            drafter=self.speculation.drafter,
        )


class CompletionRequest(_Request):
    """``POST /v1/completions``."""

    prompt: str | list[int] = Field(..., description="the prompt text (or its token ids)")

    @field_validator("prompt")
    @classmethod
    def _non_empty(cls, prompt: str | list[int]) -> str | list[int]:
        if not prompt:
            raise ValueError("the prompt is empty; send at least one character")
        return prompt


class ChatMessage(BaseModel):
    model_config = ConfigDict(extra="ignore")

    role: Literal["system", "user", "assistant"] = Field(..., description="who said it")
    content: str = Field(..., description="what was said")


class ChatCompletionRequest(_Request):
    """``POST /v1/chat/completions``."""

    messages: list[ChatMessage] = Field(..., min_length=1, description="the conversation so far")


def parse_request(kind: type[_Request], body: bytes, max_body_bytes: int) -> Any:
    """Raw HTTP body -> a validated request, or a :class:`RequestError` saying what to fix."""
    if len(body) > max_body_bytes:
        raise RequestError(f"request body of {len(body)} bytes exceeds the limit of {max_body_bytes}", status=413)
    try:
        return kind.model_validate_json(body)
    except ValidationError as exc:
        if any(error["type"] == "json_invalid" for error in exc.errors()):
            raise RequestError("the request body is not valid JSON", code="invalid_json") from exc
        raise RequestError.from_validation(exc) from exc
