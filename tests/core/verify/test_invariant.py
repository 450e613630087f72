"""Drafter-invariant sampling (rule E of docs/verification.md): keyed Gumbel noise, argmax(log p + G) at every position.

* The noise is a function of (seed, absolute position) only: repeatable, batch- and order-free,
  bit-identical in a fresh process, standard Gumbel (a KS test), and it leaves every RNG alone.
* Output invariance: for one seed the engine emits the same tokens with the draft model at γ 2
  and 5, n-gram lookup, no drafter, a draft model that ignores the noise, and static and dynamic
  trees — and they equal a hand-written plain loop (full target forward per token, argmax of
  log p + G) — at temperature 1 and under top-k/top-p warps; other seeds give other outputs.
* Exactness: chi-square tests (ALPHA = 1e-3 each, two of them: false-failure probability
  < 2e-3; the seeds are fixed, so a pass is deterministic) that the first and second tokens the
  engine emits over 1200 seeds follow p(.|prompt) and sum_t p(t|prompt) p(.|prompt, t); the same
  test rejects a wrong rule (argmax(p + G): the log forgotten).
* Coupling: the draft model proposing argmax(log q + G) is accepted far more often than the same
  model sampling on its own stream; the target drafting for itself is accepted every time (chains
  and the rank-0 path of a static tree), which checks the positions the drafters use.
* Temperature 0 ignores the flag; neither the verifier's nor the drafter's generator is consumed.
"""

from __future__ import annotations

import dataclasses
import json
import os
import subprocess
import sys
from collections.abc import Sequence

import pytest
import scipy.stats
import torch
from conftest import TinyPair
from stats_helpers import chi2_pvalue, draws_over_seeds

from specserve import defaults
from specserve.cli import main
from specserve.core.draft.drafter import Draft
from specserve.core.engine import SpeculativeEngine
from specserve.core.request import GenerationConfig, GenerationResult
from specserve.core.sampling.params import InvalidSamplingParams, SamplingParams
from specserve.core.sampling.warps import warp_probs
from specserve.core.target import LocalSequence, TargetVerifier
from specserve.core.tree.draft_tree import DraftTree
from specserve.core.tree.shapes import TreeBudget, TreeSpec, TreeTopology
from specserve.core.verify.invariant import gumbel_noise, invariant_scores, invariant_tokens, noise_key
from specserve.drafters import DraftModelDrafter, build_drafter_set

ALPHA = 1e-3
MAX_NEW = 24
STATIC = TreeSpec("static", topology=TreeTopology.from_lists([[0], [1], [0, 0], [0, 1], [0, 0, 0]]))
DYNAMIC = TreeSpec("dynamic", budget=TreeBudget(depth=3, width=2, nodes=6))
WARPS = {
    "plain": {"temperature": 1.0},
    "warped": {"temperature": 0.8, "top_k": 20, "top_p": 0.9},
}


def invariant(seed: int, **warps: float) -> SamplingParams:
    return SamplingParams(seed=seed, drafter_invariant=True, **warps)  # type: ignore[arg-type]


class UncoupledDrafter(DraftModelDrafter):
    """The draft model sampling from its own generator, blind to the request's noise (and sending q)."""

    def start(self, prompt_ids: Sequence[int], params: SamplingParams, generator: torch.Generator) -> None:
        super().start(prompt_ids, dataclasses.replace(params, drafter_invariant=False), generator)


def plain_invariant_loop(pair: TinyPair, prompt: Sequence[int], params: SamplingParams, n: int) -> list[int]:
    """The reference: full target forward (no cache) per token, argmax(log p + G) at the token's position."""
    ids = list(prompt)
    with torch.no_grad():
        for _ in range(n):
            logits = pair.target.model(input_ids=torch.tensor([ids]), use_cache=False).logits[0, -1]
            noise = gumbel_noise(params.seed, [len(ids)], logits.shape[-1])[0]
            ids.append(int((warp_probs(logits, params).log() + noise).argmax()))
    return ids[len(prompt) :]


