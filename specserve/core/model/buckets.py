"""Verify-width buckets: the few block widths a static-shape engine runs its target forwards at.

A verify block of ``k`` tokens (the last committed token and ``k - 1`` draft nodes) is padded up to the
smallest bucket ``>= k`` (:meth:`VerifyBuckets.width`), so the target only ever sees a handful of shapes:
each can be captured once as a CUDA graph (:mod:`specserve.core.static.graphs`), and kernels run at the widths they
like. Padding never changes an output: pad tokens come after every real token of the block, attend only to
themselves, and write their keys and values past the block, where the rollback to the committed text drops
them (:mod:`specserve.core.static.slots`). A block wider than the largest bucket runs at its own width.

Which widths? The ones a measurement of T_verify(k) says are worth having (:func:`choose_buckets`): width k
is a bucket unless some wider width is clearly cheaper, in which case k pads up to it. The defaults below are
those measurements' outcome (BENCHMARKS.md §14): none on a CPU, powers of two on a GPU. The policy reads the same
buckets, so it prices a width at its bucket's cost (``specserve.policies``). Knows nothing of models.
"""

from __future__ import annotations

import bisect
from collections.abc import Mapping
from dataclasses import dataclass

from specserve.core.errors import UserError

MAX_BUCKET = 256
"""The widest bucket accepted: beyond it a block runs at its own width (and a graph per width would not pay)."""


@dataclass(frozen=True)
class VerifyBuckets:
    """Sorted distinct widths ``>= 1``; ``()`` pads nothing (every block runs at its own width)."""

    widths: tuple[int, ...] = ()

    def __post_init__(self) -> None:
        widths = tuple(self.widths)
        if any(not isinstance(w, int) or isinstance(w, bool) or not 1 <= w <= MAX_BUCKET for w in widths):
            raise UserError(f"verify buckets must be integers in 1..{MAX_BUCKET}, got {list(widths)}")
        if list(widths) != sorted(set(widths)):
            raise UserError(f"verify buckets must be strictly increasing, got {list(widths)}")
        object.__setattr__(self, "widths", widths)

    @property
    def largest(self) -> int:
        return self.widths[-1] if self.widths else 0

    def bucket(self, k: int) -> int | None:
        """The smallest bucket ``>= k``; ``None`` when ``k`` is wider than every bucket (it runs unpadded)."""
        if k < 1:
            raise ValueError(f"a verify block holds >= 1 token, got {k}")
        index = bisect.bisect_left(self.widths, k)
        return self.widths[index] if index < len(self.widths) else None

    def width(self, k: int) -> int:
        """The width a block of ``k`` tokens runs at: its bucket, or ``k`` itself past the largest."""
        bucket = self.bucket(k)
        return k if bucket is None else bucket

    def describe(self) -> str:
        return ",".join(str(w) for w in self.widths) if self.widths else "none"

    @classmethod
    def parse(cls, text: str) -> VerifyBuckets:
        """``"1,2,4,8"``, or ``"none"`` for no padding; a message that says what to fix otherwise."""
        text = text.strip()
        if text.lower() in ("none", "off", ""):
            return cls(())
        try:
            widths = tuple(int(part) for part in text.split(","))
        except ValueError:
            raise UserError(f"verify buckets are comma-separated widths like 1,2,4,8 (or none), got {text!r}") from None
        return cls(widths)


NO_BUCKETS = VerifyBuckets(())

CPU_BUCKETS = NO_BUCKETS
"""Default on a CPU: no padding. There a forward's cost grows with its width, one row at a time: measured on the
shipped target at 1 thread, :func:`choose_buckets` keeps every width from 1 to 64, padding 5 to 8 costs 5-6 % and
17 to 24 up to 19 %, and an engine padding to multiples of 4 and 8 ran 0.93-1.02x the unpadded one (BENCHMARKS.md
§14). A CPU gains from the static engine's preallocated cache only."""

GPU_BUCKETS = VerifyBuckets((1, 2, 4, 8, 16, 32, 64, 128))
"""Default on a GPU, where T_verify(k) was found flat up to large k (launch-bound; one H200, the figures in issue 20)
and a block of 6 dearer than one of 5: powers of two, one graph each. ``bench/device_check.sh`` measures T(k) there;
:func:`choose_buckets` on its table gives the buckets that machine should use."""


def default_buckets(device_type: str) -> VerifyBuckets:
    return GPU_BUCKETS if device_type == "cuda" else CPU_BUCKETS


def choose_buckets(costs: Mapping[int, float], tolerance: float = 0.05) -> VerifyBuckets:
    """Buckets from measured T_verify(k) (``costs``: seconds at every width 1 .. K): k is a bucket unless a wider
    width costs less than ``T(k) / (1 + tolerance)``; the widest measured width is always one. A width that is not
    a bucket pads to the next that is, so no block runs at a width dearer than one it could pad to (within the
    tolerance, which keeps measurement noise from padding everything to the widest)."""
    if not costs:
        raise ValueError("choose_buckets needs measured costs")
    widths = sorted(costs)
    if widths != list(range(1, widths[-1] + 1)):
        raise ValueError(f"costs must cover every width 1 .. K, got {widths}")
    if tolerance < 0:
        raise ValueError(f"tolerance must be >= 0, got {tolerance}")
    kept: list[int] = []
    cheapest_wider = float("inf")
    for k in reversed(widths):
        if costs[k] <= cheapest_wider * (1.0 + tolerance):
            kept.append(k)
        cheapest_wider = min(cheapest_wider, costs[k])
    return VerifyBuckets(tuple(sorted(kept)))


def bucketed_costs(costs: Mapping[int, float], buckets: VerifyBuckets) -> dict[int, float]:
    """What each measured width costs once padded: T(bucket(k)) where the bucket was measured, else T(k)."""
    return {k: costs.get(buckets.width(k), t) for k, t in costs.items()}
