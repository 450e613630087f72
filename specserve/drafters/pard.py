"""PARD drafting: a draft causal LM that proposes a whole block of K tokens in one forward.

PARD (AMD, "PARD: Accelerating LLM Inference with Low-Cost PARallel Draft Model Adaptation", 2025;
``AMD-AGI/PARD``, checkpoints such as ``amd/PARD-Llama-3.2-1B``) adapts a small causal LM of the target's family
to predict several tokens at once. Its checkpoint is a plain Hugging Face causal-LM directory, loaded with no custom
code, whose ``config.json`` adds two fields:

* ``pard_token`` — a token id of the vocabulary that text never uses (the mask token);
* ``spd_type: "pard"`` — says what the checkpoint is for.

**One drafting step** for a chain of K: the tokens the draft has not cached yet (the last cycle's committed tokens,
usually one or two) followed by K − 1 copies of ``pard_token``, in one causal forward at consecutive positions; the
logits at the last K positions give drafts 1 .. K (the last real token's position predicts draft 1, the j-th mask's
draft j + 1). The mask entries are cut from the drafter's KV cache at once, so the cache holds committed text only
and the next step re-reads what was accepted.

**What q is sent.** Each draft is drawn from its own position's distribution, warped with the request's
temperature, top-k and top-p, and that distribution is sent as its q. It does not depend on the block's earlier
drafts — the mask positions do not see them — which exact rejection sampling allows: q only has to be the law the
token was actually drawn from, given everything before it. Greedy requests send the argmax and no q (a point mass);
drafter-invariant requests (:mod:`specserve.core.verify.invariant`) send argmax(log q + G) at each position, no q.
Under a grammar each position's logits are masked by what the grammar allows after the drafts before it.

**Trees**: each block position's top tokens fill the topology as Medusa's heads do
(:func:`~specserve.drafters.medusa.tree_from_candidates`: the node at index path ``(r_0, .., r_d)`` is position
d + 1's rank-``r_d`` token), deterministic, so exact at any temperature; a dynamic budget becomes Medusa's best-first
topology of :data:`~specserve.drafters.medusa.DEFAULT_RANK_PROBS`. The block is as deep as the tree.

Not here: one forward for the blocks of many requests (each request drafts alone in a batched step), static shapes,
training (``specserve train pard`` is to come).
"""

from __future__ import annotations

import json
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import torch

from specserve.core.draft.drafter import Draft
from specserve.core.errors import UserError
from specserve.core.kv.prefix_index import common_prefix
from specserve.core.model.causal_lm import CausalLM, TargetDescription
from specserve.core.sampling.params import SamplingParams
from specserve.core.sampling.warps import sample, warp_probs
from specserve.core.static.options import StaticOptions
from specserve.core.tree.draft_tree import DraftTree
from specserve.core.tree.shapes import TreeBudget, TreeSpec, TreeTopology
from specserve.core.verify.grammar import DraftGrammar, mask_logits
from specserve.core.verify.invariant import invariant_tokens
from specserve.drafters.medusa import DEFAULT_RANK_PROBS, tree_from_candidates
from specserve.drafters.model import DraftModelDrafter

SPD_TYPE = "pard"


class InvalidPardCheckpoint(UserError):
    """A directory given as ``pard:DIR`` that is not a PARD checkpoint for this target; the message says why."""


def pard_token_of(directory: str | Path, vocab_size: int) -> int:
    """The mask token id a PARD checkpoint's ``config.json`` names, checked: ``spd_type`` is ``"pard"`` (when
    given) and ``pard_token`` an id of the model's vocabulary."""
    where = Path(directory) / "config.json"
    try:
        config: Any = json.loads(where.read_text(encoding="utf-8"))
    except (OSError, json.JSONDecodeError) as exc:
        raise InvalidPardCheckpoint(f"{where}: cannot read a PARD config ({exc})") from exc
    spd_type = config.get("spd_type") if isinstance(config, dict) else None
    if spd_type is not None and spd_type != SPD_TYPE:
        raise InvalidPardCheckpoint(f"{where}: spd_type is {spd_type!r}, not {SPD_TYPE!r}: not a PARD checkpoint")
    token = config.get("pard_token") if isinstance(config, dict) else None
    if token is None:
        raise InvalidPardCheckpoint(
            f"{where} has no pard_token: not a PARD checkpoint (a plain draft model is --draft DIR, without pard:)"
        )
    if isinstance(token, bool) or not isinstance(token, int) or not 0 <= token < vocab_size:
        raise InvalidPardCheckpoint(f"{where}: pard_token {token!r} is not an id of its vocabulary of {vocab_size}")
    return token


