"""The MoE model's GPU work against the kernel profiles (issue #24): for every kernel-profiled TE MoE
run of data/measurements/h100x4-te.jsonl and h200x1-te.jsonl (the gpt-oss proxy, session 34), the
GPU time of its non-NCCL kernels per step (under the profiler) against the model's compute (gemm_s +
attention_s + memory_bound_s of the te profile on our VM, the run's own router skew), with the
shipped constants and with the expert-width penalty off (moe_gemm_half_ffn = 0), and the step's
tokens/s error both ways; then, per run, the GEMM kernels against gemm_s and the memory-bound
kernels (elementwise, permute / index, norms, RoPE, loss, activation, copies) against
memory_bound_s, shipped constants.

    python bench/moe_kernels.py [RUNS.jsonl ...]

The width penalty (models/moe.py expert_width_fraction) prices narrow experts' GEMMs slower and books
the difference as memory-bound time; if it were GPU time, the profiles' kernel time would hold it.
"""
from __future__ import annotations

import json
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "bench"))
from moe_check import run_constants, run_router_skews  # noqa: E402  (beside this file)

from advisor.models import profile_fit as F  # noqa: E402
from advisor.models.calibrate import resolve_calibration  # noqa: E402
from advisor.models.dataset import load  # noqa: E402
from advisor.models.predict import predict  # noqa: E402

RUNS = [ROOT / "data/measurements/h100x4-te.jsonl", ROOT / "data/measurements/h200x1-te.jsonl"]
# kernel categories (runners/kernel_probe.categorize) of memory-bound work
MEMORY_BOUND = ("elementwise/reduce", "index/permute/sort", "norm", "rope", "loss/softmax", "other",
                "memcpy/memset", "activation")
VARIANTS = {"shipped": {}, "no width penalty": {"moe_gemm_half_ffn": 0.0}}


def rows(paths: list[Path] | Path = RUNS) -> list[dict]:
    """Per kernel-profiled MoE run: its id, profiled non-NCCL kernel ms per step (all; GEMMs;
    memory-bound), and per variant the model's compute ms per step (all; gemm_s; memory_bound_s) and
    its tokens/s / measured - 1."""
    paths = [paths] if isinstance(paths, Path) else list(paths)
    raw = {}
    for path in paths:
        with open(path, encoding="utf-8") as f:
            for line in f:
                if line.strip():
                    r = json.loads(line)
                    raw[r["id"]] = r
    vm = F.on_vm(resolve_calibration("te")).constants
    skews = run_router_skews(paths, "te")
    out = []
    for rec in load([str(p) for p in paths]).records:
        kp = (raw.get(rec.id) or {}).get("kernel_profile") or {}
        if not rec.model.is_moe or "categories" not in kp:
            continue
        cats = kp["categories"]
        kernels = sum(v["ms"] for k, v in cats.items() if not k.startswith("nccl"))
        row = {"id": rec.id, "shape": rec.model.name.split("[")[0], "precision": rec.cfg.precision,
               "kernels_ms": kernels, "busy": kp["gpu"]["non_nccl_busy"],
               "gemm_kernels_ms": sum(v["ms"] for k, v in cats.items() if k.startswith("gemm")),
               "mem_kernels_ms": sum(cats.get(k, {}).get("ms", 0.0) for k in MEMORY_BOUND)}
        for name, kw in VARIANTS.items():
            c = run_constants({"rec": rec, "skew": skews.get(rec.id)}, vm.replace(**kw))
            p = predict(rec.model, rec.cluster, rec.cfg, c, check_legal=False)
            b = p.breakdown
            row[name] = {"compute_ms": 1e3 * (b["gemm_s"] + b["attention_s"] + b["memory_bound_s"]),
                         "gemm_ms": 1e3 * b["gemm_s"], "mem_ms": 1e3 * b["memory_bound_s"],
                         "error": p.tokens_per_s_per_gpu / rec.y["tokens_per_s_per_gpu"] - 1}
        out.append(row)
    return out


def main(argv=None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    paths = [Path(a) for a in argv] or RUNS
    for path in paths:
        if not path.is_file():
            print(f"error: no such file: {path}", file=sys.stderr)
            return 2
    rs = rows(paths)
    if not rs:
        print(f"error: no kernel-profiled MoE run in {', '.join(map(str, paths))}", file=sys.stderr)
        return 2
    names = list(VARIANTS)
    print(f"{'run':16} {'shape':24} {'prec':5} {'kernels ms':>10} " + " ".join(
        f"{n + ' compute':>24} {'tok/s err':>9}" for n in names))
    for r in rs:
        print(f"{r['id']:16} {r['shape']:24} {r['precision']:5} {r['kernels_ms']:10.0f} " + " ".join(
            f"{r[n]['compute_ms']:16.0f} ({r[n]['compute_ms'] / r['kernels_ms'] - 1:+4.0%}) {r[n]['error']:+9.1%}"
            for n in names))
    for n in names:
        c = [abs(r[n]["compute_ms"] / r["kernels_ms"] - 1) for r in rs]
        e = [abs(r[n]["error"]) for r in rs]
        print(f"{n}: model compute vs profiled kernels mean |error| {100 * sum(c) / len(c):.1f}%, "
              f"tokens/s MAPE {100 * sum(e) / len(e):.1f}% over {len(rs)} runs")
    n = names[0]
    print(f"\nper kind of kernel, {n} constants (ms per step; model / kernels - 1)")
    print(f"{'run':16} {'shape':24} {'prec':5} {'busy':>5} {'GEMM kernels':>12} {'gemm_s':>14} "
          f"{'mem-bound kernels':>17} {'memory_bound_s':>15}")
    for r in rs:
        m = r[n]
        print(f"{r['id']:16} {r['shape']:24} {r['precision']:5} {r['busy']:5.2f} {r['gemm_kernels_ms']:12.0f} "
              f"{m['gemm_ms']:7.0f} ({m['gemm_ms'] / r['gemm_kernels_ms'] - 1:+4.0%}) {r['mem_kernels_ms']:17.0f} "
              f"{m['mem_ms']:8.0f} ({m['mem_ms'] / r['mem_kernels_ms'] - 1:+4.0%})")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
