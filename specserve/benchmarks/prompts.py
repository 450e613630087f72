"""Benchmark prompts: the opening of held-out standard-library files, or the user's own JSON list."""

from __future__ import annotations

import json
from pathlib import Path

from specserve.core.errors import UserError
from specserve.training import corpus

PROMPT_CHARS = 1000
MIN_FILE_CHARS = 2000


def heldout_prompts(count: int) -> list[str]:
    """The first ~1000 characters (cut at a line end) of the first ``count`` large held-out files."""
    prompts = []
    for source in corpus.load_corpus("heldout"):
        if len(source.text) < MIN_FILE_CHARS:
            continue
        head = source.text[:PROMPT_CHARS]
        prompts.append(head[: head.rfind("\n") + 1] or head)
        if len(prompts) == count:
            break
    return prompts


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
