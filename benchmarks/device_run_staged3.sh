#!/usr/bin/env bash
# One device call for the two-shot (issue 24): the one-GPU twoshot tests alone on the GPU (-n 0),
# then the world-size-1 local-work benchmark against our two standalone kernels, same run.
#   device: source .device/fi-env.sh; cd .wt/<name> && ln -sfn ../kernels fusion_bridge/kernels &&
#           export PYTHONPATH=/tmp/fi-site:$PWD; bash benchmarks/device_run_staged3.sh LABEL...
# Env: TESTS=0 skips the tests, TEST_K selects some (pytest -k); MUTANT=1 runs a parity test on a
# deliberately broken copy (slot rows dropped from L2 before they are read: it must fail); ABLATE=1 adds --ablate; TOKENS / HIDDEN override the points.
set -uo pipefail
export PYTHONUNBUFFERED=1
t0=$(date +%s); el() { echo "[$(( $(date +%s) - t0 )) s] $*"; }
OUT=${OUT:-/tmp/out}; mkdir -p "$OUT"
if [ "${TESTS:-1}" != 0 ]; then
  el "one-GPU twoshot tests (-n 0)"
  timeout "${TEST_TIMEOUT:-200}" python3 -m pytest -q -n 0 -p no:cacheprovider \
    tests/kernels/test_symm_twoshot_emulated_on_one_gpu.py ${TEST_K:+-k "$TEST_K"} > "$OUT/gpu_tests.log" 2>&1
  tail -3 "$OUT/gpu_tests.log"; grep -E "^(FAILED|ERROR)" "$OUT/gpu_tests.log" | head
fi
if [ "${MUTANT:-0}" = 1 ]; then
  # a deliberate breakage on a copy of the tree: the row launch drops its slot rows from L2
  # BEFORE it reads them (it then reads whatever HBM held): the parity test must fail
  el "mutant: slot rows dropped before they are read (expect FAILED)"
  rm -rf /tmp/mut && mkdir -p /tmp/mut && cp -r . /tmp/mut/ 2>/dev/null
  python3 - <<'PY'
p = "/tmp/mut/kernels/symm_twoshot_kernels.py"
s = open(p).read()
a = "            s = tl.zeros([ROW_BLOCK], dtype=tl.float32)\n"
b = a + "            if L2 == 2:\n" + (
    "                _discard_rows(here + ii * row_elems, src_stride, hidden, ROW_BLOCK, 1)\n"
)
assert s.count(a) == 1
open(p, "w").write(s.replace(a, b))
PY
  (cd /tmp/mut && ln -sfn ../kernels fusion_bridge/kernels && PYTHONPATH=/tmp/fi-site:$PWD timeout 90 \
    python3 -m pytest -q -n 0 -p no:cacheprovider tests/kernels/test_symm_twoshot_emulated_on_one_gpu.py \
    -k "parity and H7168K8 and none and (W1 or W2)" 2>&1 | tail -3) | tee "$OUT/mutant.log"
fi
el "local work, world size 1"
extra=(); [ "${ABLATE:-0}" = 1 ] && extra+=(--ablate)
timeout "${BENCH_TIMEOUT:-300}" python3 benchmarks/twoshot_local.py \
  --tokens ${TOKENS:-1024 4096 8192} --hidden ${HIDDEN:-7168 4096} --twoshot "$@" "${extra[@]}" \
  --csv "$OUT/local.csv" > "$OUT/local.log" 2>&1
tail -60 "$OUT/local.log"
el done
