"""Layer-skip self-speculation: draft with the target's own first L decoder layers, its final norm and LM head.

:func:`early_exit_model` builds a :class:`~specserve.core.model.CausalLM` *view* of a loaded target
that runs only its first ``layers`` decoder blocks: the module objects (and so every weight) are
the target's own — no copy, no extra memory, no training — and only the config the view carries
says ``num_hidden_layers = layers``, so its KV cache has ``layers`` layers. :class:`LayerSkipDrafter`
is the draft-model drafter (:class:`~specserve.drafters.model.DraftModelDrafter`: chains with q,
trees, drafter-invariant coupling) over that view.

What it does not do (yet): share the target's KV for those layers — the view keeps a cache of its
own, so the committed text is also run through the first L layers on the drafter's side — and it
has no trained exit head (the target's LM head reads the layer-L hidden state directly).
"""

from __future__ import annotations

import copy
from typing import Any

import torch

from specserve.core.errors import UserError
from specserve.core.model import CausalLM
from specserve.drafters.model import DraftModelDrafter


def early_exit_model(target: CausalLM, layers: int) -> CausalLM:
    """A view of ``target`` that runs its first ``layers`` decoder layers, then its final norm and LM head."""
    model = target.model
    inner: Any = getattr(model, "model", None)
    blocks = getattr(inner, "layers", None)
    if not isinstance(blocks, torch.nn.ModuleList):
        raise UserError(
            f"layer-skip drafting needs a decoder with a `model.layers` list (Llama, Qwen2, Mistral ...); "
            f"{target.info.architecture} has none"
        )
    total = len(blocks)
    if not 1 <= layers < total:
        raise UserError(f"layer-skip drafting needs 1 <= layers < {total} (the target's depth), got {layers}")
    config = copy.deepcopy(model.config)
    config.num_hidden_layers = layers
    if getattr(config, "layer_types", None):
        config.layer_types = list(config.layer_types)[:layers]
    view_inner = copy.copy(inner)  # shallow: the same submodules and parameters ...
    view_inner._modules = dict(inner._modules)  # ... in a registry of its own, so the swap below stays here
    view_inner.layers = torch.nn.ModuleList(list(blocks)[:layers])
    view_inner.config = config
    view = copy.copy(model)
    view._modules = dict(model._modules)
    view.model = view_inner
    view.config = config
    return CausalLM(view, target.tokenizer, path=f"{target.info.path} (first {layers} of {total} layers)")


class LayerSkipDrafter(DraftModelDrafter):
    """Self-speculation: the target's first ``layers`` layers draft for the whole target."""

    name = "layerskip"

    def __init__(self, target: CausalLM, layers: int) -> None:
        super().__init__(early_exit_model(target, layers), target)
        self.layers = layers
