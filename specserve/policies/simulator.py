"""Trace replay: run a γ policy over recorded cycles, charging what the recording says each choice costs.

A live policy experiment is slow and noisy; a replay answers "what would policy P have done on
this workload" in milliseconds, deterministically, from a trace (:mod:`specserve.policies.traces`).
From the chain-drafting records of one workload the simulator builds a :class:`WorkloadModel`:

**Acceptance process.** Every recorded cycle gives an accepted run length L and whether it was
*censored* (every drafted token accepted: the true run is ≥ L). The simulator lays each
request's cycles along its text: the L accepted positions are *acceptable* (a draft starting
there would have been accepted), the position of the recovered token after a rejection is *not
acceptable*, and the bonus position after a censored run (nothing was drafted there) is
*unknown*. A simulated cycle starting at text position p with budget γ accepts the run of
acceptable positions from p, stopped at the first unacceptable one or at γ, i.e.
``accepted = min(γ, L(p))``; where the run reaches an unknown position (a censored run the policy
wants to extend, a request recorded without drafting, or text past the recorded end) it is
extended position by position with the workload's per-depth acceptance α̂ at the simulated
depth, drawn from a seeded :class:`random.Random`. α̂(d) is the fraction of recorded cycles that
reached depth d and accepted it (censored cycles count for the depths they reached, so α̂ is not
biased low); depths past the deepest recorded use the last estimate; no drafting records at all
gives α̂ = 0.

For a greedy draft model this is exact: the draft at a position depends only on the committed
text, which is the same for every policy, so the labels are facts about the text. Sampled runs
(temperature > 0) and context-dependent drafters (n-gram lookup) make them an approximation: the
recorded accept outcomes of one realisation are reused for another. When a workload was recorded
under several policies, α̂ and the costs pool all of them, while the labels come from one
(``source_policy``; by default the one leaving the fewest unknown positions).

**Costs.** T_draft(γ) = fixed + γ · per-token, a least-squares line through the median draft
seconds at each recorded γ ≥ 1 (one recorded γ, or a negative intercept: a line through the
origin); T_verify(k), k = γ + 1,
the median verify seconds at each recorded k, linearly interpolated between recorded ks and
extrapolated past either end with the slope of the two nearest (clamped at zero; one recorded k:
flat). Wire seconds are charged as recorded at the covering cycle. A simulated cycle that drafts
exactly what the recorded cycle starting at the same position drafted is charged that cycle's
recorded seconds instead — so replaying the policy that recorded a trace (a fixed γ with a
draft model, which always fills its budget) reproduces every recorded cycle: accepted lengths and
seconds. The price is a small asymmetry: matched cycles carry their real noise, the others the
medians.

**Requests.** Each recorded request is simulated once, in order (``tokens`` repeats them until
that many tokens are emitted), with one :class:`~specserve.policies.controller.SpeculationController`
per request as live; it emits the recorded request's committed tokens (Σ accepted + 1), and drafts
are cut at ``remaining - 1`` like the engine's, from the recorded ``remaining`` at its first cycle.
Tokens/s is emitted tokens over charged cycle seconds: prefill and per-request overhead are not
simulated, so replayed tokens/s read higher than live wall-clock ones; compare replays with replays.

**Batches.** A cycle recorded in a batched step (``batch_size`` > 1) is replayed at that batch size: the
policy is told it (``next_budget(remaining, batch_size)``), and a γ other than the recorded one is charged
the verify seconds of a forward over ``batch_size · (γ + 1)`` positions (the batch drafting alike, as the
goodput-aware policy assumes), read off the same curve, which batched records key by the positions their
step computed. Who shared the batch, and how their choices widened it, is not replayed.

**Buckets.** A trace recorded on a static-shape engine already carries bucketed seconds per k; replaying it
with ``controller_schedules(..., buckets=...)`` lets the controllers price blocks at their buckets as live.
The curves themselves are not re-bucketed: charging an unbucketed trace as if it were padded is not simulated.

Not simulated: draft trees (tree records are ignored and tree budgets rejected), overlap mode,
and anything a policy could learn from the text itself.
"""

from __future__ import annotations

