"""``specserve generate --typical-acceptance``: refused without ``--lossy``, and labelled lossy when run."""

from __future__ import annotations

import json

import pytest

from specserve.cli import main

COMMON = ["generate", "--prompt", "def main(", "--max-new-tokens", "8", "--draft", "ngram", "--temperature", "1"]


def run_cli(capsys: pytest.CaptureFixture[str], *argv: str) -> tuple[int, str, str]:
    code = main(list(argv))
    out, err = capsys.readouterr()
    return code, out, err


def test_typical_acceptance_without_lossy_is_refused(capsys: pytest.CaptureFixture[str]) -> None:
    code, out, err = run_cli(capsys, *COMMON, "--typical-acceptance")
    assert code == 2 and not out
    lines = err.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("error: typical acceptance is lossy"), err
    assert "--lossy" in lines[0] and "Traceback" not in err


def test_bad_typical_epsilon_is_refused(capsys: pytest.CaptureFixture[str]) -> None:
    code, _, err = run_cli(capsys, *COMMON, "--typical-acceptance", "--lossy", "--typical-epsilon", "1.5")
    assert code == 2 and err.startswith("error: typical_epsilon")


def test_typical_acceptance_output_says_lossy(capsys: pytest.CaptureFixture[str]) -> None:
    code, out, err = run_cli(capsys, *COMMON, "--json", "--typical-acceptance", "--lossy")
    assert code == 0, err
    obj = json.loads(out)
    assert obj["lossy"] is True and obj["sampling"] == "typical" and len(obj["output_ids"]) <= 8
    code, out, err = run_cli(capsys, *COMMON, "--json")
    assert code == 0, err
    assert json.loads(out)["lossy"] is False
    code, _, err = run_cli(capsys, *COMMON, "--typical-acceptance", "--lossy")  # streamed text: the summary line
    assert code == 0 and "lossy=true" in err
