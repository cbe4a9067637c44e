"""Memory outside torch's allocator that megatron-core's process groups and TE's attention add
(issue #27, item 1), group by group, in a fresh process per layout.

    torchrun --nproc_per_node 4 bench/outside_memory_megatron_gpu.py OUT.jsonl TP PP CP EP

Reads (device used - torch reserved, GiB) after: the CUDA context; init_process_group with device_id
(and a barrier); parallel_state.initialize_model_parallel (the groups megatron opens for every job,
whatever their size); a 1 MiB all-reduce over each of megatron's groups in turn (the group's size is
recorded: NCCL connects a communicator's buffers at its first collective); a TE TransformerLayer
forward + backward at hidden 4096, seq 4096 (cuDNN fused attention's handle and plans). Rank 0 appends
one JSON line per rank. bench/outside_memory_gpu.py reads the NCCL part with plain torch groups.
"""
from __future__ import annotations

import json
import os
import sys
import time

import torch
import torch.distributed as dist

GIB = 2 ** 30
# megatron-core 0.19 parallel_state getters, in the order a training step first uses them
GROUPS = ("get_data_parallel_group", "get_data_parallel_group:cp", "get_tensor_model_parallel_group",
          "get_pipeline_model_parallel_group", "get_context_parallel_group", "get_model_parallel_group",
          "get_embedding_group", "get_position_embedding_group", "get_tensor_and_data_parallel_group",
          "get_tensor_and_context_parallel_group", "get_expert_model_parallel_group",
          "get_expert_tensor_parallel_group", "get_expert_data_parallel_group",
          "get_expert_tensor_and_model_parallel_group", "get_amax_reduction_group")


def read(points, name, t0, **kw):
    torch.cuda.synchronize()
    free, total = torch.cuda.mem_get_info()
    used, resv = total - free, torch.cuda.memory_reserved()
    points.append({"step": name, "used_gib": used / GIB, "reserved_gib": resv / GIB,
                   "outside_gib": (used - resv) / GIB, "t_s": round(time.time() - t0, 2), **kw})


def group(ps, name):
    fn, _, opt = name.partition(":")
    g = getattr(ps, fn)
    try:
        return g(with_context_parallel=True) if opt == "cp" else g()
    except TypeError:
        return None


def main() -> int:
    out = sys.argv[1]
    tp, pp, cp, ep = (int(x) for x in sys.argv[2:6])
    rank, local, world = int(os.environ["RANK"]), int(os.environ["LOCAL_RANK"]), int(os.environ["WORLD_SIZE"])
    torch.cuda.set_device(local)
    dev = torch.device("cuda", local)
    t0, pts = time.time(), []
    x = torch.zeros(1, device=dev)
    read(pts, "ctx", t0)
    dist.init_process_group("nccl", device_id=dev)
    dist.barrier()
    read(pts, "world", t0)
    from megatron.core import parallel_state as ps
    ps.initialize_model_parallel(tensor_model_parallel_size=tp, pipeline_model_parallel_size=pp,
                                 context_parallel_size=cp, expert_model_parallel_size=ep,
                                 create_gloo_process_groups=False)
    n_groups = None
    try:
        n_groups = len(dist.distributed_c10d._world.pg_map)  # torch's registry of process groups
    except Exception:
        pass
    read(pts, "groups_created", t0, n_groups=n_groups)
    buf = torch.ones(2 ** 19, device=dev, dtype=torch.bfloat16)
    seen = set()
    for name in GROUPS:
        try:
            g = group(ps, name)
        except Exception as e:
            read(pts, name, t0, error=f"{type(e).__name__}: {e}"[:200])
            continue
        if g is None or id(g) in seen:
            continue
        seen.add(id(g))
        size = dist.get_world_size(g)
        try:
            dist.all_reduce(buf, group=g)
            read(pts, name, t0, size=size)
        except Exception as e:
            read(pts, name, t0, size=size, error=f"{type(e).__name__}: {e}"[:200])
    try:
        import transformer_engine.pytorch as te
        layer = te.TransformerLayer(4096, 14336, 32, num_gqa_groups=8, params_dtype=torch.bfloat16,
                                    self_attn_mask_type="causal", normalization="RMSNorm",
                                    activation="swiglu", bias=False, device="cuda")
        h = torch.randn(4096, 1, 4096, device=dev, dtype=torch.bfloat16, requires_grad=True)
        layer(h).sum().backward()
        del layer, h
        read(pts, "te_layer", t0)
    except Exception as e:
        read(pts, "te_layer", t0, error=f"{type(e).__name__}: {e}"[:200])
    gathered = [None] * world
    dist.all_gather_object(gathered, pts)
    if rank == 0:
        meta = {"probe": "megatron-groups", "layout": {"tp": tp, "pp": pp, "cp": cp, "ep": ep}, "world": world,
                "torch": torch.__version__, "nccl": ".".join(map(str, torch.cuda.nccl.version())),
                "gpu": torch.cuda.get_device_name(dev)}
        with open(out, "a", encoding="utf-8") as f:
            for r, p in enumerate(gathered):
                f.write(json.dumps({**meta, "rank": r, "points": p}) + "\n")
        for s in gathered[0]:
            extra = f"size {s['size']}" if "size" in s else (f"groups {s.get('n_groups')}" if "n_groups" in s else "")
            print(f"tp{tp}pp{pp}cp{cp}ep{ep} {s['step']:44} outside {s['outside_gib']:6.2f} GiB {extra} {s.get('error', '')}")
    del x
    dist.destroy_process_group()
    return 0


if __name__ == "__main__":
    sys.exit(main())
