#!/usr/bin/env bash
# One device call that re-checks the final tree on one GPU: the one-GPU test files (xdist: the Triton
# compiles are the cost), the emulated-ranks two-shot tests alone (they need the GPU to themselves), and a
# same-run A/B of the symmetric-memory kernels against older trees. Logs go to $OUT.
#
#   here:    git archive 5a52f1a | (mkdir -p .wt/pre && tar -C .wt/pre -xf -)   # .wt is git-excluded
#   device:  run with carry [".device", ".wt/pre"] and the command
#            source .device/fi-env.sh; bash benchmarks/device_verify_one_gpu.sh .wt/pre
#
# Arguments: older tree roots to A/B against this one (none: no A/B). About 3 minutes without T=4096
# in the A/B (its first run on 2026-12-01 cut every T=4096 run at a 60 s cap), more with it.
set -uo pipefail
export PYTHONUNBUFFERED=1
root=$PWD; t0=$(date +%s); el() { echo "[$(( $(date +%s) - t0 )) s] $*"; }
OUT=${OUT:-/tmp/out}; mkdir -p "$OUT"
el "one-GPU tests"
timeout 260 python3 -m pytest -q -n 14 -m gpu -p no:cacheprovider --timeout 200 \
  tests/kernels/test_symm_oneshot_emulated_on_one_gpu.py tests/kernels/test_tp1_shapes_and_graphs.py tests/kernels/test_blocks_and_local_fused_nccl_on_gpu.py \
  tests/kernels/test_launch_cache_compiled.py tests/integrations/test_hf_transformers_on_gpu.py > "$OUT/gpu_tests.log" 2>&1
tail -3 "$OUT/gpu_tests.log"; grep -E "^(FAILED|ERROR)" "$OUT/gpu_tests.log" | head
el "emulated-ranks two-shot tests, alone on the GPU"
timeout 150 python3 -m pytest -q -n 0 -p no:cacheprovider tests/kernels/test_symm_twoshot_emulated_on_one_gpu.py \
  > "$OUT/twoshot_tests.log" 2>&1
tail -3 "$OUT/twoshot_tests.log"
[ $# -gt 0 ] || { el "no older trees given: no A/B"; exit 0; }
el "A/B: one-shot W=2 emulated (AB_CASES), H=7168 K=8, graph"
# the old two-shot kernel is gone from this tree: the A/B times the one-shot
export AB_CASES=${AB_CASES:-oneshot:2} AB_LOCAL=0 AB_TOKENS=${AB_TOKENS:-1,64,1024,4096}
for tree in "$@" . "$@" .; do  # each tree twice, interleaved
  [ "$tree" = . ] || ln -sfn ../kernels "$tree/fusion_bridge/kernels"
  label=$(basename "$(cd "$tree" && pwd)")
  (cd "$tree" && PYTHONPATH=/tmp/fi-site:$PWD timeout 150 python3 "$root/benchmarks/ab_kernels.py" \
    "$label" 2>&1 | grep '"graph"') >> "$OUT/ab.jsonl"
done
python3 - "$OUT/ab.jsonl" <<'PY'
import json, statistics, sys
rows = [json.loads(line) for line in open(sys.argv[1]) if line.strip()]
by = {}
for r in rows:
    by.setdefault((r["path"], r["W"], r["T"]), {}).setdefault(r["tree"], []).append(r["us"])
for key, trees in sorted(by.items()):
    print(*key, {t: round(statistics.median(v), 2) for t, v in trees.items()})
PY
el done
