"""The draft half of one request's speculation cycle: one object, driven by the engine loop and the drafter actor.

A :class:`DraftSide` owns what one request needs to draft: its drafter, its schedule (how much to
draft each cycle), the hand-off of the target's features to a hidden-state drafter, and the
cycle's observation. Its driver calls two methods per cycle:

1. :meth:`DraftSide.propose` — the schedule's next budget, then the drafter's proposal (a chain or
   a tree: a :data:`~specserve.core.draft.drafter.Proposal`) within the tokens the request may still emit;
2. :meth:`DraftSide.on_verdict` — given the target's :class:`~specserve.core.target.CycleOutcome`
   for that proposal: the schedule observes the cycle, and, unless the request ended, the drafter
   is told what was committed and handed the cycle's features.

The in-process engine (:mod:`specserve.core.engine`) drives it next to a
:class:`~specserve.core.target.TargetVerifier`; the drafter actor (``specserve.actors.drafter``)
drives it across a gRPC stream, and wraps it to draft ahead while the target verifies (overlap
mode). Both make the same drafter calls and random draws in the same order, so a seeded request
emits the same tokens through either. Knows nothing of the target's model, the wire or Ray.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Sequence
from typing import cast

import torch

from specserve.core.draft.drafter import (
    BatchedDrafter,
    ChainBatcher,
    Draft,
    Drafter,
    FeatureDrafter,
    ProbingDrafter,
    Proposal,
    SharesTargetKV,
    check_can_draft,
    propose,
)
from specserve.core.draft.schedule import BatchPlanned, Budget, CycleObservation, PerDrafter, Schedule
from specserve.core.errors import request_failure
from specserve.core.kv.cache import KVCache
from specserve.core.sampling.params import SamplingParams
from specserve.core.target import CycleOutcome


class DraftSide:
    """One request's drafter, schedule and feature hand-off, advanced one cycle at a time.

    ``budget`` is the request's own budget (its γ or tree); ``schedule`` decides each cycle's.
    """

    def __init__(
        self,
        drafter: Drafter,
        schedule: Schedule,
        budget: Budget,
        num_prompt: int,
        max_new_tokens: int,
        device: torch.device | str = "cpu",
        drafter_name: str | None = None,
    ) -> None:
        check_can_draft(drafter, budget.tree, drafter_name)
        if drafter_name is not None and isinstance(schedule, PerDrafter):
            schedule.use_drafter(drafter_name)
        self.drafter = drafter
        self.schedule = schedule
        self.device = torch.device(device)
        self.committed = num_prompt  # length of the committed text (prompt + output)
        self.remaining = max_new_tokens  # tokens the request may still emit
        self.budget = budget  # the last proposal's budget
        self.draft_seconds = 0.0  # time the last proposal took (drafting on the critical path)
        self._since_draft = -1  # cycles since the last one that drafted (-1: none yet)
        self._reader = drafter if isinstance(drafter, FeatureDrafter) else None

    @property
    def feature_layers(self) -> tuple[int, ...]:
        """The target features the drafter reads (EAGLE, Medusa); empty for any other drafter."""
        return tuple(self._reader.feature_layers) if self._reader is not None else ()

    @property
    def reads_features(self) -> bool:
        return self._reader is not None

    def start(
        self,
        prompt_ids: Sequence[int],
        params: SamplingParams,
        generator: torch.Generator,
        target_cache: KVCache | None = None,
    ) -> None:
        """Reset the drafter for this request. ``target_cache``: the request's target KV in this process, which a
        drafter made of the target's own first layers (:class:`~specserve.core.draft.drafter.SharesTargetKV`) reads."""
        self.drafter.start(prompt_ids, params, generator)
        if target_cache is not None and isinstance(self.drafter, SharesTargetKV):
            self.drafter.share_target_cache(target_cache)

    def add_prompt_features(self, features: torch.Tensor | None) -> None:
        """The target's features of the prompt (all but its last token), from the prefill."""
        self.add_features(0, features)

    def add_features(self, start: int, features: torch.Tensor | None) -> None:
        """The target's features of committed positions ``start ..`` (a chunk of a prefill spread over several
        batched steps, or a cycle's from its root on), for a drafter that reads them; others ignore them."""
        if self._reader is not None and features is not None:
            self._reader.add_features(start, features.to(self.device))

    # -----------------------------------------------------------------------------------------
    # One cycle

    def plan(self, batch_size: int = 1) -> Budget:
        """The schedule's budget for the next cycle, whose target forward verifies ``batch_size`` requests."""
        self.budget = self.schedule.next_budget(self.remaining, batch_size)
        return self.budget

    def propose(self, batch_size: int = 1) -> Proposal:
        """The next proposal: the schedule's budget, drafted within the request's remaining tokens."""
        self.plan(batch_size)
        return self.draft()

    def draft(self) -> Proposal:
        """The drafter's proposal for the budget :meth:`plan` chose, timed."""
        start = time.perf_counter()
        proposal = propose(self.drafter, self.budget, self.remaining, self.device)
        self.draft_seconds = time.perf_counter() - start
        return proposal

    @property
    def chain_limit(self) -> int | None:
        """Draft tokens the planned chain may hold (its γ cut to ``remaining - 1``); ``None`` for a tree."""
        if self.budget.tree is not None:
            return None
        return max(0, min(self.budget.gamma, self.remaining - 1))

    def take(self, draft: Draft, seconds: float) -> Proposal:
        """A chain drafted for this side elsewhere (with other requests' chains, in ``seconds`` of drafting time
        charged to this one), checked against the plan as :meth:`draft` checks its own."""
        limit = self.chain_limit
        assert limit is not None, "take() is for planned chains"
        self.draft_seconds = seconds
        return draft.truncate(limit).to(self.device)

    def on_verdict(
        self,
        proposal: Proposal,
        outcome: CycleOutcome,
        *,
        wire_seconds: float = 0.0,
        stopped: bool = False,
        batch_size: int | None = None,
        step_positions: int | None = None,
        step_seconds: float = 0.0,
    ) -> CycleObservation:
        """Record the verdict on ``proposal`` (verified among ``batch_size`` requests, in a forward of
        ``step_positions`` positions — by default the outcome's own — in a batched step of ``step_seconds`` from
        planning to verdicts, 0 for a cycle of its own); unless the request ended (``outcome.finish``,
        or ``stopped`` by a stop string), tell the drafter what was committed and hand it the cycle's features."""
        drafted = proposal.size > 0
        observation = CycleObservation(
            self.budget,
            proposal.size,
            proposal.depth,
            outcome.verdict.num_accepted,
            resumed=drafted and not 0 <= self._since_draft <= 1,
            draft_seconds=self.draft_seconds,
            verify_seconds=outcome.verify_seconds,
            wire_seconds=wire_seconds,
            batch_size=outcome.batch_size if batch_size is None else batch_size,
            step_positions=outcome.step_positions if step_positions is None else step_positions,
            step_seconds=step_seconds,
        )
        self.schedule.observe(observation)
        self._since_draft = 0 if drafted else (self._since_draft + 1 if self._since_draft >= 0 else -1)
        root = self.committed - 1  # the position of the verified block's first token
        self.committed += len(outcome.new_tokens)
        self.remaining -= len(outcome.new_tokens)
        if outcome.finish is None and not stopped:
            self._hand_over(proposal, outcome, root)
        return observation

    def _hand_over(self, proposal: Proposal, outcome: CycleOutcome, root: int) -> None:
        """Tell the drafter the committed tokens; a hidden-state drafter also gets the features from ``root`` on, a
        probing drafter the target's greedy tokens after its probe's nodes."""
        self.drafter.accept(outcome.new_tokens)
        self.add_features(root, outcome.features)
        if proposal.probe is not None and outcome.probe_argmax and isinstance(self.drafter, ProbingDrafter):
            self.drafter.observe_probe(proposal.probe, outcome.probe_argmax)


