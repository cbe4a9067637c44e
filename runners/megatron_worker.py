"""One torchrun worker of a measurement batch: trains the real architecture with megatron-core
(GPTModel; per job the local non-TE layer spec with SDPA core attention, or with job["stack"] ==
"te" the Transformer Engine layer spec: TE layers and fused attention, sequence / context
parallelism, FP8 through TE, TE grouped-GEMM experts) for each job of a batch and reports
events to ``<run_dir>/rank<R>.jsonl``. Needs torch + megatron-core; never imports ``advisor``:
the launcher (``advisor.runners.measure``) writes fully resolved jobs to ``<run_dir>/jobs.jsonl``.

Run by the launcher as::

    torchrun --nproc-per-node N runners/megatron_worker.py RUN_DIR FIRST_JOB

Events (one JSON line each, flushed and fsynced): hello, start, built, step (rank 0 only),
done, oom, crash, batch_done. A failure on one rank cannot be recovered in-process when other
ranks wait in a collective, so with more than one GPU the failing rank records the failure and
exits (code 3 = OOM, 4 = other); the launcher restarts the batch at the next job. With one GPU
the worker frees everything and goes on.
"""
from __future__ import annotations

import argparse
import faulthandler
import gc
import json
import math
import os
import signal
import socket
import sys
import threading
import time
import traceback

import torch
import torch.distributed as dist
import torch.nn.functional as F

from megatron.core import parallel_state, tensor_parallel
from megatron.core.distributed import (DistributedDataParallel, DistributedDataParallelConfig,
                                       finalize_model_grads)
from megatron.core.models.gpt import GPTModel
from megatron.core.models.gpt.gpt_layer_specs import (get_gpt_decoder_block_spec,
                                                      get_gpt_layer_local_spec)
from megatron.core.optimizer import OptimizerConfig, get_megatron_optimizer
from megatron.core.pipeline_parallel import get_forward_backward_func
from megatron.core.transformer import TransformerConfig
from megatron.core.transformer.module import Float16Module, MegatronModule
from kernel_probe import host_speed, profile_summary, thread_cpu_snapshot  # beside this file
from mem_probe import (point as mem_point, pressure_plan, pressure_result,  # beside this file
                       summarize as summarize_memory)
from mem_snapshot import summarize as snapshot_summary  # beside this file
from moe_probe import (MoEPhaseTimer, patch_grouped_experts, probe_grouped_mm,  # beside this file
                       summarize as summarize_moe)
from parent_watch import die_with_parent  # beside this file (sys.path[0] when run as a script)

GIB = 2 ** 30
# GQA in SDPAttention: "native" (SDPA's enable_gqa, as fused attention kernels do) or "repeat" K/V
# heads up to the query heads (every record before env.attention existed). Recorded as
# `attention`; native measured 0.9-1.3% faster and 0.1-0.25 GiB smaller (data/measurements/h200x4-gqa.jsonl).
GQA = os.environ.get("ADVISOR_SDPA_GQA", "native")
# Point-to-point of the interleaved (VP > 1) schedule: "overlap" is Megatron-LM's default
# (--overlap-p2p-communication: isend / irecv per direction, overlapped with compute); "batched"
# (megatron-core's TransformerConfig default, one batch_isend_irecv) deadlocked on 4xH200 whenever
# PP = 4, VP = 2 and the microbatches were exactly 4 (data/measurements/h200x4-hang-probe.jsonl).
INTERLEAVED_P2P = "batched" if os.environ.get("ADVISOR_OVERLAP_P2P") == "0" else "overlap"
# Per-phase memory (runners/mem_probe.py): one extra, untimed step after the measured ones.
MEMORY_PHASES = os.environ.get("ADVISOR_MEMORY_PHASES", "1") != "0"
EXIT_OOM, EXIT_CRASH = 3, 4
# How this torch runs grouped-GEMM experts (moe_probe.probe_grouped_mm), set in main().
GROUPED_MM = "not probed"
# torch's caching allocator with expandable segments: as launched (PYTORCH_CUDA_ALLOC_CONF), then
# per job as its "expandable_segments" key says (set_allocator; new segments follow the setting).
EXPANDABLE = "expandable_segments:true" in os.environ.get("PYTORCH_CUDA_ALLOC_CONF", "").replace(" ", "").lower()


