"""What the engine loop asks before each cycle and reports after it: the budget, and the cycle's observation.

The single-process engines and the distributed coordinator run every request through a
:class:`Schedule`: ``next_budget(remaining, batch_size)`` before drafting, ``observe(observation)`` after the
verdict. :class:`FixedSchedule` (the request's own γ or tree, every cycle) is the default;
``specserve.policies`` builds adaptive ones from online estimates. The types live here so that
``core`` never imports policies. A budget only changes how much is proposed, never how proposals
are verified, so every schedule keeps the output exact.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, Protocol, runtime_checkable

from specserve.core.errors import InvalidRequest
from specserve.core.tree.shapes import TreeSpec

# The policies a request may name; ``specserve.policies`` implements them (its registry checks it agrees).
POLICY_NAMES = ("fixed", "heuristic", "adaptive")

# The most draft tokens one cycle may verify in a chain: the one limit every edge (CLI, HTTP, YAML, Python) checks.
MAX_GAMMA = 64


@dataclass(frozen=True)
class Budget:
    """How much to draft in one cycle: ``gamma`` chain tokens (0 = plain decoding), or a tree."""

    gamma: int
    tree: TreeSpec | None = None

    def __post_init__(self) -> None:
        if self.gamma < 0:
            raise ValueError(f"gamma must be >= 0, got {self.gamma}")

    @property
    def nodes(self) -> int:
        """Draft nodes the target verifies at most (k - 1, with k the verify block including the root)."""
        if self.tree is None:
            return self.gamma
        if self.tree.kind == "static":
            assert self.tree.topology is not None
            return self.tree.topology.size
        assert self.tree.budget is not None
        return self.tree.budget.nodes

    def describe(self) -> str:
        return self.tree.describe() if self.tree is not None else f"chain(gamma={self.gamma})"


@dataclass(frozen=True)
class CycleObservation:
    """What one verdict tells the estimators (and what a trace records of it)."""

    budget: Budget  # what the policy chose
    drafted: int  # draft nodes actually sent (a drafter may return fewer; budgets are cut at the request's end)
    depth: int  # depth of what was sent (== drafted for a chain)
    accepted: int  # accepted path length
    draft_seconds: float  # drafting on the critical path
    verify_seconds: float  # the target's forward + verification + rollback
    wire_seconds: float = 0.0  # distributed runs: transit
    batch_size: int = 1  # requests verified together in this cycle's target forward
    # positions that forward computed, padding included (batch rows x the widest block); 0 = drafted + 1 (alone)
    step_positions: int = 0
    # the first draft of the request, or the first after cycles without one: the drafter first caught up on the
    # text it had not seen (a draft model's prompt), a one-time cost that draft_seconds includes
    resumed: bool = False
    # a batched engine's whole decoding step, from planning to every verdict (every row's drafting, the forward,
    # the bookkeeping): what each of its rows waited, the same for all; 0 = a cycle of its own (draft + verify + wire)
    step_seconds: float = 0.0

    @property
    def cycle_seconds(self) -> float:
        """What this cycle took from the request's point of view: its batched step's whole time, or its own drafting,
        verification and transit. (A row's ``draft_seconds`` in a batched step is its share of shared drafting; every
        row waited for all of it.)"""
        return self.step_seconds or self.draft_seconds + self.verify_seconds + self.wire_seconds

    @property
    def positions(self) -> int:
        """Positions the cycle's target forward computed: the whole batch's, or this request's block alone."""
        return self.step_positions or self.drafted + 1

    @property
    def accept_flags(self) -> tuple[bool, ...]:
        """Per depth reached: accepted (True) or the first rejection (False); deeper depths were not reached."""
        flags = [True] * self.accepted
        if self.accepted < self.depth:
            flags.append(False)
        return tuple(flags)


