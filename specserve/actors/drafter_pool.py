"""A drafter pool: drafter actors on cheap nodes, each drafting for several target replicas of one model.

Each target replica of the distributed runtime normally owns one drafter actor (:mod:`specserve.actors.replica`), so
drafters scale with targets and a cheap device drafts for exactly one replica. A :class:`DrafterPool` holds drafter
actors of its own — *members*, each in a placement group on the ``cheap`` resource (one bundle of a separate drafter,
:func:`~specserve.cluster.placement.replica_placement`) — and a replica spawned with the pool is assigned a member
instead of starting a drafter: the member with the fewest replicas while it has room for ``ratio`` of them, a new
member otherwise. A member runs ``ratio × max_num_seqs`` request loops at once; a draft model's loops keep their KV in
one pool and draft their chains together in shared forwards (:class:`~specserve.actors.draft_gather.DraftGatherer`),
whichever replica verifies them. A request's drafter state (its draft KV, an EAGLE head's, its suffix store) stays on
its member for the request's life: every request of a replica streams to the replica's member (``DraftJob`` names the
verifier each one's drafts go to).

Two ways to hold one: a :class:`DrafterPool` in the process that spawns the replicas
(``Coordinator.spawn(config, pool)``: the CLI's, a test's, a benchmark's), or the configuration's
``drafter_placement: pool`` (with ``pool_ratio``), which makes every replica of the model, in any process of the
cluster — each Serve replica's own — share one :class:`SharedPool`: a named, detached Ray actor running a
:class:`DrafterPool` (:func:`pool_name`: one per model and drafter settings). A shared pool stops its members when its
last replica leaves, and starts them again for the next.

Faults are the runtime's: a member that dies costs its requests their speculation, not their tokens — each request's
coordinator finishes it without speculation (:class:`~specserve.actors.coordinator.Coordinator`) — and Ray restarts the
member (``DRAFTER_MAX_RESTARTS``) on any node with the resource, for the requests after. A coordinator that finds the
member frozen kills it, which restarts it for every replica it drafts for.

Not here yet: members chosen per request rather than per replica, scaling the pool on its own load, and moving a
running request to another member.
"""

from __future__ import annotations

import dataclasses
import threading
from dataclasses import dataclass
from typing import Any

from specserve.actors.replica import start_drafter
from specserve.cluster.placement import replica_placement
from specserve.cluster.replica_config import ReplicaConfig
from specserve.core.errors import UserError
from specserve.core.model import ModelInfo


@dataclass
class _Member:
    actor: Any
    group: Any  # its placement group
    replicas: int = 0  # replicas assigned to it now


class DrafterPool:
    """Drafter actors shared by replicas of ``config``'s model, ``ratio`` replicas per member at most, ``max_members``
    members at most (then the least-assigned member takes one more)."""

    def __init__(
        self,
        config: ReplicaConfig,
        ratio: int,
        max_members: int = 64,
        ready_timeout_s: float = 60.0,
        release_idle: bool = False,
    ) -> None:
        """``release_idle``: stop every member once no replica is assigned (a shared pool's way of not outliving its
        model's replicas)."""
        if ratio < 1 or max_members < 1:
            raise UserError(f"a drafter pool needs a ratio and a member limit >= 1, got {ratio}, {max_members}")
        self.config = config
        self.ratio = ratio
        self.max_members = max_members
        self.ready_timeout_s = ready_timeout_s
        self.release_idle = release_idle
        self._members: list[_Member] = []
        self._lock = threading.Lock()

    @property
    def members(self) -> list[Any]:
        """The members' actor handles, in the order they were started."""
        return self.members_now()

    def members_now(self) -> list[Any]:
        """:attr:`members` (as a method: what a remote caller of the pool actor can call)."""
        with self._lock:
            return [member.actor for member in self._members]

    def assignments(self) -> list[int]:
        """Replicas assigned to each member now."""
        with self._lock:
            return [member.replicas for member in self._members]

    def assign(self, info: ModelInfo) -> Any:
        """A member for one more replica: the least-assigned one with room, or a new one (module docstring)."""
        with self._lock:
            room = [m for m in self._members if m.replicas < self.ratio]
            if room or len(self._members) >= self.max_members:
                member = min(room or self._members, key=lambda m: m.replicas)
            else:
                member = self._start(info)
                self._members.append(member)
            member.replicas += 1
            return member.actor

    def unassign(self, drafter: Any) -> None:
        """The replica ``drafter`` drafted for is gone (the member stays for the others, and for later replicas; with
        ``release_idle``, the last replica's leaving stops every member)."""
        with self._lock:
            for member in self._members:
                if member.actor == drafter and member.replicas > 0:  # Ray's handles compare by actor id
                    member.replicas -= 1
                    break
            idle = self.release_idle and all(member.replicas == 0 for member in self._members)
        if idle:
            self.shutdown()

    def shutdown(self) -> None:
        """Kill every member and remove its placement group."""
        import ray
        from ray.util.placement_group import remove_placement_group

        with self._lock:
            members, self._members = self._members, []
        for member in members:
            ray.kill(member.actor)
            remove_placement_group(member.group)

    def _start(self, info: ModelInfo) -> _Member:
        import ray
        from ray.util.placement_group import placement_group, remove_placement_group

        spec = dataclasses.replace(self.config.spec(), drafter_placement="separate")
        plan = replica_placement(spec).drafter
        assert plan is not None, "a separate drafter has a group of its own"
        group = placement_group(plan.bundles, strategy=plan.strategy)
        if not ray.wait([group.ready()], timeout=self.ready_timeout_s)[0]:
            remove_placement_group(group)
            raise UserError(
                f"the cluster cannot place a drafter pool member within {self.ready_timeout_s:.0f}s: it needs "
                f"{plan.bundles[0]} (a node with the {self.config.cheap_resource!r} resource)"
            )
        slots = self.ratio * self.config.max_num_seqs
        actor = start_drafter(self.config, info, group, 0, plan.bundles[0], slots)
        return _Member(actor, group)


