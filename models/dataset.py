"""Measurement records (JSONL, schema ``advisor.measurement/1``) loaded and validated for fitting.

One record per trial, written by ``advisor.runners.measure``. ``load`` reads one or more files and
keeps every ``status: ok`` record whose required fields (model, layers, config, cluster, steps,
throughput) are present and sane and whose optional blocks (memory, telemetry) are either absent
(that target is then NaN for the row, and counted) or sane; every other line is either
*skipped* (a valid record of a failed trial: oom, timeout, crash, ...) or *rejected* (not JSON,
wrong schema, a missing or corrupt field, tokens/s above the GPU's peak (MFU > 1) or not matching
tokens per step / steps.median_s), each rejection with a one-line reason, and counted.
``load(records=...)`` also takes records read elsewhere (the trials of ``advisor tune`` studies:
``advisor.study.study_records``); a record read twice (same id and content) counts once.

Targets (what the surrogates learn), per GPU:
  tokens_per_s_per_gpu  throughput.tokens_per_s_per_gpu            (required)
  memory_gib_per_gpu    memory.max_reserved_gib: peak reserved by torch's caching allocator, max
                        over ranks (what decides an OOM, up to the CUDA context and NCCL's own
                        buffers, which torch does not see); memory.max_gib (peak allocated)
                        where a record has no reserved figure   (NaN without a memory block)
  mean_power_w          telemetry.mean_power_w                      (NaN without telemetry)
  peak_power_w          telemetry.peak_power_w                      (NaN without telemetry)
  throttle_fraction     telemetry.throttle_fraction: "any_throttle", else the largest of the
                        power / thermal reasons                     (NaN without telemetry)
"""
from __future__ import annotations

import hashlib
import json
import math
from collections import Counter
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Iterable, Sequence

import numpy as np

from advisor.catalog.specs import ClusterSpec, ModelSpec, SpecError, TrainConfig
from advisor.models.residuals import ADDITIVE, apply_residual, residual  # noqa: F401 (API: next to TARGETS)

SCHEMA = "advisor.measurement/1"
STATUSES = ("ok", "oom", "timeout", "crash", "refused", "killed", "skipped")
TARGETS = ("tokens_per_s_per_gpu", "memory_gib_per_gpu", "mean_power_w", "peak_power_w", "throttle_fraction")
THROTTLE_REASONS = ("sw_power_cap", "hw_slowdown", "sw_thermal", "hw_thermal", "hw_power_brake")
# tokens/s per GPU must equal tokens per step / steps.median_s / GPUs within this fraction
TPS_TOLERANCE = 0.03


class DatasetError(SpecError):
    """No usable record (or an unreadable file); one line for the user."""


@dataclass
class Record:
    id: str
    source: str  # "file:line"
    model: ModelSpec
    cluster: ClusterSpec
    cfg: TrainConfig
    y: dict[str, float]  # TARGETS -> measured value (NaN where not measured)
    # the runner's software stack ("local": megatron-core local layers; "te": Transformer Engine);
    # records from before the te stack existed are local
    stack: str = "local"
    # torch's caching allocator ran out of free blocks and retried after emptying its cache
    # (memory_phases num_alloc_retries, max over ranks): the run was at the memory edge and its
    # steps paid for the cudaFree / cudaMalloc cycles, which the step-time model does not price
    alloc_retries: int = 0

    @property
    def group(self) -> str:
        return shape_key(self.model)


