"""Shared by the benchmark and experiment reports: one Markdown table cell, and writing a report's two files (its
rows as JSON with the command that made them, its Markdown). Nothing else."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any


def table_cell(value: Any, digits: int = 2) -> str:
    """A table cell: ``–`` for a missing value, floats to ``digits`` places, anything else as ``str``."""
    if value is None:
        return "–"
    return f"{value:.{digits}f}" if isinstance(value, float) else str(value)


def write_report(out: Path, name: str, command: str, rows: list[dict[str, Any]], lines: list[str]) -> None:
    """``out/name.json`` (the command and the rows) and ``out/name.md`` (``lines``); prints the Markdown."""
    out.mkdir(parents=True, exist_ok=True)
    (out / f"{name}.json").write_text(json.dumps({"command": command, "rows": rows}, indent=1) + "\n")
    (out / f"{name}.md").write_text("\n".join(lines) + "\n")
    print("\n".join(lines))