@runtime_checkable
class Schedule(Protocol):
    """One request's budget per cycle."""

    def next_budget(self, remaining: int, batch_size: int = 1) -> Budget:
        """The next cycle's budget; ``remaining`` = tokens the request may still emit (callers cut drafts
        to ``remaining - 1``, since the verdict always adds one token); ``batch_size`` = requests the next
        target forward verifies together, this one included (a goodput-aware schedule drafts less in a
        larger batch)."""
        ...

    def observe(self, observation: CycleObservation) -> None: ...


@runtime_checkable
class BatchPlanned(Protocol):
    """A schedule whose chains a batched engine may shorten or lengthen to the step's width (``aligns_in_batch``).

    The target's forward pads every row of a step to its widest block, so the width is the batch's decision,
    not one request's: the engine picks the width that maximises the step's expected committed tokens per
    second (:func:`specserve.core.draft_side.choose_chains`) from what each such schedule expects of a chain of
    each length, what drafting it costs and what a step of so many positions costs; it cuts longer chains to
    the width, and lets shorter ones (plain decoding included) draft up to it where the tokens gained pay for
    the drafting, since their rows cost the full width anyway.
    """

    aligns_in_batch: bool

    @property
    def max_chain(self) -> int:
        """The longest chain the engine may give this request (its replica's cap)."""
        ...

    def allowed_chain(self, gamma: int) -> int:
        """The longest chain of at most ``gamma`` the engine may give this request now: depths below
        :attr:`max_chain` may be vetoed too (a measured ceiling closes the depths that lose, one by one)."""
        ...

    def expected_tokens(self, gamma: int) -> float:
        """E[tokens committed] by a chain of ``gamma`` drafts (1 for plain decoding) under the current estimates."""
        ...

    def draft_seconds(self, gamma: int) -> float:
        """Predicted drafting seconds of a chain of ``gamma`` (0 for plain decoding), this request's share."""
        ...

    def step_seconds(self, positions: int) -> float:
        """Predicted seconds of a batched step whose forward computes ``positions`` positions."""
        ...


@runtime_checkable
class ReportingSchedule(Protocol):
    """A schedule that can say, when its request ends, what it decided and why (the request's ``stats.policy``)."""

    def report(self) -> dict[str, Any]:
        """JSON-ready: the policy's name, its decisions (how many, how many plain, the mean budget) and anything of
        its own (an adaptive schedule's measured ceiling: where it stands, its moves and their reasons)."""
        ...


@runtime_checkable
class PerDrafter(Protocol):
    """A schedule that keeps what it measures per drafter (a replica serves its configured drafter and the
    built-ins a request may choose): told its request's drafter's name before the first cycle."""

    def use_drafter(self, name: str) -> None: ...


def schedule_report(schedule: Schedule) -> dict[str, Any]:
    """``schedule``'s report; empty for a schedule that reports nothing."""
    return schedule.report() if isinstance(schedule, ReportingSchedule) else {}


class FixedSchedule:
    """The same budget every cycle (the request's ``gamma`` or ``tree``)."""

    # A fixed budget is never changed by a batched engine (see BatchPlanned).
    aligns_in_batch = False

    def __init__(self, budget: Budget) -> None:
        self.budget = budget

    def next_budget(self, remaining: int, batch_size: int = 1) -> Budget:
        return self.budget

    def observe(self, observation: CycleObservation) -> None:
        pass


# (policy name, the request's own budget: its gamma or tree) -> that request's schedule
ScheduleFactory = Callable[[str, Budget], Schedule]


def check_policy_name(name: str) -> None:
    if name not in POLICY_NAMES:
        raise InvalidRequest(f"policy must be one of {', '.join(POLICY_NAMES)}, got {name!r}")


def fixed_schedules(policy: str, budget: Budget) -> Schedule:
    """The schedule factory of an engine built without ``specserve.policies``: the fixed policy only."""
    check_policy_name(policy)
    if policy != "fixed":
        raise InvalidRequest(
            f"policy {policy!r} is not available here: build the engine with schedules=specserve.policies.schedules()"
        )
    return FixedSchedule(budget)
