"""OpenAI-compatible request bodies, validated at the HTTP edge, and their translation to engine settings.

Requests are pydantic models whose every field carries a description. The edge is strict and
bounded: types are JSON's own (no ``true`` for a number, no ``"16"`` for an integer; an integer is
a number, as JSON clients send ``"temperature": 1``), every number has bounds (``seed`` in
[0, 2**63), ``top_k`` at most :data:`~specserve.core.sampling.params.MAX_TOP_K`, ``max_tokens`` at
most :data:`MAX_TOKENS`, no NaN or infinity...), an OpenAI field this server does not implement
(``tools``, ``echo``, ``suffix``...) is refused unless it asks for
nothing (absent, ``null`` or its no-op value), and a field that is no OpenAI field nor one of
ours is refused as unknown. ``user`` and ``stream_options`` are accepted and ignored (harmless).
A request that breaks a rule becomes a :class:`~specserve.serve.errors.RequestError` with the OpenAI
error shape (``{"error": {"message", "type", "param", "code"}}``) and a 4xx status, its message
naming the field in the client's words (:mod:`specserve.serve.errors`: the refusals and their words,
and :data:`~specserve.serve.errors.STRICT`, the strictness every request object shares).

OpenAI's ``logprobs`` (completions: how many alternatives; chat: ``logprobs`` + ``top_logprobs``), ``logit_bias``,
``presence_penalty``, ``frequency_penalty``, ``n``, (completions) ``best_of`` and ``response_format``
(``json_object``, ``json_schema``; on completions too, as in vLLM) are served, exactly under speculation
(:mod:`specserve.core.verify.processors`, :mod:`specserve.core.verify.logprobs`, :mod:`specserve.core.verify.grammar`),
and so is the ``structured_outputs`` extension (vLLM's: ``json``, ``regex``, ``grammar`` in Lark, ``choice``).

Extensions beyond the OpenAI API: ``top_k``, ``min_p``, ``repetition_penalty``, ``logprobs_mode`` (``raw`` or
``processed``), ``ignore_eos`` and the ``speculation`` object (how the request drafts, and its acceptance
rule: :mod:`specserve.serve.speculation_schema`).

What a validated request means for the engine — sampling parameters and the generation config —
is decided here once (:meth:`CompletionRequest.sampling` / :meth:`CompletionRequest.generation`),
so the HTTP layer, tests and tools agree: a temperature below :data:`GREEDY_BELOW` is greedy, as
in vLLM, and ``top_k`` beyond the vocabulary (or -1, vLLM's "off") truncates nothing. Does not
tokenise, check the context length or the prompt's token ids (that needs the model: the
coordinator's prompt codec does it), or talk to Ray.
"""

from __future__ import annotations

import hashlib
import json
import secrets
from typing import Annotated, Any, Literal

from pydantic import (
    BaseModel,
    ConfigDict,
    Field,
    ValidationError,
    ValidationInfo,
    ValidatorFunctionWrapHandler,
    field_validator,
    model_validator,
)

from specserve.core.request import GenerationConfig
from specserve.core.sampling.params import (
    GREEDY_BELOW,
    MAX_BIASED_TOKENS,
    MAX_GRAMMAR_CHARS,
    MAX_LOGIT_BIAS,
    MAX_LOGPROBS,
    MAX_PENALTY,
    MAX_REPETITION_PENALTY,
    MAX_TOP_K,
    GrammarSpec,
    SamplingParams,
)
from specserve.serve.errors import STRICT, RequestError, tagged_union_error
from specserve.serve.speculation_schema import SpeculationOptions

MAX_STOP_STRINGS = 4  # as OpenAI
MAX_STOP_CHARS = 256  # characters in one stop string (a stream holds back up to that much text)
MAX_TOKENS = 1 << 24  # far beyond any context (the prompt codec refuses more than the model's); keeps ints int64
MAX_SEED = 1 << 63  # exclusive: seeds are non-negative int64, what a torch.Generator takes
MAX_TEMPERATURE = 100.0
MAX_CHOICES = 16  # n and best_of: choices generated for one request


