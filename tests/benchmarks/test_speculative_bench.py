"""The benchmark's bookkeeping: pooling stats, the two speedup predictions, the report and plot."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from specserve.benchmarks.prompts import heldout_prompts, load_prompts
from specserve.benchmarks.speculative import (
    BenchConfig,
    MethodResult,
    expected_tokens_per_cycle,
    headline,
    markdown,
    plot,
    predictions,
    summarise,
)
from specserve.core.errors import UserError
from specserve.core.stats import RequestStats


def make_stats(cycles: list[tuple[int, int]], draft_s: float, verify_s: float) -> RequestStats:
    stats = RequestStats()
    for gamma, accepted in cycles:
        stats.record_cycle(gamma, accepted, draft_s, verify_s)
    stats.new_tokens = stats.accepted_tokens + stats.cycles
    stats.total_seconds = stats.draft_seconds + stats.verify_seconds
    return stats


def test_merge_stats_adds_counts_and_positions() -> None:
    total = RequestStats()
    total.merge(make_stats([(2, 2), (2, 0)], 0.1, 0.2))
    total.merge(make_stats([(3, 1)], 0.1, 0.2))
    assert total.cycles == 3 and total.drafted_tokens == 7 and total.accepted_tokens == 3
    assert total.reached == [3, 2, 0] and total.accepted == [2, 1, 0]
    assert total.accepted_length_histogram == {3: 1, 1: 1, 2: 1}


def test_predictions_from_measured_alpha_and_costs() -> None:
    # Position 0 accepted 3 of 4 times, position 1 accepted 1 of 3 times (given position 0 was).
    stats = make_stats([(2, 2), (2, 1), (2, 1), (2, 0)], draft_s=0.01, verify_s=0.03)
    result = MethodResult("specserve/draft", 0.0, 2, new_tokens=stats.new_tokens, seconds=0.16, stats=stats)
    plain_tps = 50.0  # 20 ms per token
    pred = predictions(result, plain_tps, plain_step_seconds=0.02)
    expected_tokens = 1 + 0.75 + 0.75 * (1 / 3)
    assert pred["expected_tokens_per_cycle"] == pytest.approx(expected_tokens)
    assert pred["cycle_seconds"] == pytest.approx(0.04)
    assert pred["predicted_measured"] == pytest.approx(expected_tokens / 0.04 / plain_tps)
    alpha, c, gamma = 4 / 7, (0.04 / 8) / 0.02, 2
    assert pred["alpha_pooled"] == pytest.approx(alpha)
    assert pred["predicted_formula"] == pytest.approx((1 - alpha ** (gamma + 1)) / ((1 - alpha) * (c * gamma + 1)))
    assert result.decode_tokens_per_second is not None
    measured = result.decode_tokens_per_second / plain_tps
    assert pred["measured_over_predicted"] == pytest.approx(measured / pred["predicted_measured"])


def test_prediction_weights_short_drafts() -> None:
    # Half the cycles drafted 2 tokens, half drafted none (no n-gram match).
    stats = make_stats([(2, 2), (0, 0), (2, 1), (0, 0)], draft_s=0.0, verify_s=0.02)
    alpha = [1.0, 0.5]
    assert expected_tokens_per_cycle(alpha, stats.draft_length_histogram) == pytest.approx((1 + 1 + 0.5 + 1) / 2)
    result = MethodResult("specserve/ngram", 0.0, 2, new_tokens=stats.new_tokens, seconds=0.08, stats=stats)
    pred = predictions(result, plain_decode_tps=50.0, plain_step_seconds=0.02)
    assert pred["expected_tokens_per_cycle"] == pytest.approx(1.75)
    assert pred["measured_over_predicted"] == pytest.approx(1.0)  # the model is exact on its own inputs


def test_report_plot_and_headline(tmp_path: Path) -> None:
    plain = MethodResult("specserve/plain", 0.0, None, new_tokens=100, seconds=2.0, stats=make_stats([(0, 0)], 0, 1))
    spec = MethodResult(
        "specserve/draft", 0.0, 2, new_tokens=100, seconds=1.0, stats=make_stats([(2, 2), (2, 1)], 0.01, 0.03)
    )
    hf = MethodResult("hf/assisted", 0.0, 2, new_tokens=100, seconds=1.25)
    hf_plain = MethodResult("hf/generate", 0.0, None, new_tokens=100, seconds=2.5)
    rows = summarise([plain, spec, hf, hf_plain], plain_step=0.02)
    summary = headline(rows, BenchConfig(target="t", draft="d", temperatures=(0.0,)))["T=0"]
    assert summary["best_speedup_over_plain"] == pytest.approx(2.0)
    assert summary["best_over_best_hf_speculative"] == pytest.approx(1.25)
    assert summary["plain_over_hf_generate"] == pytest.approx(1.25)
    assert summary["best_draft_gamma"] == 2
    text = markdown({"rows": rows, "summary": {"T=0": summary}})
    assert "specserve/draft" in text and "| 0 |" in text
    plot(rows, tmp_path / "plot.png")
    assert (tmp_path / "plot.png").stat().st_size > 1000


def test_prompts(tmp_path: Path) -> None:
    prompts = heldout_prompts(3)
    assert len(prompts) == 3 and all(p.endswith("\n") for p in prompts)
    good = tmp_path / "good.json"
    good.write_text(json.dumps(["a", "b"]))
    assert load_prompts(good) == ["a", "b"]
    for bad in ("[]", '[""]', '{"a": 1}', "[1]", "not json"):
        (tmp_path / "bad.json").write_text(bad)
        with pytest.raises(UserError):
            load_prompts(tmp_path / "bad.json")
    with pytest.raises(UserError, match="does not exist"):
        load_prompts(tmp_path / "missing.json")
