"""Published EAGLE heads load unchanged and draft exactly what their reference describes.

EAGLE-1/2 (SafeAILab ``cnets1.py``) and EAGLE-3 (SafeAILab ``cnets.py``, SGLang's ``llama_eagle3``), as
docs/published-heads.md describes them: a random-weight head is written here in the exact published file layout
(``config.json`` fields, ``model.safetensors`` or ``pytorch_model.bin``, tensor names, shapes, bfloat16) beside a random
tiny 8-layer target. Then:

* the head's logits at the root and at every node of a tree (depths 0 to 3) equal a reference forward written in this
  file from the published description — its own RMSNorm, rotary embedding, grouped attention and MLP over the weights
  read back from the files, recomputed from scratch for every path — at 1e-9 in float64, eager and on static shapes
  (padded, and replayed as graphs);
* greedy output with the loaded head equals transformers' ``generate`` (chains and trees);
* an EAGLE-3 head with a reduced draft vocabulary emits the target's joint law of two tokens at T = 1, through chains
  and trees (chi-square, significance 1e-3, fixed seeds);
* malformed heads (a missing tensor, a wrong shape, another target, a deeper target, a pickle carrying code) are
  refused in one line, and nothing in a pickle runs.
"""

from __future__ import annotations

import json
import math
from collections.abc import Callable, Sequence
from pathlib import Path

import pytest
import torch
from conftest import REF_TOKENS, VOCAB, build_model
from head_helpers import check_tree_logits
from published_heads import (
    DRAFT_VOCAB,
    EPS,
    HEAD_DIM,
    HEADS,
    KV_HEADS,
    LAYOUTS,
    THETA,
    H,
    Layout,
    Payload,
    published_tensors,
    write_head,
)
from safetensors.torch import save_file
from static_helpers import BUCKETS, RecordingGraphs
from stats_helpers import batched_runs, check_single_engine_agrees, two_token_fit

from specserve import cli
from specserve.core.batch_engine import BatchedEngine
from specserve.core.draft.spec_strings import suggested_gamma
from specserve.core.engine import SpeculativeEngine
from specserve.core.errors import UserError
from specserve.core.model.causal_lm import CausalLM
from specserve.core.request import GenerationConfig
from specserve.core.sampling.params import SamplingParams
from specserve.core.static.options import StaticOptions
from specserve.core.tree.shapes import TreeBudget, TreeSpec
from specserve.drafters.eagle import EagleDrafter
from specserve.drafters.registry import build_drafter
from specserve.generate import chosen_gamma
from specserve.serve.config import ServeConfig

HfGreedy = Callable[[CausalLM, Sequence[int], int], list[int]]
ALPHA = 1e-3
LAYERS = 8  # the target's: EAGLE-3 reads the inputs of layers 2, 4 and 5


# ---------------------------------------------------------------------------------------------
# The reference, from the published description


def rms(x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
    """RMSNorm computed in float32, as the references' ``LlamaRMSNorm`` computes it whatever the input dtype."""
    x32 = x.float()
    return weight * (x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + EPS)).to(x.dtype)


