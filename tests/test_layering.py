"""Layering rules from DESIGN.md §3: ``specserve.core`` imports neither Ray nor gRPC, nor anything above it."""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
CORE = ROOT / "specserve" / "core"
FORBIDDEN = (
    "ray",
    "grpc",
    # sub-packages of specserve that sit above core
    *(f"specserve.{name}" for name in ("drafters", "actors", "serve", "rpc", "cluster", "policies", "training", "cli")),
)


def imported_modules(source: str, package: str) -> set[str]:
    """Every module an import statement (or a literal ``import_module``/``__import__`` call) in ``source`` names.

    ``package`` is the dotted package the source lives in, used to resolve relative imports.
    ``from a import b`` yields both ``a`` and ``a.b`` (``b`` may be a submodule).
    """
    parts = package.split(".")
    names: set[str] = set()
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, ast.Import):
            names.update(alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                base = parts[: len(parts) - (node.level - 1)]
                module = ".".join([*base, *([node.module] if node.module else [])])
            else:
                module = node.module or ""
            names.add(module)
            names.update(f"{module}.{alias.name}" for alias in node.names)
        elif isinstance(node, ast.Call):
            func = node.func
            func_name = func.attr if isinstance(func, ast.Attribute) else func.id if isinstance(func, ast.Name) else ""
            if func_name in ("import_module", "__import__") and node.args:
                first = node.args[0]
                if isinstance(first, ast.Constant) and isinstance(first.value, str):
                    names.add(first.value)
    return names


def forbidden(names: set[str]) -> list[str]:
    return sorted(n for n in names if any(n == f or n.startswith(f + ".") for f in FORBIDDEN))


def core_files() -> list[Path]:
    files = sorted(CORE.rglob("*.py"))
    assert files, f"no Python files under {CORE}"
    return files


@pytest.mark.parametrize("path", core_files(), ids=lambda p: str(p.relative_to(CORE)))
def test_core_does_not_import_ray_grpc_or_upper_layers(path: Path) -> None:
    package = ".".join(path.relative_to(ROOT).parent.parts)
    bad = forbidden(imported_modules(path.read_text(), package))
    assert not bad, f"{path.relative_to(ROOT)} imports {bad}; specserve.core must not depend on them"


def test_the_checker_catches_forbidden_imports() -> None:
    source = "\n".join(
        [
            "import ray",
            "from grpc import aio",
            "import importlib",
            "importlib.import_module('ray.serve')",
            "from .. import drafters",
            "from ..rpc.gen import stubs",
            "from . import sampling",
            "import torch",
        ]
    )
    names = imported_modules(source, "specserve.core")
    assert forbidden(names) == [
        "grpc",
        "grpc.aio",
        "ray",
        "ray.serve",
        "specserve.drafters",
        "specserve.rpc.gen",
        "specserve.rpc.gen.stubs",
    ]
    assert "specserve.core.sampling" in names and "torch" in names
