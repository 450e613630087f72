"""Write an EAGLE-3 head in the published layouts, so that a head trained here loads in SGLang and vLLM unchanged.

Two layouts (docs/published-heads.md §2 and §3), each a directory with ``config.json`` and ``model.safetensors``:

* :func:`save_eagle3` — SafeAILab's (``"architectures": ["LlamaForCausalLMEagle3"]``, the decoder layer under
  ``midlayer.``), what SGLang, SpecForge and vLLM load as an EAGLE-3 head;
* :func:`save_speculators` — vLLM's ``speculators`` format (``speculators_model_type: "eagle3"``, the layer under
  ``layers.0.``, the decoder's fields in ``transformer_layer_config``, the verifier and the suggested number of
  speculative tokens in ``speculators_config``).

Both write the head's weights as they are (``fc``, the midlayer, ``norm``, ``lm_head``, ``d2t``, ``t2d``; the
target's embeddings are not copied: a head as wide as its target uses the target's). Fields the readers disagree on
are written so that every reader takes them the same way: ``norm_before_residual`` always explicitly (vLLM's
speculators adapter defaults it to true, the plain readers to false), and the aux layer ids only when they are not
the default 2, L // 2, L - 3 (SGLang read explicit ids as layer outputs for a while, shifting them by one).
:mod:`specserve.drafters.eagle_layouts` reads both back. Does not train, and writes no EAGLE-1 or Medusa layout.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import torch
from safetensors.torch import save_file

from specserve.drafters.eagle3 import Eagle3Head, default_aux_layers
from specserve.drafters.head_files import CONFIG_FILE, WEIGHTS_FILE

SAFEAILAB_MIDLAYER = "midlayer."
SPECULATORS_MIDLAYER = "layers.0."
SPECULATORS_VERSION = "0.3.0"  # the speculators release whose eagle3 config fields this writer follows


def published_tensors(head: Eagle3Head, midlayer: str) -> dict[str, torch.Tensor]:
    """The head's tensors under the published names, the decoder layer under ``midlayer``, on the CPU."""
    out: dict[str, torch.Tensor] = {}
    for name, tensor in head.state_dict().items():
        if name == "body.embed_tokens.weight" or (name.startswith("embed_tokens.") and not head.config.own_embeddings):
            continue
        published = midlayer + name.removeprefix("body.layers.0.") if name.startswith("body.layers.0.") else name
        out[published] = tensor.detach().contiguous().cpu()
    return out


def decoder_fields(head: Eagle3Head) -> dict[str, Any]:
    """The Llama fields of the head's decoder layer, as a Llama ``config.json`` spells them."""
    config = head.config
    rope = None if config.rope_type == "default" else {"rope_type": config.rope_type, "factor": config.rope_factor}
    return {
        "model_type": "llama",
        "hidden_act": "silu",
        "hidden_size": config.hidden_size,
        "intermediate_size": config.intermediate_size,
        "num_hidden_layers": 1,
        "num_attention_heads": config.num_attention_heads,
        "num_key_value_heads": config.num_key_value_heads,
        "head_dim": config.head_dim or config.hidden_size // config.num_attention_heads,
        "rms_norm_eps": config.rms_norm_eps,
        "rope_theta": config.rope_theta,
        "rope_scaling": rope,
        "max_position_embeddings": config.max_position_embeddings,
        "vocab_size": config.vocab_size,
        "tie_word_embeddings": False,
        "attention_bias": False,
        "mlp_bias": False,
        "torch_dtype": str(next(head.parameters()).dtype).removeprefix("torch."),
    }


def eagle3_fields(head: Eagle3Head) -> dict[str, Any]:
    """The EAGLE-3 fields, written so that every reader takes them alike (see the module's docstring)."""
    config = head.config
    fields: dict[str, Any] = {
        "draft_vocab_size": config.draft_vocab_size,
        "norm_before_residual": config.norm_before_residual,
    }
    if config.target_hidden_size != config.hidden_size:
        fields["target_hidden_size"] = config.target_hidden_size
    if config.target_num_layers == 0 or tuple(config.feature_layers) != default_aux_layers(config.target_num_layers):
        fields["eagle_aux_hidden_state_layer_ids"] = list(config.feature_layers)
    for flag in ("norm_before_fc", "fc_norm", "norm_output"):
        if getattr(config, flag):
            fields[flag] = True
    return fields


def save_eagle3(head: Eagle3Head, directory: str | Path, extra: dict[str, Any] | None = None) -> None:
    """``directory`` as a SafeAILab-layout EAGLE-3 head (``extra``: more ``config.json`` fields, e.g. the target)."""
    out = Path(directory)
    out.mkdir(parents=True, exist_ok=True)
    config = {"architectures": ["LlamaForCausalLMEagle3"], **decoder_fields(head), **eagle3_fields(head)}
    if head.config.fc_bias:
        config["bias"] = True
    (out / CONFIG_FILE).write_text(json.dumps({**config, **(extra or {})}, indent=2) + "\n")
    save_file(published_tensors(head, SAFEAILAB_MIDLAYER), str(out / WEIGHTS_FILE))


def save_speculators(
    head: Eagle3Head,
    directory: str | Path,
    verifier: str,
    verifier_architectures: list[str],
    speculative_tokens: int,
) -> None:
    """``directory`` as a speculators-format eagle3 head for the target ``verifier`` (its name or path, and its
    ``architectures``), suggesting ``speculative_tokens`` tokens per step."""
    out = Path(directory)
    out.mkdir(parents=True, exist_ok=True)
    method = {
        "proposal_type": "greedy",
        "speculative_tokens": speculative_tokens,
        "verifier_accept_k": 1,
        "accept_tolerance": 0.0,
    }
    config = {
        "speculators_model_type": "eagle3",
        "speculators_version": SPECULATORS_VERSION,
        "architectures": ["Eagle3Speculator"],
        "transformer_layer_config": decoder_fields(head),
        **eagle3_fields(head),
        "speculators_config": {
            "algorithm": "eagle3",
            "default_proposal_method": "greedy",
            "proposal_methods": [method],
            "verifier": {"name_or_path": verifier, "architectures": verifier_architectures},
        },
    }
    (out / CONFIG_FILE).write_text(json.dumps(config, indent=2) + "\n")
    save_file(published_tensors(head, SPECULATORS_MIDLAYER), str(out / WEIGHTS_FILE))
