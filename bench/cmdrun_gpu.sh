#!/usr/bin/env bash
# GPU evidence of the command runner (docs/tune.md, "The command runner"), one device-tool call on
# a 1-GPU machine, run from the repo root (or its .xfer copy) with the wheels of .whl/ installed:
#
#   1. Megatron-LM's own argument parser on the Megatron arguments `advisor recommend` prints for the
#      top-1 layout of every catalog model x cluster (bench/megatron_args_check.py; CPU work, run
#      beside the GPU steps);
#   2. the layouts of bench/campaign_configs/h100x1-cmdrun.jsonl with the built-in runner (one
#      torchrun, megatron-core + the advisor's worker);
#   3. the same layouts with `--runner command` around Megatron-LM's training loop
#      (bench/megatron_lm_pretrain.py: megatron.training.pretrain, --mock-data, --transformer-impl local);
#   4. bench/compare_runners.py: agreement in tokens/s.
#
# REHEARSE=1 runs it on a CPU machine: step 2 as --dry-run, step 3 with the fake training script of
# the tests in place of Megatron-LM (twice, so that step 4 has two datasets to compare).
# Everything lands in $OUT (8 files at most).
set -uo pipefail
OUT=${OUT:-/tmp/cmdrun-out}
mkdir -p "$OUT"
log() { echo "== $(date +%T) $*"; }
exec > >(tee -a "$OUT/session.log") 2>&1
REHEARSE=${REHEARSE:-0}
BATCH=bench/campaign_configs/h100x1-cmdrun.jsonl
# Megatron-LM flags that make its loop run what the built-in runner runs (no Transformer Engine,
# no apex: fusions off; fp32 gradient buffers like the built-in runner's grad_reduce_in_fp32)
MLM_FIXED="--transformer-impl local --no-bias-swiglu-fusion --no-masked-softmax-fusion --no-rope-fusion \
--no-persist-layer-norm --no-gradient-accumulation-fusion --accumulate-allreduce-grads-in-fp32 --mock-data \
--tokenizer-type NullTokenizer --lr 1e-4 --weight-decay 0.01 --clip-grad 1.0 --attention-dropout 0 --hidden-dropout 0"
CMD="python3 -m torch.distributed.run --standalone --nproc-per-node {nproc_per_node} \
bench/megatron_lm_pretrain.py {megatron_model_args} {megatron_args} $MLM_FIXED"
if [ "$REHEARSE" = 1 ]; then
  CMD="python3 tests/data/measure/fake_train.py --step-s 0.2 {megatron_args} $MLM_FIXED"
else
  nvidia-smi --query-gpu=index,name,uuid,pci.bus_id,power.limit --format=csv | tee "$OUT/gpus.csv"
fi
python3 - <<'PY' || exit 2
import advisor.runners.command, advisor.runners.measure
try:
    import megatron.training.arguments, torch  # noqa: F401
    print("megatron.training imports; torch", torch.__version__)
except ImportError as e:
    print("megatron.training does not import here:", e)
PY

check=
if [ "${SKIP_ARGS_CHECK:-0}" != 1 ]; then
  log "1/4 Megatron-LM's parser on the catalog's top-1 layouts (in the background)"
  timeout 420 python3 bench/megatron_args_check.py --json "$OUT/megatron_args_check.json" > "$OUT/megatron_args_check.txt" 2>&1 &
  check=$!
fi

log "2/4 built-in runner"
if [ "$REHEARSE" = 1 ]; then
  python3 -m advisor measure --batch "$BATCH" --gpus 1 --dry-run | head -3
  python3 -m advisor measure --runner command --command "$CMD" --batch "$BATCH" --gpus 1 \
    --dataset "$OUT/builtin.jsonl" --telemetry-hz 0 --timeout 60
else
  python3 -m advisor measure --batch "$BATCH" --gpus 1 --dataset "$OUT/builtin.jsonl" --timeout 120 --max-seconds 150
fi

log "3/4 command runner around Megatron-LM's training loop"
python3 -m advisor measure --runner command --command "$CMD" --batch "$BATCH" --gpus 1 \
  --dataset "$OUT/command.jsonl" --timeout 180 --max-seconds 330 --run-dir /tmp/cmdrun-trials
tar -czf "$OUT/command-trials.tar.gz" -C /tmp cmdrun-trials 2>/dev/null
grep -h "iteration .*elapsed time per iteration\|memory (MB)" /tmp/cmdrun-trials/trial0.log | head -12 > "$OUT/megatron-lm-lines.txt"

log "4/4 agreement"
python3 bench/compare_runners.py "$OUT/builtin.jsonl" "$OUT/command.jsonl" | tee "$OUT/agreement.txt"
if [ -n "$check" ]; then wait $check; echo "megatron_args_check exit $?"; tail -3 "$OUT/megatron_args_check.txt"; fi
ls -la "$OUT"
