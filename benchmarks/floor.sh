#!/usr/bin/env bash
# One device call (2x H200): the symm_fused_oneshot GPU tests, then the floor benchmark.
#   source .device/fi-env.sh; bash benchmarks/floor.sh     (logs and the CSV land in $OUT)
set -uo pipefail
OUT="${OUT:-/tmp/floor_out}"; mkdir -p "$OUT"
timeout "${TEST_TIMEOUT:-240}" python3 -m pytest -q -x tests/test_gpu_symm_oneshot.py -p no:cacheprovider \
  > "$OUT/gpu_symm.log" 2>&1; echo "gpu tests rc=$?"; tail -25 "$OUT/gpu_symm.log" | cut -c1-400
timeout "${BENCH_TIMEOUT:-270}" python3 benchmarks/floor.py --csv "$OUT/floor_h200_tp2.csv" > "$OUT/floor.txt" \
  2> "$OUT/floor.err"; echo "floor rc=$?"
grep -v "^\s*$" "$OUT/floor.err" | grep -iE "error|exception" | head -8 | cut -c1-300; cat "$OUT/floor.txt"
