#!/usr/bin/env bash
# One GPU: regenerate the world-size-1 tables. `tune --world-size 1` for H=7168 K=8 and each quant in
# $TUNE_QUANTS (default: none fp8 nvfp4); the tables land in $OUT/cache, the plans and logs in $OUT/tune_tp1.txt.
# Ship one with `python benchmarks/install_default_table.py <fetched cache file>`.
#
#   device: source .device/fi-env.sh; bash benchmarks/device_run_tp1.sh
set -u
OUT=${OUT:-/tmp/out}; mkdir -p "$OUT/cache"
export CUDA_VISIBLE_DEVICES=0 FUSION_BRIDGE_CACHE_DIR="$OUT/cache" PYTHONUNBUFFERED=1
for q in ${TUNE_QUANTS:-none fp8 nvfp4}; do
  t0=$(date +%s)
  timeout "${TUNE_TIMEOUT:-200}" python3 -m fusion_bridge tune --world-size 1 --quant "$q" \
    > "$OUT/tune_tp1_$q.log" 2>&1
  rc=$?
  # one file for all quants (a device call returns at most 8 files): the logs minus progress bars
  { echo "== tune --quant $q rc=$rc in $(( $(date +%s) - t0 )) s"
    tr '\r' '\n' < "$OUT/tune_tp1_$q.log" | grep -v '^tune: .*case'; } | tee -a "$OUT/tune_tp1.txt" | tail -18
  rm "$OUT/tune_tp1_$q.log"
done
