"""The training corpus: the Python standard library sources of the running interpreter.

Files are split into ``train`` and ``heldout`` by a stable hash of their path relative to the
standard-library root, so the split is the same on every machine and every run. Test suites
(``test/``, ``tests/``, ``idle_test/``) and ``site-packages`` are left out: they hold large
data literals that teach a model little about code.

:func:`heldout_prompts` cuts the openings of large held-out files into the prompts that the
acceptance reports of :mod:`specserve.training` and the benchmarks of :mod:`specserve.benchmarks`
share (it lives here because the benchmarks may import training, never the other way round).

This module only finds and reads text; tokenisation and batching live elsewhere.
"""

from __future__ import annotations

import hashlib
import sysconfig
from dataclasses import dataclass
from pathlib import Path
from typing import Literal

Split = Literal["train", "heldout"]

HELDOUT_PERCENT = 5
PROMPT_CHARS = 1000
MIN_FILE_CHARS = 2000
_EXCLUDED_PARTS = frozenset({"site-packages", "test", "tests", "idle_test", "__pycache__"})


@dataclass(frozen=True)
class SourceFile:
    relpath: str
    text: str


def stdlib_root() -> Path:
    return Path(sysconfig.get_paths()["stdlib"])


def split_of(relpath: str) -> Split:
    """Stable train/held-out assignment: about ``HELDOUT_PERCENT``% of files are held out."""
    digest = hashlib.sha256(relpath.encode("utf-8")).digest()
    return "heldout" if int.from_bytes(digest[:4], "big") % 100 < HELDOUT_PERCENT else "train"


def load_corpus(split: Split, root: Path | None = None) -> list[SourceFile]:
    """All standard-library ``.py`` files of ``split``, sorted by path (deterministic order)."""
    root = root or stdlib_root()
    files: list[SourceFile] = []
    for path in sorted(root.rglob("*.py")):
        rel = path.relative_to(root)
        if _EXCLUDED_PARTS.intersection(rel.parts) or split_of(rel.as_posix()) != split:
            continue
        try:
            text = path.read_text(encoding="utf-8")
        except (UnicodeDecodeError, OSError):
            continue
        if text.strip():
            files.append(SourceFile(rel.as_posix(), text))
    if not files:
        raise RuntimeError(f"no Python sources found under {root} for split {split!r}")
    return files


def heldout_prompts(count: int) -> list[str]:
    """The first ~1000 characters (cut at a line end) of the first ``count`` large held-out files."""
    prompts = []
    for source in load_corpus("heldout"):
        if len(source.text) < MIN_FILE_CHARS:
            continue
        head = source.text[:PROMPT_CHARS]
        prompts.append(head[: head.rfind("\n") + 1] or head)
        if len(prompts) == count:
            break
    return prompts
