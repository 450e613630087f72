"""Tiny checkpoints of every architecture family specserve serves, saved as a download leaves them.

:func:`make_checkpoint` builds a family's random-initialised target (2 layers, grouped-query attention, the char
tokenizer's vocabulary) and a draft of the same family sharing its embeddings, first block and head, saves both with
``save_pretrained`` and loads them back through :meth:`CausalLM.load`, beside transformers' own greedy continuation
of :data:`PROMPTS` over a freshly loaded copy. :data:`FAMILIES` says what makes each tiny model exercise its family's
peculiarity; :data:`REFUSED` the layers specserve refuses at load. Used by ``tests/core/model/test_architectures.py``
and ``tests/core/kv/test_recurrent.py``.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import pytest
import torch
import transformers
from conftest import BOS_ID, EOS_ID, MAX_POSITIONS, PAD_ID, VOCAB, char_tokenizer, hf_greedy_ids, randomise_
from transformers import AutoModelForCausalLM, PreTrainedModel

from specserve.core.draft.drafter import Drafter
from specserve.core.model.causal_lm import CausalLM
from specserve.core.tree.shapes import TreeBudget, TreeSpec
from specserve.drafters.model import DraftModelDrafter
from specserve.drafters.ngram import NgramDrafter
from specserve.drafters.none import NoDrafter

NEW_TOKENS = 16
ALPHA = 1e-3  # a chi-square test's error probability
DYNAMIC = TreeSpec("dynamic", budget=TreeBudget(depth=3, width=2, nodes=5))
PROMPTS = ((5, 6, 7, 8, 5, 6, 7, 8, 5, 6, 7), (40, 41, 40, 41, 40, 41, 40), (17, 33, 60, 9), (70, 71, 72))


@dataclass(frozen=True)
class Family:
    config_class: str  # the transformers config class
    options: dict[str, Any]  # beyond the shared tiny shape
    architecture: str  # the class AutoModelForCausalLM builds
    draft_options: dict[str, Any] = field(default_factory=dict)  # the draft's, over ``options``
    draft_layers: int = 1


# GLM-4.5's and DeepSeek-V3's mixture: a dense first layer, then 4 routed experts in 2 groups (the best 1 searched),
# each token sent to 2, beside a shared expert
GROUPED_ROUTING = {
    "n_routed_experts": 4,
    "num_experts_per_tok": 2,
    "moe_intermediate_size": 16,
    "first_k_dense_replace": 1,
    "n_group": 2,
    "topk_group": 1,
    "n_shared_experts": 1,
}

# Families that run: each option is what makes the tiny model exercise the family's peculiarity.
FAMILIES = {
    "llama": Family("LlamaConfig", {"tie_word_embeddings": False}, "LlamaForCausalLM"),
    "qwen2": Family("Qwen2Config", {}, "Qwen2ForCausalLM"),  # q/k/v biases (randomised), tied embeddings
    "mistral": Family("MistralConfig", {"sliding_window": None}, "MistralForCausalLM"),  # as Mistral-7B-v0.3
    "qwen3": Family("Qwen3Config", {"head_dim": 8}, "Qwen3ForCausalLM"),  # per-head q/k norms, explicit head_dim
    "granite": Family(
        "GraniteConfig",
        {"embedding_multiplier": 2.0, "residual_multiplier": 0.5, "attention_multiplier": 0.2, "logits_scaling": 1.5},
        "GraniteForCausalLM",
    ),
    "phi3": Family("Phi3Config", {}, "Phi3ForCausalLM"),  # fused qkv and gate/up projections
    "olmo2": Family("Olmo2Config", {}, "Olmo2ForCausalLM"),  # q/k norms over all heads, norms after each sublayer
    # sliding windows of 16 positions, shorter than prompt + output: every layer windowed, one mask
    "mistral-v0.1": Family("MistralConfig", {"sliding_window": 16}, "MistralForCausalLM"),
    "phi3-4k": Family("Phi3Config", {"sliding_window": 16}, "Phi3ForCausalLM"),
    # a full layer, then a windowed one: a mask per layer type
    "qwen2-sliding": Family(
        "Qwen2Config", {"use_sliding_window": True, "sliding_window": 16, "max_window_layers": 1}, "Qwen2ForCausalLM"
    ),
    # soft-capped attention logits (tanh(s / 50) * 50, transformers' eager attention), local and global layers
    "gemma2": Family(
        "Gemma2Config", {"head_dim": 8, "sliding_window": 16, "query_pre_attn_scalar": 8}, "Gemma2ForCausalLM"
    ),
    # attention sinks, windowed and full layers, a mixture of 4 experts (top 2)
    "gpt-oss": Family(
        "GptOssConfig",
        {"head_dim": 8, "sliding_window": 16, "num_local_experts": 4, "num_experts_per_tok": 2},
        "GptOssForCausalLM",
    ),
    "gemma3": Family(  # local and global layers alternating, each with its own RoPE base; q/k norms; the query
        # scale of head_dim (as the published models: theirs is 256 = head_dim) keeps the tiny model's attention sharp
        "Gemma3TextConfig",
        {"head_dim": 8, "sliding_window": 16, "sliding_window_pattern": 2, "query_pre_attn_scalar": 8},
        "Gemma3ForCausalLM",
    ),
    # mixtures of experts: 4 experts, each token routed to 2
    "qwen3-moe": Family(
        "Qwen3MoeConfig",
        {"head_dim": 8, "num_experts": 4, "num_experts_per_tok": 2, "moe_intermediate_size": 16},
        "Qwen3MoeForCausalLM",
    ),
    "mixtral": Family("MixtralConfig", {"num_local_experts": 4, "num_experts_per_tok": 2}, "MixtralForCausalLM"),
    # a dense first layer, then routed experts in groups (2 groups, the best 1 searched) beside a shared expert
    "glm4-moe": Family(
        "Glm4MoeConfig",
        {"head_dim": 8, **GROUPED_ROUTING},
        "Glm4MoeForCausalLM",
    ),
    # multi-head latent attention (queries and keys/values through low-rank projections, a decoupled RoPE part,
    # values narrower than keys) and DeepSeek's grouped routing with a shared expert
    "deepseek-v3": Family(
        "DeepseekV3Config",
        {
            **GROUPED_ROUTING,
            "q_lora_rank": 24,
            "kv_lora_rank": 16,
            "qk_rope_head_dim": 4,
            "qk_nope_head_dim": 8,
            "v_head_dim": 6,
            "num_key_value_heads": 4,  # MLA expands its latent to every head: no grouped-query sharing
        },
        "DeepseekV3ForCausalLM",
    ),
    # hybrids: a recurrent layer, then an attention one; the 2-layer draft has them the other way round (its own
    # recurrent layer rolled back too), sharing the target's embeddings, norm and head
    "qwen3-next": Family(  # Gated DeltaNet (linear attention with a short convolution), experts
        "Qwen3NextConfig",
        {
            "head_dim": 8,
            "layer_types": ["linear_attention", "full_attention"],
            "linear_num_value_heads": 4,
            "linear_num_key_heads": 2,
            "linear_key_head_dim": 8,
            "linear_value_head_dim": 8,
            "num_experts": 4,
            "num_experts_per_tok": 2,
            "moe_intermediate_size": 16,
            "shared_expert_intermediate_size": 16,
        },
        "Qwen3NextForCausalLM",
        draft_options={"layer_types": ["full_attention", "linear_attention"]},
        draft_layers=2,
    ),
    "granite-4": Family(  # Mamba-2 (state-space) layers between attention ones
        "GraniteMoeHybridConfig",
        {
            "layer_types": ["mamba", "attention"],
            "mamba_n_heads": 8,
            "mamba_d_head": 8,
            "mamba_n_groups": 1,
            "mamba_d_state": 8,
            "mamba_d_conv": 4,
            "mamba_expand": 2,
            "num_local_experts": 0,
            "shared_intermediate_size": 64,
        },
        "GraniteMoeHybridForCausalLM",
        draft_options={"layer_types": ["attention", "mamba"]},
        draft_layers=2,
    ),
    "nemotron-h": Family(  # Mamba-2 and attention layers, each a block of its own
        "NemotronHConfig",
        {
            "hybrid_override_pattern": "M*",
            "mamba_num_heads": 8,
            "mamba_head_dim": 8,
            "n_groups": 1,
            "ssm_state_size": 8,
            "conv_kernel": 4,
            "expand": 2,
            "head_dim": 8,
        },
        "NemotronHForCausalLM",
        draft_options={"hybrid_override_pattern": "*M"},
        draft_layers=2,
    ),
    "falcon-h1": Family(  # attention and Mamba-2 side by side in every layer
        "FalconH1Config",
        {
            "head_dim": 8,
            "mamba_n_heads": 8,
            "mamba_d_head": 8,
            "mamba_d_ssm": 64,
            "mamba_n_groups": 1,
            "mamba_d_state": 8,
            "mamba_d_conv": 4,
            "mamba_expand": 2,
        },
        "FalconH1ForCausalLM",
    ),
}

# Layers specserve does not serve yet: refused at load, saying what.
REFUSED = {
    "llama4-chunked": (  # attention in chunks of 16 positions in 3 of every 4 layers
        Family("Llama4TextConfig", {"head_dim": 8, "attention_chunk_size": 16, "no_rope_layers": [1, 0]}, ""),
        "has layers of type 'chunked_attention'",
    ),
}


def build(family: Family, num_layers: int, seed: int, draft: bool = False) -> PreTrainedModel:
    shape = {"hidden_size": 32, "intermediate_size": 64, "num_attention_heads": 4, "num_key_value_heads": 2}
    config = getattr(transformers, family.config_class)(
        vocab_size=VOCAB,
        num_hidden_layers=num_layers,
        max_position_embeddings=MAX_POSITIONS,
        pad_token_id=PAD_ID,
        bos_token_id=BOS_ID,
        eos_token_id=EOS_ID,
        **{**shape, **family.options, **(family.draft_options if draft else {})},
    )
    # float64: a mixture of experts runs its experts one by one (torch's grouped matmul takes no float64), as
    # CausalLM.load does
    model = AutoModelForCausalLM.from_config(config, experts_implementation="eager").double().eval()
    randomise_(model, seed)
    with torch.no_grad():
        model.get_output_embeddings().weight[EOS_ID] *= 2.0  # greedy decoding reaches EOS in some contexts
    return model


def save(model: PreTrainedModel, directory: Path) -> Path:
    """A checkpoint directory as a download leaves it: config, safetensors weights, tokenizer files."""
    model.save_pretrained(directory)
    char_tokenizer().save_pretrained(directory)
    return directory


@dataclass(frozen=True)
class Checkpoint:
    name: str
    target: CausalLM  # loaded from its directory by CausalLM.load
    draft: CausalLM  # 1-layer, same family and vocabulary
    reference: PreTrainedModel  # the target loaded again by transformers alone
    greedy: dict[tuple[int, ...], list[int]]  # transformers' greedy continuation of each prompt

    def new_drafter(self, name: str) -> Drafter:
        if name == "ngram":
            return NgramDrafter(max_ngram=3, min_ngram=1)
        if name == "none":
            return NoDrafter()
        return DraftModelDrafter(self.draft, self.target)


def make_checkpoint(name: str, tmp_path_factory: pytest.TempPathFactory) -> Checkpoint:
    family = FAMILIES[name]
    root = tmp_path_factory.mktemp(name)
    target_model = build(family, num_layers=2, seed=0)
    draft_model = build(family, num_layers=family.draft_layers, seed=1, draft=True)
    shared = target_model.state_dict()  # the draft copies the target's embeddings, first block, norm and head
    draft_model.load_state_dict(
        {k: shared[k].clone() if k in shared else v for k, v in draft_model.state_dict().items()}
    )
    target_dir, draft_dir = save(target_model, root / "target"), save(draft_model, root / "draft")

    reference = AutoModelForCausalLM.from_pretrained(
        target_dir, local_files_only=True, dtype=torch.float64, experts_implementation="eager"
    ).eval()
    greedy = {prompt: hf_greedy_ids(reference, prompt, NEW_TOKENS) for prompt in PROMPTS}
    tokens = [token for ids in greedy.values() for token in ids]
    assert len(set(tokens)) > 8, f"{name}: degenerate greedy continuations would make the checks vacuous"
    target = CausalLM.load(target_dir, dtype="float64")
    draft = CausalLM.load(draft_dir, dtype="float64")
    return Checkpoint(name, target, draft, reference, greedy)