def choose_chains(
    plans: Sequence[int],
    caps: Sequence[int],
    expected: Sequence[Callable[[int], float]],
    draft_seconds: Sequence[Callable[[int], float]],
    step_seconds: Callable[[int], float],
    batch_size: int,
    min_width: int = 1,
    allowed: Sequence[Callable[[int], int]] | None = None,
) -> list[int]:
    """The chain each flexible request drafts in a batched step, chosen for the step's expected committed tokens
    per second.

    ``plans[i]``: the chain request i's schedule planned (0 = plain decoding), ``caps[i]`` the longest it may draft;
    ``expected[i](g)`` and ``draft_seconds[i](g)``: what a chain of g commits and costs it; ``step_seconds(n)``: a
    step computing n positions. The step has ``batch_size`` rows; the others' blocks (fixed chains, trees) need
    ``min_width`` and count one token each, whatever the width. Every row is padded to the step's width W (draft
    tokens + 1), so W is the batch's decision. For each W from ``min_width`` to the widest plan + 1:

    * **cut** — request i drafts min(plan_i, W − 1); its schedule already weighed what drafting its plan costs;
    * **fill** — its row costs W positions either way, so a request that planned less (plain decoding included)
      drafts up to min(cap_i, W − 1) when the tokens that adds pay for the drafting it adds, at the rate the step
      makes with its drafting counted;

    each chain then cut to the longest its schedule allows (``allowed[i](g)`` <= g: a measured ceiling vetoes
    depths one by one, so a chain cut or filled to a vetoed depth drafts less, and is rated at what it drafts);
    and W is rated (others + Σ E_i(g_i)) / (T_step(batch_size · W) + the fills' drafting). The best W wins, ties to
    the narrower.
    """
    tables: list[dict[int, tuple[float, float]]] = [{} for _ in plans]

    def value(i: int, gamma: int) -> tuple[float, float]:  # (E[tokens], draft seconds), asked once per chain length
        if gamma not in tables[i]:
            tables[i][gamma] = (expected[i](gamma), draft_seconds[i](gamma) if gamma else 0.0)
        return tables[i][gamma]

    def allow(i: int, gamma: int) -> int:
        return gamma if allowed is None or gamma == 0 else allowed[i](gamma)

    others = batch_size - len(plans)
    best_chains, best_rate = [allow(i, min(plan, min_width - 1)) for i, plan in enumerate(plans)], -1.0
    for width in range(min_width, max([min_width - 1, *plans]) + 2):
        chains = [allow(i, min(plan, width - 1)) for i, plan in enumerate(plans)]
        tokens = others + sum(value(i, g)[0] for i, g in enumerate(chains))
        step = step_seconds(batch_size * width)
        drafting = sum(value(i, g)[1] for i, g in enumerate(chains))
        filled = 0.0
        for i, cap in enumerate(caps):
            fill = allow(i, min(max(cap, plans[i]), width - 1))
            if fill <= chains[i]:
                continue
            gain = value(i, fill)[0] - value(i, chains[i])[0]
            cost = value(i, fill)[1] - value(i, chains[i])[1]
            if gain * (step + drafting) > tokens * cost:  # more tokens per second of drafting than the step makes
                chains[i], tokens, drafting, filled = fill, tokens + gain, drafting + cost, filled + cost
        rate = tokens / max(step + filled, 1e-9)
        if rate > best_rate * (1 + 1e-9):
            best_chains, best_rate = chains, rate
    return best_chains


