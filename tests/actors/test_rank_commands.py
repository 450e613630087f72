"""The rank-command protocol (:mod:`specserve.actors.rank_commands`) without Ray or a process group.

``torch.distributed.broadcast`` is replaced by a queue: what rank 0 sends, a follower in the same process receives,
so one test sends a request's commands (new, forward, tree forward, compaction, rollback, free, heartbeat,
shutdown) and checks that the follower's cache ends up holding exactly rank 0's keys and values; another does the
same for a batched replica's pool, a prefix-cache copy and trim included.
"""

from __future__ import annotations

import threading
from collections import deque

import pytest
import torch
from conftest import TinyPair

from specserve.actors.rank_commands import (
    APPLY,
    Compact,
    FollowerState,
    Forward,
    ForwardTree,
    Free,
    Heartbeat,
    New,
    Op,
    RankCommands,
    Rollback,
    Shutdown,
    follow,
    pack_blocks,
    unpack_blocks,
)
from specserve.core.kv.pool import KVPool
from specserve.core.model.causal_lm import BatchBlock
from specserve.core.tree.draft_tree import DraftTree


class Wire:
    """Rank 0's broadcasts, queued until a follower (run after rank 0 sent them all) takes them in order."""

    def __init__(self) -> None:
        self.sent: deque[torch.Tensor] = deque()
        self.receiving = False  # False: broadcasts send (rank 0); True: they receive (a follower)

    def broadcast(self, tensor: torch.Tensor, src: int) -> None:
        assert src == 0
        if self.receiving:
            tensor.copy_(self.sent.popleft())
        else:
            self.sent.append(tensor.clone())


@pytest.fixture
def wire(monkeypatch: pytest.MonkeyPatch) -> Wire:
    import torch.distributed as dist

    wire = Wire()
    monkeypatch.setattr(dist, "broadcast", wire.broadcast)
    return wire


def test_op_codes_are_the_wire_values() -> None:
    assert {op.name: int(op) for op in Op} == {
        "FORWARD": 1,
        "ROLLBACK": 2,
        "NEW": 3,
        "FREE": 4,
        "SHUTDOWN": 5,
        "FORWARD_TREE": 6,
        "COMPACT": 7,
        "HEARTBEAT": 8,
        "FORWARD_BATCH": 9,
        "COPY": 10,
        "SHRINK": 11,
    }
    assert set(APPLY) == set(Op) - {Op.HEARTBEAT, Op.SHUTDOWN}  # the loop itself handles those two


def test_batched_forward_blocks_travel_whole() -> None:
    tree = DraftTree(torch.tensor([7, 8, 9]), (-1, 0, 0))
    blocks = [BatchBlock.chain(3, torch.tensor([4, 5])), BatchBlock.tree(1, 6, tree)]
    back = unpack_blocks(pack_blocks(blocks), len(blocks))
    for block, copy in zip(blocks, back, strict=True):
        assert copy.seq_id == block.seq_id and torch.equal(copy.tokens, block.tokens)
        assert torch.equal(copy.attends(), block.attends())
        assert copy.offsets == (block.offsets or tuple(range(block.size)))
    with pytest.raises(RuntimeError, match="held"):
        unpack_blocks(pack_blocks(blocks), 1)


def test_a_follower_mirrors_rank_0s_cache(tiny_pairs: dict[str, TinyPair], wire: Wire) -> None:
    target = tiny_pairs["llama"].target
    commands = RankCommands(world_size=2)
    mine = target.new_cache()
    New.send(commands, 0)
    prompt = torch.tensor([5, 6, 7, 8, 9])
    Forward.send(commands, 0, prompt, last_only=True)
    target.forward(mine, prompt, last_only=True)
    tree = DraftTree(torch.tensor([10, 11, 12]), (-1, 0, 0))
    ForwardTree.send(commands, 0, 13, tree)
    target.forward_tree(mine, 13, tree)
    keep = [0, 1, 2, 3, 4, 5, 7]  # the prompt, the root and node 1
    Compact.send(commands, 0, keep)
    mine.compact(keep)
    Heartbeat.send(commands)
    Rollback.send(commands, 0, 6)
    mine.rollback(6)
    New.send(commands, 1)
    Free.send(commands, 1)
    Shutdown.send(commands)

    wire.receiving = True
    state = FollowerState(target, caches={})
    follow(state, threading.Lock())  # returns at the shutdown command
    assert not wire.sent, "the follower did not read every command"
    assert set(state.caches) == {0}
    theirs = state.caches[0]
    assert theirs.length == mine.length == 6
    for (k0, v0), (k1, v1) in zip(mine.snapshot(), theirs.snapshot(), strict=True):
        assert torch.equal(k0, k1) and torch.equal(v0, v1)


def test_a_command_a_replica_cannot_run_stops_its_follower(tiny_pairs: dict[str, TinyPair], wire: Wire) -> None:
    commands = RankCommands(world_size=2)
    commands.send(Op.FORWARD_BATCH, 1, 4, 0, torch.zeros(4, dtype=torch.long))
    wire.receiving = True
    state = FollowerState(tiny_pairs["llama"].target, caches={})
    with pytest.raises(RuntimeError, match=r"unknown tensor-parallel command 9$"):
        follow(state, threading.Lock())


def test_a_batched_follower_mirrors_rank_0s_pool(tiny_pairs: dict[str, TinyPair], wire: Wire) -> None:
    """Rank 0's :class:`~specserve.actors.target_shard.ShardedPool` sends as it goes; a follower's pool ends equal."""
    from specserve.actors.target_shard import ShardedPool

    target = tiny_pairs["llama"].target
    mine = ShardedPool(target, KVPool(target.model, capacity=64), RankCommands(world_size=2))
    first, second = mine.allocate(24), mine.allocate(24)
    mine.forward_batch([BatchBlock.chain(first, torch.tensor([5, 6, 7])), BatchBlock.chain(second, torch.tensor([8]))])
    tree = DraftTree(torch.tensor([10, 11, 12]), (-1, 0, 0))
    mine.forward_batch([BatchBlock.tree(first, 13, tree), BatchBlock.chain(second, torch.tensor([9, 4]))])
    mine.compact(first, [0, 1, 2, 3, 5])  # the chunk, the root and node 1
    mine.rollback(second, 2)
    third = mine.allocate(16)
    mine.copy(first, third, 0, 4)  # a prefix-cache hit
    mine.shrink(first, 5)  # an entry trimmed to what it caches
    mine.free(second)
    Shutdown.send(mine.commands)

    wire.receiving = True
    state = FollowerState(target, caches={}, pool=KVPool(target.model, capacity=64))
    follow(state, threading.Lock())
    assert not wire.sent, "the follower did not read every command"
    assert state.pool is not None and state.pool.length(first) == mine.pool.length(first) == 5
    assert state.pool.length(third) == mine.pool.length(third) == 4
    assert state.pool.reserved(first) == mine.pool.reserved(first) == 5
    assert state.pool.free_tokens == mine.pool.free_tokens == 64 - 5 - 16
    for sequence in (first, third):
        for (k0, v0), (k1, v1) in zip(mine.pool.snapshot(sequence), state.pool.snapshot(sequence), strict=True):
            assert torch.equal(k0, k1) and torch.equal(v0, v1)
