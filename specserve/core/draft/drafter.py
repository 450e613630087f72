"""The drafter contract the engine loop talks to, and the draft it returns.

A drafter serves one request at a time:

1. ``start(prompt_ids, params, generator)`` resets it for a new request;
2. ``propose(budget)`` returns up to ``budget`` draft tokens that continue the committed text,
   with the exact distribution q each was sampled from, or ``None`` when the tokens were chosen
   deterministically (greedy, n-gram lookup) — verification then treats q as a point mass;
3. ``accept(committed)`` hands back the tokens the target committed this cycle (accepted draft
   tokens followed by the recovered or bonus token); the drafter rolls its own state back to
   the longest prefix that is still valid;
4. ``rewind(length)`` drops committed text beyond ``length`` tokens (used when a drafter has
   been told an assumed verdict in overlap mode and the real one differs).

A request may choose among the drafters of a :class:`DrafterSet` by name (``REQUEST_DRAFTERS``):
the configured one (``default``), or the model-free ``ngram``, ``suffix``, ``lookahead`` and ``none``, built on
first use by a builder the caller supplies. Drafter implementations live in ``specserve.drafters`` (whose
registry supplies that builder); this module defines only the contract and the set.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import ClassVar, Protocol, runtime_checkable

import torch

from specserve.core.draft.schedule import Budget
from specserve.core.errors import InvalidRequest
from specserve.core.kv.cache import KVCache
from specserve.core.kv.pool import KVPool
from specserve.core.sampling.params import SamplingParams
from specserve.core.tree.draft_tree import (
    ChildSampling,
    DraftTree,
    PathVerdict,
    VerifyRules,
    check_probe,
    committed_tokens,
)
from specserve.core.tree.shapes import InvalidTree, TreeSpec

# The drafters a request may choose: the deployment's configured one, prompt lookup, suffix decoding, Lookahead
# decoding (its defaults), or none (plain decoding). A draft model other than the configured one cannot be chosen
# per request.
REQUEST_DRAFTERS = ("default", "ngram", "suffix", "lookahead", "none")


@dataclass(frozen=True)
class Draft:
    """A draft chain, verified by the chain rules (rule A; D without q).

    It offers the same proposal interface as :class:`~specserve.core.tree.draft_tree.DraftTree` (``size``,
    ``depth``, ``parents``, ``node_probs``, ``rules``, ``to``, ``truncate``, ``committed_by``), so
    callers handle a :data:`Proposal` without asking which of the two it is.
    """

    tokens: torch.Tensor  # [gamma] int64, on the target's device
    draft_probs: torch.Tensor | None  # [gamma, vocab] the exact q of each token; None = point mass
    probe: DraftTree | None = None  # nodes computed but not verified (see ProbingDrafter); None for most drafters

    rules: ClassVar[VerifyRules] = VerifyRules.CHAIN

    def __post_init__(self) -> None:
        check_probe(self.probe)

    @property
    def gamma(self) -> int:
        return int(self.tokens.shape[0])

    @staticmethod
    def empty(device: torch.device | str = "cpu") -> Draft:
        return Draft(torch.empty(0, dtype=torch.long, device=device), None)

    # The proposal interface (shared with DraftTree) ----------------------------------------------

    @property
    def size(self) -> int:
        """Draft nodes the target verifies."""
        return self.gamma

    @property
    def depth(self) -> int:
        return self.gamma

    @property
    def parents(self) -> tuple[int, ...]:
        return tuple(range(-1, self.gamma - 1))

    @property
    def node_probs(self) -> torch.Tensor | None:
        """[gamma, vocab]: per token, the q it was drawn from; None = deterministic."""
        return self.draft_probs

    def to(self, device: torch.device | str) -> Draft:
        probs = self.draft_probs.to(device) if self.draft_probs is not None else None
        probe = self.probe.to(device) if self.probe is not None else None
        return Draft(self.tokens.to(device), probs, probe)

    def truncate(self, max_depth: int) -> Draft:
        """The first ``max_depth`` tokens (all of them when the chain is no longer); the probe is kept whole."""
        if self.gamma <= max_depth:
            return self
        keep = max(max_depth, 0)
        probs = self.draft_probs[:keep] if self.draft_probs is not None else None
        return Draft(self.tokens[:keep], probs, self.probe)

    def committed_by(self, verdict: PathVerdict) -> list[int]:
        """The tokens a verdict on this chain commits (accepted prefix + next token), checked against the chain."""
        return committed_tokens(self.tokens, self.parents, verdict, kind="chain")


# What a drafter sends the target each cycle. Both kinds offer one interface: size, depth, parents, node_probs,
# rules, to(device), truncate(max_depth), committed_by(verdict). Only the verifier tells them apart (it applies
# the chain or the tree rules), and proposal_from_nodes builds one from wire-level fields.
Proposal = Draft | DraftTree


def proposal_from_nodes(
    tokens: torch.Tensor,  # [n] int64
    parents: tuple[int, ...],  # [n]
    node_probs: torch.Tensor | None,  # [n, vocab]: the q each node was drawn from; None = deterministic
    rules: VerifyRules,
) -> Proposal:
    """The proposal with these nodes under ``rules`` (how the wire describes one); raises
    :class:`~specserve.core.tree.draft_tree.InvalidTree` when the nodes do not fit the rules."""
    if rules is VerifyRules.CHAIN:
        if tuple(parents) != tuple(range(-1, len(parents) - 1)):
            raise InvalidTree("a draft sent under the chain rules must be a chain (parents -1, 0, 1, ...)")
        return Draft(tokens, node_probs)
    sampling = ChildSampling.IID if rules is VerifyRules.TREE_IID else ChildSampling.WITHOUT_REPLACEMENT
    return DraftTree.from_node_probs(tokens, parents, node_probs, sampling)


@runtime_checkable
class Drafter(Protocol):
    name: str

    def start(self, prompt_ids: Sequence[int], params: SamplingParams, generator: torch.Generator) -> None: ...

    def propose(self, budget: int) -> Draft: ...

    def accept(self, committed: Sequence[int]) -> None: ...

    def rewind(self, length: int) -> None:
        """Forget the committed text beyond its first ``length`` tokens (overlap mode drafts ahead
        on an assumed verdict and rewinds when the real one differs)."""
        ...


@runtime_checkable
class TreeDrafter(Drafter, Protocol):
    """A drafter that can also propose a draft tree (static topology or dynamic budget) after the committed text."""

    def propose_tree(self, spec: TreeSpec) -> DraftTree: ...


@runtime_checkable
class FeatureDrafter(Drafter, Protocol):
    """A drafter that drafts from the target's own hidden states (EAGLE, Medusa).

    ``feature_layers`` index the target's ``hidden_states`` as transformers returns them: 0 = the
    embeddings, i = the output of decoder layer i, and the last (= the number of layers) the
    output of the final norm. The target's *feature* of position t is those states of token t
    concatenated in that order (``[len(feature_layers) * hidden]``); it depends on tokens 0..t only.

    The runtime hands them over as the target computes them: after the prefill the features of
    every prompt token but the last (``add_features(0, ...)``), and after each verdict those of
    the block's root (the last token committed before the cycle) and of the accepted draft
    tokens, starting at the root's position. So before each proposal the drafter knows the
    features of every committed token except the last one.
    """

    feature_layers: tuple[int, ...]

    def add_features(self, start: int, features: torch.Tensor) -> None:
        """The features ``[k, len(feature_layers) * hidden]`` of committed positions ``start .. start + k - 1``."""
        ...


@runtime_checkable
class ProbingDrafter(Drafter, Protocol):
    """A drafter that has the target compute extra rows in the verify forward (Lookahead decoding's Jacobi window).

    Its proposals carry a ``probe``: a deterministic tree of nodes after the root that the target scores in the
    same forward as the draft but never verifies. With tree attention no draft node sees a probe node, so the
    draft's logits, the verdict and the output are exactly what they would be without it; the probe's KV is
    dropped with the rejected nodes. The cycle's :class:`~specserve.core.target.CycleOutcome` carries the target's
    greedy token after each probe node (``probe_argmax``), which the runtime hands back through
    :meth:`observe_probe` after ``accept``. Drafts that depend on it are still functions of the committed text and
    earlier cycles only, so verification stays exact at any temperature.

    ``probe_nodes`` bounds a probe's size: a request reserves that much KV room beyond its draft.
    """

    probe_nodes: int

    def observe_probe(self, probe: DraftTree, argmax: Sequence[int]) -> None:
        """The target's greedy next token after each node of ``probe`` (the probe this drafter last proposed)."""
        ...


@runtime_checkable
class CountingDrafter(Protocol):
    """A drafter that counts what it did for the current request (suffix and REST: matches and match lengths;
    Lookahead: pool hits and the n-grams its window made). The engines add the counters to the request's
    :class:`~specserve.core.stats.RequestStats` (``drafter_counters``) when it ends; they are additive, so a
    benchmark sums them over requests."""

    def request_counters(self) -> dict[str, int]:
        """This request's counters (since ``start``)."""
        ...


def drafter_counters(drafter: Drafter) -> dict[str, int]:
    """``drafter``'s counters for its current request; empty for a drafter that counts nothing."""
    return drafter.request_counters() if isinstance(drafter, CountingDrafter) else {}


def probe_nodes(drafter: Drafter) -> int:
    """The most probe nodes ``drafter``'s proposals carry (0 for a drafter that sends none)."""
    return drafter.probe_nodes if isinstance(drafter, ProbingDrafter) else 0


@runtime_checkable
class SharesTargetKV(Protocol):
    """A drafter whose model is the target's own first layers (layer-skip), which can read the target's KV.

    In one process the engine hands it the request's target cache after ``start``. Before each
    proposal that cache holds the committed text but its last token — exactly what the drafter's
    layers would compute — so the drafter feeds only the last committed token and its drafts, into
    the target cache's first layers, and rolls those layers back to the committed text before the
    target verifies. A drafter in another process keeps its own cache.
    """

    def share_target_cache(self, cache: KVCache) -> None: ...


@runtime_checkable
class ReadsTargetPool(Protocol):
    """A drafter made of the target's own first layers (layer-skip) in a batched engine of this process.

    After ``start`` the engine hands it the pool and the request's sequence. Before each proposal the request's span
    holds the committed text but its last token, as the target's own layers computed it — what the drafter's layers
    would compute — so the drafter copies the keys and values its cache lacks from there instead of computing them: a
    catch-up after cycles it did not draft (the adaptive policy's plain cycles, a probe after a pause) is a copy, not a
    forward over every token it missed. Its drafts' keys stay in its own cache; the span is the target's alone.
    """

    def follow_target_pool(self, pool: KVPool, sequence: int) -> None: ...


@runtime_checkable
class PrefixReusing(Protocol):
    """A hidden-state drafter whose per-request state outlives the request, for later ones that share its prefix.

    A request served from the target's prefix cache (:mod:`specserve.core.kv.prefix_cache`) computes no target forward
    over its cached prefix, so the target hands its drafter no features there. A drafter of this kind keeps them
    itself (:mod:`specserve.core.kv.prefix_store`): after ``start``, :meth:`reuse_prefix` takes what it holds of a
    prefix of ``tokens`` (the prompt's cacheable positions) and returns how many positions it now knows — the
    request takes no more of the target's cached KV than that — and :meth:`keep_prefix` offers the state of the
    request that ended to later ones. A hidden-state drafter without it reuses nothing: its requests prefill whole.
    """

    def reuse_prefix(self, namespace: str, tokens: Sequence[int]) -> int: ...

    def keep_prefix(self) -> None: ...


@runtime_checkable
class ChainBatcher(Protocol):
    """Drafts chains for several requests at once, in shared forwards (a draft model over one KV pool)."""

    def propose_chains(self, drafters: Sequence[Drafter], budgets: Sequence[int]) -> list[Draft]:
        """What ``[d.propose(b) for d, b in zip(drafters, budgets)]`` returns — the same tokens, the same q, the
        same draws from each request's own generator, in that order — in fewer forwards. Every drafter given
        is a :class:`BatchedDrafter` whose ``batcher`` is this one; a budget may be 0 (an empty draft).

        A batcher may also set ``catch_up_seconds`` (per drafter of the call, in order): the seconds spent
        catching that drafter alone up on text it had not seen (a newcomer's prompt), which the caller charges to
        it rather than sharing among the batch."""
        ...


@runtime_checkable
class BatchedDrafter(Drafter, Protocol):
    """A request's drafter whose chains can be drafted together with other requests' (see :class:`ChainBatcher`).

    The batched engine groups the running requests' drafters by ``batcher`` and asks each group for its chains
    in one call; alone, ``propose`` still works. ``release`` gives back what the request held (a slot of the
    batcher's KV pool) when the request ends or is cancelled; ``start`` takes it again.
    """

    batcher: ChainBatcher

    def release(self) -> None: ...


def propose(drafter: Drafter, budget: Budget, remaining: int, device: torch.device | str = "cpu") -> Proposal:
    """The drafter's proposal for ``budget`` (a chain of ``budget.gamma`` tokens, or a tree of ``budget.tree``'s
    shape), never deeper than ``remaining - 1``: the verdict always adds one more token. A drafter that overruns
    its budget is trimmed rather than trusted."""
    limit = remaining - 1
    proposal: Proposal
    if limit <= 0:  # the request's last token: nothing drafted could be verified
        return Draft.empty(device)
    if budget.tree is not None:
        check_can_draft(drafter, budget.tree)
        assert isinstance(drafter, TreeDrafter)
        proposal = drafter.propose_tree(budget.tree)
    else:
        limit = min(budget.gamma, limit)
        if limit <= 0:
            return Draft.empty(device)
        proposal = drafter.propose(limit)
    return proposal.truncate(limit).to(device)


def check_chain_call(drafters: Sequence[Drafter], budgets: Sequence[int]) -> None:
    """What every :class:`ChainBatcher` refuses before any forward: not one budget per drafter, a drafter twice."""
    if len(drafters) != len(budgets):
        raise ValueError(f"{len(drafters)} drafters but {len(budgets)} budgets")
    if len({id(drafter) for drafter in drafters}) < len(drafters):
        raise ValueError("a drafter appears more than once in one call")


def check_can_draft(drafter: Drafter, tree: TreeSpec | None, name: str | None = None) -> None:
    """Raises :class:`InvalidRequest` when ``tree`` asks for draft trees from a drafter that drafts only chains."""
    if tree is not None and not isinstance(drafter, TreeDrafter):
        raise InvalidRequest(
            f"the {name or drafter.name!r} drafter cannot draft trees; use one that can (a draft model, ngram, "
            "suffix), or chains"
        )


def check_drafter_name(name: str) -> None:
    """Raises :class:`InvalidRequest` unless ``name`` is one of ``REQUEST_DRAFTERS``."""
    if name not in REQUEST_DRAFTERS:
        allowed = ", ".join(repr(n) for n in REQUEST_DRAFTERS)
        raise InvalidRequest(
            f"drafter must be one of {allowed} (a draft model is chosen when the deployment starts), got {name!r}"
        )


class DrafterSet:
    """The drafters requests may choose by name: the configured one, and the others built once, on first use.

    ``build(name)`` makes the drafter called ``name`` (``"ngram"``, ``"suffix"`` or ``"none"``); without it only the
    configured drafter can be chosen. When the configured drafter is itself ``ngram`` or ``none``,
    ``default`` and that name are the same object. Not thread-safe: like a drafter, a set serves
    one request at a time.
    """

    def __init__(self, configured: Drafter, build: Callable[[str], Drafter] | None = None) -> None:
        self.configured = configured
        self._build = build
        self._built: dict[str, Drafter] = {"default": configured}
        if configured.name in REQUEST_DRAFTERS:
            self._built[configured.name] = configured

    def check(self, name: str) -> None:
        """Raises :class:`InvalidRequest` when ``get(name)`` cannot give a drafter (builds nothing)."""
        check_drafter_name(name)
        if name not in self._built and self._build is None:
            raise InvalidRequest(
                f"drafter {name!r} is not available here: only the configured drafter "
                f"({self.configured.name!r}, request it as 'default') can be used"
            )

    def get(self, name: str = "default") -> Drafter:
        """The drafter called ``name``, built on the first request that asks for it and kept."""
        self.check(name)
        if name not in self._built:
            assert self._build is not None
            self._built[name] = self._build(name)
        return self._built[name]
