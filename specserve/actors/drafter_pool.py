"""A drafter pool: drafter actors on cheap nodes, drafting for the requests of several target replicas of one model.

Each target replica of the distributed runtime normally owns one drafter actor (:mod:`specserve.actors.replica`), so
drafters scale with targets and a cheap device drafts for exactly one replica. A :class:`DrafterPool` holds drafter
actors of its own — *members*, each in a placement group on the ``cheap`` resource (one bundle of a separate drafter,
:func:`~specserve.cluster.placement.replica_placement`) — and replicas spawned with the pool *join* it instead of
starting a drafter. Every request then *picks* its member as it starts (:meth:`DrafterPool.pick`): the fullest ready
member below its target of ``pool_ratio × max_num_seqs`` requests, so that requests meet in shared forwards and extra
members go idle; past every target, the emptiest member with room (a member runs up to :data:`BURST` times its target
of request loops, room for a burst while the pool adds a member); a request that finds every member full decodes
without speculation (and counts as load). A draft model's loops keep their KV in one pool and draft their chains
together in shared forwards (:class:`~specserve.actors.draft_gather.DraftGatherer`), whichever replica verifies them
(``DraftJob`` names each request's verifier). A request's drafter state (its draft KV, an EAGLE head's, its suffix
store) stays on its member for the request's life; the caller says :meth:`DrafterPool.done` when it ends.

**Scaling on its own load.** A thread of the pool observes its demand — requests drafting on members plus those that
found none with room — every ``interval_s`` and holds the member count :class:`~specserve.actors.pool_scaling.
ScaleDecider` decides (``pool_min_members`` to ``pool_max_members``, one member per ``pool_ratio × max_num_seqs``
requests, after the up/down delays), independently of the target replicas. A new member is a placement group asked of
Ray at once — a pending group on the ``cheap`` resource is the demand Ray's cluster autoscaler adds a cheap node for —
and takes requests once its drafter is built; a member to stop first *drains* (takes no new request) and stops when
its last request ends. The member the first replica joined on (the one :meth:`join` returns: a replica's
``drafter``, which its health checks probe) is never stopped while replicas remain. A request whose caller died
without saying ``done`` is forgotten once its member no longer runs it, and a replica whose rank 0 died without leaving
(a Serve replica's process killed) leaves when the thread finds it dead.

Two ways to hold one: a :class:`DrafterPool` in the process that spawns the replicas
(``Coordinator.spawn(config, pool)``: the CLI's, a test's, a benchmark's), or the configuration's
``drafter_placement: pool``, which makes every replica of the model, in any process of the cluster — each Serve
replica's own — share one :class:`SharedPool`: a named, detached Ray actor running a :class:`DrafterPool`
(:func:`pool_name`: one per model, drafter and pool settings). A shared pool stops its members once its last replica
has been gone for ``pool_downscale_delay_s`` (a replica Serve replaces finds them still there), and starts them again
for the next.

Faults: a member that dies costs its running requests nothing but a moment. Each request's coordinator catches up on
rank 0's committed tokens and moves it to another member with room, whose loop starts from the committed text (the
draft state rebuilt there); with none to move to — or for a hidden-state drafter, which would need the whole text's
features — the request finishes without speculation (:class:`~specserve.actors.coordinator.Coordinator`). Ray
restarts the member (``DRAFTER_MAX_RESTARTS``) on any node with the resource; meanwhile requests starting pick
another member (a coordinator passes the members it saw die as ``avoid``).
"""

from __future__ import annotations

import dataclasses
import logging
import threading
import time
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any, Literal, Protocol

from specserve.actors.pool_scaling import PoolScaling, ScaleDecider
from specserve.actors.replica import start_drafter
from specserve.cluster.placement import replica_placement
from specserve.cluster.replica_config import ReplicaConfig
from specserve.core.errors import UserError
from specserve.core.model.causal_lm import ModelInfo

logger = logging.getLogger(__name__)

MemberState = Literal["pending", "loading", "ready", "draining"]
# a member runs this many times its target of requests at most: room for a burst while the pool adds members
BURST = 2


@dataclass(eq=False)
class _Member:
    group: Any  # its placement group
    actor: Any = None  # its drafter actor, once the group is placed
    state: MemberState = "pending"  # placing → building its drafter → taking requests → taking none, then stopped
    built: Any = None  # answers once its drafter is built
    requests: dict[str, float] = field(default_factory=dict)  # its requests, by when each picked it


