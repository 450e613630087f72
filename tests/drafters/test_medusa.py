"""Medusa heads: the saved directory, what the heads and the drafter compute, exactness with the engine, training.

Exactness is checked three ways, as for every drafter: greedy output equal to transformers' on
llama and qwen2 for chains, static and dynamic trees (with random heads, so drafts are sometimes
wrong), seeded sampled runs that reproduce, and a chi-square test (significance 1e-3: with the
seeds fixed a correct implementation passes deterministically) that the first two tokens emitted
with a sampled static tree follow the target's joint law. The training tests run the real loop on a
tiny model and a periodic stream, and the whole recipe on a tiny saved target and a folder of text.
"""

from __future__ import annotations

import json
from collections.abc import Callable, Sequence
from dataclasses import replace
from pathlib import Path

import pytest
import torch
from conftest import REF_TOKENS, TinyPair, build_model, char_tokenizer
from head_helpers import periodic, random_heads, trained_target
from safetensors.torch import load_file
from stats_helpers import chi2_pvalue

from specserve.core.draft.drafter import FeatureDrafter, TreeDrafter
from specserve.core.engine import SpeculativeEngine
from specserve.core.model.causal_lm import CausalLM
from specserve.core.request import GenerationConfig
from specserve.core.sampling.params import SamplingParams
from specserve.core.sampling.warps import warp_probs
from specserve.core.tree.shapes import ROOT, TreeBudget, TreeSpec, TreeTopology
from specserve.drafters.medusa import (
    CONFIG_FILE,
    WEIGHTS_FILE,
    InvalidMedusaHeads,
    MedusaConfig,
    MedusaDrafter,
    MedusaHeads,
    tree_from_candidates,
)
from specserve.training import corpus, loop
from specserve.training.heads import heldout_acceptance
from specserve.training.medusa import heads_for, medusa_loss, teacher_forced, train_heads, train_medusa

HfGreedy = Callable[[CausalLM, Sequence[int], int], list[int]]
HEADS = 3
ALPHA = 1e-3
GREEDY = SamplingParams()
TOPOLOGY = TreeTopology.from_lists([[0], [1], [2], [0, 0], [0, 1], [1, 0], [0, 0, 0], [0, 0, 1], [0, 0, 0, 0]])
BUDGET = TreeBudget(depth=4, width=2, nodes=6)  # deeper than K = 3: cut to 3 levels


def features_of(target: CausalLM, ids: Sequence[int]) -> torch.Tensor:  # [len(ids), hidden]
    with torch.inference_mode():
        return target.model(input_ids=torch.tensor([list(ids)]), output_hidden_states=True).hidden_states[-1][0]


def started(drafter: MedusaDrafter, target: CausalLM, prompt: Sequence[int]) -> MedusaDrafter:
    """``drafter`` after a prefill of ``prompt``: it knows the features of every prompt token but the last."""
    drafter.start(prompt, GREEDY, torch.Generator())
    drafter.add_features(0, features_of(target, prompt)[:-1])
    return drafter


def ranked_by_heads(heads: MedusaHeads, target: CausalLM, prompt: Sequence[int], width: int) -> list[list[int]]:
    """Each head's ``width`` best tokens on the feature of the token before the last, computed directly."""
    with torch.inference_mode():
        logits = heads(features_of(target, prompt)[-2], target.model.get_output_embeddings())
    return logits.topk(width, dim=-1).indices.tolist()


# ---------------------------------------------------------------------------------------------
# The saved directory


def test_save_load_round_trip_holds_only_the_heads(tmp_path: Path, pair: TinyPair) -> None:
    heads = random_heads(pair.target, seed=3)
    heads.config = replace(heads.config, rank_probs=(0.5, 0.2, 0.1))
    heads.save(tmp_path)
    stored = load_file(str(tmp_path / WEIGHTS_FILE))
    assert stored and all(name.startswith("heads.") for name in stored)  # no LM head, no target weight
    assert sum(t.numel() for t in stored.values()) == HEADS * (32 * 32 + 32)
    config = json.loads((tmp_path / CONFIG_FILE).read_text())
    assert config["specserve_drafter"] == "medusa" and config["num_heads"] == HEADS
    assert (config["hidden_size"], config["vocab_size"], config["target_num_layers"]) == (32, 96, 2)
    loaded = MedusaHeads.load(tmp_path)
    assert loaded.config == heads.config
    for (name, want), got in zip(heads.state_dict().items(), loaded.state_dict().values(), strict=True):
        torch.testing.assert_close(got.double(), want, rtol=0, atol=1e-7, msg=name)  # stored as float32


