#!/usr/bin/env bash
# One benchmark on ONE GPU, from the repository root:
#
#   bash benchmarks/device.sh NAME [ARGS...]
#
# NAME is a script benchmarks/NAME.py (tp1_local, tp1_sweep, tp1_warm, twoshot_local,
# bench_local_kernels, ab_kernels, eager_cost --world-sizes 1, ...), run with
# ARGS, or `tune` / `bench`: python -m fusion_bridge NAME --world-size 1 ARGS. The process sees one
# GPU (CUDA_VISIBLE_DEVICES=0) with NCCL NVLS and NVLink multicast off (NCCL_NVLS_ENABLE=0
# TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1); .device/fi-env.sh is sourced first
# where it exists (the FlashInfer install of a device machine).
#
# Where results go: a script's --csv (benchmarks/results/<file>, as that folder's README names
# them); LOG=<file> appends the output to <file> too, after a header line (command, commit, GPU,
# date). On a device machine ($OUT set) every file written under benchmarks/results/ during the run,
# and LOG, are copied to $OUT (what comes back), and `tune` writes its tables to $OUT/cache.
# TREE=<dir>: run from another checkout's root with its package first on PYTHONPATH, this tree's
# script: for the scripts that adapt to older trees (ab_kernels, offline_sass); give paths in ARGS
# as absolute paths then. PYTHON (python3) picks the interpreter.
set -uo pipefail

ROOT=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
if [ $# -lt 1 ]; then
  sed -n '2,/^set /p' "${BASH_SOURCE[0]}" | sed '$d' | cut -c3-
  exit 2
fi
name=$1
shift
[ -n "${LOG:-}" ] && LOG=$(realpath -m "$LOG")
cd "$ROOT" || exit 2
# shellcheck disable=SC1091
[ -f .device/fi-env.sh ] && source .device/fi-env.sh
export CUDA_VISIBLE_DEVICES=0 NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1
export NVSHMEM_DISABLE_NVLS=1 PYTHONUNBUFFERED=1
py=${PYTHON:-python3}
case $name in
  tune | bench) cmd=("$py" -m fusion_bridge "$name" --world-size 1 "$@") ;;
  *)
    if [ ! -f "benchmarks/$name.py" ]; then
      echo "device.sh: no benchmarks/$name.py (and not tune / bench)" >&2
      exit 2
    fi
    cmd=("$py" "$ROOT/benchmarks/$name.py" "$@")
    ;;
esac
if [ -n "${OUT:-}" ]; then
  mkdir -p "$OUT"
  export FUSION_BRIDGE_CACHE_DIR=${FUSION_BRIDGE_CACHE_DIR:-$OUT/cache}
fi
commit=${BENCH_COMMIT:-$(git -C "$ROOT" rev-parse --short HEAD 2>/dev/null || echo unknown)}
gpu=$(nvidia-smi --query-gpu=name --format=csv,noheader 2>/dev/null | head -1)
if [ -n "${TREE:-}" ]; then
  cd "$TREE" || exit 2
  [ -e fusion_bridge/kernels ] || ln -sfn ../kernels fusion_bridge/kernels
  export PYTHONPATH=$PWD${PYTHONPATH:+:$PYTHONPATH}
  commit="$commit, TREE=$TREE"
fi
marker=$(mktemp)
if [ -n "${LOG:-}" ]; then
  mkdir -p "$(dirname "$LOG")"
  echo "## bash benchmarks/device.sh $name $* | $commit | ${gpu:-no GPU} | $(date -u +%F)" >>"$LOG"
  "${cmd[@]}" 2>&1 | tee -a "$LOG"
  rc=${PIPESTATUS[0]}
else
  "${cmd[@]}"
  rc=$?
fi
if [ -n "${OUT:-}" ]; then
  find "$ROOT/benchmarks/results" -type f -newer "$marker" -exec cp {} "$OUT/" \;
  [ -n "${LOG:-}" ] && cp "$LOG" "$OUT/"
fi
rm -f "$marker"
exit "$rc"