class Members(Protocol):
    """How a pool places, starts and stops its members (:class:`RayMembers`; a test's stand-ins)."""

    def place(self) -> Any:
        """Ask for one member's placement group (it may not be placed yet)."""

    def placed(self, group: Any, timeout_s: float) -> bool:
        """Whether ``group`` is placed, waiting at most ``timeout_s``."""

    def launch(self, group: Any, info: ModelInfo) -> tuple[Any, Any]:
        """Start a member's drafter actor in ``group``: the actor, and what answers once its drafter is built."""

    def answered(self, ref: Any) -> bool:
        """Whether ``ref`` (from :meth:`launch`) has answered."""

    def running(self, actor: Any, timeout_s: float) -> list[str] | None:
        """The requests whose loops run on ``actor``; ``None`` when it does not say within ``timeout_s``."""

    def stop(self, actor: Any, group: Any) -> None:
        """Kill ``actor`` (if started) and remove ``group``."""

    def gone(self, actor: Any, timeout_s: float) -> bool:
        """Whether ``actor`` (a joined replica's rank 0) is dead for good; not answering in time is not gone."""


class RayMembers:
    """Members as Ray actors (:func:`~specserve.actors.replica.start_drafter`) in placement groups on the cheap
    resource, each running ``slots`` request loops."""

    def __init__(self, config: ReplicaConfig, slots: int) -> None:
        self.config = config
        self.slots = slots
        plan = replica_placement(dataclasses.replace(config.spec(), drafter_placement="separate")).drafter
        assert plan is not None, "a separate drafter has a group of its own"
        self.plan = plan

    def place(self) -> Any:
        from ray.util.placement_group import placement_group

        return placement_group(self.plan.bundles, strategy=self.plan.strategy)

    def placed(self, group: Any, timeout_s: float) -> bool:
        import ray

        return bool(ray.wait([group.ready()], timeout=timeout_s)[0])

    def launch(self, group: Any, info: ModelInfo) -> tuple[Any, Any]:
        actor = start_drafter(self.config, info, group, 0, self.plan.bundles[0], self.slots)
        return actor, actor.feature_layers.remote()

    def answered(self, ref: Any) -> bool:
        import ray

        return bool(ray.wait([ref], timeout=0)[0])

    def running(self, actor: Any, timeout_s: float) -> list[str] | None:
        import ray

        try:
            return list(ray.get(actor.running.remote(), timeout=timeout_s))
        except Exception:  # dead, restarting or busy: it says nothing this time
            return None

    def stop(self, actor: Any, group: Any) -> None:
        import ray
        from ray.util.placement_group import remove_placement_group

        if actor is not None:
            ray.kill(actor)
        remove_placement_group(group)

    def gone(self, actor: Any, timeout_s: float) -> bool:
        import ray

        try:
            ray.get(actor.node_id.remote(), timeout=timeout_s)
        except ray.exceptions.ActorDiedError:
            return True
        except Exception:  # slow, restarting, unreachable for now: not known to be gone
            return False
        return False


