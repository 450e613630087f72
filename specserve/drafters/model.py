"""Draft-model drafting: a small causal LM sharing the target's vocabulary proposes gamma tokens.

At temperature 0 the drafter proposes its argmax and sends no q. Otherwise it samples each
token from its own distribution warped with the request's temperature / top-k / top-p, and
sends exactly that distribution as q, which is what exact rejection sampling needs. In the
drafter-invariant mode (``SamplingParams.drafter_invariant``, :mod:`specserve.core.verify.invariant`) it
couples to the verifier's noise instead: the token at absolute position t is
argmax(log q_t + G_t) with the same keyed Gumbel noise G_t the target uses, sent without q (a point
mass, which the greedy-on-scores rule of that mode accepts whenever it equals the target's token).

The drafter keeps its own KV cache. Before proposing it rolls the cache back to the longest
prefix shared with the committed text and feeds the rest in one forward (usually one or two
tokens), so rejected draft tokens never leak into later proposals.

Under a grammar (structured output) the drafter drafts only what the grammar allows: each step's logits are
masked by the request's grammar after the committed text and the tokens drafted so far
(:class:`~specserve.core.verify.grammar.DraftGrammar`), so the q it sends is the masked law it sampled from, and it
stops at the end of the text. Without that, most of its drafts would be cut by the verifier.

Trees (:meth:`DraftModelDrafter.propose_tree`) are drafted by a
:class:`~specserve.drafters.tree.TreeModelDrafter` on the same model, with a cache of its own.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from specserve.core.draft.drafter import Draft
from specserve.core.kv.cache import KVCache
from specserve.core.kv.prefix_index import common_prefix
from specserve.core.model.causal_lm import CausalLM, TargetDescription
from specserve.core.sampling.params import SamplingParams
from specserve.core.sampling.warps import sample, warp_probs
from specserve.core.static.options import StaticOptions
from specserve.core.static.slots import StaticKVCache, StaticTarget
from specserve.core.tree.draft_tree import DraftTree
from specserve.core.tree.shapes import TreeSpec
from specserve.core.verify.grammar import DraftGrammar, mask_logits
from specserve.core.verify.invariant import invariant_tokens
from specserve.drafters.tree import TreeModelDrafter
from specserve.drafters.vocabulary import check_same_vocabulary


class DraftModelDrafter:
    name = "model"

    def __init__(self, draft: CausalLM, target: CausalLM | TargetDescription | None = None) -> None:
        if target is not None:
            check_same_vocabulary(target, draft)
        self.model = draft
        self._output_device = target.device if target is not None else draft.device
        self._cache: KVCache | StaticKVCache | None = None
        self._cached: list[int] = []  # tokens whose keys/values are in the cache, in order
        self._context: list[int] = []  # committed tokens of the current request
        self._params = SamplingParams()
        self._generator: torch.Generator | None = None
        self._trees: TreeModelDrafter | None = None  # once trees are asked for: its own cache, this context
        self._grammar: DraftGrammar | None = None  # the request's grammar (structured output), if any
        self._static: StaticTarget | None = None  # static shapes for the chain steps (use_static_shapes)

    def use_static_shapes(self, options: StaticOptions) -> None:
        """Draft chains on the static-shape engine (:mod:`specserve.core.static.slots`): a preallocated cache, the
        catch-up block padded to a bucket, and on a GPU each one-token step replayed as a CUDA graph. Trees keep a
        growing cache of their own."""
        self._static = StaticTarget(self.model, options)
        self._static.capture(last_only=(True,))  # the one-token steps and the catch-up blocks, once per load

    def start(self, prompt_ids: Sequence[int], params: SamplingParams, generator: torch.Generator) -> None:
        if isinstance(self._cache, StaticKVCache):  # a static slot goes back to its owner
            self._cache.release()
        self._cache = self.model.new_cache() if self._static is None else self._static.new_cache()
        self._trees = None
        self._cached = []
        self._context = list(prompt_ids)
        self._params = params
        self._generator = generator
        self._grammar = DraftGrammar.of(params, self.model.tokenizer, self.model.info, len(prompt_ids))

    @property
    def context(self) -> tuple[int, ...]:
        """The committed tokens this drafter continues (prompt and output)."""
        return tuple(self._context)

    def accept(self, committed: Sequence[int]) -> None:
        self._context.extend(committed)

    def propose_tree(self, spec: TreeSpec) -> DraftTree:
        """A draft tree after the committed text (deterministic top-k children: exact at any temperature)."""
        if self._trees is None:
            self._trees = TreeModelDrafter(self.model)
            self._trees.start(self._context)
        self._trees.context = self._context  # the same list: accept() and rewind() keep both in step
        self._trees.configure(self._params, self._generator)
        return self._trees.propose_tree(spec).to(self._output_device)

    def rewind(self, length: int) -> None:
        if not 0 <= length <= len(self._context):
            raise ValueError(f"cannot rewind {len(self._context)} committed tokens to {length}")
        del self._context[length:]

    def _catch_up(self) -> torch.Tensor:  # [vocab] logits for the token after the context
        assert self._cache is not None, "start() must be called before propose()"
        keep = max(0, min(common_prefix(self._cached, self._context), len(self._context) - 1))
        self._cache.rollback(keep)
        new = self._context[keep:]
        logits = self.model.forward(self._cache, torch.tensor(new, dtype=torch.long), last_only=True)[-1]
        self._cached = self._context[:]
        return logits

    def propose(self, budget: int) -> Draft:
        budget = min(budget, self.model.info.max_positions - len(self._context))
        if budget <= 0:
            return Draft.empty(self._output_device)
        logits = self._catch_up()
        tokens: list[torch.Tensor] = []
        probs: list[torch.Tensor] = []
        greedy = self._params.greedy
        coupled = self._params.invariant_sampling
        first = len(self._context)  # the absolute position of the first proposed token
        grammar = self._grammar
        if grammar is not None:
            grammar.sync(self._context)
        for i in range(budget):
            if grammar is not None:  # only what the grammar allows after the text and the drafts so far
                logits = mask_logits(logits, grammar.allowed())
            if greedy:
                token = logits.argmax(-1)
            elif coupled:  # argmax(log q + G) at this position; no q is sent
                token = invariant_tokens(logits[None], self._params, [first + i])[0]
            else:
                assert self._generator is not None
                row = warp_probs(logits, self._params)
                token = sample(row, self._generator)
                probs.append(row)
            tokens.append(token)
            if grammar is not None and not grammar.push(int(token)):
                break  # the text ends here: nothing to draft after it
            if i + 1 < budget:
                assert self._cache is not None
                logits = self.model.forward(self._cache, token.reshape(1), last_only=True)[-1]
        if grammar is not None:
            grammar.rewind_drafts()
        token_tensor = torch.stack(tokens).to(self._output_device)
        self._cached.extend(int(t) for t in token_tensor[:-1].tolist())
        draft_probs = torch.stack(probs).to(self._output_device) if probs else None
        return Draft(token_tensor, draft_probs)
