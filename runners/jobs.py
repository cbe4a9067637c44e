"""What the megatron runner runs and what it writes: entries (a model, a layout, run parameters),
the workers' job descriptions, and the record (``advisor.measurement/1``) assembled from the
workers' events and the telemetry trace."""
from __future__ import annotations

import statistics
import time
import uuid as uuidlib
from dataclasses import dataclass, field
from typing import Any, Mapping

from advisor.catalog.specs import ModelSpec, SpecError, TrainConfig
from advisor.runners import megatron_args as MA
from advisor.runners.mem_probe import per_stage as memory_per_stage
from advisor.runners.records import SCHEMA, finite

# How the worker runs what megatron-core leaves open (records before these existed: K/V repeated
# for GQA, batched p2p for the interleaved schedule); see megatron_worker.py.
RUNNER_ENV = ("attention", "interleaved_p2p", "grouped_mm")
# ... and the host the workers ran on (kernel_probe.host_speed: its CPU model and its issue time
# per eager op, rank 0's): host-bound runs go at their host's pace, which differs between machines
HOST_ENV = ("cpu_model", "host_op_us")
# What the launcher keeps of the workers' hello events for the records' `env`.
HELLO_ENV = ("gpu_name", "cuda", "torch", "megatron_core", "transformer_engine", "python",
             "hostname") + RUNNER_ENV + HOST_ENV
RUN_KEYS = ("steps", "warmup", "min_seconds", "max_steps", "save_trace", "id", "tag", "stack", "fp8_recipe",
            "kernel_profile_steps", "pressure_headroom_gib", "memory_snapshot_steps")
GPU_PEAK_FALLBACK_TFLOPS = {"h100": 989.0, "h200": 989.0}  # only if the catalog lacks the GPU


# ------------------------------------------------------------------------------- entries, jobs
@dataclass
class Entry:
    """One trial to run: model (proxy) + layout + run parameters."""

    model_name: str
    model: ModelSpec
    layers: int | None
    config: TrainConfig
    steps: int = 10
    warmup: int = 3
    min_seconds: float = 0.0
    max_steps: int | None = None
    save_trace: bool = False
    id: str = field(default_factory=lambda: uuidlib.uuid4().hex[:12])
    refused: str | None = None
    # the runner's software stack: "local" (megatron-core's local layers) or "te" (Transformer
    # Engine layer spec), and the FP8 recipe of a te job in fp8 ("delayed" / "tensorwise")
    stack: str = "local"
    fp8_recipe: str = "delayed"
    # train steps run under torch.profiler after the measured ones, summarized in the record's
    # kernel_profile (runners/kernel_probe.py); 0: none
    kernel_profile_steps: int = 0
    # allocator pressure after the warmup steps: a ballast leaves the job its peak allocated so far
    # plus this many GiB (megatron_worker.apply_pressure, mem_probe.pressure_plan); None: none
    pressure_headroom_gib: float | None = None
    # train steps run after the measured ones with torch's allocator history on, the last one
    # replayed block by block at its peaks (megatron_worker.snapshot_memory, runners/mem_snapshot.py); 0: none
    memory_snapshot_steps: int = 0


