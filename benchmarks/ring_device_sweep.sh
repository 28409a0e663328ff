#!/usr/bin/env bash
# Device call for the ring kernel (one H200; into $OUT): RING_TESTS=1 runs its emulated-ranks GPU
# tests first, alone on the GPU (W >= 2 need every program resident: no xdist workers beside them);
# then its W=1 local work against our standalone kernels (RING_HIDDEN, RING_VARIANTS,
# RING_ABLATE=--ablate: the finalize stage alone and our finalize in the ring's program shape,
# RING_EMULATE="2": emulated ranks). (The old two-shot kernel's local work, RING_TWOSHOT=1, went
# with that kernel: its measured rows stay in benchmarks/results/.)
#   source .device/fi-env.sh; RING_TESTS=1 RING_ABLATE=--ablate bash benchmarks/ring_device_sweep.sh
set -u
OUT="${OUT:-/tmp/ring_out}"; mkdir -p "$OUT"
if [ "${RING_TESTS:-0}" = 1 ]; then
    timeout "${RING_TEST_TIMEOUT:-250}" python3 -m pytest -q -n 0 -p no:cacheprovider --timeout 100 \
        tests/test_gpu_symm_ring_one_device.py 2>&1 | tail -30 | tee "$OUT/gpu_ring_tests.txt"
fi
timeout "${RING_BENCH_TIMEOUT:-280}" python3 benchmarks/ring_local.py \
    --hidden ${RING_HIDDEN:-7168 4096} --tokens ${RING_TOKENS:-1024 4096 8192} --variants ${RING_VARIANTS:-default} \
    ${RING_ABLATE:-} --emulate ${RING_EMULATE:-} --csv "$OUT/ring_local.csv" 2>&1 \
    | grep -v "^  check" | tee "$OUT/ring_local.txt"