import bisect
import random
import statistics
from collections import defaultdict
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass, field
from typing import Any

from specserve.core.draft.schedule import Budget, CycleObservation, Schedule
from specserve.core.errors import UserError
from specserve.core.model.buckets import VerifyBuckets
from specserve.policies.base import Policy
from specserve.policies.controller import DEFAULT_MAX_GAMMA_CAP, SpeculationController, resolve_buckets
from specserve.policies.estimators import ReplicaPrior
from specserve.policies.traces import TraceRecord

__all__ = [
    "AcceptanceProcess",
    "CostCurves",
    "RecordedRequest",
    "SimulatedCycle",
    "SimulationResult",
    "WorkloadModel",
    "acceptance_counts",
    "controller_schedules",
    "estimate_alpha",
    "simulate",
]


# ---------------------------------------------------------------------------------------------
# Acceptance per depth


def acceptance_counts(records: Iterable[TraceRecord]) -> tuple[list[int], list[int]]:
    """Per depth d: (cycles that reached d, cycles that accepted d); censored cycles count where they reached."""
    reached: list[int] = []
    accepted: list[int] = []
    for record in records:
        top = min(record.accepted + 1, record.depth)  # depths reached: the accepted ones and the first rejection
        while len(reached) < top:
            reached.append(0)
            accepted.append(0)
        for depth in range(top):
            reached[depth] += 1
            accepted[depth] += int(depth < record.accepted)
    return reached, accepted


def estimate_alpha(records: Iterable[TraceRecord]) -> tuple[float, ...]:
    """α̂(d) = cycles that accepted depth d / cycles that reached it (see :func:`acceptance_counts`)."""
    reached, accepted = acceptance_counts(records)
    return tuple(a / r for a, r in zip(accepted, reached, strict=True))


# ---------------------------------------------------------------------------------------------
# Workload model: acceptance process and cost curves


@dataclass(frozen=True)
class CostCurves:
    """T_draft(γ) and T_verify(k) of one workload, from recorded cycles (medians per size)."""

    draft_fixed_seconds: float
    draft_seconds_per_token: float | None  # None: nothing was ever drafted (speculation cannot be charged)
    # [n] recorded forward sizes, ascending: positions computed (k = depth + 1 alone; rows x widest block in a batch)
    verify_ks: tuple[int, ...]
    verify_seconds: tuple[float, ...]  # [n] median verify seconds at each size

    @staticmethod
    def from_records(records: Sequence[TraceRecord]) -> CostCurves:
        if not records:
            raise UserError("cannot estimate costs from an empty trace")
        draft_by_gamma: dict[int, list[float]] = defaultdict(list)
        verify_by_k: dict[int, list[float]] = defaultdict(list)
        for record in records:
            verify_by_k[record.positions].append(record.verify_seconds)
            if record.nodes > 0:
                draft_by_gamma[record.nodes].append(record.draft_seconds)
        ks = tuple(sorted(verify_by_k))
        verify = tuple(statistics.median(verify_by_k[k]) for k in ks)
        points = [(g, statistics.median(draft_by_gamma[g])) for g in sorted(draft_by_gamma)]
        fixed, per_token = _fit_line(points)
        return CostCurves(fixed, per_token, ks, verify)

    def t_draft(self, gamma: int) -> float:
        if gamma == 0:
            return 0.0
        if self.draft_seconds_per_token is None:
            raise UserError("the trace has no cycle that drafted anything: drafting cannot be charged")
        return max(0.0, self.draft_fixed_seconds + gamma * self.draft_seconds_per_token)

    def t_verify(self, k: int) -> float:
        return piecewise_linear(self.verify_ks, self.verify_seconds, k)

    def cycle_seconds(self, gamma: int) -> float:
        return self.t_draft(gamma) + self.t_verify(gamma + 1)


def piecewise_linear(xs: Sequence[float], ys: Sequence[float], x: float) -> float:
    """``y`` at ``x`` on the polyline through ``(xs, ys)`` (``xs`` ascending): linear between the nearest two points,
    extrapolated past either end with the slope of the two nearest, clamped at zero; one point: flat."""
    if len(xs) == 1:
        return ys[0]
    if x <= xs[0]:
        i = 0
    elif x >= xs[-1]:
        i = len(xs) - 2
    else:
        i = next(j for j in range(len(xs) - 1) if xs[j] <= x <= xs[j + 1])
    slope = (ys[i + 1] - ys[i]) / (xs[i + 1] - xs[i])
    return max(0.0, ys[i] + slope * (x - xs[i]))


