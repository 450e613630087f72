"""Build a drafter from its name: ``none``, ``ngram``, ``layerskip:L`` or a path to a draft model directory.

:func:`build_drafter_set` wraps the configured drafter in a :class:`~specserve.core.draft.DrafterSet`
whose builder is :func:`build_drafter` with the same options, so a request can also choose
``ngram`` or ``none`` (built on first use, then kept). Loads no model other than the configured one.
"""

from __future__ import annotations

from pathlib import Path

from specserve.core.draft import Drafter, DrafterSet
from specserve.core.errors import UserError
from specserve.core.model import CausalLM, TargetDescription
from specserve.drafters.layerskip import LayerSkipDrafter
from specserve.drafters.model import DraftModelDrafter
from specserve.drafters.ngram import NgramDrafter
from specserve.drafters.none import NoDrafter

BUILTIN_DRAFTERS = ("none", "ngram")
LAYERSKIP_PREFIX = "layerskip:"


def build_drafter(
    spec: str | CausalLM,
    target: CausalLM | TargetDescription,
    dtype: str = "float32",
    device: str = "cpu",
    max_ngram: int = 3,
    min_ngram: int = 1,
) -> Drafter:
    """``spec`` is ``"none"``, ``"ngram"``, ``"layerskip:L"`` (the target's first L layers; a process that holds
    only the target's description loads its own copy of the target), a draft model directory, or an already
    loaded draft model."""
    if isinstance(spec, CausalLM):
        return DraftModelDrafter(spec, target)
    if spec.startswith(LAYERSKIP_PREFIX):
        layers = spec[len(LAYERSKIP_PREFIX) :]
        if not layers.isdigit():
            raise UserError(f"layer-skip drafting is 'layerskip:L' with L the number of target layers, got {spec!r}")
        model = target if isinstance(target, CausalLM) else CausalLM.load(target.info.path, dtype=dtype, device=device)
        return LayerSkipDrafter(model, int(layers))
    if spec == "none":
        return NoDrafter(target.device)
    if spec == "ngram":
        return NgramDrafter(max_ngram=max_ngram, min_ngram=min_ngram, device=target.device)
    return DraftModelDrafter(CausalLM.load(Path(spec), dtype=dtype, device=device), target)


def build_drafter_set(
    spec: str | CausalLM,
    target: CausalLM | TargetDescription,
    dtype: str = "float32",
    device: str = "cpu",
    max_ngram: int = 3,
    min_ngram: int = 1,
) -> DrafterSet:
    """The configured drafter (built now, as :func:`build_drafter` would) and the built-ins requests may choose.

    The built-ins are made on the first request naming them, by whatever thread calls ``get``.
    """

    def build(name: str) -> Drafter:
        return build_drafter(name, target, dtype=dtype, device=device, max_ngram=max_ngram, min_ngram=min_ngram)

    configured = build_drafter(spec, target, dtype=dtype, device=device, max_ngram=max_ngram, min_ngram=min_ngram)
    return DrafterSet(configured, build)
