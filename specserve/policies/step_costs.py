"""T_step(N): what one batched target step costs, as a function of the positions its forward computes, online.

A batched engine verifies every running request's block in one forward over ``B`` rows padded to the
widest block, so the step computes ``N = B · k_max`` positions and every request in it waits the whole
step (the forward and every request's verdict). :class:`StepCostEstimator` learns T_step(N) from the steps
it is shown — the batched cycles' (``step_positions``, ``verify_seconds``) and, for single requests,
(``drafted + 1``, ``verify_seconds``) — and answers the per-request question a goodput-aware policy asks:
if every one of the ``B`` requests drafted like this one (a block of k), what would the step cost each of
them? That is T_step(B · k) / B (:meth:`StepCostEstimator.per_request_table`): the batch's committed tokens
per second are B · E[tokens | k] / (T_step(B · k) + drafting), so a request maximising E / (T_step(B · k) / B
+ its drafting) maximises the batch's goodput when the requests draft alike — and as the batch grows, a
longer block costs more of the step, so speculation shrinks and switches off where it no longer pays.

The curve: per observed N an exponentially weighted mean over its last :data:`STEP_WINDOW` observations;
between observed N a linear interpolation; past the largest a weighted least-squares line over the
observed N >= 2 (slope clamped at >= 0); below the smallest, and before anything is seen, the prior's
T_verify curve scaled to the nearest observation.

**Whole plain steps.** T_step is the forward's time, what a wider block adds. What a row of a batched step waits is
more: the step's planning, every row's drafting and the verdicts too. The measured ceiling
(:mod:`specserve.policies.ceiling`) charges each row of a step its whole time, and compares it with what a whole
*plain* step — every row one position, nothing drafted — takes at the same batch size, measured alike
(:meth:`StepCostEstimator.observe_plain_step`, :meth:`StepCostEstimator.t_plain_step`): a plain step's overheads
are then on both sides. At a batch size without plain steps measured yet, the nearest one's measurement is scaled
along the T_step curve; before any, T_step itself (overheads on the drafting side only: a draft must pay for them).

Thread-safe (one estimator is shared by a replica's
requests). Does not choose budgets (:mod:`specserve.policies.policies`) or time anything.
"""

from __future__ import annotations

import bisect
import threading

from specserve.policies.prior import DEFAULT_PRIOR, EstimatorPrior, weighted_line

STEP_WINDOW = 32.0
"""Observations at one N that its mean averages over (an exponential window): steps repeat at the same N many
times a second under load, so a short memory follows a change of context length or machine load quickly."""


class StepCostEstimator:
    """T_step(N) for N positions computed by one target forward (batch rows × widest block); see the module."""

    def __init__(self, prior: EstimatorPrior = DEFAULT_PRIOR, window: float = STEP_WINDOW) -> None:
        if not window >= 1:
            raise ValueError(f"window must be >= 1 observation, got {window}")
        self.prior = prior
        self.window = window
        self._lock = threading.Lock()
        self._mean: dict[int, float] = {}
        self._count: dict[int, int] = {}
        self._curve: tuple[list[int], list[float], tuple[float, float] | None] | None = None  # cached fit
        # per_request_table's answers since the last observation: a batched step's requests all ask for the same one
        self._tables: dict[tuple[int, int], tuple[float, ...]] = {}
        self._version = 0  # observations so far
        # whole plain steps by batch size: (mean seconds, weight in steps, at most `window`)
        self._plain: dict[int, tuple[float, float]] = {}

    def observe(self, positions: int, seconds: float) -> None:
        """One step that computed ``positions`` positions in ``seconds``."""
        if positions < 1:
            raise ValueError(f"a step computes >= 1 position, got {positions}")
        with self._lock:
            count = self._count.get(positions, 0) + 1
            mean = self._mean.get(positions, 0.0)
            self._mean[positions] = mean + (seconds - mean) / min(count, self.window)
            self._count[positions] = count
            self._curve = None
            self._tables.clear()
            self._version += 1

    def observe_plain_step(self, batch_size: int, seconds: float, weight: float = 1.0) -> None:
        """A whole plain step of ``batch_size`` rows (planning to verdicts) that took ``seconds``; ``weight``: the
        share of the step this observation stands for (each of a step's rows reports it: 1 / ``batch_size`` each)."""
        if batch_size < 1 or not 0 < weight <= 1:
            raise ValueError(f"need batch_size >= 1 and 0 < weight <= 1, got {batch_size} and {weight}")
        with self._lock:
            mean, total = self._plain.get(batch_size, (0.0, 0.0))
            total = min(total + weight, self.window)
            self._plain[batch_size] = (mean + (seconds - mean) * weight / total, total)

    def t_plain_step(self, batch_size: int) -> float:
        """Predicted seconds of a whole plain step of ``batch_size`` rows: measured at that size, else the nearest
        measured size's scaled along T_step, else T_step(``batch_size``) (see the module docstring)."""
        if batch_size < 1:
            raise ValueError(f"a step has >= 1 row, got {batch_size}")
        with self._lock:
            measured = {size: mean for size, (mean, _) in self._plain.items()}
        if batch_size in measured:
            return measured[batch_size]
        fit = self.t_step(batch_size)
        if not measured:
            return fit
        nearest = min(measured, key=lambda size: (abs(size - batch_size), size))
        return measured[nearest] * fit / self.t_step(nearest)

    @property
    def observed(self) -> dict[int, float]:
        """The measured mean T_step(N) at every N seen so far."""
        with self._lock:
            return dict(self._mean)

    def t_step(self, positions: int) -> float:
        """Predicted seconds of a step computing ``positions`` positions."""
        if positions < 1:
            raise ValueError(f"a step computes >= 1 position, got {positions}")
        with self._lock:
            if self._curve is None:
                self._curve = self._fit()
            xs, ys, line = self._curve
        if not xs:
            return self.prior.t_verify(positions)
        i = bisect.bisect_left(xs, positions)
        if i < len(xs) and xs[i] == positions:
            return ys[i]
        if i == 0:  # below everything seen: the prior's shape, at the level of the smallest observation
            return self.prior.t_verify(positions) * ys[0] / self.prior.t_verify(xs[0])
        if i == len(xs):  # past everything seen: the line, never below the largest observation
            if line is None:
                return ys[-1] * self.prior.t_verify(positions) / self.prior.t_verify(xs[-1])
            return max(ys[-1], line[0] + line[1] * positions)
        x0, x1, y0, y1 = xs[i - 1], xs[i], ys[i - 1], ys[i]
        return y0 + (y1 - y0) * (positions - x0) / (x1 - x0)

    def per_request_table(self, batch_size: int, max_k: int) -> tuple[float, ...]:
        """T_step(batch_size · k) / batch_size for k = 1 .. ``max_k``: one request's share of a step in which
        every one of ``batch_size`` requests verifies a block of k."""
        if batch_size < 1 or max_k < 1:
            raise ValueError(f"batch_size and max_k must be >= 1, got {batch_size} and {max_k}")
        with self._lock:
            table, version = self._tables.get((batch_size, max_k)), self._version
        if table is None:
            table = tuple(self.t_step(batch_size * k) / batch_size for k in range(1, max_k + 1))
            with self._lock:
                if self._version == version:  # no observation came in meanwhile: still current
                    self._tables[(batch_size, max_k)] = table
        return table

    def _fit(self) -> tuple[list[int], list[float], tuple[float, float] | None]:
        xs = sorted(self._mean)
        ys = [self._mean[x] for x in xs]
        line = weighted_line([(x, self._mean[x], float(min(self._count[x], self.window))) for x in xs if x >= 2])
        return xs, ys, line