def _fit_line(points: Sequence[tuple[int, float]]) -> tuple[float, float | None]:
    """(intercept, slope) of the least-squares line through ``points``; one point: (0, y / x)."""
    if not points:
        return 0.0, None
    if len(points) == 1:
        gamma, seconds = points[0]
        return 0.0, seconds / gamma
    n = len(points)
    mean_x = sum(x for x, _ in points) / n
    mean_y = sum(y for _, y in points) / n
    sxx = sum((x - mean_x) ** 2 for x, _ in points)
    slope = sum((x - mean_x) * (y - mean_y) for x, y in points) / sxx
    intercept = mean_y - slope * mean_x
    if intercept < 0:  # a fixed cost cannot be negative: refit through the origin
        return 0.0, sum(x * y for x, y in points) / sum(x * x for x, _ in points)
    return intercept, slope


@dataclass(frozen=True)
class RecordedRequest:
    """One recorded request laid along its text: per position, would a draft there be accepted."""

    request_id: str
    labels: tuple[bool | None, ...]  # [tokens] True acceptable, False rejected there, None unknown
    starts: tuple[int, ...]  # [cycles] text position where each recorded cycle began
    records: tuple[TraceRecord, ...]  # [cycles] in cycle order
    max_new_tokens: int | None  # the recorded `remaining` at its first cycle (None: not recorded)

    @property
    def tokens(self) -> int:
        return len(self.labels)

    @staticmethod
    def from_records(records: Sequence[TraceRecord]) -> RecordedRequest:
        ordered = tuple(sorted(records, key=lambda r: r.cycle))
        cycles = [r.cycle for r in ordered]
        if cycles != list(range(len(ordered))):
            first = ordered[0]
            raise UserError(
                f"request {first.request_id!r} ({first.policy}) has cycles {_span(cycles)}, not 0..{len(ordered) - 1} "
                "once each: two runs appended with the same request ids, or a partial trace"
            )
        labels: list[bool | None] = []
        starts: list[int] = []
        for record in ordered:
            starts.append(len(labels))
            labels.extend([True] * record.accepted)
            labels.append(None if record.censored else False)
        return RecordedRequest(ordered[0].request_id, tuple(labels), tuple(starts), ordered, ordered[0].remaining)

    def record_starting_at(self, position: int) -> TraceRecord | None:
        index = bisect.bisect_left(self.starts, position)
        return self.records[index] if index < len(self.starts) and self.starts[index] == position else None

    def record_covering(self, position: int) -> TraceRecord:
        """The recorded cycle whose committed span holds ``position`` (the last one past the recorded end)."""
        return self.records[max(0, bisect.bisect_right(self.starts, position) - 1)]


def _span(cycles: Sequence[int]) -> str:
    shown = ", ".join(map(str, cycles[:8]))
    return f"[{shown}{', ...' if len(cycles) > 8 else ''}]"


@dataclass(frozen=True)
class AcceptanceProcess:
    requests: tuple[RecordedRequest, ...]
    alpha: tuple[float, ...]  # per-depth α̂, used to resolve unknown positions

    def alpha_at(self, depth: int) -> float:
        if not self.alpha:
            return 0.0
        return self.alpha[min(depth, len(self.alpha) - 1)]


