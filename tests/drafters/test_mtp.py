"""``--draft mtp``: the MTP layer a DeepSeek-V3 or GLM-4.5 checkpoint carries drafts exactly as published.

For each family a tiny random target of L = 2 layers is written the way the published checkpoints are: ``config.json``
with ``num_nextn_predict_layers: 1`` and one ``model.safetensors`` holding the target's tensors and, at
``model.layers.2``, the MTP module (``enorm``, ``hnorm``, ``eh_proj``, a decoder layer of the family with its mixture
of experts stored per expert, ``shared_head.norm``, ``shared_head.head``, a copy of ``embed_tokens``). Then, in float64:

* the drafter's logits at the root and at every node of a tree (depths 0 to 3), after two commits, equal a reference
  forward written here from the published description (DeepSeek-V3 report §2.2; vLLM's ``deepseek_mtp``): its own
  RMSNorms and ``eh_proj`` over the tensors read back from the file, and transformers' own decoder layer of the family
  (loaded by transformers alone, from a copy of the checkpoint that declares L + 1 layers), recomputed from scratch for
  every path — eager and on static shapes — at 1e-6 (the routers score in float32);
* greedy output through ``--draft mtp`` equals transformers' ``generate``, in the single-request engine (chains and
  trees, with the drafter built from the target itself and, as a drafter actor builds it, from its description) and
  in the batched engine;
* targets it cannot run are refused in one line: no MTP layer, files without it, two MTP layers, a hybrid target,
  and tensors out of the published layout.
"""

from __future__ import annotations

import json
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

import pytest
import torch
import transformers
from conftest import REF_TOKENS, build_model, char_tokenizer, finish_all
from head_helpers import check_tree_logits
from mtp_checkpoints import FAMILIES, H, L, write_checkpoint
from safetensors.torch import load_file, save_file
from static_helpers import BUCKETS
from transformers import AutoModelForCausalLM, PreTrainedModel

from specserve.core.batch_engine import BatchedEngine
from specserve.core.engine import SpeculativeEngine
from specserve.core.errors import UserError
from specserve.core.model.causal_lm import CausalLM
from specserve.core.request import GenerationConfig
from specserve.core.sampling.params import SamplingParams
from specserve.core.static.options import StaticOptions
from specserve.core.tree.shapes import TreeBudget, TreeSpec
from specserve.drafters.eagle import EagleDrafter
from specserve.drafters.mtp import check_mtp_target
from specserve.drafters.registry import build_drafter, request_drafters

HfGreedy = Callable[[CausalLM, Sequence[int], int], list[int]]
# The routers of both families score experts in float32 (transformers keeps gate.weight in float32), and a float32
# matmul rounds differently for blocks of different shapes: agreement is to float32's rounding, not float64's.
TOLERANCE = {"rtol": 1e-6, "atol": 1e-6}
# ---------------------------------------------------------------------------------------------
# The reference, from the published description


def rms(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """RMSNorm computed in float32, as the families' own RMSNorm modules compute it whatever the input dtype."""
    x32 = x.float()
    return weight * (x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + eps)).to(x.dtype)


def reference_logits(
    reference: PreTrainedModel,
    w: dict[str, torch.Tensor],
    target: CausalLM,
    context: Sequence[int],
    path: Sequence[int],
) -> list[torch.Tensor]:
    """The MTP logits after ``context`` and after each prefix of ``path``: position t pairs (the target's last hidden
    state of token t, token t + 1); drafted positions take the previous position's layer output as their hidden
    state; every step reruns the whole sequence through transformers' decoder layer L of ``reference``."""
    eps = float(reference.config.rms_norm_eps)
    p = f"model.layers.{L}."
    with torch.no_grad():
        hidden = target.model(torch.tensor([list(context)]), output_hidden_states=True).hidden_states[-1][0]
    n = len(context) - 1
    features, tokens = list(hidden[:n].unbind(0)), list(context[1:])
    layer = reference.model.layers[L]

    def last_output() -> torch.Tensor:
        embeds = rms(w[p + "embed_tokens.weight"][torch.tensor(tokens)], w[p + "enorm.weight"], eps)
        states = rms(torch.stack(features), w[p + "hnorm.weight"], eps)
        x = (torch.cat([embeds, states], -1) @ w[p + "eh_proj.weight"].T)[None]
        positions = torch.arange(len(tokens))[None]
        with torch.no_grad():
            out = layer(x, position_embeddings=reference.model.rotary_emb(x, positions), position_ids=positions)
        return out[0, -1]

    def logits(h: torch.Tensor) -> torch.Tensor:
        return rms(h, w[p + "shared_head.norm.weight"], eps) @ w[p + "shared_head.head.weight"].T

    h = last_output()
    out = [logits(h)]
    for token in path:
        features.append(h)  # fed back before any norm
        tokens.append(token)
        h = last_output()
        out.append(logits(h))
    return out


# ---------------------------------------------------------------------------------------------


class Checkpoint:
    def __init__(self, directory: Path, name: str, seed: int) -> None:
        self.directory = directory
        self.weights = write_checkpoint(directory, name, seed)
        self.target = CausalLM.load(directory, dtype="float64")
        reference_dir = directory / "reference"  # the same files, declaring the MTP layer as layer L
        reference_dir.mkdir()
        (reference_dir / "model.safetensors").symlink_to(directory / "model.safetensors")
        config = json.loads((directory / "config.json").read_text())
        (reference_dir / "config.json").write_text(json.dumps({**config, "num_hidden_layers": L + 1}))
        self.reference = AutoModelForCausalLM.from_pretrained(
            reference_dir, dtype=torch.float64, experts_implementation="eager"
        ).eval()


