#!/usr/bin/env bash
# The second device call (one H200): this tree's GPU tests, the world-size-1 table of this tree
# against the main tree's in the same run, and two A/B sweeps of the whole-row kernel: 64-register
# cap on / off (then an env switch, now tp1_sweep.py --no-register-cap) and this tree against the first call's tree (twoshot at
# .wt/tp1x_c1: NVFP4 codes by seven comparisons). Run from the root of the device's copy of
# /work/main after `source .device/fi-env.sh`; writes to $OUT.
set -u
ROOT=$PWD
TREE=$ROOT/.wt/tp1x
C1=$ROOT/.wt/tp1x_c1
TOKENS="1 16 64 256 1024 4096 8192"
ROWS="64 256 1024 4096"
export CUDA_VISIBLE_DEVICES=0
for t in "$ROOT" "$TREE" "$C1"; do ln -sfn ../kernels "$t/fusion_bridge/kernels"; done
main_env() { PYTHONPATH=/tmp/fi-site:$ROOT "$@"; }
tree_env() { (cd "$TREE" && PYTHONPATH=/tmp/fi-site:$TREE "$@"); }
c1_env() { (cd "$C1" && PYTHONPATH=/tmp/fi-site:$C1 "$@"); }
SWEEP="benchmarks/tp1_sweep.py --tokens 64 256 1024 4096 --quant-tokens 64 256 1024 4096"
t0=$(date +%s)
phase() { echo "$1 $(( $(date +%s) - t0 )) s" | tee -a "$OUT/phases.txt"; }
# 1. compiles (CPU), the tests that share the GPU
main_env timeout 90 python3 "$TREE/benchmarks/tp1_warm.py" --tree "$ROOT" --tokens 1 16 64 256 \
  --hidden 7168 --jobs 3 >"$OUT/warm_main.txt" 2>&1 &
main_env timeout 90 python3 "$TREE/benchmarks/tp1_warm.py" --tree "$ROOT" --tokens 1 16 64 256 \
  --hidden 4096 --quant none --jobs 1 >"$OUT/warm_main_h4096.txt" 2>&1 &
tree_env timeout 90 python3 $SWEEP --warm-only --jobs 1 >"$OUT/warm_sweep.txt" 2>&1 &
tree_env env FUSION_BRIDGE_TP1_MAXNREG=0 timeout 90 python3 $SWEEP --warm-only --jobs 2 \
  >"$OUT/warm_sweep_uncapped.txt" 2>&1 &
c1_env timeout 90 python3 $SWEEP --quant nvfp4 --warm-only --jobs 1 >"$OUT/warm_c1.txt" 2>&1 &
tree_env timeout 95 python3 -m pytest -q -n 9 -m gpu tests/kernels/test_tp1_shapes_and_graphs.py \
  tests/kernels/test_blocks_and_local_fused_nccl_on_gpu.py tests/kernels/test_launch_cache_compiled.py \
  -k "(tp1 and ((parity_grid and -8-) or split_rows or graph or reciprocal)) or local_fused_parity_grid[7168-8 or launcher" \
  >"$OUT/tests.txt" 2>&1
phase tests
wait
phase compiles
# 2. timing, one at a time
main_env timeout 40 python3 benchmarks/tp1_local.py --tokens $TOKENS --hidden 7168 --emulated \
  --csv "$OUT/before.csv" >"$OUT/before.txt" 2>&1
main_env timeout 20 python3 benchmarks/tp1_local.py --tokens 1 16 64 256 1024 4096 --hidden 4096 \
  --quant none --emulated --csv "$OUT/before_h4096.csv" >"$OUT/before_h4096.txt" 2>&1
phase before
tree_env timeout 40 python3 benchmarks/tp1_local.py --tokens $TOKENS --hidden 7168 --emulated \
  --csv "$OUT/after.csv" >"$OUT/after.txt" 2>&1
tree_env timeout 20 python3 benchmarks/tp1_local.py --tokens 1 16 64 256 1024 4096 --hidden 4096 \
  --quant none --emulated --csv "$OUT/after_h4096.csv" >"$OUT/after_h4096.txt" 2>&1
phase after
tree_env timeout 30 python3 $SWEEP --csv "$OUT/sweep_capped.csv" >"$OUT/sweep_capped.txt" 2>&1
tree_env env FUSION_BRIDGE_TP1_MAXNREG=0 timeout 30 python3 $SWEEP \
  --csv "$OUT/sweep_uncapped.csv" >"$OUT/sweep_uncapped.txt" 2>&1
c1_env timeout 20 python3 $SWEEP --quant nvfp4 --csv "$OUT/sweep_c1.csv" >"$OUT/sweep_c1.txt" 2>&1
phase sweeps
# 3. the kernels that share the changed building blocks, ranks emulated (the GPU alone)
tree_env timeout 45 python3 -m pytest -q -m gpu tests/kernels/test_symm_oneshot_emulated_on_one_gpu.py -k oneshot \
  >"$OUT/tests_symm.txt" 2>&1
phase symm
tail -2 "$OUT/tests.txt" "$OUT/tests_symm.txt"