# ---------------------------------------------------------------------------------------------
# The OpenAI fields this server does not implement

# OpenAI fields this server does not implement, and the values that ask for nothing (some clients send them as
# defaults): absent, null or one of these is accepted; anything else is refused, naming the field, never ignored.
NO_OP_VALUES: dict[str, tuple[Any, ...]] = {
    "echo": (False,),
    "suffix": ("",),
    "tools": ([],),
    "tool_choice": ("none",),
    "functions": ([],),
    "function_call": ("none",),
    "modalities": (["text"],),
    "audio": (),
    "prediction": (),
    "reasoning_effort": (),
    "web_search_options": (),
    "max_completion_tokens": (),
    # fields of a chat message
    "name": (),
    "tool_calls": ([],),
    "tool_call_id": (),
    "refusal": (),
    "annotations": ([],),
}
UNSUPPORTED_HINTS = {"max_completion_tokens": "send max_tokens instead"}


def unsupported(what: str) -> Any:
    """A declared OpenAI field that this server refuses unless it asks for nothing (:func:`refuse_unsupported`)."""
    return Field(None, description=f"OpenAI's {what}: not supported; refused unless absent, null or a no-op value")


def _same(value: Any, no_op: Any) -> bool:
    return type(value) is type(no_op) and bool(value == no_op)  # so that 0 is no False, 1 no True


def refuse_unsupported(value: Any, info: ValidationInfo) -> Any:
    """The field validator of :func:`unsupported` fields: a value that asks for something is refused."""
    name = str(info.field_name)
    if value is None or any(_same(value, no_op) for no_op in NO_OP_VALUES[name]):
        return value
    raise ValueError(f"not supported by this server; {UNSUPPORTED_HINTS.get(name, 'leave it out')}")


class TextFormat(BaseModel):
    """``{"type": "text"}``: free text (the default)."""

    model_config = STRICT

    type: Literal["text"] = Field(..., description="free text")


class JsonObjectFormat(BaseModel):
    """``{"type": "json_object"}``: any JSON object."""

    model_config = STRICT

    type: Literal["json_object"] = Field(..., description="a JSON object")


class JsonSchemaSpec(BaseModel):
    """OpenAI's ``json_schema`` object: a name and the schema the output must follow."""

    model_config = ConfigDict(extra="forbid", strict=True, allow_inf_nan=False, populate_by_name=True)

    name: str = Field(..., min_length=1, max_length=64, pattern=r"^[A-Za-z0-9_-]+$", description="the format's name")
    description: str | None = Field(None, max_length=1024, description="what the format is for (not used)")
    json_schema: dict[str, Any] = Field(
        default_factory=dict, alias="schema", description="the JSON schema the output follows ({} = any JSON)"
    )
    strict: bool | None = Field(None, description="accepted: the output always follows the schema")


class JsonSchemaFormat(BaseModel):
    """``{"type": "json_schema", "json_schema": {"name": ..., "schema": {...}}}``: JSON following a schema."""

    model_config = STRICT

    type: Literal["json_schema"] = Field(..., description="JSON following a schema")
    json_schema: JsonSchemaSpec = Field(..., description="the schema and its name")


FORMAT_TYPES = ("text", "json_object", "json_schema")
ResponseFormat = Annotated[TextFormat | JsonObjectFormat | JsonSchemaFormat, Field(discriminator="type")]


