"""The Makefile's install steps, dry-run (``make -n``): what a change of torch build, of the lock or of pyproject.toml
reinstalls, and that the rest comes from the lock."""

from __future__ import annotations

import os
import shutil
import subprocess
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
CUDA_INDEX = "https://download.pytorch.org/whl/cu128"
LOCK = ROOT / "requirements" / "lock.txt"
FROM_THE_LOCK = "--require-hashes --no-deps -r requirements/lock.txt"

pytestmark = pytest.mark.skipif(shutil.which("make") is None, reason="make is not installed")


def dry_run(venv: Path, *variables: str, target: str = "install") -> str:
    proc = subprocess.run(
        ["make", "-n", "-C", str(ROOT), target, f"VENV={venv}", *variables],
        capture_output=True, text=True, timeout=60, check=True,
    )  # fmt: skip
    return proc.stdout


def install_for_real(venv: Path, *variables: str) -> None:
    """Leave the stamps a finished install would leave, oldest first: the torch step's, then the whole install's."""
    stamps = [line.split()[-1] for line in dry_run(venv, *variables).splitlines() if line.startswith("touch ")]
    assert len(stamps) == 2, stamps
    venv.mkdir(exist_ok=True)
    for age, stamp in zip((20, 10), stamps, strict=True):
        Path(stamp).touch()
        newer_than_inputs = max(path.stat().st_mtime for path in (ROOT / "pyproject.toml", LOCK)) + 1000 - age
        os.utime(stamp, (newer_than_inputs, newer_than_inputs))


def test_a_fresh_install_takes_the_pinned_cpu_torch_first(tmp_path: Path) -> None:
    steps = dry_run(tmp_path / "venv")
    torch_step = next(line for line in steps.splitlines() if "pip install" in line and "torch==" in line)
    assert "--index-url" not in torch_step
    assert steps.index(torch_step) < steps.index(FROM_THE_LOCK) < steps.index("--no-deps --no-build-isolation -e .")


def test_an_installed_tree_is_left_alone(tmp_path: Path) -> None:
    venv = tmp_path / "venv"
    install_for_real(venv)
    assert "pip install" not in dry_run(venv)


def test_choosing_the_cuda_build_after_the_cpu_one_reinstalls_torch(tmp_path: Path) -> None:
    """`make demo` then `make install TORCH_INDEX=...` (the README's GPU step) must not say "Nothing to be done"."""
    venv = tmp_path / "venv"
    install_for_real(venv)
    steps = dry_run(venv, f"TORCH_INDEX={CUDA_INDEX}")
    torch_step = next(line for line in steps.splitlines() if "pip install" in line and "torch==" in line)
    assert f"--index-url {CUDA_INDEX}" in torch_step and "--force-reinstall" in torch_step
    assert FROM_THE_LOCK in steps  # then the rest, against the new torch


def test_a_new_lock_reinstalls_the_rest_but_not_torch(tmp_path: Path) -> None:
    venv = tmp_path / "venv"
    install_for_real(venv)
    stamp = venv / ".installed"
    os.utime(stamp, (LOCK.stat().st_mtime - 10, LOCK.stat().st_mtime - 10))  # the lock changed after the install
    steps = dry_run(venv)
    assert FROM_THE_LOCK in steps and "torch==" not in steps


def test_make_test_runs_the_two_tiers_at_once_unless_serial(tmp_path: Path) -> None:
    venv = tmp_path / "venv"
    install_for_real(venv)
    tiers = dry_run(venv, target="pytest")
    assert "nice -n 19" in tiers and '-m "not ray" -n 2 --dist loadfile' in tiers
    assert f"> {venv}/pytest-in-process.log 2>&1 & in_process=" in tiers  # the in-process tier's log, in the venv
    assert "pytest -q -m ray" in tiers
    serial = dry_run(venv, "SERIAL=1", target="pytest")
    assert "pytest -q --durations=60" in serial and "-m ray" not in serial and "not ray" not in serial
