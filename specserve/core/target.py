"""The target side of one request: prefill, then verify each draft and commit what it decides.

:class:`TargetVerifier` is the one implementation of "score ``[last committed] + draft`` in one
forward, apply the exact rules of :mod:`specserve.core.verification`, cut the new tokens at EOS
and ``max_new_tokens``, roll the KV back to the committed text" — for chains, and for draft
trees (:meth:`TargetVerifier.verify_tree`: tree attention, the rules of
:mod:`specserve.core.tree_verification`, then KV compaction to the accepted path; local
sequences only so far). The single-process engine and
the distributed target replica (rank 0 of its tensor-parallel shards) both run it, so the two
cannot drift apart.

Where the keys and values live is behind :class:`TargetSequence`: one process
(:class:`LocalSequence`, a :class:`~specserve.core.model.KVCache`) or several tensor-parallel
shards that mirror every forward and rollback (``specserve.actors``). Stop strings are not
handled here: they need detokenisation and end the request, so the caller cuts for them.
"""

from __future__ import annotations

import time
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Generic, Literal, Protocol, TypeVar

import torch

from specserve.core.draft import Draft
from specserve.core.invariant import invariant_scores
from specserve.core.model import CausalLM
from specserve.core.sampling import SamplingParams, warp_probs
from specserve.core.tree import DraftTree
from specserve.core.tree_verification import TreeVerdict, verify_tree, verify_tree_greedy
from specserve.core.verification import ChainVerdict, verify_chain

FinishReason = Literal["eos", "length", "stop"]


class TargetSequence(Protocol):
    """The target's KV state for one sequence: ``length`` positions are cached."""

    @property
    def length(self) -> int: ...

    def forward(self, input_ids: torch.Tensor, last_only: bool = False) -> torch.Tensor:
        """Append ``input_ids`` ([k] int64) and return their next-token logits ([k, vocab])."""
        ...

    def rollback(self, length: int) -> None:
        """Keep the first ``length`` cached positions."""
        ...


class TreeSequence(TargetSequence, Protocol):
    """A sequence that can also verify a draft tree in one forward and keep only the accepted path."""

    def forward_tree(self, root: int, tree: DraftTree) -> torch.Tensor:
        """Append ``[root] + tree nodes`` with tree attention; ``[n + 1, vocab]`` logits (row 0 after the root)."""
        ...

    def compact(self, keep: Sequence[int]) -> None:
        """Keep only the cached positions in ``keep`` (increasing), moved to contiguous positions."""
        ...


class LocalSequence:
    """A sequence whose KV cache lives in this process."""

    def __init__(self, target: CausalLM) -> None:
        self.target = target
        self.cache = target.new_cache()

    @property
    def length(self) -> int:
        return self.cache.length

    def forward(self, input_ids: torch.Tensor, last_only: bool = False) -> torch.Tensor:
        return self.target.forward(self.cache, input_ids, last_only=last_only)

    def rollback(self, length: int) -> None:
        self.cache.rollback(length)

    def forward_tree(self, root: int, tree: DraftTree) -> torch.Tensor:
        return self.target.forward_tree(self.cache, root, tree)

    def compact(self, keep: Sequence[int]) -> None:
        self.cache.compact(keep)


Verdict = TypeVar("Verdict", ChainVerdict, TreeVerdict)


@dataclass(frozen=True)
class CycleOutcome(Generic[Verdict]):
    verdict: Verdict  # what the rules decided, before any cut
    new_tokens: list[int]  # committed this cycle: accepted drafts + next token, cut at EOS / length
    finish: FinishReason | None  # "eos" or "length" when this cycle ended the request
    verify_seconds: float  # forward + verification + rollback


