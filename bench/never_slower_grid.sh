#!/usr/bin/env bash
# The never-slower grid of issue 56 (BENCHMARKS.md §25), end to end: every shipped drafter x workloads (code
# greedy, prose at T 0.7, code at T 1.3) x plain / fixed γ / adaptive, one request at a time (never_slower.py),
# 8 and 16 requests batched in process (bench-batch), then the HTTP API at 1, 8 and 16 clients for the default
# drafter (bench-serve --batched 16). 1 torch thread; about 80 minutes on the 2-core reference machine.
#
#   bash bench/never_slower_grid.sh [OUT]        (default OUT: runs/never-slower-grid)
#   python bench/never_slower.py --from-reports --batch-from OUT/batch --out OUT/single   (the tables again)
set -euo pipefail
OUT=${1:-runs/never-slower-grid}
PY=${PY:-.venv/bin/python}
SPECSERVE=${SPECSERVE:-.venv/bin/specserve}
export RAY_USAGE_STATS_ENABLED=0 HF_HUB_OFFLINE=1 HF_HUB_DISABLE_TELEMETRY=1 OMP_NUM_THREADS=1
mkdir -p "$OUT/batch"
"$PY" -c "import json, sys; from specserve.benchmarks.prompts import prose_prompts; json.dump(prose_prompts(8), open(sys.argv[1], 'w'))" "$OUT/prose.json"

# 1. one request at a time, in process
"$PY" bench/never_slower.py --workloads code-t0,prose-t0.7,code-t1.3 --rounds "${ROUNDS:-2}" --out "$OUT/single"

# 2. 8 and 16 requests, batched in process: plain, fixed γ 2 and 3, adaptive (sequential: the exactness reference)
declare -A SPEC=([draft]=models/draft [eagle]=eagle:models/eagle [medusa]=medusa:models/medusa
                 [layerskip]=layerskip:models/exit-head [ngram]=ngram [suffix]=suffix)
for name in draft eagle medusa layerskip ngram suffix; do
  common=(--draft "${SPEC[$name]}" --concurrency 8,16 --modes sequential,plain,gamma,adaptive --gammas 2,3
          --max-new-tokens 64 --threads 1)
  "$SPECSERVE" bench-batch "${common[@]}" --temperatures 0,1.3 --num-prompts 16 --out "$OUT/batch/$name-code.json"
  "$SPECSERVE" bench-batch "${common[@]}" --temperatures 0.7 --prompts "$OUT/prose.json" --num-prompts 8 \
    --out "$OUT/batch/$name-prose.json"
done

# 3. the HTTP API (OpenAI completions, streamed), the default drafter: one-at-a-time and batched replicas
"$SPECSERVE" bench-serve --batched 16 --gammas 2,3 --concurrency 1,8,16 --requests 4,16,32 --rounds 1 \
  --max-tokens 64 --out "$OUT/http"
