"""MTP: the multi-token-prediction layer a target ships inside its own checkpoint, run as a feature head (``mtp``).

DeepSeek-V3 (technical report §2.2) and GLM-4.5 train one extra module beside the model and publish it in the same
checkpoint, at ``model.layers.{L}`` with L = ``num_hidden_layers`` (``num_nextn_predict_layers`` of them). It holds:

* ``enorm`` and ``hnorm`` (RMSNorms), ``eh_proj`` ``[H, 2H]`` without a bias;
* one decoder layer of the family itself (``self_attn``, ``mlp`` — a mixture of experts when the layer index is at
  least ``first_k_dense_replace`` —, ``input_layernorm``, ``post_attention_layernorm``);
* ``shared_head.norm`` and ``shared_head.head`` ``[V, H]``, and a copy of ``embed_tokens`` (both equal to the
  target's in the published checkpoints; the copies here are read as stored).

At head position t it reads h_t, the target's last hidden state (after the final norm, as vLLM's and SGLang's
proposers hand it over) and the embedding of token t + 1: ``x = eh_proj(cat(enorm(emb), hnorm(h_t)))`` (embedding
first, the order of the published weights); the decoder layer turns x into h', which the next draft step feeds
back as it is (before any norm), and ``shared_head.head(shared_head.norm(h'))`` are the logits of token t + 2. So an
MTP layer keeps the :class:`~specserve.drafters.eagle_head.FeatureHead` contract and drafts with the EAGLE drafter:
chains, trees, batched, static shapes, drafter actors. Choices where the references differ: vLLM zeroes the
embedding at position 0 and SGLang does not; here it is not zeroed (it only shapes that one position's keys).

transformers drops these tensors when it loads the target (``_keys_to_ignore_on_load_unexpected``), so
:func:`load_mtp_head` reads them from the checkpoint's safetensors itself, only those, and builds the decoder layer
with transformers' own class of the family through its own loading path (which also fuses per-expert weights the
way it does for the target). Refused in one line: a target without MTP layers, a checkpoint whose files lack them (a
re-save by transformers drops them), more than one MTP layer, and hybrid targets with recurrent layers (Qwen3-Next:
their state cannot be rolled back yet). Does not train or export MTP layers.
"""

from __future__ import annotations

import copy
import json
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch
from safetensors import SafetensorError, safe_open

from specserve.core.errors import UserError
from specserve.drafters.eagle_head import FeatureHead
from specserve.drafters.head_files import SHARDED_INDEX, WEIGHTS_FILE

if TYPE_CHECKING:
    from specserve.core.model.causal_lm import CausalLM

SPEC = "mtp"
OWN_TENSORS = ("enorm.", "hnorm.", "eh_proj.", "shared_head.", "embed_tokens.")  # the rest is the decoder layer
ATTENTION_LAYER_TYPES = {"full_attention", "sliding_attention", "attention"}


class MtpLoadError(UserError):
    """A target whose checkpoint carries no MTP layer specserve can run."""


@dataclass(frozen=True)
class MtpConfig:
    """What the EAGLE drafter and the fit check read of an MTP head (:class:`~.eagle_head.HeadShape`)."""

    feature_layers: tuple[int, ...]  # (L,): the target's last hidden state, after the final norm
    hidden_size: int
    vocab_size: int
    max_position_embeddings: int
    target_num_layers: int
    layer_index: int  # where the module sits in the checkpoint: model.layers.{layer_index}
    model_type: str


class SharedHead(torch.nn.Module):
    """``shared_head``: the module's own norm and LM head."""

    def __init__(self, hidden_size: int, vocab_size: int, norm: torch.nn.Module) -> None:
        super().__init__()
        self.norm = norm
        self.head = torch.nn.Linear(hidden_size, vocab_size, bias=False)

    def forward(self, hidden: torch.Tensor) -> torch.Tensor:
        return self.head(self.norm(hidden))


class MtpHead(FeatureHead):
    """One MTP module: the norms and ``eh_proj`` before the family's decoder layer (``body``, a one-layer model of the
    target's own class with no final norm), and the shared head after it."""

    layout = "MTP"

    def __init__(self, config: MtpConfig, body: torch.nn.Module, norm: type[torch.nn.Module], eps: float) -> None:
        super().__init__()
        self.config: MtpConfig = config
        width = config.hidden_size
        self.enorm, self.hnorm = norm(width, eps=eps), norm(width, eps=eps)
        self.eh_proj = torch.nn.Linear(2 * width, width, bias=False)
        self.body = body  # type: ignore[assignment]  # the family's model, run on inputs_embeds as a LlamaModel is
        self.body.add_module("norm", torch.nn.Identity())  # h' is fed back unnormed: the norm is the shared head's
        self.shared_head = SharedHead(width, config.vocab_size, norm(width, eps=eps))
        self.embed_tokens: torch.nn.Embedding | None = None  # the checkpoint's copy, when it has one

    def fuse_features(self, features: torch.Tensor) -> torch.Tensor:
        return features.to(self.eh_proj.weight.dtype)  # one feature, the target's width: nothing to fuse

    def body_inputs(self, features: torch.Tensor, token_embeds: torch.Tensor) -> torch.Tensor:
        return self.eh_proj(torch.cat([self.enorm(token_embeds), self.hnorm(features)], dim=-1))

    def output_head(self, lm_head: torch.nn.Module) -> torch.nn.Module:
        return self.shared_head

    def input_embeddings(self, embeddings: torch.nn.Module) -> torch.nn.Module:
        return self.embed_tokens if self.embed_tokens is not None else embeddings