@dataclass
class Dataset:
    records: list[Record] = field(default_factory=list)
    rejected: list[str] = field(default_factory=list)  # "file:line: reason"
    skipped: Counter = field(default_factory=Counter)  # status -> count (failed trials)
    files: list[dict] = field(default_factory=list)  # {"path", "sha256", "lines"} (+ "study", "trials", ...)
    duplicates: int = 0  # records read before (same id and measurement), not counted twice

    def __len__(self) -> int:
        return len(self.records)

    def y(self, target: str) -> np.ndarray:
        return np.array([r.y[target] for r in self.records], dtype=float)

    def groups(self, with_layers: bool = False) -> np.ndarray:
        return np.array([shape_key(r.model, with_layers) for r in self.records])

    def summary(self) -> str:
        files = [f for f in self.files if "study" not in f]
        studies = [f for f in self.files if "study" in f]
        where = []
        if files or not studies:
            where.append(f"{sum(f['lines'] for f in files)} lines in {len(files)} file(s)")
        if studies:
            where.append(f"{sum(f['trials'] for f in studies)} trials in {len(studies)} stud"
                         f"{'y' if len(studies) == 1 else 'ies'} ({sum(f['lines'] for f in studies)} with their "
                         f"own record, {sum(f['copied'] for f in studies)} duplicates of another trial left out)")
        skipped = ", ".join(f"{k} {v}" for k, v in sorted(self.skipped.items())) or "none"
        no_power = int(np.isnan(self.y("mean_power_w")).sum()) if self.records else 0
        no_mem = int(np.isnan(self.y("memory_gib_per_gpu")).sum()) if self.records else 0
        dup = f", {self.duplicates} duplicate(s) of records read before" if self.duplicates else ""
        return (f"{' and '.join(where)}: {len(self.records)} usable, "
                f"{len(self.rejected)} rejected, skipped (failed trials): {skipped}{dup}; "
                f"usable without power telemetry {no_power}, without memory {no_mem}; "
                f"{len(set(self.groups()))} model shape(s)")


def shape_key(model: ModelSpec, with_layers: bool = False) -> str:
    """The model's architecture (what sets GEMM shapes), without its name; the layer count only
    when asked (proxies of one model with different depths share a shape). Variants of one shape
    that differ only in the attention pattern or the activation's clamp (the gpt-oss proxy with
    its window, sinks or clamp off: bench/te_campaign.py s34) share it too: leaving one
    architecture out leaves them all out."""
    d = model.to_dict()
    for k in ("name", "source", "family", "window_size", "window_type", "window_pattern", "attention_sinks",
              "activation_clamp", "attn_logit_softcap", "final_logit_softcap"):
        d.pop(k, None)
    if not with_layers:
        d.pop("num_layers")
        if d.get("moe"):
            d["moe"] = {k: v for k, v in d["moe"].items() if k != "first_dense_layers"}
    return hashlib.sha1(json.dumps(d, sort_keys=True).encode()).hexdigest()[:10]


# ------------------------------------------------------------------------------------------------
# validation of one record
# ------------------------------------------------------------------------------------------------

class _Bad(Exception):
    pass


def _get(d: Any, path: str, kind=dict, required: bool = True):
    cur = d
    for part in path.split("."):
        if not isinstance(cur, dict) or part not in cur or cur[part] is None:
            if required:
                raise _Bad(f"missing field {path!r}")
            return None
        cur = cur[part]
    if not isinstance(cur, kind) or (kind in (int, float, (int, float)) and isinstance(cur, bool)):
        raise _Bad(f"field {path!r} is {type(cur).__name__}, expected {getattr(kind, '__name__', 'number')}")
    return cur


def _number(d: Any, path: str, required: bool = True, lo: float = 0.0, hi: float = math.inf,
            lo_open: bool = True) -> float:
    v = _get(d, path, (int, float), required)
    if v is None:
        return math.nan
    v = float(v)
    if not math.isfinite(v) or v > hi or v < lo or (lo_open and v == lo):
        raise _Bad(f"field {path!r} = {v!r} is out of range")
    return v


def legacy_config(config: dict, model: ModelSpec, stack: str = "local") -> dict:
    """What records written before TrainConfig had a knob ran, said in their config: MoE records
    without MoE knobs ran megatron-core's SequentialMLP (one GEMM per expert) with the alltoall
    dispatcher and the aux-loss router; te-stack records without `cross_entropy_impl` ran
    megatron-core's native fused cross entropy (the te runner set cross_entropy_loss_fusion with
    cross_entropy_fusion_impl "native" until the layout carried it), local ones the unfused one
    (TrainConfig's default)."""
    out = dict(config)
    if model.is_moe and "moe_grouped_gemm" not in config:
        out["moe_grouped_gemm"] = False
    if stack == "te" and "cross_entropy_impl" not in config:
        out["cross_entropy_impl"] = "native"
    return out


