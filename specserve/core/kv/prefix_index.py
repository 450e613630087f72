"""Longest-prefix lookup over token sequences, per namespace: the index behind the prefix cache.

A :class:`PrefixIndex` stores items (integers: the prefix cache's sequence ids), each under one token sequence (its
key) in one namespace, and answers: of the keys in a namespace, which shares the longest prefix with these tokens, and
how long is that prefix. Reuse is token-granular: a hit may end anywhere, not only at a block boundary.

Each namespace keeps its keys in lexicographic order. The key sharing the longest prefix with a query is then one of
the query's two neighbours in that order (every key between a query and a farther key shares at least as much with
the query as the farther key does), so a lookup is one bisection — tuple comparisons, in C — and two prefix
comparisons. A key that is a prefix of another sorts right before its extensions, which is how the cache finds the
entries a longer one makes redundant (:meth:`PrefixIndex.extension_of`, :meth:`PrefixIndex.prefixes_of`).

Knows nothing of KV, pools or eviction: :mod:`specserve.core.kv.prefix_cache` decides what to store and drop.
"""

from __future__ import annotations

import bisect
import itertools
from collections.abc import Hashable, Iterator, Sequence


def common_prefix(a: Sequence[int], b: Sequence[int]) -> int:
    """The length of the longest common prefix of ``a`` and ``b``."""
    n = min(len(a), len(b))
    if a[:n] == b[:n]:
        return n
    lo, hi = 0, n  # a[:lo] == b[:lo], a[:hi] != b[:hi]: bisect on slice equality (C comparisons)
    while hi - lo > 1:
        mid = (lo + hi) // 2
        if a[lo:mid] == b[lo:mid]:
            lo = mid
        else:
            hi = mid
    return lo


class PrefixIndex:
    """Items keyed by token sequences in namespaces, with longest-prefix lookup (see the module docstring)."""

    def __init__(self) -> None:
        self._sorted: dict[Hashable, list[tuple[tuple[int, ...], int]]] = {}  # namespace -> (key, item), in order
        self._keys: dict[int, tuple[Hashable, tuple[int, ...]]] = {}  # item -> (namespace, key)

    def __len__(self) -> int:
        return len(self._keys)

    def __contains__(self, item: int) -> bool:
        return item in self._keys

    def key(self, item: int) -> tuple[int, ...]:
        return self._keys[item][1]

    def insert(self, item: int, namespace: Hashable, tokens: Sequence[int]) -> None:
        """Store ``item`` under ``tokens`` in ``namespace`` (moving it if it was stored before)."""
        self.remove(item)
        key = tuple(tokens)
        bisect.insort(self._sorted.setdefault(namespace, []), (key, item))
        self._keys[item] = (namespace, key)

    def remove(self, item: int) -> None:
        """Forget ``item`` (nothing if it is not stored)."""
        stored = self._keys.pop(item, None)
        if stored is None:
            return
        namespace, key = stored
        keys = self._sorted[namespace]
        del keys[bisect.bisect_left(keys, (key, item))]
        if not keys:
            del self._sorted[namespace]

    def longest(self, namespace: Hashable, tokens: Sequence[int]) -> tuple[int | None, int]:
        """The item whose key shares the longest prefix with ``tokens`` in ``namespace``, and that length (``None``,
        0 when nothing shares a token). Among equally long matches, the one sorted first."""
        keys = self._sorted.get(namespace)
        if not keys:
            return None, 0
        query = tuple(tokens)
        at = bisect.bisect_left(keys, (query,))
        best: tuple[int | None, int] = (None, 0)
        for key, item in keys[max(at - 1, 0) : at + 1]:
            shared = common_prefix(key, query)
            if shared > best[1]:
                best = (item, shared)
        return best

    def extension_of(self, item: int) -> int | None:
        """Another item in ``item``'s namespace whose key starts with ``item``'s whole key (equal keys included)."""
        namespace, key = self._keys[item]
        keys = self._sorted[namespace]
        at = bisect.bisect_left(keys, (key, item))
        for other_key, other in keys[at + 1 : at + 2]:
            if other_key[: len(key)] == key:
                return other
        if at > 0 and keys[at - 1][0] == key:  # an equal key sorted before (a lower item)
            return keys[at - 1][1]
        return None

    def prefixes_of(self, item: int) -> Iterator[int]:
        """The other items in ``item``'s namespace whose keys are prefixes of ``item``'s (equal keys included)."""
        namespace, key = self._keys[item]
        keys = self._sorted[namespace]
        at = bisect.bisect_left(keys, (key, item))
        found = [other for other_key, other in keys[at + 1 :] if other_key == key]  # equal keys sorted after
        for other_key, other in reversed(keys[:at]):
            if key[: len(other_key)] == other_key:
                found.append(other)
            elif other_key[0] != key[0]:
                found += [o for k, o in itertools.takewhile(lambda e: not e[0], keys)]  # empty keys sort first
                break  # the others before this one share not even the first token
        yield from found
