#!/usr/bin/env bash
# The Transformer Engine campaign (issue #22) on a lent 4-GPU machine, following
# ../shared/gpu/te/TE.md (TE 2.20.2 travels in parts of .te/, written by
# `bash ../shared/gpu/te/pack-te.sh .` and re-split into seven by `bash bench/te_resplit.sh`: a call
# carries 64 MiB with the ~16 MiB tree; megatron-core from `bash ../shared/gpu/pack-wheels.sh .`).
#   calls 1-6 (carry .te/partN):  bash bench/te_device.sh part N      (N = 0..5)
#   call 7 (carry .te/part6 .te/whl .te/te.sha256 .te/install-te.sh .whl/megatron_core-*.whl):
#                                 bash bench/te_device.sh run SECONDS [BATCH ...]
#   later calls on the same warm machine: the same `run` (TE is installed once).
#   bash bench/te_device.sh tests     # the GPU runner tests, TE included
#   bash bench/te_device.sh nccl      # NCCL bandwidth vs size (bench/nccl_bw_gpu.py), 4 GPUs
#   bash bench/te_device.sh grouped [SECONDS]  # TE GroupedLinear experts kernels alone (#24), 1 GPU
#   bash bench/te_device.sh casts     # TE's FP8 cast / cast+transpose vs a BF16 copy, TB/s (#22), 1 GPU
#   bash bench/te_device.sh sinks     # TE attention with learnable softmax offsets / windows (#24), 1 GPU
#   bash bench/te_device.sh window    # TE fused attention with sliding windows (#29), 1 GPU
#   bash bench/te_device.sh outside   # memory outside torch's allocator, step by step (#27), 4 GPUs,
#                                     # under four NCCL environments (bench/outside_memory_gpu.py)
#   bash bench/te_device.sh outside-mcore   # the same, megatron-core's groups one by one, 4 layouts
#   bash bench/te_device.sh nvml      # the telemetry contract against the real NVML (#23)
#   bash bench/te_device.sh tune SECONDS TRIALS   # a real `tune --runner megatron --stack te` study
#                                     # (carry .whl/optuna, sqlalchemy, alembic, mako, colorlog, markupsafe)
# Records land in $OUT/<batch>.jsonl: commit them as data/measurements/h100x4-te*.jsonl (batches x4-*,
# kind nvidia-h100-x4) or h200x2-te.jsonl (batches x2-h200-*, kind nvidia-h200-x2).
set -uo pipefail
step=${1:?usage: bash bench/te_device.sh part N | run SECONDS [BATCH ...] | tests | nccl | window | tune SECONDS TRIALS}
OUT=${OUT:-/tmp/advisor-out}
mkdir -p "$OUT"
if [ "$step" = part ]; then
  mkdir -p /tmp/te && cp ".te/part${2:?N}" /tmp/te/ && ls -la /tmp/te; exit $?
fi
if [ ! -d /tmp/site/transformer_engine ]; then
  bash .te/install-te.sh || exit 2
fi
if [ ! -d /tmp/site/megatron/core ]; then
  python3 -m pip install -q --no-index --no-deps --no-compile --target /tmp/site .whl/megatron_core-*.whl || exit 2
fi
export PYTHONPATH=$PWD:/tmp/site NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 \
  NVSHMEM_DISABLE_NVLS=1 CUDA_DEVICE_ORDER=PCI_BUS_ID PYTHONUNBUFFERED=1
