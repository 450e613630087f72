"""What specserve needs is installed exactly as requirements/lock.txt says, and the lock covers pyproject.toml's ranges.

``make install`` installs the lock (``pip install --require-hashes --no-deps``), then torch's pinned build and this
package; CI does the same on a fresh clone, so a release published last night changes nothing here until someone runs
``make lock`` and commits the new lock. These tests read the lock as text and the environment through
``importlib.metadata``: no network, no pip.
"""

from __future__ import annotations

import re
import tomllib
from importlib import metadata
from pathlib import Path

from packaging.requirements import Requirement
from packaging.utils import canonicalize_name
from packaging.version import Version

ROOT = Path(__file__).resolve().parents[1]
LOCK = ROOT / "requirements" / "lock.txt"
# Installed beside the lock by their own pinned steps (the Makefile): the installer, torch's CPU or CUDA build, us.
OUTSIDE_THE_LOCK = {"pip", "torch", "specserve"}


def locked() -> dict[str, tuple[Version, int]]:
    """Each locked package: its version and how many hashes the lock gives for it."""
    pins: dict[str, tuple[Version, int]] = {}
    name = None
    for line in LOCK.read_text().splitlines():
        if match := re.match(r"^([A-Za-z0-9][A-Za-z0-9._-]*)==(\S+)", line):
            name = canonicalize_name(match[1])
            assert name not in pins, f"{name} is pinned twice"
            pins[name] = (Version(match[2]), 0)
        elif name is not None and line.strip().startswith("--hash=sha256:"):
            version, hashes = pins[name]
            pins[name] = (version, hashes + 1)
    return pins


def declared() -> list[Requirement]:
    project = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]
    return [Requirement(spec) for spec in [*project["dependencies"], *project["optional-dependencies"]["dev"]]]


def makefile_pin(variable: str) -> Version:
    match = re.search(rf"^{variable} \S= \w+==(\S+)", (ROOT / "Makefile").read_text(), re.MULTILINE)
    assert match, f"the Makefile pins no {variable}"
    return Version(match[1])


def test_every_locked_package_is_pinned_with_hashes() -> None:
    pins = locked()
    assert len(pins) > 50, "the lock holds transitive dependencies too"
    assert not [name for name, (_, hashes) in pins.items() if hashes == 0]
    assert not OUTSIDE_THE_LOCK & set(pins), "torch, pip and specserve are installed by their own steps"


def test_the_lock_satisfies_every_range_of_pyproject() -> None:
    """(That the lock is closed under its packages' own requirements, extras included, `make install` checks with
    `pip check`.)"""
    pins = locked()
    for requirement in declared():
        name = canonicalize_name(requirement.name)
        if name == "torch":
            assert makefile_pin("TORCH_SPEC") in requirement.specifier
            continue
        assert name in pins, f"{requirement} is not in the lock: run make lock"
        assert requirement.specifier.contains(pins[name][0], prereleases=True), (
            f"{requirement}: lock has {pins[name][0]}"
        )


def required() -> dict[str, Version | None]:
    """What specserve[dev] requires, transitively, as installed (None: required but not installed).

    Walks each installed distribution's own ``Requires-Dist``, markers evaluated for this interpreter and the extras
    asked for, from specserve with its ``dev`` extra.
    """
    found: dict[str, Version | None] = {}
    asked: dict[str, frozenset[str]] = {}
    todo = [("specserve", frozenset({"dev"}))]
    while todo:
        name, extras = todo.pop()
        key = canonicalize_name(name)
        if key in asked and extras <= asked[key]:
            continue
        asked[key] = asked.get(key, frozenset()) | extras
        try:
            dist = metadata.distribution(key)
        except metadata.PackageNotFoundError:
            found[key] = None
            continue
        found[key] = Version(dist.version)
        for spec in dist.requires or []:
            requirement = Requirement(spec)
            marker = requirement.marker
            if marker is None or any(marker.evaluate({"extra": extra}) for extra in {"", *extras}):
                todo.append((requirement.name, frozenset(requirement.extras)))
    return found


def test_the_environment_is_the_lock() -> None:
    """What specserve[dev] needs, transitively, is installed at exactly the locked versions, and the lock holds
    nothing it does not need; torch and pip at the Makefile's pins.

    Packages that nothing of ours requires (a CI runner's own tools, installed beside ours) are not checked: they
    are not imported by specserve and the lock does not promise them.
    """
    pins = locked()
    needed = required()
    missing = sorted(name for name, version in needed.items() if version is None)
    assert not missing, f"required but not installed (make install fixes it): {missing}"
    wrong = {name: (str(needed.get(name)), str(version)) for name, (version, _) in pins.items()
             if needed.get(name) != version}  # fmt: skip
    assert not wrong, f"installed vs locked (make install fixes it; absent: the lock holds what nothing needs): {wrong}"
    unlocked = sorted(set(needed) - set(pins) - OUTSIDE_THE_LOCK)
    assert not unlocked, f"required but not locked (run make lock): {unlocked}"
    assert needed["torch"] is not None and needed["torch"].public == makefile_pin("TORCH_SPEC").public
    assert Version(metadata.version("pip")) == makefile_pin("PIP_SPEC")