@pytest.fixture(scope="module", params=sorted(FAMILIES))
def checkpoint(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory) -> Checkpoint:
    return Checkpoint(tmp_path_factory.mktemp(request.param), request.param, seed=3)


@pytest.mark.parametrize("mode", ["default", "buckets"])
def test_the_mtp_logits_equal_the_published_forward(checkpoint: Checkpoint, mode: str) -> None:
    """Root and every tree node (depths 0-3), then again after two more committed tokens (a catch-up block)."""
    target = checkpoint.target
    drafter = build_drafter("mtp", target)
    assert isinstance(drafter, EagleDrafter) and drafter.head.layout == "MTP"
    if mode != "default":
        drafter.use_static_shapes(StaticOptions(buckets=BUCKETS))

    def reference(committed: Sequence[int], path: Sequence[int]) -> torch.Tensor:
        return reference_logits(checkpoint.reference, checkpoint.weights, target, committed, path)[-1]

    check_tree_logits(drafter, target, reference, **TOLERANCE)


def test_greedy_output_equals_transformers(checkpoint: Checkpoint, hf_greedy: HfGreedy) -> None:
    target = checkpoint.target
    prompts = ([5, 17, 23, 8], [60, 61, 62, 3, 9], [40, 41])
    engine = SpeculativeEngine(target, build_drafter("mtp", target))  # type: ignore[arg-type]
    # as a drafter actor builds it: from the target's description, loading the checkpoint again itself
    remote = SpeculativeEngine(target, build_drafter("mtp", target.describe(), dtype="float64"))  # type: ignore[arg-type]
    tree = TreeSpec("dynamic", budget=TreeBudget(depth=3, width=2, nodes=6))
    for prompt in prompts:
        for config in (GenerationConfig(REF_TOKENS, gamma=3), GenerationConfig(REF_TOKENS, tree=tree)):
            result = engine.generate(list(prompt), SamplingParams(), config)
            assert result.output_ids == hf_greedy(target, prompt, REF_TOKENS), (prompt, config)
            again = remote.generate(list(prompt), SamplingParams(), config)
            assert again.output_ids == result.output_ids and again.stats.accepted_tokens == result.stats.accepted_tokens
    batched = BatchedEngine(target, request_drafters("mtp", target), max_num_seqs=2)
    ids = {batched.submit(list(prompt), SamplingParams(), GenerationConfig(REF_TOKENS, gamma=2)): p
           for p, prompt in enumerate(prompts)}  # fmt: skip
    for request, result in finish_all(batched).items():
        prompt = prompts[ids[request]]
        assert result.output_ids == hf_greedy(target, prompt, REF_TOKENS), prompt


def test_targets_mtp_cannot_run_are_refused_in_one_line(tmp_path: Path) -> None:
    def refused(directory: Path, match: str) -> None:
        with pytest.raises(UserError, match=match) as info:
            build_drafter("mtp", CausalLM.load(directory, dtype="float64"))
        assert "\n" not in str(info.value)

    def variant(name: str, edit: Callable[[dict[str, torch.Tensor], dict[str, Any]], None]) -> Path:
        directory = tmp_path / name
        write_checkpoint(directory, "glm4_moe", seed=5)
        tensors = load_file(str(directory / "model.safetensors"))
        config = json.loads((directory / "config.json").read_text())
        edit(tensors, config)
        save_file(tensors, str(directory / "model.safetensors"))
        (directory / "config.json").write_text(json.dumps(config))
        return directory

    p = f"model.layers.{L}."
    llama = tmp_path / "llama"
    build_model("llama").save_pretrained(llama)
    char_tokenizer().save_pretrained(llama)
    refused(llama, r"\(llama\) carries no MTP layers")
    dropped = variant("dropped", lambda t, c: [t.pop(k) for k in list(t) if k.startswith(p)])
    refused(dropped, r"hold no model\.layers\.2\.eh_proj\.weight \(a checkpoint saved again by transformers")
    refused(variant("two", lambda t, c: c.update(num_nextn_predict_layers=2)), "has 2 MTP layers")
    refused(
        variant("norm", lambda t, c: t.pop(p + "shared_head.norm.weight")), r"no model\.layers\.2\.shared_head\.norm"
    )
    wide = variant("wide", lambda t, c: t.update({p + "eh_proj.weight": torch.zeros(H, 3 * H)}))
    refused(wide, r"eh_proj\.weight has shape \[32, 96\], expected \[32, 64\]")
    expert = variant("expert", lambda t, c: t.pop(p + "mlp.experts.3.down_proj.weight"))
    refused(expert, r"decoder layer \(model\.layers\.2\) lacks mlp\.experts\.3\.down_proj\.weight, which the target")
    hybrid = transformers.Qwen3NextConfig(num_hidden_layers=4, num_nextn_predict_layers=1)
    with pytest.raises(UserError, match="linear_attention layers keep a recurrent state") as info:
        check_mtp_target(hybrid, "qwen3-next")
    assert "\n" not in str(info.value)
