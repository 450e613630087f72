"""Exactness of the tree verifier (docs/verification.md, rules B-D: recursive rejection over a node's children).

* Greedy: hand-built trees where the accepted path and the next token are known.
* The fast verifier equals ``reference_verify_tree`` (plain Python floats) on identically seeded generators.
* Sampling exactness by Monte Carlo on a 6-token vocabulary. The target laws p_d depend only on the
  depth d, so the token emitted at depth d — counting only verifications whose path reached depth
  d — must follow p_d; and the first two tokens of the sequence (completing a verification that
  stopped at depth 0 with a fresh draw from p_1, as the next cycle would) must follow p_0 x p_1.
  Cases: children drawn i.i.d. from q (widths 2 and 3, spread and peaked q), distinct children
  drawn without replacement (widths 2 and 3), deterministic top-k children (no q), warped p.

Every chi-square test runs at ALPHA = 1e-4. This module runs EXPECTED_TESTS (= 28) of them on the
real verifier plus 4 on the correct side of a power check, so a correct verifier fails with
probability below 32e-4 = 0.32% (union bound); seeds are fixed, so outcomes are deterministic.
Two deliberately wrong rules — applying the i.i.d. rule to children drawn without replacement,
and resampling from p instead of the residual — must fail.
"""

from __future__ import annotations

from dataclasses import dataclass

import pytest
import torch
from stats_helpers import chi2_pvalue

from specserve.core.sampling.params import SamplingParams
from specserve.core.sampling.warps import sample, warp_probs
from specserve.core.tree.draft_tree import ChildSampling, DraftTree
from specserve.core.verify.chain import TokenKind
from specserve.core.verify.tree import TreeVerdict, reference_verify_tree, verify_tree, verify_tree_greedy

ALPHA = 1e-4
N_TRIALS = 12_000
VOCAB = 6


def normalise(weights: torch.Tensor) -> torch.Tensor:
    return weights / weights.sum(-1, keepdim=True)


def dirichlet(rows: int, gen: torch.Generator) -> torch.Tensor:
    return normalise(torch.empty(rows, VOCAB, dtype=torch.float64).exponential_(1.0, generator=gen))


# ---------------------------------------------------------------------------------------------
# Greedy


def one_hot_logits(argmaxes: list[int]) -> torch.Tensor:
    logits = torch.zeros(len(argmaxes), VOCAB)
    logits[torch.arange(len(argmaxes)), torch.tensor(argmaxes)] = 1.0
    return logits


@pytest.mark.parametrize(
    ("argmaxes", "path", "token", "kind"),
    [
        # rows: root, node0 .. node4
        ([1, 4, 0, 5, 3, 2], (0, 3), 3, TokenKind.BONUS),  # root->node0 (1), node0->node3 (4): a leaf, row 4
        ([2, 4, 0, 5, 3, 2], (1,), 0, TokenKind.RECOVERED),  # root->node1 (2), node1's only child is 5, not 0
        ([3, 4, 0, 5, 3, 2], (), 3, TokenKind.RECOVERED),  # no root child is 3
        ([1, 2, 0, 5, 3, 2], (0, 2), 5, TokenKind.BONUS),  # node0->node2 (2), a leaf: bonus = argmax of row 3
    ],
)
def test_greedy_walks_the_argmax(argmaxes: list[int], path: tuple[int, ...], token: int, kind: TokenKind) -> None:
    # root children: node0 = 1, node1 = 2; node0's children: node2 = 2, node3 = 4; node1's child: node4 = 5
    tree = DraftTree(torch.tensor([1, 2, 2, 4, 5]), (-1, -1, 0, 0, 1))
    assert verify_tree_greedy(one_hot_logits(argmaxes), tree) == TreeVerdict(path, token, kind)


def test_greedy_on_a_chain_equals_the_chain_rule() -> None:
    chain = DraftTree.chain(torch.tensor([1, 2, 3]))
    assert verify_tree_greedy(one_hot_logits([1, 2, 4, 0]), chain) == TreeVerdict((0, 1), 4, TokenKind.RECOVERED)
    assert verify_tree_greedy(one_hot_logits([1, 2, 3, 0]), chain) == TreeVerdict((0, 1, 2), 0, TokenKind.BONUS)
    assert verify_tree_greedy(one_hot_logits([5]), DraftTree.empty()) == TreeVerdict((), 5, TokenKind.BONUS)


