"""Rehearse a MoE campaign batch on CPU before it costs GPU time: every job of the batch is resolved
as the launcher resolves it (runners.measure.job_for), shrunk (hidden / 16, experts' FFN / 16,
sequence 128, vocabulary 512, at most 2 microbatches) and run through the GPU worker's own
run_job (runners/megatron_worker.py) on CPU with gloo: model build (local spec, MLA, grouped
experts), the measured steps, and the MoE sub-step timing (runners/moe_probe.py) with wall-clock
stand-ins for CUDA events. Needs torch + megatron-core (Python 3.12).

    python bench/moe_cpu_rehearsal.py bench/campaign_configs/h100x1-moe-a.jsonl [...]

Two steps: `jobs` (Python with advisor: write the shrunk jobs as JSONL) and `run` (Python with
torch and megatron-core: run them); with no subcommand both, the second with $REHEARSAL_PYTHON.
"""
from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent
RUNNERS = HERE.parent / "runners"


def shrink_model(d: dict) -> dict:
    d = json.loads(json.dumps(d))
    heads = max(2, d["num_attention_heads"] // 8)
    groups = d.get("num_query_groups")
    d.update(hidden_size=max(64, d["hidden_size"] // 16), num_attention_heads=heads,
             ffn_hidden_size=max(64, d["ffn_hidden_size"] // 16), vocab_size=512)
    if groups:
        d["num_query_groups"] = max(1, min(groups, heads // 2))
    if d.get("kv_channels"):
        d["kv_channels"] = 32
    if d.get("moe"):
        m = d["moe"]
        m["ffn_hidden_size"] = max(32, m["ffn_hidden_size"] // 16)
        if m.get("shared_ffn_hidden_size"):
            m["shared_ffn_hidden_size"] = max(32, m["shared_ffn_hidden_size"] // 16)
        if m.get("dense_ffn_hidden_size"):
            m["dense_ffn_hidden_size"] = d["ffn_hidden_size"]
    if d.get("mla"):
        d["mla"].update(kv_lora_rank=32, qk_nope_head_dim=16, qk_rope_head_dim=16, v_head_dim=16)
        d["kv_channels"] = 16
    return d


def write_jobs(batches: list[Path], out: Path) -> int:
    from advisor.catalog.specs import ModelSpec
    from advisor.runners import measure as M

    n = 0
    with open(out, "w") as f:
        for b in batches:
            for line in M.read_jsonl(b):
                line = dict(line)
                model = line["model"]
                if isinstance(model, str):
                    from advisor.catalog import load_model
                    model = load_model(model).to_dict()
                line["model"] = ModelSpec.from_dict(shrink_model(model))
                line["seq"] = 128
                line["mbs"] = min(line.get("mbs", 1), 2)
                line["gbs"] = line["mbs"] * 2 * line.get("dp", 1)
                world = line.get("dp", 1) * line.get("tp", 1) * line.get("pp", 1)
                e = M.entry_from_line(line, world)
                if e.refused:
                    print(f"{e.id}: refused: {e.refused}")
                    continue
                job = M.job_for(e, n)
                job["warmup"], job["steps"] = 1, 1
                job["tc"]["use_cpu_initialization"] = True  # no CUDA RNG tracker on CPU
                f.write(json.dumps({"batch": b.name, "world": world, **job}) + "\n")
                n += 1
    return n


def _cpu_shims():
    """Make the CUDA-only calls of the worker run on CPU."""
    import contextlib

    import torch

    class Event:
        def __init__(self, enable_timing=True):
            self.t = None

        def record(self, *a):
            self.t = time.perf_counter()

        def elapsed_time(self, other):
            return (other.t - self.t) * 1e3

    torch.nn.Module.cuda = lambda self, *a, **k: self
    torch.cuda.current_device = lambda: "cpu"
    torch.cuda.is_available = lambda: False
    torch.cuda.synchronize = lambda *a, **k: None
    torch.cuda.reset_peak_memory_stats = lambda *a, **k: None
    for name in ("memory_allocated", "max_memory_allocated", "max_memory_reserved", "memory_reserved"):
        setattr(torch.cuda, name, lambda *a, **k: 0)
    torch.cuda.Event = Event
    Event.synchronize = lambda self: None

    class Stream:  # the alltoall dispatcher copies token counts to the host on a side stream
        def __init__(self, *a, **k):
            pass

        def wait_stream(self, other):
            pass

        def wait_event(self, ev):
            pass

        def record_event(self, ev=None):
            e = ev or Event()
            e.record()
            return e

    main_stream = Stream()
    torch.cuda.Stream = Stream
    torch.cuda.current_stream = lambda *a, **k: main_stream
    torch.cuda.stream = lambda s: contextlib.nullcontext()
    torch.Tensor.record_stream = lambda self, s: None
    torch.Tensor.cuda = lambda self, *a, **k: self

    from torch.overrides import TorchFunctionMode

    def cpu(d):
        return "cpu" if (isinstance(d, str) and d.startswith("cuda")) or (
            isinstance(d, torch.device) and d.type == "cuda") or isinstance(d, int) and not isinstance(d, bool) else d

    class CudaToCPU(TorchFunctionMode):  # device="cuda" written into megatron's code
        def __torch_function__(self, func, types, args=(), kwargs=None):
            kwargs = dict(kwargs or {})
            if "device" in kwargs:
                kwargs["device"] = cpu(kwargs["device"])
            if func in (torch.Tensor.to,) and len(args) > 1:
                args = (args[0], cpu(args[1]), *args[2:])
            return func(*args, **kwargs)
    CudaToCPU().__enter__()
    torch.cuda.empty_cache = lambda: None
    from megatron.core import tensor_parallel
    tensor_parallel.model_parallel_cuda_manual_seed = lambda *a, **k: None
    tracker = tensor_parallel.get_cuda_rng_tracker()
    tracker.fork = lambda *a, **k: contextlib.nullcontext()


def run_jobs(path: Path) -> int:
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=os.environ.get("MASTER_PORT", "29561"),
                      RANK="0", WORLD_SIZE="1", LOCAL_RANK="0")
    sys.path.insert(0, str(RUNNERS))
    _cpu_shims()
    import torch
    import torch.distributed as dist

    dist.init_process_group("gloo")
    import megatron_worker as W

    real_generator = torch.Generator

    class CPUGenerator(real_generator):
        def __new__(cls, device=None):
            return real_generator()
    W.torch.Generator = CPUGenerator  # synthetic_batches asks for a CUDA generator

    class CPUOptimizer:  # megatron's mixed-precision optimizers need CUDA; SGD on the fp32 main grads
        def __init__(self, config, model, **kw):
            self.params = [p for m in model for p in m.parameters()]
            self.chained_optimizers = []

        def scale_loss(self, loss):
            return loss

        def zero_grad(self, set_to_none=True):
            pass

        def step(self):
            with torch.no_grad():
                for p in self.params:
                    g = getattr(p, "main_grad", None)
                    if g is not None:
                        p.add_(g.to(p.dtype), alpha=-1e-4)
            return True, 0.0, 0
    W.get_megatron_optimizer = CPUOptimizer
    W.GROUPED_MM = W.probe_grouped_mm(torch.bfloat16)
    print("grouped_mm:", W.GROUPED_MM)
    failures = 0
    for line in open(path):
        job = json.loads(line)
        if job["world"] != 1:
            continue
        events = []
        ev = lambda name, **kw: events.append((name, kw))  # noqa: E731
        state: dict = {}
        t = time.time()
        try:
            W.run_job(job, ev, 0, state)
            done = dict(events[-1][1])
            probe = done.get("moe_probe") or {}
            terms = {k: round(v * 1e3, 1) for k, v in (probe.get("terms") or {}).items()}
            print(f"ok   {job['id']} {job['key']} {time.time() - t:.1f}s ms={terms} load={probe.get('load')}")
            assert probe.get("terms", {}).get("expert_s", 0) > 0, "no expert time recorded"
            want = "TorchGroupedMLP" if job.get("moe_experts") == "grouped" else "SequentialMLP"
            assert probe.get("experts_module") == want, f"experts ran as {probe.get('experts_module')}, not {want}"
        except Exception as e:  # noqa: BLE001
            import traceback
            failures += 1
            print(f"FAIL {job['id']} {job['key']}: {type(e).__name__}: {e}")
            traceback.print_exc(limit=-8)
        finally:
            W.release(state)  # as the worker cleanup does (incl. the MoE metrics tracker)
            W.parallel_state.destroy_model_parallel()
    return failures


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("cmd", nargs="?", choices=("jobs", "run"))
    ap.add_argument("batches", nargs="*", type=Path)
    ap.add_argument("--jobs-file", type=Path, default=Path("/tmp/moe-rehearsal-jobs.jsonl"))
    a = ap.parse_args(argv)
    if a.cmd == "jobs":
        print(f"{write_jobs(a.batches, a.jobs_file)} jobs -> {a.jobs_file}")
        return 0
    if a.cmd == "run":
        bad = run_jobs(a.jobs_file)
        print(f"{bad} failure(s)")
        return 1 if bad else 0
    write_jobs(a.batches, a.jobs_file)
    py = os.environ.get("REHEARSAL_PYTHON", sys.executable)
    return subprocess.call([py, __file__, "run", "--jobs-file", str(a.jobs_file)])


if __name__ == "__main__":
    sys.exit(main())
