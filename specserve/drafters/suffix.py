"""Suffix decoding: draft what followed the longest earlier match of the text's suffix, scored by frequency.

Two token stores are searched (ideas from SuffixDecoding, Oliaro et al. 2024; the code is ours):

* **per request** — the request's prompt and committed output (:class:`TokenBuffer`), appended to as
  the target commits tokens and cut back on ``rewind``;
* **global** — a :class:`SuffixCache` of recent *finished* requests' outputs (not their prompts: the
  request's own prompt is already in its per-request store, and outputs are what repeats across
  requests of one workload), shared by every request the drafters holding it serve in one process.
  It holds at most ``max_tokens`` tokens, evicting the oldest request's output first. A request's
  output is published when its drafter starts the next request, is finished (:meth:`SuffixDrafter.finish`)
  or is garbage-collected (a batched engine drops each request's drafter when the request ends). The
  tokens of a request's last cycle are not in it: a drafter is not told the verdict that ends a request.

A query (:func:`match_occurrences`) finds the longest suffix of the committed text, up to
``max_depth`` tokens, that occurred before with at least one token after it, and every place it
occurred. The store with the longer match is used (both on a tie). The tokens that followed the
(most recent ``max_occurrences``) occurrences are merged into a :class:`CountTrie`, each node
counting the occurrences it continues; a node's score is that count over the number of occurrences
(the empirical probability that its continuation follows the match).

Drafting adapts to the match: at most ``ceil(size_factor * match_length)`` tokens (nodes, for a
tree) are drafted, and only nodes scoring at least ``min_score``; no match, no draft. A chain is
the most frequent continuation (the rank-0 path); a dynamic tree keeps the best-scored nodes within
the budget's depth, width and node count; a static topology keeps the paths the trie fills, ranks by
count. The choice is deterministic, so no q is sent and the verifier treats each proposal as a
point mass: exact at any temperature.

Matching is a vectorised scan (numpy) of the stores, not a suffix tree: a query costs O(n) for the
candidates (positions holding the last token) plus O(candidates) per matched length; the stores
cost 8 bytes per token. Not done here: publishing a request's output while it runs. A request's
counters (proposals, matches, matched tokens, global matches) reach its stats
(:meth:`SuffixDrafter.request_counters`); the match length of each proposal is kept
(:attr:`SuffixDrafter.match_lengths`).
"""

from __future__ import annotations

import math
import threading
import weakref
from collections import deque
from collections.abc import Sequence
from dataclasses import dataclass, field

import numpy as np
import torch

from specserve.core.draft.drafter import Draft
from specserve.core.errors import UserError
from specserve.core.sampling.params import SamplingParams
from specserve.core.tree.draft_tree import DraftTree
from specserve.core.tree.shapes import ROOT, TreeBudget, TreeSpec, TreeTopology

SEPARATOR = -1  # between documents of the global store: no match and no continuation crosses it
EMPTY = np.empty(0, dtype=np.int64)


class TokenBuffer:
    """A growable int64 array (amortised O(1) appends, O(1) truncation)."""

    def __init__(self, tokens: Sequence[int] = ()) -> None:
        self._data = np.empty(max(16, 2 * len(tokens)), dtype=np.int64)
        self._length = 0
        self.extend(tokens)

    def __len__(self) -> int:
        return self._length

    def extend(self, tokens: Sequence[int]) -> None:
        count = len(tokens)
        if self._length + count > self._data.shape[0]:
            grown = np.empty(max(2 * self._data.shape[0], self._length + count), dtype=np.int64)
            grown[: self._length] = self._data[: self._length]
            self._data = grown
        self._data[self._length : self._length + count] = np.asarray(tokens, dtype=np.int64)
        self._length += count

    def truncate(self, length: int) -> None:
        if not 0 <= length <= self._length:
            raise ValueError(f"cannot rewind {self._length} committed tokens to {length}")
        self._length = length

    def view(self) -> np.ndarray:
        """The tokens ``[len]`` int64 (a view: valid until the next ``extend``)."""
        return self._data[: self._length]


