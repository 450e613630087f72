"""The import order of the ``specserve`` package (docs/architecture.md#import-order), stated as data and checked.

``specserve.core`` imports neither Ray nor gRPC, nor anything above it (the first tests). Then the whole
order (:data:`LEVELS`): every module of ``specserve/`` sits on one level and imports only from levels
below it, from its own sub-package, or from the peers its level allows; Ray, gRPC and matplotlib only
from the levels :data:`EXTERNAL_FLOORS` names; and no import cycle, between sub-packages or between
modules. Every import statement counts wherever it stands (a lazy import inside a function, an
``if TYPE_CHECKING:`` block): the order holds for every import, not only for those run at import time.
The checks read the source with :mod:`ast` and import nothing.
"""

from __future__ import annotations

import ast
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
PACKAGE = ROOT / "specserve"
CORE = PACKAGE / "core"
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


# The rooms of core: a top level a newcomer can read, and sub-packages that say what they hold
CORE_TOP_LEVEL_LIMIT = 12


def test_core_top_level_stays_small() -> None:
    top = sorted(p.stem for p in CORE.glob("*.py") if p.name != "__init__.py")
    assert len(top) <= CORE_TOP_LEVEL_LIMIT, (
        f"specserve/core/ holds {len(top)} modules at its top level ({top}): put the new one in its room "
        "(docs/architecture.md#the-rooms-of-core)"
    )


@pytest.mark.parametrize("room", sorted(p.parent for p in CORE.glob("*/__init__.py")), ids=lambda p: p.name)
def test_every_core_room_states_its_job(room: Path) -> None:
    doc = ast.get_docstring(ast.parse((room / "__init__.py").read_text()))
    assert doc and "not" in doc, f"{room.relative_to(ROOT)}/__init__.py must say what the room knows and does not know"
    code = [n for n in ast.parse((room / "__init__.py").read_text()).body if not isinstance(n, ast.Expr)]
    assert not code, f"{room.relative_to(ROOT)}/__init__.py re-exports or runs code: import from the modules instead"


# ---------------------------------------------------------------------------------------------
# The whole order


@dataclass(frozen=True)
class Level:
    """One level of the import order: its sub-packages (or top-level modules) as dotted names, and which of
    them may import which others on the same level (none unless listed in ``peers``)."""

    name: str
    packages: tuple[str, ...]
    peers: Mapping[str, tuple[str, ...]] = field(default_factory=dict)


ROOT_PACKAGE = "specserve"

