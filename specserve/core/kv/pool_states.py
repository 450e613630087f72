"""The recurrent states of a KV pool's sequences: batched serving of hybrid models, exact under rollback.

A hybrid model's recurrent layers (Gated DeltaNet, Mamba-2: :mod:`specserve.core.kv.recurrent`) keep a state per
sequence that a forward advances over every token of its row — the padding after a short row's real tokens too — and
that cannot be cropped. :class:`PoolStates` keeps, per sequence of a :class:`~specserve.core.kv.pool.KVPool`:

* a **checkpoint**: every recurrent layer's state after the sequence's first ``length`` tokens (zeros at 0, which
  transformers' kernels read as a fresh start);
* the **tokens** the sequence's KV holds, so that whatever lies past the checkpoint can be read again;
* a **candidate**: the state a step left, when that step's row had no padding (its block filled the step's width):
  the checkpoint moves there once the sequence keeps that many tokens (the whole block accepted, a prefill chunk).

A batched step (:meth:`~specserve.core.model.causal_lm.CausalLM.forward_batch`) reads, for each row, the tokens between
its checkpoint and its cached length again before its block (:meth:`pending`: a rejection's accepted tokens, a padded
row's block), so its row starts from the checkpoint: no forward of its own, a few more columns in the next step.
:meth:`step_layers` hands transformers one ``LinearAttentionLayer`` per recurrent layer holding the rows' checkpoints
stacked, and :meth:`after_step` records what the rows' states became. Chains only: a tree block's recurrent layers
would read its nodes in order, not by the tree (the single-request engine verifies trees path by path). The prefix
cache reuses a sequence's keys and values only up to its checkpoint, whose states the reader takes (:meth:`adopt`):
no state is kept per position, so a hit shorter than the checkpoint reuses nothing.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field

import torch
from transformers.cache_utils import LinearAttentionLayer


@dataclass
class _Record:
    tokens: list[int] = field(default_factory=list)  # every token the sequence's KV holds, in order
    length: int = 0  # the checkpoint's position: its states are after tokens[:length]
    states: dict[int, tuple[torch.Tensor, torch.Tensor]] = field(default_factory=dict)  # layer -> (conv, recurrent)
    candidate: tuple[int, dict[int, tuple[torch.Tensor, torch.Tensor]]] | None = None


class PoolStates:
    """Checkpoints of the recurrent layers ``layers`` (model layer indices) for each of a pool's sequences."""

    def __init__(self, layers: Sequence[int]) -> None:
        self.layers = tuple(layers)
        self._records: dict[int, _Record] = {}
        self._blank: dict[int, tuple[torch.Tensor, torch.Tensor]] = {}  # a fresh row's zero states, learnt at step 1
        self._kernels: dict[int, int] = {}  # layer -> conv kernel size

    def add(self, sequence: int) -> None:
        self._records[sequence] = _Record()

    def remove(self, sequence: int) -> None:
        self._records.pop(sequence, None)

    def pending(self, sequence: int, cached: int) -> list[int]:
        """The tokens a step must read again before the sequence's block: those between its checkpoint and its
        ``cached`` length (after adopting a candidate the sequence kept)."""
        record = self._records[sequence]
        self._settle(record, cached)
        return record.tokens[record.length : cached]

    def start(self, sequence: int) -> int:
        """Where the sequence's next step starts: its checkpoint (call after :meth:`pending`)."""
        return self._records[sequence].length

    def rollback(self, sequence: int, length: int) -> None:
        """The sequence keeps its first ``length`` tokens."""
        record = self._records[sequence]
        self._settle(record, length)
        del record.tokens[length:]
        if length < record.length:  # before the checkpoint: read everything kept again, from a fresh state
            record.length, record.states = 0, {}

    def checkpoint(self, sequence: int) -> tuple[list[int], dict[int, tuple[torch.Tensor, torch.Tensor]]]:
        """The tokens the sequence's checkpoint is after, and its states there (per recurrent layer: convolution
        window, recurrent state; none before the first step)."""
        record = self._records[sequence]
        return record.tokens[: record.length], record.states

    def reusable(self, sequence: int, matched: int) -> int:
        """How much of a sequence whose first ``matched`` tokens another request shares that request can take from
        it: up to the sequence's checkpoint, if the match reaches it (its recurrent states are kept there only)."""
        length = self._records[sequence].length
        return length if length <= matched else 0

    def adopt(self, source: int, target: int, length: int) -> None:
        """``target`` takes ``source``'s checkpoint after its first ``length`` tokens (its keys and values copied):
        a prefix cache hit."""
        src, dst = self._records[source], self._records[target]
        if src.length != length:
            raise ValueError(f"sequence {source}'s recurrent states are kept after {src.length} tokens, not {length}")
        dst.tokens, dst.length, dst.states, dst.candidate = src.tokens[:length], length, dict(src.states), None

    def step_layers(self, sequences: Sequence[int]) -> dict[int, LinearAttentionLayer]:
        """Per recurrent layer, the cache layer a batched step over ``sequences`` (its rows, in order) hands
        transformers: every row's checkpoint stacked (zeros for a fresh one); before the first step, fresh layers."""
        layers: dict[int, LinearAttentionLayer] = {}
        for index in self.layers:
            layer = LinearAttentionLayer()
            if index in self._blank:
                blank = self._blank[index]
                convs, states = [], []
                for sequence in sequences:
                    saved = self._records[sequence].states.get(index, blank)
                    convs.append(saved[0])
                    states.append(saved[1])
                # as transformers' own layer holds them after a forward: initialised, with a previous state
                layer.conv_states[0], layer.recurrent_states[0] = torch.cat(convs), torch.cat(states)
                layer.conv_kernel_size[0] = self._kernels[index]
                layer.is_conv_states_initialized[0] = layer.is_recurrent_states_initialized[0] = True
                layer.has_previous_state[0] = True
                layer.dtype, layer.device = blank[0].dtype, blank[0].device  # type: ignore[assignment]
            layers[index] = layer
        return layers

    def after_step(
        self,
        sequences: Sequence[int],
        tokens: Sequence[Sequence[int]],
        width: int,
        layers: dict[int, LinearAttentionLayer],
    ) -> None:
        """Record a step: row b of ``sequences`` read ``tokens[b]`` (its pending tokens, then its block) after its
        checkpoint, in a step ``width`` columns wide; a row without padding leaves a candidate checkpoint."""
        for index, layer in layers.items():
            if index not in self._blank:
                conv, state = _row(layer, 0)
                self._blank[index] = (torch.zeros_like(conv), torch.zeros_like(state))
                self._kernels[index] = int(layer.conv_kernel_size[0] or conv.shape[-1])
        for row, (sequence, read) in enumerate(zip(sequences, tokens, strict=True)):
            record = self._records[sequence]
            del record.tokens[record.length :]
            record.tokens.extend(read)
            record.candidate = None
            if len(read) == width:  # no padding after its tokens: its states are those after them
                states = {index: _row(layer, row) for index, layer in layers.items()}
                record.candidate = (len(record.tokens), states)

    def _settle(self, record: _Record, kept: int) -> None:
        """Move the checkpoint to the candidate when the sequence keeps at least the candidate's tokens."""
        if record.candidate is not None:
            length, states = record.candidate
            record.candidate = None
            if kept >= length:
                record.length, record.states = length, states


def _row(layer: LinearAttentionLayer, row: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Row ``row``'s states in a step's layer: (convolution window, recurrent state), copied."""
    conv, state = layer.conv_states[0], layer.recurrent_states[0]
    assert conv is not None and state is not None, "a recurrent layer kept no state in a batched step"
    return conv[row : row + 1].clone(), state[row : row + 1].clone()
