"""Kernel profile of a few train steps (issue #22: which kernels FP8 adds over BF16, and whether the
host's issue rate binds). Used by the GPU worker (``megatron_worker.py``, job key
``kernel_profile_steps``) after a job's measured steps, which run without it. Never imports
``advisor``; torch only inside ``run_profiled`` / ``events_from_profiler``, so the summary is a pure
function of an event list (``Ev``) and is tested on CPU with made-up events.

What the summary holds (per step = divided by the number of profiled steps):

* ``categories``: per kernel category (``CATEGORIES``, matched on the kernel name, first match
  wins) GPU time (ms) and count per step;
* ``top``: the ``top`` kernels by GPU time (name cut to ``NAME_CHARS``, ms and count per step);
* ``other_top``: the largest kernels no pattern matched (to extend the table);
* ``gpu``: busy fraction of the compute stream (the stream with the most non-NCCL kernel time:
  union of its kernel intervals / the steps' wall time), of all non-NCCL kernels on any stream,
  and of any device activity (NCCL and copies included);
* ``host``: per profiler thread, the union of its CPU-side events (ops and CUDA runtime calls)
  per step, the time in blocking synchronisation calls and the kernel launches per step, busiest
  first (the issuing thread: busy minus sync close to the step time means the host binds);
* ``host_cpu``: the OS CPU time per step of the process's threads (/proc/self/task, utime +
  stime) over the profiled steps and, unprofiled, over the measured steps;
* ``overhead``: the profiled steps' wall time against the measured steps' median.
"""
from __future__ import annotations

import os
import re
from collections import namedtuple
from typing import Any, Callable, Iterable, Mapping

# One profiler event: `device` True for GPU activity (kernel, memcpy, memset), else a CPU-side
# event (an op, a CUDA runtime call); times in microseconds on the profiler's clock; `stream` the
# CUDA stream of a GPU event (None on the CPU side); `thread` the profiler's thread id of a CPU event.
Ev = namedtuple("Ev", "name device start_us end_us stream thread")

NAME_CHARS = 120

