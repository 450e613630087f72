"""Tiny targets whose checkpoint carries an MTP module, written as DeepSeek-V3 and GLM-4.5 publish theirs.

:func:`write_checkpoint` saves a random target of ``L`` layers (``config.json`` with ``num_nextn_predict_layers: 1``,
one ``model.safetensors``, the char tokenizer) whose MTP module sits at ``model.layers.L``: ``enorm``, ``hnorm``,
``eh_proj``, a decoder layer of the family (a mixture of experts stored per expert, as transformers writes it for the
published layout), ``shared_head.norm``, ``shared_head.head`` and a copy of ``embed_tokens``. Used by
``tests/drafters/test_mtp.py`` and the distributed MTP test.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import torch
import transformers
from conftest import BOS_ID, EOS_ID, MAX_POSITIONS, PAD_ID, VOCAB, char_tokenizer, randomise_
from safetensors.torch import load_file, save_file
from transformers import AutoModelForCausalLM

L = 2  # the target's layers; the MTP module sits at model.layers.2
H = 32
MOE = {"moe_intermediate_size": 16, "n_routed_experts": 4, "num_experts_per_tok": 2, "n_shared_experts": 1}
FAMILIES: dict[str, tuple[str, dict[str, Any]]] = {
    # GLM-4.5: grouped-query attention with partial rotary and q/k/v biases, sigmoid-routed experts
    "glm4_moe": ("Glm4MoeConfig", {**MOE, "num_key_value_heads": 2, "head_dim": 8, "attention_bias": True}),
    # DeepSeek-V3: multi-head latent attention (keys 12 wide, values 6), the same routing
    "deepseek_v3": (
        "DeepseekV3Config",
        {**MOE, "num_key_value_heads": 4, "q_lora_rank": 16, "kv_lora_rank": 8, "qk_rope_head_dim": 4,
         "qk_nope_head_dim": 8, "v_head_dim": 6},
    ),
}  # fmt: skip


def family_config(name: str, layers: int, **extra: Any) -> Any:
    config_class, options = FAMILIES[name]
    return getattr(transformers, config_class)(
        vocab_size=VOCAB,
        hidden_size=H,
        intermediate_size=64,
        num_hidden_layers=layers,
        num_attention_heads=4,
        max_position_embeddings=MAX_POSITIONS,
        pad_token_id=PAD_ID,
        bos_token_id=BOS_ID,
        eos_token_id=EOS_ID,
        first_k_dense_replace=1,  # layer 0 dense, layer 1 and the MTP layer mixtures of experts
        n_group=1,
        topk_group=1,
        tie_word_embeddings=False,
        **options,
        **extra,
    )


def write_checkpoint(directory: Path, name: str, seed: int) -> dict[str, torch.Tensor]:
    """A target of L layers with its MTP module at ``model.layers.L``, as published; returns every stored tensor."""
    deeper = AutoModelForCausalLM.from_config(family_config(name, L + 1), experts_implementation="eager")
    randomise_(deeper, seed)
    deeper.save_pretrained(directory / "deeper")  # transformers' own per-expert layout of layer L
    tensors = load_file(str(directory / "deeper" / "model.safetensors"))
    generator = torch.Generator().manual_seed(seed + 1)
    p = f"model.layers.{L}."
    tensors[p + "enorm.weight"] = 1 + 0.1 * torch.randn(H, generator=generator)
    tensors[p + "hnorm.weight"] = 1 + 0.1 * torch.randn(H, generator=generator)
    tensors[p + "eh_proj.weight"] = 0.2 * torch.randn(H, 2 * H, generator=generator)
    tensors[p + "shared_head.norm.weight"] = 1 + 0.1 * torch.randn(H, generator=generator)
    tensors[p + "shared_head.head.weight"] = tensors["lm_head.weight"].clone()
    tensors[p + "embed_tokens.weight"] = tensors["model.embed_tokens.weight"].clone()
    config = json.loads((directory / "deeper" / "config.json").read_text())
    config.update(num_hidden_layers=L, num_nextn_predict_layers=1)
    (directory / "config.json").write_text(json.dumps(config))
    save_file({k: v.contiguous() for k, v in tensors.items()}, str(directory / "model.safetensors"))
    char_tokenizer().save_pretrained(directory)
    return {k: v.double() if v.is_floating_point() else v for k, v in tensors.items()}
