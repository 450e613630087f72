"""``TargetShardActor``: one tensor-parallel rank of a target replica (a plain class, made remote at spawn time).

Every rank loads the target, then :func:`~specserve.core.tensor_parallel.shard_model` keeps its
share of each block; the ranks of one replica form a ``torch.distributed`` group (gloo on CPU,
NCCL on GPU) whose deterministic all-reduces run inside the model's own forward.

Rank 0 is the driver of its replica. It hosts the gRPC verifier
(:class:`~specserve.rpc.verifier.VerifierServer`), owns each request's
:class:`~specserve.core.target.TargetVerifier` — the same verify-and-commit step the
single-process engine runs — and, before every forward or rollback, broadcasts a small command
(``op, sequence, args`` plus the block's token ids) to the other ranks. Those ranks run a loop
that receives the commands and mirrors them on their own KV shard, so after every verdict every
shard's cache holds exactly the committed text. Draft trees take two more commands: a tree
forward (root, node tokens and parents: every rank builds the same tree attention mask) and the
compaction that keeps only the accepted path's entries. Verification (and its random numbers) happens
on rank 0 only; the other ranks never need the verdict, only the rollback command that follows it.
A follower waits for the next command inside a collective, which times out
(``ReplicaConfig.collective_timeout_s``) so that a dead rank 0 becomes an error; an idle rank 0
therefore sends an empty heartbeat command every sixth of that timeout. For a
hidden-state drafter (EAGLE, Medusa) rank 0 also keeps the features of the prompt (returned by
``start_request``) and of each verdict's root and accepted path (sent with the verdict): after each
row-parallel all-reduce every rank holds the full residual stream, so rank 0's are the whole features.

All torch work of a rank runs on its one compute thread (:mod:`specserve.actors.compute`
explains why), which also serialises it: the collectives of consecutive commands must be issued
in the same order on every rank.
"""

from __future__ import annotations

import dataclasses
import logging
import os
import socket
import threading
import time
from collections.abc import Sequence
from concurrent.futures import Future
from datetime import timedelta

import torch

from specserve.actors.compute import ComputeThread, on_compute_thread, single_threaded
from specserve.core.draft import Proposal
from specserve.core.model import CausalLM, FeatureCapture, KVCache, ModelInfo
from specserve.core.sampling import SamplingParams, make_generators
from specserve.core.target import CycleOutcome, TargetVerifier
from specserve.core.tensor_parallel import DeterministicAllReduce, check_shardable, shard_model
from specserve.core.tree import DraftTree
from specserve.rpc.verifier import UnknownRequest, VerifierServer

logger = logging.getLogger(__name__)

# Commands rank 0 broadcasts to the other ranks: header = [op, sequence id, a, b] (int64).
OP_FORWARD = 1  # a = number of tokens (broadcast next), b = last_only
OP_ROLLBACK = 2  # a = length to keep
OP_NEW = 3
OP_FREE = 4
OP_SHUTDOWN = 5
OP_FORWARD_TREE = 6  # a = number of nodes; then [root, tokens..., parents...] (2a + 1 int64)
OP_COMPACT = 7  # a = number of positions to keep; then the positions
OP_HEARTBEAT = 8  # nothing to do: keeps an idle replica's followers inside the collectives' timeout
HEADER_SIZE = 4
HEARTBEAT_FRACTION = 6  # rank 0 sends a heartbeat after 1/6 of the collectives' timeout without a command


class _Commands:
    """Rank 0's broadcast of one command to the other ranks (nothing to do at TP 1)."""

    def __init__(self, world_size: int) -> None:
        self.world_size = world_size
        self.last_sent = time.monotonic()

    def send(self, op: int, sequence: int, a: int = 0, b: int = 0, tokens: torch.Tensor | None = None) -> None:
        if self.world_size == 1:
            return
        import torch.distributed as dist

        self.last_sent = time.monotonic()
        dist.broadcast(torch.tensor([op, sequence, a, b], dtype=torch.long), src=0)
        if tokens is not None:
            dist.broadcast(tokens.to("cpu", torch.long).contiguous(), src=0)