# ---------------------------------------------------------------------------------------------
# Sampling: trees drawn from the drafter laws, verified many times


@dataclass(frozen=True)
class TreeCase:
    name: str
    target: torch.Tensor  # [depth + 1, vocab]: p_d, the target law after any path of d tokens
    proposal: torch.Tensor  # [depth, vocab]: the drafter law at depth d
    width: int  # children per node
    sampling: ChildSampling
    deterministic: bool = False  # children = the proposal's top-`width` tokens, passed without q
    deepest: int = 2  # deepest depth tested

    @property
    def depth(self) -> int:
        return self.proposal.shape[0]


def draw_tree(case: TreeCase, gen: torch.Generator) -> DraftTree:
    """A full tree of the case's width and depth, children drawn as the case says."""
    tokens: list[int] = []
    parents: list[int] = []
    frontier = [-1]
    for d in range(case.depth):
        q = case.proposal[d]
        next_frontier = []
        for parent in frontier:
            if case.deterministic:
                picks = q.topk(case.width).indices.tolist()
            elif case.sampling == ChildSampling.IID:
                picks = sample(q.expand(case.width, VOCAB), gen).tolist()
            else:
                picks = torch.multinomial(q, case.width, replacement=False, generator=gen).tolist()
            for token in picks:
                tokens.append(token)
                parents.append(parent)
                next_frontier.append(len(tokens) - 1)
        frontier = next_frontier
    probs = None
    if not case.deterministic:  # row 0 (root) and each node's row: the law its children were drawn from
        depths = DraftTree(torch.tensor(tokens), tuple(parents)).depths
        rows = [case.proposal[0]] + [
            case.proposal[d + 1] if d + 1 < case.depth else torch.zeros(VOCAB, dtype=torch.float64) for d in depths
        ]
        probs = torch.stack(rows)
    return DraftTree(torch.tensor(tokens), tuple(parents), probs)


def target_rows(case: TreeCase, tree: DraftTree) -> torch.Tensor:
    return torch.stack([case.target[0]] + [case.target[d + 1] for d in tree.depths])


def build_cases() -> list[TreeCase]:
    gen = torch.Generator().manual_seed(4242)
    cases = [
        TreeCase("iid_w2_spread", dirichlet(4, gen), dirichlet(3, gen), 2, ChildSampling.IID),
        TreeCase("iid_w3_spread", dirichlet(3, gen), dirichlet(2, gen), 3, ChildSampling.IID),
    ]
    peaked = normalise(dirichlet(2, gen) ** 4)  # mass on one or two tokens
    cases.append(TreeCase("iid_w3_peaked", dirichlet(3, gen), peaked, 3, ChildSampling.IID))
    cases.append(TreeCase("wor_w2", dirichlet(3, gen), dirichlet(2, gen), 2, ChildSampling.WITHOUT_REPLACEMENT))
    cases.append(TreeCase("wor_w3", dirichlet(3, gen), dirichlet(2, gen), 3, ChildSampling.WITHOUT_REPLACEMENT))
    cases.append(
        TreeCase("topk_w2_no_q", dirichlet(3, gen), dirichlet(2, gen), 2, ChildSampling.IID, deterministic=True)
    )
    logits_p = torch.randn(3, VOCAB, generator=gen, dtype=torch.float64) * 1.5
    logits_q = logits_p[:2] + torch.randn(2, VOCAB, generator=gen, dtype=torch.float64)
    p = warp_probs(logits_p, SamplingParams(temperature=0.8, top_k=4))
    q = warp_probs(logits_q, SamplingParams(temperature=1.0, top_p=0.9))
    cases.append(TreeCase("warped_wor_w2", p, q, 2, ChildSampling.WITHOUT_REPLACEMENT))
    return cases


CASES = build_cases()
EXPECTED_TESTS = sum(case.deepest + 1 + 1 for case in CASES)  # one per depth, one joint


@dataclass(frozen=True)
class Trials:
    depth_reached: torch.Tensor  # [n] accepted path lengths
    emitted: torch.Tensor  # [n, depth + 1], -1 past the end
    second: torch.Tensor  # [n] the sequence's second token (from p_1 after a depth-0 stop)