class SDPAttention(MegatronModule):
    """Core attention through torch's scaled_dot_product_attention (flash / memory-efficient
    kernels: memory linear in the sequence, unlike the local spec's unfused DotProductAttention).
    Causal; GQA natively (SDPA's enable_gqa) or, with ADVISOR_SDPA_GQA=repeat, by repeating K/V
    heads up to the query heads of this TP partition. Multi-latent attention (query / key head
    dim 192, value 128): V is zero-padded to the query head dim for the flash kernel and the
    output cut back (what flash-attention based MLA implementations do)."""

    def __init__(self, config, layer_number, attn_mask_type, attention_type,
                 attention_dropout=None, softmax_scale=None, cp_comm_type=None,
                 pg_collection=None, **unused):
        super().__init__(config=config)
        assert config.context_parallel_size == 1, "SDPAttention does not do context parallelism"
        self.softmax_scale = softmax_scale

    def forward(self, query, key, value, attention_mask, attn_mask_type=None,
                attention_bias=None, packed_seq_params=None, **unused):
        # [s, b, heads, d] -> [b, heads, s, d]
        q, k, v = (x.permute(1, 2, 0, 3) for x in (query, key, value))
        gqa = k.size(1) != q.size(1)
        if gqa and GQA != "native":
            rep = q.size(1) // k.size(1)
            k, v = k.repeat_interleave(rep, dim=1), v.repeat_interleave(rep, dim=1)
        dv = v.size(-1)
        if dv != q.size(-1):
            v = F.pad(v, (0, q.size(-1) - dv))
        o = F.scaled_dot_product_attention(q, k, v, is_causal=True, scale=self.softmax_scale,
                                           enable_gqa=gqa and GQA == "native")
        if dv != o.size(-1):
            o = o[..., :dv]
        s, b = o.size(2), o.size(0)
        return o.permute(2, 0, 1, 3).reshape(s, b, -1)


# ---------------------------------------------------------------------------------------------
class Events:
    def __init__(self, path):
        self.f = open(path, "a", encoding="utf-8")

    def __call__(self, ev, **kw):
        kw = {"ev": ev, "t": time.time(), **kw}
        self.f.write(json.dumps(kw) + "\n")
        self.f.flush()
        os.fsync(self.f.fileno())


def device_identity(local_rank):
    p = torch.cuda.get_device_properties(local_rank)
    uuid = str(p.uuid)
    if not uuid.startswith("GPU-"):
        uuid = "GPU-" + uuid
    try:
        pci = "%08x:%02x:%02x.0" % (p.pci_domain_id, p.pci_bus_id, p.pci_device_id)
    except AttributeError:
        pci = None
    return {"uuid": uuid, "pci_bus_id": pci, "gpu_name": p.name,
            "total_memory_gib": p.total_memory / GIB}


def versions():
    try:
        from importlib.metadata import version
        mc = version("megatron-core")
    except Exception:
        mc = None
    try:
        from importlib.metadata import version
        te = version("transformer-engine")
    except Exception:
        te = None
    return {"torch": torch.__version__, "cuda": torch.version.cuda, "megatron_core": mc,
            "transformer_engine": te, "python": sys.version.split()[0],
            "hostname": socket.gethostname()}


# ---------------------------------------------------------------------------------------------
def _activation(name):
    if name == "squared_relu":
        from megatron.core.activations import squared_relu
        return squared_relu
    if name == "quick_gelu":  # the object TransformerConfig and the MoE experts compare against
        from megatron.core.fusions.fused_bias_geglu import quick_gelu
        return quick_gelu
    return {"silu": F.silu, "gelu": F.gelu}[name]


def _patch_attention(layer_spec):
    layer_spec.submodules.self_attention.submodules.core_attention = SDPAttention


