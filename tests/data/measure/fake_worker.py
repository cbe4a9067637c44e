"""A stand-in for torchrun + megatron_worker.py in CPU tests: writes the same events for every rank
from one process. The job's id says what happens:

- ok-*: warmup + steps of 0.1 s each; slow-*: the same with 0.3 s steps.
- oom-*: runs out of memory after the first step. With more than one rank, rank 1 reports it and
  the process exits (torchrun gives up); with one rank the worker frees everything (0.5 s) and
  goes on to the next job, as megatron_worker.py does on one GPU.
- oomhang-*: rank 1 reports an OOM and the process hangs (the other ranks wait in a collective).
- crash-*: a Python exception in the job (one rank: reported and the worker goes on).
- hang-*: no progress after the first step boundary (the watchdog must kill it); SIGUSR1 dumps
  the stacks into rank0.stacks, as megatron_worker.py does (it hangs in `wait_in_collective`).
- segv-*: dies without an event, 0.5 s after building the model.

A job with "kernel_profile_steps" gets a kernel_profile in its done events, summarized by the real
summarizer (runners/kernel_probe.py) from a few made-up kernels; a job with
"memory_snapshot_steps" a memory_snapshot by the real summarizer (runners/mem_snapshot.py); one with
"expandable_segments" reports the allocator setting in its start events, as the worker does.

Like torchrun, SIGTERM makes it print "SignalException: Process <pid> got signal: 15" and exit 1.
The hello events carry this process's pid."""
import faulthandler
import json
import os
import signal
import sys
import time

run_dir, start, nproc = sys.argv[1], int(sys.argv[2]), int(sys.argv[3])
files = [open(os.path.join(run_dir, f"rank{r}.jsonl"), "a") for r in range(nproc)]


def on_sigterm(signum, frame):
    print(f"torch.distributed.elastic.multiprocessing.api.SignalException: Process {os.getpid()} "
          f"got signal: {signum}", flush=True)
    sys.exit(1)


signal.signal(signal.SIGTERM, on_sigterm)
faulthandler.register(signal.SIGUSR1, file=open(os.path.join(run_dir, "rank0.stacks"), "a"), all_threads=True)


def wait_in_collective():
    time.sleep(3600)


def ev(r, kind, **kw):
    files[r].write(json.dumps({"ev": kind, "t": time.time(), **kw}) + "\n")
    files[r].flush()


for r in range(nproc):
    ev(r, "hello", rank=r, local_rank=r, world=nproc, uuid=f"GPU-00000000-0000-4000-8000-{r:012x}",
       pci_bus_id=f"00000000:{0x18 + r:02x}:00.0", gpu_name="NVIDIA H200", torch="2.11.0",
       cuda="13.0", megatron_core="0.19.2", python="3.12.3", hostname="fake", pid=os.getpid())
jobs = [json.loads(l) for l in open(os.path.join(run_dir, "jobs.jsonl"))]
failing = min(1, nproc - 1)  # the rank that reports an OOM
for job in jobs:
    i = job["index"]
    if i < start:
        continue
    for r in range(nproc):
        ev(r, "start", cfg=i, allocated_gib=0.06,
           alloc_conf=f"expandable_segments:{bool(job.get('expandable_segments'))}")
        ev(r, "built", cfg=i, params=1000, stage=r // (job["tp"] * job["dp"]), tp_rank=r % job["tp"],
           dp_rank=(r // job["tp"]) % job["dp"], ep_rank=0, mem_gib=1.0)
    kind = job["id"].split("-")[0]
    if kind == "segv":
        time.sleep(0.5)  # building the model
        print("Fatal Python error: Segmentation fault", flush=True)
        sys.exit(139)
    if kind == "hang":
        ev(0, "step", cfg=i, k=0, tt=time.time())
        wait_in_collective()
    t = time.time()
    ev(0, "step", cfg=i, k=0, tt=t)
    bounds = [t]
    failed = False
    for k in range(1, job["warmup"] + job["steps"] + 1):
        time.sleep(0.3 if kind == "slow" else 0.1)
        bounds.append(time.time())
        ev(0, "step", cfg=i, k=k, tt=bounds[-1])
        if kind in ("oom", "oomhang") and k == 1:
            ev(failing, "oom", cfg=i, error="CUDA out of memory. Tried to allocate 20.00 GiB",
               allocated_gib=130.0, reserved_gib=138.0, peak_allocated_gib=131.0, peak_reserved_gib=139.0)
            print("torch.OutOfMemoryError: CUDA out of memory. Tried to allocate 20.00 GiB", flush=True)
            if kind == "oomhang":
                time.sleep(3600)
            if nproc > 1:
                os._exit(1)
            failed = True
            break
        if kind == "crash" and k == 1:
            ev(0, "crash", cfg=i, error="ValueError: boom", traceback="ValueError: boom")
            if nproc > 1:
                os._exit(4)
            failed = True
            break
    if failed:
        time.sleep(0.5)  # one rank: free everything (as long as a real cleanup) and go on
        continue
    extra = {}
    if job.get("kernel_profile_steps"):
        from advisor.runners.kernel_probe import Ev, summarize
        n = job["kernel_profile_steps"]
        evs = [Ev("nvjet_tst_128x256_64x4_1x2_h_bz_coopA_NNT", True, 1000.0 * s, 1000.0 * s + 600, 7, None)
               for s in range(n)]
        extra["kernel_profile"] = summarize(evs, n, [0.1] * n, 0.1)
    if job.get("pressure_headroom_gib") is not None:  # the plan as mem_probe.pressure_plan words it
        extra["pressure"] = {"headroom_gib": job["pressure_headroom_gib"], "ballast_gib": 60.0, "retries": 2}
    if job.get("memory_snapshot_steps"):  # the real summarizer on a tiny made-up step
        from advisor.runners.mem_snapshot import summarize as snap
        seg = {"address": 0, "total_size": 4 << 20, "blocks": [{"address": 0, "size": 1 << 20, "state": "active_allocated"}]}
        trace = [{"action": "alloc", "addr": 1 << 20, "size": 2 << 20, "frames": []},
                 {"action": "free_requested", "addr": 1 << 20, "size": 2 << 20}]
        extra["memory_snapshot"] = snap({"segments": [seg]}, {"segments": [seg], "device_traces": [trace]})
    for r in range(nproc):
        ev(r, "done", cfg=i, bounds=bounds,
           peak_allocated_gib=10.0 + r, peak_reserved_gib=12.0 + r, **extra)
for r in range(nproc):
    ev(r, "batch_done")