def run_trials(case: TreeCase, seed: int, sampling: ChildSampling | None = None, verify=verify_tree) -> Trials:  # type: ignore[no-untyped-def]
    draft_gen = torch.Generator().manual_seed(seed)
    verify_gen = torch.Generator().manual_seed(seed + 1)
    emitted = torch.full((N_TRIALS, case.depth + 1), -1)
    reached = torch.zeros(N_TRIALS, dtype=torch.long)
    for i in range(N_TRIALS):
        tree = draw_tree(case, draft_gen)
        verdict = verify(target_rows(case, tree), tree, verify_gen, sampling or case.sampling)
        path = tree.path_tokens(verdict.accepted[-1]) if verdict.accepted else []
        emitted[i, : len(path)] = torch.tensor(path, dtype=torch.long)
        emitted[i, len(path)] = verdict.next_token
        reached[i] = len(path)
    fresh = sample(case.target[1].expand(N_TRIALS, VOCAB), torch.Generator().manual_seed(seed + 2))
    second = torch.where(reached >= 1, emitted[:, 1], fresh)
    return Trials(reached, emitted, second)


def pvalues_of(case: TreeCase, trials: Trials) -> dict[str, float]:
    out = {}
    for d in range(case.deepest + 1):
        rows = trials.depth_reached >= d
        assert int(rows.sum()) >= 500, f"{case.name}: depth {d} reached only {int(rows.sum())} times"
        out[f"depth{d}"] = chi2_pvalue(trials.emitted[rows, d], case.target[d])
    joint = case.target[0][:, None] * case.target[1][None, :]
    out["joint01"] = chi2_pvalue(trials.emitted[:, 0] * VOCAB + trials.second, joint)
    return out


@pytest.mark.parametrize("case", CASES, ids=lambda c: c.name)
def test_emitted_tokens_follow_the_target(case: TreeCase) -> None:
    trials = run_trials(case, seed=10 + CASES.index(case))
    pvalues = pvalues_of(case, trials)
    failing = {name: pv for name, pv in pvalues.items() if pv < ALPHA}
    assert not failing, f"{case.name}: chi-square p-values below {ALPHA}: {failing}"


def test_case_count_matches_docstring() -> None:
    assert EXPECTED_TESTS == 28


def test_fast_equals_reference() -> None:
    for case in CASES:
        gen = torch.Generator().manual_seed(7)
        for trial in range(60):
            tree = draw_tree(case, gen)
            rows = target_rows(case, tree)
            fast = verify_tree(rows, tree, torch.Generator().manual_seed(trial), case.sampling)
            slow = reference_verify_tree(rows, tree, torch.Generator().manual_seed(trial), case.sampling)
            assert fast == slow, (case.name, trial)


# ---------------------------------------------------------------------------------------------
# Power: wrong rules must fail the same tests


@pytest.mark.slow  # the test's power against a wrong rule: make test, not the quick loop
def test_iid_rule_on_children_drawn_without_replacement_fails() -> None:
    case = next(c for c in CASES if c.name == "wor_w3")
    wrong = pvalues_of(case, run_trials(case, seed=99, sampling=ChildSampling.IID))
    assert min(wrong.values()) < ALPHA, wrong
    right = pvalues_of(case, run_trials(case, seed=99))
    assert min(right.values()) >= ALPHA, right


def resample_from_p(
    target_probs: torch.Tensor, tree: DraftTree, generator: torch.Generator, sampling: ChildSampling
) -> TreeVerdict:
    """A wrong rule: after the children are rejected, draw from p instead of the residual."""
    verdict = verify_tree(target_probs, tree, generator, sampling)
    if verdict.next_kind == TokenKind.RECOVERED:
        row = verdict.accepted[-1] + 1 if verdict.accepted else 0
        token = int(torch.multinomial(target_probs[row].double(), 1, generator=generator))
        return TreeVerdict(verdict.accepted, token, verdict.next_kind)
    return verdict


@pytest.mark.slow  # the test's power against a wrong rule: make test, not the quick loop
def test_resampling_from_p_fails() -> None:
    case = next(c for c in CASES if c.name == "iid_w2_spread")
    wrong = pvalues_of(case, run_trials(case, seed=5, verify=resample_from_p))
    assert wrong["depth0"] < ALPHA, wrong