def _fit_to_width(sides: Sequence[DraftSide]) -> None:
    """Cut or lengthen the planned chains of goodput-aware schedules to the width that pays best for the whole
    step (:func:`choose_chains`), each width rated with every chain at the longest its schedule allows there."""
    flexible: list[tuple[DraftSide, BatchPlanned]] = [
        (side, side.schedule)
        for side in sides
        if side.chain_limit is not None and isinstance(side.schedule, BatchPlanned) and side.schedule.aligns_in_batch
    ]
    if not flexible:
        return
    chosen = {id(side) for side, _ in flexible}
    others = [side for side in sides if id(side) not in chosen]
    min_width = 1 + max(
        [0, *(side.chain_limit if side.chain_limit is not None else side.budget.nodes for side in others)]
    )
    plans = [side.chain_limit or 0 for side, _ in flexible]
    caps = [max(0, min(schedule.max_chain, side.remaining - 1)) for side, schedule in flexible]
    if not any(plans) and not any(caps):
        return  # nobody drafts and nobody may: every width is plain decoding's
    chains = choose_chains(
        plans,
        caps,
        [schedule.expected_tokens for _, schedule in flexible],
        [schedule.draft_seconds for _, schedule in flexible],
        flexible[0][1].step_seconds,
        len(sides),
        min_width,
        [schedule.allowed_chain for _, schedule in flexible],
    )
    for (side, _), plan, chain in zip(flexible, plans, chains, strict=True):
        if chain != plan:
            side.budget = Budget(chain)


