"""The rank-command protocol of a tensor-parallel target replica: what rank 0 broadcasts, and how the others apply it.

Before every forward, rollback, compaction, allocation or release of KV, rank 0 broadcasts one command to the other
ranks, which repeat it on their own shard, so every shard's cache holds exactly the committed text. A command is a
header ``[op, sequence, a, b]`` (:data:`HEADER_SIZE` int64, ``op`` an :class:`Op`), then for some commands one int64
payload whose length the header gives. Each command is one class below with its two halves side by side: ``send``
(rank 0, through :class:`RankCommands`) and ``apply`` (a follower, on its :class:`FollowerState`).
:func:`follow` is a follower's loop.

Does not decide when a command is sent (the sharded sequences and pool of :mod:`specserve.actors.target_shard` do),
verify anything (rank 0 alone does), or hold KV of its own (a follower's caches and pool are the actor's).
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from enum import IntEnum

import torch

from specserve.core.batch_step import LocalPool
from specserve.core.kv.cache import KVCache
from specserve.core.kv.pool import KVPool
from specserve.core.model.causal_lm import BatchBlock, CausalLM
from specserve.core.target import PooledSequence
from specserve.core.tree.draft_tree import DraftTree

HEADER_SIZE = 4  # [op, sequence, a, b], int64


class Op(IntEnum):
    """A command's code, the header's first value."""

    FORWARD = 1  # a = number of tokens (broadcast next), b = last_only
    ROLLBACK = 2  # a = length to keep
    NEW = 3  # a pool's: a = tokens reserved
    FREE = 4
    SHUTDOWN = 5
    FORWARD_TREE = 6  # a = number of nodes; then [root, tokens..., parents...] (2a + 1 int64)
    COMPACT = 7  # a = number of positions to keep; then the positions
    HEARTBEAT = 8  # nothing to do: keeps an idle replica's followers inside the collectives' timeout
    FORWARD_BATCH = 9  # sequence = number of blocks, a = payload length (broadcast next), b = last_only
    COPY = 10  # a pool's prefix-cache hit: sequence = target, a = source, b = start; then [stop]
    SHRINK = 11  # a pool's sequence gives back its reserved positions past a


class RankCommands:
    """Rank 0's broadcast of one command to the other ranks (nothing to do at TP 1)."""

    def __init__(self, world_size: int) -> None:
        self.world_size = world_size
        self.last_sent = time.monotonic()

    def send(self, op: Op, sequence: int, a: int = 0, b: int = 0, payload: torch.Tensor | None = None) -> None:
        if self.world_size == 1:
            return
        import torch.distributed as dist

        self.last_sent = time.monotonic()
        dist.broadcast(torch.tensor([int(op), sequence, a, b], dtype=torch.long), src=0)
        if payload is not None:
            dist.broadcast(payload.to("cpu", torch.long).contiguous(), src=0)


@dataclass
class FollowerState:
    """What a rank > 0 applies commands to: its target shard and its KV — a cache per sequence, or (a batched replica)
    its share of the pool, whose sequences the commands then name."""

    target: CausalLM
    caches: dict[int, KVCache]  # sequence id -> this rank's KV shard (replicas without a pool)
    pool: KVPool | None = None

    def kv(self, sequence: int) -> KVCache | PooledSequence:
        """The KV of ``sequence`` on this rank, to roll back or compact: its cache, or its span of the pool."""
        if self.pool is None:
            return self.caches[sequence]
        return PooledSequence(LocalPool(self.target, self.pool), sequence)


def _receive(size: int) -> torch.Tensor:
    """The payload rank 0 broadcasts after a header: ``size`` int64."""
    import torch.distributed as dist

    payload = torch.empty(size, dtype=torch.long)
    dist.broadcast(payload, src=0)
    return payload


def _unknown(op: int, state: FollowerState) -> RuntimeError:
    op = int(op)
    suffix = " for a batched replica" if state.pool is not None else ""
    return RuntimeError(f"unknown tensor-parallel command {op}{suffix}")


# ---------------------------------------------------------------------------------------------
# The commands: each one's send (rank 0) beside its apply (the other ranks)