def make_entry(model: str | ModelSpec, world_size: int | None, layers: int | None = None,
               steps: int = 10, warmup: int = 3, min_seconds: float = 0.0,
               max_steps: int | None = None, save_trace: bool = False, id: str | None = None,
               stack: str = "local", fp8_recipe: str = "delayed", kernel_profile_steps: int = 0,
               pressure_headroom_gib: float | None = None, memory_snapshot_steps: int = 0,
               **layout: Any) -> Entry:
    """Resolve a model name / config.json path / ModelSpec and layout keys into an Entry. dp
    defaults to world_size / (tp*pp*cp); gbs defaults to 8 microbatches. Illegal or unrunnable
    layouts come back with ``refused`` set (a one-line reason). Torch's allocator runs with
    expandable segments only where the layout keys say ``expandable_segments: true`` (the worker
    sets it per job), and the pipeline frees its sent outputs only where they say
    ``deallocate_pipeline_outputs: true``; a layout's own default is off for both (MA.runner_config)."""
    if isinstance(model, ModelSpec):
        spec, name = model, model.name
    else:
        from advisor.catalog import load_model
        spec, name = load_model(model), str(model)
    if layers:
        if layers < 1:
            raise SpecError(f"layers must be >= 1, got {layers}")
        if layers != spec.num_layers:
            spec = spec.with_layers(layers)
    if stack not in MA.RUNNER_STACKS:
        raise SpecError(f"stack must be one of {', '.join(MA.RUNNER_STACKS)}, got {stack!r}")
    if fp8_recipe not in MA.FP8_RECIPES:
        raise SpecError(f"fp8_recipe must be one of {', '.join(MA.FP8_RECIPES)}, got {fp8_recipe!r}")
    for k, v in (("steps", steps), ("warmup", warmup), ("kernel_profile_steps", kernel_profile_steps),
                 ("memory_snapshot_steps", memory_snapshot_steps)):
        if isinstance(v, bool) or not isinstance(v, int) or v < (1 if k == "steps" else 0):
            raise SpecError(f"{k} must be an integer >= {1 if k == 'steps' else 0}, got {v!r}")
    if pressure_headroom_gib is not None:
        if isinstance(pressure_headroom_gib, bool) or not isinstance(pressure_headroom_gib, (int, float)) \
                or not 0 <= pressure_headroom_gib <= 1024:
            raise SpecError(f"pressure_headroom_gib must be a number of GiB in [0, 1024], got {pressure_headroom_gib!r}")
        if warmup < 1:
            raise SpecError("pressure_headroom_gib needs warmup >= 1 (the ballast is sized on the warmup's peak)")
    lay = dict(layout)
    run = dict(stack=stack, fp8_recipe=fp8_recipe, kernel_profile_steps=kernel_profile_steps,
               pressure_headroom_gib=pressure_headroom_gib, memory_snapshot_steps=memory_snapshot_steps)
    mp = lay.get("tp", 1) * lay.get("pp", 1) * lay.get("cp", 1)
    if "dp" not in lay or lay["dp"] is None:
        if world_size is None:
            raise SpecError("dp is not given and the world size is unknown")
        if world_size % mp:
            lay["dp"] = 1
            cfg = TrainConfig.from_dict(_with_gbs(lay))
            return Entry(name, spec, layers, MA.runner_config(cfg, keep_requested=True), steps, warmup, min_seconds,
                         max_steps, save_trace, id or uuidlib.uuid4().hex[:12],
                         refused=f"world size {world_size} is not divisible by tp*pp*cp = {mp}", **run)
        lay["dp"] = world_size // mp
    cfg = MA.runner_config(TrainConfig.from_dict(_with_gbs(lay)), keep_requested=True)
    return Entry(name, spec, layers, cfg, steps, warmup, min_seconds, max_steps, save_trace,
                 id or uuidlib.uuid4().hex[:12], refused=MA.refusal_reason(spec, cfg, world_size, stack), **run)


def _with_gbs(lay: dict[str, Any]) -> dict[str, Any]:
    lay = {k: v for k, v in lay.items() if v is not None}
    if "gbs" not in lay:
        lay["gbs"] = lay.get("mbs", 1) * lay.get("dp", 1) * 8
    return lay


def entry_from_line(line: Mapping[str, Any], world_size: int | None) -> Entry:
    """A batch line: {"model": name|path, "layers": n, <TrainConfig keys>, <RUN_KEYS>}."""
    d = dict(line)
    if "model" not in d:
        raise SpecError("batch line has no 'model'")
    model = d.pop("model")
    if isinstance(model, dict):
        model = ModelSpec.from_dict(model)
    d.pop("tag", None)
    return make_entry(model, world_size, **d)


