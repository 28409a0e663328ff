#!/usr/bin/env bash
# Device run: the GPU test suite (minus files given in $SKIP), then A/B of auto between .ab/before and
# .ab/after (alternating, twice each), then the eager-cost benchmark. Logs under $OUT.
set -u
OUT=${OUT:-/tmp/out}; mkdir -p "$OUT"
nvidia-smi --query-gpu=name,memory.used --format=csv > "$OUT/gpus.txt"
timeout ${TEST_TIMEOUT:-300} python3 -m pytest -m gpu -q -x -p no:cacheprovider ${SKIP:-} tests 2>&1 | tee "$OUT/gpu_tests.txt" | tail -15
for tree in before after before after; do
  timeout 90 python3 benchmarks/ab_auto.py --tree .ab/$tree --out /tmp/ab.json 2>>"$OUT/ab.err" | tee -a "$OUT/ab.jsonl" | cut -c1-400
done
timeout ${EAGER_TIMEOUT:-150} python3 -m benchmarks.eager_cost > "$OUT/eager.txt" 2>"$OUT/eager.err"; tail -30 "$OUT/eager.txt"; tail -5 "$OUT/eager.err"
cp benchmarks/results/eager_cost_h200.csv "$OUT/" 2>/dev/null
