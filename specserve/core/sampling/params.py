"""A request's sampling parameters, checked when made. Torch-free.

:class:`SamplingParams` is what every front end builds (the command line, the HTTP schema, the
Python API) and every engine reads; its checks run before any model or torch loads, so a bad
value is refused at once with a message saying what is allowed. A positive temperature below
:data:`GREEDY_BELOW` is greedy (stored as 0), as in vLLM: dividing logits by it would overflow.
The warps and draws that use it are :mod:`specserve.core.sampling.warps`; the meaning of each mode is
documented there.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Literal

from specserve.core.errors import UserError

MAX_TOP_K = 1 << 20
# A positive temperature below this samples greedily (vLLM's _SAMPLING_EPS). At 1e-5 the warped distribution is
# one-hot to float32 precision already unless the top logits are within ~1e-3 of each other, and far below it
# logits / temperature overflows (at ~1e-36 for float32 logits: inf, then NaN probabilities).
GREEDY_BELOW = 1e-5
Acceptance = Literal["exact", "typical"]
ACCEPTANCE_MODES: tuple[Acceptance, ...] = ("exact", "typical")
# Medusa's defaults (Cai et al. 2024; its code's posterior_threshold and posterior_alpha = sqrt(threshold)).
TYPICAL_EPSILON = 0.09
TYPICAL_DELTA = 0.3
# OpenAI's bounds for presence / frequency penalties and logit biases; at most this many biased tokens (OpenAI: 300).
MAX_PENALTY = 2.0
MAX_LOGIT_BIAS = 100.0
MAX_BIASED_TOKENS = 1024
MAX_REPETITION_PENALTY = 10.0
MAX_LOGPROBS = 20  # alternatives per token (OpenAI's chat maximum)
LogprobsMode = Literal["raw", "processed"]
LOGPROBS_MODES: tuple[LogprobsMode, ...] = ("raw", "processed")


class InvalidSamplingParams(UserError):
    """A sampling parameter is out of range; the message says which and what is allowed."""


GrammarKind = Literal["json_schema", "regex", "lark"]
GRAMMAR_KINDS: tuple[GrammarKind, ...] = ("json_schema", "regex", "lark")
MAX_GRAMMAR_CHARS = 1 << 16


@dataclass(frozen=True)
class GrammarSpec:
    """Structured output: the text must match ``source``, a JSON schema (as JSON text), a regular expression or a
    Lark grammar. Compiled against the model's tokenizer by :mod:`specserve.core.verify.grammar`."""

    kind: GrammarKind
    source: str

    def __post_init__(self) -> None:
        if self.kind not in GRAMMAR_KINDS:
            raise InvalidSamplingParams(f"a grammar is json_schema, regex or lark, got {self.kind!r}")
        if not isinstance(self.source, str) or not self.source:
            raise InvalidSamplingParams(f"the {self.kind} grammar is empty")
        if len(self.source) > MAX_GRAMMAR_CHARS:
            raise InvalidSamplingParams(
                f"the {self.kind} grammar has {len(self.source)} characters, more than {MAX_GRAMMAR_CHARS}"
            )

    @classmethod
    def json_object(cls) -> GrammarSpec:
        """Any JSON object (OpenAI's ``response_format: {"type": "json_object"}``)."""
        return cls("json_schema", '{"type": "object"}')