# Kernel categories by name (re.search, case-insensitive), tried in order: the first match wins.
# Patterns come from the kernel names of cuBLAS(Lt), cuDNN, TE 2.x, torch and NCCL on Hopper. They
# are matched on the kernel's base name first (template arguments and parameters cut off: a norm
# kernel whose template says __nv_fp8_e4m3 is a norm), then, where nothing matched, on the whole
# name (cutlass::Kernel2<cutlass_80_tensorop_bf16_s16816gemm_...> is a GEMM).
CATEGORIES: list[tuple[str, str, str]] = [
    # NCCL collectives: ncclDevKernel_AllReduce_Sum_bf16_RING_LL (NCCL >= 2.19), ncclKernel_... (older);
    # the kind is the word after "Kernel_" (AllReduce, ReduceScatter, AllGather, SendRecv, Broadcast):
    # the category becomes "nccl <kind>". All-to-all (MoE dispatch) runs as SendRecv.
    ("nccl", r"^nccl", "NCCL collective kernels, split by kind below"),
    # Copies and fills the driver does (the profiler names them "Memcpy DtoD (Device -> Device)",
    # "Memset (Device)"), not copy kernels.
    ("memcpy/memset", r"^mem(cpy|set)\b", "driver copies and fills"),
    # Fused attention backward: cuDNN sm90_flash_bprop..., flash-attn flash_bwd..., its dot(dO, O)
    # preprocess and dq conversion, torch's memory-efficient fmha_cutlassB. Before the GEMMs:
    # cuDNN's flash kernels have "wgmma" in their names.
    ("attention bwd", r"bprop|flash.*bwd|bwd.*flash|fmha.*cutlassB|dot_do_o|convert_dq|attn.*bwd|attention.*backward",
     "fused attention backward"),
    # Fused attention forward: cuDNN sm90_flash_fprop..., cudnn_generated..., flash_fwd..., fmha_cutlassF.
    ("attention fwd", r"fprop|flash|fmha|cudnn|attn|attention|sdpa", "fused attention forward"),
    # Hopper FP8 GEMMs: cuBLASLt sm90_xmma_gemm_e4m3..., e5m2 (gradients), cutlass fp8 kernels,
    # and (a guess: cuBLAS does not document its nvjet names; the top list shows what ran) nvjet
    # kernels whose type code starts with q.
    ("gemm fp8", r"(gemm|xmma|cutlass|nvjet|wgmma).*(e4m3|e5m2|fp8|f8)|nvjet_(sm\d+_)?q",
     "FP8 tensor-core GEMMs (TE linear layers in fp8)"),
    # Every other GEMM: cuBLAS sm90_xmma_gemm_bf16..., nvjet_* (cuBLAS 12.x; no dtype in most names),
    # cutlass, ampere_/sm80_ kernels, torch's gemv. Under FP8 this is what TE leaves in BF16 (output
    # layer, router, wgrad of non-FP8 layers) plus any FP8 GEMM whose name hides its type.
    ("gemm bf16/other", r"gemm|gemv|nvjet|xmma|cutlass.*tensorop|wgmma|s16816|matmul|splitk",
     "all other GEMMs (BF16 under both precisions)"),
    # TE's delayed scaling bookkeeping: amax history roll / scale update
    # (delayed_scaling_recipe::kernel_bulk), amax computation (compute_amax / amax_kernel), scale
    # from amax (current scaling). Before the cast patterns: these names can also say "fp8".
    ("fp8 amax/scale", r"amax|delayed_scaling|scale_update|compute_scale|update_scale|kernel_bulk",
     "FP8 scaling bookkeeping"),
    # Fused optimizer (TE / apex multi_tensor_apply: Adam, grad norm l2norm, scale, zero), torch
    # _foreach kernels. Before norm: multi_tensor_l2norm is the gradient norm, not a layer norm.
    ("optimizer", r"multi_tensor|adam|_foreach|foreach_|lamb|sgd", "optimizer step and gradient norm"),
    # Gated activations and their backward, also TE's fused activation + FP8 cast (cast_fp8_gated,
    # gated_act_kernel, dgated_act_cast_transpose): counted here, the activation being the work.
    ("activation", r"swiglu|geglu|silu|gelu|gated|act_and_mul|squared_relu|relu", "MLP activations"),
    # FP8 casts: TE cast_transpose (fused, dbias, multi), cast_fp8_1D/2D, quantize / dequantize,
    # TE's FP8 transpose. The data movement FP8 adds to every linear layer.
    ("fp8 cast/transpose", r"cast_transpose|cast_fp8|quantize|fp8|transpose_kernel|transpose_optimized|multi_cast",
     "FP8 casts, transposes, (de)quantisation"),
    # RMSNorm / LayerNorm forward and backward (TE rmsnorm_fwd_tuned_kernel, ln_bwd..., torch
    # layer_norm kernels), possibly fused with an FP8 cast.
    ("norm", r"rms_?norm|layer_?norm|\bln_|_ln_|norm_(fwd|bwd)|normalization", "normalisation"),
    # MoE routing and permutation (TE moe_permute / unpermute, top-k, radix sort) and the index /
    # gather / scatter kernels torch uses for it and for embedding and loss.
    ("index/permute/sort", r"permute|topk|sort|index|scatter|gather|embedding", "MoE routing, embedding, loss indexing"),
    # RoPE (TE fused_rope_forward / backward, megatron's apply_rotary).
    ("rope", r"rope|rotary", "rotary position embedding"),
    # Softmax / cross entropy of the loss (torch softmax_warp, cross_entropy, nll_loss).
    ("loss/softmax", r"softmax|cross_entropy|nll_loss|log_softmax", "loss"),
    # torch elementwise and reductions: residual adds, bias, dtype casts, dropout, sums.
    ("elementwise/reduce", r"elementwise|reduce_kernel|reduce_|copy_kernel|fill|cat_|dropout|CatArray",
     "torch elementwise ops and reductions"),
]
_COMPILED = [(k, re.compile(p, re.I)) for k, p, _ in CATEGORIES]
_NCCL_KIND = re.compile(r"^nccl(?:Dev)?Kernel_([A-Za-z]+)")
# CUDA runtime / driver calls that launch a kernel, and those that block the host until the GPU is done.
LAUNCH = re.compile(r"^(cuda|cu)(LaunchKernel|LaunchKernelExC|LaunchKernelEx|LaunchCooperativeKernel|GraphLaunch)")
SYNC = re.compile(r"^(cudaStreamSynchronize|cudaDeviceSynchronize|cudaEventSynchronize|cudaMemcpy$|cuStreamSynchronize|cuCtxSynchronize)")