class StructuredOutputs(BaseModel):
    """The ``structured_outputs`` extension (vLLM's): exactly one of a JSON schema, a regex, a Lark grammar or a
    list of choices."""

    model_config = ConfigDict(extra="forbid", strict=True, allow_inf_nan=False, populate_by_name=True)

    json_schema: dict[str, Any] | None = Field(None, alias="json", description="a JSON schema the output follows")
    regex: str | None = Field(None, min_length=1, max_length=MAX_GRAMMAR_CHARS, description="a regular expression")
    grammar: str | None = Field(
        None, min_length=1, max_length=MAX_GRAMMAR_CHARS, description="a Lark grammar (llguidance's dialect)"
    )
    choice: list[Annotated[str, Field(min_length=1, max_length=1024)]] | None = Field(
        None, min_length=1, max_length=256, description="the output is exactly one of these strings"
    )

    @model_validator(mode="after")
    def _exactly_one(self) -> StructuredOutputs:
        given = [value for value in (self.json_schema, self.regex, self.grammar, self.choice) if value is not None]
        if len(given) != 1:
            raise ValueError("give exactly one of json, regex, grammar or choice")
        return self

    def spec(self) -> GrammarSpec:
        if self.json_schema is not None:
            return GrammarSpec("json_schema", json.dumps(self.json_schema))
        if self.regex is not None:
            return GrammarSpec("regex", self.regex)
        if self.grammar is not None:
            return GrammarSpec("lark", self.grammar)
        return GrammarSpec("lark", "start: " + " | ".join(json.dumps(option) for option in self.choice or ()))


class StreamOptions(BaseModel):
    """OpenAI's ``stream_options``: accepted and ignored (the last event of a stream carries ``usage`` anyway)."""

    model_config = ConfigDict(extra="ignore", strict=True)

    include_usage: bool | None = Field(None, description="ignored: usage is always sent with the last event")