def te_layer_spec(job, config, vp_stage):
    """megatron-core's Transformer Engine spec: TE linear / norm layers and TEDotProductAttention
    (fused attention; context parallelism), MoE experts through TE's GroupedLinear when
    moe_grouped_gemm is set (megatron-core picks the module from the config)."""
    if job["tc"].get("num_moe_experts") or job["tc"].get("multi_latent_attention"):
        return get_gpt_decoder_block_spec(config, use_transformer_engine=True,
                                          normalization=config.normalization, vp_stage=vp_stage)
    from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_with_transformer_engine_spec
    return get_gpt_layer_with_transformer_engine_spec()


def layer_spec(job, config, vp_stage):
    if job.get("stack") == "te":
        return te_layer_spec(job, config, vp_stage)
    if job["tc"].get("num_moe_experts") or job["tc"].get("multi_latent_attention"):
        spec = get_gpt_decoder_block_spec(config, use_transformer_engine=False,
                                          normalization=config.normalization, vp_stage=vp_stage)
        for ls in spec.layer_specs:
            _patch_attention(ls)
        if job.get("moe_experts") == "grouped":
            if not GROUPED_MM.startswith("torch_grouped_mm"):
                raise RuntimeError(f"grouped GEMM experts asked for, but {GROUPED_MM}")
            if not patch_grouped_experts(spec) and job["tc"].get("num_moe_experts"):
                raise RuntimeError("grouped GEMM experts asked for, but no MoE layer spec was found to patch")
        return spec
    spec = get_gpt_layer_local_spec(normalization=config.normalization)
    _patch_attention(spec)
    return spec


def build(job):
    tc = dict(job["tc"])
    for k in ("params_dtype", "pipeline_dtype"):
        tc[k] = getattr(torch, tc[k])
    tc["activation_func"] = _activation(tc["activation_func"])
    if tc.get("window_size") is not None:  # JSON made the (left, right) tuple a list
        tc["window_size"] = tuple(tc["window_size"])
    tc = {k: v for k, v in tc.items() if v is not None}
    if job["vp"] > 1 and INTERLEAVED_P2P == "overlap":
        tc.update(overlap_p2p_comm=True, batch_p2p_comm=False)
    parallel_state.initialize_model_parallel(
        tensor_model_parallel_size=job["tp"], pipeline_model_parallel_size=job["pp"],
        virtual_pipeline_model_parallel_size=job["vp"] if job["vp"] > 1 else None,
        context_parallel_size=job["cp"], expert_model_parallel_size=job["ep"],
        expert_tensor_parallel_size=job["etp"], create_gloo_process_groups=False)
    tensor_parallel.model_parallel_cuda_manual_seed(1234)
    if tc.get("multi_latent_attention"):
        from megatron.core.transformer.transformer_config import MLATransformerConfig
        config = MLATransformerConfig(**tc)
    else:
        config = TransformerConfig(**tc)
    chunks = []
    vp = job["vp"]
    for i in range(vp):
        vps = i if vp > 1 else None
        pre = parallel_state.is_pipeline_first_stage(ignore_virtual=False, vp_stage=vps)
        post = parallel_state.is_pipeline_last_stage(ignore_virtual=False, vp_stage=vps)
        m = GPTModel(config=config, transformer_layer_spec=layer_spec(job, config, vps),
                     pre_process=pre, post_process=post, vp_stage=vps, **job["model_kw"])
        for p in m.parameters():
            tensor_parallel.set_defaults_if_not_set_tensor_model_parallel_attributes(p)
        m.cuda(torch.cuda.current_device())
        chunks.append(Float16Module(config, m))
    n_params = sum(p.numel() for c in chunks for p in c.parameters())
    ddp_config = DistributedDataParallelConfig(**job["ddp"])
    overlap = ddp_config.overlap_grad_reduce
    pp_rank = parallel_state.get_pipeline_model_parallel_rank()
    model = [DistributedDataParallel(config=config, ddp_config=ddp_config, module=c,
                                     disable_bucketing=(i > 0) or pp_rank > 0 or not overlap)
             for i, c in enumerate(chunks)]
    opt = dict(job["opt"])
    opt["params_dtype"] = getattr(torch, opt["params_dtype"])
    optimizer = get_megatron_optimizer(OptimizerConfig(**opt), model, use_gloo_process_groups=False)
    config.finalize_model_grads_func = finalize_model_grads
    config.grad_scale_func = optimizer.scale_loss
    if overlap:
        config.no_sync_func = [m.no_sync for m in model] if len(model) > 1 else model[0].no_sync
    return config, model, optimizer, n_params


