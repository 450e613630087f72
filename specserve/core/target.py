"""The target side of one request: prefill, then verify each draft and commit what it decides.

:class:`TargetVerifier` is the one implementation of "score ``[last committed] + proposal`` in one
forward, apply the exact rules, cut the new tokens at EOS and ``max_new_tokens``, roll the KV back
to the committed text" — for chains (the rules of :mod:`specserve.core.verify.chain`) and for
draft trees (tree attention, the rules of :mod:`specserve.core.verify.tree`, then KV
compaction to the accepted path), behind one :meth:`TargetVerifier.verify`. The single-process
engine and the distributed target replica (rank 0 of its tensor-parallel shards) both run it,
so the two cannot drift apart.

Where the keys and values live is behind :class:`TargetSequence`: one process
(:class:`LocalSequence`, a :class:`~specserve.core.model.causal_lm.KVCache`), one span of a batched
engine's KV pool (:class:`PooledSequence`), or several tensor-parallel shards that mirror every
forward and rollback (``specserve.actors``). A batched step splits :meth:`TargetVerifier.verify`
in two: every request's :meth:`~TargetVerifier.block` goes into one forward, then each request's
verifier decides on its own rows (:meth:`~TargetVerifier.decide`). Stop strings are not
handled here: they need detokenisation and end the request, so the caller cuts for them.

For hidden-state drafters (EAGLE, Medusa: :class:`~specserve.core.draft.drafter.FeatureDrafter`) the verifier
is built with their ``feature_layers``: the prefill returns the prompt's features and every cycle's
outcome the features of its root and accepted tokens, taken from the same forward that verified them
(in a batched step, the batch's forward, which fills one :class:`~specserve.core.model.causal_lm.FeatureCapture`
per row: :meth:`TargetVerifier.new_capture`).
"""

from __future__ import annotations

import dataclasses
import time
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Literal, Protocol

import torch

from specserve.core.draft.drafter import Draft, Proposal
from specserve.core.errors import RequestFailed
from specserve.core.kv.cache import KVCache
from specserve.core.kv.pool import KVPool
from specserve.core.model.causal_lm import BatchBlock, CausalLM, FeatureCapture
from specserve.core.sampling.params import SamplingParams
from specserve.core.sampling.warps import warp_probs
from specserve.core.static.slots import StaticKVCache
from specserve.core.tree.draft_tree import DraftTree, block_nodes
from specserve.core.tree.shapes import ROOT
from specserve.core.verify.chain import (
    ChainVerdict,
    TokenKind,
    chain_rows_greedy,
    chain_rows_stochastic,
    chain_verdict,
)
from specserve.core.verify.grammar import RequestGrammar, mask_logits
from specserve.core.verify.invariant import invariant_scores
from specserve.core.verify.logprobs import TokenLogprob, logprob_tensors, read_logprobs
from specserve.core.verify.processors import PenaltyState
from specserve.core.verify.staged import Host, Staged
from specserve.core.verify.tree import TreeVerdict, greedy_tree_walk, sampled_tree_walk, tree_rows_stochastic
from specserve.core.verify.typical import verify_chain_typical, verify_tree_typical

FinishReason = Literal["eos", "length", "stop"]


class TargetSequence(Protocol):
    """The target's KV state for one sequence: ``length`` positions are cached."""

    @property
    def length(self) -> int: ...

    def forward(
        self, input_ids: torch.Tensor, last_only: bool = False, capture: FeatureCapture | None = None
    ) -> torch.Tensor:
        """Append ``input_ids`` ([k] int64) and return their next-token logits ([k, vocab]); with ``capture``, keep
        the block's features there (:class:`~specserve.core.model.causal_lm.FeatureCapture`)."""
        ...

    def rollback(self, length: int) -> None:
        """Keep the first ``length`` cached positions."""
        ...


class TreeSequence(TargetSequence, Protocol):
    """A sequence that can also verify a draft tree in one forward and keep only the accepted path."""

    def forward_tree(self, root: int, tree: DraftTree, capture: FeatureCapture | None = None) -> torch.Tensor:
        """Append ``[root] + tree nodes`` with tree attention; ``[n + 1, vocab]`` logits (row 0 after the root)."""
        ...

    def compact(self, keep: Sequence[int]) -> None:
        """Keep only the cached positions in ``keep`` (increasing), moved to contiguous positions."""
        ...


