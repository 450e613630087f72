"""Layer-skip self-speculation: draft with the target's own first L decoder layers, its final norm and LM head.

:func:`early_exit_model` builds a :class:`~specserve.core.model.causal_lm.CausalLM` *view* of a loaded target
that runs only its first ``layers`` decoder blocks: the module objects (and so every weight) are
the target's own — no copy, no extra memory — and only the config the view carries says
``num_hidden_layers = layers``, so its KV cache has ``layers`` layers. :class:`LayerSkipDrafter`
is the draft-model drafter (:class:`~specserve.drafters.model.DraftModelDrafter`: chains with q,
trees, drafter-invariant coupling) over that view.

Optionally a small trained :class:`ExitHead` sits between layer L and the target's final norm (the
early-exit adapter of LayerSkip, Elhoushi et al. 2024, here trained post hoc on a frozen target
instead of with the target): a residual MLP, ``h + W2 SiLU(W1 RMSNorm(h))``, with ``W2`` zero at
initialisation so an untrained head is exactly plain layer-skip. In the view it replaces the
``norm`` entry of the view's own module registry by :class:`ExitNorm` (exit head, then the
target's norm); the target itself is never modified. An exit head is saved as a directory
(:func:`save_exit_head`: ``config.json`` saying which target it fits, ``model.safetensors`` with the
head's weights only) and loaded against a target (:func:`load_exit_head`), which refuses a head
made for another target shape. Training lives in :mod:`specserve.training.exit_head`.

KV: in one process the drafter shares the target's cache for its layers
(:class:`~specserve.core.draft.drafter.SharesTargetKV`): the target's first L cache layers already hold the
committed text but its last token, exactly what the view would compute, so each proposal feeds
only the last committed token and the drafts into them and rolls them back before the target
verifies. In a batched engine (:class:`~specserve.core.draft.drafter.ReadsTargetPool`) it keeps a cache of its own
but fills it by copying the target's keys and values of its layers from the request's span of the pool, so the
tokens it did not draft after (plain cycles, a pause) cost a copy, not a forward. A drafter in another process (the
distributed drafter actor) keeps a cache of its own and computes it.
"""

from __future__ import annotations

import copy
import json
import math
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import torch
from safetensors import SafetensorError
from safetensors.torch import load_file, save_file

from specserve.core.draft.drafter import Draft
from specserve.core.errors import UserError
from specserve.core.kv.cache import KVCache
from specserve.core.kv.pool import KVPool
from specserve.core.kv.prefix_index import common_prefix
from specserve.core.model.causal_lm import CausalLM
from specserve.core.sampling.params import SamplingParams
from specserve.core.static.options import StaticOptions
from specserve.core.tree.draft_tree import DraftTree
from specserve.core.tree.shapes import TreeSpec
from specserve.drafters.head_files import CONFIG_FILE, WEIGHTS_FILE, read_head_config
from specserve.drafters.model import DraftModelDrafter
from specserve.drafters.tree import TreeModelDrafter

EXIT_HEAD_KIND = "exit-head"  # the "specserve_drafter" value in an exit head's config.json
CONFIG_FORMAT = 1


class ExitHeadError(UserError):
    """An exit head directory is missing, malformed, or made for another target; the message says which."""


# ---------------------------------------------------------------------------------------------
# The exit head and the early-exit view


class ExitHead(torch.nn.Module):
    """A residual adapter on the layer-L hidden state: ``h + down(SiLU(up(RMSNorm(h))))``.

    ``down`` starts at zero, so an untrained head is the identity (plain layer-skip); ``up`` is
    drawn like ``torch.nn.Linear``'s default, from ``generator`` when given.
    """

    def __init__(
        self,
        hidden_size: int,
        intermediate_size: int | None = None,
        eps: float = 1e-6,
        generator: torch.Generator | None = None,
    ) -> None:
        super().__init__()
        self.hidden_size = hidden_size
        self.intermediate_size = intermediate_size or hidden_size
        self.eps = eps
        self.norm = torch.nn.RMSNorm(hidden_size, eps=eps)
        self.up = torch.nn.Linear(hidden_size, self.intermediate_size, bias=False)
        self.down = torch.nn.Linear(self.intermediate_size, hidden_size, bias=False)
        with torch.no_grad():
            torch.nn.init.kaiming_uniform_(self.up.weight, a=math.sqrt(5), generator=generator)
            self.down.weight.zero_()

    def forward(self, hidden: torch.Tensor) -> torch.Tensor:  # [..., hidden] -> [..., hidden]
        return hidden + self.down(torch.nn.functional.silu(self.up(self.norm(hidden))))