def job_for(entry: Entry, index: int) -> dict[str, Any]:
    """What the worker needs, fully resolved (the worker does not import advisor)."""
    m, c = entry.model, entry.config
    return {
        "index": index, "id": entry.id, "key": c.key(),
        "tp": c.tp, "pp": c.pp, "vp": c.vp, "cp": c.cp, "ep": c.ep, "etp": c.etp, "dp": c.dp,
        "mbs": c.mbs, "gbs": c.gbs, "seq": c.seq, "num_microbatches": c.num_microbatches,
        "warmup": entry.warmup, "steps": entry.steps, "min_seconds": entry.min_seconds,
        "max_steps": entry.max_steps,
        "stack": entry.stack,
        "tc": MA.transformer_config_kwargs(m, c, entry.stack, entry.fp8_recipe),
        "model_kw": MA.model_kwargs(m, c),
        "ddp": MA.ddp_kwargs(c, entry.stack), "opt": MA.optimizer_kwargs(c),
        **MA.moe_job_keys(m, c, entry.stack),
        # only where asked: the worker's job dicts stay as they were otherwise
        **({"kernel_profile_steps": entry.kernel_profile_steps} if entry.kernel_profile_steps else {}),
        **({"expandable_segments": True} if c.expandable_segments else {}),
        **({"pressure_headroom_gib": float(entry.pressure_headroom_gib)}
           if entry.pressure_headroom_gib is not None else {}),
        **({"memory_snapshot_steps": entry.memory_snapshot_steps} if entry.memory_snapshot_steps else {}),
    }


# ----------------------------------------------------------------------------- record assembly
def _pct(xs: list[float], q: float) -> float:
    s = sorted(xs)
    if len(s) == 1:
        return s[0]
    pos = (len(s) - 1) * q
    lo = int(pos)
    hi = min(lo + 1, len(s) - 1)
    return s[lo] + (s[hi] - s[lo]) * (pos - lo)


def gpu_catalog_name(gpu_name: str | None) -> tuple[str | None, float | None]:
    """(catalog GPU name, bf16 dense peak TFLOP/s) for a torch / NVML device name."""
    if not gpu_name:
        return None, None
    try:
        from advisor.catalog import load_gpu
        g = load_gpu(gpu_name)
        return g.name, g.bf16_tflops
    except Exception:
        pass
    low = gpu_name.lower()
    for key, peak in GPU_PEAK_FALLBACK_TFLOPS.items():
        if key in low:
            try:
                from advisor.catalog import load_gpu
                g = load_gpu(key)
                return g.name, g.bf16_tflops
            except Exception:
                return key, peak
    return low.replace("nvidia ", "").replace(" ", "-"), None


def _flops_per_token(model: ModelSpec, seq: int) -> float | None:
    try:
        from advisor.models.flops import training_flops_per_token
    except ImportError:
        return None
    return training_flops_per_token(model, seq)


def step_windows(bounds: list[float], warmup: int) -> list[tuple[str, float, float]]:
    """Telemetry windows of a job's steps from rank 0's boundaries: ("warmup 1", t0, t1), ...,
    ("step 1", ...), so a saved trace lines up with its record's steps."""
    return [(f"warmup {k + 1}" if k < warmup else f"step {k - warmup + 1}", a, b)
            for k, (a, b) in enumerate(zip(bounds, bounds[1:]))]


