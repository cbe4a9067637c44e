#!/usr/bin/env bash
# The Transformer Engine campaign (issue #22) on a lent 4-GPU machine, following
# ../shared/gpu/te/TE.md (TE 2.20.2 travels in five parts of .te/, written by
# `bash ../shared/gpu/te/pack-te.sh .`; megatron-core from `bash ../shared/gpu/pack-wheels.sh .`).
#   calls 1-4 (carry .te/partN):  bash bench/te_device.sh part N
#   call 5 (carry .te/part4 .te/whl .te/te.sha256 .te/install-te.sh .whl/megatron_core-*.whl):
#                                 bash bench/te_device.sh run SECONDS [BATCH ...]
#   later calls on the same warm machine: the same `run` (TE is installed once).
#   NO_CANARY=1 bash bench/te_device.sh run 540 x4-te-edge   # the OOM-edge batch alone (issue #27)
#   bash bench/te_device.sh tests     # the GPU runner tests, TE included
# Records land in $OUT/<batch>.jsonl: commit them as data/measurements/h100x4-te*.jsonl.
set -uo pipefail
step=${1:?usage: bash bench/te_device.sh part N | run SECONDS [BATCH ...] | tests}
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
nvidia-smi --query-gpu=index,name,uuid,pci.bus_id,power.limit,driver_version --format=csv | tee "$OUT/gpus.csv"
case "$step" in
run)
  budget=${2:-500}; shift 2
  python3 bench/te_campaign.py run --budget "$budget" --out "$OUT" ${NO_CANARY:+--no-canary} ${1:+--batches "$@"}
  rm -rf "$OUT"/*.runs
  python3 bench/te_campaign.py table "$OUT"/x4-te*.jsonl
  ;;
tests)
  timeout 400 python3 -m pytest -q -p no:cacheprovider -m gpu tests/gpu/test_gpu_runner.py 2>&1 | tail -15
  ;;
*) echo "error: unknown step '$step'"; exit 2 ;;
esac
