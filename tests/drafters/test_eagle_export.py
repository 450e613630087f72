"""An EAGLE-3 head written in the published layouts loads back and drafts bit for bit what it drafted before.

A random EAGLE-3 head (float32 and float64, a reduced draft vocabulary, the EAGLE-3.1 flags on and off) beside a tiny
8-layer target is saved in SafeAILab's layout and in vLLM's speculators format
(:mod:`specserve.drafters.eagle_export`); each directory, read back by the loader of published heads, gives a head
whose logits at the root and every node of a tree are equal (``torch.equal``) to the original's, and whose sampled
chains and trees draw the same tokens from the same seed. The files use the names and fields the readers agree on.
The published architecture trains (its loss falls) over a draft vocabulary of the stream's most frequent tokens.
"""

from __future__ import annotations

import json
from dataclasses import replace
from pathlib import Path

import pytest
import torch
from conftest import build_model
from head_helpers import target_stream
from safetensors.torch import load_file

from specserve.core.model.causal_lm import CausalLM, select_features
from specserve.core.sampling.params import SamplingParams
from specserve.core.tree.shapes import ROOT, TreeBudget, TreeSpec
from specserve.drafters.eagle import EagleDrafter
from specserve.drafters.eagle3 import Eagle3Config, Eagle3Head
from specserve.drafters.eagle_export import save_eagle3, save_speculators
from specserve.training import loop
from specserve.training.eagle import EagleRecipe, eagle_loss, new_head, train_head

LAYERS = 8
LEVELS = [[0, 1], [2, 3], [4]]
TREE_TOKENS = [11, 40, 13, 70, 15]
TREE_PARENTS = [ROOT, ROOT, 0, 0, 2]
CONTEXT = [5, 17, 23, 8, 9, 30]


@pytest.fixture(scope="module")
def target() -> CausalLM:
    return CausalLM(build_model("llama", num_layers=LAYERS, seed=5))


def random_head(target: CausalLM, dtype: torch.dtype, **flags: bool) -> Eagle3Head:
    config = replace(Eagle3Config.for_target(target.model, draft_vocab_size=40), **flags)
    head = Eagle3Head(config)
    generator = torch.Generator().manual_seed(11)
    with torch.no_grad():
        for parameter in head.parameters():
            parameter.copy_(torch.randn(parameter.shape, generator=generator) * 0.3 + (parameter.dim() == 1))
    head.set_draft_vocabulary(torch.randperm(96, generator=generator)[:40].tolist())
    return head.to(dtype).eval()


def session_logits(drafter: EagleDrafter, target: CausalLM) -> list[torch.Tensor]:
    """The root's logits and each tree level's, after the committed ``CONTEXT``."""
    with torch.inference_mode():
        out = target.model(torch.tensor([CONTEXT]), output_hidden_states=True)
        raw = select_features([h[0] for h in out.hidden_states], drafter.feature_layers)
    drafter.start(CONTEXT, SamplingParams(), torch.Generator())
    drafter.add_features(0, raw[: len(CONTEXT) - 1])
    session = drafter._open_session()
    logits = [session.root_logits.clone()]
    logits += [session.expand(level, TREE_TOKENS, TREE_PARENTS).clone() for level in LEVELS]
    session.close()
    return logits


def sampled_drafts(drafter: EagleDrafter, target: CausalLM) -> list[object]:
    with torch.inference_mode():
        out = target.model(torch.tensor([CONTEXT]), output_hidden_states=True)
        raw = select_features([h[0] for h in out.hidden_states], drafter.feature_layers)
    drafts: list[object] = []
    for seed in range(3):
        drafter.start(CONTEXT, SamplingParams(temperature=1.0), torch.Generator().manual_seed(seed))
        drafter.add_features(0, raw[: len(CONTEXT) - 1])
        drafts.append(drafter.propose(4).tokens.tolist())
        tree = drafter.propose_tree(TreeSpec("dynamic", budget=TreeBudget(depth=3, width=2, nodes=6)))
        drafts.append((tree.tokens.tolist(), tree.parents))
    return drafts


