#!/usr/bin/env bash
# One device call (2x H200): GPU tests, kernel benchmark, epilogue benchmark at TP2 and TP1.
# Everything lands in $OUT/res, packed as $OUT/results.tgz (the device returns at most 8 files).
set -uo pipefail
R="$OUT/res"; mkdir -p "$R"; export FUSION_BRIDGE_CACHE_DIR="$R/tables"
timeout 150 python3 -m pytest -q -m gpu tests/ -p no:cacheprovider > "$R/gpu_tests.log" 2>&1; tail -3 "$R/gpu_tests.log"
timeout 60 python3 -m pytest -q tests/kernels/test_blocks.py -p no:cacheprovider > "$R/kernel_tests_on_gpu.log" 2>&1; tail -1 "$R/kernel_tests_on_gpu.log"
CUDA_VISIBLE_DEVICES=0 timeout 120 python3 benchmarks/bench_local_kernels.py --csv "$R/local_kernels_h200.csv" > "$R/local_kernels.txt" 2>&1
grep -E "^(finalize_add|add_rmsnorm)" "$R/local_kernels.txt" | awk '$2>=1024 || $2<=1' ; grep sweep "$R/local_kernels.txt" | cut -c1-200
timeout 300 python3 -m fusion_bridge bench --world-size 2 --csv "$R/epilogue_h200_tp2.csv" > "$R/bench_tp2.txt" 2>"$R/bench_tp2.err"; echo "tp2 rc=$?"
tail -20 "$R/bench_tp2.txt"; tail -5 "$R/bench_tp2.err"
CUDA_VISIBLE_DEVICES=0 timeout 150 python3 -m fusion_bridge bench --world-size 1 --csv "$R/epilogue_h200_tp1.csv" > "$R/bench_tp1.txt" 2>"$R/bench_tp1.err"; echo "tp1 rc=$?"
tail -16 "$R/bench_tp1.txt"; tail -3 "$R/bench_tp1.err"
tar czf "$OUT/results.tgz" -C "$OUT" res && rm -rf "$R"
