"""Fit the `te` stack's Blackwell profile on the published Blackwell rows and write it to
models/data/te_blackwell_calibration.joblib (+ .json); the H100 profile (te_calibration.*) is not
touched: `advisor` answers for a Blackwell GPU (catalog generation "blackwell") with this one.

    python bench/fit_blackwell.py            # fit, cross-validate, write the profile
    python bench/fit_blackwell.py --dry-run  # fit and print, write nothing
    python bench/fit_blackwell.py --rows GB300,GB200   # the shipped profile, per row: predicted vs
                                             # measured, the step's terms (% of the step), the clock
    python bench/fit_blackwell.py --clock-check  # an 8192^3 GEMM under B300's limit vs gemm_clock_share
    python bench/fit_blackwell.py --pairs    # GB300 / GB200 on the same model, format and GPU count:
                                             # measured vs the shipped profile at three V-f slopes
    python bench/fit_blackwell.py --dry-run --fit-vf-slope   # also fit the V-f slope (vf_slope)
    python bench/fit_blackwell.py --dry-run --gb200-cap 1100  # GB200's limiter holding 1,100 W (its
                                             # 1,050 W span kept): the budget candidate of bench/blackwell_terms.py

Rows: the usable dense pretraining rows of data/published/published_fit.csv on B200, GB200, B300
and GB300 (FP8 delayed / current scaling, MXFP8, NVFP4; no MoE, as the H100 profile). Start and
priors: the H100 profile's fitted constants (same kernels, same TE), the NVFP4 GEMM fraction from
the measured B200 FP4 GEMM (FP4_GEMM_PRIOR). Reported out of sample: leave one GPU out, one model out, one family out, per GPU and
per format, and the profile's domain (what it was fitted on, with its error there).
"""
from __future__ import annotations

import dataclasses
import sys
from collections import defaultdict
from functools import partial
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
sys.path.insert(0, str(Path(__file__).resolve().parent))

from advisor.models import profile_fit as F  # noqa: E402
from advisor.models import published as P  # noqa: E402
from advisor.models.calibrate import LEVEL, Calibration, resolve_calibration  # noqa: E402
from advisor.models.profiles import STACKS  # noqa: E402

GPUS = ("B200", "GB200", "B300", "GB300")
NAMES = ("gemm_efficiency_max_fp8", "gemm_efficiency_max_fp4", "attention_efficiency",
         "elementwise_hidden_passes", "tp_overlap_fraction", "pp_overlap_fraction", "layer_overhead_s",
         "gemm_clock_share")
# gemm_clock_share: the share of a GEMM's (and attention's) time at the maximum clock that runs at
# the SM clock (models/dvfs.py), physically 0.1 (memory-bound) .. 1 (all of it on the tensor cores,
# which run at the SM clock). GB200 and GB300 are the same silicon at the same dense BF16 / FP8 rates
# (catalog/data/gpus) under a 1,200 vs 1,400 W limit: the published rows' GB300 / GB200 ratio at one
# layout and container is the clock's effect, and it pins this share.
# vf_slope (only with --fit-vf-slope; the shipped profile keeps the H100's 0.331): the slope of the
# linear V-f curve (models/dvfs.py: voltage / voltage at the maximum clock = 1 - vf_slope x (1 - f / f_max),
# above the floor vf_min_voltage), which sets how convex power is in the clock (P_dyn ~ f V^2) and so
# what clock a power limit buys near the maximum one; range that of the H100 sweep fit (bench/dvfs_fit.py).
# Freed, the Blackwell rows drive it to its floor 0.05 (voltage all but constant over the clock range, P
# linear in f: not what a DVFS part does), and leaving a family out gets no better (docs/calibration.md).
BOUNDS = {**F.TE_FIT, "gemm_efficiency_max_fp4": (0.30, 0.85), "gemm_clock_share": (0.1, 1.0),
          "vf_slope": (0.05, 1.5)}


# The NVFP4 GEMM fraction before its shape factor, measured on B200 (the K=64 FP4 rate, 4 x BF16,
# which is also the rate TE's NVFP4 GEMMs issue at on Blackwell Ultra: Constants.nvfp4_gemm_rate_bf16)
# against its peak at the maximum clock, 9,530 TFLOP/s (catalog/data/gpus/b200.yaml): cuBLASLt (what
# TE's NVFP4 GEMMs call) runs an 8192^3 NVFP4 GEMM (torch._scaled_mm) at 5,370 TFLOP/s (pytorch/ao
# PR 2427, benchmarks/float8/bench_matmul.py --recipe nvfp4) and an MXF4 one at 5,239, DeepGEMM's
# kernel at 5,702 (deepseek-ai/DeepGEMM PR 348, CUDA 12.9, cublasTest 13.3): 0.55-0.56 / 0.60, over
# the shape factor (8192 / (8192 + gemm_half_dim_fp4))^3 = 0.87: 0.63-0.65 / 0.69. Centre cuBLAS's;
# the spread covers DeepGEMM's and the clock the GEMM held (not reported). (Until blackwell6 the
# centre was 0.67: the same GEMMs over the datasheet's 9,000, the peak before the max-clock rates.)
FP4_GEMM_PRIOR = (0.64, 0.06)

