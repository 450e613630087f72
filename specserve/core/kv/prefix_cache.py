"""Prefix caching over a KV pool: the keys and values of finished (and running) sequences, reused by later ones.

A :class:`PrefixCache` indexes sequences of one :class:`~specserve.core.kv.pool.KVPool` by the tokens they cache,
per namespace (:class:`~specserve.core.kv.prefix_index.PrefixIndex`). Two kinds of entries:

- **shared** — a running sequence's committed prefix (:meth:`PrefixCache.share`, after each prefill chunk): other
  requests copy from it while it runs; it is never evicted or freed here (its owner frees it, :meth:`withdraw`);
- **retained** — a sequence that ended (:meth:`PrefixCache.retain`): its span now belongs to the cache, trimmed to
  the positions it caches. A retained entry whose tokens another entry extends is dropped (the longer one serves
  every hit it would), so the turns of one conversation keep one entry.

A hit (:meth:`PrefixCache.lookup`) is copied into the new sequence's own span (:meth:`PrefixCache.copy`): the layout
stays one contiguous span per sequence, which a batched step reads as a view, and a reader never depends on an entry
after the copy — so eviction never waits for a reader. Retained entries are evicted least recently used when the pool
needs room (:meth:`PrefixCache.make_room`): a full pool evicts before it refuses.

The cached keys and values of a token sequence do not depend on the request that computed them (only on the tokens
and the model), so a request that copies them continues exactly as one that computed them itself. A hybrid model's
recurrent states are kept only at each sequence's checkpoint (:mod:`specserve.core.kv.pool_states`), so a hit on one
reaches exactly that far, or is no hit.

The engines' side is three calls: :meth:`PrefixCache.admit` (room for a newcomer, keeping the entry it will copy),
:meth:`PrefixCache.adopt` (copy a hit in, and offer what the sequence caches now) and :meth:`PrefixCache.retain` or
:meth:`PrefixCache.withdraw` when it ends. Does not decide when to look up (the engines do: at admission and before
each prefill chunk), nor restore a drafter's state.
"""

from __future__ import annotations

import itertools
from collections.abc import Hashable, Sequence
from dataclasses import dataclass, field
from typing import Protocol

from specserve.core.kv.pool import KVPool
from specserve.core.kv.prefix_index import PrefixIndex


class PoolEdits(Protocol):
    """How the cache changes its pool: the :class:`~specserve.core.kv.pool.KVPool` itself, or rank 0's operations that
    every tensor-parallel rank mirrors first (``specserve.actors``)."""

    def copy(self, source: int, target: int, start: int, stop: int) -> None: ...

    def shrink(self, sequence: int, reserved: int) -> None: ...

    def free(self, sequence: int) -> None: ...


@dataclass
class CacheStats:
    """What a prefix cache did since it was made (counters) and holds now (gauges)."""

    lookups: int = 0  # requests whose prompt was looked up (counted once it is cached)
    hits: int = 0  # of those, the ones that reused at least one position
    hit_tokens: int = 0  # positions copied from the cache instead of computed
    lookup_tokens: int = 0  # cacheable prompt positions of the requests looked up (all but each prompt's last)
    evictions: int = 0  # retained entries evicted for room
    retained_entries: int = 0  # gauge
    retained_tokens: int = 0  # gauge: pool positions held by retained entries

    def as_dict(self) -> dict[str, int]:
        return dict(self.__dict__)


@dataclass
class _Entry:
    namespace: Hashable
    retained: bool  # the cache owns the span (else a running sequence shares it)
    last_used: int = field(default=0)


@dataclass(frozen=True)
class Hit:
    seq_id: int  # the pool sequence holding the cached prefix
    length: int  # positions of it that match


