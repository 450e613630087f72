"""Formatting shared by the benchmark and experiment reports: one Markdown table cell. Nothing else."""

from __future__ import annotations

from typing import Any


def table_cell(value: Any, digits: int = 2) -> str:
    """A table cell: ``–`` for a missing value, floats to ``digits`` places, anything else as ``str``."""
    if value is None:
        return "–"
    return f"{value:.{digits}f}" if isinstance(value, float) else str(value)