def synthetic_batches(job):
    """Random tokens of this rank's share of the sequence: seq / cp with context parallelism
    (each CP rank holds 2 of the 2*cp load-balanced chunks; RoPE is sliced to them by megatron)."""
    mbs, seq, vocab = job["mbs"], job["seq"] // job.get("cp", 1), job["model_kw"]["vocab_size"]
    dev = torch.cuda.current_device()
    g = torch.Generator(device="cuda").manual_seed(1)
    tokens = torch.randint(0, vocab, (mbs, seq + 1), device=dev, generator=g)
    batch = (tokens[:, :-1].contiguous(), tokens[:, 1:].contiguous(),
             torch.arange(seq, device=dev).unsqueeze(0).expand(mbs, -1).contiguous())
    while True:
        yield batch


def forward_step(data_iterator, model):
    tokens, labels, position_ids = next(data_iterator)
    out = model(tokens, position_ids, None, labels=labels)

    def loss_func(output_tensor):
        loss = output_tensor.float().mean()
        return loss, {"lm loss": loss.detach()}

    return out, loss_func


def forward_backward(job, model, optimizer, iters):
    for m in model:
        m.zero_grad_buffer()
    optimizer.zero_grad()
    fb = get_forward_backward_func()
    fb(forward_step_func=forward_step, data_iterator=iters if len(model) > 1 else iters[0],
       model=model if len(model) > 1 else model[0], num_microbatches=job["num_microbatches"],
       seq_length=job["seq"], micro_batch_size=job["mbs"], decoder_seq_length=job["seq"],
       forward_only=False)


def train_step(job, config, model, optimizer, iters):
    forward_backward(job, model, optimizer, iters)
    optimizer.step()


def probe_memory(job, model, optimizer, iters, points, state):
    """One more step after the measured ones (which ran without it), its allocator peak counter
    reset before the forward-backward schedule and again before optimizer.step(): the peak of
    each phase (runners/mem_probe.py). Host-side counters, no snapshot, no extra sync inside."""
    points["step_start"] = mem_point(torch.cuda, device=True)
    torch.cuda.reset_peak_memory_stats()
    state["phase"] = "probe forward_backward"
    forward_backward(job, model, optimizer, iters)
    points["forward_backward"] = mem_point(torch.cuda)
    torch.cuda.reset_peak_memory_stats()
    state["phase"] = "probe optimizer"
    optimizer.step()
    torch.cuda.synchronize()
    points["optimizer"] = mem_point(torch.cuda, device=True)
    return summarize_memory(points)


def set_allocator(job):
    """Expandable segments on or off for this job (its "expandable_segments" key; absent: off),
    through torch's runtime allocator settings, after the previous job's memory was released
    (cleanup: empty_cache). Returns the setting for the record's env."""
    global EXPANDABLE
    want = bool(job.get("expandable_segments"))
    if want != EXPANDABLE:
        setting = getattr(torch._C, "_accelerator_setAllocatorSettings", None)  # torch >= 2.9
        (setting or torch.cuda.memory._set_allocator_settings)(f"expandable_segments:{want}")
        EXPANDABLE = want
    return f"expandable_segments:{EXPANDABLE}"


def apply_pressure(job, state):
    """After the warmup steps: a ballast tensor leaves the job its peak allocated so far plus
    pressure_headroom_gib (mem_probe.pressure_plan), so the measured steps show whether the memory the
    allocator cached beyond that was releasable (issue #27). A ballast the allocator cannot place is
    recorded (ballast_error) and the steps run without it. Peak counters restart after it."""
    plan = pressure_plan(torch.cuda, float(job["pressure_headroom_gib"]))
    n = int(plan["ballast_gib"] * GIB)  # whole 2 MiB pages (pressure_plan): exact in GiB
    try:
        if n > 0:
            state["ballast"] = torch.empty(n, dtype=torch.uint8, device="cuda")
    except torch.cuda.OutOfMemoryError as e:
        plan["ballast_error"] = str(e).splitlines()[0][:300]
    torch.cuda.synchronize()
    plan["reserved_with_ballast_gib"] = torch.cuda.memory_reserved() / GIB
    plan["retries_placing"] = torch.cuda.memory_stats().get("num_alloc_retries", 0) - plan["retries_before"]
    state["pressure"] = plan
    torch.cuda.reset_peak_memory_stats()


