"""Layer-skip chains for many requests at once, drafted in the target's own KV pool.

In a batched engine each request's layer-skip drafter (:class:`PooledLayerSkipDrafter`) follows the request's span
of the target's pool (:class:`~specserve.core.draft.drafter.ReadsTargetPool`). Before a proposal the span holds the
committed text but its last token, as the target's own first L layers computed it — what the early-exit view
(:func:`~specserve.drafters.layerskip.early_exit_model`) computes. So :class:`BatchedLayerSkip` drafts every
request's chain in shared forwards of the view over the target's pool (the
:class:`~specserve.drafters.batched_model.BatchedDraftModel` loop: the first round feeds each row's last committed
token, then one token per row and round), writing the drafts' keys and values past each span's committed length in
its first L layers, and rolls every span back to where it was before the target verifies (whose block overwrites
those positions). No catch-up after plain cycles, no cache of its own, and 16 requests drafting γ tokens cost γ
forwards of 16 rows through L layers instead of 16 × γ forwards of one row.

Per request the chain is :class:`~specserve.drafters.layerskip.LayerSkipDrafter`'s (the same token choice, q, grammar
and cut), up to rounding. Trees are drafted alone, with a cache of their own. A pool whose first L layers do not all
keep plain keys and values (a latent, a recurrent state) cannot be drafted in: such a drafter says so when it is
asked to follow it. Does not verify, schedule, or choose which requests draft together.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from specserve.core.draft.drafter import Draft, Drafter
from specserve.core.errors import UserError
from specserve.core.kv.pool import KVPool
from specserve.core.model.causal_lm import CausalLM, TargetDescription
from specserve.core.sampling.params import SamplingParams
from specserve.core.verify.grammar import DraftGrammar
from specserve.drafters.batched_model import (
    DEFAULT_CATCH_UP_TOKENS,
    BatchedDraftModel,
    DraftRow,
    PooledDraftModelDrafter,
)


class BatchedLayerSkip(BatchedDraftModel):
    """Drafts the chains of many requests' :class:`PooledLayerSkipDrafter` in shared forwards of the early-exit
    ``view`` (``layers`` layers of the target) over the target's KV pool. Not thread-safe."""

    def __init__(self, view: CausalLM, layers: int, target: CausalLM | TargetDescription) -> None:
        # not BatchedDraftModel.__init__: it drafts in the target's pool, which the first request hands over
        self.model = view
        self.layers = layers
        self.output_device = target.device
        self.catch_up_tokens = DEFAULT_CATCH_UP_TOKENS
        self.max_seq_len = view.info.max_positions
        self.graphs = None
        self.catch_up_seconds: list[float] = []
        self._long_seconds: dict[int, float] = {}
        self._pool: KVPool | None = None

    @property
    def pool(self) -> KVPool:  # type: ignore[override]
        if self._pool is None:
            raise RuntimeError("no request has handed over the target's KV pool yet (follow_target_pool)")
        return self._pool

    def follow(self, pool: KVPool) -> None:
        """Draft in ``pool`` (one batched engine's: every request's drafter hands over the same one)."""
        if not pool.readable_layers(self.layers):
            raise UserError(
                f"layer-skip drafts in the target's first {self.layers} layers of KV, but this target's pool keeps "
                "no plain keys and values there (a latent or recurrent layer); use a draft model or a head instead"
            )
        if self._pool is not None and self._pool is not pool:
            raise ValueError("a layer-skip batcher drafts for one batched engine: its requests share one pool")
        self._pool = pool

    def new_drafter(self) -> PooledLayerSkipDrafter:
        return PooledLayerSkipDrafter(self)

    def propose_chains(self, drafters: Sequence[Drafter], budgets: Sequence[int]) -> list[Draft]:
        """Per drafter, its chain (as :meth:`BatchedDraftModel.propose_chains`), every span given back to the target
        as it was."""
        if any(isinstance(d, PooledLayerSkipDrafter) and d.seq_id is None and d.context for d in drafters):
            raise RuntimeError(
                "a layer-skip drafter drafts in its request's span of the target's KV pool, which a batched engine "
                "hands over after start() (follow_target_pool); this one was given none"
            )
        lengths = [(d.seq_id, self.pool.length(d.seq_id)) for d in drafters if isinstance(d, PooledLayerSkipDrafter)
                   and d.seq_id is not None]  # fmt: skip
        try:
            return super().propose_chains(drafters, budgets)
        finally:
            for seq_id, length in lengths:
                self.pool.rollback(seq_id, length)

    def _catch_up(self, row: DraftRow) -> torch.Tensor:  # [k] int64: the committed tokens past the span (k >= 1)
        """The span is the target's: it holds the committed text but its last token (what the view computes), so
        only the tokens after it are fed."""
        context = row.drafter.context
        length = min(self.pool.length(row.seq_id), len(context) - 1)
        self.pool.rollback(row.seq_id, length)
        return torch.tensor(context[length:], dtype=torch.long)


class PooledLayerSkipDrafter(PooledDraftModelDrafter):
    """One request's layer-skip drafter in a batched engine: its chains are drafted in the request's span of the
    target's pool (:class:`BatchedLayerSkip`), which the engine hands over after ``start``; trees alone."""

    name = "layerskip"

    def __init__(self, batcher: BatchedLayerSkip) -> None:
        super().__init__(batcher)
        self._layers = batcher

    def start(self, prompt_ids: Sequence[int], params: SamplingParams, generator: torch.Generator) -> None:
        """Reset for a new request; it drafts once the engine hands over the request's span (follow_target_pool)."""
        self.release()
        self.context = list(prompt_ids)
        self.params = params
        self.generator = generator
        model = self._layers.model
        self.grammar = DraftGrammar.of(params, model.tokenizer, model.info, len(prompt_ids))

    def follow_target_pool(self, pool: KVPool, sequence: int) -> None:
        self._layers.follow(pool)
        self.seq_id = sequence

    def release(self) -> None:
        """Forget the request's span (the target's: the engine frees it)."""
        self.seq_id = None
        self.cached = []
        self._trees = None
