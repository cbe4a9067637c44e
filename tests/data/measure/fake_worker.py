"""A stand-in for megatron_worker.py in CPU tests: writes the same events for every rank from one
process. The job's id says what happens: ok-*, oom-* (rank 1 runs out of memory and the process
exits), hang-* (no progress: the watchdog must kill it), segv-* (dies with no event)."""
import json
import os
import sys
import time

run_dir, start, nproc = sys.argv[1], int(sys.argv[2]), int(sys.argv[3])
files = [open(os.path.join(run_dir, f"rank{r}.jsonl"), "a") for r in range(nproc)]


def ev(r, kind, **kw):
    files[r].write(json.dumps({"ev": kind, "t": time.time(), **kw}) + "\n")
    files[r].flush()


for r in range(nproc):
    ev(r, "hello", rank=r, local_rank=r, world=nproc, uuid=f"GPU-00000000-0000-4000-8000-{r:012x}",
       pci_bus_id=f"00000000:{0x18 + r:02x}:00.0", gpu_name="NVIDIA H200", torch="2.11.0",
       cuda="13.0", megatron_core="0.19.2", python="3.12.3", hostname="fake")
jobs = [json.loads(l) for l in open(os.path.join(run_dir, "jobs.jsonl"))]
for job in jobs:
    i = job["index"]
    if i < start:
        continue
    for r in range(nproc):
        ev(r, "start", cfg=i)
        ev(r, "built", cfg=i, params=1000, stage=r // (job["tp"] * job["dp"]), tp_rank=r % job["tp"],
           dp_rank=(r // job["tp"]) % job["dp"], ep_rank=0, mem_gib=1.0)
    kind = job["id"].split("-")[0]
    if kind == "segv":
        print("Fatal Python error: Segmentation fault", flush=True)
        sys.exit(139)
    if kind == "hang":
        ev(0, "step", cfg=i, k=0, tt=time.time())
        time.sleep(3600)
    t = time.time()
    ev(0, "step", cfg=i, k=0, tt=t)
    bounds = [t]
    for k in range(1, job["warmup"] + job["steps"] + 1):
        time.sleep(0.1)
        bounds.append(time.time())
        ev(0, "step", cfg=i, k=k, tt=bounds[-1])
        if kind == "oom" and k == 1:
            ev(1, "oom", cfg=i, error="CUDA out of memory. Tried to allocate 20.00 GiB", allocated_gib=130.0,
               reserved_gib=138.0, peak_allocated_gib=131.0, peak_reserved_gib=139.0)
            print("torch.OutOfMemoryError: CUDA out of memory. Tried to allocate 20.00 GiB", flush=True)
            os._exit(1)
    for r in range(nproc):
        ev(r, "done", cfg=i, bounds=bounds,
           peak_allocated_gib=10.0 + r, peak_reserved_gib=12.0 + r)
for r in range(nproc):
    ev(r, "batch_done")
