"""The single-process speculative decoding loop: prefill, then draft -> verify -> commit -> stop checks.

One cycle, in four named phases (after EAGLE/Medusa's decomposition of a speculative step):

1. **draft** — the request's :class:`~specserve.core.draft_side.DraftSide` asks its schedule for a
   budget and its drafter for a chain or tree within it;
2. **verify** — the :class:`~specserve.core.target.TargetVerifier` scores ``[last committed token] +
   draft`` in one forward and the exact rules pick the accepted path and one more token
   (recovered or bonus);
3. **commit** — the new tokens are cut at EOS and at ``max_new_tokens``, the target's KV cache is
   rolled back to exactly the committed text, and the drafter is told what was committed;
4. **stop checks** — EOS, length, stop strings; the text delta is streamed out.

The target's cache always holds every committed token except the last, which is fed at the
head of the next verify block. The engine knows nothing about where drafts come from (any
:class:`~specserve.core.draft.drafter.Drafter`) nor about tokenisation beyond a decode function. Plain
decoding is the same loop with the ``none`` drafter, so the two are measured like for like.

Each request names its drafter (:attr:`GenerationConfig.drafter`): ``default`` (the engine's
configured drafter), ``ngram`` or ``none``. The engine takes them from a
:class:`~specserve.core.draft.drafter.DrafterSet`; given a bare drafter, it can serve only that one
(``specserve.drafters.build_drafter_set`` makes a set that builds the others on first use).
Output is exact whichever drafter runs; the choice only changes speed.

A drafter that reads the target's hidden states (:class:`~specserve.core.draft.drafter.FeatureDrafter`:
EAGLE, Medusa) gets them from the verifier's own forwards: the prompt's after the prefill, and
each cycle's root and accepted tokens' after the verdict.
"""

from __future__ import annotations

import logging
import time
from abc import ABC, abstractmethod
from collections.abc import Sequence

from specserve.core.draft.drafter import Drafter, DrafterSet, check_can_draft, drafter_counters
from specserve.core.draft.schedule import ScheduleFactory, fixed_schedules, schedule_report
from specserve.core.kv.cache import KVCache
from specserve.core.model.causal_lm import CausalLM
from specserve.core.prompts import PromptCodec
from specserve.core.request import ChunkStream, GenerationConfig, GenerationResult, start_request
from specserve.core.sampling.params import SamplingParams
from specserve.core.static.options import StaticOptions
from specserve.core.static.slots import StaticTarget, use_static_shapes
from specserve.core.target import LocalSequence

logger = logging.getLogger(__name__)

__all__ = ["GenerationFrontend", "SpeculativeEngine"]


class GenerationFrontend(ABC):
    """A way to run requests — in this process or through the distributed runtime — behind one API.

    Subclasses own a :class:`~specserve.core.prompts.PromptCodec` and the generation loop
    (``_run``); encoding, checks and the blocking ``generate`` are shared.
    """

    prompts: PromptCodec

    def generate(
        self,
        prompt: str | Sequence[int],
        params: SamplingParams | None = None,
        config: GenerationConfig | None = None,
    ) -> GenerationResult:
        """Blocking call: the whole generation."""
        for chunk in self.stream(prompt, params, config):
            if chunk.result is not None:
                return chunk.result
        raise AssertionError("stream ended without a result")  # pragma: no cover

    def stream(
        self,
        prompt: str | Sequence[int],
        params: SamplingParams | None = None,
        config: GenerationConfig | None = None,
    ) -> ChunkStream:
        """Streaming call: chunks of new text as cycles commit; the last chunk carries the result."""
        params = params or SamplingParams()
        config = config or GenerationConfig()
        prompt_ids = self.encode(prompt)
        self.validate(prompt_ids, config)
        self.prompts.check_params(params, config.ignore_eos)
        return self._run(prompt_ids, params, config)

    def encode(self, prompt: str | Sequence[int]) -> list[int]:
        return self.prompts.encode(prompt)

    def validate(self, prompt_ids: Sequence[int], config: GenerationConfig) -> None:
        self.prompts.check_length(prompt_ids, config.max_new_tokens)

    def decode(self, ids: Sequence[int]) -> str:
        return self.prompts.decode(ids)

    @abstractmethod
    def _run(self, prompt_ids: list[int], params: SamplingParams, config: GenerationConfig) -> ChunkStream: ...


