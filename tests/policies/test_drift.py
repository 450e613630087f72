"""The drift monitor: its change-point test's false-alarm rate and detection delay on simulated traffic, and what it
makes of cycles (acceptance by position, budgets, the measured speedup).

Simulated traffic: each request's prompt has its own acceptance rate, drawn from a Beta law around the drafter's
mean (concentration 8: prompts differ a lot, as they do), and reaches the position 20 times (binomial outcomes).
Seeded, so the counts below are facts of these streams, not flaky estimates: 300 steady runs of 500 requests with
no alarm bound the false-alarm rate per 500 requests below 1 % at 95 % confidence (the rule of three: 3 / 300).
"""

from __future__ import annotations

import random
import statistics

import pytest

from specserve.core.draft.schedule import Budget, CycleObservation
from specserve.policies.drift import MIN_REACHED, WARMUP, DriftMonitor, RequestCusum


def request_rate(stream: random.Random, mean: float, reached: int = 20, concentration: float = 8.0) -> float:
    alpha = stream.betavariate(mean * concentration, (1 - mean) * concentration)
    return sum(stream.random() < alpha for _ in range(reached)) / reached


@pytest.mark.parametrize("mean", [0.3, 0.6, 0.9])
def test_steady_traffic_raises_no_event(mean: float) -> None:
    alarms = 0
    for run in range(100):
        stream = random.Random(run * 13 + int(mean * 100))
        test = RequestCusum()
        alarms += any(test.update(request_rate(stream, mean)) for _ in range(500))
    assert alarms == 0


def delays(before: float, after: float, runs: int = 100) -> list[int]:
    """Requests from a change of the drafter's mean acceptance to the event."""
    out = []
    for run in range(runs):
        stream = random.Random(5000 + run)
        test = RequestCusum()
        for _ in range(200):
            test.update(request_rate(stream, before))
        for i in range(2000):
            direction = test.update(request_rate(stream, after))
            if direction is not None:
                assert direction == ("down" if after < before else "up")
                out.append(i + 1)
                break
        else:
            out.append(10**9)
    return out


def test_a_change_is_caught_within_a_stated_number_of_requests() -> None:
    fall = delays(0.7, 0.3)
    assert statistics.median(fall) <= 10 and max(fall) <= 20
    collapse = delays(0.6, 0.01)  # a drafter replaced by a random one
    assert max(collapse) <= 10
    small = delays(0.8, 0.6)
    assert statistics.median(small) <= 25 and max(small) <= 70
    rise = delays(0.3, 0.7)
    assert max(rise) <= 20


def cycle(accepted: int, gamma: int = 4, seconds: float = 0.01, batch: int = 1) -> CycleObservation:
    return CycleObservation(
        budget=Budget(gamma), drafted=gamma, depth=gamma, accepted=accepted, draft_seconds=seconds / 4,
        verify_seconds=seconds, batch_size=batch,
    )  # fmt: skip


def test_the_monitor_reports_rates_budgets_speedup_and_events() -> None:
    monitor = DriftMonitor()
    stream = random.Random(0)
    for _ in range(WARMUP + 20):  # requests of 10 cycles, each accepting its whole block with probability 0.8
        assert monitor.observe("eagle", [cycle(4 if stream.random() < 0.8 else 0) for _ in range(10)]) == []
    view = monitor.view("eagle")
    assert view.rates[0] is not None and view.rates[0] > 0.6 and view.budget == pytest.approx(4.0)
    assert view.tokens_per_cycle == pytest.approx(0.8 * 5 + 0.2 * 1, abs=0.3)  # smoothed over ~580 cycles: sd 0.07
    # plain steps of 0.008 s: about 4.2 tokens per 0.0125 s, against 1 per 0.008 s
    monitor.observe("none", [cycle(0, gamma=0, seconds=0.008) for _ in range(20)])
    assert monitor.drafters == ["eagle"]
    speedup = monitor.view("eagle").speedup
    assert speedup is not None and 1.5 < speedup < 3.5
    cycles = monitor.cycles("eagle")
    events = []
    for _ in range(10):  # the drafter stops being accepted
        events += monitor.observe("eagle", [cycle(0) for _ in range(10)])
    assert [(e.drafter, e.position, e.direction) for e in events] == [("eagle", 0, "down")]
    assert events[0].reference > 0.6 and events[0].rate < events[0].reference
    assert events[0].cycles - cycles <= 100
    assert monitor.view("eagle").speedup < speedup  # type: ignore[operator]
    assert monitor.view("eagle").tokens_per_cycle < view.tokens_per_cycle  # type: ignore[operator]
    assert monitor.view("unknown").speedup is None
    # a request that reached a position fewer than MIN_REACHED times is not tested there
    assert monitor.observe("short", [cycle(0)] * (MIN_REACHED - 1)) == []
