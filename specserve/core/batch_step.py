"""One batched verification step over a KV pool, written once for every batched runtime.

:func:`verify_batch` scores every request's verify block in **one** target forward over the pool
(:meth:`~specserve.core.model.CausalLM.forward_batch`: rows padded to the widest block, each row seeing
only its own prefix and block), then lets each request's :class:`~specserve.core.target.TargetVerifier`
decide on its own rows by the exact rules, with its own generators, and roll back or compact its own
slot. A request whose verifier has feature layers (a hidden-state drafter's) gets its block's features
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
from collections.abc import Iterable, Sequence
from dataclasses import dataclass

import torch

from specserve.core.draft import Proposal
from specserve.core.kv_pool import KVPool
from specserve.core.model import BatchBlock, CausalLM, FeatureCapture
from specserve.core.target import CycleOutcome, PooledSequence, PoolOps, TargetVerifier


class LocalPool:
    """Pool operations in this process: the target's batched forward and the pool's own rollback and compaction."""

    def __init__(self, target: CausalLM, pool: KVPool) -> None:
        self.target = target
        self.pool = pool

    def forward_batch(
        self,
        blocks: Sequence[BatchBlock],
        last_only: bool = False,
        capture: Sequence[FeatureCapture | None] | None = None,
    ) -> list[torch.Tensor]:
        return self.target.forward_batch(self.pool, blocks, last_only=last_only, capture=capture)

    def rollback(self, slot: int, length: int) -> None:
        self.pool.rollback(slot, length)

    def compact(self, slot: int, keep: Sequence[int]) -> None:
        self.pool.compact(slot, keep)

    def move(self, source: int, target: int) -> None:
        self.pool.move(source, target)


def pack(ops: PoolOps, pool: KVPool, sequences: Iterable[PooledSequence]) -> None:
    """Move the allocated slots down to ``0 .. n − 1`` (:meth:`~specserve.core.kv_pool.KVPool.packing`, carried out
    through ``ops``, so on every rank) and renumber the ``sequences`` that held them. A step whose rows are
    consecutive slots reads the pool as a view: a copy of a few requests' KV now and then, between steps, instead of
    a gather of every request's KV in every layer at every step."""
    moved = dict(pool.packing())  # a slot moves at most once: each target is below every slot still to move
    for source, target in moved.items():
        ops.move(source, target)
    for sequence in sequences:
        sequence.slot = moved.get(sequence.slot, sequence.slot)


@dataclass(frozen=True)
class StepResult:
    outcomes: list[CycleOutcome]  # per item, in order
    seconds: float  # the forward and every verdict
    positions: int  # positions the forward computed: rows × the widest block


def verify_batch(ops: PoolOps, items: Sequence[tuple[TargetVerifier, Proposal, int]]) -> StepResult:
    """Verify ``(verifier, proposal, slot)`` items in one forward over ``ops`` (see the module docstring)."""
    if not items:
        raise ValueError("a batched step needs at least one request")
    start = time.perf_counter()
    blocks = [verifier.block(proposal, slot) for verifier, proposal, slot in items]
    captures = [verifier.new_capture() for verifier, _, _ in items]  # None for requests that read no features
    logits = ops.forward_batch(blocks, capture=captures)
    outcomes = [
        verifier.decide(proposal, rows, start, capture.take() if capture is not None else None)
        for (verifier, proposal, _), rows, capture in zip(items, logits, captures, strict=True)
    ]
    seconds = time.perf_counter() - start
    positions = len(blocks) * max(block.size for block in blocks)
    return StepResult([dataclasses.replace(o, verify_seconds=seconds) for o in outcomes], seconds, positions)
