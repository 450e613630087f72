"""The directory of a drafter head (EAGLE, Medusa, exit head): reading its ``config.json`` and its weight files.

Each of specserve's own head directories is HF-style: ``config.json`` naming the head's kind under
``"specserve_drafter"``, ``model.safetensors`` with the head's weights only, and a ``README.md`` card.
:func:`read_config_json` reads any head's ``config.json``; :func:`read_head_config` also checks it is specserve's
own head of one kind. Both turn a missing directory, a missing or broken ``config.json``, or a directory of another
kind (a plain model checkpoint, another head) into the caller's :class:`~specserve.core.errors.UserError`
subclass, with a message saying what to pass instead. :func:`read_weights` reads a published head's tensors from
``model.safetensors`` (or its sharded index) or ``pytorch_model.bin``, the latter with ``weights_only`` so that a
pickle carrying code is refused and nothing in it runs. What the fields and tensors mean stays with each head's
module.
"""

from __future__ import annotations

import json
import re
from pathlib import Path
from typing import Any

import torch
from safetensors import SafetensorError
from safetensors.torch import load_file

from specserve.core.errors import UserError

CONFIG_FILE = "config.json"
WEIGHTS_FILE = "model.safetensors"
SHARDED_INDEX = "model.safetensors.index.json"
PICKLE_FILE = "pytorch_model.bin"


def read_config_json(directory: str | Path, what: str, error: type[UserError], hint: str) -> dict[str, Any]:
    """The parsed ``config.json`` of a head directory (``what``: how messages name it, e.g. "an EAGLE head"); raises
    ``error`` ending in ``hint`` (how to get a right one) when there is none or it is not a JSON object."""
    path = Path(directory)
    if not path.is_dir():
        raise error(f"{what} directory {path} does not exist or is not a directory; {hint}")
    config_path = path / CONFIG_FILE
    if not config_path.is_file():
        raise error(f"{path} has no {CONFIG_FILE}: it is not {what} directory; {hint}")
    try:
        data = json.loads(config_path.read_text())
    except (json.JSONDecodeError, UnicodeDecodeError) as exc:
        raise error(f"{config_path} is not valid JSON: {exc}") from exc
    if not isinstance(data, dict):
        raise error(f"{config_path} is not a JSON object")
    return data


def read_head_config(directory: str | Path, kind: str, what: str, error: type[UserError], hint: str) -> dict[str, Any]:
    """The parsed ``config.json`` of specserve's own ``kind`` head directory; raises ``error`` ending in ``hint`` for
    anything else."""
    path = Path(directory)
    data = read_config_json(path, what, error, hint)
    if data.get("specserve_drafter") != kind:
        found, model_type = data.get("specserve_drafter"), data.get("model_type")
        if found is not None:
            looks = f"it holds a {found!r} head"
        elif model_type:
            looks = f"it looks like a {model_type!r} model checkpoint: pass that as a draft model directory"
        else:
            looks = "it holds no specserve head"
        raise error(
            f'{path} is not {what} directory: its {CONFIG_FILE} lacks "specserve_drafter": "{kind}" ({looks}); {hint}'
        )
    return data


def read_weights(directory: str | Path, error: type[UserError]) -> dict[str, torch.Tensor]:
    """Every tensor of a head directory, on the CPU in its stored dtype: ``model.safetensors``, the shards its
    ``model.safetensors.index.json`` names, or ``pytorch_model.bin`` loaded with ``weights_only`` (a pickle that is
    not plain tensors is refused; nothing in it runs). Raises ``error`` naming the file when none can be read."""
    path = Path(directory)
    try:
        if (path / WEIGHTS_FILE).is_file():
            return load_file(str(path / WEIGHTS_FILE))
        if (path / SHARDED_INDEX).is_file():
            index = json.loads((path / SHARDED_INDEX).read_text())
            shards = sorted(set(index["weight_map"].values()))
            return {name: tensor for shard in shards for name, tensor in load_file(str(path / shard)).items()}
    except (SafetensorError, OSError, KeyError, TypeError, json.JSONDecodeError) as exc:
        raise error(f"could not read the weights in {path}: {exc}") from exc
    if (path / PICKLE_FILE).is_file():
        return read_pickle(path / PICKLE_FILE, error, "convert it to model.safetensors with the tool that wrote it")
    raise error(f"{path} has no weights: expected {WEIGHTS_FILE}, {SHARDED_INDEX} or {PICKLE_FILE}")


def read_pickle(file: Path, error: type[UserError], fix: str) -> dict[str, torch.Tensor]:
    """The state dict of tensors in the torch pickle ``file``, loaded with ``weights_only``: a pickle that is not plain
    tensors is refused with ``error`` (ending in ``fix``, what to use instead) and nothing in it runs."""
    try:
        state = torch.load(file, map_location="cpu", weights_only=True)
    except Exception as exc:  # any failure of the restricted unpickler is a refused file
        raise error(
            f"{file} was refused: it is not a plain tensor pickle (weights_only: {_refusal_reason(exc)}); nothing in "
            f"it was run. {fix[:1].upper()}{fix[1:]}"
        ) from exc
    if not isinstance(state, dict) or not all(isinstance(t, torch.Tensor) for t in state.values()):
        raise error(f"{file} holds no state dict of tensors")
    return {str(name): tensor for name, tensor in state.items()}


def _refusal_reason(exc: Exception) -> str:
    """Why torch's restricted unpickler refused a file, in one line (its message spans several)."""
    text = re.sub(r"\x1b\[[0-9;]*m", "", str(exc))
    for line in text.splitlines():
        if "WeightsUnpickler error:" in line:
            return line.split("WeightsUnpickler error:", 1)[1].strip().split(". ")[0]
    lines = [line.strip() for line in text.splitlines() if line.strip()]
    return lines[0] if lines else type(exc).__name__
