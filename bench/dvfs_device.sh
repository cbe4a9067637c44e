#!/usr/bin/env bash
# One device call on nvidia-h100-x1 (issue 14): the DVFS load sweep, then four training layouts of
# model shapes no earlier run used, each with its trace and NVML energy counter. Changes no GPU
# setting (the power limit is only read). Run from the repo root with .whl carried; everything
# lands in $OUT/dvfs-h100.tar.gz (the device tool returns at most 8 files) plus $OUT/log.txt:
#   bash bench/dvfs_device.sh [SWEEP_SCALE]
set -uo pipefail
OUT=${OUT:-/tmp/advisor-out}
W=/tmp/dvfs; rm -rf "$W"; mkdir -p "$W/sweep" "$W/measurements" "$W/traces"
log() { echo "== $(date +%T) $*" | tee -a "$OUT/log.txt"; }
export PYTHONPATH=$PWD:/tmp/site CUDA_DEVICE_ORDER=PCI_BUS_ID PYTHONUNBUFFERED=1
log "sweep"
python3 bench/dvfs_sweep.py --out "$W/sweep" --scale "${1:-1}" 2>&1 | tee -a "$OUT/log.txt" | tail -40
nvidia-smi -q -d SUPPORTED_CLOCKS > "$W/sweep/nvidia-smi-supported-clocks.txt" 2>&1
log "training layouts (held-out shapes)"
python3 -m pip install -q --no-index --no-deps --no-compile --target /tmp/site .whl/*.whl >/dev/null 2>&1 || log "wheel install failed"
timeout 200 python3 -m advisor measure --batch bench/campaign_configs/h100x1-energy.jsonl \
  --dataset "$W/measurements/h100x1-energy.jsonl" --trace-dir "$W/traces" --timeout 120 --max-seconds 150 \
  2>&1 | tail -12 | tee -a "$OUT/log.txt"
tar -czf "$OUT/dvfs-h100.tar.gz" -C "$W" .
log "done: $(tar -tzf "$OUT/dvfs-h100.tar.gz" | wc -l) files"