# Lowest level first. A module may import its own sub-package, anything on a lower level, and the peers its
# level lists for its sub-package; a module belongs to the longest name below that it equals or starts with.
LEVELS = (
    # specserve/__init__.py: environment defaults (no hub) and the version. Every `import specserve.x` runs it
    # first, so it sits under everything and imports nothing of specserve.
    Level("package", (ROOT_PACKAGE,)),
    # The bottom: core, the library, in rooms that follow one speculation cycle over its state (docs/architecture.md
    # #the-rooms-of-core), lowest first. errors: the one base class of the errors a caller can fix. Then what a
    # request asks of the target's distribution (sampling) and the tree a draft is (tree); the attention paths; the
    # state a cycle rolls back (kv); the forward over it (model); static shapes and captured steps over the forward
    # (static); the draft side's contracts (draft); the acceptance rules and what shapes the distributions they compare
    # (verify). No room imports a room above it and no room has peers: a room that needs another's type sits above it.
    Level("core: errors", ("specserve.core.errors",)),
    Level("core: sampling and trees", ("specserve.core.sampling", "specserve.core.tree")),
    Level("core: attention", ("specserve.core.attention",)),
    Level("core: kv", ("specserve.core.kv",)),
    Level("core: model", ("specserve.core.model",)),
    Level("core: static", ("specserve.core.static",)),
    Level("core: draft", ("specserve.core.draft",)),
    Level("core: verify", ("specserve.core.verify",)),
    # core's top: the two halves of a cycle (draft_side, target), a request's life (request, prompts, detokenize,
    # stats, resume, shadow) and the engines that run it (engine, batch_step, batch_engine), over every room below.
    # defaults: where this checkout keeps the shipped model pair, and the defaults every command shares; it reads the
    # environment and nothing else. No peers: core serves any checkpoint and never learns where the shipped pair lives.
    Level("core", ("specserve.core", "specserve.defaults")),
    # How much to draft, and what. Both know core only, and meet there (core.draft.schedule's Budget,
    # core.draft.drafter's Drafter). No peers: a policy is a pure decision over estimator state and never touches a
    # model or a drafter (docs/architecture.md#import-order); a drafter is told its budget, never asks a policy.
    Level("policies and drafters", ("specserve.policies", "specserve.drafters")),
    # Distribution: the Ray actors, the gRPC wire, the cluster bootstrap. actors may import rpc (the drafter and
    # target actors serve and call the gRPC streams) and cluster (a replica places its actors with the
    # cluster's placement groups and resource classes); rpc and cluster are libraries the actors use and
    # import neither each other nor the actors.
    Level(
        "distribution",
        ("specserve.actors", "specserve.rpc", "specserve.cluster"),
        peers={"specserve.actors": ("specserve.rpc", "specserve.cluster")},
    ),
    # Ray Serve deployments and the OpenAI-compatible HTTP API, over the actors.
    Level("serving", ("specserve.serve",)),
    # Tools over everything. The CLI (specserve.cli, which registers the subcommands, and the subcommand modules
    # placed here, such as specserve.generate) drives generation, training and the benchmarks; the benchmarks
    # take their held-out prompts from training's corpus. training never imports the benchmarks (it judges its
    # heads by running the engine itself) and a subcommand never imports the CLI, so the level has no cycle.
    Level(
        "tools",
        ("specserve.training", "specserve.benchmarks", "specserve.generate", "specserve.replay", "specserve.cli"),
        peers={
            "specserve.cli": ("specserve.training", "specserve.benchmarks", "specserve.generate", "specserve.replay"),
            "specserve.replay": ("specserve.generate",),
            "specserve.benchmarks": ("specserve.training",),
        },
    ),
)

# Third-party packages only some levels may import, each with the lowest level that may.
EXTERNAL_FLOORS = {
    "ray": "distribution",  # policies and drafters run inside actors but never call Ray themselves
    "grpc": "distribution",
    "matplotlib": "tools",  # plots belong to benchmarks and reports; nothing that serves loads a plotting library
}


def level_index(name: str) -> int:
    return next(i for i, level in enumerate(LEVELS) if level.name == name)


def placement(module: str) -> tuple[int, str] | None:
    """The level and the sub-package ``module`` belongs to (the longest matching name); None: not placed.

    The package root matches only itself: ``specserve.x`` is never placed by the root's entry.
    """
    best: tuple[int, str] | None = None
    for index, level in enumerate(LEVELS):
        for package in level.packages:
            matches = module == package or (package != ROOT_PACKAGE and module.startswith(package + "."))
            if matches and (best is None or len(package) > len(best[1])):
                best = (index, package)
    return best


def module_name(path: Path) -> str:
    parts = path.relative_to(ROOT).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def package_files() -> list[Path]:
    files = sorted(PACKAGE.rglob("*.py"))
    assert files, f"no Python files under {PACKAGE}"
    return files


MODULES = frozenset(module_name(path) for path in package_files())


def resolve(name: str, modules: frozenset[str] = MODULES) -> str | None:
    """The specserve module an imported name refers to: the name itself or the module defining it
    (``specserve.core.model.causal_lm.CausalLM`` → ``specserve.core.model.causal_lm``); None for a name outside
    specserve."""
    if name != ROOT_PACKAGE and not name.startswith(ROOT_PACKAGE + "."):
        return None
    while name not in modules and "." in name:
        name = name.rpartition(".")[0]
    return name