def mtp_layer_count(config: Any) -> int:
    """``num_nextn_predict_layers`` (DeepSeek-V3, GLM-4.5), 0 when the config has none."""
    return int(getattr(config, "num_nextn_predict_layers", 0) or 0)


def check_mtp_target(config: Any, path: str) -> int:
    """The checkpoint index L of the MTP layer of a target with ``config``; raises :class:`MtpLoadError` saying why
    the target cannot draft with ``mtp``."""
    model_type = str(getattr(config, "model_type", "?"))
    recurrent = sorted(set(getattr(config, "layer_types", None) or []) - ATTENTION_LAYER_TYPES)
    if recurrent:
        raise MtpLoadError(
            f"--draft mtp is refused for {path} ({model_type}): its {', '.join(recurrent)} layers keep a recurrent "
            "state that specserve cannot roll back yet; use ngram or suffix drafting"
        )
    count = mtp_layer_count(config)
    if count == 0:
        raise MtpLoadError(
            f"{path} ({model_type}) carries no MTP layers (its config has no num_nextn_predict_layers); --draft mtp "
            "needs a target that ships them (DeepSeek-V3, GLM-4.5); use a draft model, eagle:DIR or ngram instead"
        )
    if count > 1:
        raise MtpLoadError(
            f"{path} has {count} MTP layers; specserve runs single-layer MTP (the published DeepSeek-V3 and GLM-4.5 "
            "checkpoints have one), so this checkpoint is refused"
        )
    return int(config.num_hidden_layers)


def read_prefixed(directory: str | Path, prefix: str, shapes_only: bool = False) -> dict[str, Any]:
    """The tensors whose names start with ``prefix`` in a checkpoint's ``model.safetensors`` or the shards its index
    names (only those shards are opened, only those tensors read), keyed without the prefix; with ``shapes_only``
    their shapes, read from the headers."""
    path = Path(directory)
    if (path / SHARDED_INDEX).is_file():
        weight_map = json.loads((path / SHARDED_INDEX).read_text()).get("weight_map", {})
        files = sorted({file for name, file in weight_map.items() if name.startswith(prefix)})
    else:
        files = [WEIGHTS_FILE] if (path / WEIGHTS_FILE).is_file() else []
    found: dict[str, Any] = {}
    for file in files:
        with safe_open(str(path / file), framework="pt") as handle:
            for name in handle.keys():  # noqa: SIM118 (a safetensors handle is not a mapping)
                if name.startswith(prefix):
                    read = handle.get_slice(name).get_shape() if shapes_only else handle.get_tensor(name)
                    found[name[len(prefix) :]] = read
    return found


def check_decoder_layer(path: str, layer: int, shapes: dict[str, list[int]], config: Any) -> None:
    """The MTP decoder layer is a decoder layer of the family like the target's last one (both mixtures of experts in
    the published checkpoints): the same tensor names and shapes, or :class:`MtpLoadError` naming the first that
    differs. Skipped when the target's last layer is dense."""
    if layer - 1 < int(getattr(config, "first_k_dense_replace", 0) or 0):
        return
    last = read_prefixed(path, f"model.layers.{layer - 1}.", shapes_only=True)
    lacking, extra = sorted(set(last) - set(shapes)), sorted(set(shapes) - set(last))
    wrong = sorted(name for name in set(last) & set(shapes) if list(last[name]) != list(shapes[name]))
    where = f"{path}'s MTP decoder layer (model.layers.{layer})"
    if lacking:
        raise MtpLoadError(f"{where} lacks {lacking[0]}, which the target's decoder layers have")
    if extra:
        raise MtpLoadError(f"{where} has {extra[0]}, which the target's decoder layers do not")
    if wrong:
        raise MtpLoadError(f"{where} has {wrong[0]} of shape {list(shapes[wrong[0]])}, the target's layers "
                           f"{list(last[wrong[0]])}")  # fmt: skip


