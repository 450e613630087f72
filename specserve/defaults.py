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
# torch CPU threads of a command's own process (``--threads``): 1, measured on this 2-core machine with the shipped
# pair: 86 tok/s with 1 thread and 84-99 with 2 when idle; 41-46 with 1 and 7.5-11 with 2 when other work shared the
# cores (load average 3.5). docs/usage.md#threads.
DEFAULT_THREADS = 1
