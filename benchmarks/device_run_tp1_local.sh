#!/usr/bin/env bash
# One GPU, world size 1 (issue 23's evidence in one call): fused_tp1's GPU tests (xdist: the
# parity grid is parametrized so the compiles run in parallel), the one-shot kernel's
# emulated-ranks tests, then benchmarks/tp1_local.py (one launch vs two launches vs the byte
# floor, quant cost, eager cost), and with SWEEP_TOKENS set the launch-shape sweep. Writes to
# $OUT: gpu_tests_*.txt, tp1_local.txt/.csv, tp1_sweep.txt/.csv.
set -u
OUT=${OUT:-/tmp/out}; mkdir -p "$OUT"
export CUDA_VISIBLE_DEVICES=0
timeout ${TEST_TIMEOUT:-150} python3 -m pytest -q -n 12 -m gpu tests/kernels/test_tp1_shapes_and_graphs.py \
  > "$OUT/gpu_tests_fused_tp1.txt" 2>&1
echo "fused_tp1 tests rc=$?"; tail -4 "$OUT/gpu_tests_fused_tp1.txt"
if [ -z "${SKIP_SYMM_TESTS:-}" ]; then
  timeout ${TEST_TIMEOUT:-150} python3 -m pytest -q -n 4 -m gpu tests/kernels/test_symm_oneshot_emulated_on_one_gpu.py \
    -k oneshot > "$OUT/gpu_tests_symm_one_device.txt" 2>&1
  echo "symm_one_device tests rc=$?"; tail -4 "$OUT/gpu_tests_symm_one_device.txt"
fi
timeout ${BENCH_TIMEOUT:-240} python3 benchmarks/tp1_local.py \
  --tokens ${TOKENS:-1 16 64 256 1024 4096 8192} --hidden ${HIDDEN:-7168 4096} \
  --emulated ${EMULATED:-1 16} --csv "$OUT/tp1_local.csv" > "$OUT/tp1_local.txt" 2>&1
echo "tp1_local rc=$?"; cat "$OUT/tp1_local.txt"
if [ -n "${SWEEP_TOKENS:-}" ]; then  # the launch shapes per T (benchmarks/tp1_sweep.py)
  timeout ${SWEEP_TIMEOUT:-120} python3 benchmarks/tp1_sweep.py --tokens $SWEEP_TOKENS \
    --quant ${SWEEP_QUANT:-none} --csv "$OUT/tp1_sweep.csv" > "$OUT/tp1_sweep.txt" 2>&1
  echo "tp1_sweep rc=$?"; cat "$OUT/tp1_sweep.txt"
fi
