"""Recurrent layers in one sequence's KV cache: exact rollback by checkpoint and recompute, draft trees path by path.

Hybrid models (Qwen3-Next's Gated DeltaNet, Granite-4's and Nemotron-H's Mamba-2) interleave attention layers with
layers that keep, instead of keys and values per position, a state a forward advances over every token it is given:
a recurrent matrix and a short convolution window (transformers' ``LinearAttentionLayer``: ``recurrent_states`` and
``conv_states``). That state cannot be cropped — after a verify pass over k drafted tokens it has read all k, however
many were accepted — and it reads its block in order, blind to a tree mask. :class:`RecurrentKVCache` keeps it exact:

* **checkpoint**: the first forward after the cache settled (a rollback, a compaction, the start) first copies every
  recurrent layer's state (its size does not grow with the text: no per-position storage);
* **recompute**: a rollback to a length at or past the checkpoint restores the copy, crops the attention layers' KV
  to the checkpoint and feeds the kept tokens again, through transformers' own forward. A cycle whose drafts were
  all accepted costs nothing more; a rejection costs a forward over the accepted tokens. A rollback before the
  checkpoint (a stop string cutting earlier text) feeds the whole kept text again;
* **trees**: :meth:`RecurrentKVCache.forward_tree` runs ``[root] + nodes`` as a batch of its root-to-leaf paths over
  copies of the cache (right-padded: padding comes after every real token of its row, so none sees it) and takes
  each node's logits from a path through it. The cache then holds the block *pending*, its own state untouched; the
  compaction that keeps the accepted path (or a rollback into the block) feeds that path.

Checkpointing every position instead would need the recurrent kernels to hand back each position's state, which
transformers' do not. What recompute costs is measured in BENCHMARKS.md. Not here: the batched KV pool's states
(:mod:`specserve.core.kv.pool_states`) and the prefix cache, which keeps keys and values per position and no recurrent
state, so no hybrid prefix is reused.
"""

from __future__ import annotations

import copy
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import torch
from transformers.cache_utils import DynamicCache, DynamicLayer, LinearAttentionCacheLayerMixin

from specserve.core.kv.cache import KVCache

if TYPE_CHECKING:
    from transformers import PreTrainedModel

    from specserve.core.tree.draft_tree import DraftTree

# Runs the model over ``ids`` ([rows, width]) at ``positions`` ([rows, width]) on ``cache``, in inference mode; returns
# its output: with "feed" nothing needed (the last token's logits), with "logits" every token's, with "hidden" their
# hidden states too
ModelRun = Callable[[DynamicCache, torch.Tensor, torch.Tensor, str], Any]

_FLAGS = ("has_previous_state", "is_conv_states_initialized", "is_recurrent_states_initialized", "conv_kernel_size")
_STATES = ("conv_states", "recurrent_states")


def recurrent_layers(cache: DynamicCache) -> list[int]:
    """Indices of the cache's layers that keep a recurrent state."""
    return [i for i, layer in enumerate(cache.layers) if isinstance(layer, LinearAttentionCacheLayerMixin)]


@dataclass(frozen=True)
class StateCheckpoint:
    """Every recurrent layer's state when the cache held ``length`` positions."""

    length: int
    layers: dict[int, dict[str, dict[int, Any]]]  # layer -> field -> state index -> a copy (or a flag)

    @staticmethod
    def take(cache: DynamicCache, length: int) -> StateCheckpoint:
        layers: dict[int, dict[str, dict[int, Any]]] = {}
        for index in recurrent_layers(cache):
            layer = cache.layers[index]
            saved = {name: dict(getattr(layer, name)) for name in _FLAGS}
            for name in _STATES:
                saved[name] = {i: None if t is None else t.clone() for i, t in getattr(layer, name).items()}
            layers[index] = saved
        return StateCheckpoint(length, layers)

    def restore(self, cache: DynamicCache) -> None:
        """Put every recurrent layer back as it was (in place where the tensors still have their shapes: transformers
        marks them as static addresses)."""
        for index, saved in self.layers.items():
            layer = cache.layers[index]
            for name in _FLAGS:
                getattr(layer, name).update(saved[name])
            for name in _STATES:
                current = getattr(layer, name)
                for i, value in saved[name].items():
                    if value is None:
                        continue  # not yet made at the checkpoint: has_previous_state (restored) says to start afresh
                    if current[i] is not None and current[i].shape == value.shape:
                        current[i].copy_(value)
                    else:
                        current[i] = value.clone()

    @property
    def nbytes(self) -> int:
        return sum(
            t.numel() * t.element_size()
            for saved in self.layers.values()
            for name in _STATES
            for t in saved[name].values()
            if t is not None
        )