class _Request(BaseModel):
    model_config = STRICT

    model: str = Field(..., min_length=1, max_length=256, description="the served model's name (see GET /v1/models)")
    max_tokens: int | None = Field(
        None, ge=1, le=MAX_TOKENS, description="new tokens to generate at most; default: the server's"
    )
    temperature: float = Field(
        1.0,
        ge=0.0,
        le=MAX_TEMPERATURE,
        description=f"0 = greedy; otherwise the sampling temperature (below {GREEDY_BELOW:g}: greedy, as in vLLM)",
    )
    top_p: float = Field(1.0, gt=0.0, le=1.0, description="nucleus sampling mass in (0, 1]")
    top_k: int = Field(
        0,
        ge=-1,
        le=MAX_TOP_K,
        description="extension: keep the k most likely tokens (0 or -1 = off; beyond the vocabulary: no truncation)",
    )
    seed: int | None = Field(
        None,
        ge=0,
        lt=MAX_SEED,
        description="in [0, 2**63); makes sampling reproducible for the same request (none: a random seed each time)",
    )
    stop: str | list[str] | None = Field(
        None,
        description=f"up to {MAX_STOP_STRINGS} non-empty strings of at most {MAX_STOP_CHARS} characters;"
        " generation stops before them",
    )
    n: int = Field(
        1,
        ge=1,
        le=MAX_CHOICES,
        description=f"choices to generate, each sampled with its own seed (at most {MAX_CHOICES})",
    )
    presence_penalty: float = Field(
        0.0, ge=-MAX_PENALTY, le=MAX_PENALTY, description="subtracted once from each token already in the output"
    )
    frequency_penalty: float = Field(
        0.0, ge=-MAX_PENALTY, le=MAX_PENALTY, description="subtracted per occurrence of a token in the output"
    )
    repetition_penalty: float = Field(
        1.0,
        gt=0.0,
        le=MAX_REPETITION_PENALTY,
        description="extension: divides the positive logits (multiplies the negative) of tokens in the prompt or"
        " output, as transformers and vLLM do (1 = off)",
    )
    logit_bias: dict[str, float] | None = Field(
        None,
        description=f"token id (as a string) -> bias in [-{MAX_LOGIT_BIAS:g}, {MAX_LOGIT_BIAS:g}] added to its logit"
        f" at every position; at most {MAX_BIASED_TOKENS} tokens",
    )
    min_p: float = Field(
        0.0, ge=0.0, le=1.0, description="extension: drop tokens less likely than min_p times the most likely (0 = off)"
    )
    response_format: ResponseFormat | None = Field(
        None,
        description='{"type": "text"} (default), {"type": "json_object"} or {"type": "json_schema", "json_schema":'
        ' {"name": ..., "schema": {...}}}: every position is masked to what the format allows (exact under'
        " speculation)",
    )
    structured_outputs: StructuredOutputs | None = Field(
        None,
        description='extension (vLLM\'s): {"json": schema}, {"regex": "..."}, {"grammar": "Lark"} or {"choice":'
        " [...]}, one of them; not together with response_format",
    )
    logprobs_mode: Literal["raw", "processed"] = Field(
        "raw",
        description="extension: logprobs under the model's own distribution (raw) or the one each token was chosen"
        " from, after biases, penalties and the sampling warps (processed)",
    )
    stream: bool = Field(False, description="stream the answer as server-sent events")
    ignore_eos: bool = Field(False, description="extension: keep generating past the end-of-sequence token")
    speculation: SpeculationOptions = Field(default_factory=SpeculationOptions, description="extension")
    cache_salt: str | None = Field(
        None,
        min_length=1,
        max_length=256,
        description="extension (vLLM's): requests reuse each other's cached prompt prefixes only when they carry the "
        "same salt (and API key); give each tenant its own, so one cannot learn another's prompts from timing",
    )
    # accepted and ignored
    user: str | None = Field(None, max_length=256, description="OpenAI's end-user id: accepted and ignored")
    stream_options: StreamOptions | None = Field(None, description="accepted and ignored")

    @field_validator("response_format", mode="wrap")
    @classmethod
    def _one_format_error(cls, value: Any, handler: ValidatorFunctionWrapHandler) -> Any:
        """Faults inside ``response_format`` are reported at it (see :func:`tagged_union_error`)."""
        try:
            return handler(value)
        except ValidationError as exc:
            raise tagged_union_error(exc, "type", FORMAT_TYPES) from exc

    @field_validator("structured_outputs")
    @classmethod
    def _one_format(cls, outputs: StructuredOutputs | None, info: ValidationInfo) -> StructuredOutputs | None:
        given = info.data.get("response_format")
        if outputs is not None and given is not None and not isinstance(given, TextFormat):
            raise ValueError("response_format already asks for a format; send one of the two")
        return outputs

    @field_validator("logit_bias")
    @classmethod
    def _token_biases(cls, bias: dict[str, float] | None) -> dict[str, float] | None:
        if bias is None:
            return None
        if len(bias) > MAX_BIASED_TOKENS:
            raise ValueError(f"at most {MAX_BIASED_TOKENS} tokens may be biased, got {len(bias)}")
        for key, value in bias.items():
            if not key.isascii() or not key.isdigit() or len(key) > 12:
                raise ValueError(f'keys must be token ids written as strings of digits, e.g. "50256"; got {key!r}')
            if not -MAX_LOGIT_BIAS <= value <= MAX_LOGIT_BIAS:
                raise ValueError(f"biases must be in [-{MAX_LOGIT_BIAS:g}, {MAX_LOGIT_BIAS:g}], got {value} for {key}")
        if len({int(key) for key in bias}) != len(bias):
            raise ValueError('a token id is named twice (e.g. "7" and "07")')
        return bias

    def logprobs_wanted(self) -> int | None:
        """How many alternatives per token the request asks for; ``None``: no logprobs at all."""
        raise NotImplementedError

    @field_validator("stop")
    @classmethod
    def _stops(cls, stop: str | list[str] | None) -> str | list[str] | None:
        stops = [stop] if isinstance(stop, str) else list(stop or [])
        if len(stops) > MAX_STOP_STRINGS or any(not 0 < len(s) <= MAX_STOP_CHARS for s in stops):
            raise ValueError(
                f"stop takes at most {MAX_STOP_STRINGS} non-empty strings of at most {MAX_STOP_CHARS} characters"
            )
        return stop

    def stop_strings(self) -> tuple[str, ...]:
        return (self.stop,) if isinstance(self.stop, str) else tuple(self.stop or ())

    def sampling(self, default_invariant: bool = False) -> SamplingParams:
        """The engine's sampling parameters: a temperature below :data:`GREEDY_BELOW` is greedy, top_k -1 is 0;
        ``default_invariant``: the deployment samples drafter-invariantly when a request does not say (a request
        under typical acceptance never does: that rule is lossy, invariance is exact)."""
        invariant = self.speculation.drafter_invariant
        if invariant is None:
            invariant = default_invariant and self.speculation.acceptance != "typical"
        return SamplingParams(
            temperature=self.temperature,  # below GREEDY_BELOW: SamplingParams makes it greedy
            top_p=self.top_p,
            top_k=max(self.top_k, 0),
            seed=self.seed if self.seed is not None else secrets.randbits(63),  # no seed: fresh randomness
            drafter_invariant=invariant,
            acceptance=self.speculation.acceptance,
            lossy=self.speculation.lossy,
            typical_epsilon=self.speculation.typical_epsilon,
            typical_delta=self.speculation.typical_delta,
            presence_penalty=self.presence_penalty,
            frequency_penalty=self.frequency_penalty,
            repetition_penalty=self.repetition_penalty,
            logit_bias=tuple(sorted((int(key), value) for key, value in (self.logit_bias or {}).items())),
            min_p=self.min_p,
            logprobs=self.logprobs_wanted(),
            logprobs_mode=self.logprobs_mode,
            grammar=self.grammar(),
        )

    def grammar(self) -> GrammarSpec | None:
        """The structured output asked for (``response_format`` or ``structured_outputs``); ``None``: free text."""
        if self.structured_outputs is not None:
            return self.structured_outputs.spec()
        if isinstance(self.response_format, JsonObjectFormat):
            return GrammarSpec.json_object()
        if isinstance(self.response_format, JsonSchemaFormat):
            return GrammarSpec("json_schema", json.dumps(self.response_format.json_schema.json_schema or {}))
        return None

    def choices(self) -> int:
        """How many completions to generate (``best_of`` for completions, else ``n``)."""
        return self.n

    def generation(
        self, default_max_tokens: int, default_gamma: int, default_policy: str = "fixed", tenant: str = ""
    ) -> GenerationConfig:
        """The request's generation settings, with the deployment's defaults where it sets none; ``tenant``: who sent
        it (a digest of its API key), which with its ``cache_salt`` names its prefix-cache namespace."""
        speculation = self.speculation
        gamma = (speculation.gamma or default_gamma) if speculation.enabled else 0
        policy = default_policy if speculation.policy == "default" else speculation.policy
        return GenerationConfig(
            max_new_tokens=self.max_tokens or default_max_tokens,
            gamma=gamma,
            stop=self.stop_strings(),
            ignore_eos=self.ignore_eos,
            drafter=speculation.drafter,
            tree=speculation.tree.spec() if speculation.enabled else None,
            policy=policy if speculation.enabled else "fixed",
            cache_namespace=cache_namespace(tenant, self.cache_salt),
        )


