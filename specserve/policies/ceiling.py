"""The measured ceiling: how deep a draft may be on this replica, from what its drafting cycles measured, per batch.

A model-based policy (:mod:`specserve.policies.policies`) rates every γ from its estimates of acceptance per depth and
of the costs, and a model can be wrong in the long drafts first: acceptance that is not independent across depths (an
n-gram match either continues or breaks), a verify cost the fit does not see, a replica prior learned on easier text.
Measured on the shipped pair: the n-gram drafter under the adaptive policy drafted 9-16 tokens a cycle on held-out code
and committed 1.5 of them in 2-2.6 plain steps (0.7x plain decoding), where a fixed γ 3 ran 1.33x plain.

:class:`ReplicaCeiling` measures drafting by the depth of the drafts, in bands (:data:`BANDS`: 1, 2, 3-4, 5-8, 9+
tokens), each with its measured speedup — committed tokens over the cycle's time in plain steps at its batch size
(:class:`RatioWindow`), pooled over the replica's requests — and keeps a **ceiling**: the bands below it are open, the
ones from it up are closed, and no request drafts past it. A ceiling of 0 is plain decoding: the fallback when no
drafting pays. (An earlier per-request "payoff guard", judged on 8 drafting cycles of one request, fell back falsely
where drafting paid: n-gram cycles swing between 1 and 5 tokens; the replica's cycles are more evidence.)

* **Closing** — once a band has :attr:`CeilingSettings.min_cycles` cycles measured, it is closed (with every band
  above it) when it is slower than what is open below it *with confidence*: its speedup plus
  :attr:`CeilingSettings.confidence` standard errors is below ``(1 − margin)`` times the best measured band below it,
  or plain decoding's 1.0 if that is better — unless a deeper open band measures at least that much. The policy
  drafts short where it expects little (the suffix drafter's one-token drafts measured 0.86x plain on held-out code
  while its drafts of 3-4 tokens measured 2.3x): a short band's cycles come from the hard contexts, and closing it
  would close the deep drafts that pay. Closing the lowest band lowers the ceiling to 0: plain decoding. The ceiling
  also falls to 0 when the drafting cycles of all open bands *together* are confidently slower than plain decoding
  while no band has enough cycles to be judged alone: a drafter that drafts rarely and at any depth (n-gram lookup on
  high-entropy text) gives no band enough cycles of its own.
* **Trying again** — the band just above the ceiling is opened again for a trial after ``backoff`` steps of the
  replica at that batch size (a step of B requests counts once), its window cleared. Judged after
  :attr:`CeilingSettings.trial_cycles` cycles, it stays open when it measures at least what is open below it (its
  back-off resets), and is closed again with the back-off doubled, up to :attr:`CeilingSettings.max_backoff`, when
  not; the band above it then waits its own back-off from that moment, so the ceiling rises one band at a time. So
  text that becomes predictable again gets its long drafts back.
* **Per batch size** — a wider step costs more per position than a narrow one, so each batch size bucket (1, 2-3,
  4-7, 8-15, 16+) keeps its own ceiling.

**Its bound.** Against the best ceiling in hindsight it loses only in trials: ``trial_cycles`` cycles of one band
every back-off, the back-off doubling to ``max_backoff`` steps. A trial cycle takes at most ``c`` plain steps and
makes tokens at ``s`` of the rate below it, so once the back-off has reached its cap the ceiling keeps at least ``1 −
T c (1 − s) / (max_backoff + T c)`` of the best ceiling's rate (T = ``trial_cycles``;
:meth:`CeilingSettings.rate_floor`: 0.994 at c = 3, s = 0.5 with the defaults); before it, the doubling back-offs add
``log2(max_backoff / first_backoff)`` = 4 trials of each closed band, and closing a band takes ``min_cycles``
cycles: a bounded loss once, not a share.

It only ever shortens drafts: whatever it decides, every verdict is the verifier's and the output stays exact. Pure
bookkeeping: no clock (the caller passes seconds), no randomness; thread-safe (a replica's requests share one). Not
here: the choice of γ below the ceiling (the policy), the controller's glue; :class:`ReplicaCeilings` keeps one
ceiling per drafter of a replica.
"""

from __future__ import annotations

import threading
from dataclasses import dataclass, field

from specserve.core.draft.schedule import CycleObservation

BANDS: tuple[tuple[int, int | None], ...] = ((1, 1), (2, 2), (3, 4), (5, 8), (9, None))
"""Bands of drafted depth (first, last; None: unbounded) the ceiling measures and closes, shortest first."""