class TargetVerifier:
    """Verifies one request's drafts against the target and keeps its KV equal to the committed text.

    The cache holds every committed token except the last, which heads the next verify block.
    """

    def __init__(
        self,
        sequence: TargetSequence,
        prompt_ids: Sequence[int],
        params: SamplingParams,
        generator: torch.Generator,
        max_new_tokens: int,
        eos_token_ids: Sequence[int] = (),
        device: torch.device | str = "cpu",
    ) -> None:
        if not prompt_ids:
            raise ValueError("a request needs at least one prompt token")
        self.sequence = sequence
        self.params = params
        self.generator = generator
        self.max_new_tokens = max_new_tokens
        self.eos = frozenset(eos_token_ids)
        self.device = torch.device(device)
        self.committed: list[int] = list(prompt_ids)
        self.num_prompt = len(self.committed)
        self.finish: FinishReason | None = None

    @property
    def num_output(self) -> int:
        return len(self.committed) - self.num_prompt

    @property
    def remaining(self) -> int:
        return self.max_new_tokens - self.num_output

    def prefill(self) -> None:
        if len(self.committed) > 1:
            ids = torch.tensor(self.committed[:-1], dtype=torch.long, device=self.device)
            self.sequence.forward(ids, last_only=True)

    def verify(self, draft: Draft) -> CycleOutcome[ChainVerdict]:
        """One cycle over a draft chain. With ``params.drafter_invariant`` (and T > 0) the greedy rule runs on
        log p + G from :mod:`specserve.core.invariant` (likewise in :meth:`verify_tree`): q is ignored and the
        request's generator is not consumed, so the output does not depend on the drafter."""
        if self.finish is not None:
            raise RuntimeError(f"the request already finished ({self.finish})")
        start = time.perf_counter()
        head = torch.tensor([self.committed[-1]], dtype=torch.long, device=self.device)
        tokens = draft.tokens.to(self.device)
        target_logits = self.sequence.forward(torch.cat([head, tokens]))  # [gamma + 1, vocab]
        if self.params.invariant_sampling:
            # Row j predicts position len(committed) + j; greedy rule on log p + G, q unused, generator untouched.
            first = len(self.committed)
            scores = invariant_scores(target_logits, self.params, range(first, first + target_logits.shape[0]))
            verdict = verify_chain(scores, None, tokens, None, None)
        else:
            target_probs = None if self.params.greedy else warp_probs(target_logits, self.params)
            draft_probs = draft.draft_probs.to(self.device) if draft.draft_probs is not None else None
            verdict = verify_chain(target_logits, target_probs, tokens, draft_probs, self.generator)

        new = [*tokens[: verdict.num_accepted].tolist(), verdict.next_token]
        return self._commit(verdict, new, start)

    def verify_tree(self, tree: DraftTree) -> CycleOutcome[TreeVerdict]:
        """One cycle over a draft tree: tree-attention forward, exact tree rules, keep only the accepted path."""
        if self.finish is not None:
            raise RuntimeError(f"the request already finished ({self.finish})")
        sequence = self.sequence
        if not (hasattr(sequence, "forward_tree") and hasattr(sequence, "compact")):
            raise NotImplementedError(f"{type(sequence).__name__} cannot verify draft trees; send chains")
        start = time.perf_counter()
        cached = sequence.length  # == len(committed) - 1: the root (last committed token) goes first
        target_logits = sequence.forward_tree(self.committed[-1], tree)  # [n + 1, vocab]
        if self.params.greedy:
            verdict = verify_tree_greedy(target_logits, tree)
        elif self.params.invariant_sampling:
            # Row 0 predicts position len(committed), row i + 1 (after node i) len(committed) + 1 + depth(i).
            first = len(self.committed)
            positions = [first, *(first + 1 + depth for depth in tree.depths)]
            verdict = verify_tree_greedy(invariant_scores(target_logits, self.params, positions), tree)
        else:
            verdict = verify_tree(warp_probs(target_logits, self.params), tree, self.generator)
        sequence.compact([*range(cached + 1), *(cached + 1 + node for node in verdict.accepted)])
        path = [int(tree.tokens[node]) for node in verdict.accepted]
        return self._commit(verdict, [*path, verdict.next_token], start)

    def _commit(self, verdict: Verdict, new: list[int], start: float) -> CycleOutcome[Verdict]:
        """Cut the new tokens at ``max_new_tokens`` and EOS, commit them, roll the KV back to the committed text."""
        remaining = self.remaining
        if len(new) >= remaining:
            new, self.finish = new[:remaining], "length"
        for i, token in enumerate(new):
            if token in self.eos:
                new, self.finish = new[: i + 1], "eos"
                break
        self.committed.extend(new)
        self.sequence.rollback(len(self.committed) - 1)
        return CycleOutcome(verdict, new, self.finish, time.perf_counter() - start)

    def stop_at(self, num_output: int) -> None:
        """End the request with only its first ``num_output`` new tokens (a stop string matched)."""
        if not 0 <= num_output <= self.num_output:
            raise ValueError(f"cannot keep {num_output} of {self.num_output} new tokens")
        del self.committed[self.num_prompt + num_output :]
        self.sequence.rollback(len(self.committed) - 1)
        self.finish = "stop"
