"""Tests of the sampling warps, categorical draws, parameter validation and per-request generators.

Statistical tests are chi-square goodness-of-fit tests at significance ALPHA = 1e-4 each: for a
correct implementation a random seed would make any one of them fail with probability 1e-4, and
this module runs 4 of them, so its false-failure probability is below 4e-4 (union bound). All
seeds are fixed, so the outcome is deterministic.
"""

from __future__ import annotations

import math

import pytest
import torch
from stats_helpers import chi2_pvalue
from transformers.generation.logits_process import TemperatureLogitsWarper, TopKLogitsWarper, TopPLogitsWarper

from specserve.core.sampling.params import GREEDY_BELOW, MAX_TOP_K, InvalidSamplingParams, SamplingParams
from specserve.core.sampling.warps import make_generators, sample, warp_probs

ALPHA = 1e-4  # per-test significance of every chi-square test in this module


# ---------------------------------------------------------------------------------------------
# warp_probs


def transformers_probs(logits: torch.Tensor, temperature: float, top_k: int, top_p: float) -> torch.Tensor:
    """The distribution transformers samples from: temperature, top-k, top-p warpers in that order, then softmax.

    Warpers are added under the same conditions as ``GenerationMixin._get_logits_processor``.
    """
    scores = logits
    if temperature != 1.0:
        scores = TemperatureLogitsWarper(temperature)(None, scores)
    if top_k != 0:
        scores = TopKLogitsWarper(top_k)(None, scores)
    if top_p < 1.0:
        scores = TopPLogitsWarper(top_p)(None, scores)
    return scores.softmax(-1)


WARP_COMBOS = [
    (1.0, 0, 1.0),
    (0.7, 0, 1.0),
    (1.8, 0, 1.0),
    (1.0, 5, 1.0),
    (1.0, 1, 1.0),
    (1.0, 0, 0.9),
    (1.0, 0, 0.01),  # only the top token survives
    (0.5, 10, 0.8),
    (2.0, 3, 0.5),
    (1.3, 40, 0.95),
    (1.0, 100, 1.0),  # top_k >= vocab is a no-op
    (0.9, 100, 0.7),
]


@pytest.mark.parametrize("temperature,top_k,top_p", WARP_COMBOS)
@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
@pytest.mark.parametrize("ties", [False, True], ids=["distinct", "ties"])
def test_warp_probs_matches_transformers(
    temperature: float, top_k: int, top_p: float, dtype: torch.dtype, ties: bool
) -> None:
    gen = torch.Generator().manual_seed(1234)
    logits = torch.randn(16, 50, generator=gen, dtype=dtype) * 3.0
    if ties:  # integer-valued logits: many exact ties at the top-k / top-p boundaries
        logits = logits.round()
    params = SamplingParams(temperature=temperature, top_k=top_k, top_p=top_p)
    ours = warp_probs(logits, params)
    ref = transformers_probs(logits, temperature, top_k, top_p)
    assert ours.dtype == dtype
    assert ours.shape == logits.shape
    assert torch.equal(ours == 0, ref == 0), "different supports after truncation"
    torch.testing.assert_close(ours, ref, rtol=1e-6, atol=1e-9)
    torch.testing.assert_close(ours.sum(-1), torch.ones(16, dtype=dtype))


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
def test_warp_probs_half_precision_upcasts(dtype: torch.dtype) -> None:
    gen = torch.Generator().manual_seed(7)
    logits = (torch.randn(4, 30, generator=gen) * 2).to(dtype)
    params = SamplingParams(temperature=0.8, top_k=12, top_p=0.9)
    ours = warp_probs(logits, params)
    assert ours.dtype == torch.float32
    ref = transformers_probs(logits.float(), 0.8, 12, 0.9)
    assert torch.equal(ours == 0, ref == 0)
    torch.testing.assert_close(ours, ref, rtol=1e-6, atol=1e-9)


