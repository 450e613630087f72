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

Every wait has a deadline. The coordinator waits at most ``stall_timeout_s``
(:class:`~specserve.cluster.replica_config.ReplicaConfig`) for the drafter's next report, then probes
the replica's actors (a trivial call each, :data:`PROBE_TIMEOUT_S`): when every shard answers, the
drafter is frozen — it is killed, Ray restarts it, and the request goes on without speculation as
above (a drafter that is restarting, or that this coordinator killed and has not seen back since, is
not killed again: each kill costs one of its restarts). A target shard that is dead or does not
answer a probe loses the replica: the request raises :class:`~specserve.core.errors.ReplicaLost`
(naming the rank and why), and from then on so do every new request and :meth:`~Coordinator.check_health`,
at once (:attr:`Coordinator.lost`). The same holds when a call to rank 0 (admission and prefill,
probed every ``stall_timeout_s`` for at most :data:`START_TIMEOUT_S`; a progress query or a plain
cycle, :data:`PROGRESS_TIMEOUT_S`) finds it dead or outlives its deadline, and when the drafter's
loop fails while a shard is gone (its verifier went with it). Any other failure of the drafter's loop — a
bug, or a draft the verifier refused as garbage (which changes nothing on rank 0) — costs the request its
speculation, not the request; only the request's own errors (a ``UserError``) are raised. Does not restart
shards, nor resume a lost request elsewhere (the front end does: :mod:`specserve.core.resume`).

A replica that joined a drafter pool (:mod:`specserve.actors.drafter_pool`) has each request pick its drafter, a
member of the pool, as it starts; the health bookkeeping above is kept per drafter actor, so a member this coordinator
saw die is passed over until it is back, and a request that finds no member (every one full or down) goes without
speculation from the start. A request whose member dies mid-stream *moves* (at most :data:`POOL_MOVES` times): the
coordinator pushes the tokens rank 0 committed that the dead member never reported, picks another member and starts
its loop on the committed text (its draft state rebuilt there; the verifier's state is rank 0's and never moved).
Every cycle report must follow the tokens streamed so far (its ``committed_length``): one that does not — a queued
draft of the dead member committed after the move — ends speculation for the request, and rank 0's progress supplies
the tokens. Greedy output is unchanged; sampled output stays distributed as the target's (drafter-invariant sampling:
the same tokens). A hidden-state drafter's request does not move (the new member would need the whole text's
features): it finishes plainly.