class SpeculativeEngine(GenerationFrontend):
    """Runs one request at a time on a target model, in this process, with the drafter each request names.

    ``drafter`` is the configured drafter, or a :class:`DrafterSet` around it that can also build
    the ``ngram`` and ``none`` drafters requests may ask for.
    """

    def __init__(
        self,
        target: CausalLM,
        drafter: Drafter | DrafterSet,
        schedules: ScheduleFactory = fixed_schedules,
        static: StaticOptions | None = None,
    ) -> None:
        """``static``: run the target on the static-shape engine (:mod:`specserve.core.static.slots`: preallocated
        KV, verify blocks padded to buckets, CUDA graphs on a GPU), and a draft model's steps likewise; ``None``:
        growing caches and blocks at their own widths."""
        self.target = target
        self.drafters = drafter if isinstance(drafter, DrafterSet) else DrafterSet(drafter)
        self.drafter = self.drafters.configured
        self.schedules = schedules
        self.prompts = PromptCodec(target.info, target.tokenizer)
        self.static: StaticTarget | None = None
        if static is not None:
            self.static = StaticTarget(target, static)
            captured = self.static.capture()  # every bucket's verify graph, once per model load (none without graphs)
            use_static_shapes(self.drafter, static)
            logger.info(
                "target on %s: buckets %s, %d verify graphs captured",
                static.describe(),
                self.static.buckets.describe(),
                len(captured),
            )

    def validate(self, prompt_ids: Sequence[int], config: GenerationConfig) -> None:
        super().validate(prompt_ids, config)
        self.drafters.check(config.drafter)
        self.schedules(config.policy, config.budget)  # raises for a policy this engine cannot run
        check_can_draft(self.drafters.get(config.drafter), config.tree, config.drafter)

    # -----------------------------------------------------------------------------------------
    # The loop

    def _run(self, prompt_ids: list[int], params: SamplingParams, config: GenerationConfig) -> ChunkStream:
        start = time.perf_counter()
        target = self.target
        cache = self.static.new_cache() if self.static is not None else None
        try:
            yield from self._loop(prompt_ids, params, config, LocalSequence(target, cache), start)
        finally:
            if cache is not None:
                cache.release()

    def _loop(
        self,
        prompt_ids: list[int],
        params: SamplingParams,
        config: GenerationConfig,
        sequence: LocalSequence,
        start: float,
    ) -> ChunkStream:
        request = start_request(
            self.target,
            sequence,
            prompt_ids,
            params,
            config,
            self.drafters.get(config.drafter),
            self.schedules,
            self.decode,
            start,
        )
        side, verifier, out, stats = request.side, request.verifier, request.out, request.out.stats
        prompt_features = verifier.prefill()
        shared = sequence.cache if isinstance(sequence.cache, KVCache) else None  # a layer-skip drafter reads it
        side.start(prompt_ids, params, request.generators.draft, target_cache=shared)
        side.add_prompt_features(prompt_features)
        stats.prefill_seconds = time.perf_counter() - start

        while out.finish is None:
            # 1. draft (the schedule's budget), 2. verify, 3. commit (EOS and length cuts, KV rollback or compaction)
            proposal = side.propose()
            outcome = verifier.verify(proposal)
            # 4. stop strings, stream out; the drafter learns what was committed unless the request ended
            chunk = out.push(outcome.new_tokens, outcome.finish, outcome.logprobs)
            if out.finish == "stop":
                verifier.stop_at(len(out.tokens))
            stats.record(side.on_verdict(proposal, outcome, stopped=out.finish == "stop"))
            if out.finish is not None:
                stats.drafter_counters.update(drafter_counters(side.drafter))
                stats.policy = schedule_report(side.schedule)
            yield chunk