def test_warp_probs_batched_leading_dims() -> None:
    gen = torch.Generator().manual_seed(3)
    logits = torch.randn(2, 3, 5, 20, generator=gen)
    params = SamplingParams(temperature=1.1, top_k=7, top_p=0.85)
    ours = warp_probs(logits, params)
    ref = transformers_probs(logits.reshape(-1, 20), 1.1, 7, 0.85).reshape(2, 3, 5, 20)
    assert ours.shape == logits.shape
    torch.testing.assert_close(ours, ref, rtol=1e-6, atol=1e-9)


def test_warp_probs_greedy_is_one_hot_on_argmax_lowest_id() -> None:
    logits = torch.tensor(
        [
            [0.1, 2.0, -1.0, 0.5],
            [3.0, 3.0, 1.0, 3.0],  # three-way tie -> 0
            [-5.0, 1.0, 1.0, 0.0],  # tie between 1 and 2 -> 1
            [float("-inf"), float("-inf"), 4.0, 4.0],  # tie after masked entries -> 2
            [-2.0, -3.0, -1.0, -1.5],
        ]
    )
    expected = torch.tensor([1, 0, 1, 2, 2])
    for params in (SamplingParams(), SamplingParams(temperature=0.0, top_k=2, top_p=0.3)):
        assert params.greedy
        probs = warp_probs(logits, params)
        assert probs.dtype == logits.dtype
        assert torch.equal(probs, torch.nn.functional.one_hot(expected, 4).float())


def test_warp_probs_greedy_batched() -> None:
    gen = torch.Generator().manual_seed(11)
    logits = torch.randint(0, 3, (3, 4, 9), generator=gen).double()  # many ties
    probs = warp_probs(logits, SamplingParams(temperature=0.0))
    assert probs.shape == logits.shape and probs.dtype == torch.float64
    for row, prob in zip(logits.reshape(-1, 9).tolist(), probs.reshape(-1, 9), strict=True):
        first_max = row.index(max(row))
        assert prob[first_max] == 1.0 and prob.sum() == 1.0


# ---------------------------------------------------------------------------------------------
# sample


def test_sample_matches_weights_chi_square() -> None:
    weights = torch.tensor([0.1, 0.0, 0.25, 0.05, 0.0, 0.4, 0.2, 0.0], dtype=torch.float64)
    n = 60_000
    gen = torch.Generator().manual_seed(2024)
    draws = sample(weights.expand(n, -1), gen)
    assert draws.shape == (n,) and draws.dtype == torch.int64
    # chi2_pvalue asserts the zero-weight entries 1, 4 and 7 are never drawn.
    assert chi2_pvalue(draws, weights) >= ALPHA


def test_sample_unnormalised_weights_chi_square() -> None:
    weights = torch.tensor([3.0, 0.0, 7.5, 1.0, 12.0, 0.0], dtype=torch.float32)  # sums to 23.5
    n = 60_000
    gen = torch.Generator().manual_seed(99)
    draws = sample(weights.expand(n, -1), gen)
    assert chi2_pvalue(draws, weights) >= ALPHA


def test_sample_rows_are_independent_laws() -> None:
    rows = torch.tensor([[0.7, 0.0, 0.3, 0.0], [0.0, 0.25, 0.25, 0.5]], dtype=torch.float64)
    n = 30_000
    gen = torch.Generator().manual_seed(5)
    draws = sample(rows.expand(n, -1, -1), gen)  # [n, 2]
    assert draws.shape == (n, 2)
    for j in range(2):
        assert chi2_pvalue(draws[:, j], rows[j]) >= ALPHA


def test_sample_never_draws_zero_weight_even_against_tiny_weight() -> None:
    weights = torch.zeros(1000, dtype=torch.float32)
    weights[617] = 1e-30
    gen = torch.Generator().manual_seed(0)
    draws = sample(weights.expand(2000, -1), gen)
    assert bool((draws == 617).all())


