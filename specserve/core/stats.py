"""Per-request speculation statistics: what was drafted, what was accepted, where the time went.

Acceptance by position i is conditional on reaching it: among cycles whose draft had a token
at position i and accepted every token before it, the fraction that accepted token i.
"Accepted length" of a cycle counts the recovered or bonus token too, so plain decoding has
mean accepted length 1.
"""

from __future__ import annotations

from collections import Counter
from dataclasses import dataclass, field
from typing import Any

from specserve.core.draft.schedule import CycleObservation


@dataclass
class RequestStats:
    cycles: int = 0
    drafted_tokens: int = 0
    accepted_tokens: int = 0  # draft tokens accepted by the verifier
    new_tokens: int = 0  # tokens delivered to the caller
    reached: list[int] = field(default_factory=list)  # [max_gamma] cycles that reached position i
    accepted: list[int] = field(default_factory=list)  # [max_gamma] cycles that accepted position i
    accepted_length_histogram: Counter[int] = field(default_factory=Counter)  # accepted + 1 -> cycles
    draft_length_histogram: Counter[int] = field(default_factory=Counter)  # tokens drafted -> cycles
    prefill_seconds: float = 0.0
    prompt_tokens: int = 0  # the request's prompt
    cached_tokens: int = 0  # prompt positions copied from the prefix cache instead of computed
    draft_seconds: float = 0.0
    verify_seconds: float = 0.0
    wire_seconds: float = 0.0  # distributed runs: gRPC transit of drafts and verdicts
    allreduce_seconds: float = 0.0  # distributed runs: tensor-parallel all-reduces inside verify
    overlap_hits: int = 0  # overlap mode: cycles whose draft was ready when the verdict came
    tree_shapes: list[tuple[int, int]] = field(default_factory=list)  # tree runs: (nodes, depth) per cycle
    budgets: list[int] = field(default_factory=list)  # the budget the policy chose per cycle (γ, or tree nodes)
    observations: list[CycleObservation] = field(default_factory=list)  # every cycle, as the policy saw it
    # what the drafter counted (core.draft.drafter.CountingDrafter: matches, match tokens, pool hits...), when it counts
    drafter_counters: Counter[str] = field(default_factory=Counter)
    # what the request's schedule decided and why (core.draft.schedule.schedule_report); {} for a fixed one
    policy: dict[str, Any] = field(default_factory=dict)
    total_seconds: float = 0.0

    def record(self, observation: CycleObservation, allreduce_seconds: float = 0.0, overlap_hit: bool = False) -> None:
        """One cycle as the engine loop (or the coordinator) observed it: budget, draft, verdict, times."""
        self.record_cycle(
            observation.depth,
            observation.accepted,
            observation.draft_seconds,
            observation.verify_seconds,
            wire_seconds=observation.wire_seconds,
            allreduce_seconds=allreduce_seconds,
            overlap_hit=overlap_hit,
            drafted=observation.drafted if observation.budget.tree is not None else None,
        )
        self.budgets.append(observation.budget.nodes)
        self.observations.append(observation)

    def record_cycle(
        self,
        gamma: int,
        num_accepted: int,
        draft_seconds: float,
        verify_seconds: float,
        *,
        wire_seconds: float = 0.0,
        allreduce_seconds: float = 0.0,
        overlap_hit: bool = False,
        drafted: int | None = None,
    ) -> None:
        """``gamma``: the draft's length (a tree's depth: positions are depths); ``drafted``: its
        token count when that differs (a tree's nodes)."""
        self.cycles += 1
        self.drafted_tokens += gamma if drafted is None else drafted
        self.accepted_tokens += num_accepted
        self._grow(gamma)
        for i in range(min(num_accepted + 1, gamma)):
            self.reached[i] += 1
            if i < num_accepted:
                self.accepted[i] += 1
        self.accepted_length_histogram[num_accepted + 1] += 1
        self.draft_length_histogram[gamma] += 1
        self.draft_seconds += draft_seconds
        self.verify_seconds += verify_seconds
        self.wire_seconds += wire_seconds
        self.allreduce_seconds += allreduce_seconds
        self.overlap_hits += int(overlap_hit)
        if drafted is not None:
            self.tree_shapes.append((drafted, gamma))

    def merge(self, other: RequestStats) -> None:
        """Pool another request's counters and times into this one (a benchmark's totals)."""
        self.cycles += other.cycles
        self.drafted_tokens += other.drafted_tokens
        self.accepted_tokens += other.accepted_tokens
        self.new_tokens += other.new_tokens
        self._grow(len(other.reached))
        for i, (reached, accepted) in enumerate(zip(other.reached, other.accepted, strict=True)):
            self.reached[i] += reached
            self.accepted[i] += accepted
        self.accepted_length_histogram.update(other.accepted_length_histogram)
        self.draft_length_histogram.update(other.draft_length_histogram)
        self.prefill_seconds += other.prefill_seconds
        self.prompt_tokens += other.prompt_tokens
        self.cached_tokens += other.cached_tokens
        self.draft_seconds += other.draft_seconds
        self.verify_seconds += other.verify_seconds
        self.wire_seconds += other.wire_seconds
        self.allreduce_seconds += other.allreduce_seconds
        self.overlap_hits += other.overlap_hits
        self.tree_shapes.extend(other.tree_shapes)
        self.budgets.extend(other.budgets)
        self.observations.extend(other.observations)
        self.drafter_counters.update(other.drafter_counters)
        self.policy = merge_policy_reports(self.policy, other.policy)
        self.total_seconds += other.total_seconds

    def _grow(self, positions: int) -> None:
        missing = positions - len(self.reached)
        if missing > 0:
            self.reached.extend([0] * missing)
            self.accepted.extend([0] * missing)

    @property
    def acceptance_by_position(self) -> list[float | None]:
        return [a / r if r else None for a, r in zip(self.accepted, self.reached, strict=True)]

    @property
    def acceptance_rate(self) -> float | None:
        """Accepted draft tokens / drafted tokens."""
        return self.accepted_tokens / self.drafted_tokens if self.drafted_tokens else None

    @property
    def mean_accepted(self) -> float:
        """Mean tokens committed per cycle by the verifier (accepted drafts + the recovered/bonus token)."""
        return (self.accepted_tokens + self.cycles) / self.cycles if self.cycles else 0.0

    @property
    def tokens_per_second(self) -> float:
        return self.new_tokens / self.total_seconds if self.total_seconds > 0 else 0.0

    def to_dict(self) -> dict[str, Any]:
        return {
            "cycles": self.cycles,
            "new_tokens": self.new_tokens,
            "drafted_tokens": self.drafted_tokens,
            "accepted_tokens": self.accepted_tokens,
            "acceptance_rate": self.acceptance_rate,
            "mean_accepted": self.mean_accepted,
            "acceptance_by_position": self.acceptance_by_position,
            "reached_by_position": list(self.reached),
            "accepted_length_histogram": {str(k): v for k, v in sorted(self.accepted_length_histogram.items())},
            "draft_length_histogram": {str(k): v for k, v in sorted(self.draft_length_histogram.items())},
            "prefill_seconds": self.prefill_seconds,
            "prompt_tokens": self.prompt_tokens,
            "cached_tokens": self.cached_tokens,
            "draft_seconds": self.draft_seconds,
            "verify_seconds": self.verify_seconds,
            "wire_seconds": self.wire_seconds,
            "allreduce_seconds": self.allreduce_seconds,
            "overlap_hits": self.overlap_hits,
            "tree_shapes": [list(shape) for shape in self.tree_shapes],
            "budgets": list(self.budgets),
            "drafter_counters": dict(sorted(self.drafter_counters.items())),
            "policy": dict(self.policy),
            "total_seconds": self.total_seconds,
            "tokens_per_second": self.tokens_per_second,
        }


def merge_policy_reports(a: dict[str, Any], b: dict[str, Any]) -> dict[str, Any]:
    """Two requests' schedule reports pooled (a benchmark's totals): counts (integers) added, a key missing on one side
    counting 0; anything else kept only where both agree (the policy's name), dropped where they differ (a request's
    own ceiling state, measured speedups, reasons)."""
    if not a or not b:
        return dict(a or b)
    merged: dict[str, Any] = {}
    for key in dict.fromkeys([*a, *b]):
        x, y = a.get(key), b.get(key)
        if all(v is None or (isinstance(v, int) and not isinstance(v, bool)) for v in (x, y)):
            merged[key] = (x or 0) + (y or 0)
        elif x == y:
            merged[key] = x
    return merged
