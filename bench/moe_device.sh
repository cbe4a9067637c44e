#!/usr/bin/env bash
# MoE measurements on the device machine (docs/moe.md), one device-tool call per step; everything
# lands under $OUT (commit it as data/measurements/<name>.jsonl). Rehearse on CPU first:
#   python bench/moe_cpu_rehearsal.py bench/campaign_configs/h100x1-moe-a.jsonl ...
#
#   bash bench/moe_device.sh h100x1 [S]   # 1 GPU: batches h100x1-moe-a (SequentialMLP), -c
#                                         # (DeepSeek-like, MLA), -b (grouped GEMM); no job starts
#                                         # after S seconds in all (default 500)
#   bash bench/moe_device.sh h100x1-d [S] # 1 GPU, second call: batch h100x1-moe-d
#   bash bench/moe_device.sh ep [S]       # 2 or 4 GPUs: batch x2-moe-ep / x4-moe-ep (EP 1/2/4,
#                                         # alltoall vs allgather, grouped GEMM on/off) into
#                                         # $OUT/<gpu>x<n>-moe-ep.jsonl (gpu: h100 / h200)
#   bash bench/moe_device.sh batch NAME [S]  # one batch of bench/campaign_configs/
#
# Run from the directory that holds this checkout's copy, with the wheels at $WHL (default
# ../../.whl, the layout of `.xfer/<name>` in the lead's checkout).
set -uo pipefail
step=${1:?usage: bash bench/moe_device.sh h100x1|ep|batch NAME [seconds]}
OUT=${OUT:-/tmp/advisor-out}
WHL=${WHL:-../../.whl}
mkdir -p "$OUT"
t0=$(date +%s)
log() { echo "== $(date +%T) (+$(( $(date +%s) - t0 )) s) $*"; }
python3 -m pip install -q --no-index --no-deps --no-compile --target /tmp/site "$WHL"/*.whl || exit 2
export PYTHONPATH=$PWD:/tmp/site NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 \
  NVSHMEM_DISABLE_NVLS=1 CUDA_DEVICE_ORDER=PCI_BUS_ID PYTHONUNBUFFERED=1
python3 -c "import advisor.runners.measure, megatron.core" || exit 2
nvidia-smi --query-gpu=index,name,uuid,pci.bus_id,power.limit,driver_version --format=csv | tee "$OUT/gpus.csv"
ngpu=$(($(wc -l < "$OUT/gpus.csv") - 1))

run_batch() {  # name, seconds, dataset
  local name=$1 secs=$2 ds=$3
  [ "$secs" -gt 20 ] || { log "skip $name: no time left"; return; }
  log "batch $name (no job starts after $secs s)"
  python3 -m advisor measure --batch "bench/campaign_configs/$name.jsonl" --dataset "$ds" \
    --max-seconds "$secs" --timeout 150 2>&1 | tail -4
}
left() { echo $(( $1 - ($(date +%s) - t0) )); }

case "$step" in
h100x1)
  budget=${2:-500}
  ds="$OUT/h100x1-moe.jsonl"
  run_batch h100x1-moe-a $(( budget * 40 / 100 )) "$ds"
  run_batch h100x1-moe-c $(( $(left "$budget") * 45 / 100 )) "$ds"
  run_batch h100x1-moe-b "$(left "$budget")" "$ds"
  ;;
h100x1-d)  # second call: grouped GEMM for real, the jobs call 1 did not reach, a fourth shape
  run_batch h100x1-moe-d "${2:-480}" "$OUT/h100x1-moe-d.jsonl"
  ;;
ep)
  budget=${2:-500}
  [ "$ngpu" -ge 2 ] || { echo "error: the EP batches need 2 or 4 GPUs, found $ngpu"; exit 2; }
  n=$([ "$ngpu" -ge 4 ] && echo 4 || echo 2)
  gpu=$(sed -n 2p "$OUT/gpus.csv" | grep -q H200 && echo h200 || echo h100)
  run_batch "x$n-moe-ep" "$budget" "$OUT/${gpu}x$n-moe-ep.jsonl"
  ;;
batch)
  name=${2:?batch name}
  run_batch "$name" "${3:-500}" "$OUT/$name.jsonl"
  ;;
*) echo "error: unknown step '$step'"; exit 2 ;;
esac
log "summary"
python3 - "$OUT" <<'PY'
import glob, json, sys
for f in sorted(glob.glob(sys.argv[1] + "/*.jsonl")):
    for line in open(f):
        r = json.loads(line)
        th, m, p = r.get("throughput") or {}, r.get("memory") or {}, r.get("moe_probe") or {}
        t = {k: round(v * 1e3, 1) for k, v in (p.get("terms") or {}).items()}
        print(r["id"], r["status"], r["config"].get("mbs"), r["config"].get("seq"),
              round(th.get("tokens_per_s_per_gpu") or 0), m.get("max_reserved_gib"),
              (r.get("steps") or {}).get("median_s"), t, (p.get("load") or {}).get("max_over_mean"),
              (r.get("error") or "")[:300])
PY
log "done"
