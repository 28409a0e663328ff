#!/usr/bin/env bash
# A shorter device call: GPU tests, kernel tests on the GPU, the kernel benchmark, the host overhead.
set -uo pipefail
R="$OUT/res"; mkdir -p "$R"
timeout 150 python3 -m pytest -q -m gpu tests/ -p no:cacheprovider > "$R/gpu_tests.log" 2>&1; tail -1 "$R/gpu_tests.log"
timeout 60 python3 -m pytest -q tests/test_kernels_cpu.py -p no:cacheprovider > "$R/kernel_tests_on_gpu.log" 2>&1; tail -1 "$R/kernel_tests_on_gpu.log"
CUDA_VISIBLE_DEVICES=0 timeout 60 python3 benchmarks/host_overhead.py 2>&1 | tail -4
CUDA_VISIBLE_DEVICES=0 timeout 120 python3 benchmarks/bench_local_kernels.py --csv "$R/local_kernels_h200.csv" > "$R/local_kernels.txt" 2>&1
grep -E "^(finalize_add|add_rmsnorm)" "$R/local_kernels.txt" | awk '$2>=1024 || $2<=1'
tar czf "$OUT/results.tgz" -C "$OUT" res && rm -rf "$R"