class PardDrafter(DraftModelDrafter):
    """Drafts a block of K tokens in one forward of a PARD draft model (its KV cache holds committed text only)."""

    name = "pard"

    def __init__(self, draft: CausalLM, pard_token: int, target: CausalLM | TargetDescription | None = None) -> None:
        super().__init__(draft, target)
        if not 0 <= pard_token < draft.info.vocab_size:
            raise InvalidPardCheckpoint(f"pard_token {pard_token} is outside the vocabulary of {draft.info.vocab_size}")
        self.pard_token = pard_token
        self._target = target
        self._topologies: dict[TreeBudget, TreeTopology] = {}
        self._forwards = 0  # this request's draft forwards (one per proposal, whatever its size)

    @classmethod
    def load(
        cls, directory: str | Path, target: CausalLM | TargetDescription, dtype: str = "float32", device: str = "cpu"
    ) -> PardDrafter:
        """The PARD checkpoint in ``directory`` (``pard:DIR``), checked against the target's vocabulary."""
        model = CausalLM.load(Path(directory), dtype=dtype, device=device)
        return cls(model, pard_token_of(directory, model.info.vocab_size), target)

    def fresh(self) -> PardDrafter:
        """A drafter for another request over the same model (shared, not copied)."""
        return type(self)(self.model, self.pard_token, self._target)

    def start(self, prompt_ids: Sequence[int], params: SamplingParams, generator: torch.Generator) -> None:
        super().start(prompt_ids, params, generator)
        self._forwards = 0

    def request_counters(self) -> dict[str, int]:
        """This request's block forwards (``CountingDrafter``): one per proposal, chain or tree."""
        return {"pard_forwards": self._forwards}

    def use_static_shapes(self, options: StaticOptions) -> None:
        """PARD's block forwards run eagerly, on a growing cache (static shapes are not built for them yet)."""

    # Drafting --------------------------------------------------------------------------------

    def _block_logits(self, size: int) -> torch.Tensor:  # [size, vocab]: drafts 1 .. size's logits
        """Feed what the cache lacks, then ``size - 1`` mask tokens, in one forward; cut the masks from the cache."""
        assert self._cache is not None, "start() must be called before propose()"
        keep = max(
            0, min(common_prefix(self._cached, self._context), len(self._context) - 1)
        )  # feed the last one at least
        self._cache.rollback(keep)
        block = [*self._context[keep:], *[self.pard_token] * (size - 1)]
        logits = self.model.forward(self._cache, torch.tensor(block, dtype=torch.long))[-size:]
        self._cache.rollback(len(self._context))
        self._cached = self._context[:]
        self._forwards += 1
        return logits

    def propose(self, budget: int) -> Draft:
        budget = min(budget, self.model.info.max_positions - len(self._context))
        if budget <= 0:
            return Draft.empty(self._output_device)
        logits = self._block_logits(budget)
        return choose_block(logits, self._params, self._grammar, self._generator, self._context).to(self._output_device)

    def propose_tree(self, spec: TreeSpec) -> DraftTree:
        """The static topology of ``spec`` (or of its dynamic budget) filled with each block position's top tokens."""
        topology = tree_topology(spec, self._topologies)
        depth = min(max((len(path) for path in topology.paths), default=0), self._room())
        if depth <= 0:
            return DraftTree.empty(self._output_device)
        return block_tree(self._block_logits(depth), topology, self._output_device)

    def _room(self) -> int:
        return self.model.info.max_positions - len(self._context)


# ---------------------------------------------------------------------------------------------
# What a block's logits become (one request alone, or a row of a batched forward)


def choose_block(
    logits: torch.Tensor,  # [K, vocab]: drafts 1 .. K's logits
    params: SamplingParams,
    grammar: DraftGrammar | None,
    generator: torch.Generator | None,
    context: Sequence[int],  # the committed text the block continues
) -> Draft:
    """The block's drafts: each position's argmax (greedy), keyed-noise token (drafter-invariant) or draw from its
    warped law, sent as q; under a grammar each position masked by what it allows after the drafts before it, and
    the block cut where the text ends. On the logits' device."""
    first, size = len(context), logits.shape[0]
    if grammar is None and params.greedy:
        return Draft(logits.argmax(-1), None)
    if grammar is None and params.invariant_sampling:
        return Draft(invariant_tokens(logits, params, range(first, first + size)), None)
    if grammar is not None:
        grammar.sync(context)
    tokens: list[torch.Tensor] = []
    probs: list[torch.Tensor] = []
    for i in range(size):
        row = logits[i]
        if grammar is not None:  # what the grammar allows after the text and the drafts before this one
            row = mask_logits(row, grammar.allowed())
        if params.greedy:
            token = row.argmax(-1)
        elif params.invariant_sampling:
            token = invariant_tokens(row[None], params, [first + i])[0]
        else:
            assert generator is not None
            warped = warp_probs(row, params)
            token = sample(warped, generator)
            probs.append(warped)
        tokens.append(token)
        if grammar is not None and not grammar.push(int(token)):
            break  # the text ends here: nothing to draft after it
    if grammar is not None:
        grammar.rewind_drafts()
    return Draft(torch.stack(tokens), torch.stack(probs) if probs else None)


def tree_topology(spec: TreeSpec, cache: dict[TreeBudget, TreeTopology]) -> TreeTopology:
    """The static shape of ``spec``: its topology, or the best-first topology of the default rank rates that its
    dynamic budget stands for (kept in ``cache``)."""
    if spec.kind == "static":
        assert spec.topology is not None
        return spec.topology
    budget = spec.budget
    assert budget is not None, "a dynamic tree spec carries a budget"
    if budget not in cache:
        cache[budget] = TreeTopology.best_first(budget.nodes, DEFAULT_RANK_PROBS[: budget.width], budget.depth)
    return cache[budget]


def block_tree(logits: torch.Tensor, topology: TreeTopology, device: torch.device) -> DraftTree:
    """``topology`` (cut to the block's depth) filled with each block position's top tokens."""
    depth = logits.shape[0]
    width = 1 + max(path[-1] for path in topology.paths if len(path) <= depth)
    ranked = logits.topk(min(width, logits.shape[-1]), dim=-1).indices
    tokens, parents = tree_from_candidates(ranked.tolist(), topology)
    return DraftTree(torch.tensor(tokens, dtype=torch.long, device=device), parents)