@pytest.mark.parametrize(
    "dtype, flags",
    [
        (torch.float32, {}),
        (torch.float64, {"norm_before_residual": True, "fc_norm": True, "norm_output": True}),
        (torch.float32, {"norm_before_fc": True}),
    ],
)
def test_both_published_layouts_draft_bit_for_bit_what_the_head_drafted(
    target: CausalLM, tmp_path: Path, dtype: torch.dtype, flags: dict[str, bool]
) -> None:
    model = CausalLM(target.model.to(dtype)) if dtype != torch.float64 else target
    head = random_head(model, dtype, **flags)
    original = EagleDrafter.for_target(head, model)
    save_eagle3(head, tmp_path / "eagle3")
    save_speculators(head, tmp_path / "speculators", "org/tiny", ["LlamaForCausalLM"], speculative_tokens=4)
    want_logits, want_drafts = session_logits(original, model), sampled_drafts(original, model)
    for layout in ("eagle3", "speculators"):
        loaded = EagleDrafter.load(tmp_path / layout, model)
        for got, want in zip(session_logits(loaded, model), want_logits, strict=True):
            assert torch.equal(got, want), layout
        assert sampled_drafts(loaded, model) == want_drafts, layout
    target.model.to(torch.float64)


def test_the_files_use_the_names_and_fields_every_reader_agrees_on(target: CausalLM, tmp_path: Path) -> None:
    head = random_head(target, torch.float64)
    save_eagle3(head, tmp_path / "eagle3")
    save_speculators(head, tmp_path / "speculators", "org/tiny", ["LlamaForCausalLM"], speculative_tokens=5)
    safeailab = json.loads((tmp_path / "eagle3" / "config.json").read_text())
    assert safeailab["architectures"] == ["LlamaForCausalLMEagle3"]
    assert safeailab["draft_vocab_size"] == 40 and safeailab["norm_before_residual"] is False
    assert "eagle_aux_hidden_state_layer_ids" not in safeailab  # the default layers: no id a reader could shift
    names = set(load_file(str(tmp_path / "eagle3" / "model.safetensors")))
    assert {"fc.weight", "midlayer.hidden_norm.weight", "norm.weight", "lm_head.weight", "d2t", "t2d"} <= names
    assert not any(name.startswith(("body.", "embed_tokens")) for name in names)
    speculators = json.loads((tmp_path / "speculators" / "config.json").read_text())
    assert speculators["speculators_model_type"] == "eagle3"
    assert speculators["norm_before_residual"] is False  # explicit: this format's readers default it to true
    assert speculators["speculators_config"]["proposal_methods"][0]["speculative_tokens"] == 5
    assert speculators["transformer_layer_config"]["hidden_size"] == 32
    assert "layers.0.self_attn.q_proj.weight" in load_file(str(tmp_path / "speculators" / "model.safetensors"))


def test_an_eagle3_head_with_a_reduced_vocabulary_learns(target: CausalLM) -> None:
    """The EAGLE-3 loss (the target's law restricted to the draft vocabulary, at positions whose argmax lies inside
    it) falls as the published architecture trains; the draft vocabulary is the stream's most frequent tokens."""
    stream = target_stream(target, seed=2)
    head = new_head(target.model, EagleRecipe(layout="eagle3", draft_vocab=40), stream).double()
    counts = torch.bincount(stream, minlength=96)
    assert counts[head.draft_token_ids()].min() >= counts.sort(descending=True).values[39]
    loss_fn = eagle_loss(target.model, head.config.feature_layers, unroll=1)
    batch = loop.sample_windows(stream, 8, 24, torch.Generator().manual_seed(5))
    with torch.no_grad():
        before = float(loss_fn(head, batch))
    recipe = EagleRecipe(layout="eagle3", unroll=1, steps=80, batch_size=8, seq_len=24, peak_lr=3e-3)
    train_head(head, target.model, stream, replace(recipe, bf16_autocast=False, checkpoint_every=1000), None)
    with torch.no_grad():
        assert float(loss_fn(head, batch)) < 0.8 * before