@dataclass(frozen=True)
class WorkloadModel:
    """What the simulator knows of one workload: its acceptance process and its cost curves."""

    workload: str
    source_policy: str  # the recorded policy whose requests form the acceptance process
    temperature: float
    acceptance: AcceptanceProcess
    costs: CostCurves

    @staticmethod
    def from_records(
        records: Iterable[TraceRecord], workload: str | None = None, source_policy: str | None = None
    ) -> WorkloadModel:
        """Model one workload from its chain records; costs and α̂ pool every recorded policy.

        The acceptance process uses one recorded policy's requests (``source_policy``; default the
        one whose records leave the fewest unknown positions per token, i.e. the deepest drafting).
        """
        chains = [r for r in records if r.tree is None and (workload is None or r.workload == workload)]
        workloads = sorted({r.workload for r in chains})
        if not chains:
            raise UserError(f"no chain-drafting records for workload {workload!r} in the trace")
        if len(workloads) > 1:
            raise UserError(f"records of several workloads ({', '.join(workloads)}): pick one")
        by_policy: dict[str, dict[str, list[TraceRecord]]] = defaultdict(lambda: defaultdict(list))
        for record in chains:
            by_policy[record.policy][record.request_id].append(record)
        requests_by_policy = {
            policy: tuple(RecordedRequest.from_records(rs) for rs in by_request.values())
            for policy, by_request in by_policy.items()
        }
        if source_policy is None:
            source_policy = min(requests_by_policy, key=lambda p: (_unknown_share(requests_by_policy[p]), p))
        elif source_policy not in requests_by_policy:
            raise UserError(
                f"policy {source_policy!r} has no records for workload {workloads[0]!r}; "
                f"recorded: {', '.join(sorted(requests_by_policy))}"
            )
        acceptance = AcceptanceProcess(requests_by_policy[source_policy], estimate_alpha(chains))
        temperatures = {r.temperature for r in chains}
        return WorkloadModel(
            workloads[0], source_policy, max(temperatures), acceptance, CostCurves.from_records(chains)
        )

    @property
    def alpha(self) -> tuple[float, ...]:
        return self.acceptance.alpha


def _unknown_share(requests: Sequence[RecordedRequest]) -> float:
    tokens = sum(r.tokens for r in requests)
    unknown = sum(label is None for r in requests for label in r.labels)
    return unknown / tokens if tokens else 1.0


# ---------------------------------------------------------------------------------------------
# Simulation


@dataclass(frozen=True)
class SimulatedCycle:
    request: int  # index of the simulated request
    position: int  # text position where the cycle began
    budget: Budget  # what the policy chose
    gamma: int  # tokens drafted (the budget cut at the request's end)
    accepted: int
    draft_seconds: float
    verify_seconds: float
    wire_seconds: float
    recorded: bool  # charged the recorded cycle's own seconds (same position, same draft)

    @property
    def seconds(self) -> float:
        return self.draft_seconds + self.verify_seconds + self.wire_seconds


@dataclass
class SimulationResult:
    workload: str
    policy: str
    cycles: list[SimulatedCycle] = field(default_factory=list)
    tokens: int = 0

    @property
    def seconds(self) -> float:
        return sum(c.seconds for c in self.cycles)

    @property
    def tokens_per_second(self) -> float:
        seconds = self.seconds
        return self.tokens / seconds if seconds > 0 else 0.0

    @property
    def mean_accepted(self) -> float:
        """Mean tokens committed per cycle (accepted drafts + the recovered/bonus token)."""
        return sum(c.accepted + 1 for c in self.cycles) / len(self.cycles) if self.cycles else 0.0

    @property
    def gammas(self) -> list[int]:
        """The γ drafted per cycle, in simulated order (γ over time)."""
        return [c.gamma for c in self.cycles]

    @property
    def mean_gamma(self) -> float:
        return sum(self.gammas) / len(self.cycles) if self.cycles else 0.0

    def observations(self) -> list[CycleObservation]:
        return [
            CycleObservation(c.budget, c.gamma, c.gamma, c.accepted, c.draft_seconds, c.verify_seconds, c.wire_seconds)
            for c in self.cycles
        ]

    def to_dict(self) -> dict[str, Any]:
        return {
            "workload": self.workload,
            "policy": self.policy,
            "tokens": self.tokens,
            "cycles": len(self.cycles),
            "seconds": self.seconds,
            "tokens_per_second": self.tokens_per_second,
            "mean_accepted": self.mean_accepted,
            "mean_gamma": self.mean_gamma,
            "gammas": self.gammas,
        }


RequestSchedules = Callable[[], Schedule]  # a fresh schedule for each simulated request