def base_name(name: str) -> str:
    """A demangled kernel name without its return type, template arguments and parameters."""
    s = name.replace("(anonymous namespace)", "").strip()
    s = re.split(r"[<(]", s, maxsplit=1)[0].strip()
    return s.removeprefix("void ").strip()


def categorize(name: str) -> str:
    """The category of a kernel name ("other" when no pattern matches)."""
    for text in (base_name(name), name):
        for key, pat in _COMPILED:
            if pat.search(text):
                if key == "nccl":
                    m = _NCCL_KIND.match(text)
                    return f"nccl {m.group(1) if m else 'other'}"
                return key
    return "other"


def union_us(intervals: Iterable[tuple[float, float]]) -> float:
    """Total length of the union of [start, end] intervals."""
    total, cur_s, cur_e = 0.0, None, None
    for s, e in sorted(intervals):
        if cur_e is None or s > cur_e:
            if cur_e is not None:
                total += cur_e - cur_s
            cur_s, cur_e = s, e
        else:
            cur_e = max(cur_e, e)
    if cur_e is not None:
        total += cur_e - cur_s
    return total


def _ms(us: float, n: int) -> float:
    return round(us / 1000.0 / n, 4)


def summarize(events: Iterable[Ev], n_steps: int, step_walls_s: list[float],
              measured_step_s: float | None = None, top: int = 25) -> dict[str, Any]:
    """The kernel profile summary (module docstring) of `n_steps` profiled steps whose wall times
    (s, host clock, each ended by a device synchronize) are `step_walls_s`."""
    if n_steps < 1 or len(step_walls_s) != n_steps:
        raise ValueError(f"{n_steps} profiled steps but {len(step_walls_s)} wall times")
    wall_us = sum(step_walls_s) * 1e6
    dev = [e for e in events if e.device and e.end_us > e.start_us]
    cpu = [e for e in events if not e.device and e.end_us >= e.start_us]
    cats: dict[str, list[float]] = {}
    kern: dict[str, list[float]] = {}
    stream_us: dict[Any, float] = {}
    no_comm = []  # the kernels that are neither NCCL nor copies
    for e in dev:
        d = e.end_us - e.start_us
        c = categorize(e.name)
        a = cats.setdefault(c, [0.0, 0])
        a[0] += d
        a[1] += 1
        k = kern.setdefault(e.name[:NAME_CHARS], [0.0, 0, c])
        k[0] += d
        k[1] += 1
        if not c.startswith(("nccl", "memcpy")):
            stream_us[e.stream] = stream_us.get(e.stream, 0.0) + d
            no_comm.append(e)
    compute = max(stream_us, key=stream_us.get) if stream_us else None
    gpu_total = sum(v[0] for v in cats.values())
    ranked = sorted(kern.items(), key=lambda kv: -kv[1][0])

    def row(name, v):
        return {"name": name, "ms": _ms(v[0], n_steps), "count": round(v[1] / n_steps, 2), "category": v[2]}

    threads: dict[Any, list[Ev]] = {}
    for e in cpu:
        threads.setdefault(e.thread, []).append(e)
    host = []
    for t, evs in threads.items():
        busy = union_us((e.start_us, e.end_us) for e in evs)
        sync = union_us((e.start_us, e.end_us) for e in evs if SYNC.match(e.name))
        host.append({"thread": t, "busy_ms": _ms(busy, n_steps), "sync_ms": _ms(sync, n_steps),
                     "issue_ms": _ms(busy - sync, n_steps),
                     "launches": round(sum(1 for e in evs if LAUNCH.match(e.name)) / n_steps, 2),
                     "events": round(len(evs) / n_steps, 2)})
    host.sort(key=lambda h: -h["busy_ms"])
    prof_step = sum(step_walls_s) / n_steps
    return {
        "steps": n_steps, "step_wall_ms": [round(w * 1000, 3) for w in step_walls_s],
        "gpu_ms_total": _ms(gpu_total, n_steps), "kernels": round(len(dev) / n_steps, 2),
        "categories": {c: {"ms": _ms(v[0], n_steps), "count": round(v[1] / n_steps, 2)}
                       for c, v in sorted(cats.items(), key=lambda kv: -kv[1][0])},
        "top": [row(n, v) for n, v in ranked[:top]],
        "other_top": [row(n, v) for n, v in ranked if v[2] == "other"][:8],
        "gpu": {"compute_stream": compute,
                "compute_stream_busy": round(union_us((e.start_us, e.end_us) for e in dev if e.stream == compute) / wall_us, 4)
                if compute is not None and wall_us > 0 else None,
                "non_nccl_busy": round(union_us((e.start_us, e.end_us) for e in no_comm) / wall_us, 4) if wall_us > 0 else None,
                "any_busy": round(union_us((e.start_us, e.end_us) for e in dev) / wall_us, 4) if wall_us > 0 else None,
                "streams": len({e.stream for e in dev})},
        "host": host[:6],
        "overhead": {"profiled_step_s": round(prof_step, 6), "measured_step_s": measured_step_s,
                     "ratio": round(prof_step / measured_step_s, 4) if measured_step_s else None},
    }