class ExitNorm(torch.nn.Module):
    """What the view runs in place of the target's final norm: the exit head, then that norm."""

    def __init__(self, exit_head: ExitHead, norm: torch.nn.Module) -> None:
        super().__init__()
        self.exit_head = exit_head
        self.norm = norm

    def forward(self, hidden: torch.Tensor) -> torch.Tensor:  # [batch, seq, hidden]
        return self.norm(self.exit_head(hidden))


def decoder_stack(model: torch.nn.Module) -> tuple[Any, torch.nn.ModuleList]:
    """A causal LM's inner decoder (``model.model``, which holds ``layers`` and the final ``norm``) and its layers."""
    inner: Any = getattr(model, "model", None)
    blocks = getattr(inner, "layers", None)
    if not isinstance(blocks, torch.nn.ModuleList) or not isinstance(getattr(inner, "norm", None), torch.nn.Module):
        raise UserError(
            f"layer-skip drafting needs a decoder with a `model.layers` list and a final `model.norm` "
            f"(Llama, Qwen2, Mistral ...); {type(model).__name__} has none"
        )
    return inner, blocks


def early_exit_model(target: CausalLM, layers: int, exit_head: ExitHead | None = None) -> CausalLM:
    """A view of ``target`` that runs its first ``layers`` decoder layers, then ``exit_head`` (when given),
    its final norm and LM head. ``exit_head`` is moved to the target's device and dtype."""
    if target.windows.recurrent:
        raise UserError(
            f"layer-skip drafting shares the target's cache, which {target.info.architecture}'s recurrent layers "
            "cannot share (their state is the target's own); draft with a draft model or n-gram lookup"
        )
    model = target.model
    inner, blocks = decoder_stack(model)
    total = len(blocks)
    if not 1 <= layers < total:
        raise UserError(f"layer-skip drafting needs 1 <= layers < {total} (the target's depth), got {layers}")
    config = copy.deepcopy(model.config)
    config.num_hidden_layers = layers
    if getattr(config, "layer_types", None):
        config.layer_types = list(config.layer_types)[:layers]
    view_inner = copy.copy(inner)  # shallow: the same submodules and parameters ...
    view_inner._modules = dict(inner._modules)  # ... in a registry of its own, so the swaps below stay here
    view_inner.layers = torch.nn.ModuleList(list(blocks)[:layers])
    view_inner.config = config
    label = f"first {layers} of {total} layers"
    if exit_head is not None:
        if exit_head.hidden_size != config.hidden_size:
            raise ExitHeadError(
                f"the exit head reads hidden states of size {exit_head.hidden_size} but {target.info.path} "
                f"has hidden size {config.hidden_size}; train an exit head for this target"
            )
        exit_head.to(device=target.device, dtype=target.dtype)
        view_inner.norm = ExitNorm(exit_head, inner.norm)
        label += " + exit head"
    view = copy.copy(model)
    view._modules = dict(model._modules)
    view.model = view_inner
    view.config = config
    return CausalLM(view, target.tokenizer, path=f"{target.info.path} ({label})")


# ---------------------------------------------------------------------------------------------
# Exit head directories


def exit_head_config(target: CausalLM, layers: int, exit_head: ExitHead) -> dict[str, Any]:
    """The ``config.json`` of ``exit_head`` reading ``target``'s layer ``layers``."""
    _, blocks = decoder_stack(target.model)
    return {
        "specserve_drafter": EXIT_HEAD_KIND,
        "format": CONFIG_FORMAT,
        "layers": layers,
        "hidden_size": exit_head.hidden_size,
        "intermediate_size": exit_head.intermediate_size,
        "rms_norm_eps": exit_head.eps,
        "target_num_layers": len(blocks),
        "target_architecture": target.info.architecture,
        "vocab_size": target.info.vocab_size,
        "target_path": target.info.path,
    }