def violations(source: str, module: str, *, is_package: bool = False) -> list[str]:
    """Every name ``source`` (the code of ``module``) imports against the order: from a higher level, from a
    peer its level does not allow, from a module with no level, or a third-party package below its floor."""
    where = placement(module)
    assert where is not None, f"{module} has no level in LEVELS"
    level, package = where
    peers = LEVELS[level].peers.get(package, ())
    bad = set()
    for name in imported_modules(source, module if is_package else module.rpartition(".")[0]):
        floor = EXTERNAL_FLOORS.get(name.split(".")[0])
        if floor is not None and level < level_index(floor):
            bad.add(name)
        target = resolve(name)
        if target is None:
            continue
        target_where = placement(target)
        if target_where is None:
            bad.add(name)
            continue
        target_level, target_package = target_where
        if target_package != package and target_level >= level and target_package not in peers:
            bad.add(name)
    return sorted(bad)


def describe(name: str) -> str:
    """Where an offending name sits, for failure messages."""
    floor = EXTERNAL_FLOORS.get(name.split(".")[0])
    if floor is not None:
        return f"{name} (third-party: the {floor!r} level and above only)"
    target = resolve(name)
    where = placement(target) if target is not None else None
    if where is None:
        return f"{name} (no level in LEVELS: place it)"
    return f"{name} ({where[1]}, level {LEVELS[where[0]].name!r})"


def test_the_order_is_well_formed() -> None:
    placed = [package for level in LEVELS for package in level.packages]
    assert len(placed) == len(set(placed)), f"a package sits on two levels: {placed}"
    for level in LEVELS:
        for importer, allowed in level.peers.items():
            assert importer in level.packages and set(allowed) <= set(level.packages) - {importer}, (
                f"level {level.name!r}: peers must name other packages of the same level, got {importer} -> {allowed}"
            )
    assert all(any(level.name == floor for level in LEVELS) for floor in EXTERNAL_FLOORS.values())


def test_every_module_has_a_level() -> None:
    unplaced = sorted(module for module in MODULES if placement(module) is None)
    assert not unplaced, f"{unplaced} have no level: place them in LEVELS (and in docs/architecture.md#import-order)"


@pytest.mark.parametrize("path", package_files(), ids=lambda p: str(p.relative_to(PACKAGE)))
def test_imports_follow_the_order(path: Path) -> None:
    module = module_name(path)
    where = placement(module)
    if where is None:
        pytest.fail(f"{module} has no level: place it in LEVELS (and in docs/architecture.md#import-order)")
    bad = violations(path.read_text(), module, is_package=path.name == "__init__.py")
    assert not bad, (
        f"{path.relative_to(ROOT)} ({where[1]}, level {LEVELS[where[0]].name!r}) imports "
        f"{[describe(name) for name in bad]}: move the code it needs down, or this code up "
        "(docs/architecture.md#import-order)"
    )