# ------------------------------------------------------------------------ OS CPU time per thread
def thread_cpu_snapshot(proc: str = "/proc/self/task") -> dict[int, tuple[str, float]] | None:
    """{tid: (thread name, utime + stime in seconds)} of this process's threads (Linux), else None."""
    try:
        tick = os.sysconf("SC_CLK_TCK")
        out = {}
        for tid in os.listdir(proc):
            try:
                with open(f"{proc}/{tid}/stat", encoding="utf-8") as f:
                    stat = f.read()
            except OSError:  # the thread ended
                continue
            name = stat[stat.index("(") + 1:stat.rindex(")")]
            fields = stat[stat.rindex(")") + 2:].split()
            out[int(tid)] = (name, (int(fields[11]) + int(fields[12])) / tick)  # utime, stime (fields 14, 15)
        return out
    except (OSError, ValueError):
        return None


def thread_cpu_delta(before: Mapping[int, tuple[str, float]] | None, after: Mapping[int, tuple[str, float]] | None,
                     n_steps: int, main_tid: int, keep: int = 6) -> dict[str, Any] | None:
    """OS CPU ms per step between two snapshots: the main thread's, all threads', and the busiest."""
    if not before or not after or n_steps < 1:
        return None
    rows = []
    for tid, (name, t1) in after.items():
        t0 = before.get(tid, (name, 0.0))[1]
        rows.append((tid, name, (t1 - t0) * 1000.0 / n_steps))
    rows.sort(key=lambda r: -r[2])
    main = next((r[2] for r in rows if r[0] == main_tid), None)
    return {"main_thread_ms": round(main, 3) if main is not None else None,
            "all_threads_ms": round(sum(r[2] for r in rows), 3), "threads": len(rows),
            "busiest": [{"tid": t, "name": n, "ms": round(ms, 3), "main": t == main_tid}
                        for t, n, ms in rows[:keep]]}


