"""``TargetShardActor``: one tensor-parallel rank of a target replica (a plain class, made remote at spawn time).

Every rank loads the target, then :func:`~specserve.core.model.tensor_parallel.shard_model` keeps its
share of each block; the ranks of one replica form a ``torch.distributed`` group (gloo on CPU,
NCCL on GPU) whose deterministic all-reduces run inside the model's own forward.

Rank 0 is the driver of its replica. It hosts the gRPC verifier
(:class:`~specserve.rpc.verifier.VerifierServer`), owns each request's
:class:`~specserve.core.target.TargetVerifier` — the same verify-and-commit step the
single-process engine runs — and, before every forward or rollback, broadcasts a small command
(``op, sequence, args`` plus the block's token ids: :mod:`specserve.actors.rank_commands`) to the other
ranks. Those ranks run a loop
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
row-parallel all-reduce every rank holds the full residual stream, so rank 0's are the whole features. A batched
rank 0 with a prefix cache keeps them per position too (a ``PrefixStore`` per namespace and feature layers), so a
request served from the cache hands its drafter the cached prefix's features with those it computes.

All torch work of a rank runs on its one compute thread (:mod:`specserve.actors.compute`
explains why), which also serialises it: the collectives of consecutive commands must be issued
in the same order on every rank.
"""

from __future__ import annotations

import dataclasses
import logging
import os
import secrets
import socket
import threading
import time
from collections.abc import Sequence
from concurrent.futures import Future
from datetime import timedelta

import torch

from specserve.actors.compute import ComputeThread, on_compute_thread, single_threaded
from specserve.actors.rank_commands import (
    Compact,
    CopyPrefix,
    FollowerState,
    Forward,
    ForwardBatch,
    ForwardTree,
    Free,
    Heartbeat,
    New,
    RankCommands,
    Rollback,
    Shrink,
    Shutdown,
    follow,
)
from specserve.core.batch_step import LocalPool, kv_tokens, verify_batch
from specserve.core.draft.drafter import Proposal
from specserve.core.errors import UserError
from specserve.core.kv.cache import KVCache
from specserve.core.kv.pool import DEFAULT_MEMORY_FRACTION, KVPool, memory_tokens, pool_tokens
from specserve.core.kv.prefix_cache import Hit, PrefixCache
from specserve.core.kv.prefix_store import PrefixStore
from specserve.core.model.causal_lm import BatchBlock, CausalLM, FeatureCapture, ModelInfo
from specserve.core.model.tensor_parallel import DeterministicAllReduce, check_shardable, shard_model
from specserve.core.request import new_verifier
from specserve.core.sampling.params import SamplingParams
from specserve.core.sampling.warps import make_generators
from specserve.core.target import CycleOutcome, FinishReason, PooledSequence, TargetVerifier
from specserve.core.tree.draft_tree import DraftTree
from specserve.core.verify.logprobs import TokenLogprob
from specserve.rpc.verifier import UnknownRequest, VerifierServer

logger = logging.getLogger(__name__)

ROOM_POLL_S = 0.05  # a batched replica's newcomer re-checks the KV pool for room this often while it waits
HEARTBEAT_FRACTION = 6  # rank 0 sends a heartbeat after 1/6 of the collectives' timeout without a command
# rank 0 of a batched replica with a prefix cache: target features kept for hidden-state drafters' requests, in
# positions (one row of the drafter's feature layers each: 6 KiB for an EAGLE-3 head on the shipped target, 48 MiB)
FEATURE_STORE_POSITIONS = 8192


class ShardedSequence:
    """A :class:`~specserve.core.target.TargetSequence` whose forwards and rollbacks run on every rank."""

    def __init__(self, sequence_id: int, target: CausalLM, cache: KVCache, commands: RankCommands) -> None:
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
        Forward.send(self.commands, self.sequence_id, input_ids, last_only)
        return self.target.forward(self.cache, input_ids, last_only=last_only, capture=capture)

    def rollback(self, length: int) -> None:
        Rollback.send(self.commands, self.sequence_id, length)
        self.cache.rollback(length)

    def forward_tree(self, root: int, tree: DraftTree, capture: FeatureCapture | None = None) -> torch.Tensor:
        ForwardTree.send(self.commands, self.sequence_id, root, tree)
        return self.target.forward_tree(self.cache, root, tree, capture=capture)

    def compact(self, keep: Sequence[int]) -> None:
        Compact.send(self.commands, self.sequence_id, keep)
        self.cache.compact(keep)


