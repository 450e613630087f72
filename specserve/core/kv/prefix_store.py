"""A drafter's per-position state of token sequences, reused by later requests that share a prefix.

The prefix cache (:mod:`specserve.core.kv.prefix_cache`) keeps the target's keys and values. A drafter whose state
cannot be rebuilt from the text alone — an EAGLE head reads the target's features at every committed position, and
a request served from the cache computes no target forward over its cached prefix — keeps that state here:
:class:`PrefixStore` holds, per token sequence and namespace, one state per position (an EAGLE drafter's fused
features), and hands a newcomer the states of the longest stored prefix of its prompt. Bounded by positions
(``max_positions``), least recently used first out; a sequence another stored one extends is dropped. The states
are shared, never copied or modified: a reader replaces, never edits, what it was given.

Knows nothing of what a state is; does not decide when a drafter stores or reads.
"""

from __future__ import annotations

import itertools
from collections.abc import Hashable, Sequence
from dataclasses import dataclass
from typing import Generic, TypeVar

from specserve.core.kv.prefix_index import PrefixIndex

State = TypeVar("State")


@dataclass
class _Stored(Generic[State]):
    states: list[State]
    last_used: int


class PrefixStore(Generic[State]):
    """Per-position states of token sequences, per namespace, with longest-prefix reads (see the module docstring)."""

    def __init__(self, max_positions: int) -> None:
        if max_positions < 1:
            raise ValueError(f"a prefix store holds at least 1 position, got {max_positions}")
        self.max_positions = max_positions
        self.index = PrefixIndex()
        self._stored: dict[int, _Stored[State]] = {}
        self._ids = itertools.count()
        self._clock = itertools.count(1)
        self.positions = 0  # held now
        self.hit_positions = 0  # handed out so far

    def put(self, namespace: Hashable, tokens: Sequence[int], states: Sequence[State]) -> None:
        """Keep ``states`` of positions ``0 .. len(states) - 1`` of ``tokens`` (at most one per token)."""
        if len(states) > len(tokens):
            raise ValueError(f"{len(states)} states for {len(tokens)} tokens")
        if not states or len(states) > self.max_positions:
            return
        item = next(self._ids)
        self.index.insert(item, namespace, tokens[: len(states)])
        extension = self.index.extension_of(item)
        if extension is not None:  # already held, as part of a longer sequence
            self.index.remove(item)
            self._stored[extension].last_used = next(self._clock)
            return
        for shorter in list(self.index.prefixes_of(item)):
            self._drop(shorter)
        self._stored[item] = _Stored(list(states), next(self._clock))
        self.positions += len(states)
        while self.positions > self.max_positions:
            self._drop(min(self._stored, key=lambda i: self._stored[i].last_used))

    def get(self, namespace: Hashable, tokens: Sequence[int]) -> list[State]:
        """The states of the longest prefix of ``tokens`` held in ``namespace`` (empty when none)."""
        item, length = self.index.longest(namespace, tokens)
        if item is None:
            return []
        stored = self._stored[item]
        stored.last_used = next(self._clock)
        self.hit_positions += length
        return stored.states[:length]

    def peek(self, namespace: Hashable, tokens: Sequence[int]) -> list[State]:
        """What :meth:`get` would hand out, without marking it used or counting it."""
        item, length = self.index.longest(namespace, tokens)
        return [] if item is None else self._stored[item].states[:length]

    def clear(self) -> None:
        for item in list(self._stored):
            self._drop(item)

    def _drop(self, item: int) -> None:
        self.positions -= len(self._stored.pop(item).states)
        self.index.remove(item)