def save_exit_head(directory: str | Path, exit_head: ExitHead, target: CausalLM, layers: int) -> Path:
    """Write ``config.json`` and ``model.safetensors`` (the head's own weights, float32) into ``directory``."""
    out = Path(directory)
    out.mkdir(parents=True, exist_ok=True)
    config = exit_head_config(target, layers, exit_head)
    state = exit_head.state_dict()
    weights = {name: tensor.detach().to("cpu", torch.float32).contiguous() for name, tensor in state.items()}
    save_file(weights, str(out / WEIGHTS_FILE), metadata={"format": "pt", "specserve_drafter": EXIT_HEAD_KIND})
    (out / CONFIG_FILE).write_text(json.dumps(config, indent=2) + "\n")
    return out


_INT_FIELDS = ("layers", "hidden_size", "intermediate_size", "target_num_layers", "vocab_size")


def read_exit_head_config(directory: str | Path) -> dict[str, Any]:
    """The validated ``config.json`` of an exit head directory (checked against no target yet)."""
    hint = "pass a directory written by `specserve train exit-head`"
    config = read_head_config(directory, EXIT_HEAD_KIND, "an exit head", ExitHeadError, hint)
    config_path = Path(directory) / CONFIG_FILE
    for field in _INT_FIELDS:
        value = config.get(field)
        if not isinstance(value, int) or isinstance(value, bool) or value < 1:
            raise ExitHeadError(f"{config_path}: {field!r} must be a positive integer, got {value!r}")
    if not isinstance(config.get("target_architecture"), str):
        raise ExitHeadError(f"{config_path}: 'target_architecture' must be a string")
    if not isinstance(config.get("rms_norm_eps", 1e-6), int | float):
        raise ExitHeadError(f"{config_path}: 'rms_norm_eps' must be a number")
    layers, depth = config["layers"], config["target_num_layers"]
    if not layers < depth:
        raise ExitHeadError(f"{config_path}: layers ({layers}) must be below target_num_layers ({depth})")
    return config


def load_exit_head(directory: str | Path, target: CausalLM) -> tuple[ExitHead, int]:
    """The exit head saved in ``directory`` (on ``target``'s device, in its dtype) and the layer it reads.

    Raises :class:`ExitHeadError` when the directory is not an exit head or was made for a target
    of another architecture, depth, width or vocabulary.
    """
    path = Path(directory)
    config = read_exit_head_config(path)
    _, blocks = decoder_stack(target.model)
    actual = {
        "target_architecture": target.info.architecture,
        "target_num_layers": len(blocks),
        "hidden_size": int(target.model.config.hidden_size),
        "vocab_size": target.info.vocab_size,
    }
    wrong = [f"{key} {config[key]} (the target has {value})" for key, value in actual.items() if config[key] != value]
    if wrong:
        raise ExitHeadError(
            f"exit head {path} was trained for another target ({config.get('target_path', 'unknown')}): "
            f"{', '.join(wrong)}; train an exit head for {target.info.path} with `specserve train exit-head`"
        )
    head = ExitHead(config["hidden_size"], config["intermediate_size"], float(config.get("rms_norm_eps", 1e-6)))
    weights_path = path / WEIGHTS_FILE
    if not weights_path.is_file():
        raise ExitHeadError(f"exit head {path} has no {WEIGHTS_FILE}")
    try:
        weights = load_file(str(weights_path))
    except (SafetensorError, OSError) as exc:
        raise ExitHeadError(f"could not read {weights_path}: {exc}") from exc
    expected = {name: tuple(t.shape) for name, t in head.state_dict().items()}
    found = {name: tuple(t.shape) for name, t in weights.items()}
    if found != expected:
        raise ExitHeadError(f"{weights_path} holds {found}, but its {CONFIG_FILE} describes {expected}")
    head.load_state_dict(weights)
    head.requires_grad_(False)
    return head.to(device=target.device, dtype=target.dtype).eval(), int(config["layers"])


# ---------------------------------------------------------------------------------------------
# The drafter


