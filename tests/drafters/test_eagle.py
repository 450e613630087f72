"""EAGLE: the head drafts from the target's features; decoding with it stays exactly the target's.

A head is trained for a few seconds on each tiny target (so drafts are right often enough for the
tests to exercise acceptance), then: greedy output equals transformers' ``generate`` for chains,
static and dynamic trees; sampled trees emit the target's joint law (chi-square at significance
1e-3, fixed seeds); training lowers the loss and raises acceptance over the untrained head; the
head directory round-trips and refuses another target; the unrolling mask matches serving.
"""

from __future__ import annotations

import json
from collections.abc import Callable, Sequence
from pathlib import Path

import pytest
import torch
from conftest import REF_TOKENS, TinyPair, build_model
from head_helpers import RECIPE, target_stream, trained_head
from stats_helpers import batched_runs, check_single_engine_agrees, two_token_fit

from specserve.core.batch_engine import BatchedEngine
from specserve.core.engine import SpeculativeEngine
from specserve.core.errors import UserError
from specserve.core.model.causal_lm import CausalLM, select_features
from specserve.core.request import GenerationConfig
from specserve.core.sampling.params import SamplingParams
from specserve.core.tree.shapes import TreeBudget, TreeSpec, TreeTopology
from specserve.drafters.eagle import EagleDrafter
from specserve.drafters.eagle_head import EagleConfig, EagleHead
from specserve.training import heads, loop
from specserve.training.eagle import eagle_loss, unroll_mask

HfGreedy = Callable[[CausalLM, Sequence[int], int], list[int]]
ALPHA = 1e-3
TREES = (
    TreeSpec("dynamic", budget=TreeBudget(depth=4, width=2, nodes=6)),
    TreeSpec("static", topology=TreeTopology.from_lists([[0], [1], [0, 0], [0, 1], [0, 0, 0]])),
)


def test_the_default_features_are_eagle3s_low_middle_and_top_layers() -> None:
    model = build_model("llama", num_layers=8)
    assert EagleConfig.for_target(model).feature_layers == (2, 4, 8)
    assert EagleConfig.for_target(build_model("llama", num_layers=2)).feature_layers == (2,)  # EAGLE-1's one
    with pytest.raises(UserError, match="feature layers"):
        EagleConfig.for_target(model, (0, 9))


def test_the_unroll_mask_is_the_serving_attention() -> None:
    mask = unroll_mask(3, 2, torch.float64)[0, 0] == 0  # True = may attend
    # row t at step 2 sees step 0's positions <= t, then its own step-1 and step-2 entries
    want = torch.tensor(
        [
            [1, 0, 0, 1, 0, 0, 1, 0, 0],
            [1, 1, 0, 0, 1, 0, 0, 1, 0],
            [1, 1, 1, 0, 0, 1, 0, 0, 1],
        ],
        dtype=torch.bool,
    )
    assert torch.equal(mask, want)


def test_training_lowers_the_loss_and_raises_acceptance(tiny_pairs: dict[str, TinyPair]) -> None:
    pair = tiny_pairs["llama"]
    stream = target_stream(pair.target, seed=1)
    torch.manual_seed(0)
    untrained = EagleHead(EagleConfig.for_target(pair.target.model)).double()
    loss_fn = eagle_loss(pair.target.model, untrained.config.feature_layers, RECIPE.unroll)
    batch = loop.sample_windows(stream, 8, RECIPE.seq_len, torch.Generator().manual_seed(5))
    with torch.no_grad():
        before = float(loss_fn(untrained, batch))
    head = trained_head(pair)
    with torch.no_grad():
        after = float(loss_fn(head, batch))
    assert after < 0.7 * before
    prompts = [p for p in pair.prompts if len(p) > 1][:4]
    # in the real engine at temperature 1 (the tiny targets' greedy text is a few tokens to EOS, then noise) ...
    reports = [
        heads.heldout_acceptance(
            pair.target, EagleDrafter.for_target(h, pair.target), prompts, 24, gamma=4, temperature=1.0
        )
        for h in (untrained, head)
    ]
    assert reports[1]["mean_accepted_length"] > reports[0]["mean_accepted_length"] + 0.3
    # ... and greedy, teacher-forced on held-out text: the head's first draft is the target's next argmax more often
    assert top1_agreement(pair, head, stream) > top1_agreement(pair, untrained, stream) + 0.1