def test_bad_directories_are_refused_with_a_hint(tmp_path: Path, saved_pair_dirs: dict[str, Path]) -> None:
    with pytest.raises(InvalidMedusaHeads, match="does not exist"):
        MedusaHeads.load(tmp_path / "missing")
    with pytest.raises(InvalidMedusaHeads, match=r"no config.json.*specserve train medusa"):
        MedusaHeads.load(tmp_path)
    with pytest.raises(InvalidMedusaHeads, match=r"not a Medusa heads directory.*llama.*draft model"):
        MedusaHeads.load(saved_pair_dirs["target"])
    (tmp_path / CONFIG_FILE).write_text("{not json")
    with pytest.raises(InvalidMedusaHeads, match="not valid JSON"):
        MedusaHeads.load(tmp_path)
    (tmp_path / CONFIG_FILE).write_text(json.dumps({"specserve_drafter": "medusa", "num_heads": 2}))
    with pytest.raises(InvalidMedusaHeads, match="lacks hidden_size"):
        MedusaHeads.load(tmp_path)
    config = MedusaConfig(num_heads=2, hidden_size=32, vocab_size=96, target_num_layers=2)
    (tmp_path / CONFIG_FILE).write_text(json.dumps(config.to_json()))
    with pytest.raises(InvalidMedusaHeads, match=f"no {WEIGHTS_FILE}"):
        MedusaHeads.load(tmp_path)
    MedusaHeads(MedusaConfig(num_heads=3, hidden_size=32, vocab_size=96, target_num_layers=2)).save(tmp_path / "x")
    (tmp_path / WEIGHTS_FILE).write_bytes((tmp_path / "x" / WEIGHTS_FILE).read_bytes())  # 3 heads' weights, 2 in config
    with pytest.raises(InvalidMedusaHeads, match="does not match"):
        MedusaHeads.load(tmp_path)


def test_heads_of_another_target_are_refused(tmp_path: Path, tiny_pairs: dict[str, TinyPair]) -> None:
    target = tiny_pairs["llama"].target
    random_heads(target).save(tmp_path / "heads")
    other_vocab = CausalLM(build_model("llama", vocab=80))
    with pytest.raises(InvalidMedusaHeads, match=r"96 tokens.*80.*trained for this target"):
        MedusaDrafter.load(tmp_path / "heads", other_vocab)
    deeper = CausalLM(build_model("llama", num_layers=3))
    with pytest.raises(InvalidMedusaHeads, match=r"layer 2.*3 layers"):
        MedusaDrafter.load(tmp_path / "heads", deeper)
    wider = MedusaHeads(MedusaConfig(num_heads=2, hidden_size=48, vocab_size=96, target_num_layers=2))
    wider.save(tmp_path / "wider")
    with pytest.raises(InvalidMedusaHeads, match=r"hidden size 48.*hidden size 32"):
        MedusaDrafter.load(tmp_path / "wider", target)


def test_a_drafter_process_loads_the_target_lm_head_from_its_description(
    tmp_path: Path, tiny_pairs: dict[str, TinyPair], saved_pair_dirs: dict[str, Path]
) -> None:
    target = tiny_pairs["llama"].target
    heads = random_heads(target, seed=1)
    heads.save(tmp_path)
    description = CausalLM.load(saved_pair_dirs["target"], dtype="float64").describe()
    drafter = MedusaDrafter.load(tmp_path, description, dtype="float64")
    torch.testing.assert_close(drafter.lm_head.weight, target.model.get_output_embeddings().weight)
    prompt = [5, 17, 23, 8]
    assert started(drafter, target, prompt).propose(HEADS).tokens.tolist() == [
        row[0] for row in ranked_by_heads(heads, target, prompt, 1)
    ]


# ---------------------------------------------------------------------------------------------
# What the heads and the drafter compute


def test_untrained_heads_predict_what_the_lm_head_predicts(pair: TinyPair) -> None:
    target, prompt = pair.target, [5, 17, 23, 8, 30]
    heads = heads_for(target.model, HEADS)
    features = features_of(target, prompt)  # [5, hidden]
    lm_head = target.model.get_output_embeddings()
    with torch.inference_mode():
        logits = heads(features, lm_head)  # [5, K, vocab]
        want = lm_head(features)
    for k in range(HEADS):
        torch.testing.assert_close(logits[:, k], want, rtol=0, atol=1e-12)
    drafter = started(MedusaDrafter.for_target(heads, target), target, prompt)
    assert drafter.propose(2).tokens.tolist() == [int(want[-2].argmax())] * 2


