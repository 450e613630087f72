"""One request: what it asks for, what it gets back, and the one constructor that starts it.

What a request asks for beyond its sampling parameters is a :class:`GenerationConfig`; what it gets back streams
through a :class:`RequestOutput` (stop strings, detokenisation, finishing) as :class:`StreamChunk` s, the last
carrying the :class:`GenerationResult`. :func:`start_request` builds, from a request's parameters, everything its
cycles run on — its generators, its :class:`~specserve.core.draft_side.DraftSide`, its
:class:`~specserve.core.target.TargetVerifier` and its :class:`RequestOutput` — the same way for the single-request
engine and the batched engine. Where a request's halves live in different processes, each builds its half here:
rank 0 of a target replica its verifier (:func:`new_verifier`), the drafter actor its draft side
(:func:`new_draft_side`), the coordinator its output (:func:`request_output`).

A request's grammar is compiled once: :func:`new_verifier` asks :mod:`specserve.core.verify.grammar` for it, which
compiles each spec once per vocabulary and hands every user (the edge's check, the verifier, a draft model) a fresh
matcher of that one compiled grammar.

Does not run a cycle, prefill the prompt, allocate or free KV, build or choose the drafter, or start it
(:meth:`~specserve.core.draft_side.DraftSide.start`: its driver does, once the target's cache or features it may
read are there).
"""

from __future__ import annotations

import time
from collections.abc import Generator, Sequence
from dataclasses import dataclass, field

import torch

from specserve.core.detokenize import Decode, TextStream
from specserve.core.draft.drafter import Drafter, check_drafter_name
from specserve.core.draft.schedule import MAX_GAMMA, Budget, ScheduleFactory, check_policy_name
from specserve.core.draft_side import DraftSide
from specserve.core.errors import InvalidRequest
from specserve.core.model.causal_lm import CausalLM
from specserve.core.sampling.params import SamplingParams
from specserve.core.sampling.warps import RequestGenerators, make_generators
from specserve.core.stats import RequestStats
from specserve.core.target import FinishReason, TargetSequence, TargetVerifier
from specserve.core.tree.shapes import TreeSpec
from specserve.core.verify.grammar import request_grammar
from specserve.core.verify.logprobs import TokenLogprob

__all__ = [
    "ChunkStream",
    "GenerationConfig",
    "GenerationResult",
    "RequestOutput",
    "StartedRequest",
    "StreamChunk",
    "new_draft_side",
    "new_verifier",
    "request_output",
    "start_request",
]


# ---------------------------------------------------------------------------------------------
# What a request asks for and what it gets back


@dataclass(frozen=True)
class GenerationConfig:
    max_new_tokens: int = 128
    gamma: int = 4  # draft tokens per cycle (the drafter may return fewer)
    stop: tuple[str, ...] = ()
    ignore_eos: bool = False
    drafter: str = "default"  # one of REQUEST_DRAFTERS: the configured one, "ngram", "suffix", "lookahead", "none"
    tree: TreeSpec | None = None  # draft trees instead of chains (drafters that can; gamma unused)
    policy: str = "fixed"  # how much to draft each cycle: POLICY_NAMES (gamma / tree = the fixed budget)
    # the prefix cache's namespace: a request reuses only prefixes cached by requests of the same one (a tenant's)
    cache_namespace: str = ""

    def __post_init__(self) -> None:
        if self.max_new_tokens < 1:
            raise InvalidRequest(f"max_new_tokens must be >= 1, got {self.max_new_tokens}")
        if not 0 <= self.gamma <= MAX_GAMMA:
            raise InvalidRequest(f"gamma must be between 1 and {MAX_GAMMA} (0 = no drafting), got {self.gamma}")
        if any(not isinstance(s, str) or not s for s in self.stop):
            raise InvalidRequest("stop strings must be non-empty strings")
        check_drafter_name(self.drafter)
        check_policy_name(self.policy)

    @property
    def budget(self) -> Budget:
        """The request's own budget: what the fixed policy drafts every cycle (and where the others start)."""
        return Budget(self.gamma, self.tree)


@dataclass
class GenerationResult:
    prompt_ids: list[int]
    output_ids: list[int]
    text: str
    finish_reason: FinishReason
    stats: RequestStats = field(default_factory=RequestStats)
    logprobs: list[TokenLogprob] | None = None  # one per output token when the request asked for them


@dataclass(frozen=True)
class StreamChunk:
    text: str  # new text since the previous chunk (may be empty)
    token_ids: list[int]  # tokens committed in this cycle
    result: GenerationResult | None = None  # set on the last chunk only
    logprobs: tuple[TokenLogprob, ...] = ()  # one per token of token_ids when the request asked for them


ChunkStream = Generator[StreamChunk, None, None]  # a generation: close it to stop early and free its state