def assemble_record(entry: Entry, status: str, error: str | None, ranks: Mapping[int, Mapping[str, Any]],
                    bounds: list[float] | None, trace: Any = None, env: Mapping[str, Any] | None = None,
                    gpus_per_node: int | None = None, trace_path: str | None = None,
                    timestamp: float | None = None) -> dict[str, Any]:
    """One ``advisor.measurement/1`` record.

    ``ranks``: per global rank the worker's events for this job: ``hello`` (identity),
    ``built`` (stage, tp_rank, dp_rank), ``done`` (peaks) or ``oom`` (memory at failure).
    ``bounds``: rank 0's step boundaries (time.time() after cuda synchronize), warmup included.
    ``trace``: a telemetry Trace covering the measured steps, or None."""
    cfg, model = entry.config, entry.model
    world = cfg.world_size
    env = dict(env or {})
    hello0 = (ranks.get(0) or {}).get("hello") or {}
    gpu_name = env.get("gpu_name") or hello0.get("gpu_name")
    gpu, peak_tflops = gpu_catalog_name(gpu_name)
    rec: dict[str, Any] = {
        "schema": SCHEMA, "id": entry.id, "timestamp": timestamp or time.time(),
        "status": status, "error": error or None, "model_name": entry.model_name,
        "stack": entry.stack,
        **({"fp8_recipe": entry.fp8_recipe} if entry.stack == "te" and cfg.precision == "fp8" else {}),
        "model": model.to_dict(), "layers": model.num_layers,
        "config": (cfg.replace(fp8_recipe=entry.fp8_recipe) if cfg.precision == "fp8" else cfg).to_dict(),
        "cluster": {"gpu": gpu, "num_nodes": 1, "gpus_per_node": gpus_per_node or world},
        "env": {"gpu_name": gpu_name, "driver": env.get("driver"),
                **{k: env.get(k, hello0.get(k)) for k in ("cuda", "torch", "megatron_core", "python", "hostname")},
                **({"transformer_engine": env.get("transformer_engine", hello0.get("transformer_engine"))}
                   if entry.stack == "te" else {}),
                **{k: env.get(k, hello0.get(k)) for k in RUNNER_ENV + HOST_ENV if env.get(k, hello0.get(k))}},
        "steps": None, "throughput": None, "memory": None, "telemetry": None, "rank_map": [],
        "runner": "megatron", "simulated": False,  # the command runner's finish_record says "command"
    }
    # rank map
    for r in sorted(ranks):
        h, b = ranks[r].get("hello") or {}, ranks[r].get("built") or {}
        rec["rank_map"].append({"rank": r, "stage": b.get("stage"), "tp_rank": b.get("tp_rank"),
                                "dp_rank": b.get("dp_rank"), "uuid": h.get("uuid"),
                                "pci_bus_id": _norm_pci(h.get("pci_bus_id"))})
    # memory
    alloc = [(ranks.get(r) or {}).get("done", (ranks.get(r) or {}).get("oom") or {}).get("peak_allocated_gib")
             for r in range(world)]
    resv = [(ranks.get(r) or {}).get("done", (ranks.get(r) or {}).get("oom") or {}).get("peak_reserved_gib")
            for r in range(world)]
    if any(a is not None for a in alloc):
        stages: dict[int, float] = {}
        for rm in rec["rank_map"]:
            a = alloc[rm["rank"]] if rm["rank"] < world else None
            if rm["stage"] is not None and a is not None:
                stages[rm["stage"]] = max(stages.get(rm["stage"], 0.0), a)
        start = [((ranks.get(r) or {}).get("start") or {}).get("allocated_gib") for r in range(world)]
        rec["memory"] = {"peak_allocated_gib_per_rank": alloc, "peak_reserved_gib_per_rank": resv,
                         "start_allocated_gib_per_rank": start,
                         "peak_gib_per_stage": [stages[s] for s in sorted(stages)],
                         "max_gib": max(a for a in alloc if a is not None),
                         "max_reserved_gib": max((a for a in resv if a is not None), default=None)}
        oom = {r: ranks[r]["oom"] for r in ranks if ranks[r].get("oom")}
        if oom:
            rec["memory"]["at_failure"] = {str(r): {k: v for k, v in o.items()
                                                    if k.endswith("_gib") or k in ("phase", "num_alloc_retries")}
                                          for r, o in oom.items()}
    phases = memory_per_stage({r: {"stage": ((ranks.get(r) or {}).get("built") or {}).get("stage"),
                                   "memory_phases": ((ranks.get(r) or {}).get("done") or {}).get("memory_phases")}
                               for r in range(world)})
    if phases:  # per pipeline stage, its rank with the largest step peak (runners/mem_probe.py)
        rec["memory_phases"] = phases
    probe = ((ranks.get(0) or {}).get("done") or {}).get("moe_probe")
    if probe:  # MoE sub-step times of rank 0 (runners/moe_probe.py), from steps after the measured ones
        rec["moe_probe"] = probe
    pressure = _per_rank(ranks, "pressure", ("done", "oom"))
    if pressure:  # per rank: the ballast of the allocator-pressure run and what the steps did beside it
        rec["pressure"] = pressure
    kprof = ((ranks.get(0) or {}).get("done") or {}).get("kernel_profile")
    snaps = _per_rank(ranks, "memory_snapshot")
    if snaps:  # per rank: the allocator's state at the snapshot step's peaks (runners/mem_snapshot.py)
        rec["memory_snapshot"] = snaps
    if kprof:  # rank 0's kernel profile (runners/kernel_probe.py), from steps after the measured ones
        rec["kernel_profile"] = kprof
    alloc = ((ranks.get(0) or {}).get("start") or {}).get("alloc_conf")
    if alloc:  # torch's allocator setting the worker ran this job with (megatron_worker.set_allocator)
        rec["env"]["alloc_conf"] = alloc
    # steps, throughput
    if bounds and len(bounds) >= 2:
        times = [b - a for a, b in zip(bounds, bounds[1:])]
        measured = times[entry.warmup:]
        rec["steps"] = {"warmup": min(entry.warmup, len(times)), "measured": len(measured),
                        "step_times_s": times, "median_s": None, "p10_s": None, "p90_s": None,
                        "bounds_unix": list(bounds)}  # rank 0's step boundaries: align traces with steps
        if measured:
            med = statistics.median(measured)
            rec["steps"].update(median_s=med, p10_s=_pct(measured, 0.1), p90_s=_pct(measured, 0.9))
            tps = cfg.tokens_per_step / med
            fpt = _flops_per_token(model, cfg.seq)
            tflops = tps / world * fpt / 1e12 if fpt else None
            rec["throughput"] = {
                "tokens_per_s": tps, "tokens_per_s_per_gpu": tps / world,
                "tflops_per_gpu": tflops, "flops_per_token": fpt, "peak_tflops": peak_tflops,
                "mfu": tflops / peak_tflops if tflops and peak_tflops else None}
            if trace is not None:
                t0, t1 = bounds[entry.warmup], bounds[-1]
                rec["telemetry"] = telemetry_block(trace, t0, t1, cfg.tokens_per_step * len(measured),
                                                   rec["rank_map"], trace_path)
    return finite(rec)