class New:
    """A new sequence: its own cache, or ``tokens`` positions of the pool (allocations in the same order place the
    same spans, moves included, on every rank)."""

    @staticmethod
    def send(commands: RankCommands, sequence: int, tokens: int = 0) -> None:
        commands.send(Op.NEW, sequence, tokens)

    @staticmethod
    def apply(state: FollowerState, sequence: int, a: int, b: int) -> None:
        if state.pool is None:
            state.caches[sequence] = state.target.new_cache()
        elif state.pool.allocate(a) != sequence:
            raise RuntimeError(f"this rank's KV pool gave another sequence id than rank 0's ({sequence})")


class Free:
    """A sequence's KV is released."""

    @staticmethod
    def send(commands: RankCommands, sequence: int) -> None:
        commands.send(Op.FREE, sequence)

    @staticmethod
    def apply(state: FollowerState, sequence: int, a: int, b: int) -> None:
        if state.pool is None:
            state.caches.pop(sequence, None)
        else:
            state.pool.free(sequence)


class CopyPrefix:
    """A prefix-cache hit: positions ``start .. stop - 1`` of one pool sequence copied into another."""

    @staticmethod
    def send(commands: RankCommands, source: int, target: int, start: int, stop: int) -> None:
        commands.send(Op.COPY, target, source, start, torch.tensor([stop], dtype=torch.long))

    @staticmethod
    def apply(state: FollowerState, sequence: int, a: int, b: int) -> None:
        stop = int(_receive(1)[0])
        assert state.pool is not None, "only a batched replica's pool copies prefixes"
        state.pool.copy(a, sequence, b, stop)


class Shrink:
    """A pool sequence (a prefix-cache entry) keeps only ``reserved`` reserved positions."""

    @staticmethod
    def send(commands: RankCommands, sequence: int, reserved: int) -> None:
        commands.send(Op.SHRINK, sequence, reserved)

    @staticmethod
    def apply(state: FollowerState, sequence: int, a: int, b: int) -> None:
        assert state.pool is not None, "only a batched replica's pool shrinks sequences"
        state.pool.shrink(sequence, a)


class Rollback:
    """A sequence keeps its first ``length`` positions."""

    @staticmethod
    def send(commands: RankCommands, sequence: int, length: int) -> None:
        commands.send(Op.ROLLBACK, sequence, length)

    @staticmethod
    def apply(state: FollowerState, sequence: int, a: int, b: int) -> None:
        state.kv(sequence).rollback(a)


class Compact:
    """A sequence keeps the cached positions ``keep`` (a tree's accepted path), in order."""

    @staticmethod
    def send(commands: RankCommands, sequence: int, keep: Sequence[int]) -> None:
        commands.send(Op.COMPACT, sequence, len(keep), 0, torch.tensor(list(keep), dtype=torch.long))

    @staticmethod
    def apply(state: FollowerState, sequence: int, a: int, b: int) -> None:
        keep = _receive(a).tolist()
        state.kv(sequence).compact(keep)


class Forward:
    """A chain forward of one sequence (its own cache)."""

    @staticmethod
    def send(commands: RankCommands, sequence: int, input_ids: torch.Tensor, last_only: bool) -> None:
        commands.send(Op.FORWARD, sequence, int(input_ids.numel()), int(last_only), input_ids)

    @staticmethod
    def apply(state: FollowerState, sequence: int, a: int, b: int) -> None:
        if state.pool is not None:
            raise _unknown(Op.FORWARD, state)
        tokens = _receive(a)
        state.target.forward(state.caches[sequence], tokens, last_only=bool(b))


class ForwardTree:
    """A tree forward of one sequence (its own cache): root, node tokens and parents, from which every rank builds the
    same tree attention mask."""

    @staticmethod
    def send(commands: RankCommands, sequence: int, root: int, tree: DraftTree) -> None:
        parents = torch.tensor(tree.parents, dtype=torch.long)
        block = torch.cat([torch.tensor([root], dtype=torch.long), tree.tokens.to("cpu", torch.long), parents])
        commands.send(Op.FORWARD_TREE, sequence, tree.size, 0, block)

    @staticmethod
    def apply(state: FollowerState, sequence: int, a: int, b: int) -> None:
        if state.pool is not None:
            raise _unknown(Op.FORWARD_TREE, state)
        block = _receive(2 * a + 1)
        root, tokens, parents = int(block[0]), block[1 : a + 1], block[a + 1 :]
        tree = DraftTree(tokens.clone(), tuple(int(p) for p in parents.tolist()))
        state.target.forward_tree(state.caches[sequence], root, tree)