def test_sample_uses_only_its_generator() -> None:
    weights = torch.full((200, 10), 0.1)
    global_state = torch.random.get_rng_state()
    a = sample(weights, torch.Generator().manual_seed(42))
    b = sample(weights, torch.Generator().manual_seed(42))
    c = sample(weights, torch.Generator().manual_seed(43))
    assert torch.equal(torch.random.get_rng_state(), global_state)
    assert torch.equal(a, b)
    assert not torch.equal(a, c)


# ---------------------------------------------------------------------------------------------
# SamplingParams


@pytest.mark.parametrize(
    "field,value",
    [
        ("temperature", -0.1),
        ("temperature", -1e-12),
        ("temperature", float("nan")),
        ("temperature", float("inf")),
        ("temperature", float("-inf")),
        ("top_p", 0.0),
        ("top_p", -0.5),
        ("top_p", 1.0 + 1e-9),
        ("top_p", 2.0),
        ("top_p", float("nan")),
        ("top_p", float("inf")),
        ("top_k", -1),
        ("top_k", MAX_TOP_K + 1),
        ("seed", -1),
        ("seed", 2**63),
    ],
)
def test_sampling_params_rejects_bad_values(field: str, value: float) -> None:
    with pytest.raises(InvalidSamplingParams, match=field) as info:
        SamplingParams(**{field: value})
    assert isinstance(info.value, ValueError)


@pytest.mark.parametrize(
    "kwargs",
    [
        {},
        {"temperature": 0.0, "top_k": 0, "top_p": 1.0},
        {"temperature": 1e-6},
        {"temperature": 100.0, "top_k": 1, "top_p": 1e-9},
        {"top_k": MAX_TOP_K},
        {"seed": 2**63 - 1},
    ],
)
def test_sampling_params_accepts_boundary_values(kwargs: dict[str, float]) -> None:
    params = SamplingParams(**kwargs)
    assert params.greedy == (params.temperature == 0.0)


def test_sampling_params_defaults_are_greedy() -> None:
    params = SamplingParams()
    assert params.greedy and params.top_k == 0 and params.top_p == 1.0 and params.seed == 0
    assert not SamplingParams(temperature=0.5).greedy
    assert not math.isnan(params.temperature)


# ---------------------------------------------------------------------------------------------
# make_generators


def draws(gen: torch.Generator, n: int = 64) -> torch.Tensor:
    return torch.rand(n, generator=gen)


@pytest.mark.parametrize("seed", [0, 1, 12345, 2**62 + 7, 2**63 - 1])
def test_make_generators_deterministic_and_streams_differ(seed: int) -> None:
    a, b = make_generators(seed), make_generators(seed)
    va, da = draws(a.verify), draws(a.draft)
    vb, db = draws(b.verify), draws(b.draft)
    assert torch.equal(va, vb), "verify stream not reproducible"
    assert torch.equal(da, db), "draft stream not reproducible"
    assert not torch.equal(va, da), "verify and draft streams coincide"
    assert a.verify is not a.draft


def test_make_generators_seeds_differ() -> None:
    first = [draws(make_generators(seed).verify) for seed in range(5)]
    for i in range(5):
        for j in range(i + 1, 5):
            assert not torch.equal(first[i], first[j])


def test_make_generators_leave_global_rng_alone() -> None:
    state = torch.random.get_rng_state()
    gens = make_generators(77)
    draws(gens.verify)
    draws(gens.draft)
    assert torch.equal(torch.random.get_rng_state(), state)


@pytest.mark.parametrize("temperature", [5e-324, 1e-300, 1e-36, GREEDY_BELOW / 2])
def test_a_temperature_below_the_floor_is_greedy(temperature: float) -> None:
    """Dividing logits by such a temperature overflows (NaN probabilities); it is greedy instead, as in vLLM."""
    params = SamplingParams(temperature=temperature)
    assert params.temperature == 0.0 and params.greedy and params.mode == "greedy"
    assert not SamplingParams(temperature=GREEDY_BELOW).greedy
