"""The drift monitor: its change-point test's false-alarm rate and detection delay on Bernoulli streams, and what it
makes of cycles (acceptance by position, budgets, the measured speedup).

Seeded streams, so the counts below are facts of these streams, not flaky estimates. 300 steady runs of 5,000
outcomes with no alarm bound the false-alarm rate per 5,000 outcomes below 1 % at 95 % confidence (the rule of
three: 3 / 300).
"""

from __future__ import annotations

import random
import statistics

import pytest

from specserve.core.schedule import Budget, CycleObservation
from specserve.policies.drift import WARMUP, BernoulliCusum, DriftMonitor


def steady_alarms(p: float, runs: int, length: int) -> int:
    alarms = 0
    for run in range(runs):
        stream = random.Random(run * 7 + int(p * 10))
        test = BernoulliCusum()
        alarms += any(test.update(stream.random() < p) for _ in range(length))
    return alarms


@pytest.mark.parametrize("p", [0.3, 0.6, 0.9])
def test_a_steady_stream_raises_no_event(p: float) -> None:
    assert steady_alarms(p, runs=100, length=5000) == 0


def delays(before: float, after: float, runs: int = 100) -> list[int]:
    out = []
    for run in range(runs):
        stream = random.Random(1000 + run)
        test = BernoulliCusum()
        for _ in range(1000):  # false alarms are the steady test's business: here only the delay after a change
            test.update(stream.random() < before)
        for i in range(3000):
            direction = test.update(stream.random() < after)
            if direction is not None:
                assert direction == ("down" if after < before else "up")
                out.append(i + 1)
                break
        else:
            out.append(10**9)
    return out


def test_a_fall_is_caught_within_a_stated_number_of_outcomes() -> None:
    fall = delays(0.7, 0.3)
    assert statistics.median(fall) <= 60 and max(fall) <= 150
    collapse = delays(0.6, 0.01)  # a drafter replaced by a random one
    assert statistics.median(collapse) <= 40 and max(collapse) <= 60
    rise = delays(0.3, 0.7)
    assert max(rise) <= 150


def cycle(accepted: int, gamma: int = 4, seconds: float = 0.01, batch: int = 1) -> CycleObservation:
    return CycleObservation(
        budget=Budget(gamma), drafted=gamma, depth=gamma, accepted=accepted, draft_seconds=seconds / 4,
        verify_seconds=seconds, batch_size=batch,
    )  # fmt: skip


def test_the_monitor_reports_rates_budgets_speedup_and_events() -> None:
    monitor = DriftMonitor()
    stream = random.Random(0)
    good = [cycle(min(4, sum(stream.random() < 0.8 for _ in range(1)) * 4)) for _ in range(WARMUP + 50)]
    assert monitor.observe("eagle", good) == []
    view = monitor.view("eagle")
    assert view.rates[0] is not None and view.rates[0] > 0.6 and view.budget == pytest.approx(4.0)
    # plain steps of 0.008 s: 5 tokens per 0.0125 s at full acceptance, against 1 per 0.008 s
    monitor.observe("none", [cycle(0, gamma=0, seconds=0.008) for _ in range(20)])
    assert monitor.drafters == ["eagle"]
    speedup = monitor.view("eagle").speedup
    assert speedup is not None and 1.5 < speedup < 3.5
    events = monitor.observe("eagle", [cycle(0) for _ in range(60)])  # the drafter stops being accepted
    assert [(e.drafter, e.position, e.direction) for e in events] == [("eagle", 0, "down")]
    assert events[0].reference > 0.6 and events[0].rate < events[0].reference
    assert monitor.view("eagle").speedup < speedup  # type: ignore[operator]
    assert monitor.view("unknown").speedup is None
