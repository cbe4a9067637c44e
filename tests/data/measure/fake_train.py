"""A stand-in for a user's training job in CPU tests of the command runner: takes Megatron-LM
arguments, prints Megatron-LM's own log lines (the format of megatron/training/training.py and
report_memory in megatron-core 0.19.2), and misbehaves on demand.

    python fake_train.py [--mode MODE] [--step-s S] {megatron_args}

The mode is --mode, or else the first entry of $FAKE_TRAIN_MODES ("mbs2=oom,tp2=hang") whose
key is a substring of this trial's layout (tp{tp}-pp{pp}-vp{vp}-mbs{mbs}-{recompute}, from the
ADVISOR_* variables the runner sets), else "ok". Modes:

- ok: --train-iters iterations of --step-s seconds (scaled by the layout), then exit 0;
- nemo: the same as NeMo 2 progress lines; json: no log lines, one JSON line per step appended
  to $ADVISOR_STEP_FILE; regex: "step K took X s" lines;
- oom: CUDA OOM traceback after 2 iterations, exit 1; crash: a Python error after 1 iteration,
  exit 1; segv: "Segmentation fault", exit 139 after 1 iteration;
- hang: silent after 1 iteration (the watchdog must stop it); noexit: keeps iterating past
  --train-iters (the runner must stop it); silent: prints nothing it can parse, exit 0;
- spawn: like ok but first starts a background `sleep` whose pid goes to $FAKE_TRAIN_CHILD_PID
  (the guard must not let it outlive the trial); it prints its own pid to $FAKE_TRAIN_PID too.
"""
import argparse
import json
import os
import subprocess
import sys
import time
from datetime import datetime

ap = argparse.ArgumentParser()
ap.add_argument("--mode")
ap.add_argument("--step-s", type=float, default=0.05)
ap.add_argument("--train-iters", type=int, default=10)
ap.add_argument("--tensor-model-parallel-size", type=int, default=1)
ap.add_argument("--pipeline-model-parallel-size", type=int, default=1)
ap.add_argument("--micro-batch-size", type=int, default=1)
ap.add_argument("--global-batch-size", type=int, default=8)
ap.add_argument("--recompute-granularity", default="none")
ap.add_argument("--print-on-node", type=int, default=None, help="only this node rank prints iterations")
args, _ = ap.parse_known_args()

env = os.environ
layout = (f"tp{env.get('ADVISOR_TP')}-pp{env.get('ADVISOR_PP')}-vp{env.get('ADVISOR_VP')}-"
          f"mbs{env.get('ADVISOR_MBS')}-{env.get('ADVISOR_RECOMPUTE')}")
mode = args.mode
if mode is None:
    for part in filter(None, env.get("FAKE_TRAIN_MODES", "").split(",")):
        key, _, m = part.partition("=")
        if key in layout:
            mode = m
            break
mode = mode or "ok"
if env.get("FAKE_TRAIN_PID"):
    with open(env["FAKE_TRAIN_PID"], "a") as f:
        f.write(f"{os.getpid()}\n")
if mode == "spawn":
    child = subprocess.Popen(["sleep", "600"], start_new_session=False)
    with open(env["FAKE_TRAIN_CHILD_PID"], "w") as f:
        f.write(str(child.pid))

# a layout-dependent step time: bigger micro-batches are more efficient, full recompute costs 1/3
tp, pp, mbs = args.tensor_model_parallel_size, args.pipeline_model_parallel_size, args.micro_batch_size
step_s = args.step_s * (1 + 0.1 * (tp - 1) + 0.1 * (pp - 1)) * (1 + 0.5 / mbs) \
    * (1.33 if args.recompute_granularity == "full" else 1.0)
node_rank = int(env.get("ADVISOR_NODE_RANK", "0"))
prints = args.print_on_node is None or args.print_on_node == node_rank
print("> building GPT model ...", flush=True)
print(f"[after model, optimizer, and learning rate scheduler are built] datetime: {datetime.now()}", flush=True)
step_file = open(env[("ADVISOR_STEP_FILE")], "a") if mode == "json" else None


def log_iteration(k: int, dt: float) -> None:
    if not prints:
        return
    if mode == "nemo":
        print(f"Training epoch 0, iteration {k - 1}/{args.train_iters - 1} | lr: 1e-04 | global_batch_size: "
              f"{args.global_batch_size} | global_step: {k - 1} | reduced_train_loss: 10.9 | "
              f"train_step_timing in s: {dt:.4f}" + (f" | consumed_samples: {k * args.global_batch_size}" if k > 1 else ""),
              flush=True)
    elif mode == "json":
        step_file.write(json.dumps({"step": k, "step_time_s": dt}) + "\n")
        step_file.flush()
    elif mode == "regex":
        print(f"step {k} took {dt:.4f} s", flush=True)
    elif mode != "silent":
        s = f" [{datetime.now().strftime('%Y-%m-%d %H:%M:%S.%f')}]"
        s += ' iteration {:8d}/{:8d} |'.format(k, args.train_iters)
        s += ' consumed samples: {:12d} |'.format(k * args.global_batch_size)
        s += ' elapsed time per iteration (ms): {:.1f} |'.format(dt * 1000.0)
        s += f' throughput per GPU (TFLOP/s/GPU): {123.4:.1f} |'
        s += f' learning rate: {1e-4:.6E} |'
        s += f' global batch size: {args.global_batch_size:5d} |'
        s += ' lm loss: {:.6E} |'.format(10.5)
        s += f' loss scale: {1.0:.1f} |'
        s += f' grad norm: {2.5:.3f} |'
        s += ' number of skipped iterations: {:3d} |'.format(0)
        s += ' number of nan iterations: {:3d} |'.format(0)
        print(s, flush=True)
        if k in (1, 2):
            mb = 1024.0 * (10 + k)
            print("[Rank {}] {}".format(0, f"(after {k} iterations) memory (MB) | allocated: {mb * 0.5:.2f} | "
                                           f"max allocated: {mb:.2f} | reserved: {mb * 1.1:.2f} | "
                                           f"max reserved: {mb * 1.2:.2f}"), flush=True)


k = 0
while k < args.train_iters or mode == "noexit":
    t0 = time.time()
    time.sleep(step_s)
    k += 1
    log_iteration(k, time.time() - t0)
    if mode == "oom" and k == 2:
        print("Traceback (most recent call last):\n  File \"pretrain_gpt.py\", line 10, in forward_step", flush=True)
        print("torch.OutOfMemoryError: CUDA out of memory. Tried to allocate 2.00 GiB. GPU 0 has a total "
              "capacity of 79.19 GiB of which 1.05 GiB is free.", flush=True)
        sys.exit(1)
    if mode == "crash" and k == 1:
        print("Traceback (most recent call last):\n  File \"pretrain_gpt.py\", line 20, in model_provider", flush=True)
        print("AssertionError: num_query_groups must be divisible by tensor_model_parallel_size", flush=True)
        sys.exit(1)
    if mode == "segv" and k == 1:
        print("Fatal Python error: Segmentation fault", flush=True)
        sys.stdout.flush()
        os._exit(139)
    if mode == "hang" and k == 1:
        time.sleep(3600)
print("[after training is done] datetime: " + str(datetime.now()), flush=True)