def cluster_of(rec: dict) -> ClusterSpec:
    from advisor.catalog import load_cluster

    gpu = _get(rec, "cluster.gpu", str)
    nodes = _get(rec, "cluster.num_nodes", int)
    per_node = _get(rec, "cluster.gpus_per_node", int)
    if nodes < 1 or per_node < 1:
        raise _Bad("cluster.num_nodes and cluster.gpus_per_node must be >= 1")
    cap = None
    for path in ("cluster.power_cap_w", "env.power_limit_w", "telemetry.power_limit_w"):
        v = _get(rec, path, (int, float), required=False)
        if v:
            cap = float(v)
            break
    try:
        c = load_cluster(f"{gpu}x{per_node * nodes}", power_cap_w=cap)
        if c.gpus_per_node != per_node:
            c = load_cluster(f"{gpu}x{per_node}x{nodes}", power_cap_w=cap)
    except SpecError as e:
        raise _Bad(f"cluster: {e}") from None
    return c


def _throttle(rec: dict) -> float:
    fr = _get(rec, "telemetry.throttle_fraction", (dict, int, float), required=False)
    if fr is None:
        return math.nan
    if not isinstance(fr, dict):  # a bare fraction: what the simulated runner wrote before it wrote the schema's form
        fr = {"any_throttle": fr}
    vals = {}
    for k, v in fr.items():
        if v is None:
            continue
        if not isinstance(v, (int, float)) or isinstance(v, bool) or not (0.0 <= float(v) <= 1.0):
            raise _Bad(f"field 'telemetry.throttle_fraction.{k}' = {v!r} is not a fraction")
        vals[k] = float(v)
    if "any_throttle" in vals:
        return vals["any_throttle"]
    known = [vals[k] for k in THROTTLE_REASONS if k in vals]
    return max(known) if known else math.nan


def _memory(rec: dict, cluster: ClusterSpec) -> float:
    if rec.get("memory") is None:
        return math.nan
    hi = cluster.gpu.memory_gib * 1.05
    v = _number(rec, "memory.max_reserved_gib", required=False, hi=hi)
    return v if math.isfinite(v) else _number(rec, "memory.max_gib", hi=hi)


def _check_throughput(rec: dict, model: ModelSpec, cluster: ClusterSpec, cfg: TrainConfig,
                      tps: float, median_s: float) -> None:
    """Tokens/s that no GPU can reach (MFU > 1 at the catalog's peak for the precision, with the
    record's throughput.flops_per_token, else the model's count) or that disagree with the
    measured step time (tokens per step / steps.median_s / GPUs, within TPS_TOLERANCE)."""
    from advisor.models.flops import training_flops_per_token

    fpt = _get(rec, "throughput.flops_per_token", (int, float), required=False)
    if fpt is None or isinstance(fpt, bool) or not (math.isfinite(fpt) and fpt > 0):
        fpt = training_flops_per_token(model, cfg.seq)
    try:
        peak = cluster.gpu.peak_tflops(cfg.precision)
    except SpecError as e:
        raise _Bad(str(e)) from None
    mfu = tps * fpt / (peak * 1e12)
    if mfu > 1.0:
        raise _Bad(f"throughput.tokens_per_s_per_gpu = {tps:g} means MFU {mfu:.3g} > 1 "
                   f"({tps * fpt / 1e12:,.0f} TFLOPS per GPU, the {cluster.gpu.name} {cfg.precision} "
                   f"peak is {peak:g})")
    expected = cfg.tokens_per_step / median_s / cluster.world_size
    if abs(tps / expected - 1.0) > TPS_TOLERANCE:
        raise _Bad(f"throughput.tokens_per_s_per_gpu = {tps:g} disagrees with steps.median_s = {median_s:g}: "
                   f"{cfg.tokens_per_step} tokens per step / {median_s:g} s / {cluster.world_size} GPUs = "
                   f"{expected:g} ({tps / expected - 1:+.1%}, tolerance {TPS_TOLERANCE:.0%})")