BATCH_BUCKETS: tuple[int, ...] = (1, 2, 4, 8, 16)
"""Batch sizes from which on a ceiling of its own applies (1, 2-3, 4-7, 8-15, 16 and more)."""

LOWERED, RAISED = "lowered to", "raised to"
"""How the ceiling's moves begin (``"lowered to 0: ..."`` is a fallback to plain decoding, ``"raised to 1: ..."`` a
return from it); a trial's begins with ``"trial:"``."""


class RatioWindow:
    """An exponentially weighted ratio of means, Σx / Σy, over the last observations (half-life ``half_life``), with
    its standard error (the delta method for a ratio, over the weights' effective size (Σw)² / Σw²): tokens over
    time in plain steps, i.e. a measured speedup over plain decoding. One per band of drafted depth."""

    def __init__(self, half_life: float) -> None:
        if not half_life >= 1:
            raise ValueError(f"half_life must be >= 1 observation, got {half_life}")
        self._decay = 0.5 ** (1.0 / half_life)
        self._sums = [0.0] * 7  # w, w², x, y, x², y², xy
        self.count = 0  # observations since the last reset

    def add(self, x: float, y: float) -> None:
        w, w2, sx, sy, sxx, syy, sxy = (v * self._decay for v in self._sums)
        w2 *= self._decay
        self._sums = [w + 1, w2 + 1, sx + x, sy + y, sxx + x * x, syy + y * y, sxy + x * y]
        self.count += 1

    def reset(self) -> None:
        self._sums = [0.0] * 7
        self.count = 0

    @property
    def ratio(self) -> float | None:
        """Σx / Σy over the window (None before any observation)."""
        sx, sy = self._sums[2], self._sums[3]
        if self.count == 0 or sy <= 0:
            return None
        return sx / sy

    def standard_error(self) -> float:
        """The ratio's standard error (0 before two observations)."""
        w, w2, sx, sy, sxx, syy, sxy = self._sums
        if self.count < 2 or sy <= 0:
            return 0.0
        ratio = sx / sy
        mx, my = sx / w, sy / w
        var_x, var_y, cov = sxx / w - mx * mx, syy / w - my * my, sxy / w - mx * my
        spread = max(0.0, var_x - 2 * ratio * cov + ratio * ratio * var_y)
        n_eff = w * w / w2
        return (spread / n_eff) ** 0.5 / my


@dataclass(frozen=True)
class CeilingSettings:
    """How the ceiling measures and when it moves (see the module docstring for the bound they give)."""

    half_life: float = 32.0  # cycles a band's measured speedup averages over (the replica's requests together)
    min_cycles: int = 16  # cycles a band needs measured before it is first judged
    trial_cycles: int = 8  # cycles a trial measures before it is judged
    margin: float = 0.03  # close a band measured below (1 - margin) x what is open below it
    confidence: float = 2.0  # ... by this many standard errors
    first_backoff: int = 128  # replica steps before a closed band is tried again
    max_backoff: int = 2048  # the back-off doubles after each failed trial, up to this

    def __post_init__(self) -> None:
        if not self.half_life >= 1 or self.min_cycles < 1 or self.trial_cycles < 1:
            raise ValueError(
                f"need half_life >= 1, min_cycles >= 1 and trial_cycles >= 1, got {self.half_life}, "
                f"{self.min_cycles}, {self.trial_cycles}"
            )
        if not 0 <= self.margin < 1 or not self.confidence >= 0:
            raise ValueError(f"need 0 <= margin < 1 and confidence >= 0, got {self.margin}, {self.confidence}")
        if not 1 <= self.first_backoff <= self.max_backoff:
            raise ValueError(f"need 1 <= first_backoff <= max_backoff, got {self.first_backoff}, {self.max_backoff}")

    def rate_floor(self, worst_speedup: float, longest_cycle: float) -> float:
        """The long-run share of the best ceiling's rate kept once the back-off has reached its cap: a trial cycle
        takes at most ``longest_cycle`` plain steps and makes tokens at ``worst_speedup`` (< 1) of that rate."""
        if not 0 <= worst_speedup <= 1 or not longest_cycle >= 1:
            raise ValueError(f"need 0 <= worst_speedup <= 1 and longest_cycle >= 1: {worst_speedup}, {longest_cycle}")
        trial = self.trial_cycles * longest_cycle
        return 1.0 - trial * (1.0 - worst_speedup) / (self.max_backoff + trial)


