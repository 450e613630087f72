"""Random-weight Medusa heads written in the published file layouts (docs/published-heads.md §4), for the tests.

Each :class:`Layout` is one published variant: FasterDecoding's (``{i}.{j}.linear`` blocks and each head's own LM
head, in ``medusa_lm_head.pt`` or ``.safetensors``) or vLLM's (``blocks.{i}.layers.{j}``, ``lm_heads``, a truncated
vocabulary through ``token_map``, ``logit_scale``), with bfloat16 weights and the config fields its reference reads.
:func:`write_head` writes one beside a tiny target of conftest's shapes.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from pathlib import Path

import torch
from conftest import VOCAB
from safetensors.torch import save_file

H, HEADS, TRUNCATED = 32, 3, 40  # the tiny target's hidden size; heads; a truncated vocabulary


@dataclass(frozen=True)
class Layout:
    name: str
    vllm: bool
    file: str
    layers: int = 1  # residual blocks per head
    bias: bool = True  # FasterDecoding's blocks always have one; vLLM's with medusa_fc_bias
    truncated: bool = False  # vLLM: truncated_vocab_size TRUNCATED and a token_map
    full_rows: bool = False  # vLLM: truncated, but the LM heads stored with every row (cut by token_map on load)
    shared: bool = False  # vLLM: original_lm_head, one lm_head.weight
    prefix: str = ""  # vLLM: medusa_heads.
    scale: float = 1.0  # vLLM: logit_scale
    config: dict[str, object] = field(default_factory=dict)  # extra config.json fields


LAYOUTS = {
    layout.name: layout
    for layout in (
        Layout("fd-pt-1", False, "medusa_lm_head.pt"),
        Layout("fd-pt-2", False, "medusa_lm_head.pt", layers=2),  # one block object per head, stored twice
        Layout("fd-st-1", False, "medusa_lm_head.safetensors"),
        Layout("fd-st-2", False, "medusa_lm_head.safetensors", layers=2),
        Layout("vllm-bias", True, "model.safetensors", layers=2, scale=0.75, config={"medusa_fc_bias": True}),
        Layout(
            "vllm-truncated",
            True,
            "model.safetensors",
            bias=False,
            truncated=True,
            prefix="medusa_heads.",
            config={"truncated_vocab_size": TRUNCATED},
        ),
        Layout(
            "vllm-full-rows",
            True,
            "pytorch_model.bin",
            bias=False,
            truncated=True,
            full_rows=True,
            config={"truncated_vocab_size": TRUNCATED},
        ),
        Layout("vllm-shared", True, "model.safetensors", bias=False, shared=True, config={"original_lm_head": True}),
    )
}


# ---------------------------------------------------------------------------------------------
# Writing heads in the published layouts


def published_tensors(
    layout: Layout, lm_head: torch.Tensor, seed: int = 7, hidden: int = H, vocab: int = VOCAB
) -> dict[str, torch.Tensor]:
    """Random weights under the published names and shapes, in bfloat16; each LM head starts from the target's (as
    FasterDecoding initialises them) plus noise."""
    gen = torch.Generator().manual_seed(seed)

    def rand(*shape: int, scale: float = 0.2) -> torch.Tensor:
        return (torch.randn(*shape, generator=gen) * scale).to(torch.bfloat16)

    base = lm_head if tuple(lm_head.shape) == (vocab, hidden) else torch.zeros(vocab, hidden, dtype=lm_head.dtype)

    def lm(rows: torch.Tensor | None = None) -> torch.Tensor:
        full = (base + torch.randn(vocab, hidden, generator=gen, dtype=base.dtype) * 0.1).to(torch.bfloat16)
        return full if rows is None else full[rows].clone()

    tensors: dict[str, torch.Tensor] = {}
    if not layout.vllm:
        for i in range(HEADS):
            block = {"weight": rand(hidden, hidden), "bias": rand(hidden)}
            for j in range(layout.layers):  # the reference repeats one block: equal copies (shared ones in a pickle)
                for part, tensor in block.items():
                    shared = layout.file.endswith(".pt")
                    tensors[f"{i}.{j}.linear.{part}"] = tensor if shared else tensor.clone()
            tensors[f"{i}.{layout.layers}.weight"] = lm()
        return tensors
    p = layout.prefix
    token_map = torch.randperm(vocab, generator=gen)[:TRUNCATED]  # any order: row r is token token_map[r]
    for i in range(HEADS):
        for j in range(layout.layers):  # separate weights per layer
            tensors[f"{p}blocks.{i}.layers.{j}.weight"] = rand(hidden, hidden)
            if layout.bias:
                tensors[f"{p}blocks.{i}.layers.{j}.bias"] = rand(hidden)
    rows = token_map if layout.truncated and not layout.full_rows else None
    if layout.shared:
        tensors[f"{p}lm_head.weight"] = lm(rows)
    else:
        tensors |= {f"{p}lm_heads.{i}.weight": lm(rows) for i in range(HEADS)}
    if layout.truncated:
        tensors[f"{p}token_map"] = token_map
    return tensors


def published_config(layout: Layout, hidden: int = H, vocab: int = VOCAB) -> dict[str, object]:
    if not layout.vllm:
        return {
            "base_model_name_or_path": "org/tiny-llama",
            "medusa_num_heads": HEADS,
            "medusa_num_layers": layout.layers,
            "transformers_version": "4.36.2",
            **layout.config,
        }
    counts = {"medusa_num_heads": HEADS, "medusa_num_layers": layout.layers}  # vLLM renames *num*heads* / *num*layers*
    if not layout.prefix:
        counts = {"num_heads": HEADS, "num_hidden_layers": layout.layers}
    config: dict[str, object] = {
        "architectures": ["MedusaModel"],
        "model_type": "medusa",
        "hidden_size": hidden,
        "vocab_size": vocab,
        **counts,
        "max_paths": 64,
        "topk": 10,
        "torch_dtype": "bfloat16",
        **layout.config,
    }
    if layout.scale != 1.0:
        config["logit_scale"] = layout.scale
    return config


def save_tensors(tensors: dict[str, torch.Tensor], file: Path) -> None:
    if file.suffix == ".safetensors":
        save_file(tensors, str(file))
    else:
        torch.save(tensors, file)


def write_head(directory: Path, layout: Layout, lm_head: torch.Tensor, **shape: int) -> dict[str, torch.Tensor]:
    directory.mkdir(parents=True, exist_ok=True)
    (directory / "config.json").write_text(json.dumps(published_config(layout, **shape), indent=2))
    tensors = published_tensors(layout, lm_head, **shape)
    save_tensors(tensors, directory / layout.file)
    return tensors