class ShardedPool:
    """Rank 0's :class:`~specserve.core.target.PoolOps`: every allocation, batched forward, rollback and
    compaction is broadcast to the other ranks first, then done here on this rank's share of the pool."""

    def __init__(self, target: CausalLM, pool: KVPool, commands: RankCommands) -> None:
        self.local = LocalPool(target, pool)
        self.pool = pool
        self.commands = commands

    def allocate(self, tokens: int) -> int:
        seq_id = self.pool.allocate(tokens)
        New.send(self.commands, seq_id, tokens)
        return seq_id

    def free(self, seq_id: int) -> None:
        Free.send(self.commands, seq_id)
        self.pool.free(seq_id)

    def copy(self, source: int, target: int, start: int, stop: int) -> None:
        CopyPrefix.send(self.commands, source, target, start, stop)
        self.pool.copy(source, target, start, stop)

    def shrink(self, seq_id: int, reserved: int) -> None:
        Shrink.send(self.commands, seq_id, reserved)
        self.pool.shrink(seq_id, reserved)

    def forward_batch(
        self,
        blocks: Sequence[BatchBlock],
        last_only: bool = False,
        capture: Sequence[FeatureCapture | None] | None = None,
    ) -> list[torch.Tensor]:
        """The other ranks repeat the forward without capturing: after each row-parallel all-reduce every rank
        holds the full residual stream, so rank 0's captured features are the whole features."""
        ForwardBatch.send(self.commands, blocks, last_only)
        return self.local.forward_batch(blocks, last_only=last_only, capture=capture)

    def rollback(self, seq_id: int, length: int) -> None:
        Rollback.send(self.commands, seq_id, length)
        self.pool.rollback(seq_id, length)

    def compact(self, seq_id: int, keep: Sequence[int]) -> None:
        Compact.send(self.commands, seq_id, keep)
        self.pool.compact(seq_id, keep)


@dataclasses.dataclass(frozen=True)
class Started:
    """What rank 0's :meth:`TargetShardActor.start_request` hands back once a request is admitted and prefilled."""

    features: torch.Tensor | None  # the prompt's, for a hidden-state drafter (else None)
    cached_tokens: int  # prompt positions taken from the prefix cache


class _Request:
    def __init__(
        self, sequence: ShardedSequence | PooledSequence, verifier: TargetVerifier, namespace: str = ""
    ) -> None:
        self.sequence = sequence
        self.verifier = verifier
        self.namespace = namespace  # its prefix-cache namespace
        self.reuses = False  # takes prefixes from the prefix cache (a batched replica's)
        self.cached_tokens = 0  # prompt positions it took from there
        # with feature layers and a prefix cache: the features of every committed position but the last, kept so a
        # request served from the cache still hands its drafter the whole prompt's, and later ones can take them
        self.features: list[torch.Tensor] | None = None
        self.feature_key: tuple[str, tuple[int, ...]] = (namespace, ())

    def keep_features(self, features: torch.Tensor | None) -> None:
        """Append the features of the next positions (a prefill chunk's, or a verdict's root and accepted path)."""
        if self.features is not None and features is not None:
            self.features.extend(features.unbind(0))

    @property
    def seq_id(self) -> int:
        """Where its KV lives on every rank: its sequence in the pool, or its own cache's id."""
        return self.sequence.seq_id if isinstance(self.sequence, PooledSequence) else self.sequence.sequence_id