POOL_NAMESPACE = "specserve"
_POOL_FIELDS = (  # what makes two replicas' drafters interchangeable: the same model, drafter and member shape
    "target", "draft", "dtype", "device", "max_ngram", "min_ngram", "suffix_store", "threads_per_drafter",
    "cheap_resource", "cpus_per_drafter", "gpus_per_drafter", "max_num_seqs", "pool_ratio",
)  # fmt: skip


def pool_name(config: ReplicaConfig) -> str:
    """The name of the shared pool of ``config``'s model: one per model, drafter and member shape."""
    import hashlib
    import json

    key = json.dumps({name: getattr(config, name) for name in _POOL_FIELDS}, sort_keys=True, default=str)
    return "specserve-drafter-pool-" + hashlib.sha256(key.encode()).hexdigest()[:16]


class SharedPool:
    """The pool every replica of ``config``'s model shares, in any process: a named, detached Ray actor running a
    :class:`DrafterPool` (``pool_ratio`` replicas per member, idle members stopped), created by the first replica
    that needs it. Quacks like the local pool for ``spawn_replica``."""

    ATTEMPTS = 3  # a pool actor that stopped between being found and being asked is created again

    def __init__(self, config: ReplicaConfig) -> None:
        self.config = config
        self.name = pool_name(config)

    def _actor(self) -> Any:
        import ray

        pool_cls: Any = ray.remote(DrafterPool)
        return pool_cls.options(
            name=self.name,
            namespace=POOL_NAMESPACE,
            get_if_exists=True,
            lifetime="detached",  # outlives the replica that created it: the others share it
            num_cpus=0,
            max_concurrency=16,
        ).remote(self.config, self.config.pool_ratio, release_idle=True)

    def _call(self, method: str, *args: Any) -> Any:
        import ray

        for attempt in range(self.ATTEMPTS):
            try:
                return ray.get(getattr(self._actor(), method).remote(*args))
            except ray.exceptions.RayActorError:
                if attempt == self.ATTEMPTS - 1:
                    raise
        raise AssertionError("unreachable")

    def assign(self, info: ModelInfo) -> Any:
        return self._call("assign", info)

    def unassign(self, drafter: Any) -> None:
        import ray

        try:
            handle = ray.get_actor(self.name, namespace=POOL_NAMESPACE)
        except ValueError:  # no pool: nothing holds the member any more
            return
        ray.get(handle.unassign.remote(drafter))

    @property
    def members(self) -> list[Any]:
        return list(self._call("members_now"))

    def assignments(self) -> list[int]:
        return list(self._call("assignments"))

    def shutdown(self) -> None:
        """Stop the pool's members and the pool actor itself (every replica that shared it should be gone)."""
        import ray

        try:
            handle = ray.get_actor(self.name, namespace=POOL_NAMESPACE)
        except ValueError:
            return
        ray.get(handle.shutdown.remote())
        ray.kill(handle)
