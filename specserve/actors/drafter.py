"""``DrafterActor``: holds any drafter from ``specserve.drafters`` and runs a request's draft-verify loop.

The actor holds its replica's configured drafter and, for requests that name them
(:attr:`DraftJob.drafter`), the model-free ``ngram`` and ``none`` drafters, each built on the
first request that asks for it and kept (a :class:`~specserve.core.draft.drafter.DrafterSet`). Every
torch call — building drafters included — runs on the actor's compute thread.

For each request the actor opens one ``Speculate`` stream to its replica's rank 0 and drives the
request's :class:`~specserve.core.draft_side.DraftSide` — the same draft half of the cycle the
single-process engine drives: propose (the schedule's budget, within the remaining tokens) →
send the proposal → receive the verdict, rebuilt into the target's
:class:`~specserve.core.target.CycleOutcome` → ``on_verdict`` (the schedule observes, the drafter
is told what was committed and handed the cycle's features). Each cycle is reported to the
caller (the :class:`~specserve.actors.coordinator.Coordinator`) as a :class:`CycleReport` through
a Ray streaming generator, so the caller never sits on the critical path of a cycle. Reports are
yielded once the next proposal has been sent, while the target verifies it; after the first
cycle they are batched (``report_interval_s``, default 0.1 s), because each yield costs CPU that
the target's verify would otherwise have.

**Overlap mode** (:mod:`specserve.actors.overlap`) wraps the draft side so that it drafts the
next chain while the target verifies this one; trees, and drafters that read the target's hidden
states, are drafted after each verdict. A hidden-state drafter (EAGLE, Medusa) also waits for the
target's prefill (whose features it drafts from) before its first draft.

With overlap off, the sequence of drafter calls and random draws is exactly the single-process
engine's, so a seeded run emits exactly what the in-process engine emits.

**Batched replicas** (``max_requests`` > 1) run that many loops at once, each request with a drafter of
its own. A draft model's are :class:`~specserve.drafters.batched_model.PooledDraftModelDrafter` over one
KV pool, and the loops of chain requests without overlap meet in a
:class:`~specserve.actors.draft_gather.DraftGatherer`, which drafts their chains in shared forwards (the
verdicts of one step arrive together, so their next chains are wanted together).
"""

from __future__ import annotations

import threading
import time
from collections.abc import Iterator, Sequence
from contextlib import nullcontext
from dataclasses import dataclass
from functools import partial
from typing import Any

import grpc
import torch

from specserve.actors.compute import ComputeThread
from specserve.actors.draft_gather import DraftGatherer
from specserve.actors.overlap import OverlapDraftSide
from specserve.actors.suffix_store import SharedSuffixCache
from specserve.core.draft.drafter import BatchedDrafter, Drafter, FeatureDrafter
from specserve.core.draft.schedule import Budget, CycleObservation
from specserve.core.draft_side import DraftSide
from specserve.core.model.causal_lm import ModelInfo, TargetDescription, load_tokenizer
from specserve.core.request import new_draft_side
from specserve.core.sampling.params import SamplingParams
from specserve.core.sampling.warps import make_generators
from specserve.core.target import FinishReason
from specserve.core.tree.shapes import TreeSpec
from specserve.core.verify.logprobs import TokenLogprob
from specserve.drafters.model import DraftModelDrafter
from specserve.drafters.registry import build_drafter_set, request_drafters
from specserve.drafters.suffix import SuffixCache
from specserve.policies.schedules import schedules
from specserve.rpc.codec import encode_draft
from specserve.rpc.verifier import VerifierStream, open_channel


@dataclass(frozen=True)
class DraftJob:
    request_id: str
    prompt_ids: tuple[int, ...]
    params: SamplingParams
    gamma: int
    max_new_tokens: int
    verifier_address: str
    verifier_token: str = ""  # presented to the verifier (its replica's secret); empty: a verifier without one
    overlap: bool = False
    report_interval_s: float = 0.1  # after the first cycle, reports are batched at most this often
    drafter: str = "default"  # the configured drafter, "ngram", "suffix", "lookahead" or "none" (REQUEST_DRAFTERS)
    tree: TreeSpec | None = None  # draft trees of this shape instead of gamma-token chains (never overlapped)
    policy: str = "fixed"  # how much to draft each cycle (POLICY_NAMES); gamma / tree = the request's own budget

    @property
    def budget(self) -> Budget:
        return Budget(self.gamma, self.tree)


