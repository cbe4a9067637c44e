"""Measure layouts for real: the launcher side of the megatron-core trial runner (no torch here).

``run_batch(entries, ...)`` resolves each entry (model, layers, TrainConfig keys), refuses what
megatron-core without Transformer Engine cannot run, writes the runnable jobs to a run directory
and starts ONE ``torchrun`` whose workers (``megatron_worker.py``) loop over them. The launcher
samples telemetry over all local GPUs for the whole batch, follows the workers' event files,
and as soon as a job is complete assembles its record (``advisor.measurement/1``) and appends it
to the dataset (append + flush + fsync). A watchdog kills the torchrun process group when no
event arrives for ``timeout`` seconds (NCCL hang): the job is recorded as ``timeout`` and the
batch restarts at the next job; so do OOMs and crashes that take a multi-GPU worker down (a
one-GPU worker survives them in-process and goes on). The time budget (``max_seconds``) is
watched all along, not only between torchruns: no job starts once it is spent. Every job the
workers started gets exactly one record; what a worker reported (``oom`` / ``crash``) decides
the status even if torchrun is killed afterwards, and the launcher's own kills (interrupt,
budget) give ``killed`` with the steps done, never a ``crash`` classified from the log.
torchrun runs in a session of its own with ``PR_SET_PDEATHSIG`` (Linux): it ends with the
launcher even when the launcher is SIGKILLed, and each worker arms ``PR_SET_PDEATHSIG`` (SIGKILL)
itself: no worker outlives its torchrun, whatever killed it (``runners/parent_watch.py``).
"""
from __future__ import annotations

import json
import logging
import math
import os
import re
import shutil
import signal
import socket
import statistics
import subprocess
import sys
import tempfile
import time
import uuid as uuidlib
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable, Mapping

import psutil

from advisor.catalog.specs import ModelSpec, SpecError, TrainConfig
from advisor.runners import megatron_args as MA
from advisor.runners.parent_watch import preexec_die_with_parent

log = logging.getLogger(__name__)

SCHEMA = "advisor.measurement/1"
STATUSES = ("ok", "oom", "timeout", "crash", "refused", "killed", "skipped")  # skipped: never ran
WORKER = Path(__file__).with_name("megatron_worker.py")
# How the worker runs what megatron-core leaves open (records before these existed: K/V repeated
# for GQA, batched p2p for the interleaved schedule); see megatron_worker.py.
RUNNER_ENV = ("attention", "interleaved_p2p", "grouped_mm")
# What the launcher keeps of the workers' hello events for the records' `env`.
HELLO_ENV = ("gpu_name", "cuda", "torch", "megatron_core", "transformer_engine", "python",
             "hostname") + RUNNER_ENV
# Kept set in the workers too (KINDS.md: NVLink multicast off on shared hosts).
CHILD_ENV = {"NCCL_NVLS_ENABLE": "0", "TORCH_SYMM_MEM_DISABLE_MULTICAST": "1",
             "NVSHMEM_DISABLE_NVLS": "1", "CUDA_DEVICE_ORDER": "PCI_BUS_ID",
             "PYTHONUNBUFFERED": "1", "OMP_NUM_THREADS": "4"}
RUN_KEYS = ("steps", "warmup", "min_seconds", "max_steps", "save_trace", "id", "tag", "stack", "fp8_recipe")
# Set for a batch with a Transformer Engine job: one CUDA work queue, so TP / SP communication is
# issued in program order (Megatron-LM asserts it for sequence parallelism; NVIDIA's recipes set it).
TE_CHILD_ENV = {"CUDA_DEVICE_MAX_CONNECTIONS": "1"}
TE_MISSING = ("Transformer Engine is not installed here, so the te stack cannot run: "
              "pip install 'advisor[gpu,te]' (or see docs/measurement.md for bringing TE to a "
              "machine without a package index)")
GPU_PEAK_FALLBACK_TFLOPS = {"h100": 989.0, "h200": 989.0}  # only if the catalog lacks the GPU