class LayerSkipDrafter(DraftModelDrafter):
    """Self-speculation: the target's first ``layers`` layers (and an optional exit head) draft for the whole
    target."""

    name = "layerskip"

    def __init__(
        self, target: CausalLM, layers: int, exit_head: ExitHead | None = None, *, view: CausalLM | None = None
    ) -> None:
        super().__init__(view if view is not None else early_exit_model(target, layers, exit_head), target)
        self.target = target
        self.layers = layers
        self.exit_head = exit_head
        self._shared: KVCache | None = None  # this request's view of the target cache's first layers
        self._pool: tuple[KVPool, int] | None = None  # the batched target's pool and this request's sequence in it

    def fresh(self) -> LayerSkipDrafter:
        """A drafter for another request over the same early-exit view of the target (its layers and exit head
        shared, not copied), with none of this one's per-request state."""
        return type(self)(self.target, self.layers, self.exit_head, view=self.model)

    def start(self, prompt_ids: Sequence[int], params: SamplingParams, generator: torch.Generator) -> None:
        super().start(prompt_ids, params, generator)
        self._shared = None
        self._pool = None

    def use_static_shapes(self, options: StaticOptions) -> None:
        """Keeps its growing cache: it drafts on a view of the target's layers (or on the target's own cache)."""

    def share_target_cache(self, cache: KVCache) -> None:
        """Draft on the target cache's first ``layers`` layers (the same keys and values the view computes for
        the committed text) instead of a cache of its own: see :class:`~specserve.core.draft.drafter.SharesTargetKV`."""
        shared = self.model.new_cache()
        shared.inner.layers = list(cache.inner.layers[: self.layers])  # the target's layer objects, not copies
        self._shared = self._cache = shared
        self._cached = self._context[: shared.length]

    def follow_target_pool(self, pool: KVPool, sequence: int) -> None:
        """Fill its own cache from ``sequence``'s span of the batched target's ``pool`` (see
        :class:`~specserve.core.draft.drafter.ReadsTargetPool`); a pool whose first layers keep no plain keys and values
        (a latent, a recurrent state) is not followed: the drafter then computes its cache itself."""
        self._pool = (pool, sequence) if pool.readable_layers(self.layers) else None

    @torch.inference_mode()
    def _copy_from_pool(self) -> None:
        """Bring its cache up to the committed text but its last token: keep the longest prefix it holds of the
        committed text and copy the target's keys and values after it from the pool."""
        assert self._pool is not None and isinstance(self._cache, KVCache), "start() and follow_target_pool() first"
        pool, sequence = self._pool
        stop = min(pool.length(sequence), len(self._context) - 1)
        keep = min(common_prefix(self._cached, self._context), stop)
        if keep >= stop:
            return
        self._cache.rollback(keep)
        for layer, (keys, values) in enumerate(pool.read(sequence, self.layers, keep, stop)):
            self._cache.inner.update(keys, values, layer)  # appended: a copy, the span stays the target's
        self._cached = self._context[:stop]

    def propose(self, budget: int) -> Draft:
        if self._shared is None:
            if self._pool is not None:
                self._copy_from_pool()
            return super().propose(budget)
        self._cached = self._context[: self._shared.length]  # the target's cache: the committed text but its last
        try:
            return super().propose(budget)
        finally:  # give the target back its layers holding exactly the committed text but its last token
            self._shared.rollback(len(self._context) - 1)
            self._cached = self._context[:-1]

    def propose_tree(self, spec: TreeSpec) -> DraftTree:
        if self._shared is None and self._pool is None:
            return super().propose_tree(spec)
        if self._pool is not None:
            self._copy_from_pool()
        if self._trees is None:
            self._trees = TreeModelDrafter(self.model)
            self._trees.start(self._context)
        cache = self._shared if self._shared is not None else self._cache
        assert isinstance(cache, KVCache)
        self._trees.use_cache(cache)
        tree = super().propose_tree(spec)
        self._cached = self._context[: cache.length]  # the session rolled it back to the committed text but its last
        return tree

    @classmethod
    def from_directory(cls, target: CausalLM, directory: str | Path) -> LayerSkipDrafter:
        """Draft with the trained exit head saved in ``directory`` (the layer count comes from its config)."""
        exit_head, layers = load_exit_head(directory, target)
        return cls(target, layers, exit_head)

    @staticmethod
    def check_directory(directory: str | Path) -> dict[str, Any]:
        """The config of the exit head in ``directory`` (:class:`ExitHeadError` if it is none), before any
        target is at hand."""
        return read_exit_head_config(directory)
