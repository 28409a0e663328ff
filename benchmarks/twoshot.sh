#!/usr/bin/env bash
# One device call (2x H200): the symm_fused_twoshot GPU tests, then the floor benchmark's large-T rows
# (the two-shot kernel beside FlashInfer's fused kernel, today's compositions and the one-shot kernel).
#   source .device/fi-env.sh; bash benchmarks/twoshot.sh     (logs and the CSV land in $OUT)
# TESTS=0 skips the tests; TOKENS / HIDDEN / PATHS override the benchmark's grid.
set -uo pipefail
OUT="${OUT:-/tmp/twoshot_out}"; mkdir -p "$OUT"
nvidia-smi --query-gpu=name,clocks.sm,clocks.max.sm,temperature.gpu,utilization.gpu --format=csv,noheader > "$OUT/gpu_state.txt" 2>&1
if [ "${TESTS:-1}" = 1 ]; then
  timeout "${TEST_TIMEOUT:-300}" python3 -m pytest -q -s -x tests/test_gpu_symm_twoshot.py -p no:cacheprovider \
    > "$OUT/gpu_twoshot.log" 2>&1; echo "gpu tests rc=$?"
  grep -E "twoshot gpu test|passed|failed|Error|^    " "$OUT/gpu_twoshot.log" | head -30 | cut -c1-300
fi
read -r -a tokens <<< "${TOKENS:-129 512 1024 2048 4096}"
read -r -a hidden <<< "${HIDDEN:-7168 4096}"
read -r -a paths <<< "${PATHS:-symm_fused_twoshot symm_fused_twoshot_nvfp4 symm_fused_oneshot compose_fin_fi_ar_norm compose_fin_fi_ar_norm_twoshot fi_fused_moe_finalize finalize_alone symm2_v}"
FUSION_BRIDGE_SYMM_TIMEOUT_S=5 timeout "${BENCH_TIMEOUT:-300}" python3 benchmarks/floor.py --tokens "${tokens[@]}" \
  --hidden "${hidden[@]}" --paths "${paths[@]}" --merge benchmarks/results/floor_h200_tp2.csv \
  --csv "$OUT/floor_h200_tp2.csv" > "$OUT/floor.txt" 2> "$OUT/floor.err"; echo "floor rc=$?"
grep -v "^\s*$" "$OUT/floor.err" | grep -iE "error|exception" | head -8 | cut -c1-300; cat "$OUT/floor.txt"
