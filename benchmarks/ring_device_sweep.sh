#!/usr/bin/env bash
# Device call for the ring kernel (into $OUT): RING_TESTS=1 runs its emulated-ranks GPU tests alone
# on the GPU first; then its W=1 local work against our standalone kernels (RING_HIDDEN,
# RING_VARIANTS, RING_ABLATE=--ablate for the finalize stage alone).
set -u
mkdir -p "$OUT"
if [ "${RING_TESTS:-0}" = 1 ]; then
    timeout 250 python3 -m pytest -q -n 0 -p no:cacheprovider --timeout 120 \
        tests/test_gpu_symm_ring_one_device.py 2>&1 | tail -40 | tee "$OUT/gpu_ring_tests.txt"
fi
timeout 280 python3 benchmarks/ring_local.py --hidden ${RING_HIDDEN:-7168 4096} \
    --tokens 1024 4096 8192 --variants ${RING_VARIANTS:-default} ${RING_ABLATE:-} \
    --csv "$OUT/ring_local.csv" 2>&1 | tee "$OUT/ring_local.txt"