def run_job(job, ev, rank, state):
    i = job["index"]
    alloc_conf = set_allocator(job)
    torch.cuda.reset_peak_memory_stats()
    points = {"start": mem_point(torch.cuda, device=True)}
    ev("start", cfg=i, allocated_gib=torch.cuda.memory_allocated() / GIB, alloc_conf=alloc_conf)
    state["phase"] = "build"
    config, model, optimizer, n_params = build(job)
    points["built"] = mem_point(torch.cuda)
    state.update(model=model, optimizer=optimizer, config=config)
    ev("built", cfg=i, params=n_params,
       stage=parallel_state.get_pipeline_model_parallel_rank(),
       tp_rank=parallel_state.get_tensor_model_parallel_rank(),
       dp_rank=parallel_state.get_data_parallel_rank(),
       ep_rank=parallel_state.get_expert_model_parallel_rank(),
       mem_gib=torch.cuda.memory_allocated() / GIB)
    iters = [synthetic_batches(job) for _ in model]
    pre_hook = job["ddp"]["use_distributed_optimizer"] and job["ddp"]["overlap_param_gather"]
    if pre_hook:
        for m in model:
            m.disable_forward_pre_hook(param_sync=False)
    torch.cuda.synchronize()
    dist.barrier()
    bounds = [time.time()]
    if rank == 0:
        ev("step", cfg=i, k=0, tt=bounds[0])
    n_total = job["warmup"] + job["steps"]
    k = 0
    kernel_steps = job.get("kernel_profile_steps") or 0
    cpu = [thread_cpu_snapshot()] if kernel_steps and job["warmup"] == 0 else []  # OS CPU time per thread
    state["phase"] = "steps"
    while k < n_total:
        train_step(job, config, model, optimizer, iters)
        torch.cuda.synchronize()
        bounds.append(time.time())
        k += 1
        if rank == 0:
            ev("step", cfg=i, k=k, tt=bounds[-1])
        if k == 1 and pre_hook:
            for m in model:
                m.enable_forward_pre_hook()
        if k == job["warmup"] and job.get("min_seconds"):
            # Stretch the measured part to min_seconds (same count on every rank).
            last = bounds[-1] - bounds[-2]
            n = torch.tensor([max(job["steps"], math.ceil(job["min_seconds"] / max(last, 1e-3)))],
                             device="cuda", dtype=torch.int64)
            dist.broadcast(n, src=0)
            n_total = job["warmup"] + min(int(n.item()), job.get("max_steps") or 10 ** 6)
        if k == job["warmup"] and job.get("pressure_headroom_gib") is not None:
            apply_pressure(job, state)
        if k == job["warmup"] and kernel_steps:
            cpu.append(thread_cpu_snapshot())  # the measured steps begin
    if kernel_steps:
        cpu += [thread_cpu_snapshot(), n_total - job["warmup"]]
    peaks = {"peak_allocated_gib": torch.cuda.max_memory_allocated() / GIB,
             "peak_reserved_gib": torch.cuda.max_memory_reserved() / GIB}
    extra = {}
    if "pressure" in state:  # the steps' peaks without the ballast; then the ballast goes
        ballast = state.pop("ballast", None)
        extra["pressure"] = pressure_result(torch.cuda, state["pressure"],
                                            ballast.numel() if ballast is not None else 0)
        peaks = {"peak_allocated_gib": extra["pressure"]["steps_peak_allocated_gib"],
                 "peak_reserved_gib": extra["pressure"]["steps_peak_reserved_gib"]}
        del ballast
        torch.cuda.empty_cache()
    if MEMORY_PHASES:
        extra["memory_phases"] = probe_memory(job, model, optimizer, iters, points, state)
    state["phase"] = "after"
    if job.get("moe_profile_steps") and job["tc"].get("num_moe_experts"):
        try:
            extra["moe_probe"] = profile_moe(job, config, model, optimizer, iters)
        except torch.cuda.OutOfMemoryError:
            raise
        except Exception as e:  # the measured steps stand; the sub-step timing is extra
            extra["moe_probe"] = {"error": f"{type(e).__name__}: {e}"[:500]}
    if job.get("memory_snapshot_steps"):
        state["phase"] = "memory snapshot"
        try:
            extra["memory_snapshot"] = snapshot_memory(job, config, model, optimizer, iters)
        except torch.cuda.OutOfMemoryError:
            raise
        except Exception as e:  # the measured steps stand; the snapshot is extra
            extra["memory_snapshot"] = {"error": f"{type(e).__name__}: {e}"[:500]}
    if kernel_steps:
        state["phase"] = "kernel profile"
        try:
            extra["kernel_profile"] = profile_kernels(job, config, model, optimizer, iters, bounds, cpu)
        except torch.cuda.OutOfMemoryError:
            raise
        except Exception as e:  # the measured steps stand; the kernel profile is extra
            extra["kernel_profile"] = {"error": f"{type(e).__name__}: {e}"[:500]}
    ev("done", cfg=i, bounds=bounds, **peaks, **extra)


