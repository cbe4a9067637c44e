#!/usr/bin/env bash
# One device-tool call on a 1-GPU machine (Python 3.12, torch, no package index; wheels of .whl/
# from ../shared/gpu/pack-wheels.sh plus pytest): Megatron-LM's own argument parser on the
# arguments `advisor recommend` prints (bench/megatron_args_check.py: every catalog top-1 layout and
# every split of the published H100 presets), the parser tests (tests/test_megatron_lm_parser.py,
# which skip on CI's Python 3.11) and the GPU runner tests (tests/gpu). Output under $OUT.
#   run: bash bench/args_check_gpu.sh   (carry .whl)
set -uo pipefail
python3 -m pip install -q --no-index --no-deps --no-compile --target /tmp/site .whl/*.whl || exit 2
export PYTHONPATH=$PWD:/tmp/site NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1 PYTHONUNBUFFERED=1
nvidia-smi --query-gpu=index,name,power.limit,driver_version --format=csv
timeout 300 python3 bench/megatron_args_check.py --json $OUT/h100x1-args-check.json > $OUT/h100x1-args-check.txt 2>&1; echo "args check rc $?"; grep -c "^ok" $OUT/h100x1-args-check.txt; grep -v "^ok\|^skip" $OUT/h100x1-args-check.txt | tail -8
timeout 240 python3 -m pytest -q -p no:cacheprovider tests/test_megatron_lm_parser.py 2>&1 | tail -4
timeout 200 python3 -m pytest -q -p no:cacheprovider -m gpu tests/gpu 2>&1 | tail -4