# ------------------------------------------------------------------------------------- JSONL
def append_jsonl(path: str | Path, record: Mapping[str, Any]) -> None:
    """Append one JSON line durably. If an earlier write was cut off (no trailing newline), start
    on a fresh line so the new record stays readable."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    line = json.dumps(record, separators=(",", ":"), allow_nan=False, default=_jsonable) + "\n"
    with open(path, "a+b") as f:
        f.seek(0, os.SEEK_END)
        if f.tell() > 0:
            f.seek(-1, os.SEEK_END)
            if f.read(1) != b"\n":
                line = "\n" + line
        f.write(line.encode("utf-8"))
        f.flush()
        os.fsync(f.fileno())


def read_jsonl(path: str | Path) -> list[dict[str, Any]]:
    """All complete JSON objects of a JSONL file; cut-off or garbled lines are skipped."""
    out = []
    with open(path, encoding="utf-8", errors="replace") as f:
        for line in f:
            line = line.strip()
            if not line:
                continue
            try:
                obj = json.loads(line)
            except json.JSONDecodeError:
                continue
            if isinstance(obj, dict):
                out.append(obj)
    return out


def _jsonable(v: Any) -> Any:
    if hasattr(v, "item"):  # numpy scalars
        return v.item()
    if hasattr(v, "tolist"):
        return v.tolist()
    raise TypeError(f"not JSON serializable: {type(v).__name__}")


def _finite(x: Any) -> Any:
    """NaN / inf -> None, recursively (records are strict JSON)."""
    if isinstance(x, float):
        return x if math.isfinite(x) else None
    if isinstance(x, dict):
        return {k: _finite(v) for k, v in x.items()}
    if isinstance(x, (list, tuple)):
        return [_finite(v) for v in x]
    return x


# ------------------------------------------------------------------------- failure classification
_PATTERNS: list[tuple[str, str, re.Pattern]] = [
    ("oom", "CUDA out of memory", re.compile(
        r"(torch\.(cuda\.)?OutOfMemoryError|CUDA out of memory|CUDA error: out of memory|"
        r"CUBLAS_STATUS_ALLOC_FAILED|cudaErrorMemoryAllocation|Failed to CUDA calloc|"
        r"NCCL.*(Cuda failure|cuda failure).*out of memory)", re.I)),
    ("timeout", "NCCL collective timed out (watchdog)", re.compile(
        r"(Watchdog caught collective operation timeout|collective operation timeout|"
        r"ProcessGroupNCCL.*(timeout|timed out)|NCCL.*(Timeout|timed out)|"
        r"Timed out waiting|DistStoreError.*[Tt]imeout|heartbeat monitor.*(timeout|timed out))", re.I)),
    ("crash", "segmentation fault", re.compile(
        r"(Segmentation fault|SIGSEGV|Signal 11 |signal 11\b|core dumped)", re.I)),
    ("crash", "CUDA illegal memory access", re.compile(
        r"(illegal memory access|cudaErrorIllegalAddress|misaligned address|device-side assert)", re.I)),
    ("crash", "NCCL error", re.compile(
        r"(NCCL error|ncclUnhandledCudaError|ncclSystemError|ncclInternalError|ncclInvalidUsage|"
        r"ncclRemoteError|DistBackendError)", re.I)),
    ("crash", "killed by SIGKILL (host out of memory?)", re.compile(
        r"(Signal 9 \(SIGKILL\)|exitcode\s*:\s*-9\b|Killed$)", re.I | re.M)),
]
# torchrun's agent got a signal (its own workers' failures show up as exit codes instead)
_SIGNAL_EXCEPTION = re.compile(r"SignalException: Process (\d+) got signal: (\d+)")
_ERROR_LINE = re.compile(r"^\s*(\[rank\d+\]:\s*)?([A-Za-z_.]*(Error|Exception)[A-Za-z_.]*):\s*(.+)$", re.M)


def classify_failure(log_text: str, returncode: int | None) -> tuple[str, str]:
    """(status, reason) from a run's captured output and exit code. status is one of
    ok, oom, timeout, crash, killed (torchrun itself was sent a signal, by someone other than
    the launcher: the launcher's own kills are never classified from the log); reason is one
    line (the most telling log line)."""
    text = log_text or ""
    for status, what, pat in _PATTERNS:
        m = pat.search(text)
        if m:
            line = text[text.rfind("\n", 0, m.start()) + 1:].split("\n", 1)[0].strip()
            line = re.sub(r"^\[rank\d+\]:\s*", "", line)
            return status, f"{what}: {line[:300]}" if line else what
    m = _SIGNAL_EXCEPTION.search(text)
    if m:
        num = int(m.group(2))
        try:
            name = signal.Signals(num).name
        except ValueError:
            name = "?"
        return "killed", (f"torchrun (pid {m.group(1)}) was stopped by signal {num} ({name}) from "
                          "outside the launcher")
    if returncode in (-11, 139):
        return "crash", "segmentation fault (signal 11)"
    if returncode in (-9, 137):
        return "crash", "killed by SIGKILL (host out of memory?)"
    if returncode in (0, None) and "Traceback" not in text:
        return "ok", ""
    errors = _ERROR_LINE.findall(text)
    if errors:
        _, name, _, msg = errors[-1]
        return "crash", f"{name}: {msg.strip()[:300]}"
    tail = [ln.strip() for ln in text.strip().splitlines() if ln.strip()]
    return "crash", f"exit code {returncode}" + (f": {tail[-1][:300]}" if tail else "")


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


def make_entry(model: str | ModelSpec, world_size: int | None, layers: int | None = None,
               steps: int = 10, warmup: int = 3, min_seconds: float = 0.0,
               max_steps: int | None = None, save_trace: bool = False, id: str | None = None,
               stack: str = "local", fp8_recipe: str = "delayed", **layout: Any) -> Entry:
    """Resolve a model name / config.json path / ModelSpec and layout keys into an Entry. dp
    defaults to world_size / (tp*pp*cp); gbs defaults to 8 microbatches. Illegal or unrunnable
    layouts come back with ``refused`` set (a one-line reason)."""
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
    for k in ("steps", "warmup"):
        v = locals()[k]
        if not isinstance(v, int) or v < (1 if k == "steps" else 0):
            raise SpecError(f"{k} must be an integer >= {1 if k == 'steps' else 0}, got {v!r}")
    lay = dict(layout)
    mp = lay.get("tp", 1) * lay.get("pp", 1) * lay.get("cp", 1)
    if "dp" not in lay or lay["dp"] is None:
        if world_size is None:
            raise SpecError("dp is not given and the world size is unknown")
        if world_size % mp:
            lay["dp"] = 1
            cfg = TrainConfig.from_dict(_with_gbs(lay))
            return Entry(name, spec, layers, MA.effective_config(cfg), steps, warmup, min_seconds,
                         max_steps, save_trace, id or uuidlib.uuid4().hex[:12],
                         refused=f"world size {world_size} is not divisible by tp*pp*cp = {mp}",
                         stack=stack, fp8_recipe=fp8_recipe)
        lay["dp"] = world_size // mp
    cfg = MA.effective_config(TrainConfig.from_dict(_with_gbs(lay)))
    return Entry(name, spec, layers, cfg, steps, warmup, min_seconds, max_steps, save_trace,
                 id or uuidlib.uuid4().hex[:12], refused=MA.refusal_reason(spec, cfg, world_size, stack),
                 stack=stack, fp8_recipe=fp8_recipe)


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
    }


def torchrun_command(nproc: int, run_dir: str | Path, start: int = 0,
                     python: str | None = None) -> list[str]:
    return [python or sys.executable, "-m", "torch.distributed.run", "--standalone",
            "--nproc-per-node", str(nproc), "--max-restarts", "0",
            str(WORKER), str(run_dir), str(start)]  # positional: torchrun abbreviates --options


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
        "model": model.to_dict(), "layers": model.num_layers, "config": cfg.to_dict(),
        "cluster": {"gpu": gpu, "num_nodes": 1, "gpus_per_node": gpus_per_node or world},
        "env": {"gpu_name": gpu_name, "driver": env.get("driver"),
                **{k: env.get(k, hello0.get(k)) for k in ("cuda", "torch", "megatron_core", "python", "hostname")},
                **({"transformer_engine": env.get("transformer_engine", hello0.get("transformer_engine"))}
                   if entry.stack == "te" else {}),
                **{k: env.get(k, hello0.get(k)) for k in RUNNER_ENV if env.get(k, hello0.get(k))}},
        "steps": None, "throughput": None, "memory": None, "telemetry": None, "rank_map": [],
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
            rec["memory"]["at_failure"] = {str(r): {k: v for k, v in o.items() if k.endswith("_gib")}
                                          for r, o in oom.items()}
    probe = ((ranks.get(0) or {}).get("done") or {}).get("moe_probe")
    if probe:  # MoE sub-step times of rank 0 (runners/moe_probe.py), from steps after the measured ones
        rec["moe_probe"] = probe
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
    return _finite(rec)


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


# ------------------------------------------------------------------------------- event following
class _Follower:
    """Reads complete new lines of a growing file."""

    def __init__(self, path: Path):
        self.path, self.pos, self.buf = path, 0, b""

    def read(self) -> list[dict[str, Any]]:
        try:
            with open(self.path, "rb") as f:
                f.seek(self.pos)
                data = f.read()
        except FileNotFoundError:
            return []
        self.pos += len(data)
        self.buf += data
        *lines, self.buf = self.buf.split(b"\n")
        out = []
        for ln in lines:
            try:
                out.append(json.loads(ln))
            except json.JSONDecodeError:
                pass
        return out


@dataclass
class _JobState:
    ranks: dict[int, dict[str, Any]] = field(default_factory=dict)
    bounds: list[float] = field(default_factory=list)
    failure: tuple[str, str] | None = None  # (status, error) from a worker event
    recorded: bool = False
    started_at: float | None = None  # worker clock of its first `start` event
    log_offset: int = 0  # its output in the torchrun log starts at or after this byte
    torchrun_started: float | None = None  # when the launcher started the torchrun that ran it
    first_in_torchrun: bool = False  # no job ran before it in that torchrun
    stacks: dict[str, list[str]] | None = None  # where each rank was when the watchdog fired


class BatchRunner:
    """Runs entries in one torchrun (restarting after failures); see the module docstring.

    Guarantees: every job the workers started gets exactly one record; a worker's own ``oom`` /
    ``crash`` event decides its job's status even if torchrun is killed afterwards; a job cut by
    the launcher itself (interrupt, time budget) is ``killed`` with the steps it completed, never
    ``crash``; jobs the time budget kept from starting get no record (the log names them).

    ``max_seconds``: no job starts after that many seconds; the one in flight finishes, then
    torchrun is stopped (a job the workers begin after the budget ran out is stopped at once:
    no record if it completed no step, else ``killed``). ``failure_grace_s``: after a rank
    reports a failure, how long torchrun may live on without the workers going on to the next
    job before the launcher kills it (the other ranks may hang in a collective)."""

    def __init__(self, entries: list[Entry], dataset: str | Path | None, nproc: int,
                 run_dir: str | Path | None = None, timeout: float = 300.0,
                 telemetry_hz: float = 20.0, trace_dir: str | Path | None = None,
                 max_seconds: float | None = None, on_record: Callable[[dict], None] | None = None,
                 python: str | None = None, telemetry: str = "auto", failure_grace_s: float = 30.0):
        self.entries, self.dataset, self.nproc = entries, dataset, nproc
        # With a dataset, the worker files live beside it until the batch is settled: if the
        # launcher is SIGKILLed, the next batch on that dataset (or `advisor measure --salvage`)
        # turns what the workers wrote into records (salvage_runs).
        self._pending = run_dir is None and dataset is not None
        if self._pending:
            run_dir = pending_root(dataset) / f"{time.strftime('%Y%m%d-%H%M%S')}-{os.getpid()}"
        self.run_dir = Path(run_dir or tempfile.mkdtemp(prefix="advisor-measure-"))
        self.timeout, self.telemetry_hz, self.max_seconds = timeout, telemetry_hz, max_seconds
        self.failure_grace_s = failure_grace_s
        self.trace_dir = Path(trace_dir) if trace_dir else None
        self.on_record, self.python, self.telemetry = on_record, python, telemetry
        self.records: list[dict[str, Any]] = []
        self.sampler = None
        self.backend = None
        self.env: dict[str, Any] = {}
        self.hello: dict[int, dict[str, Any]] = {}
        self.proc: subprocess.Popen | None = None
        self.kill_reason: str | None = None  # why the launcher stopped the current torchrun
        self.t_begin = time.time()
        self._drain: Callable[[], None] | None = None

    # -- records -------------------------------------------------------------------------------
    def _emit(self, rec: dict[str, Any]) -> None:
        if self.dataset:
            append_jsonl(self.dataset, rec)
        self.records.append(rec)
        if self.on_record:
            self.on_record(rec)

    def _record(self, entry: Entry, st: _JobState | None, status: str, error: str | None) -> None:
        if st is not None:
            if st.recorded:
                return
            st.recorded = True
        ranks = {r: dict(v) for r, v in (st.ranks if st else {}).items()}
        for r, h in self.hello.items():
            ranks.setdefault(r, {}).setdefault("hello", h)
        bounds = st.bounds if st else None
        trace, trace_path = None, None
        if self.sampler is not None and bounds and len(bounds) > entry.warmup + 1:
            trace = self._trace_between(bounds[0] - 1.0, bounds[-1] + 1.0)
            if entry.save_trace and self.trace_dir is not None and trace is not None:
                self.trace_dir.mkdir(parents=True, exist_ok=True)
                p = self.trace_dir / f"{entry.id}.trace.json.gz"
                trace.windows.extend(step_windows(bounds, entry.warmup))
                trace.save(p)
                trace_path = str(p)
        try:
            rec = assemble_record(entry, status, error, ranks, bounds, trace, self.env,
                                  gpus_per_node=self.nproc, trace_path=trace_path)
        except Exception as e:  # never lose a measurement to a bug in summarising it
            log.exception("assembling the record of %s failed", entry.id)
            rec = assemble_record(entry, status, f"{error or ''} [record assembly: {e}]".strip(),
                                  ranks, bounds, None, self.env, gpus_per_node=self.nproc)
        if st is not None and st.stacks:
            rec["hang_stacks"] = st.stacks
        if st is not None and st.torchrun_started is not None:
            rec["timing"] = job_timing(st.torchrun_started, st.first_in_torchrun, st.started_at,
                                       bounds[0] if bounds else None, time.time())
        self._emit(rec)

    def _trace_between(self, t0: float, t1: float):
        try:
            return self.sampler.snapshot(t0, t1)
        except Exception as e:  # telemetry must not cost the record
            log.warning("telemetry snapshot failed: %s", e)
            return None

    # -- telemetry -----------------------------------------------------------------------------
    def _start_telemetry(self) -> None:
        if self.telemetry == "off" or self.telemetry_hz <= 0:
            from advisor.runners.telemetry_nvml import driver_version

            self.env["driver"] = driver_version()  # still recorded without telemetry
            return
        try:
            from advisor.runners.telemetry import Sampler, open_backend
            t = self.telemetry
            self.backend = open_backend(t) if isinstance(t, str) else t  # or a backend object
            if self.backend is None:
                return
            self.env["driver"] = getattr(self.backend, "driver_version", None)
            self.sampler = Sampler(self.backend, None, rate_hz=self.telemetry_hz).start()
        except Exception as e:
            log.warning("telemetry unavailable: %s", e)
            self.sampler = None

    def _stop_telemetry(self):
        if self.sampler is not None:
            try:
                return self.sampler.stop()
            except Exception:
                return None

    # -- time budget ---------------------------------------------------------------------------
    @property
    def deadline(self) -> float | None:
        return self.t_begin + self.max_seconds if self.max_seconds else None

    def _budget_spent(self) -> bool:
        return self.deadline is not None and time.time() > self.deadline

    # -- the batch -----------------------------------------------------------------------------
    def run(self) -> list[dict[str, Any]]:
        runnable = []
        for e in self.entries:
            if e.refused:
                self._record(e, None, "refused", e.refused)
            else:
                runnable.append(e)
        if not runnable:
            return self.records
        if self.dataset is not None:
            salvage_runs(self.dataset)
        self.run_dir.mkdir(parents=True, exist_ok=True)
        me = psutil.Process()
        (self.run_dir / "entries.json").write_text(json.dumps(
            {"pid": me.pid, "create_time": me.create_time(), "host": socket.gethostname(), "nproc": self.nproc,
             "entries": [entry_to_dict(e) for e in runnable]}, default=_jsonable))
        with open(self.run_dir / "jobs.jsonl", "w", encoding="utf-8") as f:
            for i, e in enumerate(runnable):
                f.write(json.dumps(job_for(e, i)) + "\n")
        self._start_telemetry()
        self.t_begin = time.time()
        states = [_JobState() for _ in runnable]
        start, attempt, consecutive_timeouts = 0, 0, 0
        old_handlers = _install_signal_handlers()
        try:
            while start < len(runnable) and not self._budget_spent():
                nxt, timed_out = self._attempt(runnable, states, start, attempt)
                attempt += 1
                consecutive_timeouts = consecutive_timeouts + 1 if timed_out else 0
                if consecutive_timeouts >= 2 and nxt < len(runnable):
                    for i in range(nxt, len(runnable)):
                        self._record(runnable[i], states[i], "skipped",
                                     "not run: batch aborted after 2 consecutive timeouts")
                    nxt = len(runnable)
                start = nxt
            if start < len(runnable):  # only the time budget stops the loop early
                left = runnable[start:]
                msg = (f"time budget of {self.max_seconds:g} s spent after "
                       f"{time.time() - self.t_begin:.0f} s: {len(left)} job(s) not started, "
                       f"not recorded: {', '.join(e.id for e in left)}")
                log.warning(msg)
                self._log_line(msg)
        except KeyboardInterrupt:
            self._kill("interrupted")
            if self._drain is not None:
                try:
                    self._drain()  # what the workers wrote before they were stopped
                except Exception:
                    log.exception("reading the last events failed")
            for i, e in enumerate(runnable):
                st = states[i]
                if not st.recorded and (st.ranks or st.bounds):
                    if st.failure:
                        self._record(e, st, *st.failure)
                    else:
                        self._record(e, st, "killed", f"interrupted after {_steps_done(st)} step(s); "
                                                      "partial steps kept")
            self._settled()
            raise
        finally:
            self._drain = None
            _restore_signal_handlers(old_handlers)
            full = self._stop_telemetry()
            if full is not None and self.trace_dir is not None and os.environ.get("ADVISOR_SAVE_FULL_TRACE"):
                full.save(self.trace_dir / f"batch-{int(self.t_begin)}.trace.json.gz")
        for i, e in enumerate(runnable):  # safety net: nothing the workers reported is dropped
            st = states[i]
            if not st.recorded and (st.ranks or st.bounds):
                log.error("job %d (%s) had no outcome; recording it", i, e.id)
                self._record(e, st, *(st.failure or ("crash", "the launcher lost track of this job")))
        self._settled()
        return self.records

    def _settled(self) -> None:
        """Every job has its record in the dataset: the pending worker files can go."""
        if self._pending:
            shutil.rmtree(self.run_dir, ignore_errors=True)
            try:
                self.run_dir.parent.rmdir()  # the last pending batch of this dataset
            except OSError:
                pass

    def _attempt(self, runnable: list[Entry], states: list[_JobState], start: int,
                 attempt: int) -> tuple[int, bool]:
        """One torchrun from job `start`; records every job it started and returns (the first
        job it did not start, timed out?)."""
        log_path = self.run_dir / f"attempt{attempt}.log"
        followers = {r: _Follower(self.run_dir / f"rank{r}.jsonl") for r in range(self.nproc)}
        for f in followers.values():  # skip what earlier attempts wrote
            f.read()
        env = dict(os.environ, **CHILD_ENV)
        if any(e.stack == "te" for e in runnable):
            env.update(TE_CHILD_ENV)
        cmd = torchrun_command(self.nproc, self.run_dir, start, self.python)
        self.kill_reason = None
        launched_at = time.time()
        with open(log_path, "ab") as logf:
            # A session of its own: a terminal's Ctrl-C reaches the launcher only, which then
            # stops torchrun and records what was measured. PR_SET_PDEATHSIG: torchrun still
            # goes if the launcher is SIGKILLed.
            self.proc = subprocess.Popen(cmd, stdout=logf, stderr=subprocess.STDOUT, env=env,
                                         start_new_session=True, preexec_fn=preexec_die_with_parent())
        s: dict[str, Any] = {"current": None, "failed": None, "batch_done": False, "seen": False,
                             "progress": time.time(), "start": start, "log_mark": 0,
                             "torchrun_started": launched_at}

        def drain() -> None:
            # A job first seen in this drain began after the previous drain read the event
            # files, so its output in the log starts after the size measured then: failures are
            # classified from there on, not from an earlier job's (recovered) error messages.
            mark = _size(log_path)
            for r, fol in followers.items():
                for evt in fol.read():
                    s["progress"], s["seen"] = time.time(), True
                    self._consume(r, evt, runnable, states, s)
            s["log_mark"] = mark
            cur = s["current"]
            for i in range(start, start if cur is None else cur):  # failures a 1-GPU worker survived
                if states[i].failure and not states[i].recorded:
                    self._record(runnable[i], states[i], *states[i].failure)

        self._drain = drain
        timed_out = False
        while True:
            rc = self.proc.poll()
            drain()
            if rc is not None:
                break
            now = time.time()
            failed = s["failed"]
            if failed and failed[0] == s["current"] and now - failed[1] > self.failure_grace_s:
                # A rank failed and the workers did not go on (a 1-GPU worker recovers and goes
                # on to the next job): the other ranks may hang in a collective.
                self._log_line(f"job {failed[0]} failed {self.failure_grace_s:g} s ago and the "
                               f"workers did not go on: stopping torchrun")
                self._kill("failure")
                break
            if now - s["progress"] > self.timeout:
                timed_out = True
                if s["current"] is not None:
                    states[s["current"]].stacks = dump_worker_stacks(self.proc.pid, self.run_dir)
                self._kill("timeout")
                break
            if self._budget_spent():
                i = s["current"]
                st = states[i] if i is not None else None
                in_flight = (st is not None and not st.recorded and st.failure is None
                             and st.started_at is not None and st.started_at <= self.deadline)
                if not in_flight:  # no job may start any more
                    self._kill("budget")
                    break
            time.sleep(0.2)
        rc = self.proc.wait()
        drain()
        self._drain = None
        if not s["seen"]:  # the workers never started: the same would happen to every job
            if self.kill_reason == "budget":
                return start, False
            status, reason = classify_failure(_tail(log_path), rc)
            reason = f"workers did not start: {reason or f'exit code {rc}'}"
            for i in range(start, len(runnable)):
                self._record(runnable[i], states[i], "crash", reason)
            return len(runnable), False
        cur = s["current"]
        if cur is None:  # the workers said hello but began no job
            if self.kill_reason == "budget":
                return start, False
            cur = start
        for i in range(start, cur + 1):
            st = states[i]
            if st.recorded:
                continue
            if (i == cur and self.kill_reason == "budget" and st.failure is None
                    and len(st.bounds) < 2 and (st.started_at is None or st.started_at > self.deadline)):
                # Begun after the budget ran out and stopped before its first step: not run.
                states[i] = _JobState()
                return i, False
            self._record(runnable[i], st, *self._outcome(runnable[i], i == cur, st, rc, log_path))
        if s["batch_done"] and rc == 0:
            return len(runnable), False
        return cur + 1, timed_out

    def _outcome(self, entry: Entry, in_flight: bool, st: _JobState, rc: int | None,
                 log_path: Path) -> tuple[str, str]:
        """(status, error) of a started job that has no record when its torchrun ended."""
        if st.failure:  # what the worker itself reported wins, whatever happened afterwards
            return st.failure
        n = _steps_done(st)
        if self.kill_reason == "timeout" and in_flight:
            where = "; ".join(f"rank {r} in {stack_summary(fr)}" for r, fr in sorted(
                (st.stacks or {}).items(), key=lambda kv: int(kv[0])) if fr)
            return "timeout", (f"no progress for {self.timeout:.0f} s (NCCL hang?); process group killed"
                               + (f"; {where}" if where else ""))
        if self.kill_reason == "budget":
            return "killed", (f"cut by the time budget ({self.max_seconds:g} s) after {n} step(s); "
                              "torchrun stopped by the launcher, partial steps kept")
        if self.kill_reason is not None:
            return "killed", f"torchrun stopped by the launcher ({self.kill_reason}) after {n} step(s)"
        if not in_flight:
            missing = [r for r in range(entry.config.world_size) if "done" not in st.ranks.get(r, {})]
            return "crash", f"the workers went on without reporting this job's outcome (ranks {missing})"
        status, reason = classify_failure(_tail(log_path, start=st.log_offset), rc)
        if status == "ok":
            status, reason = "crash", f"workers exited (code {rc}) before finishing the job"
        return status, reason

    def _consume(self, r: int, evt: dict[str, Any], runnable: list[Entry],
                 states: list[_JobState], s: dict[str, Any]) -> None:
        kind, i = evt.get("ev"), evt.get("cfg")
        if kind == "hello":
            self.hello[r] = evt
            for k in HELLO_ENV:
                self.env.setdefault(k, evt.get(k))
            return
        if kind == "batch_done":
            s["batch_done"] = True
            return
        if i is None or not s["start"] <= i < len(states):  # (a late event of an earlier torchrun)
            return
        st = states[i]
        if s["current"] is None or i > s["current"]:
            s["current"] = i
            st.log_offset = s["log_mark"]
        if kind == "start":
            t = evt.get("t", time.time())
            st.started_at = t if st.started_at is None else min(st.started_at, t)
            if st.torchrun_started is None:
                st.torchrun_started = s["torchrun_started"]
                st.first_in_torchrun = i == s["start"]
        if kind == "step":
            if r == 0:
                st.bounds.append(evt["tt"])
            return
        st.ranks.setdefault(r, {})[kind] = evt
        if kind in ("oom", "crash") and st.failure is None:
            st.failure = (kind, evt.get("error"))
            if s["failed"] is None or i > s["failed"][0]:
                s["failed"] = (i, time.time())
            self._log_line(f"job {i} {kind} on rank {r}: {evt.get('error')}")
        if kind == "done" and all("done" in st.ranks.get(q, {})
                                  for q in range(runnable[i].config.world_size)):
            self._record(runnable[i], st, "ok", None)
            self._log_line(f"job {i} ok: {runnable[i].model.name} {runnable[i].config.key()}")

    def _kill(self, reason: str) -> None:
        """Stop torchrun and its workers (they run in sessions of their own) and wait until
        they are gone, so that no event arrives after the jobs are settled."""
        p = self.proc
        if p is None or p.poll() is not None:
            return
        self.kill_reason = self.kill_reason or reason
        tree = _descendants(p.pid)
        try:
            os.killpg(p.pid, signal.SIGTERM)  # torchrun passes it on to its workers
            p.wait(timeout=15)
        except (ProcessLookupError, subprocess.TimeoutExpired):
            try:
                os.killpg(p.pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
            p.wait()
        _kill_all(tree)

    def _log_line(self, msg: str) -> None:
        print(f"[measure] {msg}", file=sys.stderr, flush=True)


def job_timing(torchrun_started: float, first: bool, job_started: float | None, first_step: float | None,
               end: float) -> dict[str, Any]:
    """Where a job's wall time went (s): `startup_s` (torchrun launch to the job's start: process
    launch, imports, NCCL init; only for the first job of a torchrun), `build_s` (job start to its
    first step boundary: model, optimizer, data), `run_s` (first step boundary to its record)."""
    def gap(a, b):
        return round(b - a, 3) if a is not None and b is not None else None

    return {"torchrun_started": torchrun_started, "first_in_torchrun": first,
            "startup_s": gap(torchrun_started, job_started) if first else None,
            "build_s": gap(job_started, first_step), "run_s": gap(first_step, end)}


def _steps_done(st: _JobState) -> int:
    return max(0, len(st.bounds) - 1)


def _size(path: Path) -> int:
    try:
        return path.stat().st_size
    except OSError:
        return 0


def _tail(path: Path, n: int = 200_000, start: int = 0) -> str:
    """The last n bytes of a log, from byte `start` on."""
    try:
        with open(path, "rb") as f:
            f.seek(0, os.SEEK_END)
            f.seek(max(start, f.tell() - n))
            return f.read().decode("utf-8", "replace")
    except FileNotFoundError:
        return ""


# ---------------------------------------------------------------------------------- salvage
def pending_root(dataset: str | Path) -> Path:
    """Where the worker files of batches appending to `dataset` wait until they are settled."""
    return Path(f"{dataset}.runs")


def entry_to_dict(e: Entry) -> dict[str, Any]:
    return {"model_name": e.model_name, "model": e.model.to_dict(), "layers": e.layers,
            "config": e.config.to_dict(), "steps": e.steps, "warmup": e.warmup,
            "min_seconds": e.min_seconds, "max_steps": e.max_steps, "save_trace": e.save_trace,
            "id": e.id, "stack": e.stack, "fp8_recipe": e.fp8_recipe}


def entry_from_dict(d: Mapping[str, Any]) -> Entry:
    return Entry(d["model_name"], ModelSpec.from_dict(d["model"]), d.get("layers"),
                 TrainConfig.from_dict(d["config"]), d["steps"], d["warmup"], d.get("min_seconds", 0.0),
                 d.get("max_steps"), d.get("save_trace", False), d["id"],
                 stack=d.get("stack", "local"), fp8_recipe=d.get("fp8_recipe", "delayed"))


def _owner_alive(meta: Mapping[str, Any]) -> bool:
    """Is the launcher that wrote this batch still running? A batch of another host (a shared
    file system) counts as alive: its process cannot be checked from here."""
    if meta.get("host", socket.gethostname()) != socket.gethostname():
        return True
    try:
        p = psutil.Process(int(meta["pid"]))
        return abs(p.create_time() - float(meta["create_time"])) < 1.0
    except (psutil.Error, KeyError, TypeError, ValueError):
        return False


def salvage_run_dir(run_dir: str | Path, dataset: str | Path) -> list[dict[str, Any]]:
    """Records for the jobs of a batch whose launcher died without settling them (SIGKILL, power
    loss): built from the workers' event files, appended to `dataset`, for every job that
    started and has no record there yet. No telemetry (it lived in the launcher). Returns them."""
    run_dir = Path(run_dir)
    meta = json.loads((run_dir / "entries.json").read_text(encoding="utf-8"))
    entries = [entry_from_dict(d) for d in meta["entries"]]
    done = {r.get("id") for r in read_jsonl(dataset)} if Path(dataset).is_file() else set()
    ranks: dict[int, dict[int, dict[str, Any]]] = {}
    bounds: dict[int, list[float]] = {}
    env: dict[str, Any] = {}
    for f in sorted(run_dir.glob("rank*.jsonl")):
        r = int(f.stem.removeprefix("rank"))
        hello = None
        for evt in read_jsonl(f):
            kind, i = evt.get("ev"), evt.get("cfg")
            if kind == "hello":
                hello = evt
                for k in HELLO_ENV:
                    env.setdefault(k, evt.get(k))
                continue
            if not isinstance(i, int) or not 0 <= i < len(entries):
                continue
            per = ranks.setdefault(i, {}).setdefault(r, {})
            if hello is not None:
                per.setdefault("hello", hello)
            if kind == "step":
                if r == 0:
                    bounds.setdefault(i, []).append(evt["tt"])
            elif kind:
                per[kind] = evt
    out = []
    for i, e in enumerate(entries):
        if e.id in done or i not in ranks:
            continue  # recorded before the launcher died, or never started
        rs, b = ranks[i], bounds.get(i)
        failed = next(((k, ev.get("error")) for ev_r in rs.values() for k, ev in ev_r.items()
                       if k in ("oom", "crash")), None)
        n = max(0, len(b or []) - 1 - e.warmup)
        if failed:
            status, error = failed
        elif all("done" in rs.get(q, {}) for q in range(e.config.world_size)):
            status, error = "ok", None
        else:
            status, error = "killed", (f"the launcher died (SIGKILL?) after {n} measured step(s); "
                                       "steps kept from the workers' event files")
        rec = assemble_record(e, status, error, rs, b, None, env, gpus_per_node=meta.get("nproc"))
        rec["salvaged_from"] = str(run_dir)
        append_jsonl(dataset, rec)
        out.append(rec)
    return out


def salvage_runs(dataset: str | Path) -> list[dict[str, Any]]:
    """Settle every batch left pending beside `dataset` by a launcher that died (see
    salvage_run_dir); batches whose launcher still runs are left alone."""
    root = pending_root(dataset)
    if not root.is_dir():
        return []
    out = []
    for d in sorted(p for p in root.iterdir() if p.is_dir()):
        try:
            meta = json.loads((d / "entries.json").read_text(encoding="utf-8"))
        except (OSError, ValueError):
            meta = None
            if time.time() - d.stat().st_mtime < 3600:
                continue  # being created by a launcher right now, or unreadable: not ours to drop
        if meta is not None and _owner_alive(meta):
            continue
        if meta is not None:
            if meta.get("runner") == "command":  # the command runner's batches: trial logs
                from advisor.runners.command import salvage_run_dir as salvage_command

                recs = salvage_command(d, dataset, meta)
            else:
                recs = salvage_run_dir(d, dataset)
            if recs:
                log.warning("salvaged %d record(s) of a batch whose launcher died: %s", len(recs), d)
            out += recs
        shutil.rmtree(d, ignore_errors=True)
    try:
        root.rmdir()
    except OSError:
        pass
    return out


# ------------------------------------------------------------------------------- processes
# The workers dump every thread's Python stack (faulthandler) into rank<R>.stacks on this signal.
STACK_SIGNAL = signal.SIGUSR1
_FRAME = re.compile(r'^\s*File "(?P<file>[^"]+)", line (?P<line>\d+) in (?P<func>\S+)')


def dump_worker_stacks(torchrun_pid: int, run_dir: Path, wait_s: float = 2.0) -> dict[str, list[str]]:
    """Ask the workers under torchrun where they are: {rank: frames of its main thread, innermost
    first, as "func (file.py:line)"}. Only the worker processes get the signal (torchrun's agent
    would die of it)."""
    marks = {p: _size(p) for p in Path(run_dir).glob("rank*.stacks")}
    sent = 0
    try:
        procs = [psutil.Process(torchrun_pid)] + _descendants(torchrun_pid)
    except psutil.Error:
        return {}
    for p in procs:
        try:
            if any(Path(a).name == WORKER.name for a in p.cmdline()[:3]):
                p.send_signal(STACK_SIGNAL)
                sent += 1
        except psutil.Error:
            pass
    if not sent:
        return {}
    time.sleep(wait_s)
    out = {}
    for p in sorted(Path(run_dir).glob("rank*.stacks")):
        frames = parse_stack_dump(_tail(p, start=marks.get(p, 0)))
        if frames:
            out[p.stem.removeprefix("rank")] = frames
    return out


def parse_stack_dump(text: str, keep: int = 12) -> list[str]:
    """The main thread's frames from a faulthandler dump (the "Current thread" block: the signal
    runs on the main thread), innermost first."""
    blocks, cur = [], None
    for line in text.splitlines():
        if line.startswith(("Thread 0x", "Current thread 0x")):
            cur = (line.startswith("Current"), [])
            blocks.append(cur)
        elif cur is not None and (m := _FRAME.match(line)):
            cur[1].append(f"{m['func']} ({Path(m['file']).name}:{m['line']})")
    main = [b for b in blocks if b[0]] or blocks
    return main[-1][1][:keep] if main else []


def stack_summary(frames: list[str], depth: int = 3) -> str:
    """The innermost frames of one rank, for an error line."""
    return " < ".join(frames[:depth])


def _descendants(pid: int) -> list[psutil.Process]:
    """Every live descendant of pid (psutil remembers each one's start time, so a recycled pid is
    never mistaken for it)."""
    try:
        return psutil.Process(pid).children(recursive=True)
    except psutil.Error:
        return []


def _alive(p: psutil.Process) -> bool:
    try:
        return p.is_running() and p.status() != psutil.STATUS_ZOMBIE
    except psutil.Error:
        return False


def _kill_all(procs: list[psutil.Process], wait_s: float = 10.0) -> None:
    """SIGKILL the processes still alive and wait until they are gone (a zombie counts as gone:
    its parent may be dead and nobody may reap it)."""
    left = [p for p in procs if _alive(p)]
    for p in left:
        try:
            p.kill()
        except psutil.Error:
            pass
    t0 = time.time()
    while left and time.time() - t0 < wait_s:
        left = [p for p in left if _alive(p)]
        if left:
            time.sleep(0.05)
    if left:
        log.warning("processes %s survived SIGKILL", [p.pid for p in left])


def _raise_interrupt(signum, frame):
    raise KeyboardInterrupt


def _install_signal_handlers():
    old = {}
    try:
        for s in (signal.SIGTERM, signal.SIGINT):
            old[s] = signal.signal(s, _raise_interrupt)
    except ValueError:  # not the main thread
        pass
    return old


def _restore_signal_handlers(old) -> None:
    for s, h in old.items():
        signal.signal(s, h)


# ------------------------------------------------------------------------------ GPU discovery
def local_gpu_count() -> int:
    """GPUs this process may use: CUDA_VISIBLE_DEVICES if set, else nvidia-smi's list."""
    cvd = os.environ.get("CUDA_VISIBLE_DEVICES")
    if cvd is not None and cvd.strip() not in ("", "all"):
        return len([x for x in cvd.split(",") if x.strip()])
    try:
        out = subprocess.run(["nvidia-smi", "-L"], capture_output=True, text=True, timeout=30)
        return sum(1 for ln in out.stdout.splitlines() if ln.startswith("GPU "))
    except (OSError, subprocess.TimeoutExpired):
        return 0


