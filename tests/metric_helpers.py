"""A stand-in for Ray's metric classes that records every update, for tests of what specserve exports."""

from __future__ import annotations

from typing import Any

import pytest


class FakeMetric:
    """Records (value, tags) of every update instead of exporting it."""

    def __init__(self, name: str, *args: Any, **kwargs: Any) -> None:
        self.name = name
        self.updates: list[tuple[float, dict[str, str]]] = []

    def inc(self, value: float, tags: dict[str, str]) -> None:
        self.updates.append((value, tags))

    observe = set = inc


def record_metrics(monkeypatch: pytest.MonkeyPatch) -> None:
    """Ray's Counter, Gauge and Histogram become :class:`FakeMetric` for the test."""
    import ray.util.metrics

    for name in ("Counter", "Gauge", "Histogram"):
        monkeypatch.setattr(ray.util.metrics, name, FakeMetric)