def propose_batch(sides: Sequence[DraftSide], batch_sizes: Sequence[int] | None = None) -> list[Proposal | Exception]:
    """Every side's next proposal for one batched step of ``len(sides)`` requests.

    Each schedule first plans its budget knowing the batch size; the chains of schedules that allow it
    (:class:`~specserve.core.draft.schedule.BatchPlanned`: the goodput-aware adaptive policy; a fixed γ stays fixed) are
    cut or lengthened to the step width that pays best for the whole batch (:func:`choose_chains`); then the
    chains of drafters that share a :class:`~specserve.core.draft.drafter.ChainBatcher` (a draft model over one KV pool)
    are drafted together, each request charged an equal share of the group's time, and every other proposal (trees,
    n-gram, none) is drafted on its own. Every request's drafter sees the calls it would see alone, so the proposals
    are the same.

    A side whose own planning or drafting raises gets its error in its place
    (:func:`~specserve.core.errors.request_failure`), and the others their proposals; only a shared forward's failure
    (a draft model's, for its whole group) raises.

    ``batch_sizes``, when given, is each side's own batch size (the distributed drafter's requests, drafted
    together but verified in steps rank 0 forms, each plan with the size of its request's last step): each side
    plans as its :meth:`DraftSide.propose` would, and no width is chosen for them together.
    """
    batch = len(sides)
    if batch_sizes is not None and len(batch_sizes) != batch:
        raise ValueError(f"{len(batch_sizes)} batch sizes for {batch} draft sides")
    proposals: list[Proposal | Exception | None] = [None] * batch
    for i, (side, size) in enumerate(zip(sides, batch_sizes or [batch] * batch, strict=True)):
        try:
            side.plan(size)
        except Exception as exc:
            proposals[i] = request_failure(exc, "drafting")
    planned = [side for side, p in zip(sides, proposals, strict=True) if p is None]
    if len(planned) > 1 and batch_sizes is None:
        _fit_to_width(planned)
    groups: dict[int, tuple[ChainBatcher, list[int]]] = {}
    for i, side in enumerate(sides):
        if proposals[i] is not None:
            continue
        limit = side.chain_limit
        if limit and isinstance(side.drafter, BatchedDrafter):
            groups.setdefault(id(side.drafter.batcher), (side.drafter.batcher, []))[1].append(i)
        else:
            try:
                proposals[i] = side.draft()
            except Exception as exc:
                proposals[i] = request_failure(exc, "drafting")
    for batcher, members in groups.values():
        drafters = [sides[i].drafter for i in members]
        limits = [sides[i].chain_limit or 0 for i in members]
        start = time.perf_counter()
        drafts = batcher.propose_chains(drafters, limits)  # one forward per round for the group: its failure is theirs
        seconds = time.perf_counter() - start
        own = list(getattr(batcher, "catch_up_seconds", None) or [0.0] * len(members))  # long catch-ups, by drafter
        share = max(0.0, seconds - sum(own)) / len(members)  # the shared rounds, split evenly
        for i, draft, alone in zip(members, drafts, own, strict=True):
            try:
                proposals[i] = sides[i].take(draft, share + alone)
            except Exception as exc:
                proposals[i] = request_failure(exc, "drafting")
    assert all(p is not None for p in proposals)
    return cast(list[Proposal | Exception], proposals)