class LocalSequence:
    """A sequence whose KV cache lives in this process: a growing one, or a static-shape engine's preallocated
    slot (:class:`~specserve.core.static.slots.StaticKVCache`)."""

    def __init__(self, target: CausalLM, cache: KVCache | StaticKVCache | None = None) -> None:
        self.target = target
        self.cache = target.new_cache() if cache is None else cache

    @property
    def length(self) -> int:
        return self.cache.length

    def forward(
        self, input_ids: torch.Tensor, last_only: bool = False, capture: FeatureCapture | None = None
    ) -> torch.Tensor:
        return self.target.forward(self.cache, input_ids, last_only=last_only, capture=capture)

    def rollback(self, length: int) -> None:
        self.cache.rollback(length)

    def forward_tree(self, root: int, tree: DraftTree, capture: FeatureCapture | None = None) -> torch.Tensor:
        return self.target.forward_tree(self.cache, root, tree, capture=capture)

    def compact(self, keep: Sequence[int]) -> None:
        self.cache.compact(keep)


class PoolOps(Protocol):
    """What a batched step does to a KV pool: in this process (:class:`~specserve.core.batch_step.LocalPool`), or
    mirrored on every tensor-parallel rank (``specserve.actors``). Sequence ids are the pool's."""

    pool: KVPool

    def forward_batch(
        self,
        blocks: Sequence[BatchBlock],
        last_only: bool = False,
        capture: Sequence[FeatureCapture | None] | None = None,
    ) -> list[torch.Tensor]:
        """:meth:`~specserve.core.model.causal_lm.CausalLM.forward_batch` on the pool: per block its logits;
        ``capture``, one per block (or ``None``), is filled with each block's features."""
        ...

    def rollback(self, seq_id: int, length: int) -> None: ...

    def compact(self, seq_id: int, keep: Sequence[int]) -> None: ...


class PooledSequence:
    """A sequence whose KV lives in a :class:`~specserve.core.kv.pool.KVPool` (batched serving), as ``seq_id``.

    Its own forwards (a prefill, or a cycle verified alone) are one-row batched forwards; a batched step
    scores its block together with the other sequences' (:meth:`TargetVerifier.block`)."""

    def __init__(self, ops: PoolOps, seq_id: int) -> None:
        self.ops = ops
        self.seq_id = seq_id

    @property
    def length(self) -> int:
        return self.ops.pool.length(self.seq_id)

    def forward(
        self, input_ids: torch.Tensor, last_only: bool = False, capture: FeatureCapture | None = None
    ) -> torch.Tensor:
        logits = self.ops.forward_batch([BatchBlock.chain(self.seq_id, input_ids)], capture=[capture])[0]
        return logits[-1:] if last_only else logits

    def rollback(self, length: int) -> None:
        self.ops.rollback(self.seq_id, length)

    def forward_tree(self, root: int, tree: DraftTree, capture: FeatureCapture | None = None) -> torch.Tensor:
        return self.ops.forward_batch([BatchBlock.tree(self.seq_id, root, tree)], capture=[capture])[0]

    def compact(self, keep: Sequence[int]) -> None:
        self.ops.compact(self.seq_id, keep)


Verdict = ChainVerdict | TreeVerdict  # both name the accepted path (``accepted``) and the token after it