def _norm_pci(p: str | None) -> str | None:
    if not p:
        return p
    try:
        from advisor.runners.telemetry import normalize_pci_bus_id
        return normalize_pci_bus_id(p)
    except Exception:
        return p


def telemetry_block(trace: Any, t0: float, t1: float, tokens: int, rank_map: list[dict[str, Any]],
                    trace_path: str | None = None) -> dict[str, Any]:
    """Telemetry of the measured interval [t0, t1], over the GPUs the job ran on."""
    from advisor.runners.telemetry import summarize

    s = summarize(trace, t0, t1, tokens=tokens)
    devs = s["devices"]
    used = [rm["uuid"] for rm in rank_map if rm.get("uuid") in devs] or list(devs)
    per_gpu = {u: devs[u] for u in used}

    def vals(key, ds=None):
        return [d[key] for d in (ds if ds is not None else per_gpu.values()) if d.get(key) is not None]

    per_stage = []
    stages = sorted({rm["stage"] for rm in rank_map if rm.get("stage") is not None})
    for st in stages:
        uu = [rm["uuid"] for rm in rank_map if rm.get("stage") == st and rm.get("uuid") in devs]
        ds = [devs[u] for u in uu]
        mp, pk, tc = vals("mean_power_w", ds), vals("peak_power_w", ds), vals("max_gpu_temp_c", ds)
        per_stage.append({"stage": st, "gpus": uu, "mean_power_w": sum(mp) / len(mp) if mp else None,
                          "peak_power_w": max(pk) if pk else None, "max_temp_c": max(tc) if tc else None})
    energies = vals("energy_j")
    energy = sum(energies) if len(energies) == len(per_gpu) and energies else None
    thr: dict[str, float] = {}
    frs = [d["throttle_fractions"] for d in per_gpu.values() if d.get("throttle_fractions")]
    for fr in frs:
        for k, v in fr.items():
            thr[k] = thr.get(k, 0.0) + v / len(frs)
    mp, pk, clk = vals("mean_power_w"), vals("peak_power_w"), vals("min_sm_clock_mhz")
    of = (getattr(trace, "meta", {}) or {}).get("overhead_fraction")
    return {"per_gpu": per_gpu, "per_stage": per_stage,
            "mean_power_w": sum(mp) / len(mp) if mp else None,
            "total_mean_power_w": sum(mp) if mp else None,
            "peak_power_w": max(pk) if pk else None,
            "energy_j": energy, "energy_per_token_j": energy / tokens if energy is not None and tokens else None,
            "throttle_fraction": thr or None, "min_sm_clock_mhz": min(clk) if clk else None,
            "median_sm_clock_mhz": statistics.median(vals("median_sm_clock_mhz")) if vals("median_sm_clock_mhz") else None,
            "max_temp_c": max(vals("max_gpu_temp_c")) if vals("max_gpu_temp_c") else None,
            "sampler_overhead_pct": 100.0 * of if of is not None else None,
            "rate_hz": (getattr(trace, "meta", {}) or {}).get("rate_hz"),
            "interval_s": t1 - t0, "trace_path": trace_path}


