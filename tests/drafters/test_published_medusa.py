"""Published Medusa heads load unchanged from ``medusa:DIR`` and draft exactly what their reference describes.

FasterDecoding/Medusa (``medusa/model/medusa_model.py``) and vLLM (``vllm/model_executor/models/medusa.py``), as
docs/published-heads.md §4 describes them: a random-weight head is written here in the exact published file layout
(``config.json`` fields, ``medusa_lm_head.pt`` / ``medusa_lm_head.safetensors`` / ``model.safetensors`` /
``pytorch_model.bin``, tensor names, shapes, bfloat16) beside a random tiny float64 target. Then:

* every head's logits equal a reference forward written in this file from the published description — plain torch,
  ``x + silu(x W^T + b)`` per block, then the head's own LM head (scaled, scattered through ``token_map``) — over the
  weights read back from the files, at 1e-9 in float64; chains and trees are those logits' ranks;
* greedy output with each loaded head, built through the ``medusa:DIR`` flag, equals transformers' ``generate``
  (chains, a static and a dynamic tree);
* malformed heads (a missing tensor, a wrong shape, another target's, a pickle carrying code, bad fields) are refused
  in one line, and nothing in a pickle runs.
"""

from __future__ import annotations

import json
from collections.abc import Callable, Sequence
from pathlib import Path

import pytest
import torch
from conftest import REF_TOKENS, VOCAB, build_model
from published_heads import Payload
from published_medusa import (
    HEADS,
    LAYOUTS,
    TRUNCATED,
    H,
    Layout,
    published_tensors,
    save_tensors,
    write_head,
)

from specserve.core.engine import SpeculativeEngine
from specserve.core.errors import UserError
from specserve.core.model.causal_lm import CausalLM
from specserve.core.request import GenerationConfig
from specserve.core.sampling.params import SamplingParams
from specserve.core.tree.shapes import TreeBudget, TreeSpec, TreeTopology
from specserve.drafters.medusa import InvalidMedusaHeads, MedusaDrafter
from specserve.drafters.registry import build_drafter

HfGreedy = Callable[[CausalLM, Sequence[int], int], list[int]]
LAYERS = 2  # the tiny target's depth
TOPOLOGY = TreeTopology.from_lists([[0], [1], [2], [0, 0], [0, 1], [1, 0], [0, 0, 0], [0, 0, 1]])
PROMPT = [5, 17, 23, 8, 30, 41]


# ---------------------------------------------------------------------------------------------
# The reference, from the published description


def reference_logits(layout: Layout, w: dict[str, torch.Tensor], feature: torch.Tensor) -> torch.Tensor:
    """``feature`` [..., H] (the target's last hidden state, after its final norm) -> [..., K, V]: head i's logits,
    which predict the token i + 2 positions ahead."""
    p = layout.prefix
    out = []
    for i in range(HEADS):
        x = feature
        for j in range(layout.layers):
            if layout.vllm:
                weight, bias = w[f"{p}blocks.{i}.layers.{j}.weight"], w.get(f"{p}blocks.{i}.layers.{j}.bias")
            else:
                weight, bias = w[f"{i}.{j}.linear.weight"], w[f"{i}.{j}.linear.bias"]
            z = x @ weight.T + (0.0 if bias is None else bias)
            x = x + z * torch.sigmoid(z)  # SiLU
        if not layout.vllm:
            lm = w[f"{i}.{layout.layers}.weight"]
        else:
            lm = w[f"{p}lm_head.weight"] if layout.shared else w[f"{p}lm_heads.{i}.weight"]
            if layout.full_rows:
                lm = lm[w[f"{p}token_map"]]
        logits = (x @ lm.T) * layout.scale
        if layout.truncated:
            full = torch.full((*logits.shape[:-1], VOCAB), float("-inf"), dtype=torch.float64)
            full[..., w[f"{p}token_map"]] = logits
            logits = full
        out.append(logits)
    return torch.stack(out, dim=-2)


