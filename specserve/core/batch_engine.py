"""Continuous batching in one process: many requests, one target forward per step.

:class:`BatchedEngine` holds a :class:`~specserve.core.kv.pool.KVPool` and the running requests.
Requests join and leave between steps. One :meth:`BatchedEngine.step`:

1. **admit and prefill** — waiting requests start, first come first served, while fewer than
   ``max_num_seqs`` run and the KV pool has the tokens the next one reserves (:func:`kv_tokens`: its
   prompt, its output and its widest block; a later request never overtakes one waiting for room);
   their prompts are prefilled in chunks, at most ``prefill_tokens`` positions per step over all
   newcomers (rows × widest chunk: the forward pads its rows), in a forward of their own, so a long
   prompt never stalls the others' decoding for more than one chunk; a request that could never fit
   (longer than ``max_seq_len``, or than the whole pool) is refused when submitted;
2. **draft** — every running request's :class:`~specserve.core.draft_side.DraftSide` plans its budget
   knowing the batch size (a goodput-aware schedule drafts less in a larger batch), the chains of
   adaptive requests are aligned to one length (:func:`~specserve.core.draft_side.align_chains`), and
   the drafts are made (:func:`~specserve.core.draft_side.propose_batch`): chains of drafters that share
   a :class:`~specserve.core.draft.drafter.ChainBatcher` (a draft model over its own KV pool) in shared
   forwards, every other proposal (trees, n-gram, none) with the request's own drafter;
3. **verify** — the target scores every request's block in **one** forward
   (:meth:`~specserve.core.model.causal_lm.CausalLM.forward_batch`); each request's
   :class:`~specserve.core.target.TargetVerifier` decides on its own rows by the same exact rules
   as the single-request engine, with the request's own generators, and rolls back or compacts
   its own span of the pool;
4. **stop checks** — EOS, length, stop strings; finished requests free their tokens.

**One request's failure is its own.** Each request's part of a step — its start, its drafting, its verdict, its
detokenisation — runs guarded: when it raises (its grammar gave up mid-text, its drafter or processors raised, the
target's logits for its rows were not finite), that request ends alone, its KV and draft span freed, and
:meth:`BatchedEngine.step` hands its id the error in place of a chunk; every other request's chunk is what it would
have been without it. Only a shared forward (the step's prefill or verify forward, a draft model's round) failing
raises from the step.

Per request, the drafter, schedule and generators see exactly the calls the single-request
:class:`~specserve.core.engine.SpeculativeEngine` makes, in the same order (but for a prompt's features,
which arrive chunk by chunk: see below), so a request's tokens
do not depend on who shares its batch (a fixed budget stays fixed; an adaptive one changes only how
much is proposed, never the output's law). Each request gets its own drafter from
``new_drafter(name)`` (a draft model's weights are shared; its cache, or its span of a shared pool,
is the request's), given back when the request ends. Each step's observation carries the batch size,
the positions the forward computed and the forward's time, which the policies' step-cost estimate learns, and the
whole decoding step's time (planning, every row's drafting, the forward, the verdicts: what each row waited), which
the adaptive policy's measured ceiling charges every row of the step against plain steps measured alike.

Hidden-state drafters (EAGLE, Medusa: :class:`~specserve.core.draft.drafter.FeatureDrafter`) get the target's
features from the batched forwards themselves: each prefill chunk's, in order, from the chunk's first
position (together, what the single engine's prefill hands over at once: every prompt token's but the
last), then each cycle's root and accepted tokens' from the step's verify forward (one
:class:`~specserve.core.model.causal_lm.FeatureCapture` per row that wants them). A layer-skip drafter
(:class:`~specserve.core.draft.drafter.SharesTargetKV`) is not given the target's cache here: a request's KV is
its span of the pool, which the engine hands over instead (:class:`~specserve.core.draft.drafter.ReadsTargetPool`):
a server's layer-skip drafters draft all requests' chains in that pool
(:class:`~specserve.drafters.layerskip_batch.BatchedLayerSkip`), and a lone one fills a cache of its own by copying
its layers' keys and values from the span rather than computing them.
"""

