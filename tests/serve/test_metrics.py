"""The replica's queue gauges read 0 while it is idle: on the gauge objects, and at Ray's Prometheus exporter; the
adaptive policy's ceiling moves are counted per drafter.

``ServeMetrics`` sets ``specserve_queue_length`` and ``specserve_running_requests`` when it is
created, so an idle replica exports 0 rather than nothing until its first request.
"""

from __future__ import annotations

import time
from typing import Any

import pytest
import requests
from metric_helpers import record_metrics

from specserve.serve.metrics import ServeMetrics

pytestmark = pytest.mark.timeout(300)


def test_idle_gauges_are_set_to_zero_when_created(monkeypatch: pytest.MonkeyPatch) -> None:
    record_metrics(monkeypatch)
    metrics = ServeMetrics("idle")
    tags = {"model": "idle", "lossy": "false"}
    queue: Any = metrics.queue_length
    running: Any = metrics.running
    assert queue.updates == [(0, tags)] and running.updates == [(0, tags)]


def test_the_ceilings_moves_a_request_saw_are_counted_per_drafter(monkeypatch: pytest.MonkeyPatch) -> None:
    """A finished request's ``stats.policy`` adds its ceiling's moves to ``specserve_policy_events`` (zeros skipped)."""
    record_metrics(monkeypatch)
    metrics = ServeMetrics("moves")
    metrics.policy("ngram", {"policy": "adaptive", "closed": 3, "reopened": 1, "fallbacks": 1, "returns": 0})
    metrics.policy("default", {})  # a fixed-γ request reports nothing
    events: Any = metrics.policy_events
    counted = {(tags["drafter"], tags["event"]): value for value, tags in events.updates if value}
    assert counted == {("ngram", "closed"): 3, ("ngram", "reopened"): 1, ("ngram", "fallback"): 1}


def test_idle_gauges_reach_prometheus_at_zero(ray_cluster: Any) -> None:
    model = "idle-gauges"
    metrics = ServeMetrics(model)  # no request ever: only the values set at creation
    port = ray_cluster.nodes()[0]["MetricsExportPort"]
    names = {"ray_specserve_queue_length", "ray_specserve_running_requests"}
    seen: dict[str, float] = {}
    deadline = time.monotonic() + 60
    while set(seen) != names and time.monotonic() < deadline:
        for line in requests.get(f"http://127.0.0.1:{port}/metrics", timeout=30).text.splitlines():
            name = line.split("{", 1)[0]
            if name in names and f'model="{model}"' in line:
                seen[name] = float(line.rsplit(" ", 1)[1])
        time.sleep(0.5)
    assert seen == dict.fromkeys(names, 0.0), f"exported: {seen}"
    del metrics
