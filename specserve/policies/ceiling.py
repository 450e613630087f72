"""The measured ceiling: how deep a draft may be on this replica, from what its drafting cycles measured, per batch.

A model-based policy (:mod:`specserve.policies.policies`) rates every γ from its estimates of acceptance per depth and
of the costs, and a model can be wrong in the long drafts first: acceptance that is not independent across depths (an
n-gram match either continues or breaks), a verify cost the fit does not see, a replica prior learned on easier text.
Measured on the shipped pair: the n-gram drafter under the adaptive policy drafted 9-16 tokens a cycle on held-out code
and committed 1.5 of them in 2-2.6 plain steps (0.7x plain decoding), where a fixed γ 3 ran 1.33x plain.

:class:`ReplicaCeiling` measures drafting by the depth of the drafts, in bands (:data:`BANDS`: 1, 2, 3-4, 5-8, 9+
tokens), each with its measured speedup — committed tokens over the cycle's time in plain steps at its batch size
(:class:`RatioWindow`), pooled over the replica's requests — and **vetoes** the bands that lose, each on its own: a
draft whose band is closed is cut to the deepest open band below it, or to plain decoding when none is open. Closing
every band is the fallback to plain decoding. Bands are judged apart because the policy chooses the depth from what
it expects: it drafts short where it expects little, so a short band's cycles come from the hard contexts (the
suffix drafter's one-token drafts measured 0.86x plain on held-out code while its drafts of 3-4 tokens measured 2.3x);
an earlier contiguous ceiling, closing every band above a losing one, held that drafter to plain decoding (0.61x the
best fixed γ). (Before it, a per-request "payoff guard", judged on 8 drafting cycles of one request, fell back falsely
where drafting paid: n-gram cycles swing between 1 and 5 tokens; the replica's cycles are more evidence.)

* **Closing** — once a band has :attr:`CeilingSettings.min_cycles` cycles measured, it is closed when it is slower
  than what is open below it *with confidence*: its speedup plus :attr:`CeilingSettings.confidence` standard errors
  is below ``(1 − margin)`` times the best measured open band below it, or plain decoding's 1.0 if that is better.
  The open bands are also closed all at once when their drafting cycles *together* are confidently slower than plain
  decoding while no band has enough cycles to be judged alone: a drafter that drafts rarely and at any depth (n-gram
  lookup on high-entropy text) gives no band enough cycles of its own.
* **Trying again** — a closed band is opened again for a trial, its window cleared, once the replica has run
  ``backoff`` steps at that batch size (a step of B requests counts once) since the last closing or trial: one trial
  at a time, the least recently tried band first, then the shortest. Judged after
  :attr:`CeilingSettings.trial_cycles` cycles, it stays open when it measures at least what is open below it (its
  back-off resets), and is closed again with the back-off doubled, up to :attr:`CeilingSettings.max_backoff`, when
  not. A trial that sees too few drafts that deep within ``first_backoff`` steps (the policy did not want them) is
  given up, nothing learned, its back-off doubled as well. So text that becomes predictable again gets its drafts back.
* **Per batch size** — a wider step costs more per position than a narrow one, so each batch size bucket (1, 2-3,
  4-7, 8-15, 16+) keeps its own bands. In a batched step every row is padded to the widest block, so every row —
  a plain one too — is measured in the band of the step's width (:func:`charged_depth`): the band's speedup is the
  step's. And every row is charged the step's whole time, not its share of the drafting: it waited for every row's
  drafts, the forward and the verdicts, and is compared with a whole plain step at the same batch size
  (:meth:`~specserve.policies.step_costs.StepCostEstimator.t_plain_step`). Charged a share (and compared with the
  forward of a plain step), EAGLE-3 at 16 requests measured 1.3-1.7x plain decoding while its drafting steps made
  0.8-0.9x the tokens per second of plain ones, and the policy drafted on (0.73x the replica without drafts).

**Its bound.** Against the best set of open bands in hindsight it loses only in trials: ``trial_cycles`` cycles of
one band at a time, at most one trial per back-off, the back-off doubling to ``max_backoff`` steps. A trial cycle
takes at most ``c`` plain steps and makes tokens at ``s`` of the rate it would have had, so once the back-offs have
reached their cap the ceiling keeps at least ``1 − T c (1 − s) / (max_backoff + T c)`` of the best rate (T =
``trial_cycles``; :meth:`CeilingSettings.rate_floor`: 0.994 at c = 3, s = 0.5 with the defaults); before it, the
doubling back-offs add ``log2(max_backoff / first_backoff)`` = 4 trials of each closed band, and closing a band takes
``min_cycles`` cycles: a bounded loss once, not a share.

It only ever shortens drafts: whatever it decides, every verdict is the verifier's and the output stays exact. Pure
bookkeeping: no clock (the caller passes seconds), no randomness; thread-safe (a replica's requests share one). Not
here: the choice of γ under the ceiling (the policy), the controller's glue; :class:`ReplicaCeilings` keeps one
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

CLOSED, FELL_BACK, TRIAL, REOPENED, RETURNED = "closed", "fell back", "trial", "reopened", "returned"
"""How the ceiling's events begin (``"closed: drafts of 2 tokens measured ..."``): a band closed; a closing that left
no band open (``fell back`` to plain decoding); a trial begun or given up; a trial that paid (``returned`` when no
other band was open: back from plain decoding)."""


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


def charged_depth(obs: CycleObservation) -> int:
    """The depth a cycle is measured at: its draft's, or in a batched step the step's width less one when wider. Every
    row of a step is padded to its widest block, so a row that drafted less (or nothing) paid for that width too: the
    rows' tokens over their time, plain rows included, are the step's speedup, and charging only the drafting rows
    would miss what drafting cost the others (measured at 16 requests on the shipped pair: 2,081 of 4,564 cycles drafted
    one token and 2,382 none, in steps 2 positions a row wide, and the adaptive policy ran 0.87x plain decoding)."""
    if obs.batch_size <= 1 or not obs.step_positions:
        return obs.depth if obs.drafted else 0
    return max(obs.depth if obs.drafted else 0, obs.step_positions // obs.batch_size - 1)


def bucket_of(batch_size: int) -> int:
    """The batch size bucket (an index in :data:`BATCH_BUCKETS`) of a step of ``batch_size`` requests."""
    return max(i for i, start in enumerate(BATCH_BUCKETS) if batch_size >= start)


@dataclass
class _Band:
    window: RatioWindow
    backoff: int
    open: bool = True
    trial: bool = False
    trial_since: float = 0.0  # the level's clock when its trial began
    tried_at: float = -1.0  # ... when its last trial ended (-1: never tried)


@dataclass
class _Level:
    """One batch size bucket's bands, each open or closed on its own."""

    bands: list[_Band]
    pooled: RatioWindow  # every open band's drafting cycles together
    clock: float = 0.0  # steps of the replica at this batch size
    quiet_since: float = 0.0  # the clock at the last closing or trial's end: closed bands wait their back-off from it
    events: list[str] = field(default_factory=list)

    def top(self) -> int | None:
        """The deepest draft allowed (None: any depth; 0: plain decoding)."""
        deepest = max((i for i, band in enumerate(self.bands) if band.open), default=None)
        return 0 if deepest is None else BANDS[deepest][1]