def test_the_drafter_satisfies_the_protocols(pair: TinyPair) -> None:
    drafter = MedusaDrafter.for_target(random_heads(pair.target), pair.target)
    assert isinstance(drafter, TreeDrafter) and isinstance(drafter, FeatureDrafter)
    assert drafter.name == "medusa" and drafter.feature_layers == (2,)


def test_chains_are_the_heads_top_tokens(pair: TinyPair) -> None:
    target, prompt = pair.target, [5, 17, 23, 8, 30, 41]
    heads = random_heads(target, seed=2)
    drafter = started(MedusaDrafter.for_target(heads, target), target, prompt)
    best = [row[0] for row in ranked_by_heads(heads, target, prompt, 1)]
    assert drafter.propose(2).tokens.tolist() == best[:2]
    draft = drafter.propose(10)  # never more than K
    assert draft.tokens.tolist() == best and draft.draft_probs is None
    assert drafter.propose(0).gamma == 0


def test_features_follow_accept_and_rewind(pair: TinyPair) -> None:
    target, prompt = pair.target, [5, 17, 23, 8]
    heads = random_heads(target, seed=4)
    drafter = MedusaDrafter.for_target(heads, target)
    drafter.start([17], GREEDY, torch.Generator())
    drafter.add_features(0, torch.empty(0, 0))  # a 1-token prompt has no features yet
    assert drafter.propose(3).gamma == 0 and drafter.propose_tree(TreeSpec("static", topology=TOPOLOGY)).size == 0
    started(drafter, target, prompt[:2])
    drafter.accept(prompt[2:])  # two committed tokens whose features have not come yet
    assert drafter.propose(3).gamma == 0
    features = features_of(target, prompt)
    drafter.add_features(1, features[1:3])  # overlaps the known row 1: replaced, same value
    want = [row[0] for row in ranked_by_heads(heads, target, prompt, 1)]
    assert drafter.propose(3).tokens.tolist() == want
    drafter.rewind(2)  # keeps tokens 0, 1 and their features
    assert drafter.propose(3).tokens.tolist() == [row[0] for row in ranked_by_heads(heads, target, prompt[:2], 1)]
    drafter.accept(prompt[2:])
    assert drafter.propose(3).gamma == 0  # feature 2 was dropped with token 2
    with pytest.raises(ValueError, match="gap"):
        drafter.add_features(3, features[3:])
    with pytest.raises(ValueError, match="cannot rewind"):
        drafter.rewind(9)


def test_a_request_served_from_the_prefix_cache_needs_only_the_next_to_last_feature(pair: TinyPair) -> None:
    """A prefix-cache hit leaves the drafter no features before it: it takes the cached KV of all the prompt's
    cacheable positions but the last (``reuse_prefix``), its store starts where the prefill's features start, and it
    proposes what a drafter given every feature proposes; a later block must still continue the ones it holds."""
    target, prompt = pair.target, [5, 17, 23, 8, 30, 41]
    heads = random_heads(target, seed=2)
    drafter = MedusaDrafter.for_target(heads, target)
    drafter.start(prompt, GREEDY, torch.Generator())
    assert drafter.reuse_prefix("ns", prompt[:-1]) == len(prompt) - 2 and drafter.reuse_prefix("ns", []) == 0
    features = features_of(target, prompt)
    drafter.add_features(len(prompt) - 2, features[len(prompt) - 2 : len(prompt) - 1])  # what the prefill computes
    want = [row[0] for row in ranked_by_heads(heads, target, prompt, 1)]
    assert drafter.propose(3).tokens.tolist() == want
    drafter.accept([int(want[0])])
    with pytest.raises(ValueError, match=r"only positions 4 \.\. 4 are known"):
        drafter.add_features(6, features[:1])
    drafter.rewind(2)  # before the first feature it holds: none left, and none read
    assert drafter.propose(3).gamma == 0
    drafter.keep_prefix()  # nothing to keep


