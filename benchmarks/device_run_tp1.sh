#!/usr/bin/env bash
# One-GPU device run: the one-GPU GPU tests, then `tune` at TP1 (table and its eager times under $OUT/cache).
set -u
OUT=${OUT:-/tmp/out}; mkdir -p "$OUT/cache"
export CUDA_VISIBLE_DEVICES=0 FUSION_BRIDGE_CACHE_DIR="$OUT/cache"
timeout ${TEST_TIMEOUT:-240} python3 -m pytest -q -p no:cacheprovider tests/test_gpu_local.py tests/test_gpu_launcher.py \
  tests/test_kernels_cpu.py tests/test_overflow.py tests/test_custom_ops.py 2>&1 | tee "$OUT/gpu_tests_tp1.txt" | tail -12
timeout ${TUNE_TIMEOUT:-200} python3 -m fusion_bridge tune --world-size 1 > "$OUT/tune_tp1.txt" 2>"$OUT/tune_tp1.err"
echo "tune rc=$?"; cat "$OUT/tune_tp1.txt"; tail -3 "$OUT/tune_tp1.err"
