"""EAGLE heads: what the EAGLE drafter needs of a head (:class:`FeatureHead`), and the one-projection head.

A head turns (the target's feature of token t, the embedding of token t + 1) into h_t, a hidden state that stands
for the target's feature of token t + 1; an output head reads h_t as the logits of token t + 2, and the next draft
step feeds h_t back as its feature. :class:`FeatureHead` is that contract; the drafter
(:mod:`specserve.drafters.eagle`) runs any head that keeps it.

:class:`EagleHead` is the head whose input is ``fc(cat(embedding, feature))`` and whose body is a stack of Llama
decoder layers read by the target's own LM head. With the defaults of :class:`EagleConfig` it is specserve's own
layout (a final norm, the input norm on every layer, EAGLE-3's fused low/middle/top features); with ``fc_bias``, no
input norm on layer 0 and no final norm it is the published EAGLE-1/EAGLE-2 head (SafeAILab's ``cnets1.py``,
docs/published-heads.md §1), loaded by :mod:`specserve.drafters.eagle_layouts`. EAGLE-3's head, whose attention reads
both halves at 2H and which has its own LM head over a reduced vocabulary, is :mod:`specserve.drafters.eagle3`.

This module saves and loads specserve's own head directory (``"specserve_drafter": "eagle"``) and checks a head
against a target; it does not detect published layouts (:mod:`specserve.drafters.eagle_layouts`), draft, or train.
"""

from __future__ import annotations

import json
from collections.abc import Sequence
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any, Protocol

import torch
from safetensors.torch import load_file, save_file
from transformers import LlamaConfig, LlamaModel
from transformers.cache_utils import Cache

from specserve.core.errors import UserError
from specserve.drafters.head_files import CONFIG_FILE, WEIGHTS_FILE, read_head_config

if TYPE_CHECKING:
    from transformers import PreTrainedModel

    from specserve.core.model.causal_lm import CausalLM, TargetDescription

KIND = "eagle"
OWN_LAYOUT = "specserve EAGLE"
TRAIN_HINT = "train one with `specserve train eagle --target DIR`, or pass a published EAGLE-1/2/3 head directory"


class EagleLoadError(UserError):
    """An EAGLE head directory is missing, malformed, or was trained for another target."""


class HeadShape(Protocol):
    """The fields of a head's configuration the drafter and the fit check read."""

    @property
    def feature_layers(self) -> tuple[int, ...]: ...  # indices into the target's hidden_states (select_features)

    @property
    def hidden_size(self) -> int: ...  # the head's own width (its fused feature and h)

    @property
    def vocab_size(self) -> int: ...  # the target's vocabulary (what the output head scores)

    @property
    def max_position_embeddings(self) -> int: ...

    @property
    def target_num_layers(self) -> int: ...  # 0 = not recorded


class FeatureHead(torch.nn.Module):
    """The contract of an EAGLE head, whatever its layout.

    ``body`` is a Llama model run on ``inputs_embeds`` only (its decoder layers hold the head's keys and values: the
    drafter sizes their cache from ``body.config``); :meth:`forward` returns h; :meth:`output_head` and
    :meth:`input_embeddings` say which modules score h and embed tokens, given the target's."""

    config: HeadShape
    body: LlamaModel
    layout: str = OWN_LAYOUT  # how messages name the layout
    speculative_tokens: int | None = None  # the γ the head's publisher suggests, when its files say one

    def fuse_features(self, features: torch.Tensor) -> torch.Tensor:
        """The target's raw features ``[..., len(layers) * target hidden]`` -> the head's input ``[..., hidden]``."""
        raise NotImplementedError

    def forward(
        self,
        features: torch.Tensor,  # [batch, k, hidden]: fused target features, or the head's own outputs
        token_embeds: torch.Tensor,  # [batch, k, hidden]: the embeddings of the next tokens
        cache: Cache | None = None,
        attention_mask: torch.Tensor | None = None,
        position_ids: torch.Tensor | None = None,
    ) -> torch.Tensor:  # [batch, k, hidden]: h, standing for the next token's feature, fed back as it is
        out = self.body(
            inputs_embeds=self.body_inputs(features, token_embeds.to(features.dtype)),
            attention_mask=attention_mask,
            position_ids=position_ids,
            cache=cache,
            use_cache=cache is not None,
        )
        return self.body_output(out.last_hidden_state)

    def body_inputs(self, features: torch.Tensor, token_embeds: torch.Tensor) -> torch.Tensor:
        """What the body's decoder layers read, from the features and the token embeddings."""
        raise NotImplementedError

    def body_output(self, hidden: torch.Tensor) -> torch.Tensor:
        """h from the body's output; by default the output itself."""
        return hidden

    @property
    def target_hidden_size(self) -> int:
        """The width of one target feature layer this head reads."""
        return self.config.hidden_size

    def output_head(self, lm_head: torch.nn.Module) -> torch.nn.Module:
        """The module that turns h into logits over the target's vocabulary; by default the target's LM head."""
        return lm_head

    def input_embeddings(self, embeddings: torch.nn.Module) -> torch.nn.Module:
        """The module that embeds the tokens the head reads; by default the target's input embeddings."""
        return embeddings


