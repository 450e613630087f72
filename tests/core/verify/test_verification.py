"""Exactness of the chain verifier (docs/verification.md#rule-a-chain-one-sampled-child-per-depth).

* Greedy: hand-built tables where the number of accepted tokens and the next token are known.
* The fast stochastic path equals ``reference_verify_chain`` bit for bit on identically seeded generators.
* Sampling exactness by Monte Carlo on tiny vocabularies: every emitted token must be distributed as
  the target. The target rows p_0..p_gamma are built independent of the prefix, so the token emitted
  at depth d (counting only cycles that reach depth d, i.e. that accepted the first d drafts) must
  follow p_d, also conditionally on which draft token was accepted before it, and the first two
  tokens of the sequence (completing a cycle that stopped after one token with a fresh draw from p_1,
  as the next cycle would) must follow p_0 x p_1.

Every chi-square test runs at significance ALPHA = 1e-4. For a correct verifier a random seed would
fail any one of them with probability 1e-4; this module runs 40 such tests on the real verifier (35 in
test_emitted_tokens_follow_target, see EXPECTED_TESTS; 4 on the correct side of the power check; 1 for
gamma = 0), so its false-failure probability is below 40e-4 = 0.4% (union bound). Seeds are fixed, so
the outcome is deterministic. Two deliberately wrong rules (resampling from p instead of the residual,
and an off-by-one bonus row) must fail the same tests, which shows the tests have power.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import pytest
import torch
from stats_helpers import chi2_pvalue

from specserve.core.sampling.params import SamplingParams
from specserve.core.sampling.warps import sample, warp_probs
from specserve.core.verify.chain import (
    ChainVerdict,
    TokenKind,
    reference_verify_chain,
    residual_rows,
    verify_chain,
    verify_chain_greedy,
    verify_chain_stochastic,
)

ALPHA = 1e-4  # per-test significance of every chi-square test in this module
N_TRIALS = 30_000  # verifier calls per exactness case (~60 us each)

VerifyFn = Callable[
    [torch.Tensor, torch.Tensor, torch.Tensor | None, torch.Generator], tuple[torch.Tensor, torch.Tensor]
]


def normalise(weights: torch.Tensor) -> torch.Tensor:
    return weights / weights.sum(-1, keepdim=True)


def dirichlet(rows: int, vocab: int, gen: torch.Generator, dtype: torch.dtype = torch.float64) -> torch.Tensor:
    """Rows drawn uniformly from the probability simplex (Dirichlet(1, ..., 1))."""
    return normalise(torch.empty(rows, vocab, dtype=dtype).exponential_(1.0, generator=gen))


def total_variation(p: torch.Tensor, q: torch.Tensor) -> torch.Tensor:
    return 0.5 * (p.double() - q.double()).abs().sum(-1)


# ---------------------------------------------------------------------------------------------
# Greedy: exact tables


def logits_with_argmax(argmaxes: list[int], vocab: int = 5) -> torch.Tensor:
    """Rows of distinct random-looking logits whose argmax is the given token."""
    gen = torch.Generator().manual_seed(sum(argmaxes) + 17 * len(argmaxes))
    logits = torch.randn(len(argmaxes), vocab, generator=gen)
    for row, token in enumerate(argmaxes):
        logits[row, token] = logits[row].max() + 1.0
    return logits


GREEDY_TABLE = [
    # (id, target argmax per row [gamma + 1], draft tokens [gamma], num_accepted, next_token)
    ("full_accept_bonus", [2, 0, 3], [2, 0], 2, 3),
    ("first_position_reject", [1, 0, 3], [2, 0], 0, 1),  # later match does not count
    ("middle_reject", [2, 4, 3], [2, 0], 1, 4),
    ("last_reject", [4, 4, 4, 1], [4, 4, 3], 2, 4),
    ("gamma1_accept", [3, 2], [3], 1, 2),
    ("gamma1_reject", [3, 2], [2], 0, 3),
    ("gamma4_full", [0, 1, 2, 3, 4], [0, 1, 2, 3], 4, 4),
    ("gamma0_bonus_only", [3], [], 0, 3),
]


@pytest.mark.parametrize(
    "argmaxes,drafts,num_accepted,next_token", [c[1:] for c in GREEDY_TABLE], ids=[c[0] for c in GREEDY_TABLE]
)
def test_greedy_table(argmaxes: list[int], drafts: list[int], num_accepted: int, next_token: int) -> None:
    logits = logits_with_argmax(argmaxes)
    draft_tokens = torch.tensor(drafts, dtype=torch.int64)
    num, token = verify_chain_greedy(logits, draft_tokens)
    assert (int(num), int(token)) == (num_accepted, next_token)
    verdict = verify_chain(logits, None, draft_tokens, None, None)
    kind = TokenKind.BONUS if num_accepted == len(drafts) else TokenKind.RECOVERED
    assert verdict == ChainVerdict(num_accepted, next_token, kind)


TIE_TABLE = [
    # (id, logits rows, draft tokens, num_accepted, next_token)
    ("tie_draft_is_lowest_id", [[1.0, 5.0, 5.0, 0.0], [2.0, 2.0, 2.0, 2.0]], [1], 1, 0),
    ("tie_draft_is_higher_id", [[1.0, 5.0, 5.0, 0.0], [2.0, 2.0, 2.0, 2.0]], [2], 0, 1),
    ("tie_bonus_lowest_id", [[0.0, 3.0, 1.0, 3.0], [-1.0, 7.0, 7.0, 7.0]], [1], 1, 1),
    ("tie_after_masked", [[float("-inf"), 4.0, float("-inf"), 4.0], [0.0, 0.0, 0.0, 1.0]], [3], 0, 1),
    ("all_equal_rows", [[0.5] * 4, [0.5] * 4, [0.5] * 4], [0, 0], 2, 0),
    ("all_equal_reject", [[0.5] * 4, [0.5] * 4, [0.5] * 4], [0, 1], 1, 0),
]


@pytest.mark.parametrize(
    "rows,drafts,num_accepted,next_token", [c[1:] for c in TIE_TABLE], ids=[c[0] for c in TIE_TABLE]
)
@pytest.mark.parametrize("dtype", [torch.float32, torch.float64, torch.bfloat16])
def test_greedy_ties_resolve_to_lowest_id(
    rows: list[list[float]], drafts: list[int], num_accepted: int, next_token: int, dtype: torch.dtype
) -> None:
    logits = torch.tensor(rows, dtype=dtype)
    draft_tokens = torch.tensor(drafts, dtype=torch.int64)
    num, token = verify_chain_greedy(logits, draft_tokens)
    assert (int(num), int(token)) == (num_accepted, next_token)


@pytest.mark.parametrize("case", GREEDY_TABLE + TIE_TABLE, ids=lambda c: c[0])
def test_stochastic_rule_on_greedy_probs_reduces_to_greedy(case: tuple) -> None:
    """With p = warp_probs(temperature 0) (one-hot on the lowest-id argmax) the stochastic rule is deterministic."""
    _, spec, drafts, num_accepted, next_token = case
    logits = logits_with_argmax(spec) if isinstance(spec[0], int) else torch.tensor(spec)
    probs = warp_probs(logits, SamplingParams(temperature=0.0))
    draft_tokens = torch.tensor(drafts, dtype=torch.int64)
    one_hot_q = torch.nn.functional.one_hot(draft_tokens, logits.shape[-1]).to(probs.dtype)
    for seed in range(5):
        for q in (None, one_hot_q):
            num, token = verify_chain_stochastic(probs, draft_tokens, q, torch.Generator().manual_seed(seed))
            assert (int(num), int(token)) == (num_accepted, next_token)


# ---------------------------------------------------------------------------------------------
# Fast path == reference, bit for bit


def random_bitwise_case(gamma: int, gen: torch.Generator) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None]:
    """A random (target_probs, draft_tokens, draft_probs) with draft tokens drawn from q (or arbitrary if q is None)."""
    vocab = int(torch.randint(2, 13, (), generator=gen))
    dtype = torch.float32 if bool(torch.rand((), generator=gen) < 0.5) else torch.float64
    mode = int(torch.randint(0, 6, (), generator=gen))
    target = dirichlet(gamma + 1, vocab, gen, dtype)
    if bool(torch.rand((), generator=gen) < 0.5):  # sparse target: zero out entries, keep each row's max
        keep = (torch.rand(gamma + 1, vocab, generator=gen) < 0.5) | (target == target.max(-1, keepdim=True).values)
        target = normalise(target * keep)
    if mode == 0:  # point-mass drafts (n-gram lookup): q = one-hot, any token
        draft_tokens = torch.randint(0, vocab, (gamma,), generator=gen)
        return target, draft_tokens, None
    if mode == 1:  # dense random q
        draft = dirichlet(gamma, vocab, gen, dtype)
    elif mode == 2:  # q == p
        draft = target[:gamma].clone()
    elif mode == 3:  # top-k truncated q, the drafter sends its real (renormalised) proposal
        k = int(torch.randint(1, vocab + 1, (), generator=gen))
        draft = warp_probs(torch.randn(gamma, vocab, generator=gen, dtype=dtype), SamplingParams(1.0, top_k=k))
    elif mode == 4:  # explicit one-hot q
        draft = torch.nn.functional.one_hot(torch.randint(0, vocab, (gamma,), generator=gen), vocab).to(dtype)
    else:  # q supported where p is small or zero
        draft = normalise((target[:gamma] == 0).to(dtype) + 0.05 * dirichlet(gamma, vocab, gen, dtype))
    draft_tokens = sample(draft, gen)
    return target, draft_tokens, draft


@pytest.mark.parametrize("gamma", [1, 2, 4])
def test_fast_equals_reference_bit_for_bit(gamma: int) -> None:
    cases = torch.Generator().manual_seed(1000 + gamma)
    kinds: set[tuple[int, int]] = set()
    for case_index in range(250):
        target, draft_tokens, draft = random_bitwise_case(gamma, cases)
        seed = 7919 * case_index + gamma
        fast_gen = torch.Generator().manual_seed(seed)
        ref_gen = torch.Generator().manual_seed(seed)
        disp_gen = torch.Generator().manual_seed(seed)
        num, token = verify_chain_stochastic(target, draft_tokens, draft, fast_gen)
        expected = reference_verify_chain(target, draft_tokens, draft, ref_gen)
        got = verify_chain(torch.log(target), target, draft_tokens, draft, disp_gen)
        assert (int(num), int(token)) == (expected.num_accepted, expected.next_token), (case_index, target, draft)
        assert got == expected, case_index
        # Both consumed exactly the same random numbers.
        assert torch.equal(fast_gen.get_state(), ref_gen.get_state())
        assert torch.equal(disp_gen.get_state(), ref_gen.get_state())
        assert target[expected.num_accepted, expected.next_token] > 0  # only tokens p allows are emitted
        kinds.add((expected.num_accepted, int(expected.next_kind)))
    # The cases exercised rejections at every position and the bonus.
    assert {n for n, _ in kinds} == set(range(gamma + 1))


def test_fast_equals_reference_when_float32_p_is_the_rounded_product() -> None:
    """Edge case: p is the float32 rounding of u * q, so the accept test sits on a rounding boundary.

    Both paths compare u * q < p in float64 on the same float64 uniform, so they must agree.
    """
    seed = 0
    u = torch.rand(1, generator=torch.Generator().manual_seed(seed), dtype=torch.float64)  # the first uniform drawn
    q = torch.tensor([0.3003000020980835])
    p = (u * q.double()).float()  # rounded to float32: lands just above or below the exact product
    target = torch.tensor([[p.item(), 1.0 - p.item()], [0.5, 0.5]])
    draft = torch.tensor([[q.item(), 1.0 - q.item()]])
    draft_tokens = torch.tensor([0])
    num, token = verify_chain_stochastic(target, draft_tokens, draft, torch.Generator().manual_seed(seed))
    expected = reference_verify_chain(target, draft_tokens, draft, torch.Generator().manual_seed(seed))
    assert expected.num_accepted == int(u.item() * q.double().item() < p.double().item())
    assert (int(num), int(token)) == (expected.num_accepted, expected.next_token)


def test_reference_and_fast_agree_on_shared_generator_sequence() -> None:
    """Calls chained on one generator stay in lockstep (same consumption per call)."""
    gen_cases = torch.Generator().manual_seed(4)
    fast_gen, ref_gen = torch.Generator().manual_seed(8), torch.Generator().manual_seed(8)
    for _ in range(200):
        target, draft_tokens, draft = random_bitwise_case(2, gen_cases)
        num, token = verify_chain_stochastic(target, draft_tokens, draft, fast_gen)
        expected = reference_verify_chain(target, draft_tokens, draft, ref_gen)
        assert (int(num), int(token)) == (expected.num_accepted, expected.next_token)


# ---------------------------------------------------------------------------------------------
# Sampling exactness (Monte Carlo)


@dataclass(frozen=True)
class ExactnessCase:
    name: str
    target: torch.Tensor  # [gamma + 1, vocab], rows independent of the prefix
    proposal: torch.Tensor  # [gamma, vocab], the law the draft tokens are drawn from
    q_mode: str  # "q": pass proposal as draft_probs; "none": pass None; "one_hot": pass one_hot(token)
    deepest: int  # the deepest depth the chain reaches often enough to test

    @property
    def gamma(self) -> int:
        return self.proposal.shape[0]


def build_cases() -> list[ExactnessCase]:
    gen = torch.Generator().manual_seed(31337)
    cases: list[ExactnessCase] = []

    p = dirichlet(4, 6, gen)
    q = dirichlet(3, 6, gen)
    cases.append(ExactnessCase("random_pq", p, q, "q", deepest=3))

    p = torch.zeros(2, 6, dtype=torch.float64)
    p[0, :3] = torch.tensor([0.5, 0.3, 0.2])
    p[1] = dirichlet(1, 6, gen)[0]
    q = torch.zeros(1, 6, dtype=torch.float64)
    q[0, 3:] = torch.tensor([0.2, 0.4, 0.4])
    cases.append(ExactnessCase("disjoint_supports", p, q, "q", deepest=0))

    p = dirichlet(3, 6, gen)
    p[0, 4] = 0.0  # the point-mass drafter sometimes proposes a token p forbids
    p = normalise(p)
    # The tokens come from some drafter law (here p plus a uniform floor, so token 4 is proposed too),
    # but each is passed as a point mass: q = one-hot(token), the proposal conditional on the token.
    drafter_law = normalise(p[:2] + 0.1)
    cases.append(ExactnessCase("point_mass_none", p, drafter_law, "none", deepest=2))

    p = dirichlet(3, 6, gen)
    fixed = torch.zeros(2, 6, dtype=torch.float64)  # a deterministic drafter: always token 2, then token 5
    fixed[0, 2] = 1.0
    fixed[1, 5] = 1.0
    p[0, 2] += 0.5
    p[1, 5] += 0.8
    p = normalise(p)
    cases.append(ExactnessCase("point_mass_explicit_one_hot", p, fixed, "one_hot", deepest=2))

    p = dirichlet(5, 6, gen)
    cases.append(ExactnessCase("q_equals_p", p, p[:4].clone(), "q", deepest=4))

    logits_p = torch.randn(3, 8, generator=gen) * 1.5
    logits_q = logits_p[:2] + torch.randn(2, 8, generator=gen)
    p = warp_probs(logits_p, SamplingParams(temperature=1.0, top_k=4))
    q = warp_probs(logits_q, SamplingParams(temperature=1.0, top_k=3))
    cases.append(ExactnessCase("top_k_warped_f32", p, q, "q", deepest=2))

    logits_p = torch.randn(3, 8, generator=gen, dtype=torch.float64) * 1.5
    logits_q = logits_p[:2] + torch.randn(2, 8, generator=gen, dtype=torch.float64)
    p = warp_probs(logits_p, SamplingParams(temperature=1.0, top_p=0.8))
    q = warp_probs(logits_q, SamplingParams(temperature=1.0, top_p=0.7))
    cases.append(ExactnessCase("top_p_warped", p, q, "q", deepest=2))
    return cases


CASES = build_cases()
# chi-square tests per case: one per depth 0..deepest, one conditional on the accepted first token
# (when depth 1 is reached), one joint test of the first two tokens.
EXPECTED_TESTS = sum((c.deepest + 1) + (1 if c.deepest >= 1 else 0) + 1 for c in CASES)


@dataclass(frozen=True)
class Trials:
    num_accepted: torch.Tensor  # [n] int64
    emitted: torch.Tensor  # [n, gamma + 1] int64, -1 past the end of the cycle
    second_token: torch.Tensor  # [n] the second token of the sequence, completed from p_1 after a depth-0 stop


def run_trials(case: ExactnessCase, verify: VerifyFn, n: int, seed: int) -> Trials:
    gamma, vocab = case.gamma, case.target.shape[-1]
    draft_gen = torch.Generator().manual_seed(seed)
    verify_gen = torch.Generator().manual_seed(seed + 1)
    drafts = sample(case.proposal.expand(n, gamma, vocab), draft_gen)  # [n, gamma], x_d ~ proposal_d
    one_hots = torch.nn.functional.one_hot(drafts, vocab).to(case.target.dtype)
    nums: list[torch.Tensor] = []
    tokens: list[torch.Tensor] = []
    for i in range(n):
        if case.q_mode == "q":
            q = case.proposal
        elif case.q_mode == "one_hot":
            q = one_hots[i]
        else:
            q = None
        num, token = verify(case.target, drafts[i], q, verify_gen)
        nums.append(num)
        tokens.append(token)
    num_accepted = torch.stack(nums)
    next_token = torch.stack(tokens)
    depth = torch.arange(gamma + 1)
    emitted = torch.cat([drafts, torch.full((n, 1), -1)], dim=1)
    emitted = torch.where(depth < num_accepted[:, None], emitted, torch.full_like(emitted, -1))
    emitted[torch.arange(n), num_accepted] = next_token
    # A cycle that stopped at depth 0 leaves the second token to the next cycle, which draws it from p_1.
    fresh = sample(case.target[1].expand(n, vocab), torch.Generator().manual_seed(seed + 2))
    second = torch.where(num_accepted >= 1, emitted[:, 1], fresh)
    return Trials(num_accepted, emitted, second)


def exactness_pvalues(case: ExactnessCase, trials: Trials) -> dict[str, float]:
    """All chi-square p-values for one case; also asserts every tested depth has enough samples."""
    pvalues: dict[str, float] = {}
    vocab = case.target.shape[-1]
    for d in range(case.deepest + 1):
        reached = trials.num_accepted >= d  # the first d drafts were accepted
        assert int(reached.sum()) >= 1000, f"{case.name}: depth {d} reached only {int(reached.sum())} times"
        pvalues[f"depth{d}"] = chi2_pvalue(trials.emitted[reached, d], case.target[d])
    if case.deepest >= 1:
        accepted_first = trials.num_accepted >= 1
        firsts = trials.emitted[accepted_first, 0]
        x = int(torch.bincount(firsts, minlength=vocab).argmax())  # the most frequently accepted first token
        given_x = accepted_first & (trials.emitted[:, 0] == x)
        assert int(given_x.sum()) >= 1000
        pvalues[f"depth1|first={x}"] = chi2_pvalue(trials.emitted[given_x, 1], case.target[1])
    joint = case.target[0][:, None] * case.target[1][None, :]  # [vocab, vocab]
    pairs = trials.emitted[:, 0] * vocab + trials.second_token
    pvalues["joint01"] = chi2_pvalue(pairs, joint)
    return pvalues


@pytest.mark.parametrize("case", CASES, ids=lambda c: c.name)
def test_emitted_tokens_follow_target(case: ExactnessCase) -> None:
    trials = run_trials(case, verify_chain_stochastic, N_TRIALS, seed=100 + CASES.index(case))
    pvalues = exactness_pvalues(case, trials)
    failing = {name: pv for name, pv in pvalues.items() if pv < ALPHA}
    assert not failing, f"{case.name}: chi-square p-values below {ALPHA}: {failing}"
    if case.name == "disjoint_supports":
        assert bool((trials.num_accepted == 0).all())
    if case.name == "q_equals_p":
        assert bool((trials.num_accepted == case.gamma).all())


def test_case_count_matches_docstring() -> None:
    assert EXPECTED_TESTS == 35


# ---------------------------------------------------------------------------------------------
# Deliberately wrong rules must fail the same tests


def _accept_count(
    target_probs: torch.Tensor, draft_tokens: torch.Tensor, draft_probs: torch.Tensor | None, generator: torch.Generator
) -> torch.Tensor:
    """The (correct) acceptance step both wrong rules below share."""
    positions = torch.arange(draft_tokens.shape[0])
    p_x = target_probs[positions, draft_tokens]
    q_x = torch.ones_like(p_x) if draft_probs is None else draft_probs[positions, draft_tokens]
    accepted = torch.rand(draft_tokens.shape[0], generator=generator, dtype=target_probs.dtype) * q_x < p_x
    return accepted.long().cumprod(0).sum()


def buggy_resample_from_p(
    target_probs: torch.Tensor, draft_tokens: torch.Tensor, draft_probs: torch.Tensor | None, generator: torch.Generator
) -> tuple[torch.Tensor, torch.Tensor]:
    """Wrong: on rejection draws from p instead of norm((p - q)+)."""
    num_accepted = _accept_count(target_probs, draft_tokens, draft_probs, generator)
    return num_accepted, sample(target_probs, generator)[num_accepted]


def buggy_bonus_off_by_one(
    target_probs: torch.Tensor, draft_tokens: torch.Tensor, draft_probs: torch.Tensor | None, generator: torch.Generator
) -> tuple[torch.Tensor, torch.Tensor]:
    """Wrong: after full acceptance the bonus token is drawn from p_{gamma-1} instead of p_gamma."""
    gamma = draft_tokens.shape[0]
    shifted = torch.cat([target_probs[:gamma], target_probs[gamma - 1 : gamma]], dim=0)
    rows = residual_rows(target_probs, draft_tokens, draft_probs)
    rows = torch.cat([rows[:gamma], shifted[gamma:]], dim=0)
    num_accepted = _accept_count(target_probs, draft_tokens, draft_probs, generator)
    return num_accepted, sample(rows, generator)[num_accepted]


def power_case() -> ExactnessCase:
    """Random p, q on 6 symbols with a large total-variation distance, gamma = 1."""
    gen = torch.Generator().manual_seed(555)
    p = normalise(dirichlet(2, 6, gen) ** 2)
    q = normalise(dirichlet(1, 6, gen) ** 2)
    return ExactnessCase("power_random_pq", p, q, "q", deepest=1)


def test_power_case_has_large_tv() -> None:
    case = power_case()
    assert float(total_variation(case.target[0], case.proposal[0])) > 0.4


def test_wrong_rule_resample_from_p_fails() -> None:
    case = power_case()
    n = 20_000
    buggy = exactness_pvalues(case, run_trials(case, buggy_resample_from_p, n, seed=61))
    assert buggy["depth0"] < ALPHA, buggy
    # The correct verifier passes the very same test on the very same case and seeds.
    correct = exactness_pvalues(case, run_trials(case, verify_chain_stochastic, n, seed=61))
    assert min(correct.values()) >= ALPHA, correct


def test_wrong_rule_bonus_off_by_one_fails() -> None:
    case = next(c for c in CASES if c.name == "q_equals_p")
    assert float(total_variation(case.target[-1], case.target[-2])) > 0.2
    buggy = exactness_pvalues(case, run_trials(case, buggy_bonus_off_by_one, 10_000, seed=62))
    assert buggy[f"depth{case.gamma}"] < ALPHA, buggy


# ---------------------------------------------------------------------------------------------
# Seeded determinism and dispatch


def test_same_seed_same_verdicts() -> None:
    case = next(c for c in CASES if c.name == "random_pq")
    runs = [run_trials(case, verify_chain_stochastic, 300, seed=9) for _ in range(2)]
    assert torch.equal(runs[0].num_accepted, runs[1].num_accepted)
    assert torch.equal(runs[0].emitted, runs[1].emitted)
    other = run_trials(case, verify_chain_stochastic, 300, seed=10)
    assert not torch.equal(runs[0].emitted, other.emitted)


def test_verify_chain_same_seed_same_verdict_sequence() -> None:
    gen_cases = torch.Generator().manual_seed(77)
    inputs = [random_bitwise_case(2, gen_cases) for _ in range(100)]

    def verdicts(seed: int) -> list[ChainVerdict]:
        gen = torch.Generator().manual_seed(seed)
        return [verify_chain(torch.log(t), t, x, q, gen) for t, x, q in inputs]

    first, second = verdicts(123), verdicts(123)
    assert first == second
    assert verdicts(124) != first
    for verdict in first:
        assert verdict.next_kind == (TokenKind.BONUS if verdict.num_accepted == 2 else TokenKind.RECOVERED)


def test_verify_chain_stochastic_requires_generator() -> None:
    probs = torch.full((2, 4), 0.25)
    with pytest.raises(ValueError, match="generator"):
        verify_chain(probs.log(), probs, torch.tensor([1]), None, None)


def test_gamma_zero_is_a_bonus_draw_from_p0() -> None:
    p = torch.tensor([[0.1, 0.0, 0.6, 0.3]], dtype=torch.float64)
    gen = torch.Generator().manual_seed(3)
    empty = torch.zeros(0, dtype=torch.int64)
    verdicts = [verify_chain(p.log(), p, empty, None, gen) for _ in range(3000)]
    assert all(v.num_accepted == 0 and v.next_kind == TokenKind.BONUS for v in verdicts)
    assert chi2_pvalue(torch.tensor([v.next_token for v in verdicts]), p[0]) >= ALPHA