def parse_record(rec: Any, source: str = "?") -> Record | str:
    """A Record for a usable ok-record, the status (str) of a valid failed trial; raises _Bad."""
    if not isinstance(rec, dict):
        raise _Bad("not a JSON object")
    if rec.get("schema") != SCHEMA:
        raise _Bad(f"schema is {rec.get('schema')!r}, expected {SCHEMA!r}")
    status = _get(rec, "status", str)
    if status not in STATUSES:
        raise _Bad(f"unknown status {status!r}")
    if status != "ok":
        return status
    try:
        model = ModelSpec.from_dict(_get(rec, "model", dict))
    except (SpecError, TypeError, ValueError, AttributeError) as e:
        raise _Bad(f"model: {e}") from None
    layers = _get(rec, "layers", int, required=False)
    if layers is not None and layers != model.num_layers:
        raise _Bad(f"layers = {layers} but the model has {model.num_layers}")
    try:
        config = legacy_config(_get(rec, "config", dict), model, str(rec.get("stack") or "local"))
        if isinstance(rec.get("fp8_recipe"), str):
            # te records before the runner wrote the recipe into the config name it beside it; the
            # config's fp8_recipe then holds the default (delayed) whatever ran
            config = {**config, "fp8_recipe": rec["fp8_recipe"]}
        cfg = TrainConfig.from_dict(config)
    except (SpecError, TypeError, ValueError) as e:
        raise _Bad(f"config: {e}") from None
    cluster = cluster_of(rec)
    if cfg.world_size != cluster.world_size:
        raise _Bad(f"config uses {cfg.world_size} GPUs but the cluster has {cluster.world_size}")
    y = {
        "tokens_per_s_per_gpu": _number(rec, "throughput.tokens_per_s_per_gpu"),
        "memory_gib_per_gpu": _memory(rec, cluster),
        "mean_power_w": _number(rec, "telemetry.mean_power_w", required=False, hi=5000),
        "peak_power_w": _number(rec, "telemetry.peak_power_w", required=False, hi=5000),
        "throttle_fraction": _throttle(rec),
    }
    _check_throughput(rec, model, cluster, cfg, y["tokens_per_s_per_gpu"], _number(rec, "steps.median_s"))
    try:  # the analytical model must be able to evaluate the layout it will be compared with
        from advisor.models.predict import predict

        predict(model, cluster, cfg, check_legal=False)
    except (SpecError, ValueError, ZeroDivisionError) as e:
        raise _Bad(f"the analytical model cannot evaluate this layout: {e}") from None
    phases = rec.get("memory_phases") if isinstance(rec.get("memory_phases"), list) else []
    retries = max([int(p.get("num_alloc_retries") or 0) for p in phases if isinstance(p, dict)] or [0])
    return Record(id=str(rec.get("id", source)), source=source, model=model, cluster=cluster, cfg=cfg, y=y,
                  stack=str(rec.get("stack") or "local"), alloc_retries=retries)


def load(paths: Iterable[str | Path] = (), records: Iterable[tuple[str, dict]] = (),
         sources: Iterable[dict] = ()) -> Dataset:
    """Read and validate measurement JSONL files, and records read elsewhere ((source, record)
    pairs: the trials of `advisor tune` studies, `advisor.study.study_records`, with `sources`
    their entries for Dataset.files). A record read before (same id and the same measurement: a
    study's record is also appended to its JSONL) is counted once."""
    ds = Dataset()
    paths, records, sources = list(paths), list(records), list(sources)
    if not paths and not records and not sources:
        raise DatasetError("no measurement file given (--data FILE.jsonl or --study JOURNAL_OR_URL)")
    seen: set[str] = set()

    def add(source: str, line: str | None, rec: Any = None) -> None:
        try:
            if line is not None:
                try:
                    rec = json.loads(line)
                except json.JSONDecodeError as e:
                    raise _Bad(f"not JSON ({e.msg})") from None
            key = _identity(rec)
            if key is not None and key in seen:
                ds.duplicates += 1
                return
            out = parse_record(rec, source)
        except _Bad as e:
            rid = rec.get("id") if isinstance(rec, dict) else None
            ds.rejected.append(f"{source}: rejected{f' ({rid})' if rid else ''}: {e}")
            return
        if key is not None:
            seen.add(key)
        if isinstance(out, str):
            ds.skipped[out] += 1
        else:
            ds.records.append(out)

    for path in paths:
        p = Path(path)
        if not p.is_file():
            raise DatasetError(f"{p}: no such file")
        raw = p.read_bytes()
        lines = raw.decode("utf-8", errors="replace").splitlines()
        ds.files.append({"path": str(p), "sha256": hashlib.sha256(raw).hexdigest(),
                         "lines": sum(1 for s in lines if s.strip())})
        for n, line in enumerate(lines, 1):
            if line.strip():
                add(f"{p.name}:{n}", line)
    ds.files.extend(sources)
    for source, rec in records:
        add(source, None, rec)
    return ds


