#!/usr/bin/env bash
# GPU evidence that needs a 4-GPU node, one step per device-tool call (each fits its 10 minutes).
# Run from the repo root on nvidia-h200-x4 with the wheels carried (carry [".whl"], built here by
# `bash ../shared/gpu/pack-wheels.sh "$PWD"`: an absolute path, or its Ray step writes nowhere);
# everything it produces lands under $OUT, mirroring the
# repo's paths, to be committed as data:
#
#   bash bench/device_session.sh placement   # docs/placement.md: rank -> planned GPU check,
#                                            # thermal profile of every slot, placed vs identity
#   bash bench/device_session.sh full-depth [S]  # llama3-8b at 32 layers: TP=4, TP x PP, PP=4,
#                                            # DP; starts no config after S seconds (default 480)
#   bash bench/device_session.sh tune [S]    # the real study of docs/tune.md; launches nothing
#                                            # after S seconds (default 330); run again to resume
#   bash bench/device_session.sh probe       # the interleaved-pipeline hang of the tune study
#                                            # (5 variants, stacks of a hung job), and SDPA's
#                                            # native GQA vs repeated K/V (3 layouts each)
#   bash bench/device_session.sh telemetry-ab  # NVML checks and the sampler's cost in step time
#
# Steps are independent: each installs what it needs on the bare machine first.
set -uo pipefail
step=${1:?usage: bash bench/device_session.sh placement|full-depth [seconds]|tune [seconds]}
OUT=${OUT:-/tmp/advisor-out}
mkdir -p "$OUT"
log() { echo "== $(date +%T) $*"; }

