"""Whether a path is a local Hugging Face checkpoint directory, checked before torch loads. Torch-free.

specserve loads local directories only (it never reaches a model hub). :func:`check_checkpoint_dir`
says what is wrong with a path that should be one: missing (with the download recipe when the
path looks like a hub id such as ``meta-llama/Llama-3.2-1B``), not a directory, no
``config.json``, no weights. It does not read the weights or know architectures:
:meth:`specserve.core.model.causal_lm.CausalLM.load` does.
"""

from __future__ import annotations

import json
import re
from pathlib import Path

from specserve.core.errors import UserError

# owner/name, as the hub spells repository ids: what a user who came from vLLM or transformers passes.
_HUB_ID = re.compile(r"^[A-Za-z0-9][\w.-]*/[\w.-]+$")
CHECKPOINTS_DOC = "docs/checkpoints.md"


class ModelLoadError(UserError):
    """A model directory is missing, malformed or not a causal LM; the message says which."""


def looks_like_hub_id(path: str | Path) -> bool:
    """Whether ``path`` reads as a hub repository id (``owner/name``) rather than a local path."""
    text = str(path)
    return bool(_HUB_ID.match(text)) and not text.startswith(".")


def missing_directory_message(path: str | Path, what: str = "model directory", flag: str = "--target ") -> str:
    """``{what} {path} does not exist``, with the download recipe when ``path`` looks like a hub id (ending in how to
    pass the downloaded directory: ``flag`` before it, e.g. ``"--draft eagle:"``)."""
    path = str(path)
    message = f"{what} {path} does not exist"
    if looks_like_hub_id(path):
        local = "models/" + path.split("/")[-1].lower()
        message += (
            f"; {path!r} looks like a Hugging Face hub id, but specserve loads local directories only. "
            f"Download it once (`hf download {path} --local-dir {local}`; gated models need `hf auth login` "
            f"first) and pass {flag}{local} ({CHECKPOINTS_DOC})"
        )
    return message


def check_checkpoint_dir(directory: str | Path, what: str = "model directory") -> None:
    """Raise :class:`ModelLoadError` unless ``directory`` holds a ``config.json`` and weights."""
    directory = Path(directory)
    if not directory.exists():
        raise ModelLoadError(missing_directory_message(directory, what))
    if not directory.is_dir():
        raise ModelLoadError(f"{directory} is not a directory; pass a Hugging Face checkpoint directory")
    config_path = directory / "config.json"
    if not config_path.is_file():
        raise ModelLoadError(f"{directory} has no config.json; it is not a Hugging Face checkpoint directory")
    try:
        json.loads(config_path.read_text())
    except (json.JSONDecodeError, UnicodeDecodeError) as exc:
        raise ModelLoadError(f"{config_path} is not valid JSON: {exc}") from exc
    weights = list(directory.glob("*.safetensors")) + list(directory.glob("*.bin"))
    if not weights:
        raise ModelLoadError(f"{directory} has no weights (*.safetensors or *.bin)")