def rotate(x: torch.Tensor) -> torch.Tensor:
    """Llama's half-split rotary embedding of ``x`` ``[heads, T, d]``; its angles in float32, as the references
    (SafeAILab's ``LlamaRotaryEmbedding``, transformers') compute them."""
    t = x.shape[1]
    inverse = 1.0 / THETA ** (torch.arange(0, HEAD_DIM, 2, dtype=torch.float32) / HEAD_DIM)
    angles = torch.arange(t, dtype=torch.float32)[:, None] * inverse[None]
    cos = torch.cat([angles.cos()] * 2, -1).double()
    sin = torch.cat([angles.sin()] * 2, -1).double()
    first, second = x[..., : HEAD_DIM // 2], x[..., HEAD_DIM // 2 :]
    return x * cos + torch.cat([-second, first], -1) * sin


def attention(x: torch.Tensor, w: dict[str, torch.Tensor], prefix: str) -> torch.Tensor:
    """Causal grouped-query attention over positions 0 .. T - 1."""
    t = x.shape[0]
    q = rotate((x @ w[f"{prefix}self_attn.q_proj.weight"].T).view(t, HEADS, HEAD_DIM).transpose(0, 1))
    k = rotate((x @ w[f"{prefix}self_attn.k_proj.weight"].T).view(t, KV_HEADS, HEAD_DIM).transpose(0, 1))
    v = (x @ w[f"{prefix}self_attn.v_proj.weight"].T).view(t, KV_HEADS, HEAD_DIM).transpose(0, 1)
    k, v = k.repeat_interleave(HEADS // KV_HEADS, 0), v.repeat_interleave(HEADS // KV_HEADS, 0)
    scores = (q @ k.transpose(1, 2)) / math.sqrt(HEAD_DIM)
    scores = scores.masked_fill(torch.ones(t, t, dtype=torch.bool).triu(1), float("-inf"))
    out = (scores.softmax(-1) @ v).transpose(0, 1).reshape(t, HEADS * HEAD_DIM)
    return out @ w[f"{prefix}self_attn.o_proj.weight"].T


def mlp(x: torch.Tensor, w: dict[str, torch.Tensor], prefix: str) -> torch.Tensor:
    gate, up = x @ w[f"{prefix}mlp.gate_proj.weight"].T, x @ w[f"{prefix}mlp.up_proj.weight"].T
    return (torch.nn.functional.silu(gate) * up) @ w[f"{prefix}mlp.down_proj.weight"].T


def eagle1_layer(w: dict[str, torch.Tensor], embeds: torch.Tensor, features: torch.Tensor) -> torch.Tensor:
    """cnets1.py: x = fc(cat(e, f)); layer 0 without an input norm; no final norm."""
    x = torch.cat([embeds, features], -1) @ w["fc.weight"].T + w.get("fc.bias", torch.zeros(H, dtype=torch.float64))
    h = x + attention(x, w, "layers.0.")
    return h + mlp(rms(h, w["layers.0.post_attention_layernorm.weight"]), w, "layers.0.")


def eagle3_layer(layout: Layout, w: dict[str, torch.Tensor], embeds: torch.Tensor, g: torch.Tensor) -> torch.Tensor:
    """cnets.py's midlayer: attention over cat(input_layernorm(e), hidden_norm(g)); residual g (or its norm)."""
    p = layout.midlayer
    normed = rms(g, w[f"{p}hidden_norm.weight"])
    h = (normed if layout.norm_before_residual else g) + attention(
        torch.cat([rms(embeds, w[f"{p}input_layernorm.weight"]), normed], -1), w, p
    )
    return h + mlp(rms(h, w[f"{p}post_attention_layernorm.weight"]), w, p)


def reference_logits(
    layout: Layout, w: dict[str, torch.Tensor], target: CausalLM, context: Sequence[int], path: Sequence[int]
) -> list[torch.Tensor]:
    """The head's logits over the target vocabulary after ``context`` (committed) and after each prefix of the
    drafted ``path``: position t pairs (the feature of token t, token t + 1); drafted positions take the previous
    position's output as their feature; every step recomputes the whole sequence from scratch."""
    model = target.model
    embeddings, lm_head = model.get_input_embeddings().weight, model.get_output_embeddings().weight
    with torch.no_grad():
        hidden_states = model(torch.tensor([list(context)]), output_hidden_states=True).hidden_states
    n = len(context) - 1
    if layout.eagle3:  # the inputs of layers 2, L//2, L-3, (normed and) projected by fc
        parts = [hidden_states[i][0, :n] for i in (2, LAYERS // 2, LAYERS - 3)]
        if layout.fc_norm:
            parts = [rms(part, w[f"fc_norm.{k}.weight"]) for k, part in enumerate(parts)]
        aux = torch.cat(parts, -1)
        if layout.norm_before_fc:
            aux = rms(aux, w["input_norm.weight"])
        features = list((aux @ w["fc.weight"].T).unbind(0))
    else:  # the top layer's output after the target's final norm
        features = list(hidden_states[LAYERS][0, :n].unbind(0))
    tokens = list(context[1:])

    def last_output() -> torch.Tensor:
        embeds = embeddings[torch.tensor(tokens)]
        stacked = torch.stack(features)
        out = eagle3_layer(layout, w, embeds, stacked) if layout.eagle3 else eagle1_layer(w, embeds, stacked)
        return out[-1]

    def logits(h: torch.Tensor) -> torch.Tensor:
        if not layout.eagle3:
            return h @ lm_head.T
        draft = rms(h, w["norm.weight"]) @ w["lm_head.weight"].T
        full = torch.full((VOCAB,), float("-inf"), dtype=torch.float64)
        full[torch.arange(draft.shape[0]) + w["d2t"]] = draft
        return full

    def fed_back(h: torch.Tensor) -> torch.Tensor:
        return rms(h, w["norm.weight"]) if layout.norm_output else h

    h = last_output()
    out = [logits(h)]
    for token in path:
        features.append(fed_back(h))
        tokens.append(token)
        h = last_output()
        out.append(logits(h))
    return out


def as_float64(tensors: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    return {name: t.double() if t.is_floating_point() else t for name, t in tensors.items()}


# ---------------------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def target() -> CausalLM:
    return CausalLM(build_model("llama", num_layers=LAYERS, seed=3))


@pytest.fixture(scope="module")
def heads(tmp_path_factory: pytest.TempPathFactory) -> dict[str, tuple[Path, dict[str, torch.Tensor]]]:
    root = tmp_path_factory.mktemp("published-heads")
    return {name: (root / name, as_float64(write_head(root / name, layout))) for name, layout in LAYOUTS.items()}


@pytest.mark.parametrize("mode", ["default", "buckets", "graphs"])
@pytest.mark.parametrize("name", sorted(LAYOUTS))
def test_the_heads_logits_equal_the_published_forward(
    target: CausalLM, heads: dict[str, tuple[Path, dict[str, torch.Tensor]]], name: str, mode: str
) -> None:
    """Root and every tree node (depths 0-3), then again after two more committed tokens (a catch-up block)."""
    layout = LAYOUTS[name]
    directory, weights = heads[name]
    drafter = EagleDrafter.load(directory, target)
    assert drafter.head.layout == ("EAGLE-3" if layout.eagle3 else "EAGLE-1")
    assert drafter.head.speculative_tokens == (5 if layout.speculators else None)
    if mode != "default":
        drafter.use_static_shapes(StaticOptions(buckets=BUCKETS), RecordingGraphs() if mode == "graphs" else None)

    def reference(committed: Sequence[int], path: Sequence[int]) -> torch.Tensor:
        return reference_logits(layout, weights, target, committed, path)[-1]

    root = check_tree_logits(drafter, target, reference, rtol=1e-9, atol=1e-9)
    if layout.reduced:  # q is exactly zero off the draft vocabulary's image
        assert int(torch.isfinite(root).sum()) == DRAFT_VOCAB


@pytest.mark.parametrize("name", sorted(LAYOUTS))
def test_greedy_output_equals_transformers(
    target: CausalLM, heads: dict[str, tuple[Path, dict[str, torch.Tensor]]], name: str, hf_greedy: HfGreedy
) -> None:
    drafter = build_drafter(f"eagle:{heads[name][0]}", target)  # the flag's path
    engine = SpeculativeEngine(target, drafter)  # type: ignore[arg-type]
    tree = TreeSpec("dynamic", budget=TreeBudget(depth=3, width=2, nodes=6))
    for prompt in ([5, 17, 23, 8], [60, 61, 62, 3, 9], [40, 41]):
        for config in (GenerationConfig(REF_TOKENS, gamma=3), GenerationConfig(REF_TOKENS, tree=tree)):
            result = engine.generate(list(prompt), SamplingParams(), config)
            assert result.output_ids == hf_greedy(target, prompt, REF_TOKENS), (prompt, config)


@pytest.mark.parametrize("shape", ["chain", "tree"])
def test_a_reduced_draft_vocabulary_keeps_the_target_joint_law(
    target: CausalLM, heads: dict[str, tuple[Path, dict[str, torch.Tensor]]], shape: str
) -> None:
    """Two tokens at T = 1 through an EAGLE-3 head that can only propose 40 of the 96 tokens (2,500 seeds as
    requests of one batched engine; the first seeds checked against the single-request engine)."""
    drafter = EagleDrafter.load(heads["eagle3"][0], target)
    batched = BatchedEngine(target, lambda name: drafter.fresh(), max_num_seqs=32)
    prompt = [5, 17, 23, 8, 30]
    tree = None if shape == "chain" else TreeSpec("dynamic", budget=TreeBudget(depth=3, width=3, nodes=7))
    config = GenerationConfig(max_new_tokens=2, gamma=3, tree=tree, ignore_eos=True)
    params = SamplingParams(temperature=1.0)
    runs = batched_runs(batched, prompt, params, config, 2500)
    assert two_token_fit([run.output_ids for run in runs], target, prompt, params) > ALPHA
    check_single_engine_agrees(SpeculativeEngine(target, drafter.fresh()), runs, prompt, params, config)


def test_malformed_heads_are_refused_in_one_line(
    target: CausalLM, heads: dict[str, tuple[Path, dict[str, torch.Tensor]]], tmp_path: Path
) -> None:
    def refused(directory: Path, match: str, model: CausalLM = target) -> None:
        with pytest.raises(UserError, match=match) as info:
            EagleDrafter.load(directory, model)
        assert "\n" not in str(info.value)

    def variant(name: str, source: str, edit: Callable[[dict[str, torch.Tensor], dict[str, object]], None]) -> Path:
        directory = tmp_path / name
        write_head(directory, LAYOUTS[source])
        tensors = dict(published_tensors(LAYOUTS[source], 7))
        config = json.loads((directory / "config.json").read_text())
        edit(tensors, config)
        (directory / LAYOUTS[source].file).unlink()
        save_file(tensors, str(directory / "model.safetensors"))
        (directory / "config.json").write_text(json.dumps(config))
        return directory

    refused(variant("missing", "eagle3", lambda t, c: t.pop("midlayer.hidden_norm.weight")), r"missing midlayer\.hid")
    wrong = variant("shape", "eagle3", lambda t, c: t.update({"fc.weight": t["fc.weight"][:, : 2 * H].contiguous()}))
    refused(wrong, r"fc\.weight has shape \[32, 64\], expected \[32, 96\]")
    refused(variant("bias", "eagle1-llama3", lambda t, c: c.pop("bias")), r"missing fc\.bias")
    deeper = variant("deeper", "eagle3", lambda t, c: c.update({"eagle_aux_hidden_state_layer_ids": [2, 16, 29]}))
    refused(deeper, "trained for a deeper target")
    smaller = CausalLM(build_model("llama", num_layers=LAYERS, vocab=80))
    refused(heads["eagle1-llama3"][0], "vocabulary 96 vs the target's 80", smaller)
    stranger = variant("stranger", "eagle1-llama3", lambda t, c: [t.pop(k) for k in list(t) if k != "fc.weight"])
    refused(stranger, "not an EAGLE head directory")

    def verifier(architectures: list[str]) -> Callable[[dict[str, torch.Tensor], dict[str, object]], None]:
        return lambda t, c: c["speculators_config"]["verifier"].update({"architectures": architectures})  # type: ignore[index]

    refused(variant("qwen", "speculators", verifier(["Qwen2ForCausalLM"])), "a head for a Qwen2ForCausalLM verifier")
    hass = variant("hass", "speculators-eagle", lambda t, c: c.update({"layernorms": True}))
    refused(hass, r"HASS's extra norms \(layernorms: true\)")
    named = tmp_path / "tiny-llama"  # the verifier's name: org/tiny-llama
    target.model.save_pretrained(named)
    EagleDrafter.load(heads["speculators"][0], CausalLM.load(named, dtype="float64"))
    other = named.rename(tmp_path / "other-model")
    refused(heads["speculators"][0], "is a head for org/tiny-llama", CausalLM.load(other, dtype="float64"))

    marker = tmp_path / "ran"
    code = tmp_path / "code"
    write_head(code, LAYOUTS["eagle1-vicuna"])
    torch.save(
        {**published_tensors(LAYOUTS["eagle1-vicuna"], 7), "payload": Payload(marker)}, code / "pytorch_model.bin"
    )
    refused(code, "refused: it is not a plain tensor pickle")
    assert not marker.exists()


def test_a_speculators_head_suggests_the_default_gamma(heads: dict[str, tuple[Path, dict[str, torch.Tensor]]]) -> None:
    """`generate` and a Serve deployment draft a speculators head's `speculative_tokens` per cycle unless their gamma
    is given (a typed --gamma equal to the default included)."""
    speculators, eagle3 = f"eagle:{heads['speculators'][0]}", f"eagle:{heads['eagle3'][0]}"
    assert suggested_gamma(speculators) == 5
    assert suggested_gamma(eagle3) is None and suggested_gamma("ngram") is None
    assert suggested_gamma("eagle:/nowhere") is None
    (generate,) = [a for a in cli.build_parser(["generate"])._actions if a.dest == "command"]
    parser = generate.choices["generate"]

    def gamma(*flags: str) -> int:
        args = parser.parse_args(["--prompt", "x", *flags])
        return chosen_gamma(args.gamma, args.draft)

    assert gamma("--draft", speculators) == 5
    assert gamma("--draft", speculators, "--gamma", "3") == 3 == gamma("--draft", eagle3) == gamma()
    assert ServeConfig(draft=speculators).with_suggested_gamma(gamma_given=False).gamma == 5
    assert ServeConfig(draft=speculators, gamma=2).with_suggested_gamma(gamma_given=True).gamma == 2
    assert ServeConfig(draft=eagle3).with_suggested_gamma(gamma_given=False).gamma == 3