def match_occurrences(text: np.ndarray, context: np.ndarray, max_depth: int) -> tuple[int, np.ndarray]:
    """The longest match of ``context``'s suffix in ``text`` and where it occurred.

    Returns ``(m, ends)``: ``m`` is the largest ``k <= max_depth`` such that ``text[j - k : j] ==
    context[-k:]`` for some ``j < len(text)`` with ``text[j] != SEPARATOR`` (a token follows the
    occurrence), and ``ends`` every such ``j`` (int64, most recent first); ``(0, [])`` when even the last
    token never occurred with something after it. When ``text`` is ``context`` itself, the suffix's own
    place (``j = len(text)``) is never counted: only earlier occurrences are.
    """
    if max_depth < 1 or context.shape[0] == 0 or text.shape[0] < 2:
        return 0, EMPTY
    ends = np.flatnonzero(text[:-1] == context[-1]) + 1  # text[j - 1] matches the last token
    ends = ends[text[ends] != SEPARATOR]
    if ends.size == 0:
        return 0, EMPTY
    length = 1
    for k in range(1, min(max_depth, context.shape[0])):
        longer = ends[ends > k]  # room for text[j - k - 1]
        longer = longer[text[longer - k - 1] == context[-k - 1]]
        if longer.size == 0:
            break
        ends, length = longer, k + 1
    return length, ends[::-1].copy()


def continuation(text: np.ndarray, end: int, depth: int) -> list[int]:
    """Up to ``depth`` tokens of ``text`` from ``end``, cut at the end of its document."""
    tokens = text[end : end + depth].tolist()
    return tokens[: tokens.index(SEPARATOR)] if SEPARATOR in tokens else tokens


class SuffixCache:
    """The global store: finished requests' outputs, newest last, at most ``max_tokens`` tokens in all.

    Shared by the drafters of one process (thread-safe). Publishing an output evicts the oldest outputs
    until the new one fits; an output longer than ``max_tokens`` keeps its last ``max_tokens`` tokens.
    """

    def __init__(self, max_tokens: int = 1 << 18) -> None:
        if max_tokens < 1:
            raise UserError(f"the suffix cache needs max_tokens >= 1, got {max_tokens}")
        self.max_tokens = max_tokens
        self._documents: deque[np.ndarray] = deque()
        self._tokens = 0
        self._text: np.ndarray | None = EMPTY  # documents joined by SEPARATOR; None: to rebuild
        self._lock = threading.Lock()

    @property
    def tokens(self) -> int:
        """Tokens held (separators not counted)."""
        return self._tokens

    @property
    def documents(self) -> list[list[int]]:
        with self._lock:
            return [document.tolist() for document in self._documents]

    def publish(self, tokens: Sequence[int] | np.ndarray) -> None:
        document = np.asarray(tokens, dtype=np.int64)[-self.max_tokens :].copy()
        if document.size == 0:
            return
        with self._lock:
            while self._documents and self._tokens + document.size > self.max_tokens:
                self._tokens -= self._documents.popleft().size
            self._documents.append(document)
            self._tokens += document.size
            self._text = None

    def text(self) -> np.ndarray:
        """Every document, oldest first, each followed by a SEPARATOR (so none runs into the next)."""
        with self._lock:
            if self._text is None:
                parts: list[np.ndarray] = []
                for document in self._documents:
                    parts += [document, np.array([SEPARATOR], dtype=np.int64)]
                self._text = np.concatenate(parts) if parts else EMPTY
            return self._text


# ---------------------------------------------------------------------------------------------
# Counted continuations