SNAPSHOT_ENTRIES = 2_000_000  # allocator events kept (a ring buffer: more would drop the step's first)


def snapshot_memory(job, config, model, optimizer, iters):
    """After the measured steps (which ran without it): memory_snapshot_steps more train steps
    with torch's allocator history on (python stacks), the last of them replayed block by block
    (runners/mem_snapshot.py): the allocator's state at the step's allocated and reserved peaks.
    Only the summary is kept; the history is turned off again."""
    rec = torch.cuda.memory._record_memory_history
    for _ in range(int(job["memory_snapshot_steps"]) - 1):
        train_step(job, config, model, optimizer, iters)
    torch.cuda.synchronize()
    rec(enabled="all", context="alloc", stacks="python", max_entries=SNAPSHOT_ENTRIES)
    try:
        before = torch.cuda.memory._snapshot()
        torch.cuda.reset_peak_memory_stats()
        train_step(job, config, model, optimizer, iters)
        torch.cuda.synchronize()
        after = torch.cuda.memory._snapshot()
    finally:
        rec(enabled=None)
    dev = torch.cuda.current_device()
    out = snapshot_summary(before, after, dev)
    out["truncated"] = len((after.get("device_traces") or [[]])[dev]) >= SNAPSHOT_ENTRIES
    out["counter_peak_allocated_gib"] = torch.cuda.max_memory_allocated() / GIB
    out["counter_peak_reserved_gib"] = torch.cuda.max_memory_reserved() / GIB
    return out