def band_of(depth: int) -> int:
    """The index in :data:`BANDS` of a draft ``depth`` tokens deep (>= 1)."""
    if depth < 1:
        raise ValueError(f"a draft is >= 1 token deep, got {depth}")
    for index, (_, last) in enumerate(BANDS):
        if last is None or depth <= last:
            return index
    raise AssertionError("the last band is unbounded")


def bucket_of(batch_size: int) -> int:
    """The batch size bucket (an index in :data:`BATCH_BUCKETS`) of a step of ``batch_size`` requests."""
    return max(i for i, start in enumerate(BATCH_BUCKETS) if batch_size >= start)


@dataclass
class _Band:
    window: RatioWindow
    backoff: int
    closed_at: float = 0.0  # the level's clock when it was last closed
    trial: bool = False


@dataclass
class _Level:
    """One batch size bucket's ceiling: ``open`` bands from the shortest are open."""

    bands: list[_Band]
    pooled: RatioWindow  # every open band's drafting cycles together
    open: int = len(BANDS)
    clock: float = 0.0  # steps of the replica at this batch size
    events: list[str] = field(default_factory=list)


class ReplicaCeiling:
    """One replica's ceilings (see the module docstring). The controller asks :meth:`cap` before each decision and
    reports every verdict to :meth:`observe`."""

    def __init__(self, settings: CeilingSettings | None = None) -> None:
        self.settings = settings if settings is not None else CeilingSettings()
        self._lock = threading.Lock()
        self._levels = [
            _Level(
                [_Band(RatioWindow(self.settings.half_life), self.settings.first_backoff) for _ in BANDS],
                RatioWindow(self.settings.half_life),
            )
            for _ in BATCH_BUCKETS
        ]

    def cap(self, batch_size: int = 1) -> int | None:
        """The deepest draft a request in a step of ``batch_size`` may make now (0: plain decoding; None: no cap).
        Opens the band above the ceiling for a trial when its back-off has run out."""
        level = self._levels[bucket_of(batch_size)]
        with self._lock:
            below_settled = level.open == 0 or not level.bands[level.open - 1].trial  # one band on trial at a time
            if level.open < len(BANDS) and below_settled:
                band = level.bands[level.open]
                if level.clock - band.closed_at >= band.backoff:
                    band.window.reset()
                    band.trial = True
                    level.open += 1
                    level.events.append(f"trial: drafts of {_describe(level.open - 1)} again")
            return None if level.open == len(BANDS) else (BANDS[level.open - 1][1] if level.open else 0)

    def observe(self, obs: CycleObservation, plain_seconds: float) -> None:
        """A verdict, and what a plain step at its batch size costs (seconds per token of plain decoding)."""
        batch_size = max(1, obs.batch_size)
        level = self._levels[bucket_of(batch_size)]
        seconds = obs.draft_seconds + obs.verify_seconds + obs.wire_seconds
        with self._lock:
            level.clock += 1.0 / batch_size
            if obs.drafted == 0 or obs.depth < 1 or not seconds > 0 or not plain_seconds > 0:
                return
            index = band_of(obs.depth)
            if index >= level.open:  # drafted past the ceiling (a budget decided before it moved): not judged
                return
            band = level.bands[index]
            band.window.add(float(obs.accepted + 1), seconds / plain_seconds)
            level.pooled.add(float(obs.accepted + 1), seconds / plain_seconds)
            if not band.trial and self._nothing_pays(level):
                pooled = level.pooled.ratio
                self._close(level, 0, f"(with every depth drafted: {pooled:.2f}x plain decoding) against 1.00x")
                return
            if band.window.count < (self.settings.trial_cycles if band.trial else self.settings.min_cycles):
                return
            speedup = band.window.ratio
            assert speedup is not None
            reference = max([1.0, *(r for r in self._judged(level, 0, index) if r is not None)])
            if band.trial:
                if speedup >= reference:
                    band.trial, band.backoff = False, self.settings.first_backoff
                    for above in level.bands[index + 1 :]:  # one band up per back-off, not all at once
                        above.closed_at = level.clock
                    level.pooled.reset()
                    top = BANDS[index][1]
                    level.events.append(
                        f"{RAISED} {'any depth' if top is None else top}: drafts of {_describe(index)} "
                        f"measured {speedup:.2f}x plain decoding on trial, against {reference:.2f}x below them"
                    )
                else:
                    band.backoff = min(2 * band.backoff, self.settings.max_backoff)
                    why = f"on trial measured {speedup:.2f}x plain decoding against {reference:.2f}x"
                    self._close(level, index, why)
            elif speedup + self.settings.confidence * band.window.standard_error() < reference * (
                1.0 - self.settings.margin
            ) and not any(r is not None and r >= reference for r in self._judged(level, index + 1, level.open)):
                # (deeper drafts that pay say this band's cycles came from the hard contexts, where the policy chose
                # short drafts: the ceiling stays)
                self._close(level, index, f"measured {speedup:.2f}x plain decoding against {reference:.2f}x")

    def speedups(self, batch_size: int = 1) -> dict[str, float]:
        """What each band measured at ``batch_size``'s bucket (:func:`band_name` -> speedup over plain decoding), for
        the bands with enough cycles to be judged: the speedup the ceiling believes drafts of each depth get."""
        level = self._levels[bucket_of(batch_size)]
        with self._lock:
            return {
                band_name(index): band.window.ratio
                for index, band in enumerate(level.bands)
                if band.window.count >= min(self.settings.min_cycles, self.settings.trial_cycles)
                and band.window.ratio is not None
            }

    def _nothing_pays(self, level: _Level) -> bool:
        """Whether the drafting cycles of every open band together are confidently slower than plain decoding while no
        band has enough of its own to be judged, and none measures plain decoding's rate: the drafts of one depth may
        be too few to judge (an n-gram drafter finds a match now and then, of any length), their pool is not."""
        pooled, settings = level.pooled, self.settings
        if level.open == 0 or pooled.count < settings.min_cycles or pooled.ratio is None:
            return False
        if any(b.window.count >= settings.min_cycles for b in level.bands[: level.open]):
            return False  # a band that can be judged is judged on its own: shorter drafts may pay
        if pooled.ratio + settings.confidence * pooled.standard_error() >= 1.0 - settings.margin:
            return False
        return not any(r is not None and r >= 1.0 for r in self._judged(level, 0, level.open))

    def _judged(self, level: _Level, start: int, stop: int) -> list[float | None]:
        """The measured speedups of bands ``start .. stop - 1`` with enough cycles to be judged (None: too few)."""
        enough = min(self.settings.min_cycles, self.settings.trial_cycles)
        return [b.window.ratio if b.window.count >= enough else None for b in level.bands[start:stop]]

    def take_events(self, batch_size: int = 1) -> list[str]:
        """The ceiling's moves at ``batch_size``'s bucket since the last call."""
        level = self._levels[bucket_of(batch_size)]
        with self._lock:
            events, level.events = level.events, []
        return events

    def _close(self, level: _Level, index: int, why: str) -> None:
        band = level.bands[index]
        band.trial = False
        for closed in level.bands[index:]:  # each waits its own back-off from now
            closed.closed_at = level.clock
        level.open = index
        level.pooled.reset()  # it pools the open bands' cycles: afresh after every move
        cap = BANDS[index - 1][1] if index else 0
        level.events.append(
            f"{LOWERED} {cap}: drafts of {_describe(index)} {why}; tried again after {band.backoff} steps"
        )