@dataclass(frozen=True)
class SamplingParams:
    temperature: float = 0.0
    top_k: int = 0  # 0 = no top-k truncation
    top_p: float = 1.0  # 1 = no nucleus truncation
    seed: int = 0
    # Drafter-invariant sampling (specserve.core.verify.invariant): tokens are argmax(log p + Gumbel noise keyed
    # by (seed, absolute position)); same seed -> same output whatever the drafter, gamma, tree or TP
    # degree. Exact, but accepts fewer drafts than rejection sampling. No effect when greedy.
    drafter_invariant: bool = False
    # How drafts are accepted: "exact" (the rules of docs/verification.md) or "typical" (Medusa's typical acceptance,
    # specserve.core.verify.typical: LOSSY, the output is no longer distributed as the target's). "typical" runs only
    # with lossy=True, the explicit opt-in; epsilon and delta are its threshold min(epsilon, delta * exp(-H(p))).
    acceptance: Acceptance = "exact"
    lossy: bool = False
    typical_epsilon: float = TYPICAL_EPSILON
    typical_delta: float = TYPICAL_DELTA
    # Logit processors (specserve.core.verify.processors), applied to every verified position with the text up to it,
    # drafted tokens included: OpenAI's presence / frequency penalties (over the output), the repetition penalty of
    # transformers and vLLM (over prompt and output), logit_bias ((token id, bias) pairs, sorted), and min_p (a warp,
    # after top-p as transformers applies it). Neutral values change nothing.
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    repetition_penalty: float = 1.0
    logit_bias: tuple[tuple[int, float], ...] = ()
    min_p: float = 0.0
    # The log-probability of every emitted token and its ``logprobs`` most likely alternatives (None: none at all)
    # under the raw model's distribution or the processed one (specserve.core.verify.logprobs).
    logprobs: int | None = None
    logprobs_mode: LogprobsMode = "raw"
    # Of the prompt, the last this many tokens are earlier output (a resumed request): the penalties count them as
    # output, and the grammar has matched them, as before the request moved.
    prior_output_tokens: int = 0
    # Structured output: every position's distribution is masked to the tokens the grammar allows there
    # (specserve.core.verify.grammar); None = free text.
    grammar: GrammarSpec | None = None

    def __post_init__(self) -> None:
        if not (self.temperature >= 0.0) or self.temperature == float("inf"):
            raise InvalidSamplingParams(f"temperature must be a finite number >= 0, got {self.temperature}")
        if self.temperature < GREEDY_BELOW:
            object.__setattr__(self, "temperature", 0.0)  # greedy (GREEDY_BELOW), wherever the value came from
        if not (0.0 < self.top_p <= 1.0):
            raise InvalidSamplingParams(f"top_p must be in (0, 1], got {self.top_p}")
        if self.top_k < 0 or self.top_k > MAX_TOP_K:
            raise InvalidSamplingParams(f"top_k must be between 0 (off) and {MAX_TOP_K}, got {self.top_k}")
        if not (0 <= self.seed < 2**63):
            raise InvalidSamplingParams(f"seed must be in [0, 2**63), got {self.seed}")
        if not isinstance(self.drafter_invariant, bool):
            raise InvalidSamplingParams(f"drafter_invariant must be true or false, got {self.drafter_invariant!r}")
        self._check_acceptance()
        self._check_processors()

    def _check_processors(self) -> None:
        for name in ("presence_penalty", "frequency_penalty"):
            value = getattr(self, name)
            if not (-MAX_PENALTY <= value <= MAX_PENALTY):
                raise InvalidSamplingParams(f"{name} must be in [-{MAX_PENALTY:g}, {MAX_PENALTY:g}], got {value}")
        if not (0.0 < self.repetition_penalty <= MAX_REPETITION_PENALTY):
            raise InvalidSamplingParams(
                f"repetition_penalty must be in (0, {MAX_REPETITION_PENALTY:g}] (1 = off),"
                f" got {self.repetition_penalty}"
            )
        if not (0.0 <= self.min_p <= 1.0):
            raise InvalidSamplingParams(f"min_p must be in [0, 1] (0 = off), got {self.min_p}")
        if isinstance(self.logit_bias, Mapping):  # a dict is accepted and stored as sorted pairs
            object.__setattr__(self, "logit_bias", tuple(sorted(self.logit_bias.items())))
        if len(self.logit_bias) > MAX_BIASED_TOKENS:
            raise InvalidSamplingParams(
                f"logit_bias holds at most {MAX_BIASED_TOKENS} tokens, got {len(self.logit_bias)}"
            )
        for token, bias in self.logit_bias:
            if isinstance(token, bool) or not isinstance(token, int) or token < 0:
                raise InvalidSamplingParams(f"logit_bias keys must be token ids >= 0, got {token!r}")
            if not (-MAX_LOGIT_BIAS <= bias <= MAX_LOGIT_BIAS):
                raise InvalidSamplingParams(
                    f"logit_bias values must be in [-{MAX_LOGIT_BIAS:g}, {MAX_LOGIT_BIAS:g}], got {bias} for {token}"
                )
        if len({token for token, _ in self.logit_bias}) != len(self.logit_bias):
            raise InvalidSamplingParams("logit_bias names a token twice")
        if self.logprobs is not None and not (0 <= self.logprobs <= MAX_LOGPROBS):
            raise InvalidSamplingParams(
                f"logprobs must be between 0 (the chosen token's only) and {MAX_LOGPROBS}, got {self.logprobs}"
            )
        if self.logprobs_mode not in LOGPROBS_MODES:
            raise InvalidSamplingParams(f"logprobs_mode must be 'raw' or 'processed', got {self.logprobs_mode!r}")
        if self.prior_output_tokens < 0:
            raise InvalidSamplingParams(f"prior_output_tokens must be >= 0, got {self.prior_output_tokens}")
        if self.grammar is not None and not isinstance(self.grammar, GrammarSpec):
            raise InvalidSamplingParams(f"grammar must be a GrammarSpec, got {type(self.grammar).__name__}")

    def _check_acceptance(self) -> None:
        if self.acceptance not in ACCEPTANCE_MODES:
            raise InvalidSamplingParams(f"acceptance must be 'exact' or 'typical', got {self.acceptance!r}")
        if not isinstance(self.lossy, bool):
            raise InvalidSamplingParams(f"lossy must be true or false, got {self.lossy!r}")
        if not (0.0 < self.typical_epsilon < 1.0):
            raise InvalidSamplingParams(f"typical_epsilon must be in (0, 1), got {self.typical_epsilon}")
        if not (0.0 < self.typical_delta <= 1.0):
            raise InvalidSamplingParams(f"typical_delta must be in (0, 1], got {self.typical_delta}")
        if self.acceptance == "typical" and not self.lossy:
            raise InvalidSamplingParams(
                "typical acceptance is lossy: the output is no longer distributed as the target's; "
                "opt in explicitly with lossy=True (CLI --lossy, HTTP speculation.lossy: true)"
            )
        if self.acceptance == "typical" and self.drafter_invariant:
            raise InvalidSamplingParams(
                "typical acceptance cannot be combined with drafter_invariant (which is exact); choose one"
            )

    @property
    def greedy(self) -> bool:
        return self.temperature == 0.0

    @property
    def invariant_sampling(self) -> bool:
        """Tokens come from the keyed Gumbel noise of :mod:`specserve.core.verify.invariant` (asked for and not
        greedy)."""
        return self.drafter_invariant and not self.greedy

    @property
    def penalised(self) -> bool:
        """A logit processor runs (a penalty or a bias): every verified row is processed with its own history."""
        return bool(
            self.presence_penalty or self.frequency_penalty or self.repetition_penalty != 1.0 or self.logit_bias
        )

    @property
    def lossy_acceptance(self) -> bool:
        """A lossy acceptance rule runs (typical): every output made with these parameters must say ``lossy``."""
        return self.acceptance != "exact"

    @property
    def mode(self) -> str:
        """How the target's tokens are chosen, as outputs report it: ``greedy`` (temperature 0),
        ``drafter_invariant`` (keyed Gumbel noise, :mod:`specserve.core.verify.invariant`), ``typical`` (lossy typical
        acceptance, :mod:`specserve.core.verify.typical`) or ``rejection`` (speculative rejection sampling)."""
        if self.greedy:
            return "greedy"
        if self.lossy_acceptance:
            return "typical"
        return "drafter_invariant" if self.invariant_sampling else "rejection"
