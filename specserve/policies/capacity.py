"""Capacity planning by simulation: where drafters should run at cluster scale, and how many, for a price.

From a :class:`Scenario` — measured acceptance by draft position, the target's verify cost ``T_verify(k, b)`` on its
device class (one replica: ``tp`` large devices), one draft forward's cost ``D(b)`` on the large and on the cheap
device class, the hop a draft and its verdict take between devices, the requests each replica runs at once (``b``),
and each class's price per device-hour — :func:`plan` computes tokens/s and tokens per dollar of ``N`` replicas for

* ``plain`` — no speculation: one token per request per ``T_verify(1, b)``;
* ``colocated`` — the drafter on the replica's own large device: a cycle is ``γ · D_large(b) + T_verify(γ + 1, b)``;
* ``replica`` — one cheap device per replica drafts for it: ``γ · D_cheap(b) + hop + T_verify(γ + 1, b)``, and ``N``
  cheap devices more to pay for;
* ``pool`` at a ratio ``r`` (replicas per pool member, ``⌈N / r⌉`` cheap devices): a member drafts for its ``r``
  replicas' requests in shared forwards, ``γ · D_cheap(r · b) + hop + T_verify(γ + 1, b)``.

Each request emits ``1 + Σ_{i ≤ γ} Π_{j ≤ i} α_j`` tokens per cycle
(:func:`~specserve.policies.rates.expected_accepted`); each placement (and ratio) runs at the γ that maximises its
tokens/s, which for a fixed set of devices also maximises tokens per dollar. :func:`recommend` picks the placement
and ratio with the most tokens per dollar.

**Assumptions** (say them beside every figure): the replicas' cycles are aligned on their member, so one shared
drafting round per cycle serves all ``r`` (``misaligned=True`` charges each cycle a second round: the worst case of a
member that has just started another replica's round); drafting and verifying alternate (no overlap mode); costs are
per-forward medians, interpolated linearly between measured rows and widths and extended with the last slope; a
draft forward's cost does not depend on the width of the verify block; the cluster is priced by the device-hour,
and nothing else (network, hosts) is charged. Prefill, queueing between requests, overlap mode (drafting the next
chain while the target verifies) and failures are not simulated: with drafting and verifying in turn, a drafter on
another device pays only where its draft and the hop take less than drafting on the target's own device would.
Knows nothing of Ray: the pool itself is ``specserve.actors``.
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

from specserve.policies.rates import expected_accepted
from specserve.policies.simulator import piecewise_linear

PLACEMENTS = ("plain", "colocated", "replica", "pool")
DEFAULT_GAMMAS = tuple(range(1, 9))
DEFAULT_RATIOS = (1, 2, 4, 8, 16, 32)
DEFAULT_REPLICAS = (1, 10, 100, 1000)


@dataclass(frozen=True)
class CostTable:
    """Seconds of one forward by block width ``k`` and rows ``b``, from measured points ``{(k, b): seconds}``.

    Between measured rows (at a measured width) the cost is linear, and past the ends it follows the slope of the
    nearest two (:func:`~specserve.policies.simulator.piecewise_linear`); between measured widths likewise, from the
    rows' values at each."""

    points: Mapping[tuple[int, int], float]

    def __post_init__(self) -> None:
        if not self.points:
            raise ValueError("a cost table needs at least one measured point")
        if any(k < 1 or b < 1 or seconds < 0 for (k, b), seconds in self.points.items()):
            raise ValueError("widths and rows are >= 1 and seconds >= 0")

    def __call__(self, k: int, b: float) -> float:
        widths = sorted({k for k, _ in self.points})
        at_widths = []
        for width in widths:
            rows = sorted(b for w, b in self.points if w == width)
            at_widths.append(piecewise_linear(rows, [self.points[(width, r)] for r in rows], b))
        return piecewise_linear(widths, at_widths, k)

    @staticmethod
    def from_rows(by_rows: Mapping[int, float], k: int = 1) -> CostTable:
        """A table measured at one width (a draft forward: one token per row)."""
        return CostTable({(k, b): seconds for b, seconds in by_rows.items()})