class ForwardBatch:
    """A batched forward over the pool (the header's sequence is the number of blocks): every block's sequence,
    tokens, positions and mask."""

    @staticmethod
    def send(commands: RankCommands, blocks: Sequence[BatchBlock], last_only: bool) -> None:
        payload = pack_blocks(blocks)
        commands.send(Op.FORWARD_BATCH, len(blocks), int(payload.numel()), int(last_only), payload)

    @staticmethod
    def apply(state: FollowerState, sequence: int, a: int, b: int) -> None:
        if state.pool is None:
            raise _unknown(Op.FORWARD_BATCH, state)
        payload = _receive(a)
        state.target.forward_batch(state.pool, unpack_blocks(payload, sequence), last_only=bool(b))


class Heartbeat:
    """Nothing to do: an idle rank 0 sends it so that followers waiting inside a collective never reach its
    timeout."""

    @staticmethod
    def send(commands: RankCommands) -> None:
        commands.send(Op.HEARTBEAT, 0)


class Shutdown:
    """The followers stop following (:func:`follow` returns)."""

    @staticmethod
    def send(commands: RankCommands) -> None:
        commands.send(Op.SHUTDOWN, 0)


APPLY: dict[int, Callable[[FollowerState, int, int, int], None]] = {
    Op.NEW: New.apply,
    Op.FREE: Free.apply,
    Op.ROLLBACK: Rollback.apply,
    Op.COMPACT: Compact.apply,
    Op.FORWARD: Forward.apply,
    Op.FORWARD_TREE: ForwardTree.apply,
    Op.FORWARD_BATCH: ForwardBatch.apply,
    Op.COPY: CopyPrefix.apply,
    Op.SHRINK: Shrink.apply,
}


def follow(state: FollowerState, lock: threading.Lock) -> None:
    """A rank > 0: apply rank 0's commands, each under ``lock``, until told to stop (heartbeats are skipped)."""
    import torch.distributed as dist

    header = torch.empty(HEADER_SIZE, dtype=torch.long)
    while True:
        dist.broadcast(header, src=0)
        op, sequence, a, b = (int(x) for x in header.tolist())
        if op == Op.SHUTDOWN:
            return
        if op == Op.HEARTBEAT:
            continue
        with lock:
            apply = APPLY.get(op)
            if apply is None:
                raise _unknown(op, state)
            apply(state, sequence, a, b)


# ---------------------------------------------------------------------------------------------
# A batched forward's payload


def pack_blocks(blocks: Sequence[BatchBlock]) -> torch.Tensor:
    """What the other ranks need to repeat a batched forward: per block ``[seq_id, k, tokens (k), offsets (k), sees
    (k · k)]`` as one int64 tensor (a causal block travels with its explicit lower-triangular mask)."""
    parts: list[torch.Tensor] = []
    for block in blocks:
        k = block.size
        offsets = block.offsets or tuple(range(k))
        parts += [
            torch.tensor([block.seq_id, k], dtype=torch.long),
            block.tokens.to("cpu", torch.long),
            torch.tensor(offsets, dtype=torch.long),
            block.attends().to(torch.long).flatten(),
        ]
    return torch.cat(parts)


def unpack_blocks(payload: torch.Tensor, count: int) -> list[BatchBlock]:
    values = payload.tolist()
    blocks, at = [], 0
    for _ in range(count):
        seq_id, k = values[at], values[at + 1]
        at += 2
        tokens = payload[at : at + k].clone()
        offsets = tuple(values[at + k : at + 2 * k])
        sees = payload[at + 2 * k : at + 2 * k + k * k].reshape(k, k).to(torch.bool)
        at += 2 * k + k * k
        blocks.append(BatchBlock(seq_id, tokens, sees, offsets))
    if at != len(values):
        raise RuntimeError(f"a batched-forward command of {len(values)} values held {at} for {count} blocks")
    return blocks
