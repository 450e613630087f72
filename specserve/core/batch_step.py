"""One batched verification step over a KV pool, written once for every batched runtime.

:func:`verify_batch` scores every request's verify block in **one** target forward over the pool
(:meth:`~specserve.core.model.causal_lm.CausalLM.forward_batch`: rows padded to the widest block, each row attending
over only its own prefix and block), then lets each request's :class:`~specserve.core.target.TargetVerifier`
decide on its own rows by the exact rules, with its own generators, and roll back or compact its own
sequence. The decisions take one copy to the host for the whole step (:mod:`specserve.core.verify.staged`): every
verifier stages its verdict on the device (the rules' work, every row's next token, the logprobs asked for, whether
its logits are finite), one transfer brings every request's numbers over, and each verifier commits from them.
Typical acceptance (lossy, opted into) still reads its own tensors while staging (its rule walks on the host).
A request whose verifier has feature layers (a hidden-state drafter's) gets its block's features
from that same forward, as :meth:`~specserve.core.target.TargetVerifier.verify` gets them alone. Every
request waited for the whole step, so each outcome's ``verify_seconds`` is the step's; the step also
reports the positions its forward computed (rows × widest block), which goodput-aware schedules learn
costs against.

The in-process :class:`~specserve.core.batch_engine.BatchedEngine` runs it on a :class:`LocalPool`;
rank 0 of a distributed replica runs it on pool operations that every tensor-parallel rank mirrors
(``specserve.actors``). Does not draft, admit requests, or decide who joins a step.
"""

from __future__ import annotations

import dataclasses
import time
from collections.abc import Sequence
from dataclasses import dataclass

import torch

from specserve.core.draft.drafter import Proposal
from specserve.core.errors import request_failure
from specserve.core.kv.pool import KVPool
from specserve.core.model.buckets import VerifyBuckets
from specserve.core.model.causal_lm import BatchBlock, CausalLM, FeatureCapture
from specserve.core.static.batch_graphs import BatchGraphs
from specserve.core.target import CycleOutcome, PoolOps, TargetVerifier
from specserve.core.verify.staged import Staged, read


class LocalPool:
    """Pool operations in this process: the target's batched forward and the pool's own rollback and compaction."""

    def __init__(
        self, target: CausalLM, pool: KVPool, buckets: VerifyBuckets | None = None, graphs: BatchGraphs | None = None
    ) -> None:
        """``buckets``: every step runs at the bucket of its widest block (static shapes); ``graphs``: steps that fit
        its buckets run as captured steps (:mod:`specserve.core.static.batch_graphs`)."""
        self.target = target
        self.pool = pool
        self.buckets = buckets
        self.graphs = graphs

    def forward_batch(
        self,
        blocks: Sequence[BatchBlock],
        last_only: bool = False,
        capture: Sequence[FeatureCapture | None] | None = None,
    ) -> list[torch.Tensor]:
        return self.target.forward_batch(
            self.pool, blocks, last_only=last_only, capture=capture, buckets=self.buckets, graphs=self.graphs
        )

    def rollback(self, seq_id: int, length: int) -> None:
        self.pool.rollback(seq_id, length)

    def compact(self, seq_id: int, keep: Sequence[int]) -> None:
        self.pool.compact(seq_id, keep)


def kv_tokens(sequence_tokens: int, tree_nodes: int = 0) -> int:
    """KV positions a request reserves in a pool: its prompt and output (``sequence_tokens``), and for a request that
    drafts trees of up to ``tree_nodes`` nodes, room for its last verify block. A cycle caches every committed token
    but the last, then verifies a block of that token and its drafts; chains are cut to the tokens the request may
    still emit minus one (:func:`~specserve.core.draft.drafter.propose`), so they stay within ``sequence_tokens``, but a
    tree's nodes may outnumber them (only its depth is cut)."""
    return sequence_tokens + tree_nodes


@dataclass(frozen=True)
class StepResult:
    outcomes: list[CycleOutcome | Exception]  # per item, in order: its outcome, or what ended it alone
    seconds: float  # the forward and every verdict
    positions: int  # positions the forward computed: rows × the widest block


def verify_batch(ops: PoolOps, items: Sequence[tuple[TargetVerifier, Proposal, int]]) -> StepResult:
    """Verify ``(verifier, proposal, seq_id)`` items in one forward over ``ops`` (see the module docstring).

    One request's own failure — its block or its verdict raising (its grammar gave up, a processor raised), or the
    target's logits for its rows not finite — is that item's outcome (:func:`~specserve.core.errors.request_failure`),
    and every other item is decided as if it had not been there (its rows are its own). Only the shared forward's
    failure raises. A failed request's KV holds its block, rolled back or not: its caller ends it, which frees it."""
    if not items:
        raise ValueError("a batched step needs at least one request")
    start = time.perf_counter()
    outcomes: list[CycleOutcome | Exception | None] = [None] * len(items)
    live, blocks = [], []
    for i, (verifier, proposal, seq_id) in enumerate(items):
        try:
            blocks.append(verifier.block(proposal, seq_id))
            live.append(i)
        except Exception as exc:
            outcomes[i] = request_failure(exc, "verification")
    positions = len(blocks) * max((block.size for block in blocks), default=0)
    if live:
        captures = [items[i][0].new_capture() for i in live]  # None for requests that read no features
        logits = ops.forward_batch(blocks, capture=captures)
        staged: list[tuple[int, Staged[CycleOutcome]]] = []
        for i, rows, capture in zip(live, logits, captures, strict=True):
            verifier, proposal, _ = items[i]
            features = capture.take() if capture is not None else None
            try:
                staged.append((i, verifier.stage(proposal, rows, start, features)))
            except Exception as exc:
                outcomes[i] = request_failure(exc, "verification")
        hosts = read([s.tensors for _, s in staged])  # one host sync for the step
        for (i, stage), host in zip(staged, hosts, strict=True):
            try:
                outcomes[i] = stage.finish(host)
            except Exception as exc:
                outcomes[i] = request_failure(exc, "verification")
    seconds = time.perf_counter() - start
    done = [o if isinstance(o, Exception) else dataclasses.replace(o, verify_seconds=seconds) for o in outcomes if o]
    assert len(done) == len(items), "every item has its outcome or its failure"
    return StepResult(done, seconds, positions)
