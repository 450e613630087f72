"""When a drafter pool adds and stops members: the rule, from the pool's own load, with no Ray and no clock of its own.

A pool's load is its *demand*: the requests drafting on its members now, plus those that found every member full (they
decode without speculation meanwhile). A member is sized for ``target_requests`` of them at once — ``pool_ratio``
replicas' full batches, ``pool_ratio × max_num_seqs`` — so the pool wants ``⌈demand / target_requests⌉`` members,
within ``[min_members, max_members]``. Like Ray Serve's autoscaling of a deployment, it acts on a want that has held:
more members once the want has stayed above the count for ``upscale_delay_s``, fewer once it has stayed below for
``downscale_delay_s`` (to the highest want seen meanwhile, so a lull shorter than the delay stops nothing).

This module decides counts; :class:`~specserve.actors.drafter_pool.DrafterPool` places, starts, drains and stops the
members.
"""

from __future__ import annotations

from dataclasses import dataclass

from specserve.cluster.replica_config import ReplicaConfig
from specserve.core.errors import UserError


@dataclass(frozen=True)
class PoolScaling:
    """How many members a pool may hold, how many requests one drafts for at once, and how long a want must hold."""

    target_requests: int  # requests one member drafts for at once (its loops)
    min_members: int = 1
    max_members: int = 8
    upscale_delay_s: float = 2.0
    downscale_delay_s: float = 30.0

    def __post_init__(self) -> None:
        if not 1 <= self.min_members <= self.max_members or self.target_requests < 1:
            raise UserError(
                "a drafter pool needs 1 <= pool_min_members <= pool_max_members and a ratio >= 1; got "
                f"{self.min_members}, {self.max_members} and {self.target_requests} requests per member"
            )
        if self.upscale_delay_s < 0 or self.downscale_delay_s < 0:
            raise UserError("a drafter pool's scaling delays must be >= 0 seconds")

    @classmethod
    def of(cls, config: ReplicaConfig) -> PoolScaling:
        """The configuration's: ``pool_ratio × max_num_seqs`` requests per member and the ``pool_*`` settings."""
        return cls(
            target_requests=config.pool_ratio * config.max_num_seqs,
            min_members=config.pool_min_members,
            max_members=config.pool_max_members,
            upscale_delay_s=config.pool_upscale_delay_s,
            downscale_delay_s=config.pool_downscale_delay_s,
        )

    def wanted(self, demand: int) -> int:
        """Members ``demand`` requests want, within the limits."""
        return min(self.max_members, max(self.min_members, -(-demand // self.target_requests)))


class ScaleDecider:
    """The member count to hold, from ``(time, demand, members)`` observations (module docstring)."""

    def __init__(self, scaling: PoolScaling) -> None:
        self.scaling = scaling
        self._above_since: float | None = None  # when the want first exceeded the count, in the current run of it
        self._below_since: float | None = None
        self._peak = 0  # the highest want while below

    def decide(self, now: float, demand: int, members: int) -> int:
        want = self.scaling.wanted(demand)
        if want > members:
            self._below_since = None
            if self._above_since is None:
                self._above_since = now
            if now - self._above_since >= self.scaling.upscale_delay_s:
                self._above_since = None
                return want
        elif want < members:
            self._above_since = None
            if self._below_since is None:
                self._below_since, self._peak = now, want
            self._peak = max(self._peak, want)
            if now - self._below_since >= self.scaling.downscale_delay_s:
                self._below_since = None
                return self._peak
        else:
            self._above_since = self._below_since = None
        return members
