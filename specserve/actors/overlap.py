"""Overlap mode: a :class:`~specserve.core.draft_side.DraftSide` that drafts the next chain while the target verifies.

Once a chain is sent, the drafter does not wait idle: :meth:`OverlapDraftSide.draft_ahead`
assumes the most likely verdict — every draft token accepted — and drafts one token past the
chain's end (its guess at the bonus token) and the next chain after that. If the verdict accepts
everything and its bonus token equals the guess, the next chain is ready at once
(:meth:`~OverlapDraftSide.propose` returns it without drafting); otherwise the drafter rewinds to
the committed text and is told the real verdict, as without overlap.

A draft is only ever a proposal and every proposal is still verified by the exact rules, so
exactness is unaffected; only the drafter's random stream (and so the sampled text for a given
seed) differs from a run without overlap. Trees are not drafted ahead (each is drafted after the
previous verdict), nor is anything for a drafter that reads the target's hidden states, which
needs the verdict's features before it can draft again. Used by the drafter actor, whose
proposals travel to another process; the in-process engine has nothing to overlap with.
"""

from __future__ import annotations

import time

from specserve.core.draft.drafter import Draft, Proposal
from specserve.core.draft_side import DraftSide
from specserve.core.target import CycleOutcome


class OverlapDraftSide(DraftSide):
    """A request's draft side that drafts ahead on the assumed verdict (all accepted) while the target verifies."""

    _ahead: Draft | None = None  # drafted past the sent chain: [bonus guess, next chain...]
    _ready: Draft | None = None  # the next chain, when the guess was right
    used_ready = False  # the last proposal was drafted during the previous verification

    def propose(self, batch_size: int = 1) -> Proposal:
        ready, self._ready = self._ready, None
        self.used_ready = ready is not None
        if ready is None:
            return super().propose(batch_size)
        self.draft_seconds = 0.0  # drafted while the target verified: nothing on the critical path
        return ready  # drafted with the budget of that time (self.budget is unchanged)

    def draft_ahead(self, proposal: Proposal) -> float:
        """Once ``proposal`` is sent: tell the drafter it was all accepted, and draft the bonus guess and the next
        chain. Returns the seconds this took (time the target's verification hid)."""
        self._ahead = None
        if self.reads_features or self.budget.tree is not None or self.remaining - proposal.size - 1 <= 0:
            return 0.0
        start = time.perf_counter()
        self.drafter.accept(proposal.tokens.tolist())
        self._ahead = self.drafter.propose(self.budget.gamma + 1)
        return time.perf_counter() - start

    def _hand_over(self, proposal: Proposal, outcome: CycleOutcome, root: int) -> None:
        ahead, self._ahead = self._ahead, None
        if ahead is None:
            super()._hand_over(proposal, outcome, root)
            return
        # The drafter's context holds the proposal as if all of it were accepted.
        verdict = outcome.verdict
        if verdict.num_accepted == proposal.size and ahead.gamma > 0 and int(ahead.tokens[0]) == verdict.next_token:
            self.drafter.accept(outcome.new_tokens[-1:])  # the assumed verdict: only the bonus token is new
            self._ready = _trim(ahead, 1, min(self.budget.gamma, self.remaining - 1))
        else:
            self.drafter.rewind(root + 1)  # back to the text committed before this cycle
            self.drafter.accept(outcome.new_tokens)


def _trim(draft: Draft, start: int, budget: int) -> Draft | None:
    """``draft`` without its first ``start`` tokens, at most ``budget`` long (``None`` when nothing is left)."""
    if budget <= 0:
        return None
    tokens = draft.tokens[start : start + budget]
    if tokens.numel() == 0:
        return None
    probs = draft.draft_probs[start : start + budget] if draft.draft_probs is not None else None
    return Draft(tokens, probs)