from __future__ import annotations

import itertools
import time
from collections import deque
from collections.abc import Callable, Sequence
from dataclasses import dataclass

from specserve.core.batch_step import LocalPool, StepResult, kv_tokens, verify_batch
from specserve.core.draft.drafter import (
    BatchedDrafter,
    Drafter,
    FeatureDrafter,
    PrefixReusing,
    Proposal,
    ReadsTargetPool,
    check_can_draft,
    drafter_counters,
    probe_nodes,
)
from specserve.core.draft.schedule import ScheduleFactory, fixed_schedules, schedule_report
from specserve.core.draft_side import DraftSide, propose_batch
from specserve.core.engine import GenerationFrontend
from specserve.core.errors import InvalidRequest, request_failure
from specserve.core.kv.pool import DEFAULT_MEMORY_FRACTION, KVPool, pool_tokens
from specserve.core.kv.prefix_cache import Hit, PrefixCache
from specserve.core.model.causal_lm import BatchBlock, CausalLM, FeatureCapture
from specserve.core.prompts import PromptCodec
from specserve.core.request import ChunkStream, GenerationConfig, RequestOutput, StreamChunk, start_request
from specserve.core.sampling.params import SamplingParams
from specserve.core.static.batch_graphs import batch_graphs
from specserve.core.static.graphs import GraphBackend
from specserve.core.static.options import StaticOptions
from specserve.core.target import CycleOutcome, PooledSequence, TargetVerifier


@dataclass
class _Request:
    request_id: int
    prompt_ids: list[int]
    params: SamplingParams
    config: GenerationConfig
    drafter: Drafter
    submitted: float
    verifier: TargetVerifier | None = None
    sequence: PooledSequence | None = None
    side: DraftSide | None = None
    out: RequestOutput | None = None
    reuse_limit: int | None = None  # cached prompt positions its drafter can follow (None: all)

    @property
    def seq_id(self) -> int:
        assert self.sequence is not None, "a waiting request holds no KV"
        return self.sequence.seq_id

    def parts(self) -> tuple[TargetVerifier, DraftSide, RequestOutput]:
        """The verifier, draft side and output of a started request."""
        assert self.verifier is not None and self.side is not None and self.out is not None, "not started"
        return self.verifier, self.side, self.out


