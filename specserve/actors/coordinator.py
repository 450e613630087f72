"""``Coordinator``: one replica's front door — admits requests, runs their cycles through the actors, streams text.

A plain class: the CLI uses it in the driver process, a Ray Serve replica holds one, and it can
be made remote like the other actors. For each request it

1. encodes and checks the prompt exactly as the single-process engine does
   (:class:`~specserve.core.prompts.PromptCodec`);
2. asks rank 0 to admit the request and prefill it on every shard, and at the same time
3. starts the drafter's draft-verify loop, whose drafter prefills while the target does (a Ray
   streaming generator: the cycles run between the drafter and rank 0 over gRPC, the coordinator
   is off their critical path);
4. turns each cycle's committed tokens into text, cuts at stop strings, records stats, and
   yields the same :class:`~specserve.core.engine.StreamChunk` the engine yields;
5. frees the request's KV on every shard when it ends, however it ends.

The request's ``policy`` (fixed, heuristic or adaptive: ``specserve.policies``), its ``gamma`` /
``tree`` budget, and its ``drafter`` (configured, ``ngram`` or ``none``) go to the drafter actor,
which decides each cycle's budget there (its replica's estimates are shared by its requests); trees
are verified with tree attention on every shard.
The drafter is an optimisation, so losing it costs speed, never the request: when the drafter actor
dies mid-request (Ray restarts it for later requests, :data:`~specserve.actors.replica.DRAFTER_MAX_RESTARTS`),
the coordinator finishes the request itself without speculation (:meth:`Coordinator._decode_plainly`):
it takes the tokens rank 0 committed that the drafter never reported, then asks rank 0 for one
plain cycle (an empty draft) at a time. Greedy output is therefore the same tokens; a sampled
request stays distributed as the target's, and with drafter-invariant sampling it is the same
tokens as without the fault (the verifier's random stream otherwise depends on the drafts it saw).

A replica with ``max_num_seqs`` > 1 serves that many requests at once: call :meth:`~Coordinator.stream`
from as many threads; rank 0 verifies their drafts together, one forward per step, and the drafter
actor runs their loops side by side. Otherwise a replica serves one request at a time (its drafter
holds one request's state), and concurrent callers wait their turn in the drafter.
"""

from __future__ import annotations

import contextlib
import logging
import threading
import time
import uuid
from typing import Any

from specserve.actors.drafter import CycleReport, DraftJob
from specserve.actors.replica import Replica, ReplicaConfig, spawn_replica
from specserve.core.detokenize import TextStream
from specserve.core.draft import Draft
from specserve.core.engine import ChunkStream, GenerationConfig, GenerationFrontend, RequestOutput
from specserve.core.model import load_tokenizer
from specserve.core.prompts import PromptCodec
from specserve.core.sampling import SamplingParams
from specserve.core.stats import RequestStats

logger = logging.getLogger(__name__)
PROGRESS_TIMEOUT_S = 60.0  # a plain cycle or a progress query on rank 0 (a live rank 0 answers within a step)