class DrafterPool:
    """Drafter actors shared by the replicas of ``config``'s model, scaled on the pool's own load (module docstring)."""

    FORGET_AFTER_S = 10.0  # a request its member does not run this long after it picked it has ended (caller died)
    HOUSEKEEPING_S = 10.0  # how often the scaling thread asks whether joined replicas and picked requests still live
    WAITING_TTL_S = 300.0  # a request that found no member is counted as load at most this long without a done

    def __init__(
        self,
        config: ReplicaConfig,
        scaling: PoolScaling | None = None,
        *,
        members: Members | None = None,
        ready_timeout_s: float = 60.0,
        release_idle: bool = False,
        interval_s: float | None = 0.5,
    ) -> None:
        """``scaling``: the configuration's by default (:meth:`PoolScaling.of`). ``release_idle``: stop every member
        once no replica has been joined for ``downscale_delay_s`` (a shared pool's way of not outliving its model's
        replicas, while a replica Serve replaces finds the members it left). ``interval_s``: how
        often the scaling thread observes the load (started by the first join; ``None``: no thread, the caller steps
        :meth:`scale` itself)."""
        self.config = config
        self.scaling = scaling or PoolScaling.of(config)
        self.ready_timeout_s = ready_timeout_s
        self.release_idle = release_idle
        self.interval_s = interval_s
        self.slots = BURST * self.scaling.target_requests  # request loops a member runs at most
        self._launcher: Members = members or RayMembers(config, self.slots)
        self._decider = ScaleDecider(self.scaling)
        self._members: list[_Member] = []
        self._first: _Member | None = None  # the member join returns: never stopped while replicas remain
        self._waiting: dict[str, float] = {}  # requests no member had room for, by when they asked
        self._replicas: list[Any] = []  # the joined replicas' rank 0 actors (a replica joins once)
        self._housekept = 0.0  # time.monotonic() of the last check that replicas and requests live
        self._empty_since = 0.0  # time.monotonic() when the last replica left
        self._info: ModelInfo | None = None
        self._lock = threading.RLock()
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None

    # ---- replicas

    def join(self, info: ModelInfo, replica: Any) -> Any:
        """One more replica of the model (``info``: its target's; ``replica``: its rank 0 actor, which says whether it
        still lives — a replica whose process died without leaving, as a Serve replica may, is let go): starts the
        pool's first ``min_members`` members if they are not running (raising a :class:`UserError` when the cluster
        cannot place one within ``ready_timeout_s``), and returns the first member's actor (the replica reads its
        drafter's features from it and probes it in health checks)."""
        with self._lock:
            self._info = info
            while len(self._live()) < self.scaling.min_members:
                self._members.append(self._start_now(info))
            if self._first is None or self._first not in self._members:
                self._first = next(m for m in self._members if m.state == "ready")
            self._replicas.append(replica)
            first = self._first
        if self.interval_s is not None and self._thread is None:  # scales, and lets dead replicas go
            self._thread = threading.Thread(target=self._run, name="drafter-pool-scaling", daemon=True)
            self._thread.start()
        return first.actor

    def leave(self, replica: Any) -> None:
        """``replica`` (as it joined) is gone; with ``release_idle``, the members stop once none has been joined for
        the downscale delay (the scaling thread stops them; at once with no delay)."""
        with self._lock:
            if replica in self._replicas:
                self._replicas.remove(replica)
                if not self._replicas:
                    self._empty_since = time.monotonic()
            release = self.release_idle and not self._replicas and self.scaling.downscale_delay_s == 0
        if release:
            self._stop_members()

    # ---- requests

    def pick(self, request_id: str, avoid: Sequence[Any] = ()) -> Any | None:
        """The member ``request_id`` drafts on, among the ready ones not in ``avoid``: the fullest below its target
        (the oldest among equals); when every one is at its target, the emptiest with burst room (the load asks for
        another member meanwhile); ``None`` when none has room (the request decodes without speculation; it still
        counts as load). Picking again for the same request forgets its earlier pick."""
        now = time.monotonic()
        with self._lock:
            self._forget(request_id)
            ready = [m for m in self._members if m.state == "ready" and m.actor not in avoid]
            below = [m for m in ready if len(m.requests) < self.scaling.target_requests]
            burst = [m for m in ready if len(m.requests) < self.slots]
            if below:
                member = max(below, key=lambda m: len(m.requests))  # max keeps the first of equals: the oldest
            elif burst:
                member = min(burst, key=lambda m: len(m.requests))
            else:
                self._waiting[request_id] = now
                return None
            member.requests[request_id] = now
            return member.actor

    def done(self, request_id: str) -> None:
        """``request_id`` ended (whether it drafted on a member or not)."""
        with self._lock:
            self._forget(request_id)

    # ---- what it holds

    @property
    def members(self) -> list[Any]:
        """The started members' actors (building, ready or draining), in the order they were started."""
        return self.members_now()

    def members_now(self) -> list[Any]:
        """:attr:`members` (as a method: what a remote caller of the pool actor can call)."""
        with self._lock:
            return [m.actor for m in self._members if m.actor is not None]

    def load(self) -> dict[str, Any]:
        """Replicas joined; per member its state and requests; requests that found no member."""
        with self._lock:
            return {
                "replicas": len(self._replicas),
                "members": [(m.state, len(m.requests)) for m in self._members],
                "waiting": len(self._waiting),
            }

    # ---- scaling

    def scale(self, now: float | None = None) -> None:
        """One step of the scaling thread: forget requests that ended unsaid, move members along (placed → started
        → ready; drained → stopped), and add or drain members to the count the load wants."""
        now = time.monotonic() if now is None else now
        if now - self._housekept >= self.HOUSEKEEPING_S:
            self._housekept = now
            self._let_dead_replicas_go()
            self._forget_ended(now)
        with self._lock:
            idle = not self._replicas or self._info is None
            released = []
            if idle and self.release_idle and now - self._empty_since >= self.scaling.downscale_delay_s:
                released = self._take_members()
        if released:
            logger.info("drafter pool: no replica for %.0fs: stopping its members", now - self._empty_since)
            for member in released:
                self._launcher.stop(member.actor, member.group)
        if idle:
            return
        with self._lock:
            self._advance()
            for request_id, since in list(self._waiting.items()):
                if now - since > self.WAITING_TTL_S:
                    del self._waiting[request_id]
            live = self._live()
            demand = sum(len(m.requests) for m in self._members) + len(self._waiting)
            want = self._decider.decide(now, demand, len(live))
            if want > len(live):
                logger.info("drafter pool: %d requests want %d members, %d live: adding", demand, want, len(live))
                self._members.extend(_Member(self._launcher.place()) for _ in range(want - len(live)))
            elif want < len(live):
                logger.info("drafter pool: %d requests want %d members, %d live: draining", demand, want, len(live))
                self._drain(live, len(live) - want)
            self._advance()

    def shutdown(self) -> None:
        """Stop the scaling thread, kill every member and remove its placement group."""
        self._stop.set()
        self._stop_members()

    # ---- internals

    def _live(self) -> list[_Member]:
        return [m for m in self._members if m.state != "draining"]

    def _start_now(self, info: ModelInfo) -> _Member:
        group = self._launcher.place()
        if not self._launcher.placed(group, self.ready_timeout_s):
            self._launcher.stop(None, group)
            raise UserError(
                f"the cluster cannot place a drafter pool member within {self.ready_timeout_s:.0f}s: it needs a node "
                f"with the {self.config.cheap_resource!r} resource and {self.config.cpus_per_drafter:g} CPUs free"
            )
        actor, built = self._launcher.launch(group, info)
        return _Member(group, actor, "ready", built)  # the joining replica waits for its drafter itself

    def _advance(self) -> None:
        assert self._info is not None
        for member in list(self._members):
            if member.state == "pending" and self._launcher.placed(member.group, 0.0):
                member.actor, member.built = self._launcher.launch(member.group, self._info)
                member.state = "loading"
            if member.state == "loading" and self._launcher.answered(member.built):
                member.state = "ready"
                logger.info("drafter pool: a new member is ready (%d live)", len(self._live()))
            if member.state == "draining" and not member.requests:
                self._launcher.stop(member.actor, member.group)
                self._members.remove(member)

    def _drain(self, live: list[_Member], count: int) -> None:
        """Drain ``count`` of the live members: those not yet started first, then the ready ones with the fewest
        requests, newest first — never the first member."""
        order = {"pending": 0, "loading": 1, "ready": 2}
        ranked = sorted(
            (m for m in live if m is not self._first),
            key=lambda m: (order[m.state], len(m.requests), -self._members.index(m)),
        )
        for member in ranked[:count]:
            member.state = "draining"

    def _forget(self, request_id: str) -> None:
        self._waiting.pop(request_id, None)
        for member in self._members:
            member.requests.pop(request_id, None)

    def _forget_ended(self, now: float) -> None:
        """Requests picked over :data:`FORGET_AFTER_S` ago that their member no longer runs (their caller died
        before saying done)."""
        with self._lock:
            stale = [
                (m, [r for r, since in m.requests.items() if now - since > self.FORGET_AFTER_S])
                for m in self._members
                if m.actor is not None
            ]
        for member, requests in stale:
            if not requests:
                continue
            running = self._launcher.running(member.actor, 2.0)
            if running is None:
                continue
            with self._lock:
                for request_id in set(requests) - set(running):
                    member.requests.pop(request_id, None)

    def _let_dead_replicas_go(self) -> None:
        """Joined replicas whose rank 0 is dead for good leave."""
        with self._lock:
            replicas = list(self._replicas)
        for replica in replicas:
            if self._launcher.gone(replica, 5.0):
                logger.warning("drafter pool: a joined replica died without leaving; it leaves now")
                self.leave(replica)

    def _take_members(self) -> list[_Member]:
        """Every member, out of the pool (under the lock; the caller stops them)."""
        members, self._members, self._first = self._members, [], None
        self._waiting.clear()
        return members

    def _stop_members(self) -> None:
        with self._lock:
            members = self._take_members()
        for member in members:
            self._launcher.stop(member.actor, member.group)

    def _run(self) -> None:
        assert self.interval_s is not None
        while not self._stop.wait(self.interval_s):
            try:
                self.scale()
            except Exception:  # a step that failed (Ray busy): the next one tries again
                logger.exception("drafter pool: a scaling step failed")


