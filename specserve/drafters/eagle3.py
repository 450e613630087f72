"""The EAGLE-3 head as published (SafeAILab ``cnets.py``, SGLang/vLLM ``llama_eagle3``): docs/published-heads.md §2.

The head reads the concatenated *inputs* of three target layers (default 2, L // 2 and L - 3), projects them with
``fc`` ``[H, 3 H_t]`` to g, and runs one decoder layer ("midlayer") whose attention takes 2H:
``z = cat(input_layernorm(embedding), hidden_norm(g))``; the residual is g (or ``hidden_norm(g)`` with
``norm_before_residual``, the variant vLLM's speculators adapter defaults to); ``h = residual + attn(z)``, then
``h = h + mlp(post_attention_layernorm(h))``. h, before any norm, is what the next draft step feeds back; the logits
are ``lm_head(norm(h))`` over a draft vocabulary of ``V_d`` tokens, the draft token i standing for the target token
``i + d2t[i]``. The later variants (§2.7) are flags: ``norm_before_fc`` (one RMSNorm over the concatenated aux
states, ``input_norm``), ``fc_norm`` (one per aux state, ``fc_norm.{k}``) and ``norm_output`` (feed back ``norm(h)``,
which the LM head then reads as it is). :class:`DraftVocabLogits` scatters the logits into the target's vocabulary
with every other token at ``-inf``: q is exactly 0 off the draft vocabulary's image, so a drafted token always lies
inside it and verification (``max(0, p - q)`` over the whole vocabulary) stays exact.

This module holds the head's modules and their forward; reading a published directory into them is
:mod:`specserve.drafters.eagle_layouts`. Only single-layer heads (every published EAGLE-3 head seen) are built.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import torch
from transformers import LlamaModel
from transformers.cache_utils import Cache
from transformers.models.llama.modeling_llama import LlamaAttention, LlamaMLP, LlamaRMSNorm

from specserve.core.errors import UserError
from specserve.drafters.eagle_head import EagleConfig, FeatureHead, target_layer_shape

if TYPE_CHECKING:
    from transformers import PreTrainedModel


def default_aux_layers(num_layers: int) -> tuple[int, ...]:
    """The reference's aux layers: the inputs of layers 2, L // 2 and L - 3 (``hidden_states`` indices)."""
    if num_layers < 4:
        raise UserError(
            f"an EAGLE-3 head reads the inputs of layers 2, L//2 and L-3; this target has only {num_layers} layers"
        )
    return (2, num_layers // 2, num_layers - 3)


@dataclass(frozen=True)
class Eagle3Config:
    feature_layers: tuple[int, ...]  # indices into the target's hidden_states: the inputs of the aux layers
    hidden_size: int  # H, the head's width
    target_hidden_size: int  # H_t, the width of each target feature
    vocab_size: int  # the target's vocabulary
    draft_vocab_size: int  # V_d, the rows of the head's own LM head
    intermediate_size: int
    num_attention_heads: int
    num_key_value_heads: int
    max_position_embeddings: int
    head_dim: int = 0  # 0: hidden_size // num_attention_heads
    rms_norm_eps: float = 1e-6
    rope_theta: float = 10000.0
    rope_type: str = "default"
    rope_factor: float = 1.0
    norm_before_residual: bool = False  # SafeAILab's and SGLang's behaviour is False
    fc_bias: bool = False
    norm_before_fc: bool = False  # an RMSNorm over the concatenated aux states before fc (input_norm)
    fc_norm: bool = False  # an RMSNorm per aux state before fc (fc_norm.{k})
    norm_output: bool = False  # feed back norm(h) instead of h (EAGLE-3.1)
    own_embeddings: bool = False  # the head carries embed_tokens (needed when H != H_t)
    target_num_layers: int = 0

    @staticmethod
    def for_target(target: PreTrainedModel, draft_vocab_size: int | None = None) -> Eagle3Config:
        """A head of the reference's shape for ``target``: one of its layers wide, its default aux layers, a draft
        vocabulary of ``draft_vocab_size`` tokens (default: the whole vocabulary)."""
        shape = target_layer_shape(target)
        vocab, hidden, heads = shape["vocab_size"], shape["hidden_size"], shape["num_attention_heads"]
        if draft_vocab_size is not None and not 0 < draft_vocab_size <= vocab:
            raise UserError(f"the draft vocabulary must hold 1..{vocab} tokens, got {draft_vocab_size}")
        return Eagle3Config(
            feature_layers=default_aux_layers(shape["target_num_layers"]),
            target_hidden_size=hidden,
            draft_vocab_size=draft_vocab_size or vocab,
            head_dim=int(getattr(target.config, "head_dim", None) or hidden // heads),
            **shape,
        )

    def body_config(self) -> Any:
        """The midlayer's shapes as a one-layer Llama config (the attention and cache read heads and head_dim)."""
        llama = EagleConfig(
            feature_layers=self.feature_layers,
            hidden_size=self.hidden_size,
            vocab_size=self.vocab_size,
            intermediate_size=self.intermediate_size,
            num_attention_heads=self.num_attention_heads,
            num_key_value_heads=self.num_key_value_heads,
            max_position_embeddings=self.max_position_embeddings,
            rms_norm_eps=self.rms_norm_eps,
            rope_theta=self.rope_theta,
            head_dim=self.head_dim,
            rope_type=self.rope_type,
            rope_factor=self.rope_factor,
        )
        return llama.body_config()


class Eagle3Layer(torch.nn.Module):
    """EAGLE-3's midlayer, called as a Llama decoder layer on ``cat(embedding, g)`` (``[..., 2H]``)."""

    def __init__(self, config: Eagle3Config, llama_config: Any) -> None:
        super().__init__()
        width, eps = config.hidden_size, config.rms_norm_eps
        self.width = width
        self.norm_before_residual = config.norm_before_residual
        self.self_attn = LlamaAttention(llama_config, layer_idx=0)
        for name in ("q_proj", "k_proj", "v_proj"):  # the attention reads both halves: 2H in
            old = getattr(self.self_attn, name)
            setattr(self.self_attn, name, torch.nn.Linear(2 * width, old.out_features, bias=False))
        self.mlp = LlamaMLP(llama_config)
        self.input_layernorm = LlamaRMSNorm(width, eps=eps)  # on the token embedding
        self.hidden_norm = LlamaRMSNorm(width, eps=eps)  # on g
        self.post_attention_layernorm = LlamaRMSNorm(width, eps=eps)

    def forward(
        self,
        hidden_states: torch.Tensor,  # [batch, k, 2H]: (embedding, g)
        attention_mask: torch.Tensor | None = None,
        position_ids: torch.Tensor | None = None,
        cache: Cache | None = None,
        use_cache: bool | None = False,
        position_embeddings: tuple[torch.Tensor, torch.Tensor] | None = None,
        **kwargs: Any,
    ) -> torch.Tensor:  # [batch, k, H]
        embeds, hidden = hidden_states.split(self.width, dim=-1)
        normed = self.hidden_norm(hidden)
        residual = normed if self.norm_before_residual else hidden
        attended, _ = self.self_attn(
            hidden_states=torch.cat([self.input_layernorm(embeds), normed], dim=-1),
            attention_mask=attention_mask,
            position_ids=position_ids,
            cache=cache,
            use_cache=use_cache,
            position_embeddings=position_embeddings,
            **kwargs,
        )
        out = residual + attended
        return out + self.mlp(self.post_attention_layernorm(out))


class DraftVocabLogits(torch.nn.Module):
    """``lm_head(norm(h))`` over the draft vocabulary, scattered into the target's: token ``i + d2t[i]`` gets draft
    row i, every other token ``-inf`` (probability exactly 0)."""

    def __init__(self, head: Eagle3Head) -> None:
        super().__init__()
        self.norm: torch.nn.Module = torch.nn.Identity() if head.config.norm_output else head.norm  # h is normed
        self.lm_head = head.lm_head
        self.vocab_size = head.config.vocab_size
        self.reduced = head.config.draft_vocab_size != head.config.vocab_size
        self.register_buffer("ids", head.draft_token_ids(), persistent=False)

    def forward(self, hidden: torch.Tensor) -> torch.Tensor:
        logits = self.lm_head(self.norm(hidden))
        if not self.reduced:
            return logits
        full = logits.new_full((*logits.shape[:-1], self.vocab_size), float("-inf"))
        return full.index_copy(full.dim() - 1, self.ids.to(logits.device), logits)


class Eagle3Head(FeatureHead):
    """The EAGLE-3 head: ``fc`` over the aux features, the 2H-attention midlayer, ``norm`` + ``lm_head`` + ``d2t``."""

    layout = "EAGLE-3"

    def __init__(self, config: Eagle3Config) -> None:
        super().__init__()
        self.config: Eagle3Config = config
        width, aux = config.hidden_size, config.target_hidden_size
        self.input_norm = (
            LlamaRMSNorm(len(config.feature_layers) * aux, eps=config.rms_norm_eps) if config.norm_before_fc else None
        )
        self.fc_norm = (
            torch.nn.ModuleList(LlamaRMSNorm(aux, eps=config.rms_norm_eps) for _ in config.feature_layers)
            if config.fc_norm
            else None
        )
        self.fc = torch.nn.Linear(len(config.feature_layers) * aux, width, bias=config.fc_bias)
        self.body = LlamaModel(config.body_config())
        self.body.layers[0] = Eagle3Layer(config, self.body.config)  # the body's config: its attention choice
        self.body.add_module("norm", torch.nn.Identity())  # h leaves the layer unnormed: the norm is the output head's
        self.norm = LlamaRMSNorm(width, eps=config.rms_norm_eps)
        self.lm_head = torch.nn.Linear(width, config.draft_vocab_size, bias=False)
        self.embed_tokens = torch.nn.Embedding(config.vocab_size, width) if config.own_embeddings else None
        self.register_buffer("d2t", torch.zeros(config.draft_vocab_size, dtype=torch.long))
        self.register_buffer("t2d", torch.ones(config.vocab_size, dtype=torch.bool))

    @property
    def target_hidden_size(self) -> int:
        return self.config.target_hidden_size

    def fuse_features(self, features: torch.Tensor) -> torch.Tensor:
        features = features.to(self.fc.weight.dtype)
        if self.fc_norm is not None:
            parts = features.split(self.config.target_hidden_size, dim=-1)
            features = torch.cat([norm(part) for norm, part in zip(self.fc_norm, parts, strict=True)], dim=-1)
        elif self.input_norm is not None:
            features = self.input_norm(features)
        return self.fc(features)

    def body_inputs(self, features: torch.Tensor, token_embeds: torch.Tensor) -> torch.Tensor:
        return torch.cat([token_embeds, features], dim=-1)  # the midlayer splits them again

    def body_output(self, hidden: torch.Tensor) -> torch.Tensor:
        return self.norm(hidden) if self.config.norm_output else hidden

    def output_head(self, lm_head: torch.nn.Module) -> torch.nn.Module:
        return DraftVocabLogits(self)

    def input_embeddings(self, embeddings: torch.nn.Module) -> torch.nn.Module:
        return self.embed_tokens if self.embed_tokens is not None else embeddings

    def set_draft_vocabulary(self, token_ids: Sequence[int]) -> None:
        """Make the draft vocabulary the target tokens ``token_ids`` (``draft_vocab_size`` distinct ids; stored
        ascending, as the reference builds ``d2t`` and ``t2d``)."""
        d2t, t2d = self.get_buffer("d2t"), self.get_buffer("t2d")
        ids = torch.tensor(sorted(set(int(i) for i in token_ids)), dtype=torch.long, device=d2t.device)
        if ids.numel() != self.config.draft_vocab_size or int(ids[0]) < 0 or int(ids[-1]) >= self.config.vocab_size:
            raise ValueError(f"need {self.config.draft_vocab_size} distinct ids in 0..{self.config.vocab_size - 1}")
        with torch.no_grad():
            d2t.copy_(ids - torch.arange(ids.numel(), device=ids.device))
            t2d.zero_().index_fill_(0, ids, True)

    def draft_token_ids(self) -> torch.Tensor:
        """The target ids of the draft vocabulary, in draft order (``arange(V_d) + d2t``)."""
        d2t = self.get_buffer("d2t")
        return d2t + torch.arange(d2t.shape[0], device=d2t.device)