@dataclass
class CountTrie:
    """The continuations of ``total`` occurrences merged by shared prefix; ``counts[i]`` = occurrences node i
    continues. Nodes are in insertion order (parents first); children are ranked by count, ties by insertion
    (the most recent occurrence's first, as continuations are inserted most recent first)."""

    total: int = 0
    tokens: list[int] = field(default_factory=list)
    parents: list[int] = field(default_factory=list)
    counts: list[int] = field(default_factory=list)
    depths: list[int] = field(default_factory=list)
    children: list[dict[int, int]] = field(default_factory=lambda: [{}])  # root first, then node i's at i + 1

    @staticmethod
    def build(sequences: Sequence[Sequence[int]]) -> CountTrie:
        trie = CountTrie(total=len(sequences))
        for sequence in sequences:
            node = ROOT
            for token in sequence:
                siblings = trie.children[node + 1]
                child = siblings.get(token)
                if child is None:
                    child = siblings[token] = len(trie.tokens)
                    trie.tokens.append(int(token))
                    trie.parents.append(node)
                    trie.counts.append(0)
                    trie.depths.append(trie.depths[node] + 1 if node != ROOT else 0)
                    trie.children.append({})
                trie.counts[child] += 1
                node = child
        return trie

    @property
    def size(self) -> int:
        return len(self.tokens)

    def score(self, node: int) -> float:
        return self.counts[node] / self.total

    def ranked(self, parent: int) -> list[int]:
        """``parent``'s children (ROOT: the root's), most frequent first."""
        nodes = list(self.children[parent + 1].values())
        return sorted(nodes, key=lambda n: (-self.counts[n], n))

    def select_chain(self, length: int, min_score: float) -> list[int]:
        """The most frequent path, while its nodes score at least ``min_score``, at most ``length`` nodes."""
        path: list[int] = []
        node = ROOT
        while len(path) < length:
            ranked = self.ranked(node)
            if not ranked or self.score(ranked[0]) < min_score:
                break
            node = ranked[0]
            path.append(node)
        return path

    def select_budget(self, budget: TreeBudget, nodes: int, min_score: float) -> list[int]:
        """The best-scored ``min(nodes, budget.nodes)`` nodes among those scoring at least ``min_score``, of depth
        below ``budget.depth``, within the ``budget.width`` most frequent children of a kept parent; ties go to the
        shallower node, then the earlier inserted. A child never outscores its parent, so the choice is
        ancestor-closed and its order topological."""
        eligible: list[int] = []
        frontier = [ROOT]
        while frontier:
            parent = frontier.pop()
            for child in self.ranked(parent)[: budget.width]:
                if self.depths[child] < budget.depth and self.score(child) >= min_score:
                    eligible.append(child)
                    frontier.append(child)
        eligible.sort(key=lambda n: (-self.counts[n], self.depths[n], n))
        return eligible[: min(nodes, budget.nodes)]

    def select_topology(self, topology: TreeTopology, nodes: int, min_score: float) -> list[int]:
        """The node at each of the topology's paths the trie fills (rank = place by count) with a score of at least
        ``min_score``, in the topology's order, at most ``nodes`` of them."""
        at: dict[tuple[int, ...], int] = {}
        for path in topology.paths:  # breadth-first: a parent path comes before its children
            parent = at.get(path[:-1]) if len(path) > 1 else ROOT
            if parent is None:
                continue
            ranked = self.ranked(parent)
            if path[-1] < len(ranked) and self.score(ranked[path[-1]]) >= min_score:
                at[path] = ranked[path[-1]]
        return list(at.values())[:nodes]

    def subtree(self, nodes: Sequence[int]) -> tuple[list[int], tuple[int, ...]]:
        """Tokens and re-indexed parents of ``nodes`` (ancestor-closed, parents listed before children)."""
        index = {node: i for i, node in enumerate(nodes)}
        parents = tuple(index[self.parents[n]] if self.parents[n] != ROOT else ROOT for n in nodes)
        return [self.tokens[n] for n in nodes], parents


# ---------------------------------------------------------------------------------------------
# The drafter


@dataclass(frozen=True)
class Match:
    """One query's result: the match length, how many occurrences were merged, and from where."""

    length: int
    occurrences: int
    source: str  # "request", "global", "both" or "none"


class _Published:
    """The current request's text and prompt length, published to the cache once (when the next request starts,
    on ``finish``, or when the drafter is collected). Holds no reference to the drafter."""

    def __init__(self, cache: SuffixCache) -> None:
        self.cache = cache
        self.text = TokenBuffer()
        self.prompt_length = 0
        self.done = True

    def publish(self) -> None:
        if not self.done:
            self.done = True
            self.cache.publish(self.text.view()[self.prompt_length :])


def _new_counters() -> dict[str, int]:
    return {"proposals": 0, "matched": 0, "match_tokens": 0, "global_matches": 0}


