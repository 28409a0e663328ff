#!/usr/bin/env bash
# Two-GPU device run: every GPU test (2x H200), `tune` at TP2 (table under $OUT/cache), and one more A/B
# pair of auto between .ab/before and .ab/after. Logs under $OUT; short summaries printed.
set -u
OUT=${OUT:-/tmp/out}; mkdir -p "$OUT/cache"
timeout ${TEST_TIMEOUT:-300} python3 -m pytest -m gpu -q -p no:cacheprovider tests > "$OUT/gpu_tests.txt" 2>&1
echo "gpu tests rc=$?"; grep -E "^(FAILED|ERROR)|passed|failed" "$OUT/gpu_tests.txt" | tail -15
FUSION_BRIDGE_CACHE_DIR="$OUT/cache" timeout ${TUNE_TIMEOUT:-150} python3 -m fusion_bridge tune --world-size 2 \
  > "$OUT/tune_tp2.txt" 2>"$OUT/tune_tp2.err"; echo "tune rc=$?"; cat "$OUT/tune_tp2.txt"; tail -2 "$OUT/tune_tp2.err" | cut -c1-300
for tree in before after; do
  timeout 60 python3 benchmarks/ab_auto.py --tree .ab/$tree --out /tmp/ab.json 2>>"$OUT/ab.err" | tee -a "$OUT/ab.jsonl" | cut -c1-300
done
