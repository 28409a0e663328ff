#!/usr/bin/env bash
# The second device call (one H200): after the split kernel's window change, this tree's
# fused_tp1 GPU tests again, and the small-T rows (T=1/16/64, every quant; eager at T=1) of this
# tree against the main tree (the device's root) in the same run, then this tree's eager row twice
# more (host timings vary run to run). Writes at most 8 files to $OUT.
set -u
ROOT=$PWD
TREE=$ROOT/.wt/tp1y
export CUDA_VISIBLE_DEVICES=0 PYTHONUNBUFFERED=1
ln -sfn ../kernels "$ROOT/fusion_bridge/kernels"
ln -sfn ../kernels "$TREE/fusion_bridge/kernels"
main_env() { PYTHONPATH=/tmp/fi-site:$ROOT "$@"; }
tree_env() { (cd "$TREE" && PYTHONPATH=/tmp/fi-site:$TREE "$@"); }
t0=$(date +%s)
phase() { echo "$1 $(( $(date +%s) - t0 )) s" | tee -a "$OUT/phases.txt"; }
main_env timeout 80 python3 "$TREE/benchmarks/tp1_warm.py" --tree "$ROOT" --tokens 1 16 64 \
  --hidden 7168 --jobs 3 >/tmp/tp1y_warm2.txt 2>&1 &
tree_env timeout 90 python3 -m pytest -q -n 12 -m gpu tests/kernels/test_tp1_shapes_and_graphs.py \
  >"$OUT/tests2.txt" 2>&1
phase tests
wait
tree_env timeout 40 python3 benchmarks/tp1_warm.py --tokens 1 16 64 --hidden 7168 --jobs 9 \
  >>/tmp/tp1y_warm2.txt 2>&1
phase warm
main_env timeout 30 python3 benchmarks/tp1_local.py --tokens 1 16 64 --hidden 7168 --emulated \
  >"$OUT/before2.txt" 2>&1
tree_env timeout 30 python3 benchmarks/tp1_local.py --tokens 1 16 64 --hidden 7168 --emulated \
  >"$OUT/after2.txt" 2>&1
for i in 1 2; do
  echo "== main, round $i" >>"$OUT/eager2.txt"
  main_env timeout 15 python3 benchmarks/tp1_local.py --tokens 1 --hidden 7168 --quant none \
    --emulated >>"$OUT/eager2.txt" 2>&1
  echo "== this tree, round $i" >>"$OUT/eager2.txt"
  tree_env timeout 15 python3 benchmarks/tp1_local.py --tokens 1 --hidden 7168 --quant none \
    --emulated >>"$OUT/eager2.txt" 2>&1
done
phase timing
tail -2 "$OUT/tests2.txt"