class _VerifyBatcher:
    """Rank 0 of a batched replica: gathers the verify calls of its running requests into batched steps.

    Each request's gRPC stream hands its draft over (:meth:`verify`) and waits. A step starts once every running
    request has a draft waiting, or ``wait_s`` after the first one arrived (a request still drafting, or whose
    drafter is slow, joins the next step), and verifies all of them in one forward on the compute thread.
    """

    def __init__(self, shard: TargetShardActor, wait_s: float) -> None:
        self.shard = shard
        self.wait_s = wait_s
        self._cond = threading.Condition()
        self._pending: dict[str, tuple[Proposal, Future[CycleOutcome]]] = {}
        self._stopped = False
        self._thread = threading.Thread(target=self._loop, name="verify-batcher", daemon=True)
        self._thread.start()

    def verify(self, request_id: str, proposal: Proposal) -> CycleOutcome:
        future: Future[CycleOutcome] = Future()
        with self._cond:
            if self._stopped:
                raise UnknownRequest("the replica is shutting down")
            if request_id in self._pending:
                raise UnknownRequest(f"request {request_id!r} already has a draft waiting to be verified")
            self._pending[request_id] = (proposal, future)
            self._cond.notify_all()
        return future.result()

    def wake(self) -> None:
        """The running requests changed (one left): a step may not need to wait any longer."""
        with self._cond:
            self._cond.notify_all()

    def stop(self) -> None:
        with self._cond:
            self._stopped = True
            self._cond.notify_all()

    def _loop(self) -> None:
        while True:
            with self._cond:
                self._cond.wait_for(lambda: bool(self._pending) or self._stopped)
                if self._stopped:
                    for _, future in self._pending.values():
                        future.set_exception(UnknownRequest("the replica is shutting down"))
                    return
                deadline = time.monotonic() + self.wait_s
                while len(self._pending) < self.shard.expected_drafts() and not self._stopped:
                    left = deadline - time.monotonic()
                    if left <= 0 or not self._cond.wait(left):
                        break
                batch, self._pending = self._pending, {}
            try:
                results = self.shard.compute.run(self.shard.verify_step, {r: p for r, (p, _) in batch.items()})
            except BaseException as exc:  # the whole step failed: every request in it hears why
                for _, future in batch.values():
                    future.set_exception(exc)
                continue
            for request_id, (_, future) in batch.items():
                result = results[request_id]
                if isinstance(result, BaseException):
                    future.set_exception(result)
                else:
                    future.set_result(result)


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
        max_num_seqs: int = 0,
        max_seq_len: int = 0,
        batch_wait_s: float = 0.02,
        prefill_tokens: int = 256,
        kv_pool_tokens: int = 0,
        kv_memory_fraction: float = DEFAULT_MEMORY_FRACTION,
        prefix_caching: bool = True,
    ) -> None:
        """``max_num_seqs`` > 0 makes a batched replica: every rank keeps its KV in a pool of ``kv_pool_tokens``
        positions (0: room for ``max_num_seqs`` requests of ``max_seq_len``, itself 0 for the target's context, or
        what ``kv_memory_fraction`` of the device's free memory holds if that is less; a newcomer waits for the
        tokens it reserves), and rank 0 verifies the drafts of its running requests together,
        one forward per step, waiting at most ``batch_wait_s`` for a step to fill, and prefills newcomers
        ``prefill_tokens`` tokens at a time between steps. With ``prefix_caching`` rank 0 keeps a prefix cache over
        the pool (:mod:`specserve.core.kv.prefix_cache`) and every rank mirrors its copies, trims and evictions."""
        self.compute = ComputeThread(num_threads)
        self.rank, self.world_size = rank, world_size
        self.target = self.compute.run(CausalLM.load, model_dir, dtype=dtype, device=device)
        check_shardable(self.target.model, world_size)
        if self.target.windows.recurrent:  # (not in the distributed runtime's rank commands yet)
            raise UserError(
                f"{self.target.info.architecture}'s recurrent layers are served by the in-process engine only: serve "
                "it with tp_degree 1, no overlap and the drafter colocated"
            )
        self.all_reduce: DeterministicAllReduce | None = None  # set once the process group exists
        self._commands = RankCommands(world_size)
        self._lock = threading.Lock()
        self._caches: dict[int, KVCache] = {}  # sequence id -> this rank's KV shard
        self._requests: dict[str, _Request] = {}  # rank 0 only
        self._next_sequence = 0
        self._server: VerifierServer | None = None
        self._token = secrets.token_urlsafe(32)  # rank 0's verifier serves only streams that present it
        self._loop: Future[object] | None = None
        self._stopped = threading.Event()  # set by shutdown(): rank 0's heartbeat stops
        self._heartbeat_s = 20.0
        self._max_num_seqs = max_num_seqs
        max_seq_len = max_seq_len or self.target.info.max_positions
        self._pool_tokens = kv_pool_tokens  # 0: sized once the model is sharded (init_tensor_parallel)
        self._max_seq_len = max_seq_len
        self._kv_memory_fraction = kv_memory_fraction
        self._room = threading.Condition()  # notified when a batched replica's request frees its KV
        self._batch_wait_s = batch_wait_s
        self._pool: ShardedPool | None = None  # batched replicas, once the model is sharded
        self._prefill_tokens = prefill_tokens
        self._prefilling: dict[str, _Request] = {}  # rank 0: admitted, prompt not yet cached
        self._batcher: _VerifyBatcher | None = None  # batched replicas, rank 0
        self._prefix_caching = prefix_caching
        self._cache: PrefixCache | None = None  # batched replicas with prefix caching, rank 0
        # rank 0, with the cache: target features per position, per (namespace, feature layers) — what a hidden-state
        # drafter's request takes beside the cached KV of the same prefix
        self._features = PrefixStore[torch.Tensor](FEATURE_STORE_POSITIONS)

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
        if self._max_num_seqs:
            pool = self.compute.run(lambda: KVPool(self.target.model, self._pool_size()))
            self._pool = ShardedPool(self.target, pool, self._commands)
            if self.rank == 0:
                self._batcher = _VerifyBatcher(self, self._batch_wait_s)
                if self._prefix_caching:
                    self._cache = PrefixCache(pool, self._pool)
        if self.rank > 0:
            self._loop = self.compute.start(self._follow)  # the compute thread follows rank 0 from now on
        elif self.world_size > 1:
            threading.Thread(target=self._heartbeat, name="tp-heartbeat", daemon=True).start()

    def _pool_size(self) -> int:
        """``kv_pool_tokens``, or :func:`~specserve.core.kv.pool.pool_tokens` of this rank's share of the heads: the
        fewest over the ranks (each reads its own device's free memory; the pools mirror each other's spans)."""
        if self._pool_tokens:
            return self._pool_tokens
        fitting = memory_tokens(self.target.model, self._kv_memory_fraction)
        if self.world_size > 1:  # agree before any rank may refuse: a rank that raised alone would hang the others
            import torch.distributed as dist

            fewest = torch.tensor([fitting], dtype=torch.int64)
            dist.all_reduce(fewest, op=dist.ReduceOp.MIN)
            fitting = int(fewest.item())
        return pool_tokens(
            self.target.model,
            self._max_num_seqs,
            kv_tokens(self._max_seq_len),
            self._kv_memory_fraction,
            fitting=fitting,
        )

    def _heartbeat(self) -> None:
        """Rank 0: a follower waits for the next command inside a collective, which times out: while the replica
        is idle, send an empty command every sixth of that timeout (on the compute thread, in order)."""
        while not self._stopped.wait(self._heartbeat_s / 4):
            if time.monotonic() - self._commands.last_sent >= self._heartbeat_s:
                self.compute.run(self._send_heartbeat)

    def _send_heartbeat(self) -> None:
        if not self._stopped.is_set() and time.monotonic() - self._commands.last_sent >= self._heartbeat_s:
            Heartbeat.send(self._commands)

    def start_server(self, host: str = "127.0.0.1", port: int = 0) -> str:
        """Rank 0: start the gRPC verifier; returns the address drafters dial.

        ``host`` is the interface to bind: loopback (default) when drafters share the node, the
        node's cluster-network address (or ``0.0.0.0``) when a drafter runs on another node; with
        ``0.0.0.0`` the returned address names this node's IP as Ray knows it.
        """
        self._require_rank0()
        if self._server is None:
            # batched: each stream's handler thread waits for its step (the batcher runs steps on the compute thread)
            run_in = None if self._batcher is not None else self.compute.run
            self._server = VerifierServer(
                self, host=host, port=port, run_in=run_in, max_workers=self._max_num_seqs + 16, token=self._token
            )
            self._server.start()
        address = self._server.address
        if host == "0.0.0.0":
            import ray

            address = f"{ray.util.get_node_ip_address()}:{address.rsplit(':', 1)[1]}"
        return address

    def verifier_token(self) -> str:
        """Rank 0: the secret the replica's drafters present to its verifier (made when the actor starts)."""
        self._require_rank0()
        return self._token

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

    def start_request(
        self,
        request_id: str,
        prompt_ids: Sequence[int],
        params: SamplingParams,
        max_new_tokens: int,
        eos_token_ids: Sequence[int],
        feature_layers: Sequence[int] = (),
        tree_nodes: int = 0,
        cache_namespace: str = "",
    ) -> Started:
        """Admit a request and prefill its prompt on every rank; what it cached and, with ``feature_layers`` (a
        hidden-state drafter's), the prompt's features (every verdict then carries its cycle's too).

        A batched replica with a prefix cache copies the longest prefix of the prompt that requests of
        ``cache_namespace`` cached, before its first chunk and again before each (another request may have prefilled
        more of it since). A request with ``feature_layers`` takes no more of it than rank 0 keeps the features of (its
        drafter still gets every prompt position's: those of the cached prefix from rank 0's store of them, kept from
        the requests that computed them, prompt and answer).

        A batched replica first waits until its KV pool has the tokens the request reserves (its prompt and output, and
        its widest draft: ``tree_nodes`` for trees); one that could never fit is refused at once
        (:class:`~specserve.core.kv.pool.PoolFull`). It prefills in chunks of at most ``prefill_tokens`` tokens, each
        its own turn on the compute thread, so the running requests' steps go on between them: a long prompt delays them
        by one chunk at a time."""
        self._require_rank0()
        reserve = kv_tokens(len(prompt_ids) + max_new_tokens, tree_nodes)
        while True:
            request = self.compute.run(
                self._admit,
                request_id,
                prompt_ids,
                params,
                max_new_tokens,
                eos_token_ids,
                feature_layers,
                reserve,
                cache_namespace,
            )
            if request is not None:
                break
            with self._room:  # polls as well: a wake-up between the check and this wait costs at most one poll
                self._room.wait(timeout=ROOM_POLL_S)
        chunks: list[torch.Tensor] = []
        try:
            if self._pool is None:
                features = self.compute.run(request.verifier.prefill)
                chunks += [features] if features is not None else []
            while self._pool is not None and request.verifier.unprefilled:
                features = self.compute.run(self._prefill_chunk, request)
                chunks += [features] if features is not None else []
        except BaseException:
            self.compute.run(self._abandon, request_id)
            raise
        self.compute.run(self._register, request_id)
        if request.features is not None:  # every prompt position's: those of the cached prefix too
            chunks = [torch.stack(request.features)] if request.features else []
        features = (torch.cat(chunks).cpu() if chunks else torch.empty(0, 0)) if feature_layers else None
        return Started(features, request.cached_tokens)

    def _admit(
        self,
        request_id: str,
        prompt_ids: Sequence[int],
        params: SamplingParams,
        max_new_tokens: int,
        eos_token_ids: Sequence[int],
        feature_layers: Sequence[int],
        reserve: int,
        namespace: str = "",
    ) -> _Request | None:
        """On the compute thread: the request's KV (``reserve`` tokens of the pool, or a sequence on every rank, the
        prefix cache evicting for it) and verifier; ``None`` while the pool lacks the room (a request that could never
        fit raises)."""
        with self._lock:
            if request_id in self._requests or request_id in self._prefilling:
                raise ValueError(f"request {request_id!r} is already running")
            sequence: ShardedSequence | PooledSequence
            cache = self._cache
            key = (namespace, tuple(feature_layers))
            hit = self._lookup(key, prompt_ids[:-1]) if cache is not None else None
            if self._pool is not None:
                if reserve <= self._pool.pool.capacity:  # (one that could never fit raises on allocating)
                    fits, hit = cache.admit(reserve, hit) if cache is not None else (self._pool.pool.fits(reserve), hit)
                    if not fits:
                        return None
                sequence = PooledSequence(self._pool, self._pool.allocate(reserve))
            else:
                sequence = self._new_sequence()
            generators = make_generators(params.seed, self.target.device)
            verifier = new_verifier(
                self.target,
                sequence,
                prompt_ids,
                params,
                generators.verify,
                max_new_tokens,
                eos_token_ids,
                feature_layers,
            )
            request = self._prefilling[request_id] = _Request(sequence, verifier, namespace)
            request.reuses = cache is not None
            if cache is not None and feature_layers:
                request.features, request.feature_key = [], key
            self._reuse(request, hit)
            return request

    def _lookup(
        self, key: tuple[str, tuple[int, ...]], tokens: Sequence[int], exclude: int | None = None
    ) -> Hit | None:
        """The prefix cache's longest prefix of ``tokens`` in the key's namespace; for a request that reads features
        (the key's layers), no longer than the features kept of it."""
        assert self._cache is not None
        namespace, layers = key
        hit = self._cache.lookup(namespace, tokens, exclude=exclude)
        if hit is None or not layers:
            return hit
        held = len(self._features.peek(key, tokens))
        return Hit(hit.seq_id, min(hit.length, held)) if held else None

    def _reuse(self, request: _Request, hit: Hit | None = None) -> None:
        """Copy a prefix-cache hit (if any) into the request's span and offer what it caches to other requests; once its
        prompt is all cached, count the request."""
        cache = self._cache
        if cache is None or not request.reuses:
            return
        committed = request.verifier.committed
        request.cached_tokens += cache.adopt(request.seq_id, request.namespace, committed, hit)
        if request.features is not None:
            length = request.sequence.length
            if hit is not None and len(request.features) < length:  # the hit's features, as far as it was copied
                request.features = self._features.get(request.feature_key, committed[:length])
            self._features.put(request.feature_key, committed, request.features)
        if not request.verifier.unprefilled:
            cache.record(len(committed) - 1, request.cached_tokens)

    def _prefill_chunk(self, request: _Request) -> torch.Tensor | None:
        """On the compute thread: the next chunk of a batched replica's prefill (its features, if it captures), after
        taking what the prefix cache holds of it now."""
        assert self._pool is not None
        with self._lock:
            if self._cache is not None and request.reuses:
                tokens = request.verifier.committed[:-1]
                hit = self._lookup(request.feature_key, tokens, exclude=request.seq_id)
                if hit is not None and hit.length > request.sequence.length:
                    self._reuse(request, hit)
                if not request.verifier.unprefilled:
                    return None
            capture = request.verifier.new_capture()
            block = request.verifier.prefill_block(request.seq_id, self._prefill_tokens)
            self._pool.forward_batch([block], last_only=True, capture=[capture])
            features = capture.take() if capture is not None else None
            request.keep_features(features)
            self._reuse(request)
            return features

    def _register(self, request_id: str) -> None:
        """On the compute thread: a prefilled request joins the steps."""
        with self._lock:
            self._requests[request_id] = self._prefilling.pop(request_id)

    def _abandon(self, request_id: str) -> None:
        with self._lock:
            request = self._prefilling.pop(request_id, None)
            if request is not None:
                self._release(request)

    def verify(self, request_id: str, cycle: int, proposal: Proposal) -> CycleOutcome:
        """One cycle (called by the gRPC verifier, which encodes the outcome): forward on every rank, verify,
        commit, roll back (a chain) or compact to the accepted path (a tree). A batched replica verifies it in
        the next step with the other running requests' drafts."""
        if self._batcher is not None:
            return self._batcher.verify(request_id, proposal)
        return self._verify_alone(request_id, cycle, proposal)

    @on_compute_thread  # the gRPC server already calls it there (run_in): then it runs in place
    def _verify_alone(self, request_id: str, cycle: int, proposal: Proposal) -> CycleOutcome:
        with self._lock:
            request = self._requests.get(request_id)
            if request is None:
                raise UnknownRequest(f"request {request_id!r} is not running on this replica")
            if request.verifier.finish is not None:
                raise UnknownRequest(f"request {request_id!r} already finished ({request.verifier.finish})")
            before = self._allreduce_seconds()
            outcome = request.verifier.verify(proposal)
            return dataclasses.replace(outcome, allreduce_seconds=self._allreduce_seconds() - before)

    def expected_drafts(self) -> int:
        """Running requests whose next draft a batched step waits for (admitted, not finished)."""
        with self._lock:
            return sum(request.verifier.finish is None for request in self._requests.values())

    def verify_step(self, drafts: dict[str, Proposal]) -> dict[str, CycleOutcome | BaseException]:
        """Rank 0 of a batched replica, on the compute thread: one batched step over these requests' drafts (an
        unknown or finished request gets its error, the others their outcomes)."""
        results: dict[str, CycleOutcome | BaseException] = {}
        items = []
        with self._lock:
            for request_id, proposal in drafts.items():
                request = self._requests.get(request_id)
                if request is None:
                    results[request_id] = UnknownRequest(f"request {request_id!r} is not running on this replica")
                elif request.verifier.finish is not None:
                    results[request_id] = UnknownRequest(
                        f"request {request_id!r} already finished ({request.verifier.finish})"
                    )
                else:
                    items.append((request_id, request, proposal))
            if not items:
                return results
            assert self._pool is not None
            before = self._allreduce_seconds()
            step = verify_batch(
                self._pool, [(request.verifier, proposal, request.seq_id) for _, request, proposal in items]
            )
            allreduce = self._allreduce_seconds() - before
            for (request_id, request, _), outcome in zip(items, step.outcomes, strict=True):
                if not isinstance(outcome, Exception):
                    request.keep_features(outcome.features)
                results[request_id] = (
                    outcome  # that request's own failure: it alone ends
                    if isinstance(outcome, Exception)
                    else dataclasses.replace(
                        outcome, allreduce_seconds=allreduce, batch_size=len(items), step_positions=step.positions
                    )
                )
        return results

    @on_compute_thread
    def finish_request(self, request_id: str) -> None:
        """Forget a request and free its KV on every rank (unknown ids are ignored)."""
        with self._lock:
            request = self._requests.pop(request_id, None)
            if request is not None:
                self._release(request, retain=True)
        if self._batcher is not None:
            self._batcher.wake()

    def _release(self, request: _Request, retain: bool = False) -> None:
        """Free a request's KV on every rank; a batched replica's prefix cache keeps it when ``retain`` (a request
        that finished or was cancelled between steps: its KV holds committed text only)."""
        sequence = request.sequence
        if isinstance(sequence, PooledSequence):
            assert self._pool is not None
            committed = request.verifier.committed
            if self._cache is not None and retain and sequence.length < len(committed):  # not amid a failed block
                tokens = committed[: sequence.length]
                self._cache.retain(sequence.seq_id, request.namespace, tokens)
                if request.features is not None:  # (a verdict cut at a stop may have given more than were kept)
                    self._features.put(request.feature_key, committed, request.features[: len(committed) - 1])
            else:
                if self._cache is not None:
                    self._cache.withdraw(sequence.seq_id)
                self._pool.free(sequence.seq_id)
            with self._room:
                self._room.notify_all()
        else:
            Free.send(self._commands, sequence.sequence_id)
            self._caches.pop(sequence.sequence_id, None)

    def committed(self, request_id: str) -> list[int]:
        with self._lock:
            return list(self._requests[request_id].verifier.committed)

    def progress(self, request_id: str) -> tuple[list[int], FinishReason | None, list[TokenLogprob]]:
        """A running request's committed tokens (prompt + output), its finish reason (``None`` while it runs) and,
        when it asked for them, its output tokens' logprobs: where a coordinator that lost the request's drafter
        takes over (:meth:`Coordinator._decode_plainly`)."""
        with self._lock:
            request = self._requests.get(request_id)
            if request is None:
                raise UnknownRequest(f"request {request_id!r} is not running on this replica")
            verifier = request.verifier
            return list(verifier.committed), verifier.finish, list(verifier.output_logprobs)

    def sequence_id(self, request_id: str) -> int:
        """Where a request's KV lives on every rank: its cache's id, or its sequence in the pool (batched replicas)."""
        with self._lock:
            return self._requests[request_id].seq_id

    def active_requests(self) -> list[str]:
        with self._lock:
            return list(self._requests)

    # -----------------------------------------------------------------------------------------
    # Introspection (every rank)

    def kv_snapshot(self, sequence_id: int) -> list[tuple[torch.Tensor, torch.Tensor]]:
        """This rank's cached keys and values of one sequence, per layer."""
        # Ranks > 0: the compute thread is busy following rank 0, so copy here, without a new OpenMP team.
        with self._lock, single_threaded():
            if self._pool is not None:
                return self._pool.pool.snapshot(sequence_id)
            return self._caches[sequence_id].snapshot()

    @on_compute_thread
    def clear_prefix_cache(self) -> int:
        """Rank 0: free every prefix-cache entry on every rank (a running request keeps its KV); the positions freed."""
        with self._lock:
            if self._cache is None:
                return 0
            held = self._cache.retained_tokens
            self._cache.clear()
            self._features.clear()
        with self._room:
            self._room.notify_all()
        return held

    def prefix_cache_stats(self) -> dict[str, int] | None:
        """Rank 0: the prefix cache's counters (:class:`~specserve.core.kv.prefix_cache.CacheStats`), or ``None``."""
        with self._lock:
            return self._cache.stats.as_dict() if self._cache is not None else None

    def free_kv_tokens(self) -> int:
        """Batched replicas: KV pool positions no request holds on this rank (every rank mirrors rank 0)."""
        with self._lock:
            return self._pool.pool.free_tokens if self._pool is not None else 0

    def shutdown(self) -> None:
        self._stopped.set()
        if self._batcher is not None:
            self._batcher.stop()
        if self._server is not None:
            self._server.stop(grace=0.5)
            self._server = None
        if self.world_size > 1:
            import torch.distributed as dist

            if self.rank == 0:
                self.compute.run(Shutdown.send, self._commands)
            elif self._loop is not None:
                self._loop.result(timeout=10)
            if dist.is_initialized():
                dist.destroy_process_group()

    # -----------------------------------------------------------------------------------------

    def _new_sequence(self) -> ShardedSequence:
        sequence_id = self._next_sequence
        self._next_sequence += 1
        New.send(self._commands, sequence_id)
        cache = self._caches[sequence_id] = self.target.new_cache()
        return ShardedSequence(sequence_id, self.target, cache, self._commands)

    def _follow(self) -> None:
        """Ranks > 0: mirror rank 0's commands on this rank's KV shard until told to stop."""
        state = FollowerState(self.target, self._caches, self._pool.pool if self._pool is not None else None)
        try:
            follow(state, self._lock)
        except Exception:  # the replica cannot continue; rank 0's next collective times out with an error
            logger.exception("tensor-parallel rank %d stopped following rank 0", self.rank)

    def _allreduce_seconds(self) -> float:
        return self.all_reduce.seconds if self.all_reduce is not None else 0.0

    def _require_rank0(self) -> None:
        if self.rank != 0:
            raise RuntimeError(f"only rank 0 of a replica does this (this is rank {self.rank})")
