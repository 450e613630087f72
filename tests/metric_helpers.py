"""A stand-in for Ray's metric classes that records every update, for tests of what specserve exports; and a wait for
what Ray's Prometheus exporter shows."""

from __future__ import annotations

import time
from collections.abc import Callable
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


def wait_until_exported(
    port: int, names: set[str], model: str, timeout_s: float = 60.0, also: Callable[[str], bool] = lambda line: True
) -> None:
    """Until Ray's Prometheus exporter on ``port`` has a line of every metric in ``names`` tagged ``model`` (and, for
    which ``also`` holds); fails naming the missing ones."""
    import requests

    seen: set[str] = set()
    deadline = time.monotonic() + timeout_s
    while seen != names:
        for line in requests.get(f"http://127.0.0.1:{port}/metrics", timeout=30).text.splitlines():
            name = line.split("{", 1)[0]
            if name in names and f'model="{model}"' in line and also(line):
                seen.add(name)
        if seen != names:
            assert time.monotonic() < deadline, f"not exported after {timeout_s:.0f}s: {sorted(names - seen)}"
            time.sleep(0.1)
