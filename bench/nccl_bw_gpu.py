"""NCCL bandwidth on the lent machine, against the size of the message (GPU, issue #22).

The te profile prices a collective as ``(n - 1) / n * bytes / (link GB/s * efficiency) + latency``
(models/step_time.collective_time, NCCL's bus-bandwidth convention) and a p2p transfer as
``bytes / bandwidth + latency``. This measures what NCCL delivers on this machine for the patterns
the layouts use, one size at a time, so the two can be compared term by term:

- all_gather / reduce_scatter / all_reduce / all_to_all over groups of 2 (both pairs (0,1) and
  (2,3) at once, as TP 2 x DP 2 runs them) and of 4;
- the context-parallel ring: every rank sends to the next and receives from the previous at once
  (batch_isend_irecv), groups of 2 and 4;
- one pair's send/recv (pipeline p2p).

``bytes`` is the full buffer per rank (the all-gather's output, the reduce-scatter's input, the
all-reduce's tensor, the all-to-all's send buffer, the p2p message). One JSON line per (op, group
size, bytes) with the median time over the iterations (CUDA events), the algorithm bandwidth
(bytes / t) and the bus bandwidth (NCCL's: models.step_time.bus_factor). Rank 0 writes, and prints a table::

    python -m torch.distributed.run --nproc_per_node 4 bench/nccl_bw_gpu.py OUT.jsonl [--iters 20]
"""
from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import sys

import torch
import torch.distributed as dist

from advisor.models.step_time import bus_factor  # needs the repo on PYTHONPATH (te_device.sh sets it)

SIZES = [1 << s for s in range(18, 31, 2)]  # 256 KiB .. 1 GiB
OPS = ("all_gather", "reduce_scatter", "all_reduce", "all_to_all", "ring", "p2p")


def _runner(op: str, nbytes: int, group, ranks: list[int], rank: int, dev):
    """A zero-argument function issuing one `op` on `group` with a `nbytes` buffer per rank."""
    n = len(ranks)
    elems = nbytes // 2  # bf16
    elems -= elems % n
    big = torch.empty(elems, dtype=torch.bfloat16, device=dev)
    part = torch.empty(elems // n, dtype=torch.bfloat16, device=dev)
    me = ranks.index(rank)
    if op == "all_gather":
        return lambda: dist.all_gather_into_tensor(big, part, group=group)
    if op == "reduce_scatter":
        return lambda: dist.reduce_scatter_tensor(part, big, group=group)
    if op == "all_reduce":
        return lambda: dist.all_reduce(big, group=group)
    if op == "all_to_all":
        out = torch.empty_like(big)
        return lambda: dist.all_to_all_single(out, big, group=group)
    recv = torch.empty_like(big)
    if op == "ring":
        nxt, prv = ranks[(me + 1) % n], ranks[(me - 1) % n]

        def ring():
            for r in dist.batch_isend_irecv([dist.P2POp(dist.isend, big, nxt, group),
                                             dist.P2POp(dist.irecv, recv, prv, group)]):
                r.wait()
        return ring
    if op == "p2p":  # ranks[0] -> ranks[1] only
        if me == 0:
            return lambda: dist.send(big, ranks[1], group=group)
        if me == 1:
            return lambda: dist.recv(recv, ranks[0], group=group)
        return lambda: None
    raise ValueError(op)


def _time(fn, iters: int, warmup: int) -> float:
    for _ in range(warmup):
        fn()
    torch.cuda.synchronize()
    ts = []
    for _ in range(iters):
        a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        a.record()
        fn()
        b.record()
        b.synchronize()
        ts.append(a.elapsed_time(b) / 1e3)
    return statistics.median(ts)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("out")
    ap.add_argument("--iters", type=int, default=20)
    ap.add_argument("--warmup", type=int, default=5)
    a = ap.parse_args(argv)
    dist.init_process_group("nccl")
    rank, world = dist.get_rank(), dist.get_world_size()
    local = int(os.environ.get("LOCAL_RANK", rank))
    torch.cuda.set_device(local)
    dev = torch.device("cuda", local)
    groups = {world: (list(range(world)), dist.new_group(list(range(world))))}
    if world >= 4 and world % 2 == 0:
        pairs = [list(range(i, i + 2)) for i in range(0, world, 2)]
        made = [(p, dist.new_group(p)) for p in pairs]  # every rank creates every group
        groups[2] = next((p, g) for p, g in made if rank in p)
    rows = []
    for n, (ranks, group) in sorted(groups.items()):
        for op in OPS:
            for nbytes in SIZES:
                fn = _runner(op, nbytes, group, ranks, rank, dev)
                dist.barrier()
                iters = a.iters if nbytes < (1 << 28) else max(5, a.iters // 2)
                t = _time(fn, iters, a.warmup)
                ts = [None] * world
                dist.all_gather_object(ts, t)
                t_max = max(x for x in ts if x is not None)
                if op == "p2p":  # only the pair's receive time counts
                    t_max = ts[ranks[1]]
                algbw = nbytes / t_max / 1e9
                rows.append({"op": op, "group": n, "concurrent_groups": world // n if op != "p2p" else 1,
                             "bytes": nbytes, "seconds": t_max, "algbw_gbs": algbw,
                             "busbw_gbs": algbw * bus_factor(op, n)})
                del fn
                torch.cuda.empty_cache()
    if rank == 0:
        env = {"gpu": torch.cuda.get_device_name(0), "gpus": world, "torch": torch.__version__,
               "nccl": ".".join(map(str, torch.cuda.nccl.version())), "host": platform.node(),
               "NCCL_NVLS_ENABLE": os.environ.get("NCCL_NVLS_ENABLE")}
        with open(a.out, "w") as f:
            for r in rows:
                f.write(json.dumps({**r, "env": env}) + "\n")
        print(f"{'op':<15}{'n':>3}{'bytes':>12}{'us':>10}{'algbw':>8}{'busbw':>8}")
        for r in rows:
            print(f"{r['op']:<15}{r['group']:>3}{r['bytes']:>12}{r['seconds'] * 1e6:>10.1f}"
                  f"{r['algbw_gbs']:>8.1f}{r['busbw_gbs']:>8.1f}")
    dist.barrier()
    dist.destroy_process_group()
    return 0


if __name__ == "__main__":
    sys.exit(main())