pytest_deps() {  # the GPU image has no pytest: .whl/ carries it (pip download pytest pluggy iniconfig ...)
  python3 -c "import pytest" 2>/dev/null && return 0
  python3 -c "import packaging" 2>/dev/null || extra=.whl/pt/packaging-*.whl
  python3 -m pip install -q --no-index --no-deps --no-compile --target /tmp/site .whl/pt/pytest-*.whl \
    .whl/pt/pluggy-*.whl .whl/pt/iniconfig-*.whl .whl/pt/pytest_timeout-*.whl .whl/pt/pytest_xdist-*.whl .whl/pt/execnet-*.whl ${extra:-}
}
nvidia-smi --query-gpu=index,name,uuid,pci.bus_id,power.limit,driver_version --format=csv | tee "$OUT/gpus.csv"
case "$step" in
run)
  budget=${2:-500}; shift 2
  # jobs already measured (data/measurements/h100x4-te*.jsonl) are skipped; the canary batch runs
  # only with CANARY=1 (its features were verified by the committed records)
  for f in data/measurements/h100x4-te*.jsonl data/measurements/h200x2-te*.jsonl; do
    [ -f "$f" ] && cp "$f" "$OUT/prior-$(basename "$f")"
  done
  python3 bench/te_campaign.py run --budget "$budget" --out "$OUT" $([ -n "${CANARY:-}" ] || echo --no-canary) ${1:+--batches "$@"}
  rm -rf "$OUT"/*.runs "$OUT"/prior-*.jsonl
  python3 bench/te_campaign.py table "$OUT"/x[124]-*.jsonl
  ;;
tests)
  pytest_deps || exit 2
  timeout 400 python3 -m pytest -n 0 -q -p no:cacheprovider -m gpu tests/gpu/test_gpu_runner.py 2>&1 | tail -15
  ;;
nccl)
  timeout 240 python3 -m torch.distributed.run --nproc_per_node 4 bench/nccl_bw_gpu.py "$OUT/h100x4-nccl-bw.jsonl" 2>&1 | grep -v -i warn | tail -90
  ;;
outside)
  o="$OUT/h100x4-outside-memory.jsonl"
  for v in default buff1m nch4 nocumem; do
    case $v in
      default) e="NCCL_DEBUG=INFO NCCL_DEBUG_SUBSYS=INIT,ALLOC NCCL_DEBUG_FILE=$OUT/nccl-info.%p.txt" ;;
      buff1m) e="NCCL_BUFFSIZE=1048576" ;;
      nch4) e="NCCL_MAX_NCHANNELS=4" ;;
      nocumem) e="NCCL_CUMEM_ENABLE=0" ;;
    esac
    env $e timeout 120 python3 -m torch.distributed.run --nproc_per_node 4 bench/outside_memory_gpu.py "$o" $v 2>&1 \
      | grep -v -i warn | grep -E "^$v|rror" | head -20
  done
  for f in "$OUT"/nccl-info.*.txt; do [ -f "$f" ] && head -c 200000 "$f" > "$f.head" && mv "$f.head" "$f"; done
  ;;
outside-mcore)
  for lay in "1 1 1 1" "2 1 1 1" "1 2 1 1" "1 1 1 4"; do
    timeout 90 python3 -m torch.distributed.run --nproc_per_node 4 bench/outside_memory_megatron_gpu.py \
      "$OUT/h100x4-outside-memory-mcore.jsonl" $lay 2>&1 | grep -v -i warn | grep -E "^tp|rror" | head -24
  done
  ;;
nvml)
  pytest_deps || exit 2
  timeout 120 python3 -m pytest -q -p no:cacheprovider -n 0 -m gpu tests/contracts/test_telemetry_contract.py 2>&1 | tail -8
  ;;
casts)
  timeout 200 python3 bench/fp8_cast_gpu.py "$OUT/fp8-casts.jsonl" 2>&1 | grep -v -i warn | tail -40
  ;;
sinks)
  timeout 200 python3 bench/attention_sinks_gpu.py "$OUT/h200x1-attention-sinks.jsonl" 2>&1 | grep -v -i warn | tail -30
  timeout 200 python3 bench/grouped_gemm_rates.py --bias --out "$OUT" --budget 150 2>&1 | grep -v -i warn | tail -14
  ;;
grouped)
  timeout 560 python3 bench/grouped_gemm_rates.py --out "$OUT" --budget ${2:-450} 2>&1 | grep -v -i warn | tail -200
  ;;
window)
  timeout 200 python3 bench/window_attention_gpu.py "$OUT/h100x1-window-attention.jsonl" 2>&1 | grep -v -i warn | tail -45
  ;;
tune)
  python3 -m pip install -q --no-index --no-deps --no-compile --target /tmp/site .whl/optuna-*.whl \
    .whl/sqlalchemy-*.whl .whl/alembic-*.whl .whl/mako-*.whl .whl/colorlog-*.whl .whl/markupsafe-*.whl || exit 2
  secs=${2:-300}; trials=${3:-8}
  timeout $((secs + 120)) python3 -m advisor tune --runner megatron --stack te --ray-address inline \
    --model llama3-8b --layers 8 --cluster h100x4 --seq 4096 --gbs 32 --trials "$trials" --batch 4 \
    --timeout "$secs" --trial-timeout 240 --storage "$OUT/tune-te.journal" \
    --dataset "$OUT/tune-llama3-8b-h100x4-te.jsonl" 2>&1 | grep -v -i warn | tail -40
  ;;
*) echo "error: unknown step '$step'"; exit 2 ;;
esac
