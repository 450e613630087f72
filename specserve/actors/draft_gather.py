"""The drafter actor's shared draft forwards: its request loops' chains drafted together, like the engine's.

A batched replica's drafter actor runs one loop per request, each on a Ray thread, each driving its
request's :class:`~specserve.core.draft_side.DraftSide`. Rank 0 verifies the running requests in one
step, so their verdicts arrive together and their loops want their next chains at about the same time.
:class:`DraftGatherer` lets them meet: a loop hands its side over (:meth:`DraftGatherer.propose`) and
waits; the first to arrive leads, waiting until every loop that drafts through the gatherer has
arrived, or ``wait_s`` after its own arrival (a loop still waiting for its verdict joins the next
round), and then drafts everyone's proposal in one call on the compute thread
(:func:`~specserve.core.draft_side.propose_batch`, each side planning with its own last batch size),
where the chains of drafters that share a draft model's KV pool are drafted in shared forwards.

Every drafter sees exactly the calls it would see drafting alone, so gathering changes when a chain is
drafted, never what is drafted. Loops whose sides cannot share forwards (n-gram, none, trees, hidden-state
drafters, overlap mode) keep drafting on their own and never register. Knows nothing of gRPC or Ray.
"""

from __future__ import annotations

import threading
import time
from collections import Counter
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import Any

from specserve.core.draft.drafter import Proposal
from specserve.core.draft_side import DraftSide, propose_batch

Runner = Callable[..., Any]  # the compute thread's run(fn, *args): every torch call goes there


@dataclass
class _Ask:
    side: DraftSide
    batch_size: int
    done: threading.Event = field(default_factory=threading.Event)
    proposal: Proposal | None = None
    error: BaseException | None = None


class DraftGatherer:
    """Gathers the proposals of the loops that joined (:meth:`member`) into rounds of shared drafting."""

    def __init__(self, run: Runner, wait_s: float) -> None:
        if wait_s < 0:
            raise ValueError(f"wait_s must be >= 0, got {wait_s}")
        self._run = run
        self.wait_s = wait_s
        self._cond = threading.Condition()
        self._members = 0
        self._pending: list[_Ask] = []
        self.rounds: Counter[int] = Counter()  # requests drafted together -> rounds

    @contextmanager
    def member(self) -> Iterator[None]:
        """For the duration of a request's loop: its proposals are gathered, and rounds wait for it."""
        with self._cond:
            self._members += 1
        try:
            yield
        finally:
            with self._cond:
                self._members -= 1
                self._cond.notify_all()  # a leader waiting for this loop need not

    def propose(self, side: DraftSide, batch_size: int) -> Proposal:
        """``side``'s next proposal, as ``side.propose(batch_size)`` returns it, drafted in a round with the other
        members' (this thread leads the round when it is the first to arrive)."""
        ask = _Ask(side, batch_size)
        with self._cond:
            self._pending.append(ask)
            self._cond.notify_all()
            if self._pending[0] is not ask:  # another loop leads this round
                while not ask.done.is_set():
                    self._cond.wait()
                return self._result(ask)
            deadline = time.monotonic() + self.wait_s
            while len(self._pending) < self._members and (left := deadline - time.monotonic()) > 0:
                self._cond.wait(timeout=left)
            round_, self._pending = self._pending, []
        try:
            proposals = self._run(propose_batch, [a.side for a in round_], [a.batch_size for a in round_])
            for a, proposal in zip(round_, proposals, strict=True):
                if isinstance(proposal, Exception):
                    a.error = proposal  # that loop's own failure
                else:
                    a.proposal = proposal
        except BaseException as exc:  # every loop of the round fails with its cause
            for a in round_:
                a.error = exc
        with self._cond:
            self.rounds[len(round_)] += 1
            for a in round_:
                a.done.set()
            self._cond.notify_all()
        return self._result(ask)

    def rounds_by_size(self) -> dict[int, int]:
        """Rounds drafted so far, by how many requests each drafted together."""
        with self._cond:
            return dict(self.rounds)

    @staticmethod
    def _result(ask: _Ask) -> Proposal:
        if ask.error is not None:
            raise ask.error
        assert ask.proposal is not None
        return ask.proposal