# ---------------------------------------------------------------------------------------------
# The noise


def test_noise_depends_only_on_seed_and_position() -> None:
    rng_state = torch.get_rng_state()
    rows = gumbel_noise(3, [10, 11, 10], 50)
    assert rows.shape == (3, 50) and rows.dtype == torch.float64
    assert torch.equal(rows[0], rows[2]) and not torch.equal(rows[0], rows[1])
    assert torch.equal(gumbel_noise(3, [11], 50)[0], rows[1])  # batching and order do not matter
    assert torch.equal(gumbel_noise(3, [11, 10], 50), rows[[1, 0]])
    assert not torch.equal(gumbel_noise(4, [10], 50)[0], rows[0])  # another seed, other noise
    assert torch.equal(gumbel_noise(3, [10], 50, dtype=torch.float32)[0], rows[0].float())
    assert gumbel_noise(3, [], 50).shape == (0, 50)
    assert torch.equal(torch.get_rng_state(), rng_state), "the global RNG must not be touched"
    keys = {noise_key(seed, position) for seed in range(32) for position in range(256)}
    assert len(keys) == 32 * 256 and all(0 <= k < 2**63 for k in keys)
    with pytest.raises(ValueError, match="must be >= 0"):
        noise_key(0, -1)


def test_noise_is_bit_identical_in_a_fresh_process() -> None:
    code = (
        "from specserve.core.verify.invariant import gumbel_noise; "
        "print(gumbel_noise(2**62 + 5, [0, 7, 4096], 1000).flatten().tolist())"
    )
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True, env=env).stdout
    assert json.loads(out) == gumbel_noise(2**62 + 5, [0, 7, 4096], 1000).flatten().tolist()


def test_noise_is_standard_gumbel() -> None:
    """Kolmogorov-Smirnov against Gumbel(0, 1) of 3 positions x 20000 draws; ALPHA per test."""
    sample = gumbel_noise(9, [0, 1, 2], 20_000).flatten().numpy()
    assert scipy.stats.kstest(sample, "gumbel_r").pvalue > ALPHA


def test_scores_never_pick_a_zero_probability_token() -> None:
    generator = torch.Generator().manual_seed(0)
    logits = torch.randn(200, 30, generator=generator, dtype=torch.float64)
    params = invariant(seed=1, temperature=2.0, top_k=3)
    scores = invariant_scores(logits, params, range(200))
    assert scores.shape == (200, 30) and scores.dtype == torch.float64
    assert torch.isneginf(scores).sum(-1).eq(27).all()
    chosen = invariant_tokens(logits, params, range(200))
    top3 = logits.topk(3, dim=-1).indices
    assert (top3 == chosen[:, None]).any(-1).all()
    assert len(set(chosen.tolist())) > 3, "the noise must spread choices over the vocabulary"
    with pytest.raises(ValueError, match="positions"):
        invariant_scores(logits, params, range(3))


def test_params_flag_is_validated_and_off_by_default() -> None:
    assert not SamplingParams().drafter_invariant
    assert invariant(0, temperature=1.0).invariant_sampling
    assert not invariant(0, temperature=0.0).invariant_sampling  # greedy: no effect
    assert not SamplingParams(temperature=1.0).invariant_sampling
    with pytest.raises(InvalidSamplingParams, match="drafter_invariant"):
        SamplingParams(drafter_invariant="yes")  # type: ignore[arg-type]


# ---------------------------------------------------------------------------------------------
# Output invariance


RUNS = {
    "model_gamma2": GenerationConfig(MAX_NEW, 2, ignore_eos=True),
    "model_gamma5": GenerationConfig(MAX_NEW, 5, ignore_eos=True),
    "ngram_gamma2": GenerationConfig(MAX_NEW, 2, ignore_eos=True, drafter="ngram"),
    "ngram_gamma5": GenerationConfig(MAX_NEW, 5, ignore_eos=True, drafter="ngram"),
    "none": GenerationConfig(MAX_NEW, 5, ignore_eos=True, drafter="none"),
    "static_tree": GenerationConfig(MAX_NEW, ignore_eos=True, tree=STATIC),
    "dynamic_tree": GenerationConfig(MAX_NEW, ignore_eos=True, tree=DYNAMIC),
}