def top1_agreement(pair: TinyPair, head: EagleHead, stream: torch.Tensor) -> float:
    """How often the head's first draft token (real features of positions < t, committed x_0 .. x_t) is the
    target's argmax for token t + 1, over a few 90-token windows of the (sampled) start of ``stream``."""
    drafter = EagleDrafter.for_target(head, pair.target)
    hits = total = 0
    for window in range(4):
        ids = stream[window * 90 : (window + 1) * 90]
        with torch.inference_mode():
            out = pair.target.model(input_ids=ids[None], output_hidden_states=True)
        features = select_features(out.hidden_states, head.config.feature_layers)[0]
        argmax = out.logits[0].argmax(-1)
        for t in range(4, 89, 3):
            drafter.start(ids[: t + 1].tolist(), SamplingParams(), torch.Generator())
            drafter.add_features(0, features[:t])
            hits += int(drafter.propose(1).tokens[0]) == int(argmax[t])
            total += 1
    return hits / total


def test_greedy_eagle_equals_transformers(pair: TinyPair, hf_greedy: HfGreedy) -> None:
    engine = SpeculativeEngine(pair.target, EagleDrafter.for_target(trained_head(pair), pair.target))
    accepted = 0
    for prompt in pair.prompts:  # includes a 1-token prompt: no features yet, the first cycle drafts nothing
        for config in (
            GenerationConfig(max_new_tokens=REF_TOKENS, gamma=4),
            *(GenerationConfig(max_new_tokens=REF_TOKENS, tree=tree) for tree in TREES),
        ):
            result = engine.generate(prompt, SamplingParams(), config)
            assert result.output_ids == hf_greedy(pair.target, prompt, REF_TOKENS), (prompt, config)
            accepted += result.stats.accepted_tokens
    assert accepted > 0


def test_sampled_runs_reproduce_and_drafter_invariant_runs_match_plain_decoding(pair: TinyPair) -> None:
    engine = SpeculativeEngine(pair.target, EagleDrafter.for_target(trained_head(pair), pair.target))
    prompt = pair.prompts[0]
    for tree in (None, TREES[0]):
        config = GenerationConfig(max_new_tokens=16, gamma=3, tree=tree)
        params = SamplingParams(temperature=1.0, top_k=30, seed=4)
        first = engine.generate(prompt, params, config).output_ids
        assert engine.generate(prompt, params, config).output_ids == first
        invariant = SamplingParams(temperature=1.0, seed=4, drafter_invariant=True)
        plain = engine.generate(prompt, invariant, GenerationConfig(max_new_tokens=16, gamma=0))
        assert engine.generate(prompt, invariant, config).output_ids == plain.output_ids


@pytest.mark.parametrize("shape", ["chain", "dynamic"])
def test_sampled_eagle_emits_the_target_joint_law(tiny_pairs: dict[str, TinyPair], shape: str) -> None:
    """Two emitted tokens at T = 1 through sampled EAGLE chains / trees: their joint law is the target's (2,500 seeds
    as requests of one batched engine, whose first seeds the single-request engine emits alike)."""
    pair = tiny_pairs["llama"]
    head = trained_head(pair)
    root = EagleDrafter.for_target(head, pair.target)  # its fresh() drafters draft their chains together
    batched = BatchedEngine(pair.target, lambda name: root.fresh(), max_num_seqs=32)
    prompt = [5, 17, 23, 8, 30]
    tree = None if shape == "chain" else TreeSpec("dynamic", budget=TreeBudget(depth=3, width=3, nodes=7))
    config = GenerationConfig(max_new_tokens=2, gamma=3, tree=tree, ignore_eos=True)
    params = SamplingParams(temperature=1.0, top_k=24)
    runs = batched_runs(batched, prompt, params, config, 2500)
    assert two_token_fit([run.output_ids for run in runs], pair.target, prompt, params) > ALPHA
    single = SpeculativeEngine(pair.target, EagleDrafter.for_target(head, pair.target))
    check_single_engine_agrees(single, runs, prompt, params, config)


def test_the_head_directory_round_trips_and_refuses_another_target(pair: TinyPair, tmp_path: Path) -> None:
    head = trained_head(pair)
    head.save(tmp_path)
    loaded = EagleDrafter.load(tmp_path, pair.target)
    for (name, a), b in zip(head.state_dict().items(), loaded.head.state_dict().values(), strict=True):
        torch.testing.assert_close(a, b, rtol=0, atol=0, msg=name)
    deeper = CausalLM(build_model(pair.family, num_layers=3).double())
    with pytest.raises(UserError, match="trained for another target"):
        EagleDrafter.load(tmp_path, deeper)
    (tmp_path / "config.json").write_text(json.dumps({"model_type": "llama"}))
    with pytest.raises(UserError, match="not an EAGLE head"):
        EagleDrafter.load(tmp_path, pair.target)
    with pytest.raises(UserError, match="does not exist"):
        EagleDrafter.load(tmp_path / "missing", pair.target)
    (tmp_path / "config.json").unlink()
    with pytest.raises(UserError, match=r"no config\.json"):
        EagleDrafter.load(tmp_path, pair.target)