class SuffixDrafter:
    name = "suffix"

    def __init__(
        self,
        cache: SuffixCache | None = None,
        max_depth: int = 32,
        max_occurrences: int = 256,
        size_factor: float = 1.0,
        min_score: float = 0.1,
        device: torch.device | str = "cpu",
    ) -> None:
        """``cache``: the global store shared with other drafters (a new, private one by default).
        ``max_depth``: the longest suffix matched; ``max_occurrences``: most recent occurrences merged per query;
        a proposal holds at most ``ceil(size_factor * match length)`` tokens, each scoring ``min_score`` or more."""
        if max_depth < 1 or max_occurrences < 1 or size_factor <= 0 or not 0 <= min_score <= 1:
            raise UserError(
                "the suffix drafter needs max_depth >= 1, max_occurrences >= 1, size_factor > 0 and 0 <= min_score "
                f"<= 1; got {max_depth}, {max_occurrences}, {size_factor}, {min_score}"
            )
        self.cache = cache if cache is not None else SuffixCache()
        self.max_depth = max_depth
        self.max_occurrences = max_occurrences
        self.size_factor = size_factor
        self.min_score = min_score
        self._device = device
        self._request = _Published(self.cache)
        weakref.finalize(self, self._request.publish)
        self.match_lengths: list[int] = []  # this request: the match length of each proposal (0: none)
        self.counters = _new_counters()  # this request's

    @property
    def history(self) -> list[int]:
        return self._request.text.view().tolist()

    def start(self, prompt_ids: Sequence[int], params: SamplingParams, generator: torch.Generator) -> None:
        self._request.publish()  # the previous request's output, if any
        self._request.text = TokenBuffer(prompt_ids)
        self._request.prompt_length = len(prompt_ids)
        self._request.done = False
        self.match_lengths = []
        self.counters = _new_counters()

    def request_counters(self) -> dict[str, int]:
        """This request's proposals, those that matched, their matched tokens, and matches in the global store."""
        return dict(self.counters)

    def accept(self, committed: Sequence[int]) -> None:
        self._request.text.extend(committed)

    def rewind(self, length: int) -> None:
        self._request.text.truncate(length)

    def finish(self) -> None:
        """Publish this request's output to the global store now (else: at the next ``start``, or when collected)."""
        self._request.publish()

    def candidates(self, depth: int) -> tuple[CountTrie, Match]:
        """The counted continuations (up to ``depth`` tokens) of the longest match in either store."""
        context = self._request.text.view()
        local_length, local_ends = match_occurrences(context, context, self.max_depth)
        shared = self.cache.text()
        global_length, global_ends = match_occurrences(shared, context, self.max_depth)
        length = max(local_length, global_length)
        sequences: list[list[int]] = []
        if length and local_length == length:
            sequences += [continuation(context, int(j), depth) for j in local_ends[: self.max_occurrences]]
        if length and global_length == length:
            room = self.max_occurrences - len(sequences)
            sequences += [continuation(shared, int(j), depth) for j in global_ends[: max(room, 0)]]
        source = {(True, True): "both", (True, False): "request", (False, True): "global"}.get(
            (local_length == length > 0, global_length == length > 0), "none"
        )
        self.match_lengths.append(length)
        self.counters["proposals"] += 1
        if length:
            self.counters["matched"] += 1
            self.counters["match_tokens"] += length
            self.counters["global_matches"] += source != "request"
        return CountTrie.build(sequences if depth > 0 else []), Match(length, len(sequences), source)

    def size_limit(self, match_length: int) -> int:
        """The most tokens (nodes) a proposal after a match of this length holds."""
        return math.ceil(self.size_factor * match_length)

    def propose(self, budget: int) -> Draft:
        if budget <= 0:
            return Draft.empty(self._device)
        trie, match = self.candidates(budget)
        path = trie.select_chain(min(budget, self.size_limit(match.length)), self.min_score)
        tokens = [trie.tokens[n] for n in path]
        return Draft(torch.tensor(tokens, dtype=torch.long, device=self._device), None)

    def propose_tree(self, spec: TreeSpec) -> DraftTree:
        """A tree of the most frequent continuations (point masses: ``child_probs`` is None)."""
        if spec.kind == "static":
            assert spec.topology is not None
            trie, match = self.candidates(max(len(path) for path in spec.topology.paths))
            nodes = trie.select_topology(spec.topology, self.size_limit(match.length), self.min_score)
        else:
            assert spec.budget is not None
            trie, match = self.candidates(spec.budget.depth)
            nodes = trie.select_budget(spec.budget, self.size_limit(match.length), self.min_score)
        if not nodes:
            return DraftTree.empty(self._device)
        tokens, parents = trie.subtree(nodes)
        return DraftTree(torch.tensor(tokens, dtype=torch.long, device=self._device), parents)
