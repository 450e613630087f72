"""``DrafterActor``: holds any drafter from ``specserve.drafters`` and runs a request's draft-verify loop.

The actor holds its replica's configured drafter and, for requests that name them
(:attr:`DraftJob.drafter`), the model-free ``ngram`` and ``none`` drafters, each built on the
first request that asks for it and kept (a :class:`~specserve.core.draft.DrafterSet`). Every
torch call — building drafters included — runs on the actor's compute thread.

For each request the actor opens one ``Speculate`` stream to its replica's rank 0 and loops:
propose (within the budget the single-process engine would use) → send the tree → receive the
verdict → hand the committed tokens back to the drafter. Each cycle is reported to the caller
(the :class:`~specserve.actors.coordinator.Coordinator`) as a :class:`CycleReport` through a Ray
streaming generator, so the caller never sits on the critical path of a cycle. Reports are
yielded once the next tree has been sent, while the target verifies it; after the first cycle
they are batched (``report_interval_s``, default 0.1 s), because each yield costs CPU that the
target's verify would otherwise have.

**Overlap mode.** Once a tree is sent, the drafter does not wait idle: it assumes the most likely
verdict — every draft token accepted — and drafts one token past the tree's leaf (its guess at
the bonus token) and the next tree after that. If the verdict accepts everything and its bonus
token equals the guess, the next tree is ready at once; otherwise the drafter rewinds to the
committed text and drafts afresh. A draft is only ever a proposal and every proposal is still
verified by the exact rules, so exactness is unaffected; only the drafter's random stream (and
so the sampled text for a given seed) differs from a run without overlap.

Overlap applies to chains: a request that drafts trees (:attr:`DraftJob.tree`) drafts each tree
after the previous verdict, as the single-process engine does. So does a drafter that reads the
target's hidden states (EAGLE, Medusa: :class:`~specserve.core.draft.FeatureDrafter`), which needs
the verdict's features before it can draft again; it also waits for the target's prefill (whose
features it drafts from) before its first draft, and is handed each verdict's features.

With overlap off, the sequence of drafter calls and random draws is exactly the single-process
engine's, so a seeded run emits exactly what the in-process engine emits.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from typing import Any

import grpc
import torch

from specserve.actors.compute import ComputeThread
from specserve.core.draft import Draft, Drafter, FeatureDrafter, TreeDrafter, propose_tree_within, propose_within
from specserve.core.model import ModelInfo, TargetDescription, load_tokenizer
from specserve.core.prompts import InvalidRequest
from specserve.core.sampling import SamplingParams, make_generators
from specserve.core.schedule import Budget, CycleObservation
from specserve.core.tree import DraftTree, TreeSpec
from specserve.drafters.registry import build_drafter_set
from specserve.policies.schedules import schedules
from specserve.rpc.codec import accepted_tokens, encode_draft
from specserve.rpc.verifier import VerifierStream, open_channel


@dataclass(frozen=True)
class DraftJob:
    request_id: str
    prompt_ids: tuple[int, ...]
    params: SamplingParams
    gamma: int
    max_new_tokens: int
    verifier_address: str
    overlap: bool = False
    report_interval_s: float = 0.1  # after the first cycle, reports are batched at most this often
    drafter: str = "default"  # the configured drafter, "ngram" or "none" (REQUEST_DRAFTERS)
    tree: TreeSpec | None = None  # draft trees of this shape instead of gamma-token chains (never overlapped)
    policy: str = "fixed"  # how much to draft each cycle (POLICY_NAMES); gamma / tree = the request's own budget

    @property
    def budget(self) -> Budget:
        return Budget(self.gamma, self.tree)


@dataclass(frozen=True)
class CycleReport:
    new_tokens: list[int]  # committed this cycle (already cut at EOS / max_new_tokens by the target)
    finished: bool  # the target ended the request (EOS or max_new_tokens)
    # the budget, what was sent and accepted; draft_seconds = drafting on the critical path (0 when overlap had
    # the draft ready), verify_seconds = the target's forward + verification + rollback, wire_seconds =
    # send-to-verdict time the target did not spend (gRPC, serialisation)
    observation: CycleObservation
    allreduce_seconds: float  # of verify_seconds, tensor-parallel all-reduces
    overlap_hit: bool  # the next draft was drafted during this verification and is used


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
    ) -> None:
        self.compute = ComputeThread(num_threads)
        self.device = torch.device(device)
        target = TargetDescription(target_info, load_tokenizer(target_dir), self.device)
        self.drafters = self.compute.run(
            build_drafter_set, drafter, target, dtype=dtype, device=device, max_ngram=max_ngram, min_ngram=min_ngram
        )
        self.schedules = schedules()  # per request; the adaptive ones share this replica's prior
        self._channels: dict[str, grpc.Channel] = {}
        self._current: str | None = None  # the request whose loop is running
        self._cancel = False  # set by cancel(): stop that loop after its current cycle
        self._busy = threading.Lock()  # one request at a time: a drafter holds one request's state

    def node_id(self) -> str:
        import ray

        return str(ray.get_runtime_context().get_node_id())

    def feature_layers(self) -> tuple[int, ...]:
        """The target features the configured drafter reads (EAGLE, Medusa); empty for any other drafter."""
        drafter = self.drafters.configured
        return tuple(drafter.feature_layers) if isinstance(drafter, FeatureDrafter) else ()

    def cancel(self, request_id: str) -> None:
        """Stop a running request's loop after its current cycle (the caller no longer wants it)."""
        if request_id == self._current:
            self._cancel = True

    def run(self, job: DraftJob, target_ready: Sequence[Any] = ()) -> Iterator[list[CycleReport]]:
        """The draft-verify loop of one request; yields batches of cycle reports until the target finishes it.

        ``target_ready`` may hold the ``ObjectRef`` of rank 0's ``start_request``: the drafter then
        prefills its own state and drafts its first tree while the target prefills the prompt, and
        waits for the target only before sending that draft (on two machines, or two cores, the two prefills overlap).
        """
        with self._busy:
            self._current, self._cancel = job.request_id, False
            try:
                # The loop itself runs here (a Ray thread); every torch call goes to the compute thread.
                yield from self._loop(job, target_ready)
            finally:
                self._current = None

    def _loop(self, job: DraftJob, target_ready: Sequence[Any]) -> Iterator[list[CycleReport]]:
        device, run = self.device, self.compute.run
        drafter = run(self.drafters.get, job.drafter)  # built here on first use, then kept
        generators = make_generators(job.params.seed, device)
        run(drafter.start, job.prompt_ids, job.params, generators.draft)
        reader = drafter if isinstance(drafter, FeatureDrafter) else None  # drafts from the target's features
        reads_features = reader is not None
        if reader is not None and target_ready:  # it drafts from the prompt's features: wait for the target's prefill
            import ray

            features = ray.get(list(target_ready))[0]
            if features is not None:
                run(reader.add_features, 0, features.to(device))
            target_ready = ()
        committed = len(job.prompt_ids)
        remaining = job.max_new_tokens
        # The first tree is drafted before waiting for the target (same calls and draws as after it).
        t0 = time.perf_counter()
        if job.tree is not None and not isinstance(drafter, TreeDrafter):
            raise InvalidRequest(f"the {job.drafter!r} drafter cannot draft trees; send chains (no tree)")
        schedule = self.schedules(job.policy, job.budget)
        budget = schedule.next_budget(remaining)
        first: Draft | DraftTree | None = run(_propose, drafter, budget, remaining, device)
        first_seconds = time.perf_counter() - t0
        if target_ready:
            import ray

            ray.get(list(target_ready))  # raises the target's error if it could not admit the request
        stream = VerifierStream(self._channel(job.verifier_address))
        ready: Draft | None = None
        ready_budget = budget
        # Reports not yet sent to the caller. Each yield costs about a millisecond of CPU in this process and
        # the caller's, which on a small machine slows the target's verify: after the first cycle (time to
        # first token) they go out in batches, at most every report_interval_s, while the target verifies.
        pending: list[CycleReport] = []
        last_report = 0.0
        cycle = 0
        try:
            while not self._cancel:
                t0 = time.perf_counter()
                overlap_hit = ready is not None
                draft: Draft | DraftTree
                if first is not None:
                    draft, first = first, None
                    t0 -= first_seconds
                elif ready is not None:  # drafted during the last verification, with the budget of that time
                    draft, budget = ready, ready_budget
                else:
                    budget = schedule.next_budget(remaining)
                    draft = run(_propose, drafter, budget, remaining, device)
                t1 = time.perf_counter()
                stream.send_raw(run(encode_draft, job.request_id, cycle, draft).SerializeToString())

                ahead: Draft | None = None
                ahead_seconds = 0.0
                if job.overlap and not reads_features and isinstance(draft, Draft) and remaining - draft.gamma - 1 > 0:
                    # Assume the likeliest verdict (all accepted) and draft the bonus guess plus the next tree.
                    run(drafter.accept, draft.tokens.tolist())
                    ahead = run(drafter.propose, budget.gamma + 1)
                    ahead_seconds = time.perf_counter() - t1

                if pending and (cycle == 1 or time.perf_counter() - last_report >= job.report_interval_s):
                    yield pending
                    pending, last_report = [], time.perf_counter()

                info = stream.receive()
                t2 = time.perf_counter()
                accepted = info.verdict.num_accepted
                new = accepted_tokens(draft, info.verdict)[: info.committed_length - committed]
                root = committed - 1  # the position of the verified block's first token
                committed, remaining = info.committed_length, remaining - len(new)

                ready = None
                if ahead is not None:  # the drafter's context holds the draft as if all of it were accepted
                    assert isinstance(draft, Draft)
                    hit = (
                        not info.finished
                        and accepted == draft.gamma
                        and ahead.gamma > 0
                        and int(ahead.tokens[0]) == info.verdict.next_token
                    )
                    if hit:  # the verdict is the assumed one: only the bonus token is new to the drafter
                        run(drafter.accept, new[-1:])
                        ready = _trim(ahead, 1, min(budget.gamma, remaining - 1))
                        ready_budget = budget
                    else:
                        run(drafter.rewind, committed - len(new))
                        if not info.finished:
                            run(drafter.accept, new)
                elif not info.finished:
                    run(drafter.accept, new)
                    if reader is not None and info.features is not None:
                        run(reader.add_features, root, info.features.to(device))

                busy = max(info.target_seconds, ahead_seconds)
                drafted, depth = (draft.gamma, draft.gamma) if isinstance(draft, Draft) else (draft.size, draft.depth)
                observation = CycleObservation(
                    budget,
                    drafted,
                    depth,
                    accepted,
                    draft_seconds=t1 - t0,
                    verify_seconds=info.target_seconds,
                    wire_seconds=max(0.0, (t2 - t1) - busy),
                )
                schedule.observe(observation)
                pending.append(CycleReport(new, info.finished, observation, info.allreduce_seconds, overlap_hit))
                if info.finished:
                    yield pending
                    return
                cycle += 1
        finally:
            stream.close()

    def _channel(self, address: str) -> grpc.Channel:
        if address not in self._channels:
            self._channels[address] = open_channel(address)
        return self._channels[address]


def _propose(drafter: Drafter, budget: Budget, remaining: int, device: torch.device) -> Draft | DraftTree:
    """The next proposal within the request's remaining tokens: a chain, or a tree of the budget's shape."""
    if budget.tree is None:
        return propose_within(drafter, budget.gamma, remaining, device)
    if not isinstance(drafter, TreeDrafter):
        raise InvalidRequest("this drafter cannot draft the trees the policy chose; send chains (no tree)")
    return propose_tree_within(drafter, budget.tree, remaining).to(device)


def _trim(draft: Draft, start: int, budget: int) -> Draft | None:
    """``draft`` without its first ``start`` tokens, at most ``budget`` long (``None`` when nothing is left)."""
    if budget <= 0:
        return None
    tokens = draft.tokens[start : start + budget]
    if tokens.numel() == 0:
        return None
    probs = draft.draft_probs[start : start + budget] if draft.draft_probs is not None else None
    return Draft(tokens, probs)