@dataclass(frozen=True)
class Scenario:
    """What :func:`plan` needs (module docstring); prices in dollars per device-hour."""

    alpha: tuple[float, ...]  # acceptance by draft position (position 1 first)
    verify: CostTable  # T_verify(k, b) of one replica (its tp large devices together)
    draft_large: CostTable  # one draft forward on the large device class, by rows (width 1)
    draft_cheap: CostTable  # the same on the cheap device class
    hop_seconds: float  # per cycle, a drafter on another device: the draft to the target and the verdict back
    batch: int  # requests each replica runs at once
    large_price: float
    cheap_price: float
    tp: int = 1  # large devices per replica
    large_name: str = "large"
    cheap_name: str = "cheap"
    notes: str = ""  # where the figures come from

    def __post_init__(self) -> None:
        if not self.alpha or any(not 0.0 <= a <= 1.0 for a in self.alpha):
            raise ValueError(f"acceptance by position lies in [0, 1], got {self.alpha}")
        if self.batch < 1 or self.tp < 1 or self.hop_seconds < 0 or self.large_price < 0 or self.cheap_price < 0:
            raise ValueError("batch and tp >= 1; hop and prices >= 0")


@dataclass(frozen=True)
class Plan:
    """One placement (and pool ratio) for ``replicas`` replicas, at its best γ."""

    placement: str
    replicas: int
    ratio: int | None  # replicas per pool member (pool only)
    gamma: int
    cycle_seconds: float
    tokens_per_second: float  # the whole cluster's
    large_devices: int
    cheap_devices: int
    dollars_per_hour: float
    tokens_per_dollar: float
    extra: dict[str, Any] = field(default_factory=dict)

    def row(self) -> dict[str, Any]:
        return {
            "placement": self.placement,
            "replicas": self.replicas,
            "ratio": self.ratio,
            "gamma": self.gamma,
            "cycle_ms": round(1000 * self.cycle_seconds, 3),
            "tokens_per_second": round(self.tokens_per_second, 2),
            "large_devices": self.large_devices,
            "cheap_devices": self.cheap_devices,
            "dollars_per_hour": round(self.dollars_per_hour, 4),
            "tokens_per_dollar": round(self.tokens_per_dollar, 1),
        }


def cycle_seconds(scenario: Scenario, placement: str, gamma: int, ratio: int = 1, misaligned: bool = False) -> float:
    """One cycle of a request under ``placement`` at ``gamma`` (``ratio``: replicas per pool member)."""
    b, verify = scenario.batch, scenario.verify(gamma + 1, scenario.batch)
    if placement == "plain" or gamma == 0:
        return scenario.verify(1, b)
    if placement == "colocated":
        return gamma * scenario.draft_large(1, b) + verify
    if placement == "replica":
        return gamma * scenario.draft_cheap(1, b) + scenario.hop_seconds + verify
    if placement == "pool":
        drafting = gamma * scenario.draft_cheap(1, ratio * b)
        return drafting * (2 if misaligned and ratio > 1 else 1) + scenario.hop_seconds + verify
    raise ValueError(f"placement is one of {PLACEMENTS}, got {placement!r}")


def devices(scenario: Scenario, placement: str, replicas: int, ratio: int = 1) -> tuple[int, int]:
    """(large, cheap) devices ``replicas`` replicas take under ``placement``."""
    large = replicas * scenario.tp
    cheap = {"plain": 0, "colocated": 0, "replica": replicas, "pool": math.ceil(replicas / ratio)}[placement]
    return large, cheap


