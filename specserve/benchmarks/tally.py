"""What the benchmark grids share: a cell's running totals over rounds, the alternating round order, saving.

A benchmark cell (one configuration at one temperature) is timed over several rounds whose
order alternates, because machine speed drifts on a shared host; :class:`Tally` pools every
request the cell ran, and :func:`alternating` gives each round's order; :func:`save_report` writes a
report's JSON, Markdown and plot. Does not choose cells or format reports.
"""

from __future__ import annotations

import json
import time
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, TypeVar

from specserve.core.engine import GenerationFrontend
from specserve.core.request import GenerationConfig, GenerationResult
from specserve.core.sampling.params import SamplingParams
from specserve.core.stats import RequestStats

T = TypeVar("T")


@dataclass(kw_only=True)
class Tally:
    new_tokens: int = 0
    seconds: float = 0.0  # end to end, prefill included
    stats: RequestStats = field(default_factory=RequestStats)

    @property
    def tokens_per_second(self) -> float:
        return self.new_tokens / self.seconds if self.seconds else 0.0

    def run_requests(
        self,
        engine: GenerationFrontend,
        prompt_ids: Sequence[list[int]],
        temperature: float,
        config: GenerationConfig,
        seed: int = 0,
    ) -> list[GenerationResult]:
        """Generate every prompt (prompt i with seed ``seed + i``), timing each, and pool the results; the results,
        one per prompt."""
        results = []
        for i, ids in enumerate(prompt_ids):
            params = SamplingParams(temperature=temperature, seed=seed + i)
            start = time.perf_counter()
            out = engine.generate(ids, params, config)
            self.seconds += time.perf_counter() - start
            self.new_tokens += len(out.output_ids)
            self.stats.merge(out.stats)
            results.append(out)
        return results


def alternating(rounds: int, items: Sequence[T]) -> Iterator[T]:
    """Every item once per round, in order on even rounds and reversed on odd ones."""
    for round_index in range(rounds):
        yield from items if round_index % 2 == 0 else items[::-1]


def report_paths(out_dir: Path, stem: str) -> list[Path]:
    """What :func:`save_report` writes: ``stem.json``, ``stem.md`` and ``stem.png`` under ``out_dir``."""
    return [out_dir / f"{stem}{suffix}" for suffix in (".json", ".md", ".png")]


def save_report(out_dir: Path, stem: str, report: dict[str, Any], markdown: str, plot: Callable[[Path], None]) -> None:
    """``stem.json``, ``stem.md`` and ``stem.png`` under ``out_dir`` (:func:`report_paths`)."""
    out_dir.mkdir(parents=True, exist_ok=True)
    json_path, markdown_path, plot_path = report_paths(out_dir, stem)
    json_path.write_text(json.dumps(report, indent=2))
    markdown_path.write_text(markdown)
    plot(plot_path)