def test_tree_from_candidates_fills_paths_by_depth_and_rank() -> None:
    candidates = [[10, 11, 12], [20, 21]]  # head 1's three best, head 2's two best
    tokens, parents = tree_from_candidates(candidates, TOPOLOGY)
    # (0) (1) (2) (0,0) (0,1) (1,0); (0,0,0) ... are deeper than two heads
    assert tokens == [10, 11, 12, 20, 21, 20]
    assert parents == (ROOT, ROOT, ROOT, 0, 0, 1)
    tokens, parents = tree_from_candidates([[10, 11], [20]], TOPOLOGY)  # rank 2 and (0, 1) have no candidate
    assert (tokens, parents) == ([10, 11, 20, 20], (ROOT, ROOT, 0, 1))


def test_static_and_dynamic_trees(pair: TinyPair) -> None:
    target, prompt = pair.target, [5, 17, 23, 8, 30, 41]
    heads = random_heads(target, seed=5)
    drafter = started(MedusaDrafter.for_target(heads, target), target, prompt)
    ranked = ranked_by_heads(heads, target, prompt, 3)
    tree = drafter.propose_tree(TreeSpec("static", topology=TOPOLOGY))
    assert tree.child_probs is None and tree.depth == HEADS  # the 4-deep path is cut at K = 3
    assert tree.size == TOPOLOGY.size - 1 and tree.parents == TOPOLOGY.parents[:-1]
    for node, path in enumerate(TOPOLOGY.paths[:-1]):
        assert int(tree.tokens[node]) == ranked[len(path) - 1][path[-1]]
    dynamic = drafter.propose_tree(TreeSpec("dynamic", budget=BUDGET))
    shape = TreeTopology.best_first(BUDGET.nodes, heads.config.rank_probs[: BUDGET.width], HEADS)
    assert dynamic.size == BUDGET.nodes and dynamic.depth <= HEADS and dynamic.parents == shape.parents
    for node, path in enumerate(shape.paths):
        assert int(dynamic.tokens[node]) == ranked[len(path) - 1][path[-1]]


# ---------------------------------------------------------------------------------------------
# Exactness with the engine


@pytest.mark.parametrize("shape", ["chain", "static", "dynamic"])
def test_greedy_decoding_equals_transformers(pair: TinyPair, hf_greedy: HfGreedy, shape: str) -> None:
    drafter = MedusaDrafter.for_target(random_heads(pair.target, seed=7), pair.target)
    engine = SpeculativeEngine(pair.target, drafter)
    trees = {"static": TreeSpec("static", topology=TOPOLOGY), "dynamic": TreeSpec("dynamic", budget=BUDGET)}
    drafted = accepted = 0
    for gamma, prompt in zip((3, 5, 2, 3, 4, 3, 5), pair.prompts, strict=False):
        config = GenerationConfig(max_new_tokens=REF_TOKENS, gamma=gamma, tree=trees.get(shape))
        result = engine.generate(prompt, GREEDY, config)
        assert result.output_ids == hf_greedy(pair.target, prompt, REF_TOKENS), (shape, prompt)
        drafted += result.stats.drafted_tokens
        accepted += result.stats.accepted_tokens
    assert drafted > accepted > 0  # the heads were right sometimes and wrong sometimes


@pytest.mark.parametrize("shape", ["chain", "static"])
def test_sampled_runs_reproduce(pair: TinyPair, shape: str) -> None:
    engine = SpeculativeEngine(pair.target, MedusaDrafter.for_target(random_heads(pair.target), pair.target))
    tree = TreeSpec("static", topology=TOPOLOGY) if shape == "static" else None
    config = GenerationConfig(max_new_tokens=20, gamma=3, tree=tree, ignore_eos=True)
    runs = [engine.generate(pair.prompts[0], SamplingParams(temperature=1.0, seed=s), config) for s in (4, 4, 5)]
    assert runs[0].output_ids == runs[1].output_ids
    assert runs[0].output_ids != runs[2].output_ids  # the seed matters (20 tokens of a flat law never tie)


