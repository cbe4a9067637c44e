"""What a training process holds on the GPU outside torch's caching allocator (issue #27, item 1):
the CUDA context, cuBLAS, Transformer Engine, and NCCL's communicators, read one by one.

    torchrun --nproc_per_node 4 bench/outside_memory_gpu.py OUT.jsonl VARIANT

Each rank reads the device's used memory (cudaMemGetInfo: total - free) and torch's reserved memory
after each step below; outside = used - reserved is what no torch tensor accounts for. Steps, in
order (each adds to what the previous ones hold):
  ctx       CUDA context (first tensor)
  cublas    a BF16 GEMM (cuBLAS handle; its workspace comes from torch's allocator)
  te        Transformer Engine imported, a te.Linear forward + backward in BF16, then under FP8
  world     init_process_group("nccl", device_id) + an all-reduce of 64 MiB over all ranks
  world_ag  all-gather and reduce-scatter over the same communicator (ring connections)
  pair      a new 2-rank communicator ([0,1], [2,3]) + an all-reduce
  world2    a second communicator over all ranks (Megatron opens several over the same ranks:
            DP, DP x CP, TP x DP x CP, ...) + an all-reduce
  p2p       send / recv with the next rank (pipeline-style; NCCL's P2P connections)
  a2a       an all-to-all over all ranks (MoE dispatch)
VARIANT names the NCCL environment the launcher set (recorded with it: NCCL_BUFFSIZE,
NCCL_MAX_NCHANNELS, NCCL_CUMEM_ENABLE, ...). Rank 0 appends one JSON line per rank.
"""
from __future__ import annotations

import json
import os
import sys
import time

import torch
import torch.distributed as dist

GIB = 2 ** 30
MIB64 = 64 * 2 ** 20
ENV_KEYS = ("NCCL_BUFFSIZE", "NCCL_MAX_NCHANNELS", "NCCL_MIN_NCHANNELS", "NCCL_CUMEM_ENABLE",
            "NCCL_NVLS_ENABLE", "NCCL_P2P_NET_CHUNKSIZE", "NCCL_PROTO", "CUDA_MODULE_LOADING",
            "TORCH_NCCL_AVOID_RECORD_STREAMS", "CUDA_DEVICE_MAX_CONNECTIONS")


def read(name: str, points: list, t0: float, err: str | None = None) -> None:
    torch.cuda.synchronize()
    free, total = torch.cuda.mem_get_info()
    used, resv = total - free, torch.cuda.memory_reserved()
    points.append({"step": name, "used_gib": used / GIB, "reserved_gib": resv / GIB,
                   "allocated_gib": torch.cuda.memory_allocated() / GIB,
                   "outside_gib": (used - resv) / GIB, "t_s": round(time.time() - t0, 2),
                   **({"error": err[:300]} if err else {})})


def step(name, fn, points, t0):
    try:
        fn()
        read(name, points, t0)
    except Exception as e:  # record and go on: the later steps still say something
        read(name, points, t0, f"{type(e).__name__}: {e}")


def main() -> int:
    out, variant = sys.argv[1], sys.argv[2]
    rank, local, world = int(os.environ["RANK"]), int(os.environ["LOCAL_RANK"]), int(os.environ["WORLD_SIZE"])
    torch.cuda.set_device(local)
    t0, pts, keep = time.time(), [], []
    dev = torch.device("cuda", local)

    step("ctx", lambda: keep.append(torch.zeros(1, device=dev)), pts, t0)

    def cublas():
        a = torch.randn(4096, 4096, device=dev, dtype=torch.bfloat16)
        keep.append(a @ a)
    step("cublas", cublas, pts, t0)

    def te_linear():
        import transformer_engine.pytorch as te
        from transformer_engine.common.recipe import DelayedScaling
        lin = te.Linear(4096, 4096, bias=False, params_dtype=torch.bfloat16, device="cuda")
        x = torch.randn(4096, 4096, device=dev, dtype=torch.bfloat16, requires_grad=True)
        lin(x).sum().backward()
        with te.fp8_autocast(enabled=True, fp8_recipe=DelayedScaling()):
            y = lin(x)
        y.sum().backward()
        keep.append(lin)
    step("te", te_linear, pts, t0)

    buf = torch.ones(MIB64 // 2, device=dev, dtype=torch.bfloat16)

    def world_ar():
        dist.init_process_group("nccl", device_id=dev)
        dist.all_reduce(buf)
    step("world", world_ar, pts, t0)

    def world_ag():
        big = torch.empty(world * buf.numel(), device=dev, dtype=buf.dtype)
        dist.all_gather_into_tensor(big, buf)
        dist.reduce_scatter_tensor(buf, big)
        del big
    step("world_ag", world_ag, pts, t0)

    pairs = [list(range(i, min(i + 2, world))) for i in range(0, world, 2)]

    def pair():
        groups = [dist.new_group(p) for p in pairs]
        g = groups[rank // 2]
        dist.all_reduce(buf, group=g)
        keep.append(groups)
    step("pair", pair, pts, t0)

    def world2():
        g = dist.new_group(list(range(world)))
        dist.all_reduce(buf, group=g)
        keep.append(g)
    step("world2", world2, pts, t0)

    def p2p():
        recv = torch.empty_like(buf)
        ops = [dist.P2POp(dist.isend, buf, (rank + 1) % world), dist.P2POp(dist.irecv, recv, (rank - 1) % world)]
        for r in dist.batch_isend_irecv(ops):
            r.wait()
    step("p2p", p2p, pts, t0)

    def a2a():
        o = torch.empty_like(buf)
        dist.all_to_all_single(o, buf)
    step("a2a", a2a, pts, t0)

    gathered = [None] * world
    dist.all_gather_object(gathered, pts)
    if rank == 0:
        env = {k: os.environ[k] for k in ENV_KEYS if k in os.environ}
        meta = {"variant": variant, "env": env, "world": world, "torch": torch.__version__,
                "nccl": ".".join(map(str, torch.cuda.nccl.version())),
                "gpu": torch.cuda.get_device_name(dev)}
        try:
            import transformer_engine
            meta["transformer_engine"] = transformer_engine.__version__
        except Exception:
            pass
        with open(out, "a", encoding="utf-8") as f:
            for r, p in enumerate(gathered):
                f.write(json.dumps({**meta, "rank": r, "points": p}) + "\n")
        for s in gathered[0]:
            print(f"{variant:10} {s['step']:9} used {s['used_gib']:6.2f} reserved {s['reserved_gib']:6.2f} "
                  f"outside {s['outside_gib']:6.2f} GiB {s.get('error', '')}")
    dist.destroy_process_group()
    return 0


if __name__ == "__main__":
    sys.exit(main())
