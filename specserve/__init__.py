"""specserve: exact, distributed speculative decoding for large language models, served on Ray."""

import os as _os

# specserve never reaches a model hub: every model is a local directory.
_os.environ.setdefault("HF_HUB_OFFLINE", "1")
_os.environ.setdefault("HF_HUB_DISABLE_TELEMETRY", "1")
_os.environ.setdefault("TRANSFORMERS_NO_ADVISORY_WARNINGS", "1")

__version__ = "0.1.0"
