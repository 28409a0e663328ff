#!/usr/bin/env bash
# One device call: the ring kernel's W=1 local work against our standalone kernels, a shape sweep
# and the stage ablation (finalize alone, finalize + reduce). Writes into $OUT.
set -u
mkdir -p "$OUT"
timeout 330 python3 benchmarks/ring_local.py --hidden 7168 --tokens 1024 4096 8192 \
    --variants default w16_f2x4096_r1x4096 --ablate \
    --csv "$OUT/ring_sweep_a.csv" 2>&1 | tee "$OUT/sweep_a.txt"
timeout 200 python3 benchmarks/ring_local.py --hidden 7168 --tokens 4096 8192 \
    --variants w16_f1x4096_r1x4096 w16_f4x1024_r2x2048 w16_f2x2048_r1x4096 \
    --csv "$OUT/ring_sweep_b.csv" 2>&1 | tee "$OUT/sweep_b.txt"