POOL_NAMESPACE = "specserve"
_POOL_FIELDS = (  # what makes two replicas' drafters interchangeable: the same model, drafter, member and pool shape
    "target", "draft", "dtype", "device", "max_ngram", "min_ngram", "suffix_store", "threads_per_drafter",
    "cheap_resource", "cpus_per_drafter", "gpus_per_drafter", "max_num_seqs", "pool_ratio", "pool_min_members",
    "pool_max_members", "pool_upscale_delay_s", "pool_downscale_delay_s",
)  # fmt: skip


def pool_name(config: ReplicaConfig) -> str:
    """The name of the shared pool of ``config``'s model: one per model, drafter, member and pool settings."""
    import hashlib
    import json

    key = json.dumps({name: getattr(config, name) for name in _POOL_FIELDS}, sort_keys=True, default=str)
    return "specserve-drafter-pool-" + hashlib.sha256(key.encode()).hexdigest()[:16]


class SharedPool:
    """The pool every replica of ``config``'s model shares, in any process: a named, detached Ray actor running a
    :class:`DrafterPool` (idle members stopped), created by the first replica that needs it. Quacks like the local
    pool for ``spawn_replica`` and the coordinator."""

    ATTEMPTS = 3  # a pool actor that stopped between being found and being asked is created again

    def __init__(self, config: ReplicaConfig) -> None:
        self.config = config
        self.name = pool_name(config)
        self._handle: Any = None  # the pool actor, once found or created

    def _actor(self) -> Any:
        import ray

        if self._handle is not None:
            return self._handle
        pool_cls: Any = ray.remote(DrafterPool)
        handle = pool_cls.options(
            name=self.name,
            namespace=POOL_NAMESPACE,
            get_if_exists=True,
            lifetime="detached",  # outlives the replica that created it: the others share it
            num_cpus=0,
            max_concurrency=32,  # picks of every replica's requests, and joins that wait for a member's placement
        ).remote(self.config, release_idle=True)
        self._handle = handle
        return handle

    def _existing(self) -> Any | None:
        import ray

        try:
            return ray.get_actor(self.name, namespace=POOL_NAMESPACE)
        except ValueError:  # no pool
            return None

    def _call(self, method: str, *args: Any) -> Any:
        import ray

        for attempt in range(self.ATTEMPTS):
            try:
                return ray.get(getattr(self._actor(), method).remote(*args))
            except ray.exceptions.RayActorError:
                self._handle = None  # stopped (its last replica left, or shut down): find or create it again
                if attempt == self.ATTEMPTS - 1:
                    raise
        raise AssertionError("unreachable")

    def join(self, info: ModelInfo, replica: Any) -> Any:
        return self._call("join", info, replica)

    def leave(self, replica: Any) -> None:
        import ray

        handle = self._existing()
        if handle is not None:  # no pool: nothing holds a member any more
            ray.get(handle.leave.remote(replica))

    def pick(self, request_id: str, avoid: Sequence[Any] = ()) -> Any | None:
        return self._call("pick", request_id, list(avoid))

    def done(self, request_id: str) -> None:
        import ray

        handle = self._handle or self._existing()
        if handle is not None:  # awaited: the caller's next request picks after this one is counted out
            ray.get(handle.done.remote(request_id))

    @property
    def members(self) -> list[Any]:
        return list(self._call("members_now"))

    def load(self) -> dict[str, Any]:
        return dict(self._call("load"))

    def shutdown(self) -> None:
        """Stop the pool's members and the pool actor itself (every replica that shared it should be gone)."""
        import ray

        handle = self._existing()
        if handle is None:
            return
        ray.get(handle.shutdown.remote())
        ray.kill(handle)
