"""Medusa's typical acceptance (specserve.core.verify.typical), the one LOSSY rule: what it accepts, that it reduces to
greedy verification at temperature 0, that it only runs when opted into, and that it is indeed lossy.

* The rule on hand-made distributions: the threshold min(epsilon, delta * exp(-H(p))) on both of its branches,
  strictly (p(x) equal to the threshold is rejected), a node needing its parent, the longest path (ties: the
  lowest node index), the next token and its kind.
* At T = 0 it equals ``verify_tree_greedy`` on random trees (and the in-process engine's output equals exact
  greedy decoding, chains and trees).
* ``SamplingParams`` refuse it without ``lossy=True`` (and with ``drafter_invariant``, or bad epsilon / delta).
* Lossy, shown by a chi-square test: on p = [0.6, 0.3, 0.06, 0.04] and q = [0.1, 0.5, 0.2, 0.2], one draft token,
  the first emitted token follows the law q(v) [v acceptable] + q(rejected) p(v), not p. Two tests at
  ALPHA = 1e-4 on fixed seeds: the fit to that law fails with probability <= 1e-4 for a correct implementation;
  the fit to p would pass only if the chi-square statistic (expected about N * sum (law - p)^2 / p = 980 here)
  fell below its 1e-4 critical value (~ 21): probability far below 1e-100.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence

import pytest
import torch
from conftest import TinyPair
from stats_helpers import chi2_pvalue

from specserve.core.engine import SpeculativeEngine
from specserve.core.model.causal_lm import CausalLM
from specserve.core.request import GenerationConfig
from specserve.core.sampling.params import InvalidSamplingParams, SamplingParams
from specserve.core.sampling.warps import warp_probs
from specserve.core.tree.draft_tree import DraftTree
from specserve.core.tree.shapes import TreeBudget, TreeSpec
from specserve.core.verify.chain import TokenKind, verify_chain
from specserve.core.verify.tree import verify_tree_greedy
from specserve.core.verify.typical import (
    typical_acceptable,
    typical_thresholds,
    verify_chain_typical,
    verify_tree_typical,
)
from specserve.drafters.registry import build_drafter_set

ALPHA = 1e-4
VOCAB = 6
GREEDY = SamplingParams()


def rows(*allowed: Sequence[int]) -> torch.Tensor:
    """[len(allowed), VOCAB]: row r uniform over ``allowed[r]`` (at most 3 tokens, so each has p >= 1/3 > 0.09,
    above any default threshold; every other token has p = 0 and is rejected)."""
    probs = torch.zeros(len(allowed), VOCAB, dtype=torch.float64)
    for r, tokens in enumerate(allowed):
        probs[r, list(tokens)] = 1.0 / len(tokens)
    return probs


def tree(tokens: Sequence[int], parents: Sequence[int]) -> DraftTree:
    return DraftTree(torch.tensor(tokens, dtype=torch.long), tuple(parents))


# ---------------------------------------------------------------------------------------------
# The threshold


def test_threshold_is_min_of_epsilon_and_delta_times_exp_minus_entropy() -> None:
    p = torch.tensor([[0.5, 0.3, 0.2], [1.0, 0.0, 0.0], [1 / 3, 1 / 3, 1 / 3]], dtype=torch.float64)
    entropy = [-(0.5 * math.log(0.5) + 0.3 * math.log(0.3) + 0.2 * math.log(0.2)), 0.0, math.log(3)]
    want = [min(0.09, 0.3 * math.exp(-h)) for h in entropy]
    assert typical_thresholds(p).tolist() == pytest.approx(want, rel=1e-12)
    assert typical_thresholds(p, epsilon=0.5, delta=1.0).tolist() == pytest.approx(
        [min(0.5, math.exp(-h)) for h in entropy], rel=1e-12
    )


def test_acceptance_is_strict_at_the_threshold_on_both_branches() -> None:
    p = torch.tensor([[0.75, 0.25]], dtype=torch.float64)
    one = tree([1], [-1])  # token 1, p = 0.25
    # epsilon branch (delta = 1: delta * exp(-H) ~ 0.57 > epsilon)
    assert not typical_acceptable(p, one, epsilon=0.25, delta=1.0).item()  # p(x) == threshold: rejected
    assert typical_acceptable(p, one, epsilon=0.25 - 1e-9, delta=1.0).item()
    # entropy branch (epsilon = 0.99): threshold = delta * exp(-H); put it just above and just below p(x)
    exp_minus_h = math.exp(-float(torch.special.entr(p).sum()))
    delta_at = 0.25 / exp_minus_h
    assert not typical_acceptable(p, one, epsilon=0.99, delta=delta_at * (1 + 1e-9)).item()
    assert typical_acceptable(p, one, epsilon=0.99, delta=delta_at * (1 - 1e-9)).item()
    # the defaults: 0.25 > min(0.09, 0.3 * 0.57); a token of p = 0.05 at a confident row is not
    assert typical_acceptable(p, one).item()
    confident = torch.tensor([[0.95, 0.05]], dtype=torch.float64)
    assert typical_thresholds(confident).item() == pytest.approx(0.09)
    assert not typical_acceptable(confident, one).item()


# ---------------------------------------------------------------------------------------------
# Paths


def test_longest_accepted_path_needs_every_ancestor() -> None:
    #      root
    #     /    \
    #   n0(1)  n1(2)
    #    |       |
    #   n2(3)  n3(4)
    #            |
    #          n4(5)
    shape = tree([1, 2, 3, 4, 5], [-1, -1, 0, 1, 3])
    # rows: root, after n0, n1, n2, n3, n4
    all_pass = rows([1, 2], [3], [4], [0], [5], [0, 4])
    verdict = verify_tree_typical(all_pass, shape, None)
    assert verdict.accepted == (1, 3, 4) and verdict.next_kind == TokenKind.BONUS
    assert verdict.next_token == 0  # argmax of the last row (0.5 on 0 and 4): the lowest id

    # n4 rejected: paths (0, 2) and (1, 3) tie at depth 2; the lowest end node (2) wins
    tie = rows([1, 2], [3], [4], [0], [1], [0, 4])
    verdict = verify_tree_typical(tie, shape, None)
    assert verdict.accepted == (0, 2) and verdict.next_kind == TokenKind.BONUS and verdict.next_token == 0

    # n1 rejected: n3 and n4 pass their own thresholds but their parent is not accepted
    orphaned = rows([1], [3], [4], [0], [5], [0])
    verdict = verify_tree_typical(orphaned, shape, None)
    assert typical_acceptable(orphaned, shape).tolist() == [True, False, True, True, True]
    assert verdict.accepted == (0, 2)

    # nothing accepted: the next token comes from the root's row, RECOVERED (the root has children)
    nothing = rows([5], [3], [4], [0], [5], [0])
    verdict = verify_tree_typical(nothing, shape, None)
    assert verdict.accepted == () and verdict.next_token == 5 and verdict.next_kind == TokenKind.RECOVERED

    # stopping inside the tree: n0 accepted, n2 rejected -> RECOVERED after n0, from n0's row
    inner = rows([1], [0, 4], [4], [0], [5], [0])
    verdict = verify_tree_typical(inner, shape, None)
    assert verdict.accepted == (0,) and verdict.next_token == 0 and verdict.next_kind == TokenKind.RECOVERED


def test_next_token_is_drawn_from_p_at_the_path_end_with_the_generator() -> None:
    shape = tree([1], [-1])
    probs = torch.tensor([[0.0, 1.0, 0, 0, 0, 0], [0.0, 0.0, 0.5, 0.5, 0.0, 0.0]], dtype=torch.float64)
    gen = torch.Generator().manual_seed(0)
    drawn = {verify_tree_typical(probs, shape, gen).next_token for _ in range(200)}
    assert drawn == {2, 3}  # both tokens of p at the leaf appear, and nothing else


def test_chain_verdict_and_empty_draft() -> None:
    probs = rows([1], [2], [4], [0])  # gamma = 3: rows after the root and after each draft token
    verdict = verify_chain_typical(probs, torch.tensor([1, 2, 3]), None)
    assert (verdict.num_accepted, verdict.next_token, verdict.next_kind) == (2, 4, TokenKind.RECOVERED)
    verdict = verify_chain_typical(probs, torch.tensor([1, 2, 4]), None)
    assert (verdict.num_accepted, verdict.next_token, verdict.next_kind) == (3, 0, TokenKind.BONUS)
    empty = verify_chain_typical(probs[:1], torch.empty(0, dtype=torch.long), None)
    assert (empty.num_accepted, empty.next_token, empty.next_kind) == (0, 1, TokenKind.BONUS)


# ---------------------------------------------------------------------------------------------
# Temperature 0: greedy verification


def random_tree(gen: torch.Generator, size: int, vocab: int, distinct_siblings: bool) -> DraftTree:
    parents: list[int] = []
    tokens: list[int] = []
    for i in range(size):
        parent = int(torch.randint(-1, i, (1,), generator=gen))
        used = {tokens[j] for j in range(i) if parents[j] == parent}
        if distinct_siblings and len(used) == vocab:
            parent, used = i - 1, set()  # every token taken: node i - 1 has no children yet
        choices = [v for v in range(vocab) if not (distinct_siblings and v in used)]
        parents.append(parent)
        tokens.append(choices[int(torch.randint(len(choices), (1,), generator=gen))])
    return tree(tokens, parents)


@pytest.mark.parametrize("with_generator", [False, True])
def test_temperature_zero_equals_greedy_verification(with_generator: bool) -> None:
    """Integer logits in a small range make argmax ties common: both rules take the lowest id."""
    gen = torch.Generator().manual_seed(7)
    vocab = 3
    for trial in range(300):
        shape = random_tree(gen, int(torch.randint(0, 9, (1,), generator=gen)), vocab, distinct_siblings=True)
        logits = torch.randint(0, 3, (shape.size + 1, vocab), generator=gen).double()
        generator = torch.Generator().manual_seed(trial) if with_generator else None
        typical = verify_tree_typical(warp_probs(logits, GREEDY), shape, generator)
        assert typical == verify_tree_greedy(logits, shape), (shape, logits)
        if shape.is_chain:
            chain = verify_chain_typical(warp_probs(logits, GREEDY), shape.tokens, generator)
            assert chain == verify_chain(logits, None, shape.tokens, None, None)


def test_temperature_zero_with_duplicate_siblings_still_emits_the_greedy_continuation() -> None:
    """Siblings with the same token: typical may follow a longer duplicate than greedy's first match, but every
    token it emits is still the argmax, so the text is greedy's. As with a real target, a row's logits depend only
    on the tokens of its path (duplicate siblings see the same distribution)."""
    gen = torch.Generator().manual_seed(11)
    vocab = 2
    for _ in range(300):
        shape = random_tree(gen, int(torch.randint(0, 9, (1,), generator=gen)), vocab, distinct_siblings=False)
        by_path: dict[tuple[int, ...], torch.Tensor] = {}

        def target(path: tuple[int, ...], by_path: dict[tuple[int, ...], torch.Tensor] = by_path) -> torch.Tensor:
            if path not in by_path:
                by_path[path] = torch.randint(0, 3, (vocab,), generator=gen).double()
            return by_path[path]

        logits = torch.stack([target(()), *(target(tuple(shape.path_tokens(i))) for i in range(shape.size))])
        continuation: list[int] = []  # greedy decoding of the same target, one token at a time
        while len(continuation) <= shape.depth:
            continuation.append(int(target(tuple(continuation)).argmax()))
        typical = verify_tree_typical(warp_probs(logits, GREEDY), shape, None)
        greedy = verify_tree_greedy(logits, shape)
        for verdict in (typical, greedy):
            emitted = [*(int(shape.tokens[node]) for node in verdict.accepted), verdict.next_token]
            assert emitted == continuation[: len(emitted)]
        assert typical.num_accepted >= greedy.num_accepted


# ---------------------------------------------------------------------------------------------
# Opt-in


def test_typical_acceptance_needs_the_lossy_opt_in() -> None:
    assert not SamplingParams().lossy_acceptance and SamplingParams().acceptance == "exact"
    with pytest.raises(InvalidSamplingParams, match=r"typical acceptance is lossy.*lossy=True"):
        SamplingParams(temperature=1.0, acceptance="typical")
    params = SamplingParams(temperature=1.0, acceptance="typical", lossy=True)
    assert params.lossy_acceptance
    assert not SamplingParams(lossy=True).lossy_acceptance  # the permission alone changes nothing


@pytest.mark.parametrize(
    ("change", "words"),
    [
        ({"drafter_invariant": True}, "drafter_invariant"),
        ({"typical_epsilon": 0.0}, "typical_epsilon"),
        ({"typical_epsilon": 1.0}, "typical_epsilon"),
        ({"typical_delta": 0.0}, "typical_delta"),
        ({"typical_delta": 1.5}, "typical_delta"),
        ({"acceptance": "medusa"}, "acceptance"),
        ({"lossy": 1}, "lossy"),
    ],
)
def test_bad_typical_parameters_are_refused(change: dict[str, object], words: str) -> None:
    base: dict[str, object] = {"temperature": 1.0, "acceptance": "typical", "lossy": True}
    with pytest.raises(InvalidSamplingParams, match=words):
        SamplingParams(**{**base, **change})  # type: ignore[arg-type]


# ---------------------------------------------------------------------------------------------
# Lossy


def test_typical_acceptance_is_lossy() -> None:
    p = torch.tensor([0.6, 0.3, 0.06, 0.04], dtype=torch.float64)
    q = torch.tensor([0.1, 0.5, 0.2, 0.2], dtype=torch.float64)
    target_probs = torch.stack([p, p])  # [gamma + 1, vocab], gamma = 1
    acceptable = p > typical_thresholds(p[None]).item()
    assert acceptable.tolist() == [True, True, False, False]  # threshold min(0.09, 0.3 * exp(-H) ~ 0.11) = 0.09
    law = q * acceptable + q[~acceptable].sum() * p  # the first token's law under typical acceptance

    n = 2_000
    gen = torch.Generator().manual_seed(2024)
    drafts = torch.multinomial(q, n, replacement=True, generator=gen)
    first = []
    for x in drafts.tolist():
        verdict = verify_chain_typical(target_probs, torch.tensor([x]), gen)
        first.append(x if verdict.num_accepted else verdict.next_token)
    tokens = torch.tensor(first)
    assert chi2_pvalue(tokens, law) > ALPHA  # the rule does what the docstring says
    assert chi2_pvalue(tokens, p) < ALPHA  # and that is not the target's law


# ---------------------------------------------------------------------------------------------
# End to end, in process


def typical(temperature: float, seed: int = 0) -> SamplingParams:
    return SamplingParams(temperature=temperature, seed=seed, acceptance="typical", lossy=True)


TREE = TreeSpec("dynamic", budget=TreeBudget(depth=3, width=2, nodes=6))


@pytest.mark.parametrize("tree_spec", [None, TREE], ids=["chain", "tree"])
def test_engine_runs_typical_acceptance(pair: TinyPair, tree_spec: TreeSpec | None) -> None:
    engine = SpeculativeEngine(pair.target, build_drafter_set(pair.draft, pair.target))
    config = GenerationConfig(max_new_tokens=24, gamma=4, tree=tree_spec, ignore_eos=True)
    first = engine.generate([5, 17, 23, 8], typical(1.0, seed=3), config)
    again = engine.generate([5, 17, 23, 8], typical(1.0, seed=3), config)
    assert len(first.output_ids) == 24 and first.finish_reason == "length"
    assert first.output_ids == again.output_ids  # seeded: reproducible
    assert first.stats.drafted_tokens > 0 and first.stats.cycles < 24


@pytest.mark.parametrize("tree_spec", [None, TREE], ids=["chain", "tree"])
def test_engine_typical_at_temperature_zero_equals_exact_greedy(
    pair: TinyPair, tree_spec: TreeSpec | None, hf_greedy: Callable[[CausalLM, Sequence[int], int], list[int]]
) -> None:
    engine = SpeculativeEngine(pair.target, build_drafter_set(pair.draft, pair.target))
    config = GenerationConfig(max_new_tokens=20, gamma=4, tree=tree_spec)
    for prompt in pair.prompts[:4]:
        lossy = engine.generate(list(prompt), typical(0.0), config)
        exact = engine.generate(list(prompt), SamplingParams(), config)
        assert lossy.output_ids == exact.output_ids == hf_greedy(pair.target, prompt, 20)
        assert lossy.stats.accepted_tokens == exact.stats.accepted_tokens
