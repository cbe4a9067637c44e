"""Fit the shipped `te` stack profile on the published runs and write it to
models/data/te_calibration.joblib (+ .json beside it, readable).

    python bench/fit_profiles.py            # fit, cross-validate, write the profile
    python bench/fit_profiles.py --dry-run  # fit and print, write nothing

Rows: the usable pretraining rows of data/published/published_fit.csv on H100 (Megatron-Core /
NeMo / Megatron-Bridge with Transformer Engine). Left out of the fit and reported as out-of-sample
checks: Blackwell rows (other chips, same physics), the A100 rows (Megatron-LM of 2021, FP16, no
Transformer Engine: not this stack) and NeMo 24.03's long-sequence table (its attention ran at
FlashAttention-2 rates: with the te constants its error grows with the sequence, +3% at 4K, +7% at
8K, +18% at 16K without CP, +41% at 1M, as the attention share grows; today's TE attention is
cuDNN's, measured on our H100 at 0.49-0.51 of peak at 8K against 0.28-0.29 for FlashAttention-2). Each distinct configuration weighs the same. The tokens/s interval is the
80% quantile of |leave-one-source-out residual| (split conformal, as `advisor fit` builds its
calibrated level's); memory and power have no published measurements, so their intervals are the
`local` profile's (measured on this project's GPUs), and say so.
"""
from __future__ import annotations

import argparse
import hashlib
import sys
import time
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from advisor.models import profile_fit as F  # noqa: E402
from advisor.models import published as P  # noqa: E402
from advisor.models.calibrate import LEVEL, Calibration, resolve_calibration  # noqa: E402
from advisor.models.profiles import STACKS  # noqa: E402

FIT_GPUS = ("H100",)
CHECK_GPUS = ("A100-80GB", "B200", "GB200", "B300", "GB300")


OLD_ATTENTION = ("nemo_long_sequence_cp",)  # sources whose attention kernels predate TE's cuDNN ones


def in_fit(r: P.PublishedRun) -> bool:
    return r.gpu_type in FIT_GPUS and not r.moe and r.source_group not in OLD_ATTENTION


def _sha(path: Path) -> str:
    return hashlib.sha256(path.read_bytes()).hexdigest()


def borrowed_interval(spec: dict) -> dict:
    """A local-profile interval as a quantile interval of the calibrated level."""
    iv = dict(spec["interval"])
    if iv.get("type") == "gp_sd":  # +- k sd_floor: the surrogate's band away from its training rows
        half = iv["k"] * iv.get("sd_floor", 0.0)
        iv = {"type": "quantiles", "lo": -half, "hi": half}
    iv["note"] = "from the local profile (this project's measured GPUs): no published measurements of it"
    return iv


def build(say=print) -> Calibration:
    runs = P.load()
    rows, left = F.fit_rows(runs, "te", in_fit)
    base = F.te_base()
    t0 = time.time()
    say(f"fitting te on {len(rows)} published rows ({', '.join(FIT_GPUS)}, dense)")
    c, info = F.fit(rows, base)
    say(f"  fitted in {time.time() - t0:.0f} s: " + ", ".join(f"{k}={v:.4g}" for k, v in info["fitted"].items()))
    in_sample = F.summary(F.log_errors(rows, c), [x.weight for x in rows])
    say(f"  in sample: MAPE {in_sample['mape']:.1f}%, bias {in_sample['bias']:+.1f}%")
    cv = {"scheme": "leave one source out / leave one model family out", "level": LEVEL, "in_sample": in_sample}
    oof_source = None
    for name, by in (("leave_one_source_out", lambda x: x.run.source_group),
                     ("leave_one_family_out", lambda x: x.run.family)):
        oof, per = F.cross_validate(rows, base, by)
        s = F.summary(oof, [x.weight for x in rows])
        cv[name] = {"overall": s, "groups": per}
        say(f"  {name.replace('_', ' ')}: MAPE {s['mape']:.1f}%, bias {s['bias']:+.1f}%")
        if oof_source is None:
            oof_source = oof
    check = {}
    for g in CHECK_GPUS:
        rr, _ = F.fit_rows(runs, "te", lambda r, g=g: r.gpu_type == g and not r.moe)
        if rr:
            check[g] = F.summary(F.log_errors(rr, c), [x.weight for x in rr])
            say(f"  out of sample on {g} (not fitted): MAPE {check[g]['mape']:.1f}% over {check[g]['n']} rows")
    rr, _ = F.fit_rows(runs, "te", lambda r: r.gpu_type in FIT_GPUS and not r.moe and r.source_group in OLD_ATTENTION)
    if rr:
        check["H100 NeMo 24.03 long-sequence (FlashAttention-2 era)"] = s = F.summary(
            F.log_errors(rr, c), [x.weight for x in rr])
        say(f"  out of sample, NeMo 24.03 long-sequence CP table (not fitted): MAPE {s['mape']:.1f}%, "
            f"bias {s['bias']:+.1f}% over {s['n']} rows")
    cv["blackwell_out_of_sample"] = check  # and the other out-of-sample checks
    r = oof_source[np.isfinite(oof_source)]
    q = float(np.quantile(np.abs(r), LEVEL))
    local = resolve_calibration("local")
    targets = {"tokens_per_s_per_gpu": {
        "mode": "calibrated", "kind": "log_ratio",
        "interval": {"type": "quantiles", "lo": -q, "hi": q, "n_cv": int(r.size),
                     "construction": "symmetric: +-80% quantile of |leave-one-source-out residual|",
                     "coverage_cv": float(np.mean(np.abs(r) <= q))}}}
    for t, spec in local.targets.items():
        if t != "tokens_per_s_per_gpu":
            targets[t] = {"mode": "calibrated", "kind": spec["kind"], "interval": borrowed_interval(spec)}
    files = [P.FIT_FILE, P.ARCH_FILE]
    trained_on = {"n_rows": len(rows), "left_out": dict(left),
                  "files": [str(f.relative_to(P.ROOT)) for f in files],
                  "sha256": {str(f.relative_to(P.ROOT)): _sha(f) for f in files},
                  "gpus": list(FIT_GPUS), "sources": sorted({x.run.source_group for x in rows}),
                  "models": sorted({x.run.model_key for x in rows})}
    return Calibration(constants=c, targets=targets, surrogates={}, trained_on=trained_on, cv=cv,
                       fit_info=info, profile="te", fitted_bounds=dict(F.TE_FIT), base_constants=base)


def main(argv=None, build=build, out=STACKS["te"].file, doc=__doc__) -> int:
    """The command line of a profile fit (this one, bench/fit_blackwell.py's)."""
    ap = argparse.ArgumentParser(description=doc, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--dry-run", action="store_true")
    ap.add_argument("-o", "--out", default=str(out))
    a = ap.parse_args(argv)
    cal = build()
    if not a.dry_run:
        cal.save(a.out)
        print(f"wrote {a.out}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
