#!/usr/bin/env bash
# One device call (one H200): the world-size-1 kernel of this tree against the main tree's, same run.
# Run from the root of the device's copy of /work/main, this tree twoshot at .wt/tp1x
# (bash /work/tools/device-stage.sh tp1x), after `source .device/fi-env.sh`; writes to $OUT.
#   1. compile in parallel: main's defaults (tp1_warm.py), this tree's sweep variants
#      (tp1_sweep.py --warm-only), this tree's one-GPU tests at H=7168 (pytest -n 8)
#   2. time, one after another: main's tp1_local.py, this tree's sweep, this tree's tp1_local.py
set -u
ROOT=$PWD
TREE=$ROOT/.wt/tp1x
TOKENS="1 16 64 256 1024 4096"
SWEEP_TOKENS="1 16 32 64 256 1024 4096"
export CUDA_VISIBLE_DEVICES=0
ln -sfn ../kernels "$TREE/fusion_bridge/kernels"
ln -sfn ../kernels "$ROOT/fusion_bridge/kernels"
main_env() { PYTHONPATH=/tmp/fi-site:$ROOT "$@"; }
tree_env() { (cd "$TREE" && PYTHONPATH=/tmp/fi-site:$TREE "$@"); }
t0=$(date +%s)
main_env timeout 120 python3 "$TREE/benchmarks/tp1_warm.py" --tree "$ROOT" --tokens 1 16 64 256 --jobs 3 >"$OUT/warm_main.txt" 2>&1 &
tree_env timeout 120 python3 benchmarks/tp1_sweep.py --tokens $SWEEP_TOKENS --quant-tokens 16 64 256 1024 4096 \
  --warm-only --jobs 5 >"$OUT/warm_tree.txt" 2>&1 &
tree_env timeout 130 python3 -m pytest -q -n 8 -m gpu tests/kernels/test_tp1_shapes_and_graphs.py -k \
  "7168-8 or split_rows or graph or reciprocal" >"$OUT/tests.txt" 2>&1
echo "tests done $(( $(date +%s) - t0 )) s" | tee -a "$OUT/phases.txt"
wait
echo "compiles done $(( $(date +%s) - t0 )) s" | tee -a "$OUT/phases.txt"
main_env timeout 60 python3 benchmarks/tp1_local.py --tokens $TOKENS --hidden 7168 --emulated \
  --csv "$OUT/before.csv" >"$OUT/before.txt" 2>&1
echo "before done $(( $(date +%s) - t0 )) s" | tee -a "$OUT/phases.txt"
tree_env timeout 90 python3 benchmarks/tp1_sweep.py --tokens $SWEEP_TOKENS \
  --quant-tokens 16 64 256 1024 4096 --jobs 4 --csv "$OUT/sweep.csv" >"$OUT/sweep.txt" 2>&1
echo "sweep done $(( $(date +%s) - t0 )) s" | tee -a "$OUT/phases.txt"
tree_env timeout 50 python3 benchmarks/tp1_local.py --tokens $TOKENS --hidden 7168 --emulated \
  --csv "$OUT/after.csv" >"$OUT/after.txt" 2>&1
echo "after done $(( $(date +%s) - t0 )) s" | tee -a "$OUT/phases.txt"
tail -3 "$OUT/tests.txt"
