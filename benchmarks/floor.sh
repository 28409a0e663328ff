#!/usr/bin/env bash
# One device call (2x H200): the symm_fused_oneshot GPU tests, then the floor benchmark rows of the new
# kernel beside FlashInfer's fused kernel and today's composition (merged into the committed CSV).
#   source .device/fi-env.sh; bash benchmarks/floor.sh     (logs and the CSV land in $OUT)
# FULL=1 times every path (about twice as long).
set -uo pipefail
OUT="${OUT:-/tmp/floor_out}"; mkdir -p "$OUT"
nvidia-smi --query-gpu=name,clocks.sm,clocks.max.sm,temperature.gpu,utilization.gpu --format=csv,noheader > "$OUT/gpu_state.txt" 2>&1
timeout "${TEST_TIMEOUT:-180}" python3 -m pytest -q -s -x tests/distributed/test_symm_oneshot_two_gpus.py -p no:cacheprovider \
  > "$OUT/gpu_symm.log" 2>&1; echo "gpu tests rc=$?"
grep -E "symm gpu test|passed|failed|Error|^    " "$OUT/gpu_symm.log" | head -30 | cut -c1-300
if [ "${FULL:-0}" = 1 ]; then paths=(); else
  paths=(--paths symm_fused_oneshot symm_fused_oneshot_nvfp4 symm_ablate_no_peers fi_fused_moe_finalize
         compose_fin_fi_ar_norm fi_ar_norm finalize_alone symm_v); fi
FUSION_BRIDGE_SYMM_TIMEOUT_S=5 timeout "${BENCH_TIMEOUT:-200}" python3 benchmarks/floor.py --tokens 1 16 64 256 \
  "${paths[@]}" --merge benchmarks/results/floor_h200_tp2.csv --csv "$OUT/floor_h200_tp2.csv" \
  > "$OUT/floor.txt" 2> "$OUT/floor.err"; echo "floor rc=$?"
grep -v "^\s*$" "$OUT/floor.err" | grep -iE "error|exception" | head -8 | cut -c1-300; cat "$OUT/floor.txt"