# -- environment: the wheels into /tmp/site (the image has torch, no index); advisor runs from
# this checkout (advisor/__init__.py finds the layer folders beside it) --
[ -d .whl ] || { echo "error: no .whl/ here: run 'bash ../shared/gpu/pack-wheels.sh \"\$PWD\"' and carry .whl"; exit 2; }
python3 -m pip install -q --no-index --no-deps --no-compile --target /tmp/site .whl/*.whl || exit 2
# ray.tar.xz is Ray's wheel unpacked by Python's zipfile, which drops the exec bits of its
# binaries (gcs_server, raylet): Ray then fails with "Permission denied" until they are restored.
if [ -f .whl/ray.tar.xz ]; then tar -xJf .whl/ray.tar.xz -C /tmp/site && chmod -R u+x /tmp/site/ray/core || exit 2; fi
export PYTHONPATH=$PWD:/tmp/site NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 \
  NVSHMEM_DISABLE_NVLS=1 CUDA_DEVICE_ORDER=PCI_BUS_ID PYTHONUNBUFFERED=1
python3 -c "import advisor.runners.measure, optuna, megatron.core" || exit 2
advisor() { python3 -m advisor "$@"; }
# A process an earlier step left on the GPUs (seen: torchrun workers of a killed tune driver, 60-90
# GiB each) makes this step's jobs run out of memory: end them first, and say so.
stale=$(nvidia-smi --query-compute-apps=pid --format=csv,noheader 2>/dev/null | tr -d ' ')
if [ -n "$stale" ]; then echo "ending processes left on the GPUs: $(echo $stale)"; kill -9 $stale 2>/dev/null; sleep 3; fi
nvidia-smi --query-gpu=index,name,uuid,pci.bus_id,temperature.gpu,power.limit --format=csv > "$OUT/gpus.csv"
cat "$OUT/gpus.csv"
ngpu=$(($(wc -l < "$OUT/gpus.csv") - 1))
[ "$ngpu" -ge 4 ] || { echo "error: this step needs 4 GPUs, found $ngpu"; exit 2; }

case "$step" in
placement)
  d="$OUT/data/placement"; mkdir -p "$d"
  log "1/3 launch check: the rank of stage k runs on the planned GPU (NVML UUID inside the job)"
  python3 bench/placement_gpu_check.py > "$d/h200x4-launch-check.txt" 2>&1
  echo "exit $?" >> "$d/h200x4-launch-check.txt"; tail -15 "$d/h200x4-launch-check.txt"

  log "2/3 thermal profile of every slot (same GEMM load on all GPUs)"
  advisor thermal-profile --seconds 100 --idle 10 --cool 15 --node h200x4 \
    --out "$d/h200x4-profile.json" --json > "$d/h200x4-profile.summary.json" 2> "$d/h200x4-profile.log"
  echo "exit $?"; cat "$d/h200x4-profile.summary.json" | head -40

  log "3/3 the same PP layout placed by the measured profile and in identity order"
  lay=(--model llama3-8b --tp 1 --pp 4 --mbs 1 --gbs 32 --seq 4096)
  run=("${lay[@]}" --warmup 3 --steps 10 --min-seconds 60 --timeout 240)
  advisor place -p "$d/h200x4-profile.json" -m llama3-8b -c h200x4 --tp 1 --pp 4 --mbs 1 --gbs 32 \
    --seq 4096 --json > "$d/h200x4-plan.json" 2>> "$d/h200x4-place.log"
  advisor place -p "$d/h200x4-profile.json" -m llama3-8b -c h200x4 --tp 1 --pp 4 --mbs 1 --gbs 32 \
    --seq 4096 --margin 0 --json > "$d/h200x4-plan-margin0.json" 2>> "$d/h200x4-place.log"
  cat "$d/h200x4-plan.json" "$d/h200x4-plan-margin0.json"
  # identity first: the placed run starts on GPUs at least as warm (the comparison is conservative)
  advisor measure "${run[@]}" --out "$d/h200x4-run-identity.json" \
    --dataset "$d/h200x4-placement-runs.jsonl" 2>&1 | tail -3
  advisor launch -p "$d/h200x4-profile.json" -m llama3-8b -c h200x4 --tp 1 --pp 4 --mbs 1 --gbs 32 \
    --seq 4096 --margin 0 -- python3 -m advisor measure "${run[@]}" --out "$d/h200x4-run-placed.json" \
    --dataset "$d/h200x4-placement-runs.jsonl" 2>&1 | tail -3
  python3 bench/placement_compare.py --identity "$d/h200x4-run-identity.json" --placed "$d/h200x4-run-placed.json" \
    --plan "$d/h200x4-plan-margin0.json" 2>&1 | tee "$d/h200x4-placement-compare.txt"
  ;;
full-depth)
  d="$OUT/data/measurements"; mkdir -p "$d"
  log "llama3-8b, 32 layers, seq 4096, gbs 32 on 4 GPUs (bench/campaign_configs/h200x4-full.jsonl)"
  advisor measure --batch bench/campaign_configs/h200x4-full.jsonl --dataset "$d/h200x4-full-depth.jsonl" \
    --max-seconds "${2:-480}" --timeout 240 2>&1 | tail -12
  ;;
tune)
  budget=${2:-330}
  study=data/studies/llama3-8b-h200x4
  mkdir -p data/studies "$OUT/data/studies" "$OUT/data/measurements"
  ray_arg=()
  python3 -c "import ray" 2>/dev/null || { echo "ray is not importable here: trials run inline"; ray_arg=(--ray-address inline); }
  log "study (resumes from $study.journal when it exists)"
  # A layout of this proxy takes 10-16 s inside a torchrun (build + 7 steps; start-up 15 s), so a
  # trial with no progress for 90 s is hung (one did, for 5 min, in the first run). SIGINT lets
  # the driver settle the trials in flight (told from the spool, or failed and re-enqueued).
  timeout -s INT -k 30 $((budget + 190)) python3 -m advisor tune --model llama3-8b --cluster h200x4 --seq 4096 --gbs 32 \
    --layers 8 --runner megatron --trials 24 --batch 8 --steps 5 --warmup 2 --trial-timeout 90 \
    --timeout "$budget" --storage "$study.journal" --dataset data/measurements/tune-llama3-8b-h200x4.jsonl \
    --json "${ray_arg[@]}" > "$OUT/$study.json" 2> "$OUT/$study.log"
  echo "exit $?"; tail -5 "$OUT/$study.log"
  cp "$study".journal "$study".journal.*.spool.jsonl "$OUT/data/studies/" 2>/dev/null
  cp data/measurements/tune-llama3-8b-h200x4.jsonl "$OUT/data/measurements/" 2>/dev/null
  python3 - "$OUT/$study.json" <<'EOF'
import json, sys
try:
    d = json.load(open(sys.argv[1]))
except Exception as e:
    sys.exit(f"no study summary: {e}")
print("measured", d.get("measured"), "stopped:", d.get("stopped"), "counts:", d.get("counts"))
for r in d.get("pareto", []):
    print(r["trial"], r["key"], round(r["tokens_per_s_per_gpu"]), r.get("peak_power_w"))
EOF
  ;;
probe)
  d="$OUT/data/measurements"; mkdir -p "$d"
  log "1/2 TP1 PP4 VP2 variants (microbatches 4 or 8, recompute or not): which hang, and where"
  advisor measure --batch bench/campaign_configs/h200x4-hang-probe.jsonl --dataset "$d/h200x4-hang-probe.jsonl" \
    --timeout 40 2>&1 | tail -8
  log "2/2 GQA in SDPAttention: K/V repeated (as every earlier record) vs SDPA's enable_gqa"
  for mode in repeat native; do
    ADVISOR_SDPA_GQA=$mode advisor measure --batch bench/campaign_configs/h200x4-gqa-$mode.jsonl \
      --dataset "$d/h200x4-gqa.jsonl" --timeout 90 2>&1 | tail -4
  done
  python3 - "$d" <<'EOF2'
import json, sys
for f in ("h200x4-hang-probe.jsonl", "h200x4-gqa.jsonl"):
    for l in open(f"{sys.argv[1]}/{f}"):
        r = json.loads(l)
        print(r["id"], r["status"], r["config"]["mbs"], r["config"]["gbs"], r["config"]["recompute"],
              round((r.get("throughput") or {}).get("tokens_per_s_per_gpu") or 0),
              (r.get("memory") or {}).get("max_gib"), r["env"].get("attention"), (r.get("error") or "")[:400])
EOF2
  ;;
telemetry-ab)
  # $OUT/data/telemetry/<dir>/ is one folder too deep for the device tool to return: this step's
  # files land in $OUT/h200x4-nvml-check/; commit them as data/telemetry/h200x4-nvml-check/.
  d="$OUT/h200x4-nvml-check"; mkdir -p "$d"
  log "NVML checks, sampling cost at 20 and 100 Hz, and step time with the sampler on vs off"
  python3 bench/telemetry_overhead.py --seconds 5 --rates 20,100 --ab 60 --ab-period 3 --out "$d" \
    > "$d/output.txt" 2>&1
  echo "exit $?"; tail -22 "$d/output.txt"
  ;;
*) echo "error: unknown step '$step' (placement, full-depth, tune, probe or telemetry-ab)"; exit 2 ;;
esac
log "done; files under $OUT"