def test_the_checker_catches_upward_imports() -> None:
    source = "\n".join(
        [
            "from specserve.core.draft.schedule import Budget",
            "from specserve import defaults",
            "from . import base",
            "import torch",
            "import ray",
            "from ..drafters.model import DraftModelDrafter",
            "from specserve.benchmarks.experiment import run",
            "def later():",
            "    from specserve.serve import app",
            "    import matplotlib.pyplot as plt",
        ]
    )
    assert violations(source, "specserve.policies.controller") == [
        "matplotlib.pyplot",
        "ray",
        "specserve.benchmarks.experiment",
        "specserve.benchmarks.experiment.run",
        "specserve.drafters.model",
        "specserve.drafters.model.DraftModelDrafter",
        "specserve.serve",
        "specserve.serve.app",
    ]
    # peers: the actors may use rpc and cluster, not the other way round; nobody on a level may use one above
    actors = "from specserve.rpc.codec import decode\nfrom ..cluster import placement\nimport grpc\nimport ray\n"
    assert violations(actors, "specserve.actors.drafter") == []
    assert violations("from specserve.actors import drafter\n", "specserve.rpc.verifier") == [
        "specserve.actors",
        "specserve.actors.drafter",
    ]
    assert violations("from specserve.benchmarks.prompts import heldout_prompts\n", "specserve.training.heads") == [
        "specserve.benchmarks.prompts",
        "specserve.benchmarks.prompts.heldout_prompts",
    ]
    assert violations("from specserve.training import corpus\n", "specserve.benchmarks.prompts") == []
    # the bottom: core must not learn where the shipped pair lives; the package root imports nothing of specserve
    assert violations("from specserve import defaults\n", "specserve.core.engine") == ["specserve.defaults"]
    assert violations("from . import core\n", ROOT_PACKAGE, is_package=True) == ["specserve.core"]


# ---------------------------------------------------------------------------------------------
# Cycles


def import_graph() -> dict[str, set[str]]:
    """Every specserve module → the specserve modules it imports (lazily or not), itself left out."""
    graph: dict[str, set[str]] = {}
    for path in package_files():
        module = module_name(path)
        package = module if path.name == "__init__.py" else module.rpartition(".")[0]
        targets = {resolve(name) for name in imported_modules(path.read_text(), package)}
        graph[module] = {t for t in targets if t is not None and t != module}
    return graph


def cycles(graph: Mapping[str, Iterable[str]]) -> list[list[str]]:
    """Every import cycle: the strongly connected components of more than one node, each sorted (Tarjan)."""
    index: dict[str, int] = {}
    lowlink: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    found: list[list[str]] = []

    def visit(node: str) -> None:
        index[node] = lowlink[node] = len(index)
        stack.append(node)
        on_stack.add(node)
        for successor in graph.get(node, ()):
            if successor not in index:
                visit(successor)
                lowlink[node] = min(lowlink[node], lowlink[successor])
            elif successor in on_stack:
                lowlink[node] = min(lowlink[node], index[successor])
        if lowlink[node] == index[node]:
            component = []
            while True:
                member = stack.pop()
                on_stack.discard(member)
                component.append(member)
                if member == node:
                    break
            if len(component) > 1:
                found.append(sorted(component))

    for node in sorted(graph):
        if node not in index:
            visit(node)
    return sorted(found)


def package_graph(graph: Mapping[str, Iterable[str]]) -> dict[str, set[str]]:
    """The module graph collapsed onto the sub-packages of :data:`LEVELS` (unplaced modules stand alone)."""

    def package(module: str) -> str:
        where = placement(module)
        return where[1] if where is not None else module

    collapsed: dict[str, set[str]] = {}
    for module, targets in graph.items():
        edges = collapsed.setdefault(package(module), set())
        edges.update(package(t) for t in targets if package(t) != package(module))
    return collapsed


def test_no_import_cycle_between_subpackages() -> None:
    found = cycles(package_graph(import_graph()))
    assert not found, f"sub-packages importing each other: {found}; put the shared piece below both"


def test_no_import_cycle_between_modules() -> None:
    found = cycles(import_graph())
    assert not found, f"modules importing each other (lazily or not): {found}; move the shared piece to one place"


def test_the_cycle_finder_finds_cycles() -> None:
    graph = {"a": {"b"}, "b": {"c"}, "c": {"a", "d"}, "d": set(), "e": {"f"}, "f": {"e"}, "g": {"a"}}
    assert cycles(graph) == [["a", "b", "c"], ["e", "f"]]
    assert cycles({"a": {"b"}, "b": {"c"}, "c": set()}) == []
    collapsed = package_graph({"specserve.drafters.model": {"specserve.core.draft.drafter", "specserve.drafters.tree"}})
    assert collapsed == {"specserve.drafters": {"specserve.core.draft"}}