@dataclass(frozen=True)
class EagleConfig:
    feature_layers: tuple[int, ...]  # indices into the target's hidden_states (select_features)
    hidden_size: int
    vocab_size: int
    intermediate_size: int
    num_attention_heads: int
    num_key_value_heads: int
    max_position_embeddings: int
    rms_norm_eps: float = 1e-6
    rope_theta: float = 10000.0
    target_num_layers: int = 0
    target_architecture: str = ""
    # the published EAGLE-1/2 layout differs from specserve's in these (defaults: specserve's)
    num_hidden_layers: int = 1
    fc_bias: bool = False  # EAGLE-1's fc has a bias unless its config says "bias": false
    first_input_norm: bool = True  # EAGLE-1's layer 0 has no input_layernorm
    final_norm: bool = True  # EAGLE-1 has no final norm: the target's LM head reads the last layer's output
    qkv_bias: bool = False  # q/k/v projections with biases (EAGLE-1 heads of Qwen2 targets)
    head_dim: int = 0  # 0: hidden_size // num_attention_heads
    rope_type: str = "default"  # or "linear" / "dynamic" with rope_factor
    rope_factor: float = 1.0

    @staticmethod
    def for_target(target: PreTrainedModel, feature_layers: Sequence[int] | None = None) -> EagleConfig:
        """A head shaped like one of ``target``'s layers; default features: EAGLE-3's low, middle and high layer."""
        layers = int(target.config.num_hidden_layers)
        chosen = tuple(feature_layers) if feature_layers is not None else default_feature_layers(layers)
        if not chosen or any(not 0 < layer <= layers for layer in chosen):
            raise UserError(f"EAGLE feature layers must be in 1..{layers} (the target's layers), got {list(chosen)}")
        return EagleConfig(
            feature_layers=chosen, target_architecture=type(target).__name__, **target_layer_shape(target)
        )

    def body_config(self) -> LlamaConfig:
        """The decoder layers (with rotary embeddings and a final norm) as a Llama model; it never sees token ids
        (inputs_embeds only), so its own vocabulary is a single row."""
        rope: dict[str, Any] = {"rope_type": self.rope_type, "rope_theta": self.rope_theta}
        if self.rope_type != "default":
            rope["factor"] = self.rope_factor
        return LlamaConfig(
            vocab_size=1,
            hidden_size=self.hidden_size,
            intermediate_size=self.intermediate_size,
            num_hidden_layers=self.num_hidden_layers,
            num_attention_heads=self.num_attention_heads,
            num_key_value_heads=self.num_key_value_heads,
            head_dim=self.head_dim or self.hidden_size // self.num_attention_heads,
            max_position_embeddings=self.max_position_embeddings,
            rms_norm_eps=self.rms_norm_eps,
            rope_parameters=rope,
            pad_token_id=None,
            bos_token_id=None,
            eos_token_id=None,
        )


def target_layer_shape(target: PreTrainedModel) -> dict[str, Any]:
    """The shape of one of ``target``'s decoder layers and its vocabulary, as head-config fields (a head one layer
    wide): hidden and intermediate sizes, heads, KV heads, positions, norm epsilon, rope base, and the layer count."""
    config = target.config
    rope = getattr(config, "rope_parameters", None) or {}
    return {
        "hidden_size": int(config.hidden_size),
        "vocab_size": int(target.get_output_embeddings().weight.shape[0]),
        "intermediate_size": int(config.intermediate_size),
        "num_attention_heads": int(config.num_attention_heads),
        "num_key_value_heads": int(getattr(config, "num_key_value_heads", None) or config.num_attention_heads),
        "max_position_embeddings": int(config.max_position_embeddings),
        "rms_norm_eps": float(getattr(config, "rms_norm_eps", 1e-6)),
        "rope_theta": float(rope.get("rope_theta", getattr(config, "rope_theta", 10000.0))),
        "target_num_layers": int(config.num_hidden_layers),
    }