# The clock-scaled share of GEMM time: centred on the H100's (models/constants.py: 8192^3 BF16
# throughput ~ clock^0.5, 0.415), wide: not measured on Blackwell. Public B300 cuBLAS 8192^3 runs
# (a GitHub B300 characterisation, "B300 TRUE REFERENCE", CUDA 13, 1,100 W limit) bracket it: random
# data, which draws more power than zero data and so is held to a lower clock, runs 0.838 (BF16:
# 1,883 / 2,246 TFLOP/s) and 0.907 (FP8: 3,984 / 4,393) of the zero-data rate; under the 1,100 W limit
# models/dvfs.py gives 0.854 / 0.856 at share 1 and 0.900 / 0.901 at 0.415 (python bench/fit_blackwell.py --clock-check)
CLOCK_SHARE_PRIOR = (0.415, 0.3)

# The V-f slope with --fit-vf-slope: centred on the H100's fitted 0.331 (models/constants.py; TSMC 4N
# there, 4NP on Blackwell), wide: 0.2 lets the rows move it from near-constant voltage (0.1) to V at
# 0.65 of the maximum at half clock (0.7).
VF_SLOPE_PRIOR = (0.331, 0.2)


# What the Blackwell GPUs do differently from the H100 where it is not fitted: settings of the
# profile, each with its source (models/constants.py). None today: the one difference this held, the
# single quantized copy of a per-tensor-scaled FP8 operand (Blackwell's FP8 GEMMs take either
# layout, so TE makes no transpose), is a property of the GPU under every profile
# (catalog GPUSpec.fp8_transposed_copy, models/quant.py copies), not a profile setting.
BLACKWELL_SETTINGS: dict[str, float] = {}


def priors(h100) -> dict[str, tuple[float, float]]:
    """The H100 fit's values as centres (the TE stack's physics carries over), the H100 prior's
    spreads; the NVFP4 GEMM fraction from the measured B200 FP4 GEMM (FP4_GEMM_PRIOR)."""
    out = {n: (getattr(h100, n), F.TE_PRIOR[n][1]) for n in NAMES if n in F.TE_PRIOR}
    out["gemm_efficiency_max_fp4"] = FP4_GEMM_PRIOR
    out["gemm_clock_share"] = CLOCK_SHARE_PRIOR
    out["vf_slope"] = VF_SLOPE_PRIOR
    return out


def in_fit(r: P.PublishedRun) -> bool:
    return r.gpu_type in GPUS and not r.moe


def grouped(rows, e, key) -> dict[str, dict]:
    g = defaultdict(list)
    for i, x in enumerate(rows):
        g[key(x)].append(i)
    return {k: F.summary(e[idx], [rows[i].weight for i in idx]) for k, idx in sorted(g.items())}


def change_gpus(rows, gpu_changes: dict[str, dict]) -> None:
    """In place: each row of a GPU named in `gpu_changes` runs on its cluster with those changes
    (blackwell_terms.with_gpu: GPUSpec fields, power_cap_w the cluster's cap)."""
    from blackwell_terms import with_gpu

    for x in rows:
        if x.run.gpu_type in gpu_changes:
            x.run = dataclasses.replace(x.run, cluster=with_gpu(x.run.cluster, **gpu_changes[x.run.gpu_type]))