def evaluate(
    scenario: Scenario,
    placement: str,
    replicas: int,
    ratio: int | None = None,
    gammas: Sequence[int] = DEFAULT_GAMMAS,
    misaligned: bool = False,
) -> Plan:
    """``placement`` for ``replicas`` replicas at the γ among ``gammas`` with the most tokens/s."""
    if replicas < 1 or (ratio is not None and ratio < 1):
        raise ValueError(f"replicas and ratio are >= 1, got {replicas}, {ratio}")
    r = ratio or 1
    candidates = (0,) if placement == "plain" else tuple(gammas)
    best: tuple[float, int, float] | None = None
    for gamma in candidates:
        seconds = cycle_seconds(scenario, placement, gamma, r, misaligned)
        tokens = 1.0 + expected_accepted(scenario.alpha, gamma)
        rate = replicas * scenario.batch * tokens / seconds
        if best is None or rate > best[0]:
            best = (rate, gamma, seconds)
    assert best is not None
    rate, gamma, seconds = best
    large, cheap = devices(scenario, placement, replicas, r)
    dollars = large * scenario.large_price + cheap * scenario.cheap_price
    per_dollar = rate * 3600.0 / dollars if dollars > 0 else math.inf
    return Plan(placement, replicas, ratio if placement == "pool" else None, gamma, seconds, rate, large, cheap,
                dollars, per_dollar)  # fmt: skip


def plan(
    scenario: Scenario,
    replicas: Sequence[int] = DEFAULT_REPLICAS,
    ratios: Sequence[int] = DEFAULT_RATIOS,
    gammas: Sequence[int] = DEFAULT_GAMMAS,
    misaligned: bool = False,
) -> list[Plan]:
    """Every placement at every replica count, the pool at every ratio up to the replica count."""
    plans: list[Plan] = []
    for n in replicas:
        for placement in ("plain", "colocated", "replica"):
            plans.append(evaluate(scenario, placement, n, gammas=gammas, misaligned=misaligned))
        for ratio in ratios:
            if ratio <= n:
                plans.append(evaluate(scenario, "pool", n, ratio, gammas, misaligned))
    return plans


def recommend(plans: Sequence[Plan], replicas: int) -> Plan:
    """The plan with the most tokens per dollar at ``replicas`` (ties: more tokens/s, then fewer cheap devices)."""
    candidates = [p for p in plans if p.replicas == replicas]
    if not candidates:
        raise ValueError(f"no plan for {replicas} replicas")
    return max(candidates, key=lambda p: (p.tokens_per_dollar, p.tokens_per_second, -p.cheap_devices))


def load_scenario(data: Mapping[str, Any]) -> Scenario:
    """A scenario from its JSON form (``bench/scenarios/*.json``): milliseconds, and prices per device-hour::

        {"alpha": [0.8, 0.6], "verify_ms": [[k, b, ms], ...], "draft_large_ms": [[b, ms], ...],
         "draft_cheap_ms": [[b, ms], ...], "hop_ms": 1.6, "batch": 16, "tp": 1,
         "large": {"name": "H100", "price_per_hour": 3.0}, "cheap": {"name": "L4", "price_per_hour": 0.7},
         "notes": "where every figure comes from"}

    A missing or malformed field raises ``ValueError`` naming it."""
    try:
        return Scenario(
            alpha=tuple(float(a) for a in data["alpha"]),
            verify=CostTable({(int(k), int(b)): float(ms) * 1e-3 for k, b, ms in data["verify_ms"]}),
            draft_large=CostTable.from_rows({int(b): float(ms) * 1e-3 for b, ms in data["draft_large_ms"]}),
            draft_cheap=CostTable.from_rows({int(b): float(ms) * 1e-3 for b, ms in data["draft_cheap_ms"]}),
            hop_seconds=float(data["hop_ms"]) * 1e-3,
            batch=int(data["batch"]),
            tp=int(data.get("tp", 1)),
            large_price=float(data["large"]["price_per_hour"]),
            cheap_price=float(data["cheap"]["price_per_hour"]),
            large_name=str(data["large"].get("name", "large")),
            cheap_name=str(data["cheap"].get("name", "cheap")),
            notes=str(data.get("notes", "")),
        )
    except KeyError as exc:
        raise ValueError(f"a capacity scenario needs the field {exc.args[0]!r} (see load_scenario)") from None
    except (TypeError, ValueError) as exc:
        raise ValueError(f"a malformed capacity scenario: {exc}") from None
