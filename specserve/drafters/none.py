"""The ``none`` drafter: proposes nothing (no chain, an empty tree), so the engine loop runs plain
autoregressive decoding."""

from __future__ import annotations

from collections.abc import Sequence

import torch

from specserve.core.draft.drafter import Draft
from specserve.core.sampling.params import SamplingParams
from specserve.core.tree.draft_tree import DraftTree
from specserve.core.tree.shapes import TreeSpec


class NoDrafter:
    name = "none"

    def __init__(self, device: torch.device | str = "cpu") -> None:
        self._device = device

    def start(self, prompt_ids: Sequence[int], params: SamplingParams, generator: torch.Generator) -> None:
        return None

    def propose(self, budget: int) -> Draft:
        return Draft.empty(self._device)

    def propose_tree(self, spec: TreeSpec) -> DraftTree:
        return DraftTree.empty(self._device)

    def accept(self, committed: Sequence[int]) -> None:
        return None

    def rewind(self, length: int) -> None:
        return None
