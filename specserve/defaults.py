"""Where the shipped default model pair lives and the defaults every command shares.

``SPECSERVE_MODELS`` overrides the models directory; otherwise it is ``models/`` at the root of
the source checkout. ``DEFAULT_GAMMA`` is the best fixed gamma that ``specserve bench`` measured
for the default pair (see BENCHMARKS.md).
"""

from __future__ import annotations

import os
from pathlib import Path

REPO_ROOT = Path(__file__).resolve().parents[1]
MODELS_DIR = Path(os.environ.get("SPECSERVE_MODELS", REPO_ROOT / "models"))
DEFAULT_TARGET = MODELS_DIR / "target"
DEFAULT_DRAFT = MODELS_DIR / "draft"
DEFAULT_GAMMA = 3
DEFAULT_MAX_NEW_TOKENS = 128