def te_available() -> bool:
    """Can this Python import Transformer Engine's PyTorch API (without importing it)?"""
    import importlib.util

    try:
        return importlib.util.find_spec("transformer_engine.pytorch") is not None
    except (ImportError, ValueError):
        return False


def run_batch(entries: list[Entry], dataset: str | Path | None, nproc: int, **kw: Any) -> list[dict[str, Any]]:
    te_ok = None
    for e in entries:
        if not e.refused and e.config.world_size != nproc:
            e.refused = f"world size {nproc} != tp*pp*cp*dp = {e.config.world_size}"
        if not e.refused and e.stack == "te":
            te_ok = te_available() if te_ok is None else te_ok
            if not te_ok:
                e.refused = TE_MISSING
    return BatchRunner(entries, dataset, nproc, **kw).run()


def load_batch(path: str | Path, world_size: int | None) -> list[Entry]:
    entries = []
    with open(path, encoding="utf-8") as f:
        for n, line in enumerate(f, 1):
            if not line.strip() or line.lstrip().startswith("#"):
                continue
            try:
                entries.append(entry_from_line(json.loads(line), world_size))
            except json.JSONDecodeError as e:
                raise SpecError(f"{path}:{n}: invalid JSON ({e.msg})") from None
            except SpecError as e:
                raise SpecError(f"{path}:{n}: {e}") from None
    return entries