class PrefixCache:
    """Longest-prefix reuse of one pool's sequences (see the module docstring)."""

    def __init__(self, pool: KVPool, edits: PoolEdits | None = None) -> None:
        """``edits``: what copies, trims and frees the pool's sequences (default: the pool itself)."""
        self.pool = pool
        self.edits: PoolEdits = pool if edits is None else edits
        self.index = PrefixIndex()
        self._entries: dict[int, _Entry] = {}  # pool sequence -> entry
        self._clock = itertools.count(1)
        self.stats = CacheStats()

    # -----------------------------------------------------------------------------------------
    # Reuse

    def lookup(self, namespace: Hashable, tokens: Sequence[int], exclude: int | None = None) -> Hit | None:
        """The longest cached prefix of ``tokens`` in ``namespace`` (``exclude``: a sequence not to use, such as the
        asker's own), or ``None``."""
        seq_id, length = self.index.longest(namespace, tokens)
        if seq_id is not None and self.pool.states is not None:  # a hybrid's: as far as its recurrent state is kept
            length = self.pool.states.reusable(seq_id, length)
        if seq_id is None or seq_id == exclude or length == 0:
            return None
        self._entries[seq_id].last_used = next(self._clock)
        return Hit(seq_id, length)

    def copy(self, hit: Hit, seq_id: int, stop: int | None = None) -> int:
        """Copy the hit's positions from ``seq_id``'s cached length up to ``stop`` (default: the whole hit) into
        ``seq_id``'s span; returns the positions copied."""
        start, stop = self.pool.length(seq_id), hit.length if stop is None else min(stop, hit.length)
        if stop <= start:
            return 0
        self.edits.copy(hit.seq_id, seq_id, start, stop)
        self.stats.hit_tokens += stop - start
        return stop - start

    def adopt(self, seq_id: int, namespace: Hashable, committed: Sequence[int], hit: Hit | None = None) -> int:
        """Copy ``hit`` (if any) into ``seq_id``'s span, then offer what the sequence caches now to other requests
        (``committed``: its committed tokens, of which the cached positions hold the first); the positions copied."""
        copied = 0 if hit is None else self.copy(hit, seq_id)
        length = self.pool.length(seq_id)
        if length:
            self.share(seq_id, namespace, committed[:length])
        return copied

    def admit(self, tokens: int, hit: Hit | None) -> tuple[bool, Hit | None]:
        """Make room for a newcomer that reserves ``tokens`` positions and would copy ``hit``: evict other retained
        entries first, the hit's own only when nothing else makes room. Whether the pool can allocate ``tokens``
        now, and the hit still held (``None`` once evicted)."""
        if self.pool.fits(tokens) or self.make_room(tokens, keep=None if hit is None else hit.seq_id):
            return True, hit
        if not self.make_room(tokens):
            return False, hit
        return True, hit if hit is not None and self.holds(hit.seq_id) else None

    def record(self, prompt_tokens: int, reused: int) -> None:
        """One request's prompt is cached: ``reused`` of its ``prompt_tokens`` cacheable positions came from here."""
        self.stats.lookups += 1
        self.stats.lookup_tokens += prompt_tokens
        self.stats.hits += int(reused > 0)

    # -----------------------------------------------------------------------------------------
    # Entries

    def share(self, seq_id: int, namespace: Hashable, tokens: Sequence[int]) -> None:
        """Offer a running sequence's cached prefix (``tokens``: what its first ``pool.length(seq_id)`` positions
        hold) to other requests; again after it grows. Its owner still frees it (:meth:`withdraw` first)."""
        self._check_tokens(seq_id, tokens)
        entry = self._entries.setdefault(seq_id, _Entry(namespace, retained=False))
        assert not entry.retained, f"sequence {seq_id} is retained: the cache owns it"
        entry.last_used = next(self._clock)
        self.index.insert(seq_id, namespace, tokens)

    def withdraw(self, seq_id: int) -> None:
        """Stop offering a running sequence (its owner is about to free it); nothing if it was never shared."""
        entry = self._entries.get(seq_id)
        if entry is not None and not entry.retained:
            del self._entries[seq_id]
            self.index.remove(seq_id)

    def retain(self, seq_id: int, namespace: Hashable, tokens: Sequence[int]) -> None:
        """Take over an ended sequence's span (``tokens``: what its cached positions hold): it becomes a retained entry,
        trimmed to those positions, or is freed at once when it caches nothing or another entry extends it. Retained
        entries its tokens extend are freed."""
        self._check_tokens(seq_id, tokens)
        self.withdraw(seq_id)
        if not tokens:
            self.edits.free(seq_id)
            return
        self.index.insert(seq_id, namespace, tokens)
        self._entries[seq_id] = _Entry(namespace, retained=True, last_used=next(self._clock))
        self.edits.shrink(seq_id, len(tokens))
        self.stats.retained_entries += 1
        self.stats.retained_tokens += len(tokens)
        if self.index.extension_of(seq_id) is not None:
            self._drop(seq_id)
            return
        for shorter in list(self.index.prefixes_of(seq_id)):
            if self._entries[shorter].retained:
                self._drop(shorter)

    def make_room(self, tokens: int, keep: int | None = None) -> bool:
        """Evict retained entries, least recently used first (never ``keep``), until the pool can allocate
        ``tokens``; whether it can. Evicts nothing when evicting every one of them would not make room."""
        evictable = sum(self.pool.reserved(s) for s, e in self._entries.items() if e.retained and s != keep)
        if self.pool.free_tokens + evictable < tokens:
            return False
        while not self.pool.fits(tokens):
            victims = [(e.last_used, s) for s, e in self._entries.items() if e.retained and s != keep]
            if not victims:
                return False
            self._drop(min(victims)[1])
            self.stats.evictions += 1
        return True

    def holds(self, seq_id: int) -> bool:
        """Whether ``seq_id`` is an entry (retained or shared)."""
        return seq_id in self._entries

    def clear(self) -> None:
        """Free every retained entry and forget the shared ones."""
        for seq_id, entry in list(self._entries.items()):
            if entry.retained:
                self._drop(seq_id)
            else:
                self.withdraw(seq_id)

    @property
    def retained_tokens(self) -> int:
        return self.stats.retained_tokens

    def _drop(self, seq_id: int) -> None:
        entry = self._entries.pop(seq_id)
        assert entry.retained
        self.index.remove(seq_id)
        self.stats.retained_entries -= 1
        self.stats.retained_tokens -= self.pool.length(seq_id)
        self.edits.free(seq_id)

    def _check_tokens(self, seq_id: int, tokens: Sequence[int]) -> None:
        if len(tokens) != self.pool.length(seq_id):
            raise ValueError(
                f"sequence {seq_id} caches {self.pool.length(seq_id)} positions, not the {len(tokens)} tokens given"
            )
