"""Fit the `te` stack's Blackwell profile on the published Blackwell rows and write it to
models/data/te_blackwell_calibration.joblib (+ .json); the H100 profile (te_calibration.*) is not
touched: `advisor` answers for a Blackwell GPU (catalog generation "blackwell") with this one.

    python bench/fit_blackwell.py            # fit, cross-validate, write the profile
    python bench/fit_blackwell.py --dry-run  # fit and print, write nothing

Rows: the usable dense pretraining rows of data/published/published_fit.csv on B200, GB200, B300
and GB300 (FP8 delayed / current scaling, MXFP8, NVFP4; no MoE, as the H100 profile). Start and
priors: the H100 profile's fitted constants (same kernels, same TE), the NVFP4 GEMM fraction from
the measured B200 FP4 GEMM (FP4_GEMM_PRIOR). Reported out of sample: leave one GPU out, one model out, one family out, per GPU and
per format, and the profile's domain (what it was fitted on, with its error there).
"""
from __future__ import annotations

import sys
from collections import defaultdict
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
         "elementwise_hidden_passes", "tp_overlap_fraction", "pp_overlap_fraction", "layer_overhead_s")
BOUNDS = {**F.TE_FIT, "gemm_efficiency_max_fp4": (0.30, 0.85)}


# The NVFP4 GEMM fraction before its shape factor, measured: cuBLASLt (what TE's NVFP4 GEMMs call)
# runs an 8192^3 FP4 (MXF4) GEMM at 5,239 TFLOP/s on B200, DeepGEMM's kernel at 5,702 (deepseek-ai/
# DeepGEMM PR 348, CUDA 12.9, cublasTest 13.3) of the 9,000 dense peak: 0.58 / 0.63, over the shape
# factor (8192 / (8192 + gemm_half_dim_fp4))^3 = 0.87: 0.67 / 0.73. Centre cuBLAS's; the spread
# covers DeepGEMM's and NVFP4's scale per 16 elements (MXF4: per 32)
FP4_GEMM_PRIOR = (0.67, 0.06)


def priors(h100) -> dict[str, tuple[float, float]]:
    """The H100 fit's values as centres (the TE stack's physics carries over), the H100 prior's
    spreads; the NVFP4 GEMM fraction from the measured B200 FP4 GEMM (FP4_GEMM_PRIOR)."""
    out = {n: (getattr(h100, n), F.TE_PRIOR[n][1]) for n in NAMES if n in F.TE_PRIOR}
    out["gemm_efficiency_max_fp4"] = FP4_GEMM_PRIOR
    return out


def in_fit(r: P.PublishedRun) -> bool:
    return r.gpu_type in GPUS and not r.moe


def grouped(rows, e, key) -> dict[str, dict]:
    g = defaultdict(list)
    for i, x in enumerate(rows):
        g[key(x)].append(i)
    return {k: F.summary(e[idx], [rows[i].weight for i in idx]) for k, idx in sorted(g.items())}


def build(say=print, max_nfev: int = 40) -> Calibration:
    h100 = resolve_calibration("te")
    base, pri = h100.constants, priors(h100.constants)
    rows, left = F.fit_rows(P.load(), "te", in_fit)
    kw = dict(names=NAMES, bounds=BOUNDS, priors=pri, max_nfev=max_nfev)
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


def main(argv=None) -> int:
    from fit_profiles import main as fit_main

    return fit_main(argv, build, STACKS["te"].generations["blackwell"], __doc__)


if __name__ == "__main__":
    raise SystemExit(main())