class RecurrentKVCache(KVCache):
    """One sequence's cache for a model with recurrent layers: a :class:`~specserve.core.kv.cache.KVCache`
    (``length``, ``rollback``, ``compact``) exact for the recurrent layers too.
    :class:`~specserve.core.model.causal_lm.CausalLM` builds it (``new_cache``) and calls :meth:`before_chain` /
    :meth:`after_chain` around a chain forward."""

    def __init__(self, model: PreTrainedModel, run: ModelRun) -> None:
        super().__init__(model)
        self._run = run
        self.tokens: list[int] = []  # what the inner cache has read: its attention KV and recurrent states
        # a tree block read path by path, not by the inner cache: (token, parent index in pending; -1 = the last of
        # ``tokens``)
        self.pending: list[tuple[int, int]] = []
        self.checkpoint: StateCheckpoint | None = None
        self.recomputed_tokens = 0  # tokens fed again by rollbacks and compactions (for benchmarks)

    @property
    def length(self) -> int:
        return len(self.tokens) + len(self.pending)

    # Chains -------------------------------------------------------------------------------------

    def before_chain(self) -> None:
        """Called before a chain forward: a pending block that is a chain is fed first (a tree
        block cannot be appended after), and the state is checkpointed if the cache has settled since."""
        if self.pending:
            chain = self._pending_chain(len(self.pending))
            self.pending = []
            self._feed(chain)
        if self.checkpoint is None:
            self.checkpoint = StateCheckpoint.take(self.inner, len(self.tokens))

    def after_chain(self, input_ids: torch.Tensor) -> None:
        self.tokens.extend(int(token) for token in input_ids.tolist())

    # Rollback -----------------------------------------------------------------------------------

    @torch.inference_mode()  # the cached states are inference tensors: restored in place only in this mode
    def rollback(self, length: int) -> None:
        """Keep the first ``length`` positions: the recurrent states become what a forward over exactly those tokens
        leaves (restored and recomputed), the attention layers' KV is cropped."""
        current = self.length
        if not 0 <= length <= current:
            raise ValueError(f"cannot roll back a cache of length {current} to {length}")
        kept_pending = length - len(self.tokens)
        if kept_pending >= 0:  # the inner cache keeps everything it read, and a chain of the pending block follows
            chain = self._pending_chain(kept_pending)
            self.pending = []
            self._feed(chain)
        else:
            self.pending = []
            checkpoint = self.checkpoint
            if checkpoint is not None and checkpoint.length <= length:
                checkpoint.restore(self.inner)
                start = checkpoint.length
            else:  # before the checkpoint: read the kept text again from the start
                self._reset()
                start = 0
            tail = self.tokens[start:length]
            self._crop(start)
            del self.tokens[start:]
            self._feed(tail)
        self.checkpoint = None  # settled: the next forward checkpoints here

    @torch.inference_mode()
    def compact(self, keep: Sequence[int]) -> None:
        """Keep the positions ``keep``: every position the inner cache read, then a chain of the pending block (the
        accepted path of a tree, which is fed). Dropping a position the inner cache already read is not possible."""
        keep = list(keep)
        held = len(self.tokens)
        if keep[:held] != list(range(held)):
            raise ValueError(f"a recurrent cache keeps its first {held} positions whole; cannot keep only {keep}")
        nodes = [position - held for position in keep[held:]]
        if any(not 0 <= node < len(self.pending) for node in nodes):
            raise ValueError(f"positions to keep must be below {self.length}, got {keep}")
        parent = -1
        for node in nodes:
            if self.pending[node][1] != parent:
                raise ValueError(f"the kept pending positions {nodes} are not a path from the block's root")
            parent = node
        path = [self.pending[node][0] for node in nodes]
        self.pending = []
        self._feed(path)
        self.checkpoint = None

    # Trees --------------------------------------------------------------------------------------

    def forward_tree(self, root: int, tree: DraftTree, hidden: bool = False) -> tuple[torch.Tensor, Any]:
        """``[root] + tree nodes`` appended as a pending block: per entry its logits (``[n + 1, vocab]``, row 0 the
        root's) and, with ``hidden``, its hidden states per layer (``[n + 1, width]`` each)."""
        if self.pending:
            raise ValueError("a recurrent cache verifies a tree after a settled text; compact or roll back first")
        self.pending = [(root, -1), *((int(t), p + 1) for t, p in zip(tree.tokens.tolist(), tree.parents, strict=True))]
        return self._pending_outputs(hidden)

    def extend_tree(self, tree: DraftTree, start: int) -> torch.Tensor:
        """Nodes ``start ..`` of ``tree`` appended after the cache's last token (the tree's root) and its pending nodes
        ``[:start]``; their logits ``[n - start, vocab]``."""
        nodes = [(int(t), p) for t, p in zip(tree.tokens.tolist(), tree.parents, strict=True)]
        if self.pending != nodes[:start]:
            raise ValueError(f"the cache's pending nodes are not the tree's first {start}")
        self.pending = nodes
        logits, _ = self._pending_outputs(False)
        return logits[start:]

    def _pending_outputs(self, hidden: bool) -> tuple[torch.Tensor, Any]:
        """Runs every root-to-leaf path of the pending block in one batched forward over copies of the inner cache."""
        size = len(self.pending)
        has_child = [False] * size
        for _, parent in self.pending:
            if parent >= 0:
                has_child[parent] = True
        paths = []
        for leaf in (i for i in range(size) if not has_child[i]):
            path, node = [], leaf
            while node >= 0:
                path.append(node)
                node = self.pending[node][1]
            paths.append(path[::-1])
        width = max(len(path) for path in paths)
        ids = torch.empty(len(paths), width, dtype=torch.long)
        where = [(0, 0)] * size  # per pending entry: a (row, column) that computed it
        for row, path in enumerate(paths):
            tokens = [self.pending[node][0] for node in path]
            ids[row] = torch.tensor(tokens + [tokens[-1]] * (width - len(tokens)))  # padding after the real tokens
            for column, node in enumerate(path):
                where[node] = (row, column)
        positions = (len(self.tokens) + torch.arange(width)).expand(len(paths), width)
        out = self._run(_rows_copy(self.inner, len(paths)), ids, positions, "hidden" if hidden else "logits")
        rows = torch.tensor([row for row, _ in where])
        columns = torch.tensor([column for _, column in where])
        logits = out.logits[rows.to(out.logits.device), columns.to(out.logits.device)]
        states = tuple(h[rows.to(h.device), columns.to(h.device)] for h in out.hidden_states) if hidden else None
        return logits, states

    # Internals ----------------------------------------------------------------------------------

    def _pending_chain(self, count: int) -> list[int]:
        """The tokens of the pending block's first ``count`` entries, which must be a chain from its root."""
        for index, (_, parent) in enumerate(self.pending[:count]):
            if parent != index - 1:
                raise ValueError(f"the first {count} positions of the pending tree block are not a chain")
        return [token for token, _ in self.pending[:count]]

    def _feed(self, tokens: Sequence[int]) -> None:
        """The inner cache reads ``tokens`` (a forward whose logits nobody needs)."""
        if not tokens:
            return
        start = len(self.tokens)
        ids = torch.tensor([list(tokens)], dtype=torch.long)
        self._run(self.inner, ids, start + torch.arange(len(tokens))[None], "feed")
        self.tokens.extend(tokens)
        self.recomputed_tokens += len(tokens)

    def _crop(self, length: int) -> None:
        """The attention layers keep their first ``length`` positions."""
        for layer in self.inner.layers:
            if isinstance(layer, DynamicLayer) and layer.is_initialized:
                excess = layer.get_seq_length() - length
                if excess > 0:
                    DynamicLayer.crop(layer, -excess)  # (a layer that is also recurrent: its attention part only)

    def _reset(self) -> None:
        """Every recurrent layer starts afresh at its next forward (transformers reads no state without a previous
        one)."""
        for layer in self.inner.layers:
            if isinstance(layer, LinearAttentionCacheLayerMixin):
                layer.has_previous_state = dict.fromkeys(layer.has_previous_state, False)


def _rows_copy(cache: DynamicCache, rows: int) -> DynamicCache:
    """``rows`` copies of ``cache`` in its batch dimension (the original untouched)."""
    batch = copy.copy(cache)
    batch.layers = []
    index: Any = torch.zeros(rows, dtype=torch.long)
    for layer in cache.layers:
        twin = copy.copy(layer)
        for name in (*_FLAGS, *_STATES):
            if hasattr(layer, name):
                setattr(twin, name, dict(getattr(layer, name)))
        twin.reorder_cache(index)  # index_select on the batch dimension: new tensors, the original's stay
        batch.layers.append(twin)
    return batch
