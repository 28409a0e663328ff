#!/usr/bin/env bash
# One device call (one H200): this tree's world-size-1 GPU tests, a deliberately broken copy of the
# NVFP4 block-scale test (it must fail), the world-size-1 table of this tree against the main tree
# (the device's root) in the same run (H=7168 none and nvfp4; this tree also fp8 and H=4096 none and nvfp4), the H=4096
# whole-row warps sweep and the 64-register cap's A/B (tp1_sweep.py --no-register-cap against the
# default, default shapes only). Run from the root of the device's copy of /work/main after
# `source .device/fi-env.sh`, this tree twoshot at .wt/tp1y; writes at most 8 files to $OUT.
set -u
ROOT=$PWD
TREE=$ROOT/.wt/tp1y
BROKEN=/tmp/tp1y_broken
export CUDA_VISIBLE_DEVICES=0 PYTHONUNBUFFERED=1
ln -sfn ../kernels "$ROOT/fusion_bridge/kernels"
ln -sfn ../kernels "$TREE/fusion_bridge/kernels"
main_env() { PYTHONPATH=/tmp/fi-site:$ROOT "$@"; }
tree_env() { (cd "$TREE" && PYTHONPATH=/tmp/fi-site:$TREE "$@"); }
t0=$(date +%s)
phase() { echo "$1 $(( $(date +%s) - t0 )) s" | tee -a "$OUT/phases.txt"; }
TOKENS="1 16 64 256 1024 4096 8192"
T4096="1 16 64 256 1024 4096"
SW="--tokens 64 256 1024 4096 --quant-tokens 64 256 1024 4096"
# 1. the tests (GPU shared by the workers) while the main tree's kernels compile
main_env timeout 150 python3 "$TREE/benchmarks/tp1_warm.py" --tree "$ROOT" --tokens $TOKENS \
  --hidden 7168 --quant none nvfp4 --jobs 3 >/tmp/tp1y_warm.txt 2>&1 &
tree_env timeout 150 python3 -m pytest -q -n 12 -m gpu tests/kernels/test_tp1_shapes_and_graphs.py \
  tests/kernels/test_blocks_and_local_fused_nccl_on_gpu.py tests/kernels/test_launch_cache_compiled.py >"$OUT/tests.txt" 2>&1
phase tests
# the broken copy: the block scale's clamp to 448 removed (a NaN amax would then store 0x7f)
rm -rf "$BROKEN"; cp -r "$TREE" "$BROKEN"; ln -sfn ../kernels "$BROKEN/fusion_bridge/kernels"
sed -i 's/q = tl.minimum(_div_by_scale(v, 6.0), 448.0)/q = _div_by_scale(v, 6.0)/' \
  "$BROKEN/kernels/quant.py"
(cd "$BROKEN" && grep -c "q = _div_by_scale(v, 6.0)$" kernels/quant.py && \
  PYTHONPATH=/tmp/fi-site:$BROKEN timeout 40 python3 -m pytest -q -m gpu \
  tests/kernels/test_tp1_shapes_and_graphs.py -k block_scale 2>&1 | tail -4) >"$OUT/broken.txt" 2>&1
phase broken
wait
tree_env timeout 60 python3 benchmarks/tp1_warm.py --tokens $TOKENS --hidden 7168 --jobs 12 \
  >>/tmp/tp1y_warm.txt 2>&1 &
tree_env timeout 60 python3 benchmarks/tp1_warm.py --tokens $T4096 --hidden 4096 \
  --quant none nvfp4 --jobs 4 >>/tmp/tp1y_warm.txt 2>&1 &
wait
phase warm
# 2. timing, one at a time: main (none for the eager rows, nvfp4: the kernels this change
# touches; its none / fp8 kernels compile to this tree's machine code), then this tree
main_env timeout 45 python3 benchmarks/tp1_local.py --tokens $TOKENS --hidden 7168 --emulated \
  --quant none nvfp4 --csv "$OUT/before.csv" >"$OUT/before.txt" 2>&1
phase before
tree_env timeout 60 python3 benchmarks/tp1_local.py --tokens $TOKENS --hidden 7168 --emulated \
  --csv "$OUT/after.csv" >"$OUT/after.txt" 2>&1
tree_env timeout 40 python3 benchmarks/tp1_local.py --tokens $T4096 --hidden 4096 \
  --quant none nvfp4 --emulated >>"$OUT/after.txt" 2>&1
phase after
# 3. sweeps: H=4096 whole rows at 4 / 8 / 16 warps (and split where it fits), no prefetch; H=7168
# NVFP4 whole rows at 8 warps; the register cap on / off at the default shapes
tree_env timeout 50 python3 benchmarks/tp1_sweep.py --hidden 4096 --quant none nvfp4 $SW \
  --prefetch 0 --row-warps 8 16 32 --jobs 12 >"$OUT/sweeps.txt" 2>&1
tree_env timeout 40 python3 benchmarks/tp1_sweep.py --hidden 7168 --quant nvfp4 \
  --tokens 256 1024 4096 --quant-tokens 256 1024 4096 --prefetch 0 --row-warps 8 16 --jobs 12 \
  >>"$OUT/sweeps.txt" 2>&1
phase sweep4096_nvfp4w8
tree_env timeout 40 python3 benchmarks/tp1_sweep.py --default-only $SW --jobs 12 \
  >>"$OUT/sweeps.txt" 2>&1
tree_env timeout 50 python3 benchmarks/tp1_sweep.py --default-only $SW --jobs 12 \
  --no-register-cap >>"$OUT/sweeps.txt" 2>&1
phase cap_ab
tail -4 /tmp/tp1y_warm.txt >>"$OUT/phases.txt"
tail -3 "$OUT/tests.txt" "$OUT/broken.txt"
