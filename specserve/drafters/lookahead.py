"""Lookahead decoding (Fu et al. 2024): the target's own Jacobi iterations fill an n-gram pool that drafts.

No draft model. Each proposal carries two parts, scored by the target in **one** forward:

* the **draft**: up to ``candidates`` n-grams from the pool whose first token is the last committed
  token (the root), their continuations merged into a trie (a tree budget) or the most recent one
  (a chain). The target verifies it by the exact rules, like any deterministic draft;
* the **probe** (:class:`~specserve.core.draft.drafter.ProbingDrafter`): the lookahead window, ``ngram - 1``
  levels of ``window`` guessed tokens. Level 0 is a chain after the root (a Jacobi guess of the next
  ``window`` tokens); the token of level ``l`` in column ``j`` follows the one of level ``l - 1`` in
  the same column. As a tree: level-0 column ``j``'s parent is column ``j - 1`` (the root for 0), level
  ``l``'s is level ``l - 1`` of its column, so each token sees level 0 up to its column, then its
  column's earlier levels — the attention of the paper's lookahead branch.

The target's greedy token after each probe node comes back with the verdict
(:meth:`LookaheadDrafter.observe_probe`). The last level's tokens are the Jacobi update: column ``j``
of the window then spells the n-gram ``(level 0, ..., level N-2, update)`` of column ``j``, which
goes into the pool; the window drops level 0 and appends the update (before it holds ``ngram - 1``
levels it only grows). Like the reference implementation's option, the pool also holds the n-grams
of the prompt and of the committed output (``pool_from_text``).

Exact at any temperature: the draft is a point mass chosen from the committed text and earlier
cycles' target outputs, never from the current cycle's random draws, and no draft node sees a
probe node, so the verdict is what it would be without the probe. Greedy output equals
``generate``. The probe costs ``window * (ngram - 1)`` extra positions in every verify forward and as
much KV room per request.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Sequence
from dataclasses import dataclass

import torch

from specserve.core.draft.drafter import Draft
from specserve.core.draft.spec_strings import LOOKAHEAD_DEFAULTS, check_lookahead, lookahead_settings
from specserve.core.errors import UserError
from specserve.core.sampling.params import SamplingParams
from specserve.core.tree.draft_tree import DraftTree
from specserve.core.tree.shapes import ROOT, TreeSpec
from specserve.drafters.history import CommittedHistory
from specserve.drafters.ngram import ContinuationTrie


@dataclass(frozen=True)
class LookaheadSettings:
    window: int = LOOKAHEAD_DEFAULTS[0]  # W: guessed positions per level
    ngram: int = LOOKAHEAD_DEFAULTS[1]  # N: n-gram size (the window holds N - 1 levels; drafts are N - 1 tokens)
    candidates: int = LOOKAHEAD_DEFAULTS[2]  # G: pooled n-grams verified per cycle at most
    pool_from_text: bool = True  # also pool the prompt's and the output's n-grams

    def __post_init__(self) -> None:
        check_lookahead(self.window, self.ngram, self.candidates)

    @property
    def probe_nodes(self) -> int:
        return self.window * (self.ngram - 1)


class NgramPool:
    """Continuations of ``length`` tokens keyed by the token before them; per key the ``per_key`` most recently
    added distinct ones, most recent first."""

    def __init__(self, length: int, per_key: int) -> None:
        self.length = length
        self.per_key = per_key
        self._grams: dict[int, OrderedDict[tuple[int, ...], None]] = {}

    def add(self, key: int, continuation: Sequence[int]) -> None:
        gram = tuple(int(t) for t in continuation)
        if len(gram) != self.length:
            raise ValueError(f"a pooled continuation has {self.length} tokens, got {len(gram)}")
        grams = self._grams.setdefault(int(key), OrderedDict())
        grams[gram] = None
        grams.move_to_end(gram, last=False)
        while len(grams) > self.per_key:
            grams.popitem()

    def add_text(self, text: Sequence[int], start: int = 0) -> None:
        """The n-grams of ``text`` that end at position ``start + length`` or later (those not yet added)."""
        for i in range(max(start, 0), len(text) - self.length):
            self.add(text[i], text[i + 1 : i + 1 + self.length])

    def get(self, key: int) -> list[tuple[int, ...]]:
        return list(self._grams.get(int(key), ()))

    def __len__(self) -> int:
        return sum(len(grams) for grams in self._grams.values())


class LookaheadDrafter(CommittedHistory):
    """Lookahead decoding for one request at a time (see the module docstring)."""

    name = "lookahead"

    def __init__(self, settings: LookaheadSettings | None = None, device: torch.device | str = "cpu") -> None:
        self.settings = settings or LookaheadSettings()
        self.probe_nodes = self.settings.probe_nodes
        self._device = device
        self.history: list[int] = []
        self._pooled_upto = 0  # text n-grams pooled: those starting before this position
        self._levels: list[list[int]] = []  # the window: levels[0] oldest, each `window` tokens
        self._pool = NgramPool(self.settings.ngram - 1, 2 * self.settings.candidates)
        self.counters = {"proposals": 0, "pool_hits": 0, "window_ngrams": 0}  # this request's

    @staticmethod
    def from_spec(spec: str, device: torch.device | str = "cpu") -> LookaheadDrafter:
        """The drafter a ``lookahead`` (the defaults) or ``lookahead:W,N,G`` spec names."""
        values = lookahead_settings(spec)
        if values is None:
            raise UserError(f"not a Lookahead spec: {spec!r} (write lookahead or lookahead:W,N,G)")
        return LookaheadDrafter(LookaheadSettings(*values), device)

    # The drafter contract ----------------------------------------------------------------------

    def start(self, prompt_ids: Sequence[int], params: SamplingParams, generator: torch.Generator) -> None:
        super().start(prompt_ids, params, generator)
        self._pooled_upto = 0
        self._levels = []
        self._pool = NgramPool(self.settings.ngram - 1, 2 * self.settings.candidates)
        self.counters = {"proposals": 0, "pool_hits": 0, "window_ngrams": 0}  # this request's
        self._pool_text()

    def accept(self, committed: Sequence[int]) -> None:
        super().accept(committed)
        self._pool_text()

    def rewind(self, length: int) -> None:
        super().rewind(length)
        self._pooled_upto = min(self._pooled_upto, max(length - self.settings.ngram + 1, 0))

    def propose(self, budget: int) -> Draft:
        """The most recent pooled n-gram after the root (cut to ``budget``), with the probe."""
        found = self._candidates()
        tokens = list(found[0][:budget]) if found and budget > 0 else []
        return Draft(torch.tensor(tokens, dtype=torch.long, device=self._device), None, self._probe())

    def propose_tree(self, spec: TreeSpec) -> DraftTree:
        """Up to ``candidates`` pooled n-grams after the root, merged and shaped to ``spec``, with the probe."""
        trie = ContinuationTrie.build(self._candidates())
        if spec.kind == "static":
            assert spec.topology is not None
            nodes = trie.select_topology(spec.topology)
        else:
            assert spec.budget is not None
            nodes = trie.select_budget(spec.budget)
        tokens, parents = trie.subtree(nodes)
        return DraftTree(torch.tensor(tokens, dtype=torch.long, device=self._device), parents, probe=self._probe())

    def observe_probe(self, probe: DraftTree, argmax: Sequence[int]) -> None:
        """One Jacobi step: the last level's next tokens update the window; full columns become pooled n-grams."""
        window, levels = self.settings.window, self._levels
        if len(argmax) != probe.size or probe.size != window * len(levels):
            return  # not the probe this window sent (a draft made before the last verdict): nothing to learn
        update = [int(t) for t in argmax[(len(levels) - 1) * window :]]
        if len(levels) == self.settings.ngram - 1:
            for column in range(window):
                self._pool.add(levels[0][column], [*(level[column] for level in levels[1:]), update[column]])
            self.counters["window_ngrams"] += window
            levels.pop(0)
        levels.append(update)

    def request_counters(self) -> dict[str, int]:
        """Proposals, those whose root had pooled n-grams (``pool_hits``), and the n-grams the window made."""
        return dict(self.counters)

    # Internals ---------------------------------------------------------------------------------

    def _candidates(self) -> list[tuple[int, ...]]:
        self.counters["proposals"] += 1
        found = self._pool.get(self.history[-1])[: self.settings.candidates] if self.history else []
        self.counters["pool_hits"] += bool(found)
        return found

    def _pool_text(self) -> None:
        if self.settings.pool_from_text:
            self._pool.add_text(self.history, self._pooled_upto)
            self._pooled_upto = max(len(self.history) - self._pool.length, 0)

    def _probe(self) -> DraftTree:
        """The window as a tree after the root (level 0 a chain; each later level hangs under its column)."""
        window = self.settings.window
        if not self._levels:  # the first guess: the last `window` committed tokens (any tokens would do)
            guess = self.history[-window:]
            self._levels = [[*([guess[0]] * (window - len(guess))), *guess]]
        tokens: list[int] = []
        parents: list[int] = []
        for level, row in enumerate(self._levels):
            for column, token in enumerate(row):
                tokens.append(token)
                if level == 0:
                    parents.append(column - 1 if column else ROOT)
                else:
                    parents.append((level - 1) * window + column)
        return DraftTree(torch.tensor(tokens, dtype=torch.long, device=self._device), tuple(parents))