A replica with ``max_num_seqs`` > 1 serves that many requests at once: call :meth:`~Coordinator.stream`
from as many threads; rank 0 verifies their drafts together, one forward per step, and the drafter
actor runs their loops side by side. Otherwise a replica serves one request at a time (its drafter
holds one request's state), and concurrent callers wait their turn in the drafter.
"""

from __future__ import annotations

import logging
import threading
import time
import uuid
from collections.abc import Generator, Sequence
from dataclasses import dataclass, replace
from typing import Any

from specserve.actors.drafter import CycleReport, DraftJob
from specserve.actors.replica import DrafterSource, Replica, ReplicaConfig, spawn_replica
from specserve.actors.target_shard import Started
from specserve.core.draft.drafter import Draft
from specserve.core.draft.spec_strings import probe_nodes_of
from specserve.core.engine import GenerationFrontend
from specserve.core.errors import ReplicaLost, UserError
from specserve.core.model.causal_lm import load_tokenizer
from specserve.core.prompts import PromptCodec
from specserve.core.request import ChunkStream, GenerationConfig, RequestOutput, StreamChunk, request_output
from specserve.core.sampling.params import SamplingParams
from specserve.core.stats import RequestStats

logger = logging.getLogger(__name__)
PROGRESS_TIMEOUT_S = 60.0  # a plain cycle or a progress query on rank 0 (a live rank 0 answers within a step)
PROBE_TIMEOUT_S = 5.0  # a probe of an actor (a trivial call its compute does not delay): a live one answers at once
QUICK_PROBE_S = 0.1  # is a drafter that was down back? asked as a request starts; silence: it starts without one
# rank 0 admits (a batched replica may first wait for KV room) and prefills a request; the shards are probed meanwhile
START_TIMEOUT_S = 1800.0
# a drafter this coordinator killed is presumed dying (Ray kills a frozen process within seconds) or restarting, its
# silence no new freeze, until it shows itself alive again (answers a probe, reports a request started after the
# kill) or this long has passed; a restarting drafter answers a probe with ActorUnavailableError anyway
DRAFTER_KILL_SETTLE_S = 15.0
POOL_PICKS = 3  # members a request of a pooled replica is offered before it starts without speculation
POOL_MOVES = 2  # times a request of a pooled replica moves to another member when its member dies


@dataclass
class _Watch:
    """One drafter actor's health as a coordinator saw it: ``time.monotonic()`` of its last kill (or of finding it
    dead), and of the latest sign that the drafter answering then was alive (a probe sent then answered, or a
    request submitted then reported)."""

    killed_at: float = -DRAFTER_KILL_SETTLE_S
    alive_at: float = -DRAFTER_KILL_SETTLE_S

    def down(self, now: float) -> bool:
        """Killed or found dead, not seen alive since, and not long ago."""
        return self.killed_at >= self.alive_at and now - self.killed_at < DRAFTER_KILL_SETTLE_S


class Coordinator(GenerationFrontend):
    def __init__(self, replica: Replica) -> None:
        self.replica = replica
        self.prompts = PromptCodec(replica.target_info, load_tokenizer(replica.config.target))
        self._slots = threading.BoundedSemaphore(replica.config.max_num_seqs)  # callers beyond them wait here
        self.lost: str | None = None  # why the replica's target is gone, once seen: every later request fails at once
        self._lock = threading.Lock()
        self._watches: dict[Any, _Watch] = {}  # per drafter actor (the replica's own, or each pool member seen)

    @classmethod
    def spawn(cls, config: ReplicaConfig, pool: DrafterSource | None = None) -> Coordinator:
        """A coordinator of a new replica. With ``pool``, a member of that drafter pool drafts for it; with
        ``drafter_placement: pool`` and none given, a member of the model's shared pool
        (:class:`~specserve.actors.drafter_pool.SharedPool`)."""
        if pool is None and config.drafter_placement == "pool":
            from specserve.actors.drafter_pool import SharedPool

            pool = SharedPool(config)
        return cls(spawn_replica(config, pool))

    @property
    def max_concurrency(self) -> int:
        """Requests this replica generates at once (its ``max_num_seqs``); more callers wait their turn."""
        return self.replica.config.max_num_seqs

    def placement(self) -> dict[str, Any]:
        return self.replica.placement()

    def processes(self) -> dict[str, Any]:
        """The process id of each of the replica's actors (shards in rank order, drafter)."""
        return self.replica.processes()

    def shutdown(self) -> None:
        self.replica.shutdown()

    def active_requests(self) -> list[str]:
        """Requests holding KV on rank 0 (every shard mirrors rank 0)."""
        import ray

        return list(ray.get(self.replica.rank0.active_requests.remote(), timeout=30))

    def prefix_cache_stats(self, timeout_s: float = 30.0) -> dict[str, int] | None:
        """Rank 0's prefix-cache counters (:class:`~specserve.core.kv.prefix_cache.CacheStats`), or ``None`` when the
        replica keeps no prefix cache."""
        import ray

        stats: dict[str, int] | None = ray.get(self.replica.rank0.prefix_cache_stats.remote(), timeout=timeout_s)
        return stats

    def drafter_pool_load(self) -> dict[str, Any] | None:
        """The load of the drafter pool this replica joined (replicas, each member's state and requests, requests
        that found no member), or ``None`` when it drafts on its own drafter."""
        pool = self.replica.pool
        return None if pool is None else pool.load()

    def check_health(self, timeout_s: float = 30.0) -> None:
        """Raises :class:`ReplicaLost` when the replica's target is gone: seen before, or a shard is dead or does not
        answer within ``timeout_s``; raises when the drafter is dead for good. A drafter that does not answer (frozen)
        is killed, and Ray restarts it; one Ray is restarting is no failure either: requests go on without
        speculation meanwhile."""
        import ray

        self._check_not_lost()
        sent = time.monotonic()
        answers = self._probe([*self.replica.shards, self.replica.drafter], timeout_s)
        self._raise_if_lost(answers[:-1], timeout_s, "at a health check")
        drafter = answers[-1]
        if drafter is None:
            self._drafter_alive(self.replica.drafter, sent)
        elif isinstance(drafter, ray.exceptions.GetTimeoutError):
            self._kill_drafter(self.replica.drafter, f"did not answer a health check within {timeout_s:g}s")
        elif not isinstance(drafter, ray.exceptions.ActorUnavailableError):
            raise drafter  # dead for good (its restarts spent), or broken

    # -----------------------------------------------------------------------------------------

    def _run(self, prompt_ids: list[int], params: SamplingParams, config: GenerationConfig) -> ChunkStream:
        self._check_not_lost()  # here, not in the generator: stream() itself raises
        return self._run_in_turn(prompt_ids, params, config)

    def _run_in_turn(self, prompt_ids: list[int], params: SamplingParams, config: GenerationConfig) -> ChunkStream:
        with self._slots:
            self._check_not_lost()  # lost while this request waited its turn
            yield from self._run_admitted(prompt_ids, params, config)

    def _run_admitted(self, prompt_ids: list[int], params: SamplingParams, config: GenerationConfig) -> ChunkStream:
        replica = self.replica
        request_id = uuid.uuid4().hex
        eos = () if config.ignore_eos else replica.target_info.eos_token_ids
        stats = RequestStats()
        start = time.perf_counter()
        layers = replica.feature_layers if config.drafter == "default" else ()  # hidden-state drafters' features
        started = replica.rank0.start_request.remote(
            request_id,
            prompt_ids,
            params,
            config.max_new_tokens,
            eos,
            layers,
            self._widest_block(config),
            config.cache_namespace,
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
        out = request_output(prompt_ids, params, config, self.prompts.decode, start, stats)
        drafter = None
        try:
            drafter = self._drafter_for(request_id)
            if drafter is None:  # it died or was killed and is not back yet, or the pool is full: do not wait
                self._started(self._wait_for_start(started, request_id), stats, start)
                yield from self._decode_plainly(request_id, out)
                return
            # The drafter prefills while the target does (the ref travels inside a list, so Ray does not wait
            # for it before starting the drafter's task); the drafter waits for the target before drafting.
            submitted = time.monotonic()
            reports = drafter.run.options(num_returns="streaming").remote(job, [started])
            self._started(self._wait_for_start(started, request_id), stats, start)
            moves = 0
            while True:
                ended = yield from self._follow(request_id, drafter, reports, submitted, out)
                if ended == "done":
                    return
                if ended == "lost" and replica.pool is not None and not layers and moves < POOL_MOVES:
                    # a pool member died: the request goes on with another, its draft state rebuilt there from the
                    # committed text (a hidden-state drafter would need the whole text's features: it goes plainly)
                    context = yield from self._catch_up(request_id, out)
                    if out.finish is not None:
                        return
                    member = self._drafter_for(request_id, avoid=[drafter])
                    if member is not None:
                        moves += 1
                        logger.info(
                            "request %s moves to another pool member after %d tokens", request_id, len(out.tokens)
                        )
                        remaining = config.max_new_tokens - len(out.tokens)
                        job = replace(job, prompt_ids=tuple(context), max_new_tokens=remaining)
                        drafter, submitted = member, time.monotonic()
                        reports = drafter.run.options(num_returns="streaming").remote(job, [])
                        continue
                yield from self._decode_plainly(request_id, out)
                return
        finally:
            if drafter is not None and out.finish not in ("eos", "length"):  # stopped early, failed or abandoned
                drafter.cancel.remote(request_id)
            if replica.pool is not None:
                replica.pool.done(request_id)
            if self.lost is None:  # a lost target's KV is moot (and freeing it would fail on a broken process group)
                replica.rank0.finish_request.remote(request_id)

    @staticmethod
    def _started(started: Started, stats: RequestStats, start: float) -> None:
        """A request rank 0 admitted and prefilled: its prefill time, and the prompt positions it took from the prefix
        cache."""
        stats.prefill_seconds = time.perf_counter() - start
        stats.cached_tokens = started.cached_tokens

    def _wait_for_start(self, started: Any, request_id: str) -> Started:
        """Until rank 0 has admitted and prefilled the request (raising its error if it could not), probing the
        shards every ``stall_timeout_s`` meanwhile, for at most :data:`START_TIMEOUT_S`."""
        import ray

        stall_s = self.replica.config.stall_timeout_s
        deadline = time.monotonic() + START_TIMEOUT_S
        while not ray.wait([started], timeout=max(0.0, min(stall_s, deadline - time.monotonic())))[0]:
            when = f"during request {request_id}'s admission and prefill"
            self._raise_if_lost(self._probe(self.replica.shards), PROBE_TIMEOUT_S, when)
            if time.monotonic() >= deadline:
                raise self._lose(f"rank 0 did not admit and prefill a request within {START_TIMEOUT_S:g}s (stuck)")
        result: Started = self._get_from_rank0(started, "admission and prefill", PROGRESS_TIMEOUT_S)
        return result

    def _follow(
        self, request_id: str, drafter: Any, reports: Any, submitted: float, out: RequestOutput
    ) -> Generator[StreamChunk, None, str]:
        """Stream ``drafter``'s cycle reports of ``request_id`` into ``out``. Returns how it ended: ``"done"`` (the
        request finished, or its loop was cancelled), ``"lost"`` (the drafter died), ``"failed"`` (its loop failed,
        or a cycle did not follow the tokens streamed so far) or ``"stalled"`` (no report for ``stall_timeout_s``: the
        drafter was frozen, and killed). Raises :class:`ReplicaLost` when a shard is gone, and the request's own
        errors."""
        import ray

        stall_s = self.replica.config.stall_timeout_s
        try:
            while ray.wait([reports], timeout=stall_s)[0]:
                try:
                    ref = next(reports)
                except StopIteration:
                    return "done"  # the loop ended without the target finishing the request (cancelled)
                batch: list[CycleReport] = ray.get(ref, timeout=PROBE_TIMEOUT_S)  # ready: here already
                self._drafter_alive(drafter, submitted)
                for report in batch:
                    follows = len(out.prompt_ids) + len(out.tokens) + len(report.new_tokens)
                    if report.committed_length and report.committed_length != follows:
                        # a cycle of a lost drafter committed after this drafter started: rank 0's progress has it
                        logger.warning(
                            "request %s: a cycle committed %d tokens where %d follow the stream; it continues "
                            "without speculation",
                            request_id,
                            report.committed_length,
                            follows,
                        )
                        drafter.cancel.remote(request_id)
                        return "failed"
                    out.stats.record(report.observation, report.allreduce_seconds, report.overlap_hit)
                    # the target's finish reason, from the wire
                    yield out.push(report.new_tokens, report.finish, report.logprobs)
                    if out.finish is not None:
                        return "done"
        except ray.exceptions.RayActorError as exc:  # the drafter died (or is restarting): go on without it
            logger.warning("request %s lost its drafter (%s)", request_id, exc)
            self._drafter_seen_down(drafter)
            return "lost"
        except ray.exceptions.RayError as exc:  # the drafter's loop failed: was its verifier (rank 0) lost?
            # (an error that cannot be unpickled here arrives as an UnserializableException, not a RayTaskError)
            cause = exc.cause if isinstance(exc, ray.exceptions.RayTaskError) else exc
            when = f"after request {request_id}'s drafter failed ({type(cause).__name__})"
            self._raise_if_lost(self._probe(self.replica.shards), PROBE_TIMEOUT_S, when)
            if isinstance(cause, UserError):  # the request's own (a drafter it named cannot serve it)
                raise
            # the target is fine: the drafter failed or sent garbage (refused by the verifier, which changed
            # nothing); the request goes on without it
            logger.warning(
                "request %s: its drafter failed (%s: %s); it continues without speculation",
                request_id,
                type(cause).__name__,
                cause,
            )
            return "failed"
        # no report for stall_s: a shard is gone (raises ReplicaLost), or the drafter is frozen (killed)
        self._drafter_stalled(request_id, drafter, stall_s)
        return "stalled"

    def _catch_up(self, request_id: str, out: RequestOutput) -> Generator[StreamChunk, None, list[int]]:
        """Push rank 0's committed tokens of ``request_id`` that ``out`` lacks (cycles whose reports died with a
        drafter), and its finish if it finished; returns every committed token, the prompt's included."""
        committed, finish, logprobs = self._get_from_rank0(
            self.replica.rank0.progress.remote(request_id), "a progress query", PROGRESS_TIMEOUT_S
        )
        missed = committed[len(out.prompt_ids) + len(out.tokens) :]
        if missed or finish is not None:
            yield out.push(missed, finish, logprobs[len(out.tokens) : len(out.tokens) + len(missed)])
        return list(committed)

    def _drafter_stalled(self, request_id: str, drafter_actor: Any, stall_s: float) -> None:
        """No report from the request's drafter for ``stall_s``: raises :class:`ReplicaLost` when a shard is gone;
        otherwise the drafter is frozen, and is killed (Ray restarts it) unless it is restarting already, or this
        coordinator killed it and has not seen it back since (another request's stall, a health check)."""
        import ray

        sent = time.monotonic()
        answers = self._probe([*self.replica.shards, drafter_actor])
        self._raise_if_lost(answers[:-1], PROBE_TIMEOUT_S, f"while request {request_id} waited for its drafter")
        drafter = answers[-1]
        if isinstance(drafter, ray.exceptions.RayActorError):  # restarting (or dead): nothing to kill
            logger.warning(
                "request %s: no report from its drafter for %gs, which is restarting or dead (%s); the request "
                "continues without speculation",
                request_id,
                stall_s,
                type(drafter).__name__,
            )
            return
        state = "does not answer a probe" if drafter is not None else "answers a probe but its loop is stuck"
        logger.warning(
            "request %s: no report from its drafter for %gs, and it %s; every target shard answers; the request "
            "continues without speculation",
            request_id,
            stall_s,
            state,
        )
        if drafter is None:
            self._drafter_alive(drafter_actor, sent)
        self._kill_drafter(drafter_actor, f"sent request {request_id} no report for {stall_s:g}s")

    def _kill_drafter(self, drafter: Any, why: str) -> None:
        """Kill a frozen drafter so that Ray restarts it (one of its restarts), unless this coordinator killed it
        already and it has not shown itself alive since (for at most :data:`DRAFTER_KILL_SETTLE_S`): that one is
        still dying, or restarting, and a kill now would cost another restart."""
        import ray

        with self._lock:
            now = time.monotonic()
            watch = self._watch(drafter)
            if watch.down(now):
                logger.warning("a drafter %s; it was killed %.1fs ago and is restarting", why, now - watch.killed_at)
                return
            watch.killed_at = now
        logger.warning("a drafter %s: killing it (Ray restarts it)", why)
        ray.kill(drafter, no_restart=False)

    def _drafter_seen_down(self, drafter: Any) -> None:
        """A request found ``drafter`` dead (Ray restarts it): later requests start without it until it is back."""
        with self._lock:
            watch = self._watch(drafter)
            now = time.monotonic()
            if not watch.down(now):
                watch.killed_at = now

    def _watch(self, drafter: Any) -> _Watch:
        """``drafter``'s health as this coordinator saw it (under the lock)."""
        return self._watches.setdefault(drafter, _Watch())

    def _drafter_for(self, request_id: str, avoid: Sequence[Any] = ()) -> Any | None:
        """The drafter actor ``request_id`` drafts on, or ``None`` when it goes without speculation: the replica's
        own drafter unless it is down; a pool's member the pool picks, passing over those this coordinator saw down
        (and a pick that turns out down), or none when no member has room."""
        pool = self.replica.pool
        if pool is None:
            if self._drafter_down(self.replica.drafter):
                logger.info("request %s starts without speculation: the drafter is restarting", request_id)
                return None
            return self.replica.drafter
        now = time.monotonic()
        with self._lock:
            avoid = [*avoid, *(drafter for drafter, watch in self._watches.items() if watch.down(now))]
        for _ in range(POOL_PICKS):
            try:
                member = pool.pick(request_id, avoid)
            except Exception as exc:  # the pool itself failed (its actor lost): the request goes on without it
                logger.warning("request %s starts without speculation: the drafter pool failed (%r)", request_id, exc)
                return None
            if member is None:
                logger.info("request %s starts without speculation: no drafter pool member has room", request_id)
                return None
            if not self._drafter_down(member):
                return member
            avoid.append(member)
        logger.info("request %s starts without speculation: the pool's members it was given are down", request_id)
        return None

    def _widest_block(self, config: GenerationConfig) -> int:
        """Draft nodes beyond a chain's a request's verify block may hold: its tree's, and the configured drafter's
        probe (Lookahead's window) when it drafts with that one. The target reserves KV room for them."""
        # a request naming "lookahead" drafts with the configured Lookahead drafter when there is one
        configured = probe_nodes_of(self.replica.config.draft) if config.drafter in ("default", "lookahead") else 0
        probe = max(configured, probe_nodes_of(config.drafter))
        return (config.budget.nodes if config.tree else 0) + probe

    def _drafter_down(self, drafter: Any) -> bool:
        """``drafter`` was killed or found dead, has not shown itself alive since (for at most
        :data:`DRAFTER_KILL_SETTLE_S`), and does not answer a quick probe now: requests starting now go without
        it rather than wait for it."""
        with self._lock:
            if not self._watch(drafter).down(time.monotonic()):
                return False
        sent = time.monotonic()
        if self._probe([drafter], QUICK_PROBE_S)[0] is None:
            self._drafter_alive(drafter, sent)
            return False
        return True

    def _drafter_alive(self, drafter: Any, since: float) -> None:
        """``drafter`` answered a probe sent at ``since``, or reported a request submitted then: if that was after
        this coordinator's last kill, Ray has restarted it, and a new silence is a new freeze."""
        with self._lock:
            watch = self._watch(drafter)
            if since > watch.killed_at:
                watch.alive_at = max(watch.alive_at, since)

    # ---- the target's health

    def _probe(self, actors: list[Any], timeout_s: float = PROBE_TIMEOUT_S) -> list[BaseException | None]:
        """Ask each actor a trivial question at once; per actor, ``None`` when it answered within ``timeout_s``, else
        what went wrong (a ``GetTimeoutError`` when it did not answer, a ``RayActorError`` when it is dead)."""
        import ray

        refs = [actor.node_id.remote() for actor in actors]
        ray.wait(refs, num_returns=len(refs), timeout=timeout_s)
        answers: list[BaseException | None] = []
        for ref in refs:
            try:
                ray.get(ref, timeout=0)
                answers.append(None)
            except Exception as exc:
                answers.append(exc)
        return answers

    def _raise_if_lost(self, shards: list[BaseException | None], timeout_s: float, when: str) -> None:
        """Raise :class:`ReplicaLost` (and remember it) when a shard's probe found it dead or silent."""
        import ray

        for rank, problem in enumerate(shards):
            if problem is None:
                continue
            if isinstance(problem, ray.exceptions.GetTimeoutError):
                why = f"rank {rank} does not answer within {timeout_s:g}s (frozen or unreachable)"
            elif isinstance(problem, ray.exceptions.RayActorError):
                why = f"rank {rank} died ({type(problem).__name__})"
            else:
                why = f"rank {rank} failed a probe ({type(problem).__name__}: {problem})"
            raise self._lose(f"{why} {when}") from problem

    def _get_from_rank0(self, ref: Any, what: str, timeout_s: float) -> Any:
        """``ray.get`` of a call to rank 0 with a deadline: a dead rank 0, a call past its deadline, or a failure
        while a shard is gone raises :class:`ReplicaLost`; the request's own errors (a ``UserError``) and failures
        of a healthy replica are raised as they are."""
        import ray

        try:
            return ray.get(ref, timeout=timeout_s)
        except ray.exceptions.RayActorError as exc:
            raise self._lose(f"rank 0 died ({type(exc).__name__}) during {what}") from exc
        except ray.exceptions.GetTimeoutError as exc:
            self._raise_if_lost(self._probe(self.replica.shards), PROBE_TIMEOUT_S, f"during {what}")
            raise self._lose(f"rank 0 did not complete {what} within {timeout_s:g}s (its compute is stuck)") from exc
        except ray.exceptions.RayError as exc:  # RayTaskError, or UnserializableException (an error not unpickled)
            if not isinstance(exc, UserError):
                self._raise_if_lost(self._probe(self.replica.shards), PROBE_TIMEOUT_S, f"after {what} failed")
            raise

    def _lose(self, why: str) -> ReplicaLost:
        """Remember that the replica's target is gone (the first reason seen); the error to raise."""
        with self._lock:
            first = self.lost is None
            if first:
                self.lost = why
        if first:
            logger.error("replica lost: %s; its requests fail from now on", why)
        return ReplicaLost(f"the replica's target is gone: {why}")

    def _check_not_lost(self) -> None:
        if self.lost is not None:
            raise ReplicaLost(f"the replica's target is gone: {self.lost}")

    def _decode_plainly(self, request_id: str, out: RequestOutput) -> ChunkStream:
        """Finish a request whose drafter is gone: rank 0's committed tokens the drafter never reported, then one
        plain cycle (an empty draft: one token from the target's distribution) at a time until it finishes."""
        from specserve.rpc.verifier import UnknownRequest

        rank0 = self.replica.rank0
        cycle = 0
        while out.finish is None:
            before = len(out.tokens)
            yield from self._catch_up(request_id, out)  # cycles whose reports died with the drafter
            if out.finish is not None or len(out.tokens) != before:
                continue
            try:
                outcome = self._get_from_rank0(
                    rank0.verify.remote(request_id, cycle, Draft.empty()), "a plain cycle", PROGRESS_TIMEOUT_S
                )
            except UnknownRequest:  # the lost drafter's last draft is still queued, or it finished the request
                time.sleep(0.01)
                continue  # progress says what it committed
            cycle += 1
            if outcome.committed_length - len(outcome.new_tokens) != len(out.prompt_ids) + len(out.tokens):
                continue  # a cycle of the lost drafter committed first: progress has its tokens and this one's
            out.stats.record_cycle(0, 0, 0.0, outcome.verify_seconds, allreduce_seconds=outcome.allreduce_seconds)
            yield out.push(outcome.new_tokens, outcome.finish, outcome.logprobs)