def default_feature_layers(num_layers: int) -> tuple[int, ...]:
    """specserve's fused features: a low, a middle and the top layer (the top one is after the final norm)."""
    if num_layers < 3:
        return (num_layers,)
    return (2, num_layers // 2, num_layers)


def add_qkv_biases(attention: torch.nn.Module) -> None:
    """Give a Llama attention's q/k/v projections biases (o_proj keeps none), as Qwen2-style heads have."""
    for name in ("q_proj", "k_proj", "v_proj"):
        old = getattr(attention, name)
        setattr(attention, name, torch.nn.Linear(old.in_features, old.out_features, bias=True))


class EagleHead(FeatureHead):
    """specserve's EAGLE head and the published EAGLE-1/2 head: feature fusion, ``fc`` over (embedding, feature),
    and Llama decoder layers; the target's LM head reads the output."""

    def __init__(self, config: EagleConfig) -> None:
        super().__init__()
        self.config: EagleConfig = config
        self.layout = OWN_LAYOUT if config.first_input_norm else "EAGLE-1"
        width = config.hidden_size
        fused = len(config.feature_layers) * width
        self.fuse: torch.nn.Module = (
            torch.nn.Linear(fused, width, bias=False) if fused != width else torch.nn.Identity()
        )
        self.fc = torch.nn.Linear(2 * width, width, bias=config.fc_bias)
        self.body = LlamaModel(config.body_config())
        if not config.first_input_norm:
            self.body.layers[0].add_module("input_layernorm", torch.nn.Identity())
        if not config.final_norm:
            self.body.add_module("norm", torch.nn.Identity())
        if config.qkv_bias:
            for layer in self.body.layers:
                add_qkv_biases(layer.get_submodule("self_attn"))

    def fuse_features(self, features: torch.Tensor) -> torch.Tensor:
        return self.fuse(features.to(self.fc.weight.dtype))

    def body_inputs(self, features: torch.Tensor, token_embeds: torch.Tensor) -> torch.Tensor:
        return self.fc(torch.cat([token_embeds, features], dim=-1))  # (embedding, feature): the reference's order

    # -----------------------------------------------------------------------------------------

    def save(self, directory: str | Path, extra: dict[str, Any] | None = None) -> None:
        """``config.json`` + ``model.safetensors`` (the head's weights only), in specserve's own layout."""
        out = Path(directory)
        out.mkdir(parents=True, exist_ok=True)
        config = {"specserve_drafter": KIND, **asdict(self.config), **(extra or {})}
        (out / CONFIG_FILE).write_text(json.dumps(config, indent=2) + "\n")
        state = {name: tensor.detach().contiguous().cpu() for name, tensor in self.state_dict().items()}
        save_file(state, str(out / WEIGHTS_FILE))

    @staticmethod
    def read_config(directory: str | Path) -> dict[str, Any]:
        return read_head_config(directory, KIND, "an EAGLE head", EagleLoadError, TRAIN_HINT)

    @classmethod
    def load(cls, directory: str | Path) -> EagleHead:
        """The head saved in ``directory`` in specserve's own layout, in the dtype it was saved in."""
        data = cls.read_config(directory)
        fields = {name: data[name] for name in EagleConfig.__dataclass_fields__ if name in data}
        try:
            config = EagleConfig(**{**fields, "feature_layers": tuple(fields["feature_layers"])})
        except (KeyError, TypeError) as exc:
            raise EagleLoadError(f"{directory}/{CONFIG_FILE} is incomplete: {exc}") from exc
        head = cls(config)
        weights = Path(directory) / WEIGHTS_FILE
        if not weights.is_file():
            raise EagleLoadError(f"{directory} has no {WEIGHTS_FILE}")
        try:
            state = load_file(str(weights))
            head = head.to(next(iter(state.values())).dtype)
            head.load_state_dict(state)
        except (RuntimeError, OSError, StopIteration) as exc:
            raise EagleLoadError(f"could not load the EAGLE head weights in {weights}: {exc}") from exc
        return head.eval()


def check_head_fits(head: FeatureHead, target: CausalLM | TargetDescription, hidden_size: int, num_layers: int) -> None:
    """Raise :class:`EagleLoadError` unless ``head`` reads this target's features and scores its vocabulary."""
    config = head.config
    problems = []
    if config.vocab_size != target.info.vocab_size:
        problems.append(f"vocabulary {config.vocab_size} vs the target's {target.info.vocab_size}")
    if head.target_hidden_size != hidden_size:
        problems.append(f"hidden size {head.target_hidden_size} vs the target's {hidden_size}")
    if max(config.feature_layers) > num_layers or (config.target_num_layers and config.target_num_layers != num_layers):
        problems.append(f"features of a {config.target_num_layers}-layer target vs this {num_layers}-layer one")
    if problems:
        detail, path = "; ".join(problems), target.info.path
        if head.layout == OWN_LAYOUT:
            fix = f"train one for {path} with `specserve train eagle --target {path}`"
        else:
            fix = f"use a head published for the model in {path}"
        raise EagleLoadError(f"this {head.layout} head was trained for another target ({detail}); {fix}")