def as_float64(tensors: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    return {name: t.double() if t.is_floating_point() else t.long() for name, t in tensors.items()}


def features_of(target: CausalLM, ids: Sequence[int]) -> torch.Tensor:  # [len(ids), H]
    with torch.inference_mode():
        return target.model(torch.tensor([list(ids)]), output_hidden_states=True).hidden_states[LAYERS][0]


# ---------------------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def target() -> CausalLM:
    return CausalLM(build_model("llama", num_layers=LAYERS, seed=3))


@pytest.fixture(scope="module")
def heads(
    target: CausalLM, tmp_path_factory: pytest.TempPathFactory
) -> dict[str, tuple[Path, dict[str, torch.Tensor]]]:
    root = tmp_path_factory.mktemp("published-medusa")
    lm_head = target.model.get_output_embeddings().weight.detach()
    return {
        name: (root / name, as_float64(write_head(root / name, layout, lm_head))) for name, layout in LAYOUTS.items()
    }


@pytest.mark.parametrize("name", sorted(LAYOUTS))
def test_the_heads_logits_equal_the_published_forward(
    target: CausalLM, heads: dict[str, tuple[Path, dict[str, torch.Tensor]]], name: str
) -> None:
    layout = LAYOUTS[name]
    directory, weights = heads[name]
    drafter = MedusaDrafter.load(directory, target)
    assert drafter.layout == ("vLLM Medusa" if layout.vllm else "FasterDecoding/Medusa")
    assert drafter.feature_layers == (LAYERS,) and drafter.config.num_heads == HEADS
    features = features_of(target, PROMPT)
    want = reference_logits(layout, weights, features)  # [T, K, V]
    with torch.inference_mode():
        got = drafter.heads(features, drafter.lm_head)
    torch.testing.assert_close(got, want, rtol=1e-9, atol=1e-9)
    finite = torch.isfinite(want).sum(-1)
    assert bool((finite == (TRUNCATED if layout.truncated else VOCAB)).all())  # q is exactly 0 off the token map

    # chains: heads 1 .. K's top-1 on the feature of the token before the last; trees: their ranks by depth
    drafter.start(PROMPT, SamplingParams(), torch.Generator())
    drafter.add_features(0, features[:-1])
    ranked = want[-2].topk(3, dim=-1).indices.tolist()
    assert drafter.propose(HEADS).tokens.tolist() == [row[0] for row in ranked]
    tree = drafter.propose_tree(TreeSpec("static", topology=TOPOLOGY))
    assert tree.parents == TOPOLOGY.parents
    assert tree.tokens.tolist() == [ranked[len(path) - 1][path[-1]] for path in TOPOLOGY.paths]
    fresh = drafter.fresh()  # another request's drafter over the same weights
    assert fresh.lm_head is drafter.lm_head and fresh.layout == drafter.layout


def test_a_drafter_process_loads_published_heads_from_the_target_description(
    target: CausalLM, heads: dict[str, tuple[Path, dict[str, torch.Tensor]]], tmp_path: Path
) -> None:
    target.model.save_pretrained(tmp_path / "target")
    description = CausalLM.load(tmp_path / "target", dtype="float64").describe()
    drafter = MedusaDrafter.load(heads["vllm-truncated"][0], description, dtype="float64")
    features = features_of(target, PROMPT)
    with torch.inference_mode():
        got = drafter.heads(features, drafter.lm_head)
    want = reference_logits(LAYOUTS["vllm-truncated"], heads["vllm-truncated"][1], features)
    torch.testing.assert_close(got, want, rtol=1e-9, atol=1e-9)


def test_other_spellings_load_as_their_reference_reads_them(
    target: CausalLM, tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    """Block copies of one FasterDecoding head that differ (used as stored, with a warning); vLLM's shared LM head
    stored as lm_heads.0.weight; a token_map beside the full vocabulary (unused, as in vLLM)."""
    lm_head = target.model.get_output_embeddings().weight.detach()
    features = features_of(target, PROMPT)

    def check(name: str, layout: Layout, edit: Callable[[dict[str, torch.Tensor]], None]) -> MedusaDrafter:
        tensors = write_head(tmp_path / name, layout, lm_head)
        edit(tensors)
        save_tensors(tensors, tmp_path / name / layout.file)
        drafter = MedusaDrafter.load(tmp_path / name, target)
        weights = as_float64(tensors)
        if "lm_heads.0.weight" in weights and layout.shared:
            weights["lm_head.weight"] = weights.pop("lm_heads.0.weight")
        with torch.inference_mode():
            got = drafter.heads(features, drafter.lm_head)
        torch.testing.assert_close(got, reference_logits(layout, weights, features), rtol=1e-9, atol=1e-9)
        return drafter

    def differ(t: dict[str, torch.Tensor]) -> None:
        t["1.1.linear.weight"] = t["1.1.linear.weight"] * -0.5

    with caplog.at_level("WARNING"):
        check("differ", LAYOUTS["fd-st-2"], differ)
    assert "residual blocks of head 1 differ" in caplog.text
    check("lm-heads-0", LAYOUTS["vllm-shared"], lambda t: t.update({"lm_heads.0.weight": t.pop("lm_head.weight")}))
    unused = check("unused-map", LAYOUTS["vllm-bias"], lambda t: t.update({"token_map": torch.arange(VOCAB)}))
    assert unused.lm_head.token_map is None


@pytest.mark.parametrize("name", sorted(LAYOUTS))
def test_greedy_output_equals_transformers(
    target: CausalLM, heads: dict[str, tuple[Path, dict[str, torch.Tensor]]], name: str, hf_greedy: HfGreedy
) -> None:
    drafter = build_drafter(f"medusa:{heads[name][0]}", target)  # the flag's path
    assert isinstance(drafter, MedusaDrafter)
    engine = SpeculativeEngine(target, drafter)
    shapes = (
        GenerationConfig(REF_TOKENS, gamma=3),
        GenerationConfig(REF_TOKENS, tree=TreeSpec("static", topology=TOPOLOGY)),
        GenerationConfig(REF_TOKENS, tree=TreeSpec("dynamic", budget=TreeBudget(depth=3, width=2, nodes=6))),
    )
    drafted = accepted = 0
    for prompt in ([5, 17, 23, 8], [9, 9, 9, 9, 9], [40, 41]):
        for config in shapes:
            result = engine.generate(list(prompt), SamplingParams(), config)
            assert result.output_ids == hf_greedy(target, prompt, REF_TOKENS), (prompt, config)
            drafted += result.stats.drafted_tokens
            accepted += result.stats.accepted_tokens
    assert drafted > accepted > 0  # the heads were right sometimes and wrong sometimes


def test_malformed_heads_are_refused_in_one_line(
    target: CausalLM, heads: dict[str, tuple[Path, dict[str, torch.Tensor]]], tmp_path: Path
) -> None:
    lm_head = target.model.get_output_embeddings().weight.detach()

    def refused(directory: Path, match: str, model: CausalLM = target) -> None:
        with pytest.raises(InvalidMedusaHeads, match=match) as info:
            build_drafter(f"medusa:{directory}", model)
        assert isinstance(info.value, UserError) and "\n" not in str(info.value)

    def variant(
        name: str, source: str, edit: Callable[[dict[str, torch.Tensor], dict[str, object]], None], **shape: int
    ) -> Path:
        layout = LAYOUTS[source]
        directory = tmp_path / name
        write_head(directory, layout, lm_head, **shape)
        tensors = published_tensors(layout, lm_head, **shape)
        config = json.loads((directory / "config.json").read_text())
        edit(tensors, config)
        save_tensors({k: v.clone() for k, v in tensors.items()}, directory / layout.file)
        (directory / "config.json").write_text(json.dumps(config))
        return directory

    def drop(name: str) -> Callable[[dict[str, torch.Tensor], dict[str, object]], None]:
        def edit(tensors: dict[str, torch.Tensor], config: dict[str, object]) -> None:
            del tensors[name]

        return edit

    def repeat_first(tensors: dict[str, torch.Tensor], config: dict[str, object]) -> None:
        tensors["medusa_heads.token_map"][1] = tensors["medusa_heads.token_map"][0]

    def reshape(name: str) -> Callable[[dict[str, torch.Tensor], dict[str, object]], None]:
        return lambda t, c: t.update({name: t[name][:, : H // 2]})

    def configure(**fields: object) -> Callable[[dict[str, torch.Tensor], dict[str, object]], None]:
        return lambda t, c: c.update(fields)

    refused(variant("missing", "fd-st-1", drop("1.0.linear.bias")), r"medusa_lm_head\.safetensors .*missing 1\.0\.l")
    refused(variant("missing-pt", "fd-pt-2", drop("2.1.linear.weight")), r"missing 2\.1\.linear\.weight")
    refused(variant("shape", "fd-st-1", reshape("0.0.linear.weight")), r"0\.0\.linear\.weight has shape \[32, 16\], ")
    refused(
        variant("extra", "fd-st-1", configure(medusa_num_heads=2)),
        r"unexpected 2\.0\.linear\.bias, 2\.0\.linear\.weight, 2\.1\.weight;",
    )
    refused(variant("bias", "vllm-bias", drop("blocks.0.layers.1.bias")), r"missing blocks\.0\.layers\.1\.bias")
    refused(variant("lm", "vllm-shared", reshape("lm_head.weight")), r"lm_head\.weight has shape \[96, 16\], expected")
    refused(variant("map", "vllm-truncated", drop("medusa_heads.token_map")), "missing token_map")
    refused(variant("repeat", "vllm-truncated", repeat_first), "token_map repeats a token id")
    refused(variant("scale", "vllm-bias", configure(logit_scale=-1.0)), "logit_scale -1.0 is not supported")
    refused(variant("layers", "fd-st-1", configure(medusa_num_layers=0)), "medusa_num_layers is 0, expected an integer")

    # heads for another target: its vocabulary, its hidden size
    smaller = CausalLM(build_model("llama", num_layers=LAYERS, vocab=80))
    refused(
        heads["fd-pt-1"][0],
        r"for org/tiny-llama\) were trained for a target with hidden size 32 and 96 tokens, but",
        smaller,
    )
    refused(
        heads["vllm-truncated"][0],
        "hidden size 32 and 96 tokens, but target .* has hidden size 32 and 80 tokens",
        smaller,
    )
    wider = variant("wider", "fd-st-2", lambda t, c: None, hidden=48)
    refused(wider, "trained for a target with hidden size 48 and 96 tokens, but target .* hidden size 32")
    refused(variant("wider-vllm", "vllm-shared", lambda t, c: None, hidden=48), "hidden size 48 and 96 tokens")

    (tmp_path / "plain").mkdir()
    (tmp_path / "plain" / "config.json").write_text(json.dumps({"model_type": "llama"}))
    refused(tmp_path / "plain", "not a Medusa heads directory.*FasterDecoding/Medusa or vLLM Medusa heads")

    marker = tmp_path / "ran"
    code = tmp_path / "code"
    write_head(code, LAYOUTS["fd-pt-1"], lm_head)
    torch.save(
        {**published_tensors(LAYOUTS["fd-pt-1"], lm_head), "payload": Payload(marker)}, code / "medusa_lm_head.pt"
    )
    refused(code, r"medusa_lm_head\.pt was refused: it is not a plain tensor pickle")
    assert not marker.exists()