def cache_namespace(tenant: str, salt: str | None) -> str:
    """The prefix-cache namespace of a request from ``tenant`` with ``cache_salt`` ``salt``: "" for neither, else a
    digest of both (the engine sees no key or salt)."""
    if not tenant and salt is None:
        return ""
    return hashlib.sha256(f"{tenant}\0{salt or ''}".encode()).hexdigest()[:32]


class CompletionRequest(_Request):
    """``POST /v1/completions``."""

    prompt: str | list[int] = Field(..., description="the prompt text (or its token ids)")
    logprobs: int | None = Field(
        None,
        ge=0,
        le=MAX_LOGPROBS,
        description=f"the log-probability of every token and its 0 to {MAX_LOGPROBS} most likely alternatives",
    )
    best_of: int | None = Field(
        None,
        ge=1,
        le=MAX_CHOICES,
        description="generate this many completions and return the n with the highest mean log-probability per"
        " token (not with stream)",
    )
    echo: Any = unsupported("echo of the prompt")
    suffix: Any = unsupported("suffix (insertion)")

    _unsupported_completion = field_validator("echo", "suffix")(refuse_unsupported)

    @field_validator("logprobs", mode="before")
    @classmethod
    def _false_is_none(cls, logprobs: Any) -> Any:
        """``false`` (which some clients send, as chat's boolean) asks for no logprobs; ``true`` names no count."""
        if logprobs is False:
            return None
        if logprobs is True:
            raise ValueError(f"completions take the number of alternatives, 0 to {MAX_LOGPROBS}; true names none")
        return logprobs

    @field_validator("best_of")
    @classmethod
    def _best_of(cls, best_of: int | None, info: ValidationInfo) -> int | None:
        n = info.data.get("n", 1)
        if best_of is not None and best_of < n:
            raise ValueError(f"best_of ({best_of}) must be at least n ({n})")
        if best_of is not None and best_of > n and info.data.get("stream"):
            raise ValueError("best_of > n cannot stream: the best completions are known only at the end")
        return best_of

    def logprobs_wanted(self) -> int | None:
        return self.logprobs

    def choices(self) -> int:
        return self.best_of or self.n

    @field_validator("prompt")
    @classmethod
    def _non_empty(cls, prompt: str | list[int]) -> str | list[int]:
        if not prompt:
            raise ValueError("the prompt is empty; send at least one character")
        return prompt


