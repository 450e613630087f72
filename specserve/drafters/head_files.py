"""The directory of a trained drafter head (EAGLE, Medusa, exit head): reading and checking its ``config.json``.

Each head directory is HF-style: ``config.json`` naming the head's kind under
``"specserve_drafter"``, ``model.safetensors`` with the head's weights only, and a ``README.md`` card.
:func:`read_head_config` is the one reader: it turns a missing directory, a missing or broken
``config.json``, or a directory of another kind (a plain model checkpoint, another head) into the
caller's :class:`~specserve.core.errors.UserError` subclass, with a message saying what to pass
instead. What the fields mean, and the weights, stay with each head's module.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from specserve.core.errors import UserError

CONFIG_FILE = "config.json"
WEIGHTS_FILE = "model.safetensors"


def read_head_config(directory: str | Path, kind: str, what: str, error: type[UserError], hint: str) -> dict[str, Any]:
    """The parsed ``config.json`` of a ``kind`` head directory (``what``: how messages name it, e.g. "an EAGLE
    head"); raises ``error`` ending in ``hint`` (how to get a right one) for anything else."""
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
    if not isinstance(data, dict) or data.get("specserve_drafter") != kind:
        found = data.get("specserve_drafter") if isinstance(data, dict) else None
        model_type = data.get("model_type") if isinstance(data, dict) else None
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
