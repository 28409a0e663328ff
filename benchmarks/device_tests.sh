#!/usr/bin/env bash
# One device call: the GPU tests (2x H200) and the kernel benchmark (1 GPU). Logs and CSVs go to $OUT.
set -uo pipefail
nvidia-smi --query-gpu=name,memory.used --format=csv,noheader
python3 -m pytest -q -m gpu tests/ -p no:cacheprovider 2>&1 | tee "$OUT/gpu_tests.log" | tail -25
python3 -m pytest -q tests/kernels/test_blocks.py -p no:cacheprovider 2>&1 | tee "$OUT/kernel_tests_on_gpu.log" | tail -3
CUDA_VISIBLE_DEVICES=0 python3 benchmarks/bench_local_kernels.py --csv "$OUT/local_kernels_h200.csv" 2>&1 | tail -70
