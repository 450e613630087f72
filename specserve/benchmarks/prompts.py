"""Benchmark prompts: the opening of held-out standard-library files, or the user's own JSON list; and the workloads
built from them.

The held-out openings come from :func:`specserve.training.corpus.heldout_prompts` (re-exported here so
every benchmark takes its prompts from this one module); the training acceptance reports use the same
function. Two workloads whose outputs repeat earlier text are built here from the same sources:

* **repetitive** (:func:`repetitive_prompts`): an excerpt of a held-out file (from its first top-level
  function, else class) followed by ``# The same code, with NAME renamed to new_NAME:`` — the output
  repeats the input, edited (an editing request);
* **prose** (:func:`prose_prompts`): a held-out file's opening cut halfway through its module docstring,
  so the continuation is English prose (the nearest to chat text the shipped code model has seen);
* **multi-turn** (:func:`multiturn_prompts`): conversations of :data:`MULTITURN_TURNS` turns; turn k's
  prompt is turn k − 1's prompt, its output and a follow-up asking for the code above again (once
  unchanged, then with a name renamed), so later requests repeat earlier outputs.

This module reads prompt files and validates them, and builds text; it does not tokenise or generate
(the multi-turn outputs come from a ``respond`` callable).
"""

from __future__ import annotations

import ast
import builtins
import io
import json
import keyword
import re
import tokenize
from collections import Counter
from collections.abc import Callable, Sequence
from pathlib import Path

from specserve.core.errors import UserError
from specserve.training.corpus import MIN_FILE_CHARS, PROMPT_CHARS, heldout_prompts, load_corpus

__all__ = [
    "MULTITURN_TURNS",
    "heldout_files",
    "heldout_prompts",
    "load_prompts",
    "multiturn_prompts",
    "prose_prompts",
    "repetitive_prompts",
]

RENAME_REQUEST = "\n# The same code, with {old} renamed to {new}:\n"
FOLLOW_UPS = (  # turn 2, turn 3, ... (cycled)
    "\n# The code above once more, unchanged:\n",
    "\n# The code above again, with {old} renamed to {new}:\n",
)
MULTITURN_TURNS = 3  # turns per conversation
_DEFINITIONS = (re.compile(r"^(?:async )?def ", re.MULTILINE), re.compile(r"^class ", re.MULTILINE))
_NOT_RENAMED = frozenset({"self", "cls"})
MIN_PROSE_CHARS = 400  # a module docstring shorter than this leaves too little prose to continue


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


def heldout_files(count: int) -> list[str]:
    """The whole text of the first ``count`` large held-out files (those :func:`heldout_prompts` opens)."""
    texts = [source.text for source in load_corpus("heldout") if len(source.text) >= MIN_FILE_CHARS]
    return texts[:count]


def prose_prompts(count: int) -> list[str]:
    """Up to ``count`` prose prompts: the opening of each held-out file with a module docstring of at least
    :data:`MIN_PROSE_CHARS` characters, up to about halfway through the docstring (at a line end, within
    ``PROMPT_CHARS``), in corpus order. Files Python cannot parse are passed over."""
    prompts = []
    for source in load_corpus("heldout"):
        try:
            body = ast.parse(source.text).body
        except (SyntaxError, ValueError):
            continue
        first = body[0] if body else None
        if not (
            isinstance(first, ast.Expr)
            and isinstance(first.value, ast.Constant)
            and isinstance(first.value.value, str)
            and len(first.value.value) >= MIN_PROSE_CHARS
        ):
            continue
        lines = source.text.splitlines(keepends=True)
        start = sum(len(line) for line in lines[: first.lineno - 1]) + first.col_offset
        end = sum(len(line) for line in lines[: first.end_lineno or first.lineno])
        head = source.text[: min(start + (end - start) // 2, PROMPT_CHARS)]
        cut = head.rfind("\n", start) + 1
        prompts.append(head[:cut] if cut > start else head)
        if len(prompts) == count:
            break
    return prompts


def excerpt(source: str, max_chars: int = PROMPT_CHARS) -> str:
    """Up to ``max_chars`` of ``source`` from its first top-level function (else class; else from the start) that
    leaves at least half of that (half of a shorter source), cut at a line end when it is cut at all."""
    starts = [found.start() for pattern in _DEFINITIONS if (found := pattern.search(source))]
    start = next((i for i in starts if len(source) - i >= min(max_chars, len(source)) // 2), 0)
    text = source[start:]
    if len(text) <= max_chars:
        return text
    head = text[:max_chars]
    return head[: head.rfind("\n") + 1] or head


def renamed_identifier(text: str) -> tuple[str, str]:
    """The name to rename in ``text`` and its new name: the most frequent name in its code (Python's tokenizer:
    not in strings or comments) of 3 or more characters that is not a keyword, a builtin, ``self`` or ``cls`` (the
    first seen on a tie), and ``new_`` + it; ``("x", "new_x")`` when there is none."""
    names = Counter(
        name
        for name in _code_names(text)
        if len(name) >= 3 and not keyword.iskeyword(name) and name not in _NOT_RENAMED and not hasattr(builtins, name)
    )
    old = max(names, key=names.__getitem__) if names else "x"  # Counter keeps first-seen order: ties go first
    return old, f"new_{old}"


def _code_names(text: str) -> list[str]:
    """The NAME tokens of ``text``, up to where Python's tokenizer gives up (an excerpt may end inside a string)."""
    names: list[str] = []
    try:
        for token in tokenize.generate_tokens(io.StringIO(text).readline):
            if token.type == tokenize.NAME:
                names.append(token.string)
    except (tokenize.TokenError, SyntaxError):  # IndentationError is a SyntaxError
        pass
    return names


def repetitive_prompts(sources: Sequence[str]) -> list[str]:
    """One editing request per source: its :func:`excerpt`, then ``# The same code, with NAME renamed to NEW:``."""
    prompts = []
    for source in sources:
        text = excerpt(source)
        old, new = renamed_identifier(text)
        prompts.append(text + RENAME_REQUEST.format(old=old, new=new))
    return prompts


def multiturn_prompts(
    openings: Sequence[str], count: int, respond: Callable[[str], str], turns: int = MULTITURN_TURNS
) -> list[str]:
    """``count`` requests (or fewer, when the openings run out): one conversation of ``turns`` turns per opening,
    in order. Turn 1's prompt is the opening; turn k's is turn k − 1's prompt, ``respond(that prompt)`` (its
    output) and the next of :data:`FOLLOW_UPS`. ``respond`` is called only for turns that have a next one."""
    if turns < 1:
        raise ValueError(f"a conversation needs turns >= 1, got {turns}")
    prompts: list[str] = []
    for opening in openings:
        prompt = opening
        for turn in range(turns):
            if len(prompts) == count:
                return prompts
            prompts.append(prompt)
            if turn + 1 < turns and len(prompts) < count:
                output = respond(prompt)
                old, new = renamed_identifier(opening + output)
                prompt = prompt + output + FOLLOW_UPS[turn % len(FOLLOW_UPS)].format(old=old, new=new)
    return prompts
