#!/usr/bin/env bash
# One device call for programmatic dependent launch (kernels/pdl.py): the GPU tests (-n 12), a
# mutant copy of the tree whose PDL kernels skip griddepcontrol.wait (the PDL test must fail), the
# same-run PDL off/on tables of fused_tp1 (tp1_local --pdl-ab) and of the two-shot
# (twoshot_local pdl_off / pdl_on, with the standalone kernels), then the one-GPU twoshot tests (-n 0).
#   device: source .device/fi-env.sh; cd .wt/<name> && ln -sfn ../kernels fusion_bridge/kernels &&
#           export PYTHONPATH=/tmp/fi-site:$PWD; bash benchmarks/device_run_pdl.sh
# Env: TOKENS / HIDDEN / QUANTS override tp1_local's points; the last step gets what is left of
# BUDGET_S (250) seconds, or TWOSHOT_TIMEOUT.
set -uo pipefail
export PYTHONUNBUFFERED=1
t0=$(date +%s); el() { echo "[$(( $(date +%s) - t0 )) s] $*" | tee -a "$OUT/steps.log"; }
OUT=${OUT:-/tmp/out}; mkdir -p "$OUT"
TOKENS=${TOKENS:-1 16 64 256 1024 4096}; HIDDEN=${HIDDEN:-7168 4096}; QUANTS=${QUANTS:-none nvfp4}
nvidia-smi --query-gpu=name,clocks.sm,clocks.mem --format=csv,noheader | tee -a "$OUT/steps.log"
el "GPU tests -n 12, with the benchmarks' kernels compiled alongside (outputs discarded)"
for h in $HIDDEN; do for q in $QUANTS; do
  timeout 100 python3 benchmarks/tp1_local.py --tokens $TOKENS --hidden $h --quant $q --emulated \
    --no-two-launch --pdl-ab > /dev/null 2>&1 &
done; done
timeout 100 python3 benchmarks/twoshot_local.py --tokens 1024 --hidden $HIDDEN --twoshot pdl_off pdl_on \
  --ablate > /dev/null 2>&1 &
timeout 150 python3 -m pytest -q -n 12 -m gpu -p no:cacheprovider tests/kernels/test_tp1_shapes_and_graphs.py \
  tests/kernels/test_blocks_and_local_fused_nccl_on_gpu.py tests/kernels/test_launch_cache_compiled.py tests/kernels/test_pdl_late_writer.py > "$OUT/tests_n12.log" 2>&1
tail -2 "$OUT/tests_n12.log" | tee -a "$OUT/steps.log"; grep -E "^(FAILED|ERROR)" "$OUT/tests_n12.log" | head
el "mutant: the PDL kernels skip griddepcontrol.wait (expect the tp1 PDL test FAILED)"
rm -rf /tmp/mut && mkdir -p /tmp/mut && cp -r . /tmp/mut/ 2>/dev/null
python3 - <<'PY'
p = "/tmp/mut/kernels/pdl.py"
s = open(p).read()
a = "    if USE_PDL:\n        gdc_wait()\n"
assert s.count(a) == 1
open(p, "w").write(s.replace(a, "    if USE_PDL:\n"))
PY
(cd /tmp/mut && ln -sfn ../kernels fusion_bridge/kernels && PYTHONPATH=/tmp/fi-site:$PWD timeout 60 \
  python3 -m pytest -q -n 4 -p no:cacheprovider tests/kernels/test_pdl_late_writer.py 2>&1 | tail -8) > "$OUT/mutant.log"
cat "$OUT/mutant.log" >> "$OUT/steps.log"
wait
el "tp1_local PDL off/on (GPU alone)"
timeout 120 python3 benchmarks/tp1_local.py --tokens $TOKENS --hidden $HIDDEN --quant $QUANTS --emulated \
  --no-two-launch --pdl-ab --csv "$OUT/tp1_pdl.csv" > "$OUT/tp1_pdl.log" 2>&1
el "twoshot_local PDL off/on beside the standalone kernels"
timeout 90 python3 benchmarks/twoshot_local.py --tokens 1024 4096 8192 --hidden $HIDDEN \
  --twoshot pdl_off pdl_on --ablate --csv "$OUT/twoshot_pdl.csv" > "$OUT/twoshot_pdl.log" 2>&1
tail -16 "$OUT/twoshot_pdl.log"
el "one-GPU twoshot tests -n 0 (GPU alone)"
left=$(( ${BUDGET_S:-250} - ($(date +%s) - t0) )); [ "$left" -lt 20 ] && left=20
timeout "${TWOSHOT_TIMEOUT:-$left}" python3 -m pytest -q -n 0 -p no:cacheprovider \
  tests/kernels/test_symm_twoshot_emulated_on_one_gpu.py > "$OUT/twoshot_tests.log" 2>&1
tail -2 "$OUT/twoshot_tests.log" | tee -a "$OUT/steps.log"; grep -E "^(FAILED|ERROR)" "$OUT/twoshot_tests.log" | head
el done
