"""Draft-model chains for many requests at once: one KV pool, one draft forward per drafted position.

:class:`BatchedDraftModel` is a :class:`~specserve.core.draft.drafter.ChainBatcher` over one draft model. Each request's
drafter (:class:`PooledDraftModelDrafter`, from :meth:`BatchedDraftModel.new_drafter`) keeps its KV in a span of
``max_seq_len`` positions of the batcher's :class:`~specserve.core.kv.pool.KVPool`, taken by ``start`` and given back by
``release``.
:meth:`BatchedDraftModel.propose_chains` drafts every request's chain together: each row first catches up (its span
rolled back to the longest prefix shared with its committed text, the rest fed as a ragged block), then grows by one
token per forward while its budget lasts, all rows in the same
:meth:`~specserve.core.model.causal_lm.CausalLM.forward_batch` calls, which compute each row's last logits only. So 16
requests drafting γ tokens cost γ forwards of 16 rows instead of 16 × γ forwards of one row.

Per request the result is :class:`~specserve.drafters.model.DraftModelDrafter`'s, call for call: the same
catch-up, the same token choice (greedy argmax; the keyed-noise token in drafter-invariant mode; otherwise a
draw from the warped q with the request's own generator, q sent with the draft), the same mask and stop under a
grammar (:class:`~specserve.core.verify.grammar.DraftGrammar`), the same ``max_positions`` cut, and rejected drafts
never leak into later proposals. A row's logits differ from a one-row forward's only
by rounding. Random draws are made row by row in the order given, one generator per request; when sampled
requests share a generator their chains are drafted one request after another, so that generator still sees
the draws it would see alone.

A batched forward pads every row to its longest block, so one long catch-up (the first after ``start`` is
the whole prompt) would make every row of the batch that long. Catch-ups of at most ``SHORT_CATCH_UP`` tokens
(the usual one or two: the last draft token and the verdict's) go into the first shared round; a longer one
first feeds all but its last token in forwards of the long rows only, at most ``catch_up_tokens`` per row and
forward. So a forward's blocks differ by fewer than ``max(catch_up_tokens, SHORT_CATCH_UP)`` tokens.

Does not draft trees in batches: :meth:`PooledDraftModelDrafter.propose_tree` drafts alone, with a
:class:`~specserve.drafters.tree.TreeModelDrafter` and a cache of its own, as the one-row drafter does. Does
not verify, schedule, or decide which requests draft together.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from functools import partial

import torch

from specserve.core.draft.drafter import ChainBatcher, Draft, Drafter, check_chain_call
from specserve.core.kv.pool import KVPool, PoolFull
from specserve.core.kv.prefix_index import common_prefix
from specserve.core.model.causal_lm import BatchBlock, CausalLM, TargetDescription
from specserve.core.sampling.params import SamplingParams
from specserve.core.sampling.warps import sample, warp_probs
from specserve.core.static.batch_graphs import batch_graphs
from specserve.core.static.graphs import GraphBackend
from specserve.core.static.options import StaticOptions
from specserve.core.tree.draft_tree import DraftTree
from specserve.core.tree.shapes import TreeSpec
from specserve.core.verify.grammar import DraftGrammar, mask_logits
from specserve.core.verify.invariant import invariant_tokens
from specserve.drafters.tree import TreeModelDrafter
from specserve.drafters.vocabulary import check_same_vocabulary

logger = logging.getLogger(__name__)

DEFAULT_CATCH_UP_TOKENS = 128  # tokens per row and forward of a long catch-up
SHORT_CATCH_UP = 4  # a catch-up of at most this many tokens shares the first drafting round with the others


class BatchedDraftModel:
    """Drafts chains for many requests' :class:`PooledDraftModelDrafter` in shared forwards of one draft model.

    ``max_num_seqs`` requests may hold a span at once, each of ``max_seq_len`` positions. A proposal of
    ``b`` tokens after ``n`` committed ones needs ``n + b - 1`` positions; a request whose chains are cut to the
    tokens it may still emit minus one (as :func:`specserve.core.draft.drafter.propose` cuts them) stays within its
    prompt + ``max_new_tokens``. Not thread-safe.
    """

    def __init__(
        self,
        draft: CausalLM,
        target: CausalLM | TargetDescription | None,
        max_num_seqs: int,
        max_seq_len: int,
        catch_up_tokens: int = DEFAULT_CATCH_UP_TOKENS,
        static: StaticOptions | None = None,
        graph_backend: GraphBackend | None = None,
    ) -> None:
        """``static``: the forwards that fit its buckets replay as captured graphs
        (:mod:`specserve.core.static.batch_graphs`: on a CUDA device with ``cuda_graphs``, or through ``graph_backend``,
        the tests' stand-in)."""
        if target is not None:
            check_same_vocabulary(target, draft)
        if catch_up_tokens < 1:
            raise ValueError(f"catch_up_tokens must be >= 1, got {catch_up_tokens}")
        self.model = draft
        self.output_device = target.device if target is not None else draft.device
        self.catch_up_tokens = catch_up_tokens
        if max_num_seqs < 1 or max_seq_len < 1:
            raise ValueError(f"max_num_seqs and max_seq_len must be >= 1, got {max_num_seqs}, {max_seq_len}")
        self.max_seq_len = max_seq_len
        self.pool = KVPool(draft.model, max_num_seqs * max_seq_len)
        self.graphs = batch_graphs(draft, self.pool, static, graph_backend)
        # per drafter of the last propose_chains call: seconds of its own long catch-up (a newcomer's prompt)
        self.catch_up_seconds: list[float] = []
        self._long_seconds: dict[int, float] = {}

    def new_drafter(self) -> PooledDraftModelDrafter:
        """A drafter for one request (it takes a span of the pool on ``start``; ``release`` gives it back)."""
        return PooledDraftModelDrafter(self)

    def propose_chains(self, drafters: Sequence[Drafter], budgets: Sequence[int]) -> list[Draft]:
        """Per drafter, what its ``propose(budget)`` alone returns (tokens, q, generator draws), in shared forwards."""
        rows = self._check(drafters, budgets)
        self._long_seconds = {}
        sampled = [row.drafter.generator for row in rows if row.sampled]
        if len({id(generator) for generator in sampled}) < len(sampled):
            for row in rows:  # shared generators: draft request by request, so each sees its draws in order
                self._draft([row])
        else:
            self._draft(rows)
        self.catch_up_seconds = [self._long_seconds.get(id(row), 0.0) for row in rows]
        return [row.finish(self.output_device) for row in rows]

    def _check(self, drafters: Sequence[Drafter], budgets: Sequence[int]) -> list[DraftRow]:
        """The rows that draft (budget cut to the draft's positions), refusing bad input before any forward."""
        check_chain_call(drafters, budgets)
        rows = []
        for drafter, budget in zip(drafters, budgets, strict=True):
            if not isinstance(drafter, PooledDraftModelDrafter) or drafter.batcher is not self:
                raise ValueError(f"{drafter!r} is not a drafter of this batcher (use its new_drafter())")
            seq_id = drafter.seq_id
            if seq_id is None:
                raise RuntimeError("start() must be called before proposing (or again after release())")
            context = len(drafter.context)
            budget = min(budget, self.model.info.max_positions - context)
            if budget > 0 and context + budget - 1 > self.max_seq_len:
                raise PoolFull(
                    f"{budget} draft tokens after {context} committed ones need {context + budget - 1} positions, "
                    f"more than the {self.max_seq_len} a request holds in the draft model's KV pool; draft fewer "
                    "tokens or configure a longer max_seq_len"
                )
            rows.append(DraftRow(drafter, seq_id, max(budget, 0)))
        return rows

    def _draft(self, rows: Sequence[DraftRow]) -> None:
        """Catch every row up and draft its budget: after any long catch-ups, one forward per round over the rows
        still drafting (the first round feeds each row's short catch-up, then one token per row)."""
        active = self._prepare(rows)
        while active:
            blocks = [BatchBlock.chain(row.seq_id, row.take(SHORT_CATCH_UP)) for row in active]
            logits = self.model.forward_batch(self.pool, blocks, last_only=True, graphs=self.graphs)
            for row, row_logits in zip(active, logits, strict=True):  # [1, vocab] each
                row.guarded(partial(row.choose, row_logits[-1]))  # draws in the order given
            active = [row for row in active if row.pending.numel() > 0]

    def _prepare(self, rows: Sequence[DraftRow]) -> list[DraftRow]:
        """The rows that draft, each caught up but for at most ``SHORT_CATCH_UP`` tokens still pending (its
        grammar's matcher at the end of its committed text); long catch-ups are fed here, in rows of their own."""
        for row in rows:
            if row.budget > 0 and row.drafter.grammar is not None:  # the matcher at the end of the committed text
                row.guarded(row.sync_grammar)
        active = [row for row in rows if row.budget > 0]
        for row in active:
            row.pending = self._catch_up(row)
        long = [row for row in active if row.pending.numel() > SHORT_CATCH_UP]
        while long:  # all but the last token of each long catch-up, in rows of their own
            start = time.perf_counter()
            chunks = [row.take(min(self.catch_up_tokens, row.pending.numel() - 1)) for row in long]
            blocks = [BatchBlock.chain(row.seq_id, chunk) for row, chunk in zip(long, chunks, strict=True)]
            self.model.forward_batch(self.pool, blocks, last_only=True, graphs=self.graphs)
            share = (time.perf_counter() - start) / len(long)
            for row in long:  # the rows that needed it pay for it (catch_up_seconds)
                self._long_seconds[id(row)] = self._long_seconds.get(id(row), 0.0) + share
            long = [row for row in long if row.pending.numel() > 1]
        return active

    def _catch_up(self, row: DraftRow) -> torch.Tensor:  # [k] int64, the committed tokens the span lacks (k >= 1)
        """Roll the span back to the longest prefix of what it caches that is still committed (never the last
        committed token, whose logits are needed); the rest of the committed text is still to feed."""
        drafter = row.drafter
        cached, context = drafter.cached, drafter.context
        keep = max(0, min(common_prefix(cached, context), len(context) - 1))
        self.pool.rollback(row.seq_id, keep)
        drafter.cached = context[:]
        return torch.tensor(context[keep:], dtype=torch.long)


@dataclass
class DraftRow:
    """One request's chain while it is drafted."""

    drafter: PooledDraftModelDrafter
    seq_id: int
    budget: int  # tokens to draft (0: an empty draft)
    pending: torch.Tensor = field(default_factory=lambda: torch.empty(0, dtype=torch.long))  # [k] still to feed
    tokens: list[torch.Tensor] = field(default_factory=list)  # each [] int64, drafted so far
    probs: list[torch.Tensor] = field(default_factory=list)  # each [vocab], the q of each sampled token

    @property
    def sampled(self) -> bool:
        """Tokens are drawn from the request's generator (not greedy, not drafter-invariant)."""
        params = self.drafter.params
        return self.budget > 0 and not params.greedy and not params.invariant_sampling

    def guarded(self, step: Callable[[], None]) -> None:
        """Run one of this row's own steps (its grammar's sync, a token's choice); if it raises (the request's grammar
        gave up mid-text, say), the row's chain ends with what it has, and the other rows draft on. Drafting less is
        always exact; the request's verifier, whose matcher is at the same text, reports a grammar that cannot run."""
        try:
            step()
        except Exception:
            logger.warning("drafting one request's chain failed; it ends here, the others draft on", exc_info=True)
            self.budget = len(self.tokens)
            self.pending = self.pending[:0]

    def sync_grammar(self) -> None:
        assert self.drafter.grammar is not None
        self.drafter.grammar.sync(self.drafter.context)

    def take(self, limit: int) -> torch.Tensor:  # [min(k, limit)] int64
        chunk, self.pending = self.pending[:limit], self.pending[limit:]
        return chunk

    def choose(self, logits: torch.Tensor) -> None:  # logits: [vocab], after the last fed token
        """The next draft token, chosen as :meth:`DraftModelDrafter.propose` chooses it; fed next unless the
        budget is spent."""
        params, grammar = self.drafter.params, self.drafter.grammar
        if grammar is not None:  # only what the grammar allows after the text and the drafts so far
            logits = mask_logits(logits, grammar.allowed())
        if params.greedy:
            token = logits.argmax(-1)
        elif params.invariant_sampling:  # argmax(log q + G) at this token's absolute position; no q is sent
            position = len(self.drafter.context) + len(self.tokens)
            token = invariant_tokens(logits[None], params, [position])[0]
        else:
            generator = self.drafter.generator
            assert generator is not None
            row = warp_probs(logits, params)
            token = sample(row, generator)
            self.probs.append(row)
        self.tokens.append(token)
        if grammar is not None and not grammar.push(int(token)):
            self.budget = len(self.tokens)  # the text ends here: nothing to draft after it
        if len(self.tokens) < self.budget:
            self.pending = token.reshape(1)

    def finish(self, device: torch.device) -> Draft:
        """The drafted chain on ``device``; the span then caches the committed text and all but the last token."""
        if self.drafter.grammar is not None:
            self.drafter.grammar.rewind_drafts()
        if not self.tokens:
            return Draft.empty(device)
        tokens = torch.stack(self.tokens).to(device)
        self.drafter.cached.extend(int(t) for t in tokens[:-1].tolist())
        draft_probs = torch.stack(self.probs).to(device) if self.probs else None
        return Draft(tokens, draft_probs)


class PooledDraftModelDrafter:
    """One request's draft-model drafter whose KV is a span of a :class:`BatchedDraftModel`'s pool.

    A :class:`~specserve.core.draft.drafter.BatchedDrafter`: ``start`` takes a span (giving back the one it held),
    ``release`` gives it back (idempotent; call it when the request ends or is cancelled, or the span is lost
    to the pool), and ``propose`` alone is a batch of one. Trees are drafted alone, with a cache of their own.
    """

    name = "model"

    def __init__(self, batcher: BatchedDraftModel) -> None:
        self.batcher: ChainBatcher = batcher
        self._model = batcher
        self.seq_id: int | None = None  # the pool's sequence, while started
        self.cached: list[int] = []  # tokens whose keys/values are in the span, in order
        self.context: list[int] = []  # committed tokens of the current request
        self.params = SamplingParams()
        self.generator: torch.Generator | None = None
        self._trees: TreeModelDrafter | None = None  # once trees are asked for: its own cache, this context
        self.grammar: DraftGrammar | None = None  # the request's grammar (structured output), if any

    def start(self, prompt_ids: Sequence[int], params: SamplingParams, generator: torch.Generator) -> None:
        """Reset for a new request and take a span (raises :class:`PoolFull` when none is free or the prompt
        does not fit one)."""
        self.release()
        if len(prompt_ids) > self._model.max_seq_len:
            raise PoolFull(
                f"a prompt of {len(prompt_ids)} tokens does not fit the {self._model.max_seq_len} positions a request "
                "holds in the draft model's KV pool; configure a longer max_seq_len"
            )
        self.seq_id = self._model.pool.allocate(self._model.max_seq_len)
        self.cached = []
        self.context = list(prompt_ids)
        self.params = params
        self.generator = generator
        model = self._model.model
        self.grammar = DraftGrammar.of(params, model.tokenizer, model.info, len(prompt_ids))

    def release(self) -> None:
        """Give the span back to the pool (nothing when none is held)."""
        if self.seq_id is not None:
            self._model.pool.free(self.seq_id)
            self.seq_id = None
        self.cached = []
        self._trees = None

    def propose(self, budget: int) -> Draft:
        return self._model.propose_chains([self], [budget])[0]

    def accept(self, committed: Sequence[int]) -> None:
        self.context.extend(committed)

    def rewind(self, length: int) -> None:
        if not 0 <= length <= len(self.context):
            raise ValueError(f"cannot rewind {len(self.context)} committed tokens to {length}")
        del self.context[length:]

    def propose_tree(self, spec: TreeSpec) -> DraftTree:
        """A draft tree after the committed text, drafted alone (see :meth:`DraftModelDrafter.propose_tree`)."""
        if self.seq_id is None:
            raise RuntimeError("start() must be called before proposing (or again after release())")
        if self._trees is None:
            self._trees = TreeModelDrafter(self._model.model)
            self._trees.start(self.context)
        self._trees.context = self.context  # the same list: accept() and rewind() keep both in step
        self._trees.configure(self.params, self.generator)
        return self._trees.propose_tree(spec).to(self._model.output_device)