@dataclass(frozen=True)
class CycleReport:
    new_tokens: list[int]  # committed this cycle (already cut at EOS / max_new_tokens by the target)
    finish: FinishReason | None  # why the target ended the request ("eos" or "length"); None while it runs on
    # the budget, what was sent and accepted; draft_seconds = drafting on the critical path (0 when overlap had
    # the draft ready), verify_seconds = the target's forward + verification + rollback, wire_seconds =
    # send-to-verdict time the target did not spend (gRPC, serialisation)
    observation: CycleObservation
    allreduce_seconds: float  # of verify_seconds, tensor-parallel all-reduces
    overlap_hit: bool  # this cycle's draft was drafted during the previous verification
    logprobs: tuple[TokenLogprob, ...] = ()  # one per new token when the request asked for them
    committed_length: int = 0  # the request's tokens on the target after this cycle (prompt included)


class RequestCancelled(Exception):
    pass


class DrafterActor:
    """One drafter serving its replica's requests."""

    def __init__(
        self,
        drafter: str,
        target_dir: str,
        target_info: ModelInfo,
        dtype: str = "float32",
        device: str = "cpu",
        max_ngram: int = 3,
        min_ngram: int = 1,
        num_threads: int | None = None,
        max_requests: int = 1,
        gather_wait_s: float = 0.005,
        suffix_store: str = "replica",
    ) -> None:
        """``max_requests`` > 1 (a batched replica): that many requests' loops run at once, each with a drafter of
        its own (a draft model's weights shared, its KV a span of one pool); their torch calls take turns on the
        compute thread, and their chains are drafted together, a round waiting at most ``gather_wait_s`` for the
        loops still to arrive."""
        if max_requests < 1:
            raise ValueError(f"max_requests must be >= 1, got {max_requests}")
        self.compute = ComputeThread(num_threads)
        self.device = torch.device(device)
        target = TargetDescription(target_info, load_tokenizer(target_dir), self.device)
        options: dict[str, Any] = {"dtype": dtype, "device": device, "max_ngram": max_ngram, "min_ngram": min_ngram}
        # the suffix drafters' store of finished outputs: this replica's, or shared with the others (a Ray actor)
        options["suffix_cache"] = SharedSuffixCache() if suffix_store == "cluster" else SuffixCache()
        self.drafters = self.compute.run(build_drafter_set, drafter, target, **options)
        # batched: one drafter per request (the configured model's weights loaded once, here)
        configured = self.drafters.configured
        loaded = configured.model if isinstance(configured, DraftModelDrafter) else drafter
        self._new_drafter = None
        self._gatherer: DraftGatherer | None = None
        if max_requests > 1:
            self._new_drafter = self.compute.run(
                partial(request_drafters, max_num_seqs=max_requests, max_seq_len=target_info.max_positions),
                loaded,
                target,
                **options,
            )
            self._gatherer = DraftGatherer(self.compute.run, gather_wait_s)
        self.schedules = schedules()  # per request; the adaptive ones share this replica's prior
        self._channels: dict[str, grpc.Channel] = {}
        self._lock = threading.Lock()
        self._running: set[str] = set()  # requests whose loop runs
        self._cancelled: set[str] = set()  # set by cancel(): stop that loop after its current cycle
        self._slots = threading.BoundedSemaphore(max_requests)  # one request at a time unless batched

    def node_id(self) -> str:
        import ray

        return str(ray.get_runtime_context().get_node_id())

    def feature_layers(self) -> tuple[int, ...]:
        """The target features the configured drafter reads (EAGLE, Medusa); empty for any other drafter."""
        drafter = self.drafters.configured
        return tuple(drafter.feature_layers) if isinstance(drafter, FeatureDrafter) else ()

    def draft_rounds(self) -> dict[int, int]:
        """Batched replicas: rounds of shared drafting so far, by how many requests each drafted together."""
        return self._gatherer.rounds_by_size() if self._gatherer is not None else {}

    def running(self) -> list[str]:
        """The requests whose loops run here now."""
        with self._lock:
            return sorted(self._running)

    def cancel(self, request_id: str) -> None:
        """Stop a running request's loop after its current cycle (the caller no longer wants it)."""
        with self._lock:
            if request_id in self._running:
                self._cancelled.add(request_id)

    def run(self, job: DraftJob, target_ready: Sequence[Any] = ()) -> Iterator[list[CycleReport]]:
        """The draft-verify loop of one request; yields batches of cycle reports until the target finishes it.

        ``target_ready`` may hold the ``ObjectRef`` of rank 0's ``start_request``: the drafter then
        prefills its own state and drafts its first tree while the target prefills the prompt, and
        waits for the target only before sending that draft (on two machines, or two cores, the two prefills overlap).
        """
        with self._slots:
            with self._lock:
                self._running.add(job.request_id)
            try:
                # The loop itself runs here (a Ray thread); every torch call goes to the compute thread.
                yield from self._loop(job, target_ready)
            finally:
                with self._lock:
                    self._running.discard(job.request_id)
                    self._cancelled.discard(job.request_id)

    def _loop(self, job: DraftJob, target_ready: Sequence[Any]) -> Iterator[list[CycleReport]]:
        run = self.compute.run
        if self._new_drafter is not None:
            drafter = run(self._new_drafter, job.drafter)  # this request's own
        else:
            drafter = run(self.drafters.get, job.drafter)  # built here on first use, then kept
        try:
            yield from self._cycles(job, target_ready, drafter)
        finally:
            if isinstance(drafter, BatchedDrafter):
                run(drafter.release)  # its span of the draft model's pool

    def _cycles(self, job: DraftJob, target_ready: Sequence[Any], drafter: Drafter) -> Iterator[list[CycleReport]]:
        device, run = self.device, self.compute.run
        generators = make_generators(job.params.seed, device)
        side = new_draft_side(
            drafter,
            self.schedules,
            len(job.prompt_ids),
            device,
            policy=job.policy,
            budget=job.budget,
            max_new_tokens=job.max_new_tokens,
            drafter_name=job.drafter,
            side_type=OverlapDraftSide if job.overlap else DraftSide,
        )
        run(side.start, job.prompt_ids, job.params, generators.draft)
        if side.reads_features and target_ready:  # it drafts from the prompt's features: wait for the target's prefill
            import ray

            run(side.add_prompt_features, ray.get(list(target_ready))[0].features)
            target_ready = ()
        # The first proposal is drafted before waiting for the target (same calls and draws as after it).
        proposal = run(side.propose)
        if target_ready:
            import ray

            ray.get(list(target_ready))  # raises the target's error if it could not admit the request
        gatherer = self._gatherer
        shares = gatherer is not None and isinstance(drafter, BatchedDrafter) and not job.overlap and job.tree is None
        stream = VerifierStream(self._channel(job.verifier_address), token=job.verifier_token or None)
        # Reports not yet sent to the caller. Each yield costs about a millisecond of CPU in this process and
        # the caller's, which on a small machine slows the target's verify: after the first cycle (time to
        # first token) they go out in batches, at most every report_interval_s, while the target verifies.
        pending: list[CycleReport] = []
        last_report = 0.0
        cycle = 0
        batch_size = 1  # requests the target verified with this one last cycle: what its next step will hold
        try:
            with gatherer.member() if shares and gatherer is not None else nullcontext():
                while job.request_id not in self._cancelled:
                    if cycle > 0:
                        if shares and gatherer is not None:  # drafted with the other loops' chains
                            proposal = gatherer.propose(side, batch_size)
                        else:
                            proposal = run(side.propose, batch_size)
                    overlap_hit = isinstance(side, OverlapDraftSide) and side.used_ready
                    sent = time.perf_counter()
                    stream.send_raw(run(encode_draft, job.request_id, cycle, proposal).SerializeToString())
                    ahead_seconds = run(side.draft_ahead, proposal) if isinstance(side, OverlapDraftSide) else 0.0

                    if pending and (cycle == 1 or time.perf_counter() - last_report >= job.report_interval_s):
                        yield pending
                        pending, last_report = [], time.perf_counter()

                    info = stream.receive()
                    # send-to-verdict time the target did not spend (nor drafting ahead hid): gRPC, serialisation
                    wire_seconds = max(0.0, time.perf_counter() - sent - max(info.target_seconds, ahead_seconds))
                    outcome = info.outcome(proposal, side.committed)
                    batch_size = outcome.batch_size
                    observation = run(side.on_verdict, proposal, outcome, wire_seconds=wire_seconds)
                    pending.append(
                        CycleReport(
                            outcome.new_tokens,
                            outcome.finish,
                            observation,
                            outcome.allreduce_seconds,
                            overlap_hit,
                            outcome.logprobs,
                            outcome.committed_length,
                        )
                    )
                    if outcome.finish is not None:
                        yield pending
                        return
                    cycle += 1
        finally:
            stream.close()

    def _channel(self, address: str) -> grpc.Channel:
        if address not in self._channels:
            self._channels[address] = open_channel(address)
        return self._channels[address]
