"""EAGLE chains for many requests at once: one head forward per drafted position for the whole batch.

An :class:`~specserve.drafters.eagle.EagleDrafter` alone drafts a chain of γ tokens in γ forwards of its one-layer head
(the first catches the head up on the committed positions it has not seen, each later one feeds the token just drafted
with the head's own output as its feature). At 16 requests that is 16 × γ small forwards a step, each costing mostly
its launch. :class:`EagleChains` is the :class:`~specserve.core.draft.drafter.ChainBatcher` every drafter over one head
shares (:meth:`~specserve.drafters.eagle.EagleDrafter.fresh` hands it on): it drafts all their chains in γ forwards of
the batch (:meth:`~specserve.drafters.eagle.HeadSlots.run_rows`, over each request's own slot of the head's keys and
values).

Per request the result is the drafter's own ``propose``, call for call: the same catch-up, the same token choice
(:meth:`~specserve.drafters.tree.TreeModelDrafter.choose_chain_token`: greedy argmax, the keyed-noise token when
drafter-invariant, otherwise a draw from the warped q with the request's own generator, q sent with the chain), the
same cut at the head's positions; a row's logits differ from a one-row forward's only by rounding. A catch-up longer
than :data:`SHORT_CATCH_UP` positions (a newcomer's prompt) runs in a forward of its own rather than widening every
row of the first shared one. Drafts alone, through the drafter's session, when the head runs on captured graphs
(static shapes on a GPU) or when sampled requests share a generator (so it sees its draws in order).

Does not draft trees (each request's drafter does, alone), verify, or decide which requests draft together.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any, Protocol, runtime_checkable

import torch

from specserve.core.draft.drafter import ChainBatcher, Draft, Drafter, check_chain_call

logger = logging.getLogger(__name__)


@runtime_checkable
class HeadDrafter(Protocol):
    """What a batcher needs of an EAGLE drafter (:class:`~specserve.drafters.eagle.EagleDrafter`): its head's slots and
    the request's slot of them, its catch-up, its token choice and its chain."""

    batcher: ChainBatcher
    slots: Any  # HeadSlots: run_rows, graphed

    @property
    def head_cache(self) -> Any: ...  # StaticKVCache | None

    @property
    def sampled(self) -> bool: ...

    @property
    def generator(self) -> torch.Generator | None: ...

    def chain_budget(self, budget: int) -> int: ...

    def unfed(self) -> tuple[torch.Tensor, torch.Tensor]: ...

    def fed(self) -> None: ...

    def drafted(self) -> None: ...

    def choose_chain_token(self, logits: torch.Tensor, index: int, probs: list[torch.Tensor]) -> int: ...

    def chain_draft(self, tokens: Sequence[int], probs: Sequence[torch.Tensor]) -> Draft: ...

    def propose_chain(self, budget: int) -> Draft: ...


SHORT_CATCH_UP = 8  # a catch-up of at most this many positions shares the first drafting round with the others


@dataclass
class _Row:
    """One request's chain while it is drafted."""

    drafter: HeadDrafter
    budget: int
    tokens: list[int] = field(default_factory=list)
    probs: list[torch.Tensor] = field(default_factory=list)
    feed: tuple[torch.Tensor, torch.Tensor] | None = None  # the next forward's tokens [k] and features [k, hidden]

    def choose(self, logits: torch.Tensor, hidden: torch.Tensor) -> None:
        """The next token from the logits after the last fed position; fed next (with ``hidden`` as its feature)
        while the budget lasts. A choice that raises ends the chain with what it has (drafting less stays exact)."""
        try:
            self.tokens.append(self.drafter.choose_chain_token(logits, len(self.tokens), self.probs))
        except Exception:
            logger.warning(
                "drafting one request's EAGLE chain failed; it ends here, the others draft on", exc_info=True
            )
            self.budget = len(self.tokens)
        if len(self.tokens) < self.budget:
            token = torch.tensor([self.tokens[-1]], dtype=torch.long, device=hidden.device)
            self.feed = (token, hidden[None])
        else:
            self.feed = None


class EagleChains:
    """Drafts chains for many :class:`~specserve.drafters.eagle.EagleDrafter` of one head in shared forwards (see the
    module docstring). Not thread-safe."""

    def __init__(self) -> None:
        self.catch_up_seconds: list[float] = []  # per drafter of the last call: its long catch-up's own forward

    def propose_chains(self, drafters: Sequence[Drafter], budgets: Sequence[int]) -> list[Draft]:
        """Per drafter, what its ``propose(budget)`` alone returns (tokens, q, generator draws), in shared forwards."""
        rows = self._check(drafters, budgets)
        self.catch_up_seconds = [0.0] * len(rows)
        sampled = [id(row.drafter.generator) for row in rows if row.budget and row.drafter.sampled]
        graphed = any(row.drafter.slots.graphed for row in rows)
        if graphed or len(set(sampled)) < len(sampled):
            return [row.drafter.propose_chain(row.budget) for row in rows]
        active = [row for row in rows if row.budget > 0]
        for row in active:
            row.feed = row.drafter.unfed()
        try:
            for i, row in enumerate(rows):
                if row.feed is not None and row.feed[0].numel() > SHORT_CATCH_UP:  # alone, but for its last position
                    start = time.perf_counter()
                    tokens, features = row.feed
                    self._forward([row], [(tokens[:-1], features[:-1])])
                    row.feed = (tokens[-1:], features[-1:])
                    self.catch_up_seconds[i] = time.perf_counter() - start
            for row in active:
                row.drafter.fed()
            while active:
                feeds = [row.feed for row in active]
                assert all(feed is not None for feed in feeds)
                logits, hidden = self._forward(active, feeds)  # type: ignore[arg-type]
                for b, row in enumerate(active):
                    row.choose(logits[b], hidden[b])
                active = [row for row in active if row.feed is not None]
        finally:
            for row in rows:
                if row.budget > 0 and row.drafter.head_cache is not None:
                    row.drafter.drafted()
        return [row.drafter.chain_draft(row.tokens, row.probs) for row in rows]

    @staticmethod
    def _forward(
        rows: Sequence[_Row], feeds: Sequence[tuple[torch.Tensor, torch.Tensor]]
    ) -> tuple[torch.Tensor, torch.Tensor]:
        caches = [row.drafter.head_cache for row in rows]
        assert all(cache is not None for cache in caches)
        logits, hidden = rows[0].drafter.slots.run_rows(caches, [t for t, _ in feeds], [f for _, f in feeds])
        return logits, hidden

    def _check(self, drafters: Sequence[Drafter], budgets: Sequence[int]) -> list[_Row]:
        check_chain_call(drafters, budgets)
        rows = []
        for drafter, budget in zip(drafters, budgets, strict=True):
            if not isinstance(drafter, HeadDrafter) or drafter.batcher is not self:
                raise ValueError(f"{drafter!r} is not an EAGLE drafter of this batcher (use the head's fresh())")
            if drafter.head_cache is None:
                raise RuntimeError("call start() before proposing")
            rows.append(_Row(drafter, drafter.chain_budget(budget)))
        return rows