class ShardedSequence:
    """A :class:`~specserve.core.target.TargetSequence` whose forwards and rollbacks run on every rank."""

    def __init__(self, sequence_id: int, target: CausalLM, cache: KVCache, commands: _Commands) -> None:
        self.sequence_id = sequence_id
        self.target = target
        self.cache = cache
        self.commands = commands

    @property
    def length(self) -> int:
        return self.cache.length

    def forward(
        self, input_ids: torch.Tensor, last_only: bool = False, capture: FeatureCapture | None = None
    ) -> torch.Tensor:
        self.commands.send(OP_FORWARD, self.sequence_id, int(input_ids.numel()), int(last_only), input_ids)
        return self.target.forward(self.cache, input_ids, last_only=last_only, capture=capture)

    def rollback(self, length: int) -> None:
        self.commands.send(OP_ROLLBACK, self.sequence_id, length)
        self.cache.rollback(length)

    def forward_tree(self, root: int, tree: DraftTree, capture: FeatureCapture | None = None) -> torch.Tensor:
        self.commands.send(OP_FORWARD_TREE, self.sequence_id, tree.size, 0, _tree_block(root, tree))
        return self.target.forward_tree(self.cache, root, tree, capture=capture)

    def compact(self, keep: Sequence[int]) -> None:
        self.commands.send(OP_COMPACT, self.sequence_id, len(keep), 0, torch.tensor(list(keep), dtype=torch.long))
        self.cache.compact(keep)


def _tree_block(root: int, tree: DraftTree) -> torch.Tensor:
    """What the other ranks need to repeat a tree forward: ``[root, tokens..., parents...]``."""
    parents = torch.tensor(tree.parents, dtype=torch.long)
    return torch.cat([torch.tensor([root], dtype=torch.long), tree.tokens.to("cpu", torch.long), parents])


def _from_tree_block(block: torch.Tensor, nodes: int) -> tuple[int, DraftTree]:
    root, tokens, parents = int(block[0]), block[1 : nodes + 1], block[nodes + 1 :]
    return root, DraftTree(tokens.clone(), tuple(int(p) for p in parents.tolist()))


class _Request:
    def __init__(self, sequence: ShardedSequence, verifier: TargetVerifier) -> None:
        self.sequence = sequence
        self.verifier = verifier


