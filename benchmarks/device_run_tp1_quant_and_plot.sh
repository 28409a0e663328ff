#!/usr/bin/env bash
# One GPU: the TP1 tables (none, fp8, nvfp4; re-tuned with fused_tp1 and the recorded spread) and the
# one-GPU plot (issue 26). Two parts, each fits one 10-minute call: PART=tune (default) or PART=bench.
# Writes to $OUT:
#   cache/*.json                 tables written by `tune` (install: benchmarks/install_default_table.py)
#   tune_tp1_<quant>.txt         the plan per bucket, why each route won, the measured spread
#   epilogue_h200_tp1.csv/.png   `bench` at TP1, T=1..4096 (the README's one-GPU plot)
# `tune`/`bench` set NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1 in
# every process they start.
set -u
OUT=${OUT:-/tmp/out}; mkdir -p "$OUT/cache"
export CUDA_VISIBLE_DEVICES=0 FUSION_BRIDGE_CACHE_DIR="$OUT/cache"
if [ "${PART:-tune}" = tune ]; then
  for quant in ${QUANTS:-none fp8 nvfp4}; do
    timeout ${TUNE_TIMEOUT:-180} python3 -m fusion_bridge tune --world-size 1 --quant "$quant" \
      > "$OUT/tune_tp1_$quant.txt" 2> "$OUT/tune_tp1_$quant.err"
    echo "tune $quant rc=$?"; cat "$OUT/tune_tp1_$quant.txt"; tail -3 "$OUT/tune_tp1_$quant.err"
  done
else
  # bench tunes its own buckets (T <= 4096) and saves that table: keep it out of the tuned tables
  FUSION_BRIDGE_CACHE_DIR="$OUT/bench_cache" timeout ${BENCH_TIMEOUT:-540} python3 -m fusion_bridge \
    bench --world-size 1 --csv "$OUT/epilogue_h200_tp1.csv" > "$OUT/bench_tp1.txt" 2> "$OUT/bench_tp1.err"
  echo "bench rc=$?"; tail -20 "$OUT/bench_tp1.txt"; tail -3 "$OUT/bench_tp1.err"
fi
