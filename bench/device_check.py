"""The device check (issue 20): exactness and speed on one GPU, in one run of under 8 minutes.

    python bench/device_check.py [--out DIR] [--device cuda|cpu] [--quick] [--budget SECONDS] [--models DIR]

Usually run through ``bench/device_check.sh``, which says how to send it to a lent GPU. What it measures and
writes: :mod:`specserve.benchmarks.device_check`. This entry first makes the packages the GPU image lacks
unimportable (:data:`ABSENT_ON_DEVICE`), so that a run here imports exactly what a run there can.
"""

from __future__ import annotations

import sys
import time

START = time.perf_counter()  # the budget counts from here

ABSENT_ON_DEVICE = ("ray", "llguidance", "hypothesis", "pydantic", "scipy")
"""Not on the GPU image (torch, transformers, numpy, msgpack, grpcio, protobuf and matplotlib are): importing
any of them fails here as it would there (``None`` in ``sys.modules`` makes an import raise ModuleNotFoundError,
and ``importlib.util.find_spec`` report the package absent)."""


def main() -> int:
    for name in ABSENT_ON_DEVICE:
        if name not in sys.modules:
            sys.modules[name] = None  # type: ignore[assignment]
    from specserve.benchmarks.device_check import main as check

    return check(sys.argv[1:], start=START)


if __name__ == "__main__":
    sys.exit(main())