class TargetShardActor:
    """Rank ``rank`` of a ``world_size``-way tensor-parallel target replica."""

    def __init__(
        self,
        model_dir: str,
        rank: int = 0,
        world_size: int = 1,
        dtype: str = "float32",
        device: str = "cpu",
        num_threads: int | None = None,
    ) -> None:
        self.compute = ComputeThread(num_threads)
        self.rank, self.world_size = rank, world_size
        self.target = self.compute.run(CausalLM.load, model_dir, dtype=dtype, device=device)
        check_shardable(self.target.model, world_size)
        self.all_reduce: DeterministicAllReduce | None = None  # set once the process group exists
        self._commands = _Commands(world_size)
        self._lock = threading.Lock()
        self._caches: dict[int, KVCache] = {}  # sequence id -> this rank's KV shard
        self._requests: dict[str, _Request] = {}  # rank 0 only
        self._next_sequence = 0
        self._server: VerifierServer | None = None
        self._loop: Future[object] | None = None
        self._stopped = threading.Event()  # set by shutdown(): rank 0's heartbeat stops
        self._heartbeat_s = 20.0

    # -----------------------------------------------------------------------------------------
    # Set-up (called by the replica spawner on every rank)

    def rendezvous(self) -> tuple[str, int]:
        """Rank 0: an address and free port for the process group's TCP store.

        A replica's shards always share a node (``STRICT_PACK``), so the store listens on loopback.
        """
        host = "127.0.0.1"
        with socket.socket() as sock:
            sock.bind((host, 0))
            port = int(sock.getsockname()[1])
        return host, port

    def init_tensor_parallel(self, host: str, port: int, timeout_s: float = 120.0) -> None:
        """Join the replica's process group and keep this rank's share of the weights.

        All ranks must be called together (submit every call, then wait): each blocks until all joined.
        """
        self._heartbeat_s = timeout_s / HEARTBEAT_FRACTION
        if self.world_size > 1:
            import torch.distributed as dist

            if host.startswith("127.") and "GLOO_SOCKET_IFNAME" not in os.environ:
                os.environ["GLOO_SOCKET_IFNAME"] = "lo"
            backend = "nccl" if self.target.device.type == "cuda" else "gloo"
            dist.init_process_group(
                backend,
                init_method=f"tcp://{host}:{port}",
                rank=self.rank,
                world_size=self.world_size,
                timeout=timedelta(seconds=timeout_s),
            )
            self.all_reduce = DeterministicAllReduce()
            self.compute.run(shard_model, self.target.model, self.rank, self.world_size, self.all_reduce)
        if self.rank > 0:
            self._loop = self.compute.start(self._follow)  # the compute thread follows rank 0 from now on
        elif self.world_size > 1:
            threading.Thread(target=self._heartbeat, name="tp-heartbeat", daemon=True).start()

    def _heartbeat(self) -> None:
        """Rank 0: a follower waits for the next command inside a collective, which times out: while the replica
        is idle, send an empty command every sixth of that timeout (on the compute thread, in order)."""
        while not self._stopped.wait(self._heartbeat_s / 4):
            if time.monotonic() - self._commands.last_sent >= self._heartbeat_s:
                self.compute.run(self._send_heartbeat)

    def _send_heartbeat(self) -> None:
        if not self._stopped.is_set() and time.monotonic() - self._commands.last_sent >= self._heartbeat_s:
            self._commands.send(OP_HEARTBEAT, 0)

    def start_server(self, host: str = "127.0.0.1", port: int = 0) -> str:
        """Rank 0: start the gRPC verifier; returns the address drafters dial.

        ``host`` is the interface to bind: loopback (default) when drafters share the node, the
        node's cluster-network address (or ``0.0.0.0``) when a drafter runs on another node; with
        ``0.0.0.0`` the returned address names this node's IP as Ray knows it.
        """
        self._require_rank0()
        if self._server is None:
            self._server = VerifierServer(self, host=host, port=port, run_in=self.compute.run)
            self._server.start()
        address = self._server.address
        if host == "0.0.0.0":
            import ray

            address = f"{ray.util.get_node_ip_address()}:{address.rsplit(':', 1)[1]}"
        return address

    def describe(self) -> ModelInfo:
        return self.target.info

    def node_id(self) -> str:
        import ray

        return str(ray.get_runtime_context().get_node_id())

    # -----------------------------------------------------------------------------------------
    # Requests (rank 0)

    @property
    def vocab_size(self) -> int:
        return self.target.info.vocab_size

    @on_compute_thread
    def start_request(
        self,
        request_id: str,
        prompt_ids: Sequence[int],
        params: SamplingParams,
        max_new_tokens: int,
        eos_token_ids: Sequence[int],
        feature_layers: Sequence[int] = (),
    ) -> torch.Tensor | None:
        """Admit a request and prefill its prompt on every rank. With ``feature_layers`` (a hidden-state
        drafter's), return the prompt's features, and every verdict carries its cycle's."""
        self._require_rank0()
        with self._lock:
            if request_id in self._requests:
                raise ValueError(f"request {request_id!r} is already running")
            sequence = self._new_sequence()
            generators = make_generators(params.seed, self.target.device)
            verifier = TargetVerifier(
                sequence,
                prompt_ids,
                params,
                generators.verify,
                max_new_tokens,
                eos_token_ids,
                self.target.device,
                feature_layers,
            )
            features = verifier.prefill()
            self._requests[request_id] = _Request(sequence, verifier)
            return features.cpu() if features is not None else None

    @on_compute_thread  # the gRPC server already calls it there (run_in): then it runs in place
    def verify(self, request_id: str, cycle: int, proposal: Proposal) -> CycleOutcome:
        """One cycle (called by the gRPC verifier, which encodes the outcome): forward on every rank, verify,
        commit, roll back (a chain) or compact to the accepted path (a tree)."""
        with self._lock:
            request = self._requests.get(request_id)
            if request is None:
                raise UnknownRequest(f"request {request_id!r} is not running on this replica")
            if request.verifier.finish is not None:
                raise UnknownRequest(f"request {request_id!r} already finished ({request.verifier.finish})")
            before = self._allreduce_seconds()
            outcome = request.verifier.verify(proposal)
            return dataclasses.replace(outcome, allreduce_seconds=self._allreduce_seconds() - before)

    @on_compute_thread
    def finish_request(self, request_id: str) -> None:
        """Forget a request and free its KV on every rank (unknown ids are ignored)."""
        with self._lock:
            request = self._requests.pop(request_id, None)
            if request is not None:
                sequence = request.sequence.sequence_id
                self._commands.send(OP_FREE, sequence)
                self._caches.pop(sequence, None)

    def committed(self, request_id: str) -> list[int]:
        with self._lock:
            return list(self._requests[request_id].verifier.committed)

    def sequence_id(self, request_id: str) -> int:
        with self._lock:
            return self._requests[request_id].sequence.sequence_id

    def active_requests(self) -> list[str]:
        with self._lock:
            return list(self._requests)

    # -----------------------------------------------------------------------------------------
    # Introspection (every rank)

    def kv_snapshot(self, sequence_id: int) -> list[tuple[torch.Tensor, torch.Tensor]]:
        """This rank's cached keys and values of one sequence, per layer."""
        # Ranks > 0: the compute thread is busy following rank 0, so copy here, without a new OpenMP team.
        with self._lock, single_threaded():
            return self._caches[sequence_id].snapshot()

    def shutdown(self) -> None:
        self._stopped.set()
        if self._server is not None:
            self._server.stop(grace=0.5)
            self._server = None
        if self.world_size > 1:
            import torch.distributed as dist

            if self.rank == 0:
                self.compute.run(self._commands.send, OP_SHUTDOWN, 0)
            elif self._loop is not None:
                self._loop.result(timeout=10)
            if dist.is_initialized():
                dist.destroy_process_group()

    # -----------------------------------------------------------------------------------------

    def _new_sequence(self) -> ShardedSequence:
        sequence_id = self._next_sequence
        self._next_sequence += 1
        self._commands.send(OP_NEW, sequence_id)
        cache = self._caches[sequence_id] = self.target.new_cache()
        return ShardedSequence(sequence_id, self.target, cache, self._commands)

    def _follow(self) -> None:
        """Ranks > 0: mirror rank 0's commands on this rank's KV shard until told to stop."""
        import torch.distributed as dist

        header = torch.empty(HEADER_SIZE, dtype=torch.long)
        try:
            while True:
                dist.broadcast(header, src=0)
                op, sequence, a, b = (int(x) for x in header.tolist())
                if op == OP_SHUTDOWN:
                    return
                if op == OP_HEARTBEAT:
                    continue
                with self._lock:
                    if op == OP_NEW:
                        self._caches[sequence] = self.target.new_cache()
                    elif op == OP_FREE:
                        self._caches.pop(sequence, None)
                    elif op == OP_ROLLBACK:
                        self._caches[sequence].rollback(a)
                    elif op == OP_FORWARD:
                        tokens = torch.empty(a, dtype=torch.long)
                        dist.broadcast(tokens, src=0)
                        self.target.forward(self._caches[sequence], tokens, last_only=bool(b))
                    elif op == OP_FORWARD_TREE:
                        block = torch.empty(2 * a + 1, dtype=torch.long)
                        dist.broadcast(block, src=0)
                        root, tree = _from_tree_block(block, a)
                        self.target.forward_tree(self._caches[sequence], root, tree)
                    elif op == OP_COMPACT:
                        keep = torch.empty(a, dtype=torch.long)
                        dist.broadcast(keep, src=0)
                        self._caches[sequence].compact(keep.tolist())
                    else:
                        raise RuntimeError(f"unknown tensor-parallel command {op}")
        except Exception:  # the replica cannot continue; rank 0's next collective times out with an error
            logger.exception("tensor-parallel rank %d stopped following rank 0", self.rank)

    def _allreduce_seconds(self) -> float:
        return self.all_reduce.seconds if self.all_reduce is not None else 0.0

    def _require_rank0(self) -> None:
        if self.rank != 0:
            raise RuntimeError(f"only rank 0 of a replica does this (this is rank {self.rank})")