# keys the tune driver adds to a record when it files it under a trial (advisor.study)
ANNOTATIONS = ("study", "trial", "runner", "simulated")


def _identity(rec: Any) -> str | None:
    """Two copies of one measurement (a study's trial and the tune JSONL, say) have the same id
    and the same content up to the driver's annotations."""
    if not isinstance(rec, dict) or rec.get("id") is None:
        return None
    body = {k: v for k, v in rec.items() if k not in ANNOTATIONS}
    return hashlib.sha1(json.dumps(body, sort_keys=True, default=str).encode()).hexdigest()




def records_to_jsonl(records: Iterable[dict]) -> str:
    return "".join(json.dumps(r) + "\n" for r in records)


# ------------------------------------------------------------------------------------------------
# simulated records (tests, and the labelled simulated grid of bench/fit_accuracy.py)
# ------------------------------------------------------------------------------------------------

def simulate_records(cases: Iterable[tuple[ModelSpec, ClusterSpec, TrainConfig]], constants,
                     noise: float = 0.02, seed: int = 0) -> list[dict]:
    """Measurement records as the analytical model under `constants` predicts them, with
    multiplicative log-normal noise of relative size `noise`. Marked env.simulated = true; never
    for shipping."""
    from advisor.models.predict import predict

    rng = np.random.default_rng(seed)
    out = []
    for i, (model, cluster, cfg) in enumerate(cases):
        p = predict(model, cluster, cfg, constants, check_legal=False)

        def noisy(v: float) -> float:
            return float(v * math.exp(rng.normal(0.0, noise)))

        tps = noisy(p.tokens_per_s_per_gpu)
        step = cfg.tokens_per_step / (tps * cluster.world_size)
        peak = noisy(p.peak_power_w)
        mean = min(noisy(p.mean_power_w), peak)
        mem = noisy(p.memory_gib_per_gpu)
        out.append({
            "schema": SCHEMA, "id": f"sim-{seed}-{i}", "status": "ok", "model_name": model.name,
            "model": model.to_dict(), "layers": model.num_layers, "config": cfg.to_dict(),
            "cluster": {"gpu": cluster.gpu.name.lower(), "num_nodes": cluster.num_nodes,
                        "gpus_per_node": cluster.gpus_per_node, "power_cap_w": cluster.power_cap_w},
            "env": {"simulated": True},
            "steps": {"median_s": step, "p10_s": step * 0.99, "p90_s": step * 1.01},
            "throughput": {"tokens_per_s": tps * cluster.world_size, "tokens_per_s_per_gpu": tps,
                           "tflops_per_gpu": p.tflops_per_gpu, "mfu": p.mfu},
            "memory": {"max_gib": mem, "max_reserved_gib": mem},
            "telemetry": {"mean_power_w": mean, "peak_power_w": peak,
                          "throttle_fraction": {"any_throttle": float(np.clip(
                              p.throttle_fraction + rng.normal(0.0, noise), 0.0, 1.0))}},
        })
    return out


def simulated_cases(model_names: Sequence[str] = ("llama3-8b", "qwen3-30b-a3b", "nemotron4-15b", "gpt3-175b",
                                                  "mixtral-8x7b"),
                    clusters: Sequence[str] = ("h200x4",), layers: int = 4, seq: int = 2048, gbs: int = 16,
                    per_model: int = 24, seed: int = 0) -> list[tuple[ModelSpec, ClusterSpec, TrainConfig]]:
    """Up to `per_model` legal layouts per model proxy (`layers` layers) and cluster that fit in
    memory under the default constants, sampled with a fixed seed."""
    from advisor.catalog import load_cluster, load_model
    from advisor.models.memory import peak_memory_gib
    from advisor.search_spaces.space import SpaceOptions, Workload, enumerate_layouts

    rng = np.random.default_rng(seed)
    out = []
    for name in model_names:
        for cl in clusters:
            model, cluster = load_model(name).with_layers(layers), load_cluster(cl)
            opts = SpaceOptions(max_cp=1, uneven_pipeline=False)
            fits = [cfg for cfg in enumerate_layouts(model, cluster, Workload(seq=seq, gbs=gbs), opts)
                    if peak_memory_gib(model, cfg, gpu=cluster.gpu) < 0.9 * cluster.gpu.memory_gib]
            for i in rng.permutation(len(fits))[:per_model]:
                out.append((model, cluster, fits[i]))
    return out
