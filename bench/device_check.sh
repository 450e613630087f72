#!/usr/bin/env bash
# The device check (issue 20), in one run of under 8 minutes on one GPU: greedy exactness on CUDA against
# transformers for every drafter (chains and a dynamic tree), our plain decoding against transformers' (eager, and
# its static cache, which transformers compiles), every drafter's speedup, T_verify(k) of the target, and the same
# plain decoding and T_verify(k) for a random-initialised 1.1B-parameter Llama in bf16, and both models in batches
# of 1, 16 and 64 requests against transformers' generate_batch (issue 38). Needs only python3 with
# torch and transformers (matplotlib for the PNG): no Ray, no network, no pip. What each section measures:
# specserve/benchmarks/device_check.py; docs/usage.md#gpu-check.
#
#   bench/device_check.sh [--out DIR] [--budget SECONDS] [--models DIR] [--device cpu --quick] ...
#
# Every flag goes to bench/device_check.py. Writes DIR/device_check.json (after every section) and
# DIR/device_check.png (default DIR: bench/results/device_check), prints the tables, a PASS / FAIL line per target
# and one JSON line. Exit status: 0 it ran to the end (a target may still FAIL: read the lines), 2 this machine
# cannot run what was asked (no CUDA: one line says so), 3 torch or transformers missing, 124 the 480 s limit
# struck (the JSON keeps every section finished by then), anything else a crash.
#
# Through the device tool (a lent H200). Only 64 MiB (67,108,864 bytes) of the working tree travel: the code, docs
# and results are about 5.2 MB, models/target 54.0 MB and models/draft 6.2 MB, 65.5 MB (62.4 MiB) together
# (`git ls-files | xargs du -cb`, less models/eagle, models/medusa and models/exit-head, 22.9 MB), plus whatever
# untracked files the tree holds. So the heads stay behind: move them into the ignored runs/ for the call and back
# after it; the check reports their drafters "skipped: files missing".
#
#   mkdir -p runs/aside && mv models/eagle models/medusa models/exit-head runs/aside/
#   run(command="bash bench/device_check.sh --out $OUT", timeout_s=560)     # the JSON and PNG come back
#   mv runs/aside/eagle runs/aside/medusa runs/aside/exit-head models/
#
# Medusa (4.2 MB) fits too if bench/results (2.5 MB) and tests (1.0 MB) go aside as well (66.2 MB, 63.1 MiB:
# check with `du -cb` over what remains). On a CPU the same flow runs in seconds:
# bench/device_check.sh --quick --device cpu --out runs/device_check.
set -euo pipefail

ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
cd "$ROOT"
PY="${PYTHON:-python3}"
export PYTHONPATH="$ROOT${PYTHONPATH:+:$PYTHONPATH}"
export HF_HUB_OFFLINE=1 HF_HUB_DISABLE_TELEMETRY=1 TOKENIZERS_PARALLELISM=false PYTHONUNBUFFERED=1

if ! "$PY" -c "import torch, transformers, sys; print('device_check:', sys.executable, '| torch', torch.__version__,
      '| transformers', transformers.__version__, '| cuda', torch.cuda.is_available())"; then
    echo "device_check: $PY cannot import torch and transformers; set PYTHON to an interpreter that can" >&2
    exit 3
fi
"$PY" -c "import matplotlib" 2>/dev/null || echo "device_check: matplotlib missing: the JSON only, no PNG"

if command -v timeout >/dev/null; then
    exec timeout 480 "$PY" bench/device_check.py "$@"
fi
exec "$PY" bench/device_check.py "$@"
