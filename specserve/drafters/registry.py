"""Build a drafter from its name: ``none``, ``ngram`` or a path to a draft model directory."""

from __future__ import annotations

from pathlib import Path

from specserve.core.draft import Drafter
from specserve.core.model import CausalLM, TargetDescription
from specserve.drafters.model import DraftModelDrafter
from specserve.drafters.ngram import NgramDrafter
from specserve.drafters.none import NoDrafter

BUILTIN_DRAFTERS = ("none", "ngram")


def build_drafter(
    spec: str | CausalLM,
    target: CausalLM | TargetDescription,
    dtype: str = "float32",
    device: str = "cpu",
    max_ngram: int = 3,
    min_ngram: int = 1,
) -> Drafter:
    """``spec`` is ``"none"``, ``"ngram"``, a draft model directory, or an already loaded draft model."""
    if isinstance(spec, CausalLM):
        return DraftModelDrafter(spec, target)
    if spec == "none":
        return NoDrafter(target.device)
    if spec == "ngram":
        return NgramDrafter(max_ngram=max_ngram, min_ngram=min_ngram, device=target.device)
    return DraftModelDrafter(CausalLM.load(Path(spec), dtype=dtype, device=device), target)
