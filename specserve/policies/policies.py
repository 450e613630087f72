"""The speculation policies behind :class:`~specserve.policies.base.Policy`, and their registry.

* :class:`FixedPolicy` — the same γ (or tree) every cycle.
* :class:`HeuristicPolicy` — transformers' assisted-generation ``"heuristic"`` schedule, as a baseline:
  +2 after a cycle whose drafts were all accepted, −1 otherwise, never below 1.
* :class:`AdaptivePolicy` — maximises predicted tokens per second (:mod:`specserve.policies.rates`) over
  γ ∈ {0 .. max_gamma} (and optional tree candidates), with hysteresis, and probes while off.

All are pure: a decision is a function of the :class:`~specserve.policies.base.PolicyState` and the
policy's constructor arguments only (no clock, no randomness, no model), so the same code runs live and in
trace replays. Not here: estimating the state (:mod:`specserve.policies.estimators`), clipping a budget to
a request's remaining tokens or to a replica's cap (:mod:`specserve.policies.controller`).
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from typing import Any

from specserve.core.draft.schedule import POLICY_NAMES as REQUEST_POLICY_NAMES
from specserve.core.errors import UserError
from specserve.core.tree.shapes import TreeSpec
from specserve.policies.base import Budget, Policy, PolicyState
from specserve.policies.rates import budget_depth, predicted_rate

# ---------------------------------------------------------------------------------------------------------
# Fixed and heuristic baselines


class FixedPolicy:
    """Always the same budget: ``FixedPolicy(4)`` drafts a chain of 4, ``FixedPolicy(Budget(0, tree))`` a tree."""

    name = "fixed"

    def __init__(self, budget: Budget | int = 4):
        if isinstance(budget, bool) or not isinstance(budget, Budget | int):
            raise UserError(f"fixed policy: budget must be a gamma (int >= 0) or a Budget, got {budget!r}")
        if isinstance(budget, int):
            if budget < 0:
                raise UserError(f"fixed policy: gamma must be >= 0, got {budget}")
            budget = Budget(budget)
        self.budget = budget

    def decide(self, state: PolicyState) -> Budget:
        return self.budget


TRANSFORMERS_START_GAMMA = 20  # transformers' GenerationConfig default num_assistant_tokens


class HeuristicPolicy:
    """transformers' ``num_assistant_tokens_schedule="heuristic"``: start at ``start_gamma``; after a cycle
    whose drafts were all accepted (``last_accepted == last_drafted``, as transformers compares matches with
    the candidates it actually got) draft 2 more, otherwise 1 fewer, never fewer than 1. ``max_gamma``
    optionally bounds the growth (transformers has no bound; the controller's cap applies anyway)."""

    name = "heuristic"

    def __init__(self, start_gamma: int = TRANSFORMERS_START_GAMMA, max_gamma: int | None = None):
        _check_int("heuristic", "start_gamma", start_gamma, minimum=1)
        if max_gamma is not None:
            _check_int("heuristic", "max_gamma", max_gamma, minimum=1)
        self.start_gamma = start_gamma
        self.max_gamma = max_gamma

    def decide(self, state: PolicyState) -> Budget:
        if state.previous is None or state.cycles == 0:
            gamma = self.start_gamma
        elif state.last_accepted >= state.last_drafted:
            gamma = state.previous.gamma + 2
        else:
            gamma = max(1, state.previous.gamma - 1)
        if self.max_gamma is not None:
            gamma = min(gamma, self.max_gamma)
        return Budget(gamma)


# ---------------------------------------------------------------------------------------------------------
# Adaptive


def probe_due(cycles_off: int, interval: int, max_interval: int) -> bool:
    """Whether a probe is due after ``cycles_off`` consecutive off decisions (probes included).

    Probes fire at ``interval``, then after gaps doubling each time (exponential back-off) up to
    ``max_interval``: with interval 16 and cap 128, at 16, 48, 112, 240, 368, 496, ...
    """
    if cycles_off <= 0:
        return False
    due, gap = interval, interval
    while due < cycles_off:
        if gap >= max_interval:
            return (cycles_off - due) % max_interval == 0
        gap = min(2 * gap, max_interval)
        due += gap
    return due == cycles_off


class AdaptivePolicy:
    """Chooses the budget that maximises predicted tokens per second under the current estimates.

    Candidates are chains γ ∈ {0 .. ``max_gamma``} (γ = 0 is plain decoding at 1 / T_verify(1)) and any
    ``trees`` given; rates come from :func:`~specserve.policies.rates.predicted_rate` (``overlap=True``:
    E / max(T_draft, T_verify)).

    * **Hysteresis** — the previous budget is kept unless the best candidate's rate beats it by more than
      a relative margin, so estimate noise does not make γ flap. The margin is ``hysteresis`` right after a
      change and halves every ``hysteresis_half_life`` cycles the decision stands, down to
      ``hysteresis_floor``: a γ chosen on young, noisy estimates is revisited once the estimates have
      matured, instead of being held for good because it happened to fall within 5 % of the best (on a flat
      rate curve that band spans several γ).
    * **Off and probes** — once the policy chooses γ = 0 no acceptance is observed any more, so it stays
      off until a probe is due (:func:`probe_due`: after ``probe_interval`` off cycles, then with doubling
      gaps capped at ``max_probe_interval``), when it drafts ``probe_gamma`` for one cycle to refresh the
      estimates. A probe that got nothing accepted leaves speculation off (the next probe waits longer);
      otherwise the decision after it compares against plain decoding with the full ``hysteresis``. The
      estimators restart their long memory when drafting resumes after a pause
      (:class:`~specserve.policies.acceptance.AcceptanceEstimator`), so a probe after a long pause weighs
      heavily.
    * **Evidence before the off switch** — speculation is not switched off while the acceptance estimate
      at depth 1 rests on fewer than ``min_evidence`` pseudo-counts (the prior's 4 plus the request's own
      cycles): a handful of unlucky cycles, or a pessimistic replica prior, must not switch a request off
      for good. After a probe, speculation comes back on if the drafts' rate under acceptance raised by
      ``optimism`` posterior standard deviations (:meth:`~specserve.policies.base.PolicyState.optimistic`)
      beats plain decoding by the margin. In a batch (``state.batch_size > 1``) the evidence rule holds only
      while that optimistic rate would still beat plain decoding: when the step's cost alone rules drafting
      out, more evidence about the drafts could not change the answer.
    * **Batches (goodput)** — in a batched step ``state.verify_seconds`` is this request's share of the step
      if every request drafted alike (:mod:`specserve.policies.step_costs`), so maximising the request's rate
      maximises the batch's committed tokens per second: γ shrinks as the batch grows and speculation
      switches off where it no longer pays, later for a request whose drafts are accepted more. While off,
      the decision is revisited (against plain decoding, with the full ``hysteresis``) whenever the batch is
      smaller than it was when speculation last was judged not to pay.
    * **Verify buckets** — under a static-shape engine ``state.verify_seconds`` prices every block at its
      bucket, never above a wider bucket's cost (:class:`~specserve.policies.costs.CostEstimator`). A
      chain whose block would run at a bucket dearer than a wider one (``state.dominated_ks``) is no candidate:
      it would pay its own bucket, while a longer chain fills the cheaper one. Plain decoding always stays one.
    * **Vetoed depths** — a depth the replica's measured ceiling has closed (``state.vetoed_depths``,
      :mod:`specserve.policies.ceiling`) is no candidate: a draft that deep would be cut below it, so the policy
      chooses among the open depths and plain decoding instead (a closed one-token band must not turn the contexts
      where a longer draft pays into plain decoding).
    * **Trees** — optional candidates (static topologies or dynamic budgets), rated with the simple tree
      model of :mod:`specserve.policies.rates`; chains are the main case.
    """

    name = "adaptive"
    calibrates_plain = True  # ask the controller for one plain cycle when T_verify(1) was never measured

    def __init__(
        self,
        max_gamma: int = 16,
        hysteresis: float = 0.05,
        hysteresis_half_life: int = 64,
        hysteresis_floor: float = 0.01,
        probe_interval: int = 16,
        max_probe_interval: int = 128,
        probe_gamma: int = 2,
        overlap: bool = False,
        optimism: float = 1.0,
        min_evidence: float = 12.0,
        trees: Sequence[TreeSpec] = (),
    ):
        _check_int("adaptive", "max_gamma", max_gamma, minimum=1)
        _check_int("adaptive", "probe_interval", probe_interval, minimum=1)
        _check_int("adaptive", "max_probe_interval", max_probe_interval, minimum=probe_interval)
        _check_int("adaptive", "probe_gamma", probe_gamma, minimum=1)
        _check_int("adaptive", "hysteresis_half_life", hysteresis_half_life, minimum=1)
        for option, value in (("hysteresis", hysteresis), ("hysteresis_floor", hysteresis_floor)):
            if isinstance(value, bool) or not isinstance(value, int | float) or not 0 <= value < 1:
                raise UserError(f"adaptive policy: {option} must be a number in [0, 1), got {value!r}")
        if hysteresis_floor > hysteresis:
            raise UserError(f"adaptive policy: hysteresis_floor ({hysteresis_floor}) exceeds hysteresis ({hysteresis})")
        if not isinstance(overlap, bool):
            raise UserError(f"adaptive policy: overlap must be true or false, got {overlap!r}")
        if any(not isinstance(t, TreeSpec) for t in trees):
            raise UserError("adaptive policy: trees must be TreeSpec candidates")
        self.max_gamma = max_gamma
        self.hysteresis = float(hysteresis)
        self.hysteresis_half_life = hysteresis_half_life
        self.hysteresis_floor = float(hysteresis_floor)
        self.probe_interval = probe_interval
        self.max_probe_interval = max_probe_interval
        self.probe_gamma = probe_gamma
        self.overlap = overlap
        if isinstance(optimism, bool) or not isinstance(optimism, int | float) or not 0 <= optimism <= 5:
            raise UserError(f"adaptive policy: optimism must be a number in [0, 5], got {optimism!r}")
        self.optimism = float(optimism)
        if isinstance(min_evidence, bool) or not isinstance(min_evidence, int | float) or min_evidence < 0:
            raise UserError(f"adaptive policy: min_evidence must be a number >= 0, got {min_evidence!r}")
        self.min_evidence = float(min_evidence)
        self.candidates: tuple[Budget, ...] = (
            *(Budget(g) for g in range(max_gamma + 1)),
            *(Budget(0, tree) for tree in trees),
        )

    def rates(self, state: PolicyState) -> dict[Budget, float]:
        """Predicted tokens per second of every candidate (chains of a dominated block size and drafts of a depth
        the replica's ceiling vetoes left out; plain decoding always stays)."""
        dominated, vetoed = state.dominated_ks, state.vetoed_depths
        return {
            b: predicted_rate(state, b, self.overlap)
            for b in self.candidates
            if not (dominated and b.tree is None and b.gamma > 0 and b.gamma + 1 in dominated)
            and not (vetoed and b.nodes > 0 and budget_depth(b) in vetoed)
        }

    def margin(self, cycles_since_change: int) -> float:
        """The relative gain a candidate needs over a decision that has stood this many cycles."""
        decayed = self.hysteresis * 2.0 ** (-cycles_since_change / self.hysteresis_half_life)
        return max(self.hysteresis_floor, decayed)

    def _might_pay(self, state: PolicyState, drafting: list[Budget], margin: float) -> bool:
        """Whether drafting could beat plain decoding with acceptance raised by ``optimism`` standard deviations."""
        hopeful = self.rates(state.optimistic(self.optimism))
        return max(hopeful[b] for b in drafting) > hopeful[Budget(0)] * (1.0 + margin)

    def decide_off(
        self, previous: Budget | None, cycles_off: int, batch_size: int, batch_size_off: int
    ) -> Budget | None:
        """Off: a probe when one is due, otherwise plain decoding, unless the batch shrank since speculation was
        judged not to pay (then the rates decide: ``None``). ``None`` too when not off."""
        if cycles_off <= 0 or previous is None or previous.nodes != 0:
            return None
        if probe_due(cycles_off, self.probe_interval, self.max_probe_interval):
            return Budget(self.probe_gamma)
        if 0 < batch_size < batch_size_off:  # a smaller batch: a larger share of a step
            return None
        return Budget(0)

    def decide(self, state: PolicyState) -> Budget:
        previous = state.previous
        off = self.decide_off(previous, state.cycles_off, state.batch_size, state.batch_size_off)
        if off is not None:
            return off
        if state.cycles_off > 0 and previous is not None:
            if previous.nodes == 0:  # off, in a smaller batch than the one it turned off in: drafting may pay now
                rates = self.rates(state)
                best = max(rates, key=lambda b: rates[b])
                if best.nodes > 0 and rates[best] > rates[Budget(0)] * (1.0 + self.hysteresis):
                    return best
                return Budget(0)
            if state.last_accepted == 0:  # a probe that got nothing accepted
                return Budget(0)
            reference: Budget | None = Budget(0)  # after a probe, the standing decision is plain decoding
            margin = self.hysteresis
        else:
            reference = previous
            margin = self.margin(state.cycles_since_change)
        rates = self.rates(state)
        best = max(rates, key=lambda b: rates[b])  # dicts keep order: ties go to the earlier (smaller) candidate
        drafting = [b for b in rates if b.nodes > 0]
        if drafting and reference is not None and reference.nodes == 0:
            # just probed: back on if the drafts might pay — acceptance raised by `optimism` standard deviations
            if self._might_pay(state, drafting, margin):
                return max(drafting, key=lambda b: rates[b])
            return Budget(0)
        if (
            drafting
            and best.nodes == 0
            and state.alpha_weight
            and state.alpha_weight[0] < self.min_evidence
            and (state.batch_size == 1 or self._might_pay(state, drafting, margin))
        ):
            # too little seen of these drafts to give up on them (a few unlucky cycles, a pessimistic prior)
            if reference is not None and reference.nodes > 0 and reference in rates:
                return reference
            return max(drafting, key=lambda b: rates[b])
        if reference is not None and reference in rates and rates[best] <= rates[reference] * (1.0 + margin):
            return reference
        return best


# ---------------------------------------------------------------------------------------------------------
# Registry


def _check_int(policy: str, option: str, value: object, minimum: int) -> None:
    if isinstance(value, bool) or not isinstance(value, int) or value < minimum:
        raise UserError(f"{policy} policy: {option} must be an integer >= {minimum}, got {value!r}")


_FACTORIES: Mapping[str, tuple[Callable[..., Policy], tuple[str, ...]]] = {
    "fixed": (FixedPolicy, ("budget",)),
    "heuristic": (HeuristicPolicy, ("start_gamma", "max_gamma")),
    "adaptive": (
        AdaptivePolicy,
        (
            "max_gamma",
            "hysteresis",
            "hysteresis_half_life",
            "hysteresis_floor",
            "probe_interval",
            "max_probe_interval",
            "probe_gamma",
            "overlap",
            "optimism",
            "min_evidence",
            "trees",
        ),
    ),
}

POLICY_NAMES: tuple[str, ...] = tuple(_FACTORIES)
if tuple(REQUEST_POLICY_NAMES) != POLICY_NAMES:  # the names a request may give (core) must be exactly these
    raise ImportError(
        f"policy registry {POLICY_NAMES} disagrees with specserve.core.draft.schedule {REQUEST_POLICY_NAMES}"
    )


def build_policy(name: str, **options: Any) -> Policy:
    """A policy by name (one of :data:`POLICY_NAMES`); unknown names or options raise :class:`UserError`.

    ``fixed`` also takes ``gamma`` as a synonym of ``budget``.
    """
    if name not in _FACTORIES:
        raise UserError(f"unknown policy {name!r}; choose one of {', '.join(POLICY_NAMES)}")
    factory, allowed = _FACTORIES[name]
    if name == "fixed" and "gamma" in options:
        if "budget" in options:
            raise UserError("fixed policy: give gamma or budget, not both")
        options["budget"] = options.pop("gamma")
    unknown = sorted(set(options) - set(allowed))
    if unknown:
        raise UserError(
            f"{name} policy: unknown option(s) {', '.join(unknown)}; it accepts {', '.join(allowed) or 'none'}"
        )
    return factory(**options)
