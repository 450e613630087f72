"""Random-weight EAGLE heads written in the published file layouts (docs/published-heads.md), for the tests.

Each :class:`Layout` is one published variant: file name, tensor names, shapes, bfloat16 weights and the config
fields its reference reads. :func:`write_head` writes one beside a tiny target of conftest's shapes. :class:`Payload`
is a pickle that would run code when unpickled without restriction (for the loaders' refusal tests).
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path

import torch
from conftest import MAX_POSITIONS, VOCAB
from safetensors.torch import save_file

H, HEADS, KV_HEADS, HEAD_DIM, INTERMEDIATE = 32, 4, 2, 8, 64  # the tiny target's shapes (conftest.build_model)
THETA, EPS = 10000.0, 1e-5
DRAFT_VOCAB = 40


@dataclass(frozen=True)
class Layout:
    name: str
    eagle3: bool
    file: str  # "model.safetensors" or "pytorch_model.bin"
    config: dict[str, object]  # the config.json fields beyond the common Llama ones
    fc_bias: bool = False
    midlayer: str = "midlayer."  # EAGLE-3's layer prefix: SafeAILab's, or vLLM's "layers.0."
    reduced: bool = False  # EAGLE-3 with a draft vocabulary of DRAFT_VOCAB tokens
    norm_before_residual: bool = False
    norm_before_fc: bool = False  # input_norm over the concatenated aux states
    fc_norm: bool = False  # fc_norm.{k} per aux state
    norm_output: bool = False  # norm(h) fed back
    speculators: bool = False  # vLLM's speculators format: the decoder fields in transformer_layer_config


LAYOUTS = {
    # Vicuna / LLaMA-2-chat EAGLE heads: no "bias" key (fc has one), a pickle
    "eagle1-vicuna": Layout("eagle1-vicuna", False, "pytorch_model.bin", {}, fc_bias=True),
    # LLaMA-3 EAGLE heads: "bias": false
    "eagle1-llama3": Layout("eagle1-llama3", False, "model.safetensors", {"bias": False}),
    "eagle3": Layout(
        "eagle3",
        True,
        "model.safetensors",
        {"architectures": ["LlamaForCausalLMEagle3"], "draft_vocab_size": DRAFT_VOCAB},
        reduced=True,
    ),
    # the midlayer under vLLM's name, the residual taken after hidden_norm, the full vocabulary
    "eagle3-vllm": Layout(
        "eagle3-vllm",
        True,
        "model.safetensors",
        {"architectures": ["Eagle3LlamaForCausalLM"], "norm_before_residual": True},
        midlayer="layers.0.",
        norm_before_residual=True,
    ),
    # EAGLE-3.1: a norm per aux state, norm(h) fed back (one flag where vLLM also reads it, in eagle_config)
    "eagle3.1": Layout(
        "eagle3.1",
        True,
        "model.safetensors",
        {"draft_vocab_size": DRAFT_VOCAB, "fc_norm": True, "eagle_config": {"norm_output": True}},
        reduced=True,
        fc_norm=True,
        norm_output=True,
    ),
    # speculators: no norm_before_residual key (true in that format), a norm before fc, a suggested γ of 5
    "speculators": Layout(
        "speculators",
        True,
        "model.safetensors",
        {
            "speculators_model_type": "eagle3",
            "speculators_version": "0.2.0",
            "architectures": ["Eagle3Speculator"],
            "draft_vocab_size": DRAFT_VOCAB,
            "norm_before_fc": True,
            "speculators_config": {
                "algorithm": "eagle3",
                "default_proposal_method": "greedy",
                "proposal_methods": [{"proposal_type": "greedy", "speculative_tokens": 5, "verifier_accept_k": 1}],
                "verifier": {"name_or_path": "org/tiny-llama", "architectures": ["LlamaForCausalLM"]},
            },
        },
        midlayer="layers.0.",
        reduced=True,
        norm_before_residual=True,
        norm_before_fc=True,
        speculators=True,
    ),
    # speculators "eagle": EAGLE-1's head under the names fusion_fc.* and transformer.*, its fc with a bias
    "speculators-eagle": Layout(
        "speculators-eagle",
        False,
        "model.safetensors",
        {
            "speculators_model_type": "eagle",
            "speculators_version": "0.1.0",
            "architectures": ["EagleSpeculator"],
            "transformer_layer_architecture": "LlamaDecoderLayer",
            "layernorms": False,
            "fusion_bias": True,
            "speculators_config": {
                "algorithm": "eagle",
                "default_proposal_method": "greedy",
                "proposal_methods": [{"proposal_type": "greedy", "speculative_tokens": 5, "verifier_accept_k": 1}],
                "verifier": {"name_or_path": "org/tiny-llama", "architectures": ["LlamaForCausalLM"]},
            },
        },
        fc_bias=True,
        speculators=True,
    ),
}
SPECULATORS_EAGLE_NAMES = {"fc.": "fusion_fc.", "layers.0.": "transformer."}  # SafeAILab's prefix -> the file's


def published_tensors(layout: Layout, seed: int) -> dict[str, torch.Tensor]:
    """Random weights under the published names and shapes, in bfloat16 (d2t/t2d as the reference builds them)."""
    gen = torch.Generator().manual_seed(seed)

    def rand(*shape: int, scale: float = 0.25) -> torch.Tensor:
        return (torch.randn(*shape, generator=gen) * scale).to(torch.bfloat16)

    def norm() -> torch.Tensor:
        return (1 + 0.2 * torch.randn(H, generator=gen)).to(torch.bfloat16)

    width = 2 * H if layout.eagle3 else H  # EAGLE-3's attention reads cat(embedding, hidden)
    prefix = layout.midlayer if layout.eagle3 else "layers.0."
    tensors = {
        f"{prefix}self_attn.q_proj.weight": rand(HEADS * HEAD_DIM, width),
        f"{prefix}self_attn.k_proj.weight": rand(KV_HEADS * HEAD_DIM, width),
        f"{prefix}self_attn.v_proj.weight": rand(KV_HEADS * HEAD_DIM, width),
        f"{prefix}self_attn.o_proj.weight": rand(H, HEADS * HEAD_DIM),
        f"{prefix}mlp.gate_proj.weight": rand(INTERMEDIATE, H),
        f"{prefix}mlp.up_proj.weight": rand(INTERMEDIATE, H),
        f"{prefix}mlp.down_proj.weight": rand(H, INTERMEDIATE),
        f"{prefix}post_attention_layernorm.weight": norm(),
        "embed_tokens.weight": rand(VOCAB, H),  # published files may carry the target's table; it goes unused
    }
    if not layout.eagle3:
        tensors["fc.weight"] = rand(H, 2 * H)
        if layout.fc_bias:
            tensors["fc.bias"] = rand(H)
        return tensors
    vocab = DRAFT_VOCAB if layout.reduced else VOCAB
    used = torch.randperm(VOCAB, generator=gen)[:vocab].sort().values  # the reference: ascending target ids
    tensors |= {
        "fc.weight": rand(H, 3 * H),
        f"{prefix}input_layernorm.weight": norm(),
        f"{prefix}hidden_norm.weight": norm(),
        "norm.weight": norm(),
        "lm_head.weight": rand(vocab, H, scale=0.5),
        "d2t": used - torch.arange(vocab),
        "t2d": torch.zeros(VOCAB, dtype=torch.bool).index_fill_(0, used, True),
    }
    if layout.norm_before_fc:
        tensors["input_norm.weight"] = (1 + 0.2 * torch.randn(3 * H, generator=gen)).to(torch.bfloat16)
    if layout.fc_norm:
        tensors |= {f"fc_norm.{k}.weight": norm() for k in range(3)}
    return tensors


def write_head(directory: Path, layout: Layout, seed: int = 7) -> dict[str, torch.Tensor]:
    """The head's files in ``directory``; returns its weights under the reference's (SafeAILab's) names, which a
    speculators eagle head stores under its own."""
    directory.mkdir(parents=True, exist_ok=True)
    decoder = {
        "architectures": ["LlamaForCausalLM"],
        "model_type": "llama",
        "hidden_size": H,
        "intermediate_size": INTERMEDIATE,
        "num_attention_heads": HEADS,
        "num_key_value_heads": KV_HEADS,
        "num_hidden_layers": 1,
        "rms_norm_eps": EPS,
        "rope_theta": THETA,
        "rope_scaling": None,
        "vocab_size": VOCAB,
        "max_position_embeddings": MAX_POSITIONS,
        "tie_word_embeddings": False,
        "pad_token_id": 0,
        "torch_dtype": "bfloat16",
    }
    if layout.speculators:  # the decoder's fields nested, the head's at the top level
        decoder.pop("architectures")
        config = {"transformer_layer_config": {**decoder, "head_dim": HEAD_DIM}, **layout.config}
    else:
        config = {**decoder, **layout.config}
    (directory / "config.json").write_text(json.dumps(config, indent=2))
    tensors = published_tensors(layout, seed)
    stored = tensors
    if layout.speculators and not layout.eagle3:  # the speculators eagle names; no embed_tokens in that format
        stored = {_renamed(name): tensor for name, tensor in tensors.items() if name != "embed_tokens.weight"}
    if layout.file == "model.safetensors":
        save_file(stored, str(directory / layout.file))
    else:
        torch.save(stored, directory / layout.file)
    return tensors


def _renamed(name: str) -> str:
    for reference, published in SPECULATORS_EAGLE_NAMES.items():
        if name.startswith(reference):
            return published + name[len(reference) :]
    return name


class Payload:
    """A pickle that would create a file when unpickled without restriction."""

    def __init__(self, marker: Path) -> None:
        self.marker = marker

    def __reduce__(self) -> tuple[object, tuple[object, ...]]:
        return (Path.touch, (self.marker,))
