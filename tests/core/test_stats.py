"""Tests of RequestStats: conditional acceptance by position, mean accepted length, histogram."""

from __future__ import annotations

import json

import pytest

from specserve.core.stats import RequestStats


def test_empty_stats() -> None:
    stats = RequestStats()
    assert stats.acceptance_by_position == []
    assert stats.acceptance_rate is None
    assert stats.mean_accepted == 0.0
    assert stats.tokens_per_second == 0.0
    json.dumps(stats.to_dict())


def test_acceptance_by_position_is_conditional_on_reaching_it() -> None:
    stats = RequestStats()
    stats.record_cycle(gamma=4, num_accepted=2, draft_seconds=0.1, verify_seconds=0.2)  # reaches 0,1,2
    stats.record_cycle(gamma=4, num_accepted=4, draft_seconds=0.1, verify_seconds=0.2)  # reaches 0..3
    stats.record_cycle(gamma=4, num_accepted=0, draft_seconds=0.1, verify_seconds=0.2)  # reaches 0
    stats.record_cycle(gamma=2, num_accepted=1, draft_seconds=0.1, verify_seconds=0.2)  # reaches 0,1
    assert stats.reached == [4, 3, 2, 1]
    assert stats.accepted == [3, 2, 1, 1]
    assert stats.acceptance_by_position == [pytest.approx(3 / 4), pytest.approx(2 / 3), 0.5, 1.0]
    assert stats.cycles == 4
    assert stats.drafted_tokens == 14
    assert stats.accepted_tokens == 7
    assert stats.acceptance_rate == pytest.approx(7 / 14)
    assert stats.draft_seconds == pytest.approx(0.4)
    assert stats.verify_seconds == pytest.approx(0.8)


def test_mean_accepted_counts_the_bonus_or_recovered_token() -> None:
    stats = RequestStats()
    stats.record_cycle(gamma=3, num_accepted=3, draft_seconds=0, verify_seconds=0)  # 3 + bonus = 4
    stats.record_cycle(gamma=3, num_accepted=0, draft_seconds=0, verify_seconds=0)  # recovered = 1
    stats.record_cycle(gamma=3, num_accepted=1, draft_seconds=0, verify_seconds=0)  # 1 + recovered = 2
    assert stats.mean_accepted == pytest.approx((4 + 1 + 2) / 3)
    assert stats.accepted_length_histogram == {4: 1, 1: 1, 2: 1}


def test_plain_decoding_has_mean_accepted_one() -> None:
    stats = RequestStats()
    for _ in range(5):
        stats.record_cycle(gamma=0, num_accepted=0, draft_seconds=0, verify_seconds=0)
    assert stats.mean_accepted == 1.0
    assert stats.acceptance_rate is None
    assert stats.acceptance_by_position == []
    assert stats.accepted_length_histogram == {1: 5}


def test_positions_never_reached_are_none() -> None:
    stats = RequestStats()
    stats.record_cycle(gamma=3, num_accepted=0, draft_seconds=0, verify_seconds=0)
    assert stats.acceptance_by_position == [0.0, None, None]


def test_to_dict_is_json_ready() -> None:
    stats = RequestStats()
    stats.record_cycle(gamma=2, num_accepted=1, draft_seconds=0.5, verify_seconds=0.25)
    stats.new_tokens = 2
    stats.total_seconds = 1.0
    data = json.loads(json.dumps(stats.to_dict()))
    assert data["cycles"] == 1
    assert data["new_tokens"] == 2
    assert data["acceptance_by_position"] == [1.0, 0.0]
    assert data["reached_by_position"] == [1, 1]
    assert data["accepted_length_histogram"] == {"2": 1}
    assert data["mean_accepted"] == 2.0
    assert data["tokens_per_second"] == 2.0