def profile_kernels(job, config, model, optimizer, iters, bounds, measured_cpu):
    """After the measured steps (which ran without it): kernel_profile_steps more train steps
    under torch.profiler, summarized (runners/kernel_probe.py; no trace file)."""
    measured = [b - a for a, b in zip(bounds, bounds[1:])][job["warmup"]:]
    return profile_summary(lambda: train_step(job, config, model, optimizer, iters),
                           job["kernel_profile_steps"], torch.cuda.synchronize,
                           sorted(measured)[len(measured) // 2] if measured else None,
                           threading.main_thread().native_id, measured_cpu=measured_cpu)


def profile_moe(job, config, model, optimizer, iters):
    """After the measured steps (which ran without it): time the MoE sub-steps for a few more."""
    timer = MoEPhaseTimer(model)
    steps, times = [], []
    for _ in range(job["moe_profile_steps"]):
        torch.cuda.synchronize()
        t = time.time()
        timer.start()
        train_step(job, config, model, optimizer, iters)
        steps.append(timer.stop())
        times.append(time.time() - t)
    out = summarize_moe(steps, times)
    out["moe_layers"] = len(timer.layers)
    out["experts_module"] = type(timer.layers[0].experts).__name__ if timer.layers else None
    return out


def destroy_groups():
    """Destroy megatron's process groups (NCCL communicators hold GPU memory), then its state."""
    seen = set()
    world = dist.group.WORLD
    for name, v in list(vars(parallel_state).items()):
        if not name.startswith("_") or "GROUP" not in name:
            continue
        for g in (v if isinstance(v, (list, tuple)) else [v]):
            if isinstance(g, dist.ProcessGroup) and g is not world and id(g) not in seen:
                seen.add(id(g))
                try:
                    dist.destroy_process_group(g)
                except Exception:
                    pass
    parallel_state.destroy_model_parallel()


def free_storage(t):
    if not isinstance(t, torch.Tensor):
        return
    # TE's quantized parameters (FP8 primary weights: Float8Tensor, MXFP8Tensor) are wrappers whose
    # bytes live in inner tensors
    inner = [x for x in (getattr(t, a, None) for a in ("_data", "_transpose", "_rowwise_data", "_columnwise_data",
                                                       "_scale_inv", "_rowwise_scale_inv", "_columnwise_scale_inv"))
             if isinstance(x, torch.Tensor) and x is not t]
    for x in inner:
        free_storage(x)
    if t.is_cuda:
        try:
            t.untyped_storage().resize_(0)
        except (RuntimeError, NotImplementedError, TypeError):
            if not inner:
                raise


def drop_cached_tensors(model):
    """Drop the activations modules keep between calls (MoE token dispatchers and routers cache
    probs, routing maps and permutation indices as plain attributes): after an OOM in the middle
    of a step they hold that step's autograd graph, and the next job ran out of memory on a GPU
    still ~69 GiB full (data/measurements/h100x1-moe.jsonl, jobs after h100x1-moe-a-02)."""
    for mod in model.modules():
        for owner in [mod] + [v for v in vars(mod).values()
                              if hasattr(v, "__dict__") and not isinstance(v, (torch.nn.Module, torch.Tensor, type))]:
            for k, v in list(vars(owner).items()):  # registered parameters / buffers are not in vars()
                if isinstance(v, torch.Tensor) and not isinstance(v, torch.nn.Parameter):
                    setattr(owner, k, None)


def release(state):
    """Free the GPU memory of a finished job even if something still references its objects
    (megatron-core 0.19.2 keeps earlier models alive, e.g. through the class-level lru_cache of
    RotaryEmbedding.forward and the hooks stored in the TransformerConfig): drop the hooks,
    clear the caches and shrink every parameter, gradient buffer and optimizer state to 0 bytes."""
    config = state.get("config")
    if config is not None:
        for k in ("no_sync_func", "grad_sync_func", "param_sync_func", "grad_scale_func",
                  "finalize_model_grads_func"):
            if hasattr(config, k):
                setattr(config, k, None)
    opt = state.get("optimizer")
    if opt is not None:
        for o in getattr(opt, "chained_optimizers", [opt]):
            inner = getattr(o, "optimizer", None)
            if inner is None:
                continue
            for st in inner.state.values():
                for v in st.values():
                    free_storage(v)
            for g in inner.param_groups:
                for p in g["params"]:
                    free_storage(p)
                    free_storage(p.grad)
    for m in state.get("model") or []:
        for buf in list(getattr(m, "buffers", [])) + list(getattr(m, "expert_parallel_buffers", [])):
            free_storage(getattr(buf, "param_data", None))
            free_storage(getattr(buf, "grad_data", None))
        for p in m.parameters():
            free_storage(p)
            free_storage(getattr(p, "main_grad", None))
        drop_cached_tensors(m)
    try:
        from megatron.core.models.common.embeddings.rotary_pos_embedding import RotaryEmbedding
        RotaryEmbedding.forward.cache_clear()
    except Exception:
        pass
    for mod in ("transformer_engine.pytorch.quantization", "transformer_engine.pytorch.fp8"):
        try:  # TE's global FP8 state (amax histories, scaling buffers of this job's layers)
            __import__(mod, fromlist=["FP8GlobalStateManager"]).FP8GlobalStateManager.reset()
            break
        except Exception:
            continue
    try:  # the MoE metrics tracker keeps per-layer tensors sized by this job's layer count
        from megatron.core.transformer.moe.moe_logging import MoEMetricsTracker, set_moe_metrics_tracker
        set_moe_metrics_tracker(MoEMetricsTracker())
    except Exception:
        pass


def cleanup(state):
    torch.cuda.synchronize()
    release(state)
    state.clear()
    gc.collect()
    torch.cuda.synchronize()
    if os.environ.get("ADVISOR_DESTROY_GROUPS", "1") == "1":
        destroy_groups()
    else:
        parallel_state.destroy_model_parallel()
    gc.collect()
    torch.cuda.empty_cache()
    torch.cuda.reset_peak_memory_stats()


def attention_impl(jobs):
    """The core attention of this batch's jobs, as recorded in env.attention."""
    kinds = {"te-fused" if j.get("stack") == "te" else f"sdpa-{GQA}-kv" for j in jobs}
    return "+".join(sorted(kinds)) if kinds else f"sdpa-{GQA}-kv"


def main(argv=None):
    ap = argparse.ArgumentParser()
    ap.add_argument("run_dir")
    ap.add_argument("start", type=int)
    a = ap.parse_args(argv)
    # SIGKILL when torchrun's agent dies, however it died: a worker left behind holds its GPU's
    # memory (seen: 60-90 GiB per GPU after a tune driver was killed) and the next job OOMs.
    die_with_parent()
    rank, local_rank = int(os.environ["RANK"]), int(os.environ["LOCAL_RANK"])
    world = int(os.environ["WORLD_SIZE"])
    torch.cuda.set_device(local_rank)
    ev = Events(os.path.join(a.run_dir, f"rank{rank}.jsonl"))
    # On SIGUSR1 (the launcher's watchdog, before it kills a hung job) write where every thread
    # is: the record then says which call the rank was stuck in.
    stacks = open(os.path.join(a.run_dir, f"rank{rank}.stacks"), "a", encoding="utf-8")
    faulthandler.register(signal.SIGUSR1, file=stacks, all_threads=True)
    with open(os.path.join(a.run_dir, "jobs.jsonl"), encoding="utf-8") as f:
        jobs = [json.loads(line) for line in f if line.strip()]
    global GROUPED_MM
    moe = {}
    if any(j.get("moe_experts") == "grouped" for j in jobs):
        GROUPED_MM = probe_grouped_mm()
        moe["grouped_mm"] = GROUPED_MM
    ev("hello", rank=rank, local_rank=local_rank, world=world, **device_identity(local_rank),
       **versions(), attention=attention_impl(jobs), interleaved_p2p=INTERLEAVED_P2P, **moe, **host_speed())
    dist.init_process_group("nccl", device_id=torch.device("cuda", local_rank))
    for job in jobs:
        if job["index"] < a.start:
            continue
        state = {}
        try:
            run_job(job, ev, rank, state)
        except torch.cuda.OutOfMemoryError as e:
            ev("oom", cfg=job["index"], error=str(e).splitlines()[0][:500],
               allocated_gib=torch.cuda.memory_allocated() / GIB,
               reserved_gib=torch.cuda.memory_reserved() / GIB,
               peak_allocated_gib=torch.cuda.max_memory_allocated() / GIB,
               peak_reserved_gib=torch.cuda.max_memory_reserved() / GIB, phase=state.get("phase"),
               num_alloc_retries=torch.cuda.memory_stats().get("num_alloc_retries"),
               **({"pressure": state["pressure"]} if "pressure" in state else {}))
            if world > 1:
                sys.stdout.flush()
                os._exit(EXIT_OOM)
        except Exception as e:
            tb = traceback.format_exc().strip().splitlines()
            ev("crash", cfg=job["index"], error=f"{type(e).__name__}: {e}"[:1000],
               traceback="\n".join(tb[-25:]))
            if world > 1:
                sys.stdout.flush()
                os._exit(EXIT_CRASH)
        cleanup(state)  # with one GPU also after a failure: free everything and go on
    ev("batch_done")
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
