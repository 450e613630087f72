"""Every document the code cites is in the repository: citations and Markdown links resolve to a file and heading.

The code cites its rules as ``docs/<file>.md#<anchor>`` (e.g. ``docs/verification.md#rule-a-...``);
the Markdown files link each other relatively. Both must name a file that exists and, with an
anchor, a heading of that file (GitHub's anchor rule: lower case, punctuation dropped, spaces to
hyphens). Nothing may cite the design notes that live outside the repository.
"""

from __future__ import annotations

import re
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
CODE_DIRS = ("specserve", "tests", "bench", "protos", "deploy")
CITATION = re.compile(r"docs/([\w-]+\.md)(#[\w-]+)?")
LINK = re.compile(r"\]\(([^)\s]+)\)")
OUTSIDE = re.compile(r"\b(VERIFICATION|DESIGN|STYLE)\.md|\bDESIGN §|\bVERIFICATION rule")


def anchor(heading: str) -> str:
    """GitHub's anchor for a heading's text."""
    # code and emphasis marks go; an underscore inside a word stays (T_verify)
    text = re.sub(r"[`*]|(?<!\w)_|_(?!\w)", "", heading.strip().lower())
    text = re.sub(r"[^\w\- ]", "", text)
    return text.replace(" ", "-")


def anchors(path: Path) -> set[str]:
    headings = [line.lstrip("#") for line in path.read_text().splitlines() if re.match(r"#{1,6} ", line)]
    return {anchor(h) for h in headings}


def code_files() -> list[Path]:
    files = [
        p for d in CODE_DIRS for p in (ROOT / d).rglob("*") if p.is_file() and p.suffix in (".py", ".proto", ".yaml")
    ]
    return [p for p in files if "gen" not in p.relative_to(ROOT).parts]


def markdown_files() -> list[Path]:
    return sorted(
        [
            ROOT / "README.md",
            ROOT / "BENCHMARKS.md",
            ROOT / "bench" / "README.md",
            *(ROOT / "docs").glob("*.md"),
            *(ROOT / "bench" / "results" / "notes").glob("*.md"),
        ]
    )


def test_the_checker_slugs_headings_as_github_does() -> None:
    assert anchor("Rule A: chain, one sampled child per depth") == "rule-a-chain-one-sampled-child-per-depth"
    assert anchor("The `DraftSide` (one request's draft half)") == "the-draftside-one-requests-draft-half"
    assert anchor("19. Hybrid targets: T_verify(k), _rollback_") == "19-hybrid-targets-t_verifyk-rollback"


def test_code_citations_resolve_to_a_doc_and_heading() -> None:
    cited = 0
    for path in code_files():
        if path == Path(__file__):
            continue
        for name, fragment in CITATION.findall(path.read_text(errors="replace")):
            doc = ROOT / "docs" / name
            assert doc.is_file(), f"{path.relative_to(ROOT)} cites docs/{name}, which does not exist"
            if fragment:
                assert fragment[1:] in anchors(doc), (
                    f"{path.relative_to(ROOT)} cites docs/{name}{fragment}: no such heading"
                )
            cited += 1
    assert cited >= 10  # the verification rules, the performance model, the import order ... are cited


@pytest.mark.parametrize("path", markdown_files(), ids=lambda p: str(p.relative_to(ROOT)))
def test_markdown_links_resolve(path: Path) -> None:
    for target in LINK.findall(path.read_text()):
        if re.match(r"[a-z]+:", target):  # http:, https:, mailto:
            continue
        file_part, _, fragment = target.partition("#")
        doc = (path.parent / file_part).resolve() if file_part else path
        assert doc.exists(), f"{path.relative_to(ROOT)} links to {target}: no such file"
        if fragment and doc.suffix == ".md":
            assert fragment in anchors(doc), f"{path.relative_to(ROOT)} links to {target}: no such heading"


def test_nothing_cites_the_design_notes_outside_the_repository() -> None:
    for path in [*code_files(), *markdown_files()]:
        if path == Path(__file__):
            continue
        found = OUTSIDE.search(path.read_text(errors="replace"))
        assert found is None, f"{path.relative_to(ROOT)} cites {found.group(0)!r}: cite docs/ instead"
