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
the configured one (``default``), or the model-free ``ngram`` and ``none``, built on first use by
a builder the caller supplies. Drafter implementations live in ``specserve.drafters`` (whose
registry supplies that builder); this module defines only the contract and the set.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Protocol, runtime_checkable

import torch

from specserve.core.model import KVCache
from specserve.core.prompts import InvalidRequest
from specserve.core.sampling import SamplingParams
from specserve.core.tree import DraftTree, TreeSpec

# The drafters a request may choose: the deployment's configured one, prompt lookup, or none (plain
# decoding). A draft model other than the configured one cannot be chosen per request.
REQUEST_DRAFTERS = ("default", "ngram", "none")


@dataclass(frozen=True)
class Draft:
    tokens: torch.Tensor  # [gamma] int64, on the target's device
    draft_probs: torch.Tensor | None  # [gamma, vocab] the exact q of each token; None = point mass

    @property
    def gamma(self) -> int:
        return int(self.tokens.shape[0])

    @staticmethod
    def empty(device: torch.device | str = "cpu") -> Draft:
        return Draft(torch.empty(0, dtype=torch.long, device=device), None)


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
class SharesTargetKV(Protocol):
    """A drafter whose model is the target's own first layers (layer-skip), which can read the target's KV.

    In one process the engine hands it the request's target cache after ``start``. Before each
    proposal that cache holds the committed text but its last token — exactly what the drafter's
    layers would compute — so the drafter feeds only the last committed token and its drafts, into
    the target cache's first layers, and rolls those layers back to the committed text before the
    target verifies. A drafter in another process keeps its own cache.
    """

    def share_target_cache(self, cache: KVCache) -> None: ...


def propose_within(drafter: Drafter, gamma: int, remaining: int, device: torch.device | str = "cpu") -> Draft:
    """Ask for ``gamma`` tokens but never more than ``remaining - 1``: the verdict always adds one more.

    A drafter that overruns its budget is trimmed rather than trusted.
    """
    budget = min(gamma, remaining - 1)
    if budget <= 0:
        return Draft.empty(device)
    draft = drafter.propose(budget)
    if draft.gamma > budget:
        probs = draft.draft_probs[:budget] if draft.draft_probs is not None else None
        draft = Draft(draft.tokens[:budget], probs)
    return draft


def propose_tree_within(drafter: TreeDrafter, spec: TreeSpec, remaining: int) -> DraftTree:
    """The drafter's tree for ``spec``, cut to depth ``remaining - 1`` (the verdict always adds one token)."""
    return drafter.propose_tree(spec).truncate(max(remaining - 1, 0))


def check_drafter_name(name: str) -> None:
    """Raises :class:`InvalidRequest` unless ``name`` is one of ``REQUEST_DRAFTERS``."""
    if name not in REQUEST_DRAFTERS:
        allowed = ", ".join(repr(n) for n in REQUEST_DRAFTERS)
        raise InvalidRequest(
            f"drafter must be one of {allowed} (a draft model is chosen when the deployment starts), got {name!r}"
        )


class DrafterSet:
    """The drafters requests may choose by name: the configured one, and the others built once, on first use.

    ``build(name)`` makes the drafter called ``name`` (``"ngram"`` or ``"none"``); without it only the
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