class Coordinator(GenerationFrontend):
    def __init__(self, replica: Replica) -> None:
        self.replica = replica
        self.prompts = PromptCodec(replica.target_info, load_tokenizer(replica.config.target))
        self._slots = threading.BoundedSemaphore(replica.config.max_num_seqs)  # callers beyond them wait here

    @classmethod
    def spawn(cls, config: ReplicaConfig) -> Coordinator:
        return cls(spawn_replica(config))

    @property
    def max_concurrency(self) -> int:
        """Requests this replica generates at once (its ``max_num_seqs``); more callers wait their turn."""
        return self.replica.config.max_num_seqs

    def placement(self) -> dict[str, Any]:
        return self.replica.placement()

    def shutdown(self) -> None:
        self.replica.shutdown()

    def active_requests(self) -> list[str]:
        """Requests holding KV on rank 0 (every shard mirrors rank 0)."""
        import ray

        return list(ray.get(self.replica.rank0.active_requests.remote(), timeout=30))

    def check_health(self, timeout_s: float = 30.0) -> None:
        """Raises when any of the replica's actors is dead or does not answer within ``timeout_s``. A drafter that
        Ray is restarting is no failure: its requests go on without speculation meanwhile."""
        import ray

        ray.get([shard.node_id.remote() for shard in self.replica.shards], timeout=timeout_s)
        with contextlib.suppress(ray.exceptions.ActorUnavailableError):
            ray.get(self.replica.drafter.node_id.remote(), timeout=timeout_s)

    # -----------------------------------------------------------------------------------------

    def _run(self, prompt_ids: list[int], params: SamplingParams, config: GenerationConfig) -> ChunkStream:
        with self._slots:
            yield from self._run_admitted(prompt_ids, params, config)

    def _run_admitted(self, prompt_ids: list[int], params: SamplingParams, config: GenerationConfig) -> ChunkStream:
        import ray

        replica = self.replica
        request_id = uuid.uuid4().hex
        eos = () if config.ignore_eos else replica.target_info.eos_token_ids
        stats = RequestStats()
        text = TextStream(self.prompts.decode, config.stop)
        start = time.perf_counter()
        layers = replica.feature_layers if config.drafter == "default" else ()  # hidden-state drafters' features
        started = replica.rank0.start_request.remote(
            request_id,
            prompt_ids,
            params,
            config.max_new_tokens,
            eos,
            layers,
            config.budget.nodes if config.tree else 0,
        )
        job = DraftJob(
            request_id=request_id,
            prompt_ids=tuple(prompt_ids),
            params=params,
            gamma=config.gamma,
            max_new_tokens=config.max_new_tokens,
            verifier_address=replica.verifier_address,
            verifier_token=replica.verifier_token,
            overlap=replica.config.overlap,
            drafter=config.drafter,
            tree=config.tree,
            policy=config.policy,
        )
        out = RequestOutput(prompt_ids, text, stats, start)
        try:
            # The drafter prefills while the target does (the ref travels inside a list, so Ray does not wait
            # for it before starting the drafter's task); the drafter waits for the target before drafting.
            reports = replica.drafter.run.options(num_returns="streaming").remote(job, [started])
            ray.get(started)
            stats.prefill_seconds = time.perf_counter() - start
            try:
                for ref in reports:
                    batch: list[CycleReport] = ray.get(ref)
                    for report in batch:
                        stats.record(report.observation, report.allreduce_seconds, report.overlap_hit)
                        yield out.push(report.new_tokens, report.finish)  # the target's finish reason, from the wire
                        if out.finish is not None:
                            return
            except ray.exceptions.RayActorError as exc:  # the drafter died (or is restarting): go on without it
                logger.warning("request %s lost its drafter (%s); it continues without speculation", request_id, exc)
                yield from self._decode_plainly(request_id, out)
        finally:
            if out.finish not in ("eos", "length"):  # stopped early, failed or abandoned by the caller
                replica.drafter.cancel.remote(request_id)
            replica.rank0.finish_request.remote(request_id)

    def _decode_plainly(self, request_id: str, out: RequestOutput) -> ChunkStream:
        """Finish a request whose drafter is gone: rank 0's committed tokens the drafter never reported, then one
        plain cycle (an empty draft: one token from the target's distribution) at a time until it finishes."""
        import ray

        from specserve.rpc.verifier import UnknownRequest

        rank0 = self.replica.rank0
        cycle = 0
        while out.finish is None:
            committed, finish = ray.get(rank0.progress.remote(request_id), timeout=PROGRESS_TIMEOUT_S)
            missed = committed[len(out.prompt_ids) + len(out.tokens) :]  # cycles whose reports died with the drafter
            if missed or finish is not None:
                yield out.push(missed, finish)
                continue
            try:
                outcome = ray.get(rank0.verify.remote(request_id, cycle, Draft.empty()), timeout=PROGRESS_TIMEOUT_S)
            except UnknownRequest:  # the lost drafter's last draft is still queued, or it finished the request
                time.sleep(0.01)
                continue  # progress says what it committed
            cycle += 1
            if outcome.committed_length - len(outcome.new_tokens) != len(out.prompt_ids) + len(out.tokens):
                continue  # a cycle of the lost drafter committed first: progress has its tokens and this one's
            out.stats.record_cycle(0, 0, 0.0, outcome.verify_seconds, allreduce_seconds=outcome.allreduce_seconds)
            yield out.push(outcome.new_tokens, outcome.finish)