@pytest.mark.parametrize("warp", sorted(WARPS))
def test_output_is_the_same_whatever_the_drafter(pair: TinyPair, warp: str) -> None:
    engine = SpeculativeEngine(pair.target, build_drafter_set(pair.draft, pair.target))
    uncoupled = SpeculativeEngine(pair.target, UncoupledDrafter(pair.draft, pair.target))
    accepted = {name: 0 for name in [*RUNS, "uncoupled_gamma5"]}
    for prompt in pair.prompts[:3]:
        params = invariant(seed=3, **WARPS[warp])
        reference = plain_invariant_loop(pair, prompt, params, MAX_NEW)
        results: dict[str, GenerationResult] = {
            name: engine.generate(prompt, params, cfg) for name, cfg in RUNS.items()
        }
        results["uncoupled_gamma5"] = uncoupled.generate(prompt, params, RUNS["model_gamma5"])
        for name, result in results.items():
            assert result.output_ids == reference, (pair.family, warp, name, prompt)
            accepted[name] += result.stats.accepted_tokens
        others = [engine.generate(prompt, dataclasses.replace(params, seed=s), RUNS["none"]) for s in (4, 5)]
        assert len({tuple(reference), *(tuple(r.output_ids) for r in others)}) == 3, "seeds must matter"
    assert accepted["none"] == 0
    for name in ("model_gamma2", "model_gamma5", "static_tree", "dynamic_tree"):
        assert accepted[name] > 0, f"{name}: no draft accepted, the invariance check would be vacuous"
    # coupling to the noise pays: measured 24..59 accepted vs 2..8 uncoupled on these models
    assert accepted["model_gamma5"] > 2 * accepted["uncoupled_gamma5"], accepted


def test_the_target_drafting_for_itself_is_always_accepted(pair: TinyPair) -> None:
    """argmax(log q + G) with q = p is the target's own token: every chain draft and the rank-0 path of a
    static tree must be accepted, which holds only if drafters and verifier key the noise by the same positions."""
    engine = SpeculativeEngine(pair.target, DraftModelDrafter(pair.target, pair.target))
    params = invariant(seed=11, temperature=1.0, top_k=30)
    prompt = pair.prompts[4]
    chain = engine.generate(prompt, params, GenerationConfig(MAX_NEW, 4, ignore_eos=True))
    assert chain.stats.accepted_tokens == chain.stats.drafted_tokens > 0
    tree = engine.generate(prompt, params, GenerationConfig(MAX_NEW, ignore_eos=True, tree=STATIC))
    assert tree.stats.accepted_tokens == sum(depth for _, depth in tree.stats.tree_shapes) > 0
    assert chain.output_ids == tree.output_ids == plain_invariant_loop(pair, prompt, params, MAX_NEW)


def test_temperature_zero_ignores_the_flag(pair: TinyPair) -> None:
    engine = SpeculativeEngine(pair.target, build_drafter_set(pair.draft, pair.target))
    for prompt in pair.prompts[:2]:
        config = GenerationConfig(16, 3)
        plain = engine.generate(prompt, SamplingParams(seed=1), config)
        flagged = engine.generate(prompt, SamplingParams(seed=1, drafter_invariant=True), config)
        assert flagged.output_ids == plain.output_ids