def controller_schedules(
    policy: Policy,
    prior: ReplicaPrior | None = None,
    max_gamma_cap: int = DEFAULT_MAX_GAMMA_CAP,
    *,
    buckets: VerifyBuckets | None = None,
) -> RequestSchedules:
    """A fresh :class:`~specserve.policies.controller.SpeculationController` per request for ``policy``, all
    sharing one replica prior (a new one unless given), as the engine's requests on one replica do; ``buckets``
    as :func:`~specserve.policies.schedules.schedules` takes them (the recorded costs should then be bucketed)."""
    shared = prior if prior is not None else ReplicaPrior(buckets=buckets)
    widths = resolve_buckets(shared, buckets)
    return lambda: SpeculationController(policy, shared, max_gamma_cap, buckets=widths)


def simulate(
    model: WorkloadModel,
    schedules: RequestSchedules,
    *,
    policy_name: str = "policy",
    seed: int = 0,
    tokens: int | None = None,
) -> SimulationResult:
    """Replay ``model``'s recorded requests under a fresh schedule per request (see the module docstring).

    ``tokens``: stop once this many tokens were emitted, repeating the recorded requests as needed
    (default: each recorded request once).
    """
    rng = random.Random(seed)
    result = SimulationResult(model.workload, policy_name)
    requests = model.acceptance.requests
    if not requests:
        raise UserError(f"workload {model.workload!r} has no recorded requests to replay")
    index = 0
    while True:
        request = requests[index % len(requests)]
        budget_left = None if tokens is None else tokens - result.tokens
        _simulate_request(model, request, schedules(), rng, result, index, budget_left)
        index += 1
        if tokens is None and index == len(requests):
            break
        if tokens is not None and result.tokens >= tokens:
            break
    return result


def _simulate_request(
    model: WorkloadModel,
    request: RecordedRequest,
    schedule: Schedule,
    rng: random.Random,
    result: SimulationResult,
    request_index: int,
    token_limit: int | None,
) -> None:
    length = request.tokens if token_limit is None else min(request.tokens, token_limit)
    max_new = request.max_new_tokens if request.max_new_tokens is not None else request.tokens
    position = 0
    while position < length:
        remaining = max_new - position
        batch = request.record_covering(position).batch_size
        budget = schedule.next_budget(remaining, batch)
        if budget.tree is not None:
            raise UserError("the trace simulator replays chain budgets only; the policy chose a tree")
        gamma = max(0, min(budget.gamma, remaining - 1))
        accepted = _run_length(model.acceptance, request, position, gamma, rng)
        draft, verify, wire, recorded = _charge(model.costs, request, position, gamma, batch)
        cycle = SimulatedCycle(request_index, position, budget, gamma, accepted, draft, verify, wire, recorded)
        positions = batch * (gamma + 1) if batch > 1 else 0
        schedule.observe(CycleObservation(budget, gamma, gamma, accepted, draft, verify, wire, batch, positions))
        result.cycles.append(cycle)
        emitted = min(accepted + 1, length - position)
        result.tokens += emitted
        position += accepted + 1


def _run_length(
    acceptance: AcceptanceProcess, request: RecordedRequest, position: int, gamma: int, rng: random.Random
) -> int:
    """Drafts accepted by a γ-token chain starting at ``position``: min(γ, the run of acceptable positions)."""
    for depth in range(gamma):
        at = position + depth
        label = request.labels[at] if at < request.tokens else None
        if label is None:
            label = rng.random() < acceptance.alpha_at(depth)
        if not label:
            return depth
    return gamma


def _charge(
    costs: CostCurves, request: RecordedRequest, position: int, gamma: int, batch: int = 1
) -> tuple[float, float, float, bool]:
    """(draft, verify, wire seconds, whether they are the recorded cycle's own) of a γ-draft at ``position`` in a
    step of ``batch`` requests (which, drafting alike, compute ``batch · (γ + 1)`` positions)."""
    recorded = request.record_starting_at(position)
    if recorded is not None and recorded.nodes == gamma and recorded.batch_size == batch:
        return recorded.draft_seconds, recorded.verify_seconds, recorded.wire_seconds, True
    wire = request.record_covering(position).wire_seconds
    return costs.t_draft(gamma), costs.t_verify(batch * (gamma + 1)), wire, False
