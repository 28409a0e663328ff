#!/usr/bin/env bash
# NOT RUN SINCE 2026-12-01: two GPUs have been withheld since then. These are the two-GPU commands
# of the device calls of that day (the former device_run_tp2.sh, device_run_a.sh, device_bench.sh,
# device_tests.sh and floor.sh), gathered here with the package's new paths; expect to fix a step
# on its first run.
#
#   bash benchmarks/two_gpus.sh STEP [ARGS...]      (from the repository root, 2 GPUs)
#
#   tests              every GPU test: pytest -m gpu tests (ARGS: more pytest arguments)
#   tune               python -m fusion_bridge tune --world-size 2 ARGS (tune_h200_tp2.txt: LOG)
#   bench              python -m fusion_bridge bench --world-size 2 ARGS (give --csv: its default
#                      lands in benchmarks/results/, whose README must list every file)
#   floor              benchmarks/floor.py ARGS (floor_h200_tp2.csv), FUSION_BRIDGE_SYMM_TIMEOUT_S=5
#   eager_cost         benchmarks/eager_cost.py ARGS: TP1 and TP2 (eager_cost_h200.csv)
#   ab_auto BEFORE AFTER [ROUNDS]
#                      benchmarks/ab_auto.py on the two trees in turn, ROUNDS (3) times; its JSON
#                      lines go to LOG (ab_auto_restructure_h200_tp2.jsonl)
#
# As benchmarks/device.sh: .device/fi-env.sh sourced where it exists, NCCL NVLS and NVLink multicast
# off in every process (NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1
# NVSHMEM_DISABLE_NVLS=1), LOG=<file> appends the output (a header line first, except for ab_auto's
# JSON lines), and with $OUT set (a device machine) the files written under benchmarks/results/ and
# LOG are copied to $OUT, the tables `tune` / `bench` write to $OUT/cache.
set -uo pipefail

ROOT=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
if [ $# -lt 1 ]; then
  sed -n '2,/^set /p' "${BASH_SOURCE[0]}" | sed '$d' | cut -c3-
  exit 2
fi
step=$1
shift
[ -n "${LOG:-}" ] && LOG=$(realpath -m "$LOG")
cd "$ROOT" || exit 2
# shellcheck disable=SC1091
[ -f .device/fi-env.sh ] && source .device/fi-env.sh
export CUDA_VISIBLE_DEVICES=${CUDA_VISIBLE_DEVICES:-0,1} NCCL_NVLS_ENABLE=0
export TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1 PYTHONUNBUFFERED=1
py=${PYTHON:-python3}
if [ -n "${OUT:-}" ]; then
  mkdir -p "$OUT"
  export FUSION_BRIDGE_CACHE_DIR=${FUSION_BRIDGE_CACHE_DIR:-$OUT/cache}
fi

ab_auto() {  # BEFORE AFTER [ROUNDS]: one JSON line per run on stdout
  local before=${1:?ab_auto BEFORE AFTER [ROUNDS]} after=${2:?ab_auto BEFORE AFTER [ROUNDS]}
  local round tree
  for round in $(seq "${3:-3}"); do
    for tree in "$before" "$after"; do
      "$py" benchmarks/ab_auto.py --tree "$tree" --out "$(mktemp)" || return
    done
  done
}

case $step in
  tests) cmd=("$py" -m pytest -q -m gpu -p no:cacheprovider tests "$@") ;;
  tune | bench) cmd=("$py" -m fusion_bridge "$step" --world-size 2 "$@") ;;
  floor) cmd=(env FUSION_BRIDGE_SYMM_TIMEOUT_S=5 "$py" benchmarks/floor.py "$@") ;;
  eager_cost) cmd=("$py" -m benchmarks.eager_cost "$@") ;;
  ab_auto) cmd=(ab_auto "$@") ;;
  *)
    echo "two_gpus.sh: unknown step $step (tests, tune, bench, floor, eager_cost, ab_auto)" >&2
    exit 2
    ;;
esac
marker=$(mktemp)
if [ -n "${LOG:-}" ]; then
  mkdir -p "$(dirname "$LOG")"
  if [ "$step" = ab_auto ]; then
    "${cmd[@]}" | tee -a "$LOG"
    rc=${PIPESTATUS[0]}
  else
    commit=${BENCH_COMMIT:-$(git rev-parse --short HEAD 2>/dev/null || echo unknown)}
    gpus=$(nvidia-smi --query-gpu=name --format=csv,noheader 2>/dev/null | paste -sd, -)
    echo "## bash benchmarks/two_gpus.sh $step $* | $commit | ${gpus:-no GPU} | $(date -u +%F)" \
      >>"$LOG"
    "${cmd[@]}" 2>&1 | tee -a "$LOG"
    rc=${PIPESTATUS[0]}
  fi
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