class BatchedEngine(GenerationFrontend):
    """Serves many requests at once on a target model in this process, one batched target forward per step.

    ``new_drafter(name)`` builds a drafter for one request (``name`` is the request's
    :attr:`~specserve.core.engine.GenerationConfig.drafter`: ``default``, ``ngram`` or ``none``).
    Up to ``max_num_seqs`` requests run at once, each within ``max_seq_len`` tokens of prompt and output
    (default: the target's context length), their KV in a pool of ``kv_pool_tokens`` positions (default:
    room for ``max_num_seqs`` requests of ``max_seq_len``, or what ``kv_memory_fraction`` of the free memory holds if
    that is less); the rest wait. Newcomers' prompts are prefilled
    at most ``prefill_tokens`` positions per step (rows × widest chunk).
    """

    def __init__(
        self,
        target: CausalLM,
        new_drafter: Callable[[str], Drafter],
        schedules: ScheduleFactory = fixed_schedules,
        max_num_seqs: int = 16,
        max_seq_len: int | None = None,
        prefill_tokens: int = 256,
        kv_pool_tokens: int | None = None,
        static: StaticOptions | None = None,
        kv_memory_fraction: float = DEFAULT_MEMORY_FRACTION,
        prefix_caching: bool = True,
        graph_backend: GraphBackend | None = None,
    ) -> None:
        """``static``: run every step at the bucket of its widest block (:mod:`specserve.core.model.buckets`; the KV
        pool is preallocated either way). ``kv_memory_fraction``: without ``kv_pool_tokens``, the pool takes at most
        that share of the memory free on the target's device (:func:`~specserve.core.kv.pool.pool_tokens`).
        ``prefix_caching``: reuse the KV of prefixes earlier (or running) requests cached, within a namespace
        (:mod:`specserve.core.kv.prefix_cache`). With ``static``, steps that fit its buckets replay as captured graphs
        (:mod:`specserve.core.static.batch_graphs`) on a CUDA device with ``cuda_graphs``, or through ``graph_backend``
        when one is given (the tests' stand-in)."""
        if prefill_tokens < 1 or max_num_seqs < 1:
            raise ValueError(f"prefill_tokens and max_num_seqs must be >= 1, got {prefill_tokens}, {max_num_seqs}")
        self.prefill_tokens = prefill_tokens
        self.max_num_seqs = max_num_seqs
        self.max_seq_len = max_seq_len or target.info.max_positions
        self.target = target
        self.new_drafter = new_drafter
        self.schedules = schedules
        self.prompts = PromptCodec(target.info, target.tokenizer)
        self.pool = KVPool(
            target.model,
            kv_pool_tokens or pool_tokens(target.model, max_num_seqs, kv_tokens(self.max_seq_len), kv_memory_fraction),
        )
        self.buckets = None if static is None else static.buckets_for(target.device.type)
        self.graphs = batch_graphs(target, self.pool, static, graph_backend)
        self.ops = LocalPool(target, self.pool, self.buckets, self.graphs)
        self.cache = PrefixCache(self.pool) if prefix_caching else None
        self._ids = itertools.count()
        self._waiting: deque[_Request] = deque()
        self._running: dict[int, _Request] = {}

    # -----------------------------------------------------------------------------------------
    # Requests

    def submit(
        self, prompt: str | Sequence[int], params: SamplingParams | None = None, config: GenerationConfig | None = None
    ) -> int:
        """Queue a request; returns its id. Raises :class:`InvalidRequest` for one that can never run here."""
        params, config = params or SamplingParams(), config or GenerationConfig()
        prompt_ids = self.encode(prompt)
        self.validate(prompt_ids, config)
        self.prompts.check_params(params, config.ignore_eos)
        if len(prompt_ids) + config.max_new_tokens > self.max_seq_len:
            raise InvalidRequest(
                f"prompt ({len(prompt_ids)} tokens) + max_new_tokens ({config.max_new_tokens}) exceed the "
                f"{self.max_seq_len} tokens a request may hold here (max_seq_len); shorten one of them"
            )
        drafter = self.new_drafter(config.drafter)
        reserve = self._kv_tokens(len(prompt_ids), config, drafter)
        if reserve > self.pool.capacity:
            raise InvalidRequest(
                f"prompt ({len(prompt_ids)} tokens), max_new_tokens ({config.max_new_tokens}) and its widest verify "
                f"block need {reserve} KV positions, more than this replica's whole pool ({self.pool.capacity}, "
                "kv_pool_tokens); shorten the prompt or max_new_tokens"
            )
        check_can_draft(drafter, config.tree, config.drafter)
        if self.pool.states is not None and (config.tree is not None or probe_nodes(drafter) > 0):
            raise InvalidRequest(
                f"{self.target.info.architecture}'s recurrent layers read a block in order, so a batched replica "
                "verifies chains only; draft chains, or serve draft trees one request at a time (--max-num-seqs 1)"
            )
        self.schedules(config.policy, config.budget)  # raises for a policy this engine cannot run
        request = _Request(next(self._ids), prompt_ids, params, config, drafter, time.perf_counter())
        self._waiting.append(request)
        return request.request_id

    def cancel(self, request_id: int) -> None:
        """Drop a waiting or running request (its KV is freed at once); unknown ids are ignored."""
        self._waiting = deque(r for r in self._waiting if r.request_id != request_id)
        request = self._running.pop(request_id, None)
        if request is not None:
            self._release(request, retain=True)

    def _release(self, request: _Request, retain: bool) -> None:
        """Free what a started request holds: its KV (kept by the prefix cache when ``retain``: it caches committed
        text only) and its span of a draft model's pool."""
        if request.sequence is not None:
            if self.cache is not None and retain:
                assert request.verifier is not None
                seq_id = request.seq_id
                tokens = request.verifier.committed[: self.pool.length(seq_id)]
                self.cache.retain(seq_id, request.config.cache_namespace, tokens)
            else:
                if self.cache is not None:
                    self.cache.withdraw(request.seq_id)
                self.pool.free(request.seq_id)
        if self.cache is not None and retain and isinstance(request.drafter, PrefixReusing):
            request.drafter.keep_prefix()  # its features, for later requests that share its prefix
        if isinstance(request.drafter, BatchedDrafter):
            request.drafter.release()  # its span of the draft model's pool

    @property
    def has_work(self) -> bool:
        return bool(self._waiting or self._running)

    @property
    def num_running(self) -> int:
        return len(self._running)

    # -----------------------------------------------------------------------------------------
    # One step

    def step(self) -> list[tuple[int, StreamChunk | Exception]]:
        """Admit and prefill (a chunk), then draft, verify every prefilled request in one forward, commit; each
        request's new chunk.

        A request whose own part of the step fails — its start, its drafting, its verdict (its grammar gave up, its
        processors raised, non-finite logits in its rows), its detokenisation — ends alone: its id comes with the
        error in place of a chunk (the caller's :class:`~specserve.core.errors.UserError`, or
        :class:`~specserve.core.errors.RequestFailed`), its KV is freed, and every other request's chunk is what it
        would have been without it. Only a shared forward's failure raises."""
        failed: list[tuple[int, StreamChunk | Exception]] = []
        self._admit(failed)
        self._prefill(failed)
        running = [r for r in self._running.values() if r.verifier is not None and not r.verifier.unprefilled]
        if not running:
            return failed
        started = time.perf_counter()  # the decoding step: planning, drafting, the forward, every verdict
        proposals = propose_batch([request.parts()[1] for request in running])
        drafted = []
        for request, proposal in zip(running, proposals, strict=True):
            if isinstance(proposal, Exception):
                self._fail(request, proposal, failed)
            else:
                drafted.append((request, proposal))
        if not drafted:
            return failed
        step = verify_batch(self.ops, [(r.parts()[0], proposal, r.seq_id) for r, proposal in drafted])
        step_seconds = time.perf_counter() - started
        chunks: list[tuple[int, StreamChunk | Exception]] = []
        for (request, proposal), outcome in zip(drafted, step.outcomes, strict=True):
            if isinstance(outcome, Exception):
                self._fail(request, outcome, chunks)
                continue
            try:
                chunks.append(
                    (request.request_id, self._commit(request, proposal, outcome, len(drafted), step, step_seconds))
                )
            except Exception as exc:
                self._fail(request, request_failure(exc, "committing the verdict"), chunks)
        return failed + chunks

    def _commit(
        self,
        request: _Request,
        proposal: Proposal,
        outcome: CycleOutcome,
        batch_size: int,
        step: StepResult,
        step_seconds: float,
    ) -> StreamChunk:
        """One request's verdict turned into its chunk: stop checks, the draft side's observation (with the whole
        step's time, which its row waited), and its end."""
        verifier, side, out = request.parts()
        chunk = out.push(outcome.new_tokens, outcome.finish, outcome.logprobs)
        if out.finish == "stop":
            verifier.stop_at(len(out.tokens))
        stopped = out.finish == "stop"
        observation = side.on_verdict(
            proposal,
            outcome,
            stopped=stopped,
            batch_size=batch_size,
            step_positions=step.positions,
            step_seconds=step_seconds,
        )
        out.stats.record(observation)
        if out.finish is not None:
            out.stats.drafter_counters.update(drafter_counters(side.drafter))
            out.stats.policy = schedule_report(side.schedule)
            self.cancel(request.request_id)
        return chunk

    def _fail(self, request: _Request, error: Exception, into: list[tuple[int, StreamChunk | Exception]]) -> None:
        """End ``request`` alone with ``error`` (already what its caller should hear): its KV and drafter freed (its KV
        may hold a block it failed on: the prefix cache does not keep it)."""
        self._running.pop(request.request_id, None)
        self._release(request, retain=False)
        into.append((request.request_id, error))

    def _admit(self, failed: list[tuple[int, StreamChunk | Exception]]) -> None:
        """Start waiting requests, first come first served, while a request may run and the pool has room for the
        next (the prefix cache evicting for it; never the entry it will copy its prefix from, unless that is the
        only way to fit)."""
        while self._waiting and len(self._running) < self.max_num_seqs:
            request = self._waiting[0]
            hit = self._lookup(request)
            need = self._request_kv_tokens(request)
            if self.cache is not None:
                fits, hit = self.cache.admit(need, hit)
            else:
                fits = self.pool.fits(need)
            if not fits:
                break
            self._waiting.popleft()
            try:
                self._start(request, hit)
            except Exception as exc:
                self._fail(request, request_failure(exc, "starting the request"), failed)

    # -----------------------------------------------------------------------------------------
    # Prefix caching

    def _cacheable(self, request: _Request) -> list[int]:
        """The prompt positions a request may take from the prefix cache: all but its last token, and no more than
        its drafter can follow (:class:`~specserve.core.draft.drafter.PrefixReusing`: the features it holds)."""
        return request.prompt_ids[: len(request.prompt_ids) - 1][: request.reuse_limit]

    def _lookup(self, request: _Request) -> Hit | None:
        """The longest prefix of the request's cacheable prompt the cache holds, beyond what it caches already."""
        tokens = self._cacheable(request)
        if self.cache is None or not tokens:
            return None
        own = request.seq_id if request.sequence is not None else None
        hit = self.cache.lookup(request.config.cache_namespace, tokens, exclude=own)
        cached = self.pool.length(own) if own is not None else 0
        return hit if hit is not None and hit.length > cached else None

    def _reuse(self, request: _Request, hit: Hit | None = None) -> None:
        """Copy a hit (if any) into the request's span and offer what it caches to others while it runs (its drafter's
        features too); once its prompt is all cached, count the request."""
        if self.cache is None:
            return
        verifier, _, out = request.parts()
        namespace = request.config.cache_namespace
        out.stats.cached_tokens += self.cache.adopt(request.seq_id, namespace, verifier.committed, hit)
        if isinstance(request.drafter, PrefixReusing) and self.pool.length(request.seq_id):
            request.drafter.keep_prefix()  # its features, for the same prefix
        if not verifier.unprefilled:
            self.cache.record(len(request.prompt_ids) - 1, out.stats.cached_tokens)
            out.stats.prefill_seconds = time.perf_counter() - request.submitted

    @staticmethod
    def _kv_tokens(prompt_tokens: int, config: GenerationConfig, drafter: Drafter) -> int:
        """KV positions a request reserves: its text, and room for its widest verify block (tree, probe)."""
        widest = (config.budget.nodes if config.tree else 0) + probe_nodes(drafter)
        return kv_tokens(prompt_tokens + config.max_new_tokens, widest)

    def _request_kv_tokens(self, request: _Request) -> int:
        return self._kv_tokens(len(request.prompt_ids), request.config, request.drafter)

    def _prefill(self, failed: list[tuple[int, StreamChunk | Exception]]) -> None:
        """One forward over the next prompt chunks of the requests still prefilling, oldest first, within
        ``prefill_tokens`` positions *computed*: the forward pads every row to its widest chunk, so rows × widest
        chunk stays within the budget (a later chunk never widens the step; one that would not fit waits for the
        next step). Without this, a 248-token chunk beside an 8-token one cost two 248-token rows."""
        blocks: list[BatchBlock] = []
        filling: list[tuple[_Request, int, FeatureCapture | None]] = []
        width = 0
        for request in self._running.values():
            verifier = request.verifier
            assert verifier is not None
            if verifier.unprefilled and self.cache is not None:  # another request may have cached more of it since
                drafter = request.drafter
                if isinstance(drafter, PrefixReusing) and isinstance(drafter, FeatureDrafter):  # features first
                    request.reuse_limit = drafter.reuse_prefix(request.config.cache_namespace, request.prompt_ids[:-1])
                hit = self._lookup(request)
                if hit is not None:
                    self._reuse(request, hit)
            if not verifier.unprefilled:
                continue
            rows = len(blocks) + 1
            take = min(verifier.unprefilled, self.prefill_tokens // rows, width or self.prefill_tokens)
            if take < 1 or rows * max(width, take) > self.prefill_tokens:
                break
            width = max(width, take)
            # the chunk's first position, and its features for a drafter that reads them (None otherwise)
            filling.append((request, verifier.sequence.length, verifier.new_capture()))
            blocks.append(verifier.prefill_block(request.seq_id, take))
        if not blocks:
            return
        # a chunk caches prompt tokens before the last committed one: nobody reads its logits
        self.ops.forward_batch(blocks, last_only=True, capture=[capture for _, _, capture in filling])
        now = time.perf_counter()
        for request, start, capture in filling:
            verifier, side, out = request.parts()
            if capture is not None:  # the chunks come in order: the drafter knows every position before ``start``
                try:
                    side.add_features(start, capture.take())
                except Exception as exc:
                    self._fail(request, request_failure(exc, "drafting"), failed)
                    continue
            if self.cache is not None:
                self._reuse(request)
            elif not verifier.unprefilled:
                out.stats.prefill_seconds = now - request.submitted

    def _start(self, request: _Request, hit: Hit | None = None) -> None:
        """Give a newcomer its KV (with the prefix cache's ``hit`` copied in), verifier and draft side, as the
        single-request engine does; the rest of its prompt is prefilled in chunks by the steps that follow
        (:meth:`_prefill`)."""
        params = request.params
        seq_id = self.pool.allocate(self._request_kv_tokens(request))
        sequence = request.sequence = PooledSequence(self.ops, seq_id)
        started = start_request(
            self.target,
            sequence,
            request.prompt_ids,
            params,
            request.config,
            request.drafter,
            self.schedules,
            self.decode,
            request.submitted,
        )
        # No target cache for a layer-skip drafter: the request's KV is a span of the pool, not a cache it can draft
        # in, so it keeps its own, filled from the span (ReadsTargetPool). A hidden-state drafter gets the prompt's
        # features from the prefill's chunks (_prefill), but for the cached prefix it takes from its own store.
        started.side.start(request.prompt_ids, params, started.generators.draft)
        drafter = request.drafter
        if isinstance(drafter, ReadsTargetPool):
            drafter.follow_target_pool(self.pool, seq_id)
        if isinstance(drafter, FeatureDrafter):  # it follows the cached KV only as far as it holds the features
            request.reuse_limit = 0
            if self.cache is not None and isinstance(drafter, PrefixReusing):
                request.reuse_limit = drafter.reuse_prefix(request.config.cache_namespace, request.prompt_ids[:-1])
            if hit is not None and hit.length > request.reuse_limit:
                hit = Hit(hit.seq_id, request.reuse_limit) if request.reuse_limit else None
        request.verifier, request.side, request.out = started.verifier, started.side, started.out
        self._running[request.request_id] = request
        self._reuse(request, hit)

    # -----------------------------------------------------------------------------------------
    # One request's stream (GenerationFrontend): steps the whole batch until this request ends

    def _run(self, prompt_ids: list[int], params: SamplingParams, config: GenerationConfig) -> ChunkStream:
        request_id = self.submit(prompt_ids, params, config)
        done = False
        try:
            while not done:
                for rid, chunk in self.step():
                    if rid == request_id:
                        if isinstance(chunk, Exception):
                            done = True  # the engine already forgot it
                            raise chunk
                        done = chunk.result is not None
                        yield chunk
        finally:
            if not done:
                self.cancel(request_id)