def band_name(index: int) -> str:
    """The name of the band at ``index`` in :data:`BANDS`: ``"1"``, ``"2"``, ``"3-4"``, ``"5-8"``, ``"9+"``."""
    first, last = BANDS[index]
    return f"{first}+" if last is None else str(first) if first == last else f"{first}-{last}"


def band_label(depth: int) -> str:
    """The name of the band holding a draft ``depth`` tokens deep."""
    return band_name(band_of(depth))


def _describe(index: int) -> str:
    first, last = BANDS[index]
    if last is None:
        return f"{first} or more tokens"
    if first == last:
        return f"{first} token{'s' if first > 1 else ''}"
    return f"{first}-{last} tokens"


class ReplicaCeilings:
    """One replica's ceilings, one per drafter a request may name (``"default"``: the configured one; the built-ins:
    their drafts cost and pay differently). Thread-safe."""

    def __init__(self, settings: CeilingSettings | None = None) -> None:
        self.settings = settings
        self._lock = threading.Lock()
        self._by_drafter: dict[str, ReplicaCeiling] = {}

    def get(self, drafter: str = "default") -> ReplicaCeiling:
        """Drafter ``drafter``'s ceiling, made on first use."""
        with self._lock:
            if drafter not in self._by_drafter:
                self._by_drafter[drafter] = ReplicaCeiling(self.settings)
            return self._by_drafter[drafter]
