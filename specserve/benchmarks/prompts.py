"""Benchmark prompts: the opening of held-out standard-library files, or the user's own JSON list.

The held-out openings come from :func:`specserve.training.corpus.heldout_prompts` (re-exported here so
every benchmark takes its prompts from this one module); the training acceptance reports use the same
function. This module reads prompt files and validates them; it does not tokenise.
"""

from __future__ import annotations

import json
from pathlib import Path

from specserve.core.errors import UserError
from specserve.training.corpus import heldout_prompts

__all__ = ["heldout_prompts", "load_prompts"]


def load_prompts(path: str | Path) -> list[str]:
    file = Path(path)
    if not file.is_file():
        raise UserError(f"prompts file {file} does not exist")
    try:
        data = json.loads(file.read_text(encoding="utf-8"))
    except json.JSONDecodeError as exc:
        raise UserError(f"prompts file {file} is not valid JSON: {exc}") from exc
    if not isinstance(data, list) or not data or not all(isinstance(p, str) and p for p in data):
        raise UserError(f"prompts file {file} must hold a non-empty JSON list of non-empty strings")
    return data