def test_no_generator_is_consumed(pair: TinyPair) -> None:
    """The verifier (chain and tree) and the coupled draft model draw nothing from the request's generators."""
    prompt = list(pair.prompts[0])
    params = invariant(seed=2, temperature=1.0)
    verify_gen, draft_gen = torch.Generator().manual_seed(1), torch.Generator().manual_seed(2)
    states = verify_gen.get_state(), draft_gen.get_state()
    verifier = TargetVerifier(LocalSequence(pair.target), prompt, params, verify_gen, max_new_tokens=20)
    verifier.prefill()
    drafter = DraftModelDrafter(pair.draft, pair.target)
    drafter.start(prompt, params, draft_gen)
    draft = drafter.propose(4)
    assert draft.draft_probs is None and draft.gamma == 4
    outcome = verifier.verify(draft)
    drafter.accept(outcome.new_tokens)
    tree = drafter.propose_tree(DYNAMIC)
    assert tree.child_probs is None
    verifier.verify(tree)
    verifier.verify(Draft.empty())
    verifier.verify(DraftTree.empty())
    assert torch.equal(verify_gen.get_state(), states[0]) and torch.equal(draft_gen.get_state(), states[1])
    assert verifier.committed[len(prompt) :] == plain_invariant_loop(pair, prompt, params, verifier.num_output)


# ---------------------------------------------------------------------------------------------
# Exactness


def test_emitted_tokens_follow_the_target_distribution(tiny_pairs: dict[str, TinyPair]) -> None:
    """Chi-square of the two tokens the engine emits over 1200 seeds (draft model, gamma = 1: the first token
    is an accepted draft or the target's own) against exact enumeration; and a wrong rule fails the same test."""
    pair = tiny_pairs["llama"]
    prompt = [5, 6, 7, 8, 9]
    warps = {"temperature": 1.0, "top_k": 6}
    params = invariant(seed=0, **warps)
    with torch.no_grad():
        logits = pair.target.model(input_ids=torch.tensor([prompt])).logits[0, -1]
        p1 = warp_probs(logits, params)
        p2 = torch.zeros_like(p1)
        for t in torch.nonzero(p1).flatten().tolist():
            next_logits = pair.target.model(input_ids=torch.tensor([[*prompt, t]])).logits[0, -1]
            p2 += p1[t] * warp_probs(next_logits, params)

    engine = SpeculativeEngine(pair.target, DraftModelDrafter(pair.draft, pair.target))
    n = 1200

    def run(seed: int) -> tuple[list[int], int]:
        result = engine.generate(prompt, invariant(seed=seed, **warps), GenerationConfig(2, 1, ignore_eos=True))
        return result.output_ids, result.stats.accepted_tokens

    runs = draws_over_seeds(run, n)
    first = [output[0] for output, _ in runs]
    second = [output[1] for output, _ in runs]
    accepted = sum(count for _, count in runs)
    assert 0 < accepted < n, "both accepted and rejected drafts must occur"
    assert chi2_pvalue(torch.tensor(first), p1) > ALPHA
    assert chi2_pvalue(torch.tensor(second), p2) > ALPHA

    # The same test has the power to catch a wrong rule: argmax(p + G) over p's support (the log forgotten).
    support = p1 > 0
    wrong = [
        int((p1 + gumbel_noise(seed, [len(prompt)], p1.shape[-1])[0]).masked_fill(~support, -torch.inf).argmax())
        for seed in range(n)
    ]
    assert chi2_pvalue(torch.tensor(wrong), p1) < ALPHA


# ---------------------------------------------------------------------------------------------
# Command line (the shipped pair)


def test_cli_drafter_invariant_output_is_draft_independent(capsys: pytest.CaptureFixture[str]) -> None:
    outputs = []
    for draft in (str(defaults.DEFAULT_DRAFT), "ngram", "none"):
        argv = [
            "generate", "--prompt", "import os\n", "--max-new-tokens", "16", "--json", "--dtype", "float64",
            "--draft", draft, "--gamma", "3", "--temperature", "1", "--top-p", "0.95", "--seed", "5",
            "--drafter-invariant",
        ]  # fmt: skip
        assert main(argv) == 0
        obj = json.loads(capsys.readouterr().out)
        assert obj["sampling"] == "drafter_invariant"
        outputs.append(obj["output_ids"])
    assert outputs[0] == outputs[1] == outputs[2] and outputs[0]
    assert main(["generate", "--prompt", "x", "--max-new-tokens", "2", "--json", "--drafter-invariant"]) == 0
    assert json.loads(capsys.readouterr().out)["sampling"] == "greedy"  # no effect at temperature 0