def load_mtp_head(target: CausalLM) -> MtpHead:
    """The MTP module stored in ``target``'s checkpoint directory, in the target's dtype and on its device."""
    model = target.model
    config, path = model.config, target.info.path
    layer = check_mtp_target(config, path)
    prefix = f"model.layers.{layer}."
    try:
        state = read_prefixed(path, prefix)
    except (SafetensorError, OSError, json.JSONDecodeError) as exc:
        raise MtpLoadError(f"could not read the MTP layer from {path}: {exc}") from exc
    missing = [name for name in ("eh_proj.weight", "enorm.weight", "hnorm.weight") if name not in state]
    if missing:
        raise MtpLoadError(
            f"{path}'s config names an MTP layer but its safetensors files hold no {prefix}{missing[0]} (a checkpoint "
            "saved again by transformers drops the MTP layers: use the files as published)"
        )
    own = {name: tensor for name, tensor in state.items() if name.startswith(OWN_TENSORS)}
    shapes = {name: list(tensor.shape) for name, tensor in state.items() if name not in own}
    check_decoder_layer(path, layer, shapes, config)
    layer_state = {f"layers.0.{name}": tensor for name, tensor in state.items() if name not in own}
    body = _decoder_body(model, layer, layer_state)
    norm_class = type(body.get_submodule("layers.0.input_layernorm"))  # the family's RMSNorm
    width = int(config.hidden_size)
    mtp_config = MtpConfig(
        feature_layers=(int(config.num_hidden_layers),),
        hidden_size=width,
        vocab_size=int(model.get_output_embeddings().weight.shape[0]),
        max_position_embeddings=int(config.max_position_embeddings),
        target_num_layers=int(config.num_hidden_layers),
        layer_index=layer,
        model_type=str(config.model_type),
    )
    head = MtpHead(mtp_config, body, norm_class, float(getattr(config, "rms_norm_eps", 1e-6)))
    if "embed_tokens.weight" in own:
        head.embed_tokens = torch.nn.Embedding(*own["embed_tokens.weight"].shape)
    if "shared_head.head.weight" not in own:
        own["shared_head.head.weight"] = model.get_output_embeddings().weight.detach()
    head = head.to(dtype=target.dtype)
    own_modules = {name: t for name, t in head.state_dict().items() if not name.startswith("body.")}
    unknown = sorted(set(own) - set(own_modules))
    absent = sorted(set(own_modules) - set(own))
    if unknown or absent:
        detail = f"unexpected {prefix}{unknown[0]}" if unknown else f"no {prefix}{absent[0]}"
        raise MtpLoadError(f"{path}'s MTP layer is not in the published layout: {detail}")
    for name, tensor in own.items():
        expected = own_modules[name].shape
        if tensor.shape != expected:
            raise MtpLoadError(
                f"{path}'s MTP tensor {prefix}{name} has shape {list(tensor.shape)}, expected {list(expected)}"
            )
    head.load_state_dict(own, strict=False)  # the body's weights are loaded already
    return head.to(device=target.device).eval()


def _decoder_body(model: Any, layer: int, layer_state: dict[str, torch.Tensor]) -> torch.nn.Module:
    """A one-layer model of the target's own base class holding the MTP decoder layer, loaded through transformers'
    own path (its per-family weight conversions included); its embeddings are a single unused row."""
    base = model.get_decoder() if hasattr(model, "get_decoder") else model.model
    config = copy.deepcopy(model.config)
    config.num_hidden_layers = 1
    config.vocab_size, config.pad_token_id = 1, None
    if hasattr(config, "first_k_dense_replace"):  # the MTP layer is a mixture of experts as layer L would be
        config.first_k_dense_replace = 0 if layer >= int(config.first_k_dense_replace) else 1
    width = int(config.hidden_size)
    state = {
        **layer_state,
        "embed_tokens.weight": torch.zeros(1, width),
        "norm.weight": torch.ones(width),  # replaced by the identity: the shared head holds the norm
    }
    options: dict[str, Any] = {"config": config, "state_dict": state, "dtype": model.dtype, "output_loading_info": True}
    implementation = getattr(model.config, "_experts_implementation", None)
    if implementation is not None:
        options["experts_implementation"] = implementation
    try:
        body, info = type(base).from_pretrained(None, **options)
    except (RuntimeError, ValueError, KeyError) as exc:
        raise MtpLoadError(f"the MTP decoder layer does not load as a {type(base).__name__} layer: {exc}") from exc
    for kind in ("missing_keys", "unexpected_keys", "mismatched_keys"):
        names = sorted(str(name[0] if isinstance(name, tuple) else name) for name in info.get(kind) or ())
        if names:
            tensor = names[0].replace("layers.0.", f"model.layers.{layer}.")
            what = {"missing_keys": "it lacks", "unexpected_keys": "unexpected", "mismatched_keys": "wrong shape of"}
            raise MtpLoadError(
                f"the MTP decoder layer at model.layers.{layer} is not a {type(base).__name__} layer: "
                f"{what[kind]} {tensor}"
            )
    body.config.use_cache = True
    return body.eval()