@dataclass(frozen=True)
class CycleOutcome:
    """What one verification decided and committed: the core result the engine, the drafter and the wire share."""

    verdict: Verdict  # what the rules decided, before any cut
    new_tokens: list[int]  # committed this cycle: accepted drafts + next token, cut at EOS / length
    finish: FinishReason | None  # "eos" or "length" when this cycle ended the request
    verify_seconds: float  # forward + verification + rollback
    committed_length: int  # committed tokens (prompt + output) after this cycle
    # with feature layers: [len(path) + 1, width], the features of the block's root and of the accepted path
    features: torch.Tensor | None = None
    allreduce_seconds: float = 0.0  # of verify_seconds, tensor-parallel all-reduces (rank 0's view)
    batch_size: int = 1  # requests verified in the same target forward (1 = alone)
    step_positions: int = 0  # positions that forward computed (rows x widest block); 0 = this block's alone
    # the target's greedy token after each probe node of the proposal (ProbingDrafter); () without a probe
    probe_argmax: tuple[int, ...] = ()
    # one per new token when the request asks for logprobs (specserve.core.verify.logprobs); () otherwise
    logprobs: tuple[TokenLogprob, ...] = ()


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
        feature_layers: Sequence[int] = (),
        grammar: RequestGrammar | None = None,
    ) -> None:
        """``feature_layers``: the target features a hidden-state drafter reads
        (:class:`~specserve.core.draft.drafter.FeatureDrafter`); :meth:`prefill` then returns the prompt's and each
        :class:`CycleOutcome` carries the cycle's. ``grammar``: the request's structured output
        (:mod:`specserve.core.verify.grammar`, compiled from ``params.grammar``), at the start of its output."""
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
        self.feature_layers = tuple(feature_layers)
        self.penalties: PenaltyState | None = None  # made at the first cycle, which knows the vocabulary
        self.output_logprobs: list[TokenLogprob] = []  # every output token's, when the request asks for them
        self.grammar = grammar
        if grammar is not None and params.prior_output_tokens:  # a resumed request: its earlier output matched
            grammar.advance(self.committed[len(self.committed) - params.prior_output_tokens :])
        # the proposal being verified, as the grammar cut it, and the kept nodes' indices (block, then decide)
        self._cut: tuple[Proposal, Proposal, list[int]] | None = None

    @property
    def num_output(self) -> int:
        return len(self.committed) - self.num_prompt

    @property
    def remaining(self) -> int:
        return self.max_new_tokens - self.num_output

    def prefill(self) -> torch.Tensor | None:
        """Cache the prompt but its last token; with feature layers, return those tokens' features."""
        capture = self.new_capture()
        if len(self.committed) > 1:
            ids = torch.tensor(self.committed[:-1], dtype=torch.long, device=self.device)
            self.sequence.forward(ids, last_only=True, capture=capture)
        elif capture is not None:
            capture.value = torch.empty(0, 0)
        return capture.take() if capture is not None else None

    @property
    def unprefilled(self) -> int:
        """Prompt tokens (all but the last) not yet cached: a chunked prefill feeds them over several steps."""
        return max(len(self.committed) - 1 - self.sequence.length, 0)

    def prefill_block(self, seq_id: int, budget: int) -> BatchBlock:
        """The next (at most ``budget``) uncached prompt tokens as one row of a batched forward, in the pool's
        sequence ``seq_id`` that holds this request's KV: a chunk of a prefill spread over several steps. The chunk
        starts at position ``sequence.length``; with feature layers, the forward's :meth:`new_capture` holds its
        features, which the drafter gets from that position on, chunk after chunk, as :meth:`prefill` would hand them
        over at once."""
        cached = self.sequence.length
        end = min(cached + budget, len(self.committed) - 1)
        if end <= cached:
            raise ValueError(f"nothing to prefill within a budget of {budget} (cached {cached} of the prompt)")
        return BatchBlock.chain(seq_id, torch.tensor(self.committed[cached:end], dtype=torch.long))

    def new_capture(self) -> FeatureCapture | None:
        """A capture of this request's feature layers for a forward over its tokens; ``None`` without any."""
        return FeatureCapture(self.feature_layers) if self.feature_layers else None

    def verify(self, proposal: Proposal) -> CycleOutcome:
        r"""One cycle: score ``[last committed] + proposal`` in one forward, decide by the chain rules (a
        :class:`~specserve.core.draft.drafter.Draft`) or the tree rules (a
        :class:`~specserve.core.tree.draft_tree.DraftTree`), commit, and roll the KV back (or compact it) to the
        committed text.

        With ``params.drafter_invariant`` (and T > 0) the greedy rule runs on log p + G from
        :mod:`specserve.core.verify.invariant`: q is ignored and the request's generator is not consumed, so the
        output does not depend on the drafter.

        A batched step splits this in two: the batch scores every request's :meth:`block` in one forward (with
        :meth:`new_capture` for its features), then each request's verifier decides on its own rows
        (:meth:`decide`)."""
        self._check_running()
        start = time.perf_counter()
        capture = self.new_capture()
        root = self.committed[-1]
        sent, scored = proposal, self._cut_to_grammar(proposal)  # the grammar's cut (the proposal without one)
        if isinstance(scored, Draft) and scored.probe is None:  # a chain needs no tree mask
            head = torch.tensor([root], dtype=torch.long, device=self.device)
            block = torch.cat([head, scored.tokens.to(self.device)])
            target_logits = self.sequence.forward(block, capture=capture)  # [gamma + 1, vocab]
        else:
            sequence = self.sequence
            if not (hasattr(sequence, "forward_tree") and hasattr(sequence, "compact")):
                raise NotImplementedError(f"{type(sequence).__name__} cannot verify draft trees; send chains")
            tokens, parents = block_nodes(scored.tokens.to(self.device), scored.parents, scored.probe)
            tree = scored if scored.probe is None and isinstance(scored, DraftTree) else DraftTree(tokens, parents)
            target_logits = sequence.forward_tree(root, tree, capture=capture)  # [n + probe + 1, vocab]
        return self.decide(sent, target_logits, start, capture.take() if capture is not None else None)

    def block(self, proposal: Proposal, seq_id: int) -> BatchBlock:
        """This cycle's verify block ``[last committed] + proposal`` as one row of a batched forward
        (:meth:`~specserve.core.model.causal_lm.CausalLM.forward_batch`) whose sequence ``seq_id`` holds this request's
        KV."""
        self._check_running()
        scored = self._cut_to_grammar(proposal)
        tokens, parents = block_nodes(scored.tokens, scored.parents, scored.probe)
        return BatchBlock.after(seq_id, self.committed[-1], tokens, parents)

    def _cut_to_grammar(self, proposal: Proposal) -> Proposal:
        """The proposal the target scores: ``proposal`` itself, or with a grammar, what is left once the nodes it
        can never accept are cut (:meth:`~specserve.core.verify.grammar.RequestGrammar.prune`); remembered for
        :meth:`decide`."""
        if self.grammar is None:
            return proposal
        if self._cut is not None and self._cut[0] is proposal:
            return self._cut[1]
        params = self.params
        decided_without_q = params.greedy or params.invariant_sampling or params.lossy_acceptance
        keep_refused = proposal.node_probs is not None and not decided_without_q
        scored, kept = self.grammar.prune(proposal, keep_refused)
        self._cut = (proposal, scored, kept)
        return scored

    def decide(
        self,
        proposal: Proposal,
        target_logits: torch.Tensor,  # [size + 1 (+ probe), vocab]: row 0 after the root, row i + 1 after node i
        start: float | None = None,
        features: torch.Tensor | None = None,  # [size + 1, width] the block's features (feature layers only)
    ) -> CycleOutcome:
        """Apply the exact rules to the cycle's logits, commit, and roll back or compact the KV, which holds the
        whole block (``start``: when the cycle's verification began, for its timing): :meth:`stage`, then its own
        copy to the host."""
        return self.stage(proposal, target_logits, start, features).complete()

    def stage(
        self,
        proposal: Proposal,
        target_logits: torch.Tensor,  # [size + 1 (+ probe), vocab]: row 0 after the root, row i + 1 after node i
        start: float | None = None,
        features: torch.Tensor | None = None,  # [size + 1, width] the block's features (feature layers only)
    ) -> Staged[CycleOutcome]:
        """:meth:`decide` up to the host: the rules' device work, and what the host needs of it as tensors
        (:mod:`specserve.core.verify.staged`), with the rest — the verdict, the commit, the rollback or compaction — to
        run once they are copied. A probe's rows follow the draft's: only their greedy tokens are kept (for the
        drafter); the rules never see them. Typical acceptance (lossy, opted into) still reads its own tensors while
        staging (its rule walks on the host). Nothing is committed until the verdict finishes; stage one cycle at a
        time."""
        self._check_running()
        start = time.perf_counter() if start is None else start
        sent, proposal = proposal, self._cut_to_grammar(proposal)  # the logits are the cut proposal's
        kept = self._cut[2] if self._cut is not None else []
        self._cut = None
        rows = proposal.size + 1
        tensors = {"finite": torch.isfinite(target_logits).all().reshape(1)}
        if proposal.probe is not None:
            tensors["probe"] = target_logits[rows:].argmax(dim=-1)
            target_logits = target_logits[:rows]
        raw_logits = target_logits
        tokens = proposal.tokens.to(self.device)
        if self.params.penalised:  # every row with its own history: the committed text and its path in the proposal
            target_logits = self._penalty_state(target_logits.shape[-1]).apply(target_logits, tokens, proposal.parents)
        if self.grammar is not None:  # every row masked to what the grammar allows after its own path
            target_logits = mask_logits(target_logits, self.grammar.row_masks(tokens, proposal.parents))
        tensors["tokens"] = tokens.long()
        if isinstance(proposal, Draft):  # which rules apply: the chain's or the tree's
            count, next_by_row = self._chain_rows(proposal, target_logits)
            tensors["count"] = count.reshape(1)
            eager: TreeVerdict | None = None
        else:
            next_by_row, chosen, eager = self._tree_rows(proposal, target_logits)
            if chosen is not None:
                tensors["chosen"] = chosen
        tensors["next"] = next_by_row
        if self.params.logprobs is not None:
            parent_rows = torch.tensor([parent + 1 for parent in proposal.parents], dtype=torch.long)
            rows_of = logprob_tensors(raw_logits, target_logits, parent_rows.to(self.device), tokens.long(),
                                      next_by_row, self.params)  # fmt: skip
            tensors.update({f"logprobs.{name}": t for name, t in rows_of.items()})

        def finish(host: Host) -> CycleOutcome:
            if not host["finite"][0]:
                raise RequestFailed("the target's logits for this request were not finite (NaN or infinity)")
            verdict: Verdict
            if isinstance(proposal, Draft):
                verdict = chain_verdict(host["count"][0], host["next"], proposal.size)
                new = [*host["tokens"][: verdict.num_accepted], verdict.next_token]
                rows_taken = list(range(verdict.num_accepted + 1))
            else:
                if eager is not None:
                    verdict = eager
                elif "chosen" in host:
                    verdict = sampled_tree_walk(host["chosen"], host["next"], proposal)
                else:
                    verdict = greedy_tree_walk(host["next"], host["tokens"], proposal)
                new, rows_taken = self._compact_to(proposal, verdict, host["tokens"])
            outcome = self._commit(verdict, new, start, features[rows_taken] if features is not None else None)
            if proposal is not sent:  # the verdict names the nodes of the proposal that was sent
                outcome = dataclasses.replace(outcome, verdict=_as_sent(outcome.verdict, sent, kept))
            if self.params.logprobs is not None:
                lp = {name.removeprefix("logprobs."): v for name, v in host.items() if name.startswith("logprobs.")}
                logprobs = read_logprobs(lp, outcome.new_tokens, verdict.accepted, rows_taken)
                self.output_logprobs.extend(logprobs)
                outcome = dataclasses.replace(outcome, logprobs=logprobs)
            if "probe" in host:
                outcome = dataclasses.replace(outcome, probe_argmax=tuple(host["probe"]))
            return outcome

        return Staged(tensors, finish)

    def _penalty_state(self, vocab: int) -> PenaltyState:
        if self.penalties is None:
            self.penalties = PenaltyState(self.params, self.committed[: self.num_prompt], vocab, self.device)
            self.penalties.commit(self.committed[self.num_prompt :])
        return self.penalties

    def _check_running(self) -> None:
        if self.finish is not None:
            raise RuntimeError(f"the request already finished ({self.finish})")

    def _chain_rows(self, draft: Draft, target_logits: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """The chain rules on the device: the accepted count and every row's next token
        (:func:`~specserve.core.verify.chain.chain_rows_greedy`)."""
        tokens = draft.tokens.to(self.device)
        if self.params.lossy_acceptance:
            # LOSSY, opted into (specserve.core.verify.typical): Medusa's typical acceptance; q unused; greedy at T = 0.
            # Its rule reads its own tensors: the verdict is made here, and its numbers travel as the others'.
            generator = None if self.params.greedy else self.generator
            eps, delta = self.params.typical_epsilon, self.params.typical_delta
            verdict = verify_chain_typical(warp_probs(target_logits, self.params), tokens, generator, eps, delta)
            count = torch.tensor(verdict.num_accepted, device=self.device)
            return count, torch.full((draft.size + 1,), verdict.next_token, device=self.device)
        if self.params.invariant_sampling:
            # Row j predicts position len(committed) + j; greedy rule on log p + G, q unused, generator untouched.
            first = len(self.committed)
            scores = invariant_scores(target_logits, self.params, range(first, first + target_logits.shape[0]))
            return chain_rows_greedy(scores, tokens)
        if self.params.greedy:
            return chain_rows_greedy(target_logits, tokens)
        draft_probs = draft.draft_probs.to(self.device) if draft.draft_probs is not None else None
        return chain_rows_stochastic(warp_probs(target_logits, self.params), tokens, draft_probs, self.generator)

    def _tree_rows(
        self, tree: DraftTree, target_logits: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor | None, TreeVerdict | None]:
        """The tree rules on the device: every row's next token and, for the sampled rule, its accepted child
        (``chosen``, -1 for none; :func:`~specserve.core.verify.tree.tree_rows_stochastic`); the greedy rules
        need only every row's argmax. The host walks them from the root. Typical acceptance decides here (its walk
        reads the tensors), and every row's next token is then the verdict's."""
        params = self.params
        if params.lossy_acceptance:  # LOSSY, opted into: Medusa's typical acceptance (specserve.core.verify.typical)
            generator = None if params.greedy else self.generator
            eps, delta = params.typical_epsilon, params.typical_delta
            verdict = verify_tree_typical(warp_probs(target_logits, params), tree, generator, eps, delta)
            return torch.full((tree.size + 1,), verdict.next_token, device=self.device), None, verdict
        if params.greedy:
            return target_logits.argmax(dim=-1), None, None
        if params.invariant_sampling:
            # Row 0 predicts position len(committed), row i + 1 (after node i) len(committed) + 1 + depth(i).
            first = len(self.committed)
            positions = [first, *(first + 1 + depth for depth in tree.depths)]
            return invariant_scores(target_logits, params, positions).argmax(dim=-1), None, None
        chosen, next_by_row = tree_rows_stochastic(warp_probs(target_logits, params), tree, self.generator)
        return next_by_row, chosen, None

    def _compact_to(self, tree: DraftTree, verdict: Verdict, tokens: Sequence[int]) -> tuple[list[int], list[int]]:
        """Keep only the accepted path of ``tree`` in the KV; the tokens the verdict commits and the rows they were
        chosen at (the root's, then the accepted nodes')."""
        sequence = self.sequence
        if not hasattr(sequence, "compact"):
            raise NotImplementedError(f"{type(sequence).__name__} cannot verify draft trees; send chains")
        cached = len(self.committed) - 1  # the KV before the block: the root (last committed token) went first
        sequence.compact([*range(cached + 1), *(cached + 1 + node for node in verdict.accepted)])
        path = [int(tokens[node]) for node in verdict.accepted]
        return [*path, verdict.next_token], [0, *(1 + node for node in verdict.accepted)]

    def _commit(
        self, verdict: Verdict, new: list[int], start: float, features: torch.Tensor | None = None
    ) -> CycleOutcome:
        """Cut the new tokens at ``max_new_tokens`` and EOS, commit them, roll the KV back to the committed text."""
        remaining = self.remaining
        if len(new) >= remaining:
            new, self.finish = new[:remaining], "length"
        for i, token in enumerate(new):
            if token in self.eos:
                new, self.finish = new[: i + 1], "eos"
                break
        self.committed.extend(new)
        if self.penalties is not None:
            self.penalties.commit(new)
        if self.grammar is not None:
            self.grammar.advance(new)
        self.sequence.rollback(len(self.committed) - 1)
        seconds = time.perf_counter() - start
        return CycleOutcome(verdict, new, self.finish, seconds, len(self.committed), features)

    def stop_at(self, num_output: int) -> None:
        """End the request with only its first ``num_output`` new tokens (a stop string matched)."""
        if not 0 <= num_output <= self.num_output:
            raise ValueError(f"cannot keep {num_output} of {self.num_output} new tokens")
        del self.committed[self.num_prompt + num_output :]
        del self.output_logprobs[num_output:]
        self.sequence.rollback(len(self.committed) - 1)
        self.finish = "stop"


def _as_sent(verdict: Verdict, sent: Proposal, kept: Sequence[int]) -> Verdict:
    """A verdict on the grammar's cut of ``sent`` (its nodes ``kept``), as a verdict on ``sent`` itself: the path
    renumbered, and the next token recovered when ``sent`` had children after the path (the grammar refused them)."""
    path = tuple(kept[node] for node in verdict.accepted)
    last = path[-1] if path else ROOT
    kind = TokenKind.RECOVERED if any(parent == last for parent in sent.parents) else TokenKind.BONUS
    if isinstance(verdict, ChainVerdict):
        return ChainVerdict(verdict.num_accepted, verdict.next_token, kind)
    return TreeVerdict(path, verdict.next_token, kind)