class RequestOutput:
    """One request's output as it streams: cuts at stop strings, detokenises, finishes, shapes each chunk.

    Step 4 of the loop, shared by the in-process engine and the distributed coordinator so the two
    stream identical chunks for identical committed tokens.
    """

    def __init__(
        self, prompt_ids: Sequence[int], text: TextStream, stats: RequestStats, start: float, logprobs: bool = False
    ) -> None:
        """``logprobs``: the request asked for them; every pushed token then comes with its own."""
        self.prompt_ids = list(prompt_ids)
        self.text = text
        self.stats = stats
        self.start = start
        self.tokens: list[int] = []
        self.logprobs: list[TokenLogprob] | None = [] if logprobs else None
        self.finish: FinishReason | None = None

    def push(self, new: list[int], finish: FinishReason | None, logprobs: Sequence[TokenLogprob] = ()) -> StreamChunk:
        """Commit one cycle's tokens (``finish`` set when the target ended the request) and, when the request asked
        for them, their logprobs; a stop string found in them cuts them and sets ``finish = "stop"``."""
        if self.logprobs is not None and len(logprobs) != len(new):
            raise ValueError(f"{len(new)} new tokens came with {len(logprobs)} logprobs")
        delta, keep = self.text.push(new)
        if self.text.stopped:
            new, finish = new[:keep], "stop"
        logprobs = tuple(logprobs[: len(new)]) if self.logprobs is not None else ()
        if self.logprobs is not None:
            self.logprobs.extend(logprobs)
        self.tokens.extend(new)
        self.finish = finish
        if finish is not None:
            delta += self.text.finish()
        self.stats.new_tokens = len(self.tokens)
        self.stats.total_seconds = time.perf_counter() - self.start
        result = None
        if finish is not None:
            result = GenerationResult(self.prompt_ids, self.tokens, self.text.text, finish, self.stats, self.logprobs)
        return StreamChunk(delta, new, result, logprobs)


# ---------------------------------------------------------------------------------------------
# Starting a request


@dataclass
class StartedRequest:
    """A request's parts, built by :func:`start_request` (its drafter not started yet, its prompt not prefilled)."""

    generators: RequestGenerators
    side: DraftSide
    verifier: TargetVerifier
    out: RequestOutput


def start_request(
    target: CausalLM,
    sequence: TargetSequence,
    prompt_ids: Sequence[int],
    params: SamplingParams,
    config: GenerationConfig,
    drafter: Drafter,
    schedules: ScheduleFactory,
    decode: Decode,
    start: float,
) -> StartedRequest:
    """A request's generators, draft side (``drafter``, and the schedule ``schedules`` makes for its policy and
    budget), verifier (its KV in ``sequence``, its grammar compiled) and output (timed from ``start``, a
    ``time.perf_counter()``)."""
    generators = make_generators(params.seed, target.device)
    side = new_draft_side(
        drafter,
        schedules,
        len(prompt_ids),
        target.device,
        policy=config.policy,
        budget=config.budget,
        max_new_tokens=config.max_new_tokens,
        drafter_name=config.drafter,
    )
    eos = () if config.ignore_eos else target.info.eos_token_ids
    verifier = new_verifier(
        target, sequence, prompt_ids, params, generators.verify, config.max_new_tokens, eos, side.feature_layers
    )
    out = request_output(prompt_ids, params, config, decode, start)
    return StartedRequest(generators, side, verifier, out)


def new_verifier(
    target: CausalLM,
    sequence: TargetSequence,
    prompt_ids: Sequence[int],
    params: SamplingParams,
    generator: torch.Generator,
    max_new_tokens: int,
    eos_token_ids: Sequence[int],
    feature_layers: Sequence[int] = (),
) -> TargetVerifier:
    """A request's verifier on ``target``, its KV in ``sequence``, with the request's grammar (if any) compiled for
    the target's tokenizer."""
    return TargetVerifier(
        sequence,
        prompt_ids,
        params,
        generator,
        max_new_tokens,
        eos_token_ids,
        target.device,
        feature_layers,
        request_grammar(params, target.tokenizer, target.info),
    )


def new_draft_side(
    drafter: Drafter,
    schedules: ScheduleFactory,
    num_prompt: int,
    device: torch.device | str,
    *,
    policy: str,
    budget: Budget,
    max_new_tokens: int,
    drafter_name: str,
    side_type: type[DraftSide] = DraftSide,
) -> DraftSide:
    """A request's draft side (a ``side_type``: the drafter actor's overlap mode subclasses it) around ``drafter``,
    with the schedule ``schedules`` makes for ``policy`` and ``budget``."""
    schedule = schedules(policy, budget)
    return side_type(drafter, schedule, budget, num_prompt, max_new_tokens, device, drafter_name)


def request_output(
    prompt_ids: Sequence[int],
    params: SamplingParams,
    config: GenerationConfig,
    decode: Decode,
    start: float,
    stats: RequestStats | None = None,
) -> RequestOutput:
    """A request's output: its text decoded by ``decode`` and cut at its stop strings, its logprobs when it asks for
    them, timed from ``start``."""
    stats = stats if stats is not None else RequestStats()
    stats.prompt_tokens = len(prompt_ids)
    return RequestOutput(
        prompt_ids,
        TextStream(decode, config.stop),
        stats,
        start,
        logprobs=params.logprobs is not None,
    )
