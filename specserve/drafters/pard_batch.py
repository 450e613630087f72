"""PARD blocks for many requests at once: one draft forward per batched step, whatever the blocks' sizes.

:class:`BatchedPardModel` is a :class:`~specserve.drafters.batched_model.BatchedDraftModel` over a PARD draft model
(one KV pool, one span per request, taken by ``start`` and given back by ``release``). Its
:meth:`~BatchedPardModel.propose_chains` catches every row up as the draft model's batcher does (long catch-ups first,
in forwards of their own rows), then feeds each row's last committed tokens followed by its block's K − 1 mask tokens,
**all rows in one** :meth:`~specserve.core.model.causal_lm.CausalLM.forward_batch`, reads each row's last K logits and
rolls each span back to its committed text. So 16 requests drafting blocks of K cost one forward of 16 rows, where a
draft model's chains cost K.

Per request the result is :class:`~specserve.drafters.pard.PardDrafter`'s, call for call: the same block, the same
token choice and q (:func:`~specserve.drafters.pard.choose_block`), the same random draws in the request's own
generator (a block draws all its tokens in one go, so requests sharing a generator still see their draws in order).
A row's logits differ from a one-row forward's only by rounding. Trees (:meth:`PooledPardDrafter.propose_tree`): the
request's block alone, in its own span. Does not verify, schedule, or decide which requests draft together; the
forwards run eagerly (no captured graphs).
"""

from __future__ import annotations

import logging
from collections.abc import Sequence

import torch

from specserve.core.draft.drafter import Draft, Drafter
from specserve.core.model.causal_lm import BatchBlock, CausalLM, TargetDescription
from specserve.core.sampling.params import SamplingParams
from specserve.core.tree.draft_tree import DraftTree
from specserve.core.tree.shapes import TreeBudget, TreeSpec, TreeTopology
from specserve.drafters.batched_model import BatchedDraftModel, DraftRow, PooledDraftModelDrafter
from specserve.drafters.pard import InvalidPardCheckpoint, block_tree, choose_block, tree_topology

logger = logging.getLogger(__name__)


class BatchedPardModel(BatchedDraftModel):
    """Drafts the blocks of many requests' :class:`PooledPardDrafter` in one forward of a PARD draft model."""

    def __init__(
        self,
        draft: CausalLM,
        pard_token: int,
        target: CausalLM | TargetDescription | None,
        max_num_seqs: int,
        max_seq_len: int,
    ) -> None:
        super().__init__(draft, target, max_num_seqs, max_seq_len)
        if not 0 <= pard_token < draft.info.vocab_size:
            raise InvalidPardCheckpoint(f"pard_token {pard_token} is outside the vocabulary of {draft.info.vocab_size}")
        self.pard_token = pard_token
        self.forwards = 0  # shared block forwards run (long catch-ups not counted)

    def new_drafter(self) -> PooledPardDrafter:
        return PooledPardDrafter(self)

    def propose_chains(self, drafters: Sequence[Drafter], budgets: Sequence[int]) -> list[Draft]:
        """Per drafter, what :meth:`PardDrafter.propose` alone returns (tokens, q, generator draws), in one forward."""
        rows = self._check(drafters, budgets)
        self._long_seconds = {}
        drafts = [Draft.empty(self.output_device)] * len(rows)
        for i, row, logits in self._blocks(rows):
            drafter = row.drafter
            try:
                block = choose_block(logits, drafter.params, drafter.grammar, drafter.generator, drafter.context)
                drafts[i] = block.to(self.output_device)
            except Exception:  # one request's grammar gave up mid-text, say: its block is empty, the others draft on
                logger.warning("one request's block failed; it drafts nothing, the others draft on", exc_info=True)
        self.catch_up_seconds = [self._long_seconds.get(id(row), 0.0) for row in rows]
        return drafts

    def block_logits(self, drafter: PooledPardDrafter, size: int) -> torch.Tensor | None:
        """One request's block of ``size`` alone (a tree's): its ``[size, vocab]`` logits, or None when it may not
        draft (no room left in its context)."""
        blocks = self._blocks(self._check([drafter], [size]))
        return blocks[0][2] if blocks else None

    def _blocks(self, rows: Sequence[DraftRow]) -> list[tuple[int, DraftRow, torch.Tensor]]:
        """Each drafting row's index, row and block logits ``[budget, vocab]``, from one forward of all of them; every
        span is then rolled back to its committed text."""
        active = self._prepare(rows)
        if not active:
            return []
        masks = [torch.full((row.budget - 1,), self.pard_token, dtype=torch.long) for row in active]
        blocks = [BatchBlock.chain(row.seq_id, torch.cat([row.take(row.pending.numel()), mask])) for row, mask in
                  zip(active, masks, strict=True)]  # fmt: skip
        logits = self.model.forward_batch(self.pool, blocks)
        self.forwards += 1
        index = {id(row): i for i, row in enumerate(rows)}
        out = []
        for row, row_logits in zip(active, logits, strict=True):
            drafter = row.drafter
            self.pool.rollback(row.seq_id, len(drafter.context))  # the masks leave no trace
            drafter.cached = drafter.context[:]
            assert isinstance(drafter, PooledPardDrafter)
            drafter.forwards += 1
            out.append((index[id(row)], row, row_logits[-row.budget :]))
        return out


class PooledPardDrafter(PooledDraftModelDrafter):
    """One request's PARD drafter whose KV is a span of a :class:`BatchedPardModel`'s pool (a ``BatchedDrafter``:
    its chains are drafted with the other requests' in one forward; ``propose`` alone is a batch of one)."""

    name = "pard"

    def __init__(self, batcher: BatchedPardModel) -> None:
        super().__init__(batcher)
        self._pard = batcher
        self.forwards = 0  # this request's block forwards (one per proposal)
        self._topologies: dict[TreeBudget, TreeTopology] = {}

    def start(self, prompt_ids: Sequence[int], params: SamplingParams, generator: torch.Generator) -> None:
        super().start(prompt_ids, params, generator)
        self.forwards = 0

    def request_counters(self) -> dict[str, int]:
        """This request's block forwards (``CountingDrafter``), as :class:`~specserve.drafters.pard.PardDrafter`."""
        return {"pard_forwards": self.forwards}

    def propose_tree(self, spec: TreeSpec) -> DraftTree:
        """Each block position's top tokens in the topology of ``spec``, the block drafted alone in this span."""
        if self.seq_id is None:
            raise RuntimeError("start() must be called before proposing (or again after release())")
        topology = tree_topology(spec, self._topologies)
        depth = max((len(path) for path in topology.paths), default=0)
        logits = self._pard.block_logits(self, depth) if depth > 0 else None
        if logits is None:
            return DraftTree.empty(self._pard.output_device)
        return block_tree(logits, topology, self._pard.output_device)