def _per_rank(ranks: Mapping, key: str, events: tuple[str, ...] = ("done",)) -> dict[str, Any]:
    """{rank: its last event's `key`} over the ranks whose first present event of `events` has it."""
    out = {}
    for r in sorted(ranks):
        d = ranks[r] or {}
        last = next((d[e] for e in events if d.get(e)), {})
        if last.get(key):
            out[str(r)] = last[key]
    return out


def entry_to_dict(e: Entry) -> dict[str, Any]:
    return {"model_name": e.model_name, "model": e.model.to_dict(), "layers": e.layers,
            "config": e.config.to_dict(), "steps": e.steps, "warmup": e.warmup,
            "min_seconds": e.min_seconds, "max_steps": e.max_steps, "save_trace": e.save_trace,
            "id": e.id, "stack": e.stack, "fp8_recipe": e.fp8_recipe, "kernel_profile_steps": e.kernel_profile_steps,
            "pressure_headroom_gib": e.pressure_headroom_gib, "memory_snapshot_steps": e.memory_snapshot_steps}


def entry_from_dict(d: Mapping[str, Any]) -> Entry:
    return Entry(d["model_name"], ModelSpec.from_dict(d["model"]), d.get("layers"),
                 TrainConfig.from_dict(d["config"]), d["steps"], d["warmup"], d.get("min_seconds", 0.0),
                 d.get("max_steps"), d.get("save_trace", False), d["id"],
                 stack=d.get("stack", "local"), fp8_recipe=d.get("fp8_recipe", "delayed"),
                 kernel_profile_steps=d.get("kernel_profile_steps", 0),
                 pressure_headroom_gib=d.get("pressure_headroom_gib"),
                 memory_snapshot_steps=d.get("memory_snapshot_steps", 0))