class ReplicaCeiling:
    """One replica's measured ceilings (see the module docstring). The controller asks :meth:`allowed` before each
    decision and reports every verdict to :meth:`observe`."""

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

    def allowed(self, depth: int, batch_size: int = 1) -> int:
        """The deepest draft of at most ``depth`` tokens that a request in a step of ``batch_size`` may make now:
        ``depth`` when its band is open, else the last depth of the deepest open band below it, else 0 (plain
        decoding). Opens a closed band for a trial when its back-off has run out."""
        level = self._levels[bucket_of(batch_size)]
        with self._lock:
            self._start_trial(level)
            if depth < 1:
                return 0
            index = band_of(depth)
            if level.bands[index].open:
                return depth
            below = max((i for i in range(index) if level.bands[i].open), default=None)
            last = BANDS[below][1] if below is not None else 0
            assert last is not None  # only the deepest band is unbounded
            return last

    def vetoed(self, max_depth: int, batch_size: int = 1) -> frozenset[int]:
        """The draft depths 1 .. ``max_depth`` whose band is closed at ``batch_size``'s bucket now: what a policy
        should not choose (a draft of such a depth would be cut below it). Opens a band for a trial as
        :meth:`allowed` does."""
        level = self._levels[bucket_of(batch_size)]
        with self._lock:
            self._start_trial(level)
            return frozenset(d for d in range(1, max_depth + 1) if not level.bands[band_of(d)].open)

    def cap(self, batch_size: int = 1) -> int | None:
        """The deepest draft a request in a step of ``batch_size`` may make at all (0: plain decoding; None: no cap).
        Bands below it may be closed: :meth:`allowed` says what a draft of a given depth becomes."""
        level = self._levels[bucket_of(batch_size)]
        with self._lock:
            self._start_trial(level)
            return level.top()

    def open_bands(self, batch_size: int = 1) -> list[str]:
        """The names of the bands open at ``batch_size``'s bucket (:func:`band_name`), shortest first."""
        level = self._levels[bucket_of(batch_size)]
        with self._lock:
            return [band_name(i) for i, band in enumerate(level.bands) if band.open]

    def observe(self, obs: CycleObservation, plain_seconds: float) -> None:
        """A verdict, and what a plain step at its batch size costs (seconds per token of plain decoding): a
        batched row is charged its whole step (:attr:`CycleObservation.cycle_seconds`), so ``plain_seconds`` is then
        a whole plain step's, measured alike."""
        batch_size = max(1, obs.batch_size)
        level = self._levels[bucket_of(batch_size)]
        seconds = obs.cycle_seconds
        with self._lock:
            level.clock += 1.0 / batch_size
            depth = charged_depth(obs)
            if depth < 1 or not seconds > 0 or not plain_seconds > 0:
                return
            index = band_of(depth)
            band = level.bands[index]
            if not band.open:  # a budget decided before the band closed: not judged
                return
            band.window.add(float(obs.accepted + 1), seconds / plain_seconds)
            level.pooled.add(float(obs.accepted + 1), seconds / plain_seconds)
            if not band.trial and self._nothing_pays(level):
                pooled = level.pooled.ratio
                why = f"together measured {pooled:.2f}x plain decoding"
                for i, each in enumerate(level.bands):
                    if each.open:
                        self._close(level, i, why, announce=False)
                level.events.append(f"{FELL_BACK}: drafts of every depth open {why}, each too rare to judge alone")
                return
            if band.window.count < (self.settings.trial_cycles if band.trial else self.settings.min_cycles):
                return
            speedup = band.window.ratio
            assert speedup is not None
            reference = max([1.0, *(r for r in self._judged(level, 0, index) if r is not None)])
            if band.trial:
                if speedup >= reference:
                    returned = not any(b.open for i, b in enumerate(level.bands) if i != index)
                    band.trial, band.backoff, band.tried_at = False, self.settings.first_backoff, level.clock
                    level.quiet_since = level.clock  # the next trial waits its back-off from now
                    level.pooled.reset()
                    level.events.append(
                        f"{RETURNED if returned else REOPENED}: drafts of {_describe(index)} measured {speedup:.2f}x "
                        f"plain decoding on trial, against {reference:.2f}x"
                    )
                else:
                    band.backoff = min(2 * band.backoff, self.settings.max_backoff)
                    self._close(
                        level, index, f"measured {speedup:.2f}x plain decoding on trial, against {reference:.2f}x"
                    )
            elif speedup + self.settings.confidence * band.window.standard_error() < reference * (
                1.0 - self.settings.margin
            ):
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

    def take_events(self, batch_size: int = 1) -> list[str]:
        """The ceiling's moves at ``batch_size``'s bucket since the last call."""
        level = self._levels[bucket_of(batch_size)]
        with self._lock:
            events, level.events = level.events, []
        return events

    def _start_trial(self, level: _Level) -> None:
        """Open a closed band for a trial when its back-off has run out (one at a time: the least recently tried,
        then the shortest); give up a trial that saw too few drafts that deep in a first back-off (the policy did not
        want them: nothing was learned; the band waits twice as long, and the others get their turn)."""
        for index, band in enumerate(level.bands):
            if band.trial:
                waited = level.clock - band.trial_since >= self.settings.first_backoff
                if waited and band.window.count < self.settings.trial_cycles:
                    band.open = band.trial = False
                    band.tried_at = level.quiet_since = level.clock
                    band.backoff = min(2 * band.backoff, self.settings.max_backoff)  # the policy does not want them
                    level.events.append(
                        f"{TRIAL}: drafts of {_describe(index)} too rare on trial; "
                        f"tried again after {band.backoff} steps"
                    )
                return
        due = [
            (band.tried_at, index)
            for index, band in enumerate(level.bands)
            if not band.open and level.clock - level.quiet_since >= band.backoff
        ]
        if not due:
            return
        index = min(due)[1]
        band = level.bands[index]
        band.window.reset()
        band.open = band.trial = True
        band.trial_since = level.clock
        level.events.append(f"{TRIAL}: drafts of {_describe(index)} again")

    def _nothing_pays(self, level: _Level) -> bool:
        """Whether the drafting cycles of every open band together are confidently slower than plain decoding while no
        band has enough of its own to be judged, and none measures plain decoding's rate: the drafts of one depth may
        be too few to judge (an n-gram drafter finds a match now and then, of any length), their pool is not."""
        pooled, settings = level.pooled, self.settings
        open_bands = [b for b in level.bands if b.open]
        if not open_bands or pooled.count < settings.min_cycles or pooled.ratio is None:
            return False
        if any(b.window.count >= settings.min_cycles for b in open_bands):
            return False  # a band that can be judged is judged on its own: shorter drafts may pay
        if pooled.ratio + settings.confidence * pooled.standard_error() >= 1.0 - settings.margin:
            return False
        return not any(r is not None and r >= 1.0 for r in self._judged(level, 0, len(BANDS)))

    def _judged(self, level: _Level, start: int, stop: int) -> list[float | None]:
        """The measured speedups of the open bands ``start .. stop - 1`` with enough cycles to be judged (None: too
        few, or closed)."""
        enough = min(self.settings.min_cycles, self.settings.trial_cycles)
        return [b.window.ratio if b.open and b.window.count >= enough else None for b in level.bands[start:stop]]

    def _close(self, level: _Level, index: int, why: str, announce: bool = True) -> None:
        band = level.bands[index]
        if band.trial:
            band.tried_at = level.clock
        band.open = band.trial = False
        level.quiet_since = level.clock
        level.pooled.reset()  # it pools the open bands' cycles: afresh after every move
        if announce:
            plain = not any(b.open for b in level.bands)
            level.events.append(
                f"{FELL_BACK if plain else CLOSED}: drafts of {_describe(index)} {why}; "
                f"tried again after {band.backoff} steps"
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