# ------------------------------------------------------------------------------- torch side
def events_from_profiler(prof) -> list[Ev]:
    """`Ev`s of a finished torch.profiler.profile: its raw Kineto events (fast, no event tree)."""
    out = []
    for k in prof.profiler.kineto_results.events():
        dt = str(k.device_type()).rsplit(".", 1)[-1]
        start = k.start_ns() / 1000.0 if hasattr(k, "start_ns") else float(k.start_us())
        dur = k.duration_ns() / 1000.0 if hasattr(k, "duration_ns") else float(k.duration_us())
        device = dt != "CPU"
        out.append(Ev(k.name(), device, start, start + dur, k.device_resource_id() if device else None,
                      None if device else k.start_thread_id()))
    return out


def run_profiled(step: Callable[[], None], n: int, sync: Callable[[], None], cuda: bool = True,
                 clock: Callable[[], float] | None = None) -> tuple[list[Ev], list[float], Any]:
    """Run `step` n times under torch.profiler (CPU + CUDA activities, no shapes, no stacks), each
    ended by `sync`; returns (events, wall time of each step, OS CPU snapshots (before, after))."""
    import time

    import torch

    clock = clock or time.time
    acts = [torch.profiler.ProfilerActivity.CPU] + ([torch.profiler.ProfilerActivity.CUDA] if cuda else [])
    walls = []
    sync()
    with torch.profiler.profile(activities=acts, record_shapes=False, with_stack=False) as prof:
        before = thread_cpu_snapshot()
        for _ in range(n):
            t = clock()
            step()
            sync()
            walls.append(clock() - t)
        after = thread_cpu_snapshot()
    return events_from_profiler(prof), walls, (before, after)


def profile_summary(step: Callable[[], None], n: int, sync: Callable[[], None], measured_step_s: float | None,
                    main_tid: int, cuda: bool = True, measured_cpu: Any = None) -> dict[str, Any]:
    """run_profiled + summarize, with the OS CPU time per thread of the profiled steps and, when
    given ((before, after, steps) snapshots around the measured steps), of the unprofiled ones."""
    events, walls, (before, after) = run_profiled(step, n, sync, cuda)
    out = summarize(events, n, walls, measured_step_s)
    out["host_cpu"] = {"profiled": thread_cpu_delta(before, after, n, main_tid)}
    if measured_cpu is not None and len(measured_cpu) == 3:
        out["host_cpu"]["measured"] = thread_cpu_delta(measured_cpu[0], measured_cpu[1], measured_cpu[2], main_tid)
    return out


def cpu_model(cpuinfo: str = "/proc/cpuinfo") -> str | None:
    """The host CPU's model name (the first "model name" line of /proc/cpuinfo), None where unknown:
    a host-bound run's speed is its host's, and lent machines differ."""
    try:
        with open(cpuinfo, encoding="utf-8", errors="replace") as f:
            for line in f:
                if line.lower().startswith("model name"):
                    return line.split(":", 1)[1].strip() or None
    except OSError:
        return None
    return None


def host_op_us(op: Callable[[], None], sync: Callable[[], None], n: int = 2000, rounds: int = 3,
               clock: Callable[[], float] | None = None) -> float:
    """Host microseconds per call of `op` (an eager op on a tiny CUDA tensor, whose kernel is shorter
    than its issue, so the loop runs at the host's issue rate), the median of `rounds` loops of `n`
    calls each closed by `sync`: the machine's issue speed, which host-bound runs are paced by."""
    import statistics
    import time

    clock = clock or time.perf_counter
    sync()
    out = []
    for _ in range(rounds):
        t = clock()
        for _ in range(n):
            op()
        sync()
        out.append((clock() - t) / n * 1e6)
    return round(statistics.median(out), 3)


def host_speed() -> dict[str, Any]:
    """{"cpu_model", "host_op_us"} of this process's host and current CUDA device (torch imported
    here: the GPU worker's hello); what could not be measured is left out."""
    out: dict[str, Any] = {}
    model = cpu_model()
    if model:
        out["cpu_model"] = model
    try:
        import torch

        if torch.cuda.is_available():
            x = torch.zeros(1, device="cuda")
            out["host_op_us"] = host_op_us(lambda: x.add_(1.0), torch.cuda.synchronize)
    except Exception:  # noqa: BLE001 - a probe: the record goes on without it
        pass
    return out