def test_two_tokens_emitted_with_a_sampled_tree_follow_the_target_joint_law() -> None:
    vocab, prompt = 8, [5, 6, 7, 3]
    target = CausalLM(build_model("llama", seed=11, vocab=vocab))
    engine = SpeculativeEngine(target, MedusaDrafter.for_target(random_heads(target, std=0.3), target))
    topology = TreeTopology.from_lists([[0], [1], [0, 0], [0, 1], [1, 0]])
    config = GenerationConfig(max_new_tokens=2, tree=TreeSpec("static", topology=topology), ignore_eos=True)
    params = SamplingParams(temperature=1.0)
    cells, accepted = [], 0
    for seed in range(300):
        result = engine.generate(prompt, SamplingParams(temperature=1.0, seed=seed), config)
        cells.append(result.output_ids[0] * vocab + result.output_ids[1])
        accepted += result.stats.accepted_tokens
    assert accepted > 0
    with torch.inference_mode():
        first = warp_probs(target.model(input_ids=torch.tensor([prompt])).logits[0, -1], params)
        after = warp_probs(
            target.model(input_ids=torch.tensor([[*prompt, a] for a in range(vocab)])).logits[:, -1], params
        )
    assert chi2_pvalue(torch.tensor(cells), first[:, None] * after) > ALPHA


# ---------------------------------------------------------------------------------------------
# Training


def test_training_lowers_the_loss_and_raises_acceptance(tmp_path: Path) -> None:
    target = trained_target()
    heads = heads_for(target.model, 2)
    loss_fn = medusa_loss(target.model)
    probe = periodic(4 * 33, offset=5).reshape(4, 33)
    heldout, prompts = periodic(200, offset=11), [periodic(12, offset=o).tolist() for o in (3, 9, 17)]

    def measure() -> tuple[float, list[float], float]:
        with torch.no_grad():
            loss = float(loss_fn(heads, probe))
        agreement = teacher_forced(target.model, heads, heldout, seq_len=32, windows=4)["top1_by_head"]
        drafter = MedusaDrafter.for_target(heads, target)
        return loss, agreement, heldout_acceptance(target, drafter, prompts, 24, gamma=2)["mean_accepted_length"]

    loss_before, agreement_before, accepted_before = measure()
    cfg = loop.TrainConfig(steps=60, batch_size=8, seq_len=32, peak_lr=2e-2, warmup_steps=4, bf16_autocast=False)
    run = train_heads(target.model, periodic(3000), cfg, heads, checkpoint_dir=tmp_path, checkpoint_every=30)
    loss_after, agreement_after, accepted_after = measure()
    assert loss_after < 0.2 * loss_before and run["final_loss"] < loss_before
    assert all(after > before + 0.5 for before, after in zip(agreement_before, agreement_after, strict=True))
    assert accepted_after > accepted_before + 0.5  # tokens per target pass, greedy, on held-out prompts
    saved = torch.load(tmp_path / loop.CHECKPOINT_FILE, weights_only=False)["model"]
    assert saved and all(name.startswith("heads.") for name in saved)  # the target's weights are not trained


def heldout_named(index: int) -> str:
    """A file name the corpus's stable hash puts in the held-out split."""
    names = (f"notes{i}.txt" for i in range(10_000))
    return [name for name in names if corpus.split_of(name) == "heldout"][index]


def test_the_recipe_saves_loadable_heads_a_card_and_resumes(tmp_path: Path, saved_pair_dirs: dict[str, Path]) -> None:
    data = tmp_path / "data"
    data.mkdir()
    text = "def add(a, b): return a + b  # sum of two numbers; "
    for i in range(6):
        (data / f"train{i}.txt").write_text(text * (i + 3))
    (data / heldout_named(0)).write_text(text * 4)
    out = tmp_path / "heads"
    options = {"heads": 2, "steps": 4, "batch_size": 2, "seq_len": 16, "data_folder": data, "bf16_autocast": False}
    summary = train_medusa(saved_pair_dirs["target"], out, report_prompts=2, report_tokens=8, **options)
    assert {p.name for p in out.iterdir()} >= {CONFIG_FILE, WEIGHTS_FILE, "README.md", "training_summary.json"}
    assert json.loads((out / "training_summary.json").read_text())["heads"] == summary["heads"]
    assert set(summary["acceptance"]) == {"chain", "static_tree", "dynamic_tree"}
    assert "Medusa heads for" in (out / "README.md").read_text()
    target = CausalLM.load(saved_pair_dirs["target"])
    assert target.tokenizer is not None and len(target.tokenizer) == len(char_tokenizer())
    drafter = MedusaDrafter.load(out, target)
    assert drafter.config.rank_probs == tuple(summary["teacher_forced"]["trained"]["rank_probs"])
    again = train_medusa(saved_pair_dirs["target"], out, report_prompts=1, report_tokens=4, **options)
    assert again["train"]["resumed_from_step"] == 4