def build(say=print, max_nfev: int = 40, names: tuple[str, ...] = NAMES,
          gpu_changes: dict[str, dict] | None = None) -> Calibration:
    """`gpu_changes` (an experiment, never the shipped profile): {GPU name: changes to its rows'
    GPU catalog entry, as blackwell_terms.with_gpu takes them}, e.g. GB200's power budget."""
    h100 = resolve_calibration("te")
    base, pri = h100.constants.replace(**BLACKWELL_SETTINGS), priors(h100.constants)
    rows, left = F.fit_rows(P.load(), "te", in_fit)
    if gpu_changes:
        change_gpus(rows, gpu_changes)
        say(f"  GPU entries changed (experiment): {gpu_changes}")
    kw = dict(names=names, bounds=BOUNDS, priors=pri, max_nfev=max_nfev)
    say(f"fitting te/blackwell on {len(rows)} published rows ({', '.join(GPUS)}, dense)")
    c, info = F.fit(rows, base, **kw)
    say("  fitted: " + ", ".join(f"{k}={v:.4g}" for k, v in info["fitted"].items()))
    e_in = F.log_errors(rows, c)
    cv = {"scheme": "leave one GPU / model / family out", "level": LEVEL,
          "in_sample": F.summary(e_in, [x.weight for x in rows])}
    say(f"  in sample: MAPE {cv['in_sample']['mape']:.1f}%")
    oof_all = {}
    for name, by in (("leave_one_gpu_out", lambda x: x.run.gpu_type), ("leave_one_model_out", lambda x: x.run.model_key),
                     ("leave_one_family_out", lambda x: x.run.family)):
        oof, per = F.cross_validate(rows, base, by, **kw)
        s = F.summary(oof, [x.weight for x in rows])
        cv[name] = {"overall": s, "groups": per,
                    "by_gpu_precision": grouped(rows, oof, lambda x: f"{x.run.gpu_type} {x.cfg.quant}")}
        oof_all[name] = oof
        say(f"  {name}: MAPE {s['mape']:.1f}%, bias {s['bias']:+.1f}%")
        for k, v in cv[name]["by_gpu_precision"].items():
            say(f"    {k:24} n={v['n']:3} MAPE {v['mape']:5.1f}%  bias {v['bias']:+5.1f}%")
    r = oof_all["leave_one_model_out"]
    r = r[np.isfinite(r)]
    q = float(np.quantile(np.abs(r), LEVEL))
    targets = {"tokens_per_s_per_gpu": {
        "mode": "calibrated", "kind": "log_ratio",
        "interval": {"type": "quantiles", "lo": -q, "hi": q, "n_cv": int(r.size),
                     "construction": "symmetric: +-80% quantile of |leave-one-model-out residual|"}}}
    for t, spec in h100.targets.items():
        if t != "tokens_per_s_per_gpu":
            targets[t] = spec
    domain = {
        "gpus": sorted({x.run.gpu_type for x in rows}),
        "precisions": sorted({x.cfg.quant for x in rows}),
        "families": sorted({x.run.family for x in rows}),
        "models": sorted({x.run.model_key for x in rows}),
        "gpu_counts": [min(x.run.num_gpus for x in rows), max(x.run.num_gpus for x in rows)],
        "software": sorted({x.run.raw.get("source_version", "") for x in rows} - {""}),
        "dense_only": True,
        "checked": [{"gpu": x.run.gpu_type, "precision": x.cfg.quant, "model": x.run.model_key,
                     "gpus": x.run.num_gpus, "error_pct": float((np.exp(e) - 1) * 100)}
                    for x, e in zip(rows, oof_all["leave_one_model_out"])],
    }
    trained_on = {"n_rows": len(rows), "left_out": dict(left), "gpus": list(GPUS), "domain": domain,
                  "sources": sorted({x.run.source_group for x in rows})}
    return Calibration(constants=c, targets=targets, surrogates={}, trained_on=trained_on, cv=cv,
                       fit_info=info, profile="te-blackwell", fitted_bounds=dict(BOUNDS), base_constants=base)


TERMS = ("gemm_s", "attention_s", "memory_bound_s", "fp8_cast_s", "tp_comm_s", "cp_comm_s", "pp_p2p_s",
         "dp_comm_exposed_s", "pipeline_bubble_s", "layer_overhead_s", "optimizer_s", "step_overhead_s")


def print_rows(gpus: set[str], say=print) -> None:
    """Each fit row of `gpus` under the shipped profile: measured and predicted tokens/s per GPU,
    the error, the clock ratio the power limit holds, and each term of the step in % of the step
    (the terms overlap: GEMM + attention + memory-bound + communication can exceed 100)."""
    cal = resolve_calibration("te", gpu=type("G", (), {"generation": "blackwell"})())
    rows, _ = F.fit_rows(P.load(), "te", lambda r: r.gpu_type in gpus and not r.moe)
    say("gpu   family   model            format         gpus layout                         "
        "measured predicted  error  clock | " + " ".join(t[:-2] for t in TERMS))
    for x, p in sorted(zip(rows, F.predict_rows(rows, cal.constants)),
                       key=lambda t: (t[0].run.gpu_type, t[0].run.family, t[0].run.model_key, t[0].cfg.quant)):
        g, b = x.cfg, p.breakdown
        lay = f"t{g.tp}p{g.pp}c{g.cp}v{g.vp}d{g.dp} m{g.mbs} g{g.gbs} s{g.seq}"
        say(f"{x.run.gpu_type:5} {x.run.family:8} {x.run.model_key:16} {g.quant:14} {x.run.num_gpus:4} {lay:30} "
            f"{x.y:8.0f} {p.tokens_per_s_per_gpu:9.0f} {(p.tokens_per_s_per_gpu / x.y - 1) * 100:+6.1f}% "
            f"{p.clock_ratio:.3f} | " + " ".join(f"{b.get(t, 0.0) / p.step_time_s * 100:.1f}" for t in TERMS))