class ChatMessage(BaseModel):
    model_config = STRICT

    role: Literal["system", "user", "assistant"] = Field(..., description="who said it")
    content: str = Field(..., description="what was said")
    name: Any = unsupported("participant name")
    tool_calls: Any = unsupported("tool calls")
    tool_call_id: Any = unsupported("tool call id")
    function_call: Any = unsupported("function call")
    refusal: Any = unsupported("refusal")
    annotations: Any = unsupported("annotations")
    audio: Any = unsupported("audio")

    _unsupported = field_validator(
        "name", "tool_calls", "tool_call_id", "function_call", "refusal", "annotations", "audio"
    )(refuse_unsupported)


CHAT_UNSUPPORTED = (
    "tools",
    "tool_choice",
    "functions",
    "function_call",
    "modalities",
    "audio",
    "prediction",
    "reasoning_effort",
    "web_search_options",
    "max_completion_tokens",
)


class ChatCompletionRequest(_Request):
    """``POST /v1/chat/completions``."""

    messages: list[ChatMessage] = Field(..., min_length=1, description="the conversation so far")
    parallel_tool_calls: bool | None = Field(None, description="accepted and ignored (tools are not supported)")
    logprobs: bool | None = Field(None, description="return the log-probability of every token of the message")
    top_logprobs: int | None = Field(
        None,
        ge=0,
        le=MAX_LOGPROBS,
        description=f"with logprobs: the 0 to {MAX_LOGPROBS} most likely alternatives at every token",
    )
    tools: Any = unsupported("tools")
    tool_choice: Any = unsupported("tool choice")
    functions: Any = unsupported("functions (deprecated tools)")
    function_call: Any = unsupported("function call (deprecated tool choice)")
    modalities: Any = unsupported("output modalities")
    audio: Any = unsupported("audio output")
    prediction: Any = unsupported("predicted output")
    reasoning_effort: Any = unsupported("reasoning effort")
    web_search_options: Any = unsupported("web search")
    max_completion_tokens: Any = unsupported("max_completion_tokens (send max_tokens)")

    _unsupported_chat = field_validator(*CHAT_UNSUPPORTED)(refuse_unsupported)

    @field_validator("top_logprobs")
    @classmethod
    def _top_needs_logprobs(cls, top: int | None, info: ValidationInfo) -> int | None:
        if top is not None and not info.data.get("logprobs"):
            raise ValueError("top_logprobs needs logprobs: true")
        return top

    def logprobs_wanted(self) -> int | None:
        return (self.top_logprobs or 0) if self.logprobs else None


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