def clock_check(say=print) -> None:
    """An 8192^3 GEMM (utilisation 1) alone on a B300 under its 1,100 W limit: the clock the DVFS
    model holds and the throughput over the maximum clock's, at several gemm_clock_share (the
    public B300 measurement in CLOCK_SHARE_PRIOR's comment: 0.838 BF16, 0.907 FP8)."""
    from advisor.catalog.loaders import load_gpu
    from advisor.models import dvfs as D

    gpu = load_gpu("b300")
    for share in (0.415, 0.7, 1.0):
        c = resolve_calibration("te").constants.replace(gemm_clock_share=share)
        for fp8 in (False, True):
            s = D.solve_clock([D.Phase("gemm", 1.0, 1.0, fp8)], [], gpu, gpu.max_power_limit_w, c)
            say(f"gemm_clock_share {share:.3f} {'FP8 ' if fp8 else 'BF16'}: clock {s.x:.3f}, "
                f"throughput {1.0 / D.compute_stretch(s.x, c):.3f} of the maximum clock's")


def pair_ratios(slopes=(0.05, 0.331, 1.0), say=print) -> dict:
    """GB300 / GB200 tokens/s per GPU on the fit rows of one model, format and GPU count (every
    GB200 row against every GB300 row: layouts and containers may differ): measured, and the
    shipped profile's with the V-f slope at each of `slopes`, with the clock ratios it holds
    (median over the pairs). Returns {(model, format, gpus): {"measured": m, slope: (ratio, x200, x300)}}."""
    cal = resolve_calibration("te", gpu=type("G", (), {"generation": "blackwell"})())
    rows, _ = F.fit_rows(P.load(), "te", lambda r: r.gpu_type in ("GB200", "GB300") and not r.moe)
    groups = defaultdict(lambda: {"GB200": [], "GB300": []})
    for i, x in enumerate(rows):
        groups[(x.run.model_key, x.cfg.quant, x.run.num_gpus)][x.run.gpu_type].append(i)
    pairs = {k: [(a, b) for a in v["GB200"] for b in v["GB300"]] for k, v in groups.items()}
    pairs = {k: v for k, v in sorted(pairs.items()) if v}
    out = {k: {"measured": float(np.median([rows[b].y / rows[a].y for a, b in v]))} for k, v in pairs.items()}
    for k in slopes:
        pred = F.predict_rows(rows, cal.constants.replace(vf_slope=float(k)))
        for g, v in pairs.items():
            out[g][k] = tuple(float(np.median(q)) for q in zip(*[
                (pred[b].tokens_per_s_per_gpu / pred[a].tokens_per_s_per_gpu, pred[a].clock_ratio, pred[b].clock_ratio)
                for a, b in v]))
    say("model            format          gpus pairs measured | model ratio (clock GB200 / GB300) at vf_slope "
        + ", ".join(f"{k:.3f}" for k in slopes))
    for g, v in out.items():
        say(f"{g[0]:16} {g[1]:15} {g[2]:4} {len(pairs[g]):5} {v['measured']:8.3f} | " + " | ".join(
            f"{v[k][0]:.3f} ({v[k][1]:.3f} / {v[k][2]:.3f})" for k in slopes))
    return out


def main(argv=None) -> int:
    import argparse

    from fit_profiles import main as fit_main

    ap = argparse.ArgumentParser(add_help=False)
    ap.add_argument("--rows")
    ap.add_argument("--clock-check", action="store_true")
    ap.add_argument("--pairs", action="store_true")
    ap.add_argument("--fit-vf-slope", action="store_true")
    ap.add_argument("--gb200-cap", type=float)
    a, rest = ap.parse_known_args(argv)
    if a.rows:
        print_rows({g.strip().upper() for g in a.rows.split(",")})
        return 0
    if a.clock_check:
        clock_check()
        return 0
    if a.pairs:
        pair_ratios()
        return 0
    fit = partial(build, names=NAMES + ("vf_slope",)) if a.fit_vf_slope else build
    if a.gb200_cap:
        from advisor.catalog.loaders import load_gpu

        fit = partial(fit, gpu_changes={"GB200": {"dynamic_power_w": load_gpu("gb200").power_span_w,
                                                  "power_cap_w": a.gb200_cap}})
    return fit_main(rest, fit, STACKS["te"].generations["blackwell"], __doc__)


if __name__ == "__main__":
    raise SystemExit(main())
